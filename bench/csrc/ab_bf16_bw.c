/* Side-by-side A/B of builds of the fused step (kernels/csrc/decode_cpu.c) on a bf16 SmolLM2-135M
 * (30 layers, hidden 576, 9/3 heads of 64, intermediate 1536, vocab 49152, tied head): random bf16
 * weights and their copies packed by the first library's bf16_pack (269 MB read per decode token,
 * all in 2 MiB-aligned MADV_HUGEPAGE buffers as the loader and backend/model/fused_decode.py place
 * them; the AVX2 kernels read the row-major weights below 4 rows, the others the packed), a bf16 KV
 * cache, NT threads (the libraries' own step pools), in one process: each library given is
 * dlopen'ed and their step_forward calls alternate (order reversed every repetition); prints the
 * best / 10th-percentile / median wall ms per step and the weight GB/s at best. The first library's
 * logits are the reference: max |difference| printed per library (0 expected for a change that
 * keeps every output's sum order).
 *
 *   cc -O2 -march=native -I. -o /tmp/ab_bf16_bw bench/csrc/ab_bf16_bw.c -ldl -lm -lpthread
 *   mkdir -p /tmp/old && git archive REV kernels/csrc | tar -x -C /tmp/old
 *   cc -O3 -march=native -fopenmp -shared -fPIC -o /tmp/old.so /tmp/old/kernels/csrc/*.c -lm
 *   cc -O3 -march=native -fopenmp -shared -fPIC -o /tmp/new.so kernels/csrc/*.c -lm
 *   /tmp/ab_bf16_bw M REPS CTX NT /tmp/old.so /tmp/new.so [avx2] [nice=-19]
 *
 * M decodes (1..64) at CTX tokens of context (<= 128). A trailing ``avx2`` pins the AVX2 kernels
 * (Model.bf16_avx2). LIB@T: that side on T threads instead of NT, LIB+avx2: on the AVX2 kernels (a library may be given twice). A trailing ``nice=N`` runs the steps on a second thread of nice N (the main
 * thread, whose nice the pool's workers take, stays at 0): the stack's engine thread at nice -19
 * (TRITON_LLM_ENGINE_NICE), so that other work on the host preempts a worker, not the caller. ``split`` instead of the libraries: times the first library's bf16 linears
 * alone (linear_bf16_with at M, NT threads) per projection over every layer and the lm_head, best
 * of REPS, against its whole step: what the rest (norms, RoPE, attention, the pool) costs. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "kernels/csrc/decode_cpu.h"      /* Model: this checkout's layout (build with -I.) */
typedef int (*step_fn)(const Model *, int64_t, int64_t, const int64_t *, const int64_t *, const int64_t *,
                       const int32_t *, const int32_t *, const int32_t *, int64_t, int64_t, const int64_t *,
                       float *, float *, int);
typedef int64_t (*elems_fn)(int64_t, int64_t);
typedef void (*pack_fn)(const uint16_t *, int64_t, int64_t, uint16_t *);
typedef int (*lin_fn)(const Model *, const float *, int64_t, int64_t, const uint16_t *, const uint16_t *,
                      const float *, int64_t, float *, int, int, int);

enum { L = 30, H = 576, Q = 576, KV = 192, I = 1536, V = 49152, BS = 16, BLOCKS = 64, MAXM = 64, MAXREPS = 4096 };

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

static void *huge(size_t bytes) {
    const size_t A = 2 << 20, b = (bytes + A - 1) / A * A;
    void *p = aligned_alloc(A, b);
    madvise(p, b, MADV_HUGEPAGE);
    return p;
}

static float *rndf(size_t n, float sc) {
    float *p = malloc(n * 4);
    for (size_t i = 0; i < n; i++) p[i] = sc * ((float)rand() / RAND_MAX - 0.5f);
    return p;
}

static uint16_t bf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }

static uint16_t *rndb(size_t n, float sc, int hp) {
    uint16_t *p = hp ? huge(n * 2) : malloc(n * 2);
    for (size_t i = 0; i < n; i++) p[i] = bf(sc * ((float)rand() / RAND_MAX - 0.5f));
    return p;
}

static elems_fn elems;
static pack_fn pack;

/* A random bf16 weight [N, K] (huge pages, as the loader's arena) and its packed copy. */
static QW weight(int64_t N, int64_t K, float sc) {
    uint16_t *w = rndb((size_t)(N * K), sc, 1), *p = huge((size_t)elems(N, K) * 2);
    pack(w, N, K, p);
    return (QW){.kind = Q_BF16, .w = w, .packed = p};
}

