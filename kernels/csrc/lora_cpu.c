/* LoRA shrink / expand for the fused CPU step (issue 31): after a projection y = x W^T, the rows of
 * each adapter get
 *
 *   t            = x[rows] A^T              [n, r]   shrink (A [r, in] as PEFT stores it)
 *   y[rows, c0:] += scale * t Bt            [n, out] expand (Bt [r, out]: B [out, r] transposed once
 *                                                     per adapter by backend/lora/fused.py)
 *
 * grouped by adapter over the step's flattened rows; base rows are never touched. One call per
 * fused projection: qkv (targets q | k | v side by side in y's columns), o, gate_up (gate | up) and
 * down; x and y are the step's fp32 rows whatever the base weights are (fp32, bf16, int8 / int4).
 * Adapters are fp32.
 *
 * Vector code: GCC vector extensions with explicit AVX2 FMAs where the build has them (-march=native
 * on an AVX2 host never emits AVX-512; other builds get the generic vectors), so the library is safe
 * on every host it is built on. Shrink: register tiles of 2 A rows x up to 4 x rows with 8-float
 * accumulators along `in`, a horizontal sum at the end. Expand: Bt rows broadcast-multiplied into
 * 16-column accumulators of up to 4 rows, so each Bt row is read once per 4 rows.
 *
 * Threads: two parallel phases per call (shrink chunks = blocks of a group's rows, expand chunks =
 * column blocks of a target) through the caller's parallel-for (the step's pool); each output
 * element is computed by one chunk in a fixed order, so the thread count never changes the bits.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

typedef float lv8 __attribute__((vector_size(32)));

static inline lv8 lld(const float *p) { lv8 x; memcpy(&x, p, sizeof x); return x; }
static inline void lst(float *p, lv8 x) { memcpy(p, &x, sizeof x); }

#if defined(__AVX2__) && defined(__FMA__)
#define LFMA(a, w, x) ((lv8)_mm256_fmadd_ps((__m256)(w), (__m256)(x), (__m256)(a)))
#else
#define LFMA(a, w, x) ((a) + (w) * (x))
#endif

static inline float lhsum(lv8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* Targets in the order of backend/lora/adapter.py's TARGETS; projections as decode_cpu.c's P_*. */
enum { T_Q, T_K, T_V, T_O, T_GATE, T_UP, T_DOWN, LORA_TARGETS };
enum { LP_QKV, LP_O, LP_GU, LP_DOWN };

/* One adapter (mirrored by backend/lora/fused.py): per layer and target, A [r, in] and Bt [r, out]
 * fp32 contiguous, both NULL where the adapter does not target that module. */
typedef struct {
    int64_t rank;
    float scale;
    const float *const *a;      /* [num_layers * LORA_TARGETS] */
    const float *const *bt;     /* [num_layers * LORA_TARGETS] */
} LoraAdapter;

/* One step's groups (mirrored by backend/lora/fused.py): group g's rows are
 * rows[offsets[g] .. offsets[g + 1]), all on adapters[g]. */
typedef struct {
    int64_t hidden, q_size, kv_size, inter, num_layers;
    int64_t ngroups;
    const LoraAdapter *const *adapters;
    const int64_t *offsets;     /* [ngroups + 1] */
    const int64_t *rows;
} LoraStep;

typedef void (*lora_chunk_fn)(void *ctx, int64_t c);
typedef void (*lora_par_fn)(int nt, int64_t n, lora_chunk_fn fn, void *ctx, int dynamic);

static _Atomic int64_t rows_done;   /* rows x projections updated, all calls: tests see the C path ran */

int64_t lora_rows_done(void) { return atomic_load(&rows_done); }

/* ---- shrink: t[i, k] = x[rows[i]] . A[k] ---- */

