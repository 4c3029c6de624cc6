/* Side-by-side A/B of builds of the fused step (kernels/csrc/decode_cpu.c) on SmolLM2-135M's shapes
 * (30 layers, hidden 576, 9/3 heads of 64, intermediate 1536, vocab 49152, tied head: 538 MB of
 * fp32 weights read per step), random weights, one thread, in one process: each library given is
 * dlopen'ed and their step_forward calls alternate (order reversed every repetition); prints the
 * best wall / thread-CPU ms per step and the weight bytes per CPU second. A ":huge" suffix gives
 * that library weights in 2 MiB-aligned buffers advised MADV_HUGEPAGE (as backend/model/loader.py
 * places them); without it, plain malloc (4 KiB pages). The first library's logits are the
 * reference: max |difference| printed per library (same weights: 0 expected, the per-row sums
 * are unchanged).
 *
 *   cc -O2 -march=native -I. -o /tmp/ab_fused_bw bench/csrc/ab_fused_bw.c -ldl
 *   mkdir -p /tmp/old && git archive REV kernels/csrc | tar -x -C /tmp/old
 *   cc -O3 -march=native -fopenmp -shared -fPIC -o /tmp/old.so /tmp/old/kernels/csrc/*.c -lm
 *   cc -O3 -march=native -fopenmp -shared -fPIC -o /tmp/new.so kernels/csrc/*.c -lm
 *   /tmp/ab_fused_bw M REPS CTX /tmp/old.so /tmp/new.so /tmp/old.so:huge /tmp/new.so:huge
 *
 * M decodes (1..64) at CTX tokens of context (<= 128). ``split`` as the 4th argument instead times
 * the first library's linear_f32 on each projection of every layer and the lm_head at M = 1
 * (huge-page weights), best of REPS, against its whole step: what the rest (norms, RoPE, attention)
 * costs. Model comes from this checkout's decode_cpu.h: the libraries compared must share its layout. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kernels/csrc/decode_cpu.h"      /* Model: this checkout's layout (build with -I.) */
typedef int (*step_fn)(const Model *, int64_t, int64_t, const int64_t *, const int64_t *, const int64_t *,
                       const int32_t *, const int32_t *, const int32_t *, int64_t, int64_t, const int64_t *,
                       float *, float *, int);
typedef void (*linear_fn)(const float *, int64_t, int64_t, const float *, const float *, int64_t, float *, int, int);

enum { L = 30, H = 576, Q = 576, KV = 192, I = 1536, V = 49152, BS = 16, BLOCKS = 64, MAXM = 64 };