static Model make(int avx2) {
    Model m = {.num_layers = L, .hidden = H, .num_heads = 9, .num_kv_heads = 3, .head_dim = 64, .inter = I,
               .vocab = V, .block_size = BS, .max_pos = 2048, .gemm_min_m = 1LL << 62, .eps = 1e-5f, .scale = 0.125f,
               .kv_dtype = KV_BF16, .embed_dtype = KV_BF16, .bf16_avx2 = avx2, .bgemm_min_m = 1LL << 62};
    srand(1);
    m.embed = (const float *)rndb((size_t)V * H, 0.1f, 1);
    m.norm = rndf(H, 1);
    m.cos = rndf(2048 * 32, 1);
    m.sin = rndf(2048 * 32, 1);
#define ARR(f) m.f = calloc(L, sizeof(void *))
    ARR(ln1); ARR(qkv_w); ARR(qkv_b); ARR(o_w); ARR(o_b); ARR(ln2); ARR(gu_w); ARR(gu_b); ARR(down_w); ARR(down_b);
    ARR(k_cache); ARR(v_cache);
    QW *qw = calloc(L * P_COUNT, sizeof(QW)), *head = calloc(1, sizeof(QW));
    const int64_t n[P_COUNT] = {Q + 2 * KV, H, 2 * I, H}, k[P_COUNT] = {H, Q, H, I};
    for (int l = 0; l < L; l++) {
        m.ln1[l] = rndf(H, 1); m.ln2[l] = rndf(H, 1);
        for (int p = 0; p < P_COUNT; p++)
            qw[l * P_COUNT + p] = weight(n[p], k[p], 0.05f);
        m.k_cache[l] = rndb((size_t)BLOCKS * BS * KV, 1, 0);
        m.v_cache[l] = rndb((size_t)BLOCKS * BS * KV, 1, 0);
    }
    uint16_t *hp = huge((size_t)elems(V, H) * 2);
    pack((const uint16_t *)m.embed, V, H, hp);
    *head = (QW){.kind = Q_BF16, .w = m.embed, .packed = hp};
    m.qw = qw;
    m.head_q = head;
    return m;
}

static int cmp(const void *a, const void *b) { const double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

static int run(int argc, char **argv);
static int nice_argc, nice_rc, nice_val;
static char **nice_argv;

static void *nice_thread(void *p) {
    (void)p;
    if (setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice_val)) perror("setpriority");
    nice_rc = run(nice_argc, nice_argv);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strncmp(argv[argc - 1], "nice=", 5)) {
        nice_val = atoi(argv[argc - 1] + 5);
        nice_argc = argc - 1;
        nice_argv = argv;
        pthread_t t;
        pthread_create(&t, NULL, nice_thread, NULL);
        pthread_join(t, NULL);
        return nice_rc;
    }
    return run(argc, argv);
}