#define DEFINE_SHRINK(T)                                                                           \
static void shrink_##T(const float *const *xs, const float *a0, const float *a1, int64_t K,       \
                       float *o0, float *o1, int64_t ldo) {                                       \
    lv8 s0[T], s1[T];                                                                              \
    for (int u = 0; u < T; u++) s0[u] = s1[u] = (lv8){0};                                          \
    int64_t c = 0;                                                                                 \
    for (; c + 8 <= K; c += 8) {                                                                   \
        const lv8 w0 = lld(a0 + c), w1 = lld(a1 + c);                                              \
        for (int u = 0; u < T; u++) {                                                              \
            const lv8 xv = lld(xs[u] + c);                                                         \
            s0[u] = LFMA(s0[u], w0, xv);                                                           \
            s1[u] = LFMA(s1[u], w1, xv);                                                           \
        }                                                                                          \
    }                                                                                              \
    for (int u = 0; u < T; u++) {                                                                  \
        float r0 = lhsum(s0[u]), r1 = lhsum(s1[u]);                                                \
        for (int64_t k = c; k < K; k++) { r0 += a0[k] * xs[u][k]; r1 += a1[k] * xs[u][k]; }        \
        o0[u * ldo] = r0;                                                                          \
        o1[u * ldo] = r1;                                                                          \
    }                                                                                              \
}
DEFINE_SHRINK(1)
DEFINE_SHRINK(2)
DEFINE_SHRINK(3)
DEFINE_SHRINK(4)

/* t [n, r] for the n rows rows[0..n) of x (row stride ldx). */
static void shrink(const float *x, int64_t ldx, const int64_t *rows, int64_t n, const float *a, int64_t r,
                   int64_t K, float *t) {
    for (int64_t i = 0; i < n; i += 4) {
        const int T = n - i < 4 ? (int)(n - i) : 4;
        const float *xs[4];
        for (int u = 0; u < T; u++) xs[u] = x + rows[i + u] * ldx;
        for (int64_t k = 0; k < r; k += 2) {
            /* an odd rank's last row is computed twice into the same place */
            const int64_t k1 = k + 1 < r ? k + 1 : k;
            float *o0 = t + i * r + k, *o1 = t + i * r + k1;
            switch (T) {
            case 4: shrink_4(xs, a + k * K, a + k1 * K, K, o0, o1, r); break;
            case 3: shrink_3(xs, a + k * K, a + k1 * K, K, o0, o1, r); break;
            case 2: shrink_2(xs, a + k * K, a + k1 * K, K, o0, o1, r); break;
            default: shrink_1(xs, a + k * K, a + k1 * K, K, o0, o1, r); break;
            }
        }
    }
}

/* ---- expand: y[rows[i], j] += scale * sum_k t[i, k] Bt[k, j], columns [j0, j1) ---- */

#define DEFINE_EXPAND(T)                                                                           \
static void expand_##T(const float *t, int64_t r, const float *bt, int64_t N, float scale,       \
                       float *const *ys, int64_t j0, int64_t j1) {                               \
    int64_t j = j0;                                                                                \
    for (; j + 16 <= j1; j += 16) {                                                                \
        lv8 s0[T], s1[T];                                                                          \
        for (int u = 0; u < T; u++) s0[u] = s1[u] = (lv8){0};                                      \
        for (int64_t k = 0; k < r; k++) {                                                          \
            const lv8 b0 = lld(bt + k * N + j), b1 = lld(bt + k * N + j + 8);                      \
            for (int u = 0; u < T; u++) {                                                          \
                const lv8 tv = (lv8){0} + t[u * r + k];                                            \
                s0[u] = LFMA(s0[u], b0, tv);                                                       \
                s1[u] = LFMA(s1[u], b1, tv);                                                       \
            }                                                                                      \
        }                                                                                          \
        for (int u = 0; u < T; u++) {                                                              \
            lst(ys[u] + j, lld(ys[u] + j) + s0[u] * scale);                                        \
            lst(ys[u] + j + 8, lld(ys[u] + j + 8) + s1[u] * scale);                                \
        }                                                                                          \
    }                                                                                              \
    for (; j < j1; j++)                                                                            \
        for (int u = 0; u < T; u++) {                                                              \
            float s = 0.f;                                                                         \
            for (int64_t k = 0; k < r; k++) s += t[u * r + k] * bt[k * N + j];                    \
            ys[u][j] += s * scale;                                                                 \
        }                                                                                          \
}
DEFINE_EXPAND(1)
DEFINE_EXPAND(2)
DEFINE_EXPAND(3)
DEFINE_EXPAND(4)