static double now(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static float *rnd(size_t n, float sc, int huge) {
    float *p;
    if (huge) {
        const size_t A = 2 << 20, b = (n * 4 + A - 1) / A * A;
        p = aligned_alloc(A, b);
        madvise(p, b, MADV_HUGEPAGE);
    } else {
        p = malloc(n * 4);
    }
    for (size_t i = 0; i < n; i++) p[i] = sc * ((float)rand() / RAND_MAX - 0.5f);
    return p;
}

static Model make(int huge) {
    Model m = {.num_layers = L, .hidden = H, .num_heads = 9, .num_kv_heads = 3, .head_dim = 64, .inter = I,
               .vocab = V, .block_size = BS, .max_pos = 2048, .gemm_min_m = 1LL << 62, .eps = 1e-5f, .scale = 0.125f};
    srand(1);
    m.embed = m.lm_head = rnd((size_t)V * H, 0.1f, huge);
    m.norm = rnd(H, 1, 0);
    m.cos = rnd(2048 * 32, 1, 0);
    m.sin = rnd(2048 * 32, 1, 0);
#define ARR(f) m.f = calloc(L, sizeof(void *))
    ARR(ln1); ARR(qkv_w); ARR(qkv_b); ARR(o_w); ARR(o_b); ARR(ln2); ARR(gu_w); ARR(gu_b); ARR(down_w); ARR(down_b);
    ARR(k_cache); ARR(v_cache);
    for (int l = 0; l < L; l++) {
        m.ln1[l] = rnd(H, 1, 0); m.ln2[l] = rnd(H, 1, 0);
        m.qkv_w[l] = rnd((size_t)(Q + 2 * KV) * H, 0.05f, huge);
        m.o_w[l] = rnd((size_t)H * Q, 0.05f, huge);
        m.gu_w[l] = rnd((size_t)2 * I * H, 0.05f, huge);
        m.down_w[l] = rnd((size_t)H * I, 0.05f, huge);
        m.k_cache[l] = rnd((size_t)BLOCKS * BS * KV, 1, 0);
        m.v_cache[l] = rnd((size_t)BLOCKS * BS * KV, 1, 0);
    }
    return m;
}

int main(int argc, char **argv) {
    if (argc < 5) { fprintf(stderr, "usage: %s M REPS CTX LIB[:huge]... | M REPS CTX split LIB\n", argv[0]); return 2; }
    const int M = atoi(argv[1]), reps = atoi(argv[2]), ctx = atoi(argv[3]);
    const int split = !strcmp(argv[4], "split"), first = 4 + split, nl = argc - first;
    if (M < 1 || M > MAXM || ctx < 1 || ctx > 128 || nl < 1 || nl > 8) { fprintf(stderr, "bad arguments\n"); return 2; }
    step_fn f[8];
    linear_fn lin = NULL;
    int hg[8], made[2] = {0, 0};
    Model mm[2];
    for (int i = 0; i < nl; i++) {
        char p[1024];
        snprintf(p, sizeof p, "%s", argv[first + i]);
        char *c = strstr(p, ":huge");
        hg[i] = split || c != NULL;
        if (c) *c = 0;
        void *h = dlopen(p, RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        f[i] = (step_fn)dlsym(h, "step_forward");
        if (i == 0) lin = (linear_fn)dlsym(h, "linear_f32");
        if (!made[hg[i]]) { mm[hg[i]] = make(hg[i]); made[hg[i]] = 1; }
    }
    int64_t ids[MAXM], pos[MAXM], slots[MAXM], rows[MAXM];
    int32_t cu[MAXM + 1], lens[MAXM], tab[MAXM * 8];
    for (int i = 0; i < M; i++) {           /* sequence i: blocks i*8 .. i*8+7 (mod 64), last slot written */
        for (int j = 0; j < 8; j++) tab[i * 8 + j] = (i * 8 + j) % BLOCKS;
        ids[i] = (i * 7919) % V; pos[i] = ctx - 1; lens[i] = ctx; cu[i] = i; rows[i] = i;
        slots[i] = (int64_t)tab[i * 8 + (ctx - 1) / BS] * BS + (ctx - 1) % BS;
    }
    cu[M] = M;
    float *scratch = malloc(sizeof(float) * MAXM * 20000), *logits = malloc(sizeof(float) * M * V),
          *ref = malloc(sizeof(float) * M * V);
    if (f[0](&mm[hg[0]], M, M, ids, pos, slots, cu, lens, tab, 8, M, rows, scratch, ref, 1)) return 1;
    if (split) {
        if (!lin) { fprintf(stderr, "no linear_f32 in %s\n", argv[first]); return 1; }
        const Model *m = &mm[1];
        double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9};
        float *x = rnd(I, 1, 0), *y = malloc(sizeof(float) * V);
        for (int r = 0; r < reps; r++) {
            double t[5] = {0};
            for (int l = 0; l < L; l++) {
                const float *w[4] = {m->qkv_w[l], m->o_w[l], m->gu_w[l], m->down_w[l]};
                const int64_t k[4] = {H, Q, H, I}, n[4] = {Q + 2 * KV, H, 2 * I, H};
                for (int p = 0; p < 4; p++) {
                    const double c = now(CLOCK_THREAD_CPUTIME_ID);
                    lin(x, 1, k[p], w[p], NULL, n[p], y, 0, 1);
                    t[p] += now(CLOCK_THREAD_CPUTIME_ID) - c;
                }
            }
            double c = now(CLOCK_THREAD_CPUTIME_ID);
            lin(x, 1, H, m->lm_head, NULL, V, y, 0, 1);
            t[4] = now(CLOCK_THREAD_CPUTIME_ID) - c;
            for (int k = 0; k < 5; k++) if (t[k] < best[k]) best[k] = t[k];
        }
        double step = 1e9;
        for (int r = 0; r < reps; r++) {
            double c = now(CLOCK_THREAD_CPUTIME_ID);
            f[0](m, M, M, ids, pos, slots, cu, lens, tab, 8, M, rows, scratch, logits, 1);
            c = now(CLOCK_THREAD_CPUTIME_ID) - c;
            if (c < step) step = c;
        }
        const char *nm[5] = {"qkv x30", "o x30", "gate_up x30", "down x30", "lm_head"};
        const double mb[5] = {30.0 * (Q + 2 * KV) * H * 4, 30.0 * H * Q * 4, 30.0 * 2 * I * H * 4, 30.0 * H * I * 4,
                              (double)V * H * 4};
        double sum = 0;
        for (int k = 0; k < 5; k++) {
            sum += best[k];
            printf("%-12s %7.2f ms  %5.1f GB/s\n", nm[k], best[k] * 1e3, mb[k] / best[k] / 1e9);
        }
        printf("linears %.2f ms, whole step (M=%d, ctx %d) %.2f ms, rest %.2f ms\n", sum * 1e3, M, ctx, step * 1e3,
               (step - sum) * 1e3);
        return 0;
    }
    double bw[8], bc[8];
    for (int i = 0; i < nl; i++) bw[i] = bc[i] = 1e9;
    for (int r = 0; r <= reps; r++)
        for (int j = 0; j < nl; j++) {
            const int i = r % 2 ? j : nl - 1 - j;
            double t = now(CLOCK_MONOTONIC), c = now(CLOCK_THREAD_CPUTIME_ID);
            const int rc = f[i](&mm[hg[i]], M, M, ids, pos, slots, cu, lens, tab, 8, M, rows, scratch, logits, 1);
            t = now(CLOCK_MONOTONIC) - t;
            c = now(CLOCK_THREAD_CPUTIME_ID) - c;
            if (rc) { printf("step_forward returned %d\n", rc); return 1; }
            if (r == 0) {                   /* warm-up; compare logits with the first library's */
                double md = 0;
                for (long k = 0; k < (long)M * V; k++) {
                    const double d = logits[k] > ref[k] ? logits[k] - ref[k] : ref[k] - logits[k];
                    if (d > md) md = d;
                }
                printf("%s: max |logit - first's| %.3g%s\n", argv[first + i], md,
                       hg[i] != hg[0] ? " (other weights)" : "");
                continue;
            }
            if (t < bw[i]) bw[i] = t;
            if (c < bc[i]) bc[i] = c;
        }
    for (int i = 0; i < nl; i++)
        printf("M=%d ctx=%d %-36s best wall %7.2f ms  CPU %7.2f ms  %5.1f GB/s of weights\n", M, ctx, argv[first + i],
               bw[i] * 1e3, bc[i] * 1e3, 538.0e6 / bc[i] / 1e9);
    return 0;
}