static int run(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "usage: %s M REPS CTX NT LIB... [avx2] | M REPS CTX NT split LIB\n", argv[0]); return 2; }
    const int M = atoi(argv[1]), reps = atoi(argv[2]), ctx = atoi(argv[3]), nt = atoi(argv[4]);
    const int avx2 = !strcmp(argv[argc - 1], "avx2"), split = !strcmp(argv[5], "split");
    const int first = 5 + split, nl = argc - first - avx2;
    if (M < 1 || M > MAXM || ctx < 1 || ctx > 128 || nl < 1 || nl > 8 || reps < 1 || reps > MAXREPS) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    step_fn f[8];
    lin_fn lin = NULL;
    int nts[8], side_avx2[8];
    for (int i = 0; i < nl; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s", argv[first + i]);
        char *plus = strstr(path, "+avx2");       /* LIB+avx2: this side on the AVX2 kernels */
        side_avx2[i] = plus != NULL;
        if (plus) *plus = 0;
        char *at = strchr(path, '@');             /* LIB@T: this side on T threads */
        nts[i] = at ? atoi(at + 1) : nt;
        if (at) *at = 0;
        void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) { fprintf(stderr, "%s\n", dlerror()); return 1; }
        f[i] = (step_fn)dlsym(h, "step_forward");
        if (i == 0) {
            elems = (elems_fn)dlsym(h, "bf16_packed_elems");
            pack = (pack_fn)dlsym(h, "bf16_pack");
            lin = (lin_fn)dlsym(h, "linear_bf16_with");
        }
    }
    if (!elems || !pack) { fprintf(stderr, "no bf16_pack in %s\n", argv[first]); return 1; }
    const Model mm = make(avx2);
    Model mside[8];
    for (int i = 0; i < nl; i++) { mside[i] = mm; mside[i].bf16_avx2 = avx2 || side_avx2[i]; }
    int64_t ids[MAXM], pos[MAXM], slots[MAXM], rows[MAXM];
    int32_t cu[MAXM + 1], lens[MAXM], tab[MAXM * 8];
    for (int i = 0; i < M; i++) {           /* sequence i: blocks i*8 .. i*8+7 (mod 64), last slot written */
        for (int j = 0; j < 8; j++) tab[i * 8 + j] = (i * 8 + j) % BLOCKS;
        ids[i] = (i * 7919) % V; pos[i] = ctx - 1; lens[i] = ctx; cu[i] = i; rows[i] = i;
        slots[i] = (int64_t)tab[i * 8 + (ctx - 1) / BS] * BS + (ctx - 1) % BS;
    }
    cu[M] = M;
    float *scratch = aligned_alloc(64, sizeof(float) * MAXM * 40000), *logits = malloc(sizeof(float) * M * V),
          *ref = malloc(sizeof(float) * M * V);
    if (f[0](&mm, M, M, ids, pos, slots, cu, lens, tab, 8, M, rows, scratch, ref, nt)) return 1;
    if (split) {
        if (!lin) { fprintf(stderr, "no linear_bf16_with in %s\n", argv[first]); return 1; }
        double best[5] = {1e9, 1e9, 1e9, 1e9, 1e9}, step = 1e9;
        float *x = rndf((size_t)M * I, 1), *y = malloc(sizeof(float) * M * V);
        const int64_t k[4] = {H, Q, H, I}, n[4] = {Q + 2 * KV, H, 2 * I, H};
        for (int r = 0; r < reps; r++) {
            double t[5] = {0};
            for (int l = 0; l < L; l++)
                for (int p = 0; p < 4; p++) {
                    const QW *q = &mm.qw[l * P_COUNT + p];
                    const double c = now();
                    lin(&mm, x, M, k[p], q->w, q->packed, NULL, n[p], y, 0, nt, avx2);
                    t[p] += now() - c;
                }
            double c = now();
            lin(&mm, x, M, H, mm.head_q->w, mm.head_q->packed, NULL, V, y, 0, nt, avx2);
            t[4] = now() - c;
            for (int i = 0; i < 5; i++) if (t[i] < best[i]) best[i] = t[i];
            c = now();
            f[0](&mm, M, M, ids, pos, slots, cu, lens, tab, 8, M, rows, scratch, logits, nt);
            c = now() - c;
            if (c < step) step = c;
        }
        const char *nm[5] = {"qkv x30", "o x30", "gate_up x30", "down x30", "lm_head"};
        double sum = 0;
        for (int i = 0; i < 5; i++) {
            const double mb = i < 4 ? 30.0 * n[i] * k[i] * 2 : (double)V * H * 2;
            sum += best[i];
            printf("%-12s %7.3f ms  %5.1f GB/s\n", nm[i], best[i] * 1e3, mb / best[i] / 1e9);
        }
        printf("linears %.3f ms, whole step (M=%d, ctx %d, %d threads) %.3f ms, rest %.3f ms\n", sum * 1e3, M, ctx,
               nt, step * 1e3, (step - sum) * 1e3);
        return 0;
    }
    static double tw[8][MAXREPS];
    for (int r = 0; r <= reps; r++)
        for (int j = 0; j < nl; j++) {
            const int i = r % 2 ? j : nl - 1 - j;
            double t = now();
            const int rc = f[i](&mside[i], M, M, ids, pos, slots, cu, lens, tab, 8, M, rows, scratch, logits, nts[i]);
            t = now() - t;
            if (rc) { printf("step_forward returned %d\n", rc); return 1; }
            if (r == 0) {                   /* warm-up; compare logits with the first library's */
                double md = 0;
                for (long k = 0; k < (long)M * V; k++) {
                    const double d = logits[k] > ref[k] ? logits[k] - ref[k] : ref[k] - logits[k];
                    if (d > md) md = d;
                }
                printf("%s: max |logit - first's| %.3g\n", argv[first + i], md);
                continue;
            }
            tw[i][r - 1] = t;
        }
    for (int i = 0; i < nl; i++) {
        qsort(tw[i], (size_t)reps, sizeof(double), cmp);
        printf("M=%d ctx=%d nt=%d%s %-30s best %6.3f  p10 %6.3f  median %6.3f ms  %5.1f GB/s at best\n", M, ctx, nts[i],
               avx2 ? " avx2" : "", argv[first + i], tw[i][0] * 1e3, tw[i][reps / 10] * 1e3, tw[i][reps / 2] * 1e3,
               269.0e6 / tw[i][0] / 1e9);
    }
    return 0;
}