static void expand(const float *t, int64_t n, int64_t r, const float *bt, int64_t N, float scale, float *y,
                   int64_t ldy, const int64_t *rows, int64_t j0, int64_t j1) {
    for (int64_t i = 0; i < n; i += 4) {
        const int T = n - i < 4 ? (int)(n - i) : 4;
        float *ys[4];
        for (int u = 0; u < T; u++) ys[u] = y + rows[i + u] * ldy;
        const float *ti = t + i * r;
        switch (T) {
        case 4: expand_4(ti, r, bt, N, scale, ys, j0, j1); break;
        case 3: expand_3(ti, r, bt, N, scale, ys, j0, j1); break;
        case 2: expand_2(ti, r, bt, N, scale, ys, j0, j1); break;
        default: expand_1(ti, r, bt, N, scale, ys, j0, j1); break;
        }
    }
}

/* ---- one projection's groups, as chunks of two parallel phases ---- */

#define SHRINK_ROWS 16              /* rows of a group per shrink chunk */
#define EXPAND_COLS 128             /* output columns per expand chunk (a multiple of 16) */
#define LORA_PAR_MIN_MACS (1 << 16) /* below this a call stays on the calling thread */

typedef struct {
    const float *a, *bt;
    const int64_t *rows;
    int64_t n, r, K, N, col0;
    float scale;
    float *t;                       /* [n, r] */
    int64_t first_s, first_e;       /* this job's first shrink / expand chunk */
} Job;

typedef struct {
    Job *jobs;
    int64_t njobs;
    const float *x;
    float *y;
    int64_t ldx, ldy;
} Call;

static int64_t job_of(const Call *cl, int64_t c, int expand_phase) {
    int64_t j = 0;
    while (j + 1 < cl->njobs && (expand_phase ? cl->jobs[j + 1].first_e : cl->jobs[j + 1].first_s) <= c) j++;
    return j;
}

static void shrink_chunk(void *p, int64_t c) {
    const Call *cl = p;
    const Job *jb = &cl->jobs[job_of(cl, c, 0)];
    const int64_t i0 = (c - jb->first_s) * SHRINK_ROWS;
    const int64_t n = jb->n - i0 < SHRINK_ROWS ? jb->n - i0 : SHRINK_ROWS;
    shrink(cl->x, cl->ldx, jb->rows + i0, n, jb->a, jb->r, jb->K, jb->t + i0 * jb->r);
}

static void expand_chunk(void *p, int64_t c) {
    const Call *cl = p;
    const Job *jb = &cl->jobs[job_of(cl, c, 1)];
    const int64_t j0 = (c - jb->first_e) * EXPAND_COLS;
    const int64_t j1 = j0 + EXPAND_COLS < jb->N ? j0 + EXPAND_COLS : jb->N;
    expand(jb->t, jb->n, jb->r, jb->bt, jb->N, jb->scale, cl->y + jb->col0, cl->ldy, jb->rows, j0, j1);
}

static void run(lora_par_fn par, int nt, int64_t n, lora_chunk_fn fn, void *ctx) {
    if (par && nt > 1 && n > 1) { par(nt, n, fn, ctx, 1); return; }
    for (int64_t c = 0; c < n; c++) fn(ctx, c);
}

/* 0 when every group's rows lie in [0, M) and every adapter has a rank in [1, 1024]; else -2. */
int lora_check(const LoraStep *s, int64_t M) {
    if (s->ngroups < 0 || (s->ngroups > 0 && s->offsets[0] != 0)) return -2;
    for (int64_t g = 0; g < s->ngroups; g++) {
        if (s->offsets[g + 1] < s->offsets[g] || s->adapters[g]->rank < 1 || s->adapters[g]->rank > 1024) return -2;
        for (int64_t i = s->offsets[g]; i < s->offsets[g + 1]; i++)
            if (s->rows[i] < 0 || s->rows[i] >= M) return -2;
    }
    return 0;
}

/* The adapters' products of projection `proj` (LP_QKV .. LP_DOWN) of layer `layer`, added into y:
 * x is the projection's input [M, in] and y its output [M, out] (qkv: [q | k | v], gate_up:
 * [gate | up]; o and down: the residual stream). `par` NULL (or nt 1): on this thread.
 * Returns 0, or -1 when scratch memory is not to be had. */
int lora_apply(const LoraStep *s, int64_t layer, int64_t proj, const float *x, float *y, int nt,
               lora_par_fn par) {
    const int64_t H = s->hidden, q = s->q_size, kv = s->kv_size, I = s->inter;
    int tg[3], ntg = 0;
    int64_t K, ldy, cols[3], outs[3];
    switch (proj) {
    case LP_QKV: K = H; ldy = q + 2 * kv; tg[0] = T_Q; tg[1] = T_K; tg[2] = T_V; ntg = 3;
        cols[0] = 0; cols[1] = q; cols[2] = q + kv; outs[0] = q; outs[1] = kv; outs[2] = kv; break;
    case LP_O: K = q; ldy = H; tg[0] = T_O; ntg = 1; cols[0] = 0; outs[0] = H; break;
    case LP_GU: K = H; ldy = 2 * I; tg[0] = T_GATE; tg[1] = T_UP; ntg = 2;
        cols[0] = 0; cols[1] = I; outs[0] = I; outs[1] = I; break;
    case LP_DOWN: K = I; ldy = H; tg[0] = T_DOWN; ntg = 1; cols[0] = 0; outs[0] = H; break;
    default: return -2;
    }
    if (s->ngroups <= 0 || layer < 0 || layer >= s->num_layers) return 0;
    Job *jobs = malloc(sizeof(Job) * (size_t)(s->ngroups * ntg));
    if (!jobs) return -1;
    int64_t njobs = 0, tfloats = 0, nrows = 0;
    for (int64_t g = 0; g < s->ngroups; g++) {
        const LoraAdapter *ad = s->adapters[g];
        const int64_t n = s->offsets[g + 1] - s->offsets[g];
        int any = 0;
        for (int u = 0; u < ntg; u++) {
            const int64_t at = layer * LORA_TARGETS + tg[u];
            if (n == 0 || !ad->a[at] || !ad->bt[at]) continue;
            jobs[njobs++] = (Job){.a = ad->a[at], .bt = ad->bt[at], .rows = s->rows + s->offsets[g], .n = n,
                                  .r = ad->rank, .K = K, .N = outs[u], .col0 = cols[u], .scale = ad->scale};
            tfloats += n * ad->rank;
            any = 1;
        }
        nrows += any ? n : 0;
    }
    if (njobs == 0) { free(jobs); return 0; }
    float *t = malloc(sizeof(float) * (size_t)tfloats);
    if (!t) { free(jobs); return -1; }
    int64_t ns = 0, ne = 0, macs = 0, off = 0;
    for (int64_t j = 0; j < njobs; j++) {
        Job *jb = &jobs[j];
        jb->t = t + off;
        off += jb->n * jb->r;
        jb->first_s = ns;
        jb->first_e = ne;
        ns += (jb->n + SHRINK_ROWS - 1) / SHRINK_ROWS;
        ne += (jb->N + EXPAND_COLS - 1) / EXPAND_COLS;
        macs += jb->n * jb->r * (jb->K + jb->N);
    }
    Call cl = {jobs, njobs, x, y, K, ldy};
    const int threads = macs >= LORA_PAR_MIN_MACS ? nt : 1;
    run(par, threads, ns, shrink_chunk, &cl);
    run(par, threads, ne, expand_chunk, &cl);
    free(t);
    free(jobs);
    atomic_fetch_add(&rows_done, nrows);
    return 0;
}
