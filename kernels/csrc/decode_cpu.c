/* One whole model step of a Llama-family model in one C call (fp32 or int8/int4 weights, CPU).
 *
 * Built by kernels/cpu.py together with paged_cpu.c (whose attend_f32 it calls), loaded through
 * ctypes by backend/model/fused_decode.py. The M rows are the step's new tokens, sequences back to
 * back (varlen: a decode brings 1 row, a prefill chunk q_len rows; step_forward below). Per layer,
 * with Q = Hq*D, KV = Hkv*D:
 *
 *   xn  = rmsnorm(h) * ln1                          [M, H]
 *   qkv = xn Wqkv^T (+ b)                           [M, Q + 2 KV]   rows: [ q | k | v ]
 *   q, k rotated (rotate-half RoPE, cos/sin of each row's position); q -> qbuf [M, Q],
 *   k, v -> the layer's KV cache at slots[i]        cache [blocks, block_size, Hkv, D]: fp32, or fp16 /
 *                                                   bf16 (kv_cache_dtype: converted as stored, RNE)
 *   att = causal paged attention of qbuf row i over its sequence's first pos[i] + 1 tokens, read
 *         through the sequence's block table row   [M, Q]
 *   h  += att Wo^T (+ b)
 *   xn  = rmsnorm(h) * ln2
 *   gu  = xn Wgu^T (+ b)                            [M, 2I]         rows: [ gate | up ]
 *   act = silu(gate) * up                           [M, I]
 *   h  += act Wdown^T (+ b)
 *
 * then logits[j] = rmsnorm(h[logit_rows[j]]) * norm  W_lm^T.
 *
 * The linears are x W^T with W [N, K] row-major as stored by torch. Small M: register tiles of
 * R weight rows x T tokens (8-float vector accumulators along K, horizontal sum at the end), each
 * weight tile read from memory once and reused from L1 for every group of T tokens; a tile's rows
 * come from the 4 quarters of the row range, so the weights stream from DRAM as 4 sequential
 * streams side by side (~1.6x the bytes per second of one stream at M = 1, issue 15). M >= gemm_min_m
 * (when the caller passes MKL's sgemm_): BLAS, which wins once the step is compute-bound.
 * Threads: OpenMP over weight-row blocks and attention rows when nthreads > 1.
 *
 * Weight-only quantized projections (issue 16): when ``qw`` is set, each layer's qkv/o/gate_up/down
 * (and ``head_q`` for the lm_head) may be int8 or int4 (backend/quant/layout.py); those linears call
 * the quant library's own w8_gemm / w4_gemm (backend/quant/csrc/quant_cpu.c) through the function
 * pointers the caller passes, so they compute exactly what QuantLinear computes on the torch path.
 * The residual projections (o, down) write into the free ``xn`` rows and are added to h after.
 *
 * bf16 models (AVX512-BF16 or AVX2 + FMA): a projection of kind Q_BF16 (and ``head_q`` for the
 * lm_head) is the model's own bf16 weight [N, K]; its input rows are rounded to bf16 (RNE) and
 * multiplied on AMX tiles (TDPBF16PS, from AMX_MIN_M rows) or with VDPBF16PS (pairs of bf16
 * products summed into fp32 lanes), the matmul a bf16 torch Linear does through oneDNN; without
 * AVX512-BF16 (or with the Model's bf16_avx2 flag) by bf16_avx2.c's tiles, which widen the weights
 * in AVX2 registers (same contract, fp32 FMAs). The
 * embedding rows are bf16 too (``embed_dtype``); the rest of the step (norms, RoPE, residual
 * stream, attention over a bf16 KV cache, SiLU) stays fp32, with the caller's fp32 copies of the
 * norm weights and biases.
 */
#define _GNU_SOURCE 1          /* pthread_setname_np (the pool's worker threads) */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

typedef float v8 __attribute__((vector_size(32)));

typedef void (*sgemm_fn)(const char *ta, const char *tb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b,
                         const int *ldb, const float *beta, float *c, const int *ldc);

int attend_f32(const float *q, const float *kc, const float *vc, const int32_t *tables,
               int64_t table_stride, const int64_t *rows, const int32_t *seq, const int32_t *ctx,
               int64_t nrows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, float *out);
int attend_f16(const float *q, const uint16_t *kc, const uint16_t *vc, const int32_t *tables,
               int64_t table_stride, const int64_t *rows, const int32_t *seq, const int32_t *ctx,
               int64_t nrows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, float *out);
int attend_bf16(const float *q, const uint16_t *kc, const uint16_t *vc, const int32_t *tables,
                int64_t table_stride, const int64_t *rows, const int32_t *seq, const int32_t *ctx,
                int64_t nrows, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale, float *out);
void f32_to_half(const float *x, uint16_t *out, int64_t n, int kind);
/* bf16_avx2.c: bf16 weights widened in AVX2 registers (every x86-64 host with AVX2 + FMA) */
int bf16_avx2_supported(void);
void bf16_avx2_inputs(const float *x, int64_t M, int64_t K, float *xr, int permute);
void bf16_avx2_widen(const uint16_t *w, int64_t n, float *out);
void bf16_avx2_rows(const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias, int64_t N,
                    float *y, int acc, int64_t n0, int64_t n1);

typedef void (*w8_fn)(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w,
                      const uint16_t *scales, int64_t G, const float *bias, int64_t N, float *y,
                      int64_t ldy, int nthreads);
typedef void (*w4_fn)(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *w,
                      const uint16_t *scales, const uint16_t *zeros, int64_t G, const float *bias,
                      int64_t N, float *y, int64_t ldy, int nthreads);

/* One projection's quantized or bf16 weight; kind 0: fp32 (the Model's float pointer is used instead). */
enum { Q_F32 = 0, Q_INT8 = 1, Q_INT4 = 2, Q_BF16 = 3 };
typedef struct {
    int64_t kind, group;
    const void *w;                  /* int8 [N, K], packed int4 [N, ceil(K/32)*16] or bf16 [N, K] */
    const uint16_t *scales, *zeros; /* fp16 [N, groups]; zeros: int4 only */
} QW;
enum { P_QKV = 0, P_O = 1, P_GU = 2, P_DOWN = 3, P_COUNT = 4 };

/* Mirrored by backend/model/fused_decode.py's ctypes Structure (same field order). */
typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, block_size, max_pos;
    int64_t gemm_min_m;             /* M at or above which sgemm (if set) runs the linears */
    float eps, scale;
    const float *embed, *norm, *lm_head;
    const float *cos, *sin;         /* [max_pos, D/2] */
    const float **ln1, **qkv_w, **qkv_b, **o_w, **o_b, **ln2, **gu_w, **gu_b, **down_w, **down_b;
    void **k_cache, **v_cache;      /* per layer; element type: kv_dtype */
    sgemm_fn sgemm;                 /* NULL: own kernels for every M */
    const QW *qw;                   /* NULL (all fp32) or [num_layers * P_COUNT] */
    const QW *head_q;               /* NULL: fp32 lm_head; else int8 / int4 / bf16 */
    w8_fn w8;                       /* the quant library's w8_gemm / w4_gemm (needed when used) */
    w4_fn w4;
    int64_t kv_dtype;               /* KV cache element (kv_cache_dtype): KV_F32, KV_F16 or KV_BF16 */
    int64_t embed_dtype;            /* KV_F32 (fp32 rows) or KV_BF16 (bf16 rows: a bf16 model) */
    int64_t bf16_avx2;              /* 1: bf16 linears on the AVX2 kernels even where VDPBF16PS runs */
} Model;
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline v8 ld(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }

/* Pin a loaded vector in a register: without it GCC folds the load into every FMA that uses it
 * (a memory operand), reading each weight vector T times and each x vector R times per step. */
#if defined(__x86_64__) && defined(__AVX__)
#define IN_REG(v) __asm__("" : "+x"(v))
#else
#define IN_REG(v) ((void)0)
#endif
/* a + w x, always one fused multiply-add: the compiler contracts a * b + c in some inlined tile
 * variants and not in others, which made a row's value depend on which tile (and so on which
 * thread's row range) computed it. Explicit FMAs make every variant compute the same bits. */
#if defined(__AVX2__) && defined(__FMA__)
#define FMA8(a, w, x) ((v8)_mm256_fmadd_ps((__m256)(w), (__m256)(x), (__m256)(a)))
#define FMA1(a, w, x) fmaf((w), (x), (a))
#else
#define FMA8(a, w, x) ((a) + (w) * (x))
#define FMA1(a, w, x) ((a) + (w) * (x))
#endif

static inline float hsum(v8 a) {
    return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

/* ---- Parallel loops: the step's own worker pool (issue 15, sixth round) ----
 *
 * Every parallel loop of the step is split into chunks that the calling thread and the pool's
 * worker(s) claim one at a time from one atomic counter; the caller takes whatever is left and
 * waits only for chunks a worker has already claimed, never for a worker that has not started.
 * Through the serving stack the other core is often busy (tritonserver, the shim, the response
 * thread wake in bursts as a step's responses go out): an OpenMP region then ends in a barrier
 * that waits for the descheduled worker to get a core, run its static half, and arrive; here the
 * caller runs the chunks itself meanwhile and the worker, once it runs, takes what is still left.
 * Each output element is computed by one chunk with the same instructions whatever thread runs it
 * (rows of a linear, rows of the norms / RoPE / SiLU, attention rows), so results do not depend
 * on the thread count or on who ran which chunk.
 *
 * A worker spins briefly (POOL_SPIN pauses) for the next loop, then sleeps on a futex; the caller
 * wakes sleepers when it publishes a loop (and does not wait for them to wake up). One caller at
 * a time: a second thread calling in while the pool is busy runs its loop alone.
 * step_pool_set(0) selects OpenMP regions instead (the tests); the pool's workers are started
 * on first use, one fewer than the thread count asked for (at most POOL_MAX). */
#include <pthread.h>
#include <stdatomic.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <limits.h>
#include <sched.h>
#include <sys/resource.h>

typedef void (*chunk_fn)(void *ctx, int64_t c);

#define POOL_MAX 63
#define POOL_SPIN 4000              /* pause iterations (~0.1 ms) before a worker sleeps */

static struct {
    pthread_mutex_t start_lock;     /* starting workers */
    pthread_mutex_t busy;           /* one caller at a time */
    int workers;                    /* started */
    _Atomic uint64_t state;         /* loop generation << 32 | next unclaimed chunk */
    _Atomic uint32_t seq;           /* futex word: bumped per published loop */
    _Atomic int sleepers;
    _Atomic int64_t done;           /* chunks of the current loop finished */
    _Atomic(chunk_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER};

static inline void cpu_pause(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
}

static void *pool_worker(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "step-pool");    /* for per-thread profiles (/proc/.../comm) */
    /* The process's nice value, not the one inherited from the thread that started the pool (the
     * engine thread may run at a higher priority: the stack's other work should preempt a worker,
     * whose chunks the caller takes over, rather than the caller). Raising it is always allowed. */
    const int self_nice = getpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid));
    const int proc_nice = getpriority(PRIO_PROCESS, (id_t)getpid());
    if (proc_nice > self_nice) setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), proc_nice);
    uint64_t seen = atomic_load(&pool.state) >> 32;
    for (;;) {
        uint32_t sq = atomic_load(&pool.seq);
        uint64_t s = atomic_load(&pool.state);
        if ((s >> 32) == seen) {
            int spun = 0;
            while (atomic_load_explicit(&pool.seq, memory_order_acquire) == sq && spun < POOL_SPIN) {
                cpu_pause();
                spun++;
            }
            if (atomic_load(&pool.seq) == sq) {
                atomic_fetch_add(&pool.sleepers, 1);
                if (atomic_load(&pool.seq) == sq)
                    syscall(SYS_futex, &pool.seq, FUTEX_WAIT_PRIVATE, sq, NULL, NULL, 0);
                atomic_fetch_sub(&pool.sleepers, 1);
            }
            continue;
        }
        seen = s >> 32;
        for (;;) {          /* claim chunks of loop `seen` until none is left or the loop is over */
            s = atomic_load(&pool.state);
            if ((s >> 32) != seen) break;
            /* Read before the claim: a successful claim of (seen, idx) proves the loop was still
             * current, so these were its fields (the caller moves the state to a closed
             * generation before it writes the next loop's fields). */
            const int64_t n = atomic_load(&pool.n);
            chunk_fn fn = atomic_load(&pool.fn);
            void *ctx = atomic_load(&pool.ctx);
            if ((int64_t)(s & 0xffffffffu) >= n) break;
            if (!atomic_compare_exchange_weak(&pool.state, &s, s + 1)) continue;
            fn(ctx, (int64_t)(s & 0xffffffffu));
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        }
    }
    return NULL;
}

static int pool_on = 1;

/* 1 (default): the pool runs the parallel loops, 0: OpenMP regions (the tests' invariance
 * checks). Not while a step runs. */
void step_pool_set(int on) { pool_on = on != 0; }

static int pool_enabled(void) { return pool_on; }

/* Start workers up to `want`; returns how many run (0 when none could start). */
static int pool_start(int want) {
    if (want > POOL_MAX) want = POOL_MAX;
    if (pool.workers >= want) return pool.workers;      /* only grows; a stale read just locks */
    pthread_mutex_lock(&pool.start_lock);
    while (pool.workers < want) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &a, pool_worker, NULL);
        pthread_attr_destroy(&a);
        if (rc != 0) break;
        pool.workers++;
    }
    pthread_mutex_unlock(&pool.start_lock);
    return pool.workers;
}

/* fn(ctx, c) for c in [0, n) on up to nt threads (this one included). */
static void pool_run(int nt, int64_t n, chunk_fn fn, void *ctx) {
    if (nt <= 1 || n <= 1 || pool_start(nt - 1) == 0 || pthread_mutex_trylock(&pool.busy) != 0) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
        return;
    }
    /* Close the last loop before its fields change: a worker may have read the old state (every
     * chunk claimed) and then this loop's n, and its claim of the old state must then fail, or it
     * would run a chunk of this loop twice and over-count `done`. Generation gen + 1 has no
     * claimable chunk; gen + 2 is this loop. */
    const uint64_t gen = (atomic_load(&pool.state) >> 32) + 1;
    atomic_store(&pool.state, ((gen & 0xffffffffu) << 32) | 0xffffffffu);
    atomic_store(&pool.fn, fn);
    atomic_store(&pool.ctx, ctx);
    atomic_store(&pool.n, n);
    atomic_store(&pool.done, 0);
    atomic_store(&pool.state, ((gen + 1) & 0xffffffffu) << 32);
    atomic_fetch_add(&pool.seq, 1);
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.seq, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    int64_t mine = 0;
    for (;;) {
        const int64_t c = (int64_t)(atomic_fetch_add(&pool.state, 1) & 0xffffffffu);
        if (c >= n) break;
        fn(ctx, c);
        mine++;
    }
    atomic_fetch_add(&pool.done, mine);
    /* Only chunks a worker claimed and is running are left: wait for them. */
    for (int spun = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < n; spun++) {
        if (spun < POOL_SPIN) cpu_pause(); else sched_yield();
    }
    pthread_mutex_unlock(&pool.busy);
}

/* A parallel loop of n chunks: the pool, or (step_pool_set(0)) an OpenMP region, static or
 * dynamic schedule, as before the pool. */
static void par_for(int nt, int64_t n, chunk_fn fn, void *ctx, int dynamic) {
    if (nt <= 1 || n <= 1) {
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
    } else if (pool_enabled()) {
        pool_run(nt, n, fn, ctx);
    } else if (dynamic) {
#pragma omp parallel for schedule(dynamic) num_threads(nt)
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
    } else {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t c = 0; c < n; c++) fn(ctx, c);
    }
}

/* y[t, r g] (+)= x[t] . w[r g] + bias[r g] for R rows g rows apart, T tokens; pf: the R rows to
 * prefetch meanwhile (the next tile's, on the first token group only: later groups find this tile
 * in L1). */
#define DEFINE_TILE(R, T)                                                                          \
static void tile_##R##_##T(const float *x, int64_t K, const float *w, int64_t g, const float *bias, \
                           float *y, int64_t ldy, int acc, const float *pf) {                      \
    v8 a[R][T];                                                                                    \
    for (int r = 0; r < R; r++) for (int t = 0; t < T; t++) a[r][t] = (v8){0};                     \
    const int64_t rs = g * K;                                                                      \
    int64_t k = 0;                                                                                 \
    for (; k + 8 <= K; k += 8) {                                                                   \
        if (pf && (k & 15) == 0)                                                                   \
            for (int r = 0; r < R; r++) __builtin_prefetch(pf + r * rs + k);                       \
        v8 wv[R];                                                                                  \
        for (int r = 0; r < R; r++) { wv[r] = ld(w + r * rs + k); IN_REG(wv[r]); }                \
        for (int t = 0; t < T; t++) {                                                              \
            v8 xv = ld(x + t * K + k);                                                             \
            IN_REG(xv);                                                                            \
            for (int r = 0; r < R; r++) a[r][t] = FMA8(a[r][t], wv[r], xv);                         \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++)                                                                    \
        for (int t = 0; t < T; t++) {                                                              \
            float s = hsum(a[r][t]);                                                               \
            for (int64_t i = k; i < K; i++) s = FMA1(s, w[r * rs + i], x[t * K + i]);              \
            if (bias) s += bias[r * g];                                                            \
            float *o = y + t * ldy + r * g;                                                        \
            *o = acc ? *o + s : s;                                                                 \
        }                                                                                          \
}

/* M = 1: R rows g apart, one token; the weight vectors are used once, so no register pinning. */
#define DEFINE_GEMV(R)                                                                             \
static void gemv_##R(const float *x, int64_t K, const float *w, int64_t g, const float *bias,     \
                     float *y, int acc) {                                                          \
    v8 a[R];                                                                                       \
    for (int r = 0; r < R; r++) a[r] = (v8){0};                                                    \
    const int64_t rs = g * K;                                                                      \
    int64_t k = 0;                                                                                 \
    for (; k + 8 <= K; k += 8) {                                                                   \
        const v8 xv = ld(x + k);                                                                   \
        for (int r = 0; r < R; r++) a[r] = FMA8(a[r], ld(w + r * rs + k), xv);                     \
    }                                                                                              \
    for (int r = 0; r < R; r++) {                                                                  \
        float s = hsum(a[r]);                                                                      \
        for (int64_t i = k; i < K; i++) s = FMA1(s, w[r * rs + i], x[i]);                          \
        if (bias) s += bias[r * g];                                                                \
        y[r * g] = acc ? y[r * g] + s : s;                                                         \
    }                                                                                              \
}

DEFINE_TILE(4, 1) DEFINE_TILE(4, 2) DEFINE_TILE(3, 3) DEFINE_TILE(2, 4)
DEFINE_TILE(1, 1) DEFINE_TILE(1, 2) DEFINE_TILE(1, 3) DEFINE_TILE(1, 4)
DEFINE_GEMV(4) DEFINE_GEMV(1)

/* Rows a tile takes from STREAMS parts of a thread's row range, one row of each part: the weights
 * are then read as STREAMS long sequential streams side by side. One Zen 3 core reads ~1.5x more
 * bytes per second from DRAM that way than along one stream (4 adjacent rows are one stream). */
#define STREAMS 4
/* Threads only for calls of at least this many multiply-adds. With OpenMP regions (each ends in a
 * barrier, and on a shared host the other thread is often descheduled) a region per linear at
 * M = 1 made bench-15m's step ~50x slower under load, hence 1 << 22 then. The step's pool lets the
 * caller go on without a worker that has not started, and a step of a few tokens is bound by one
 * core's read rate, so from 1 << 18 (2026-12-02, AMX host, 2 threads): in process, decode 1 of
 * bench-110m / SmolLM2 fp32 23.0 / 34.0 -> 13.6 / 18.5 ms, bf16 11.1 / 15.6 -> ~6.0 / 9.1 ms
 * (tools/ab_dtype_step.py --threads 2); through the stack, bench-110m fp32 at 1 stream 39-40 ->
 * 59-63 tok/s, at 16 streams +5-8 %, at 32 the same (load.overhead_ab, docs/benchmarks.md). */
#define PAR_MIN_MACS (1 << 18)
#define QUANT_PAR_MIN_MACS (1 << 22)   /* int8 / int4 linears: the quant library's OpenMP regions */

/* Rows [n0, n1) of y [M, N] (+)= x [M, K] W^T + bias. */
static void linear_rows(const float *x, int64_t M, int64_t K, const float *W, const float *bias,
                        int64_t N, float *y, int acc, int64_t n0, int64_t n1) {
    const int64_t g = (n1 - n0) / STREAMS;             /* rows per part; tile rows are g apart */
    for (int64_t i = 0; i < g; i++) {
        const int64_t n = n0 + i;
        const float *w = W + n * K, *b = bias ? bias + n : NULL;
        if (M == 1) { gemv_4(x, K, w, g, b, y + n, acc); continue; }
        const float *pf = i + 1 < g ? w + K : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4, pf = NULL) {
            const float *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {     /* 4 rows: 4x1, 4x2, 3x3 + 1x3, 2x4 + 2x4 */
            case 1: tile_4_1(xt, K, w, g, b, yt, N, acc, pf); break;
            case 2: tile_4_2(xt, K, w, g, b, yt, N, acc, pf); break;
            case 3: tile_3_3(xt, K, w, g, b, yt, N, acc, pf);
                    tile_1_3(xt, K, w + 3 * g * K, g, b ? b + 3 * g : NULL, yt + 3 * g, N, acc,
                             pf ? pf + 3 * g * K : NULL);
                    break;
            default: tile_2_4(xt, K, w, g, b, yt, N, acc, pf);
                     tile_2_4(xt, K, w + 2 * g * K, g, b ? b + 2 * g : NULL, yt + 2 * g, N, acc,
                              pf ? pf + 2 * g * K : NULL);
            }
        }
    }
    for (int64_t n = n0 + STREAMS * g; n < n1; n++) {  /* the < STREAMS rows left */
        const float *w = W + n * K, *b = bias ? bias + n : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const float *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: if (M == 1) gemv_1(xt, K, w, 1, b, yt, acc); else tile_1_1(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 2: tile_1_2(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 3: tile_1_3(xt, K, w, 1, b, yt, N, acc, NULL); break;
            default: tile_1_4(xt, K, w, 1, b, yt, N, acc, NULL);
            }
        }
    }
}

#define LINEAR_CHUNKS 4

typedef struct {
    const float *x; int64_t M, K; const float *W, *bias; int64_t N; float *y; int acc; int64_t C;
} LinearJob;

static void linear_chunk(void *p, int64_t c) {
    const LinearJob *j = p;
    linear_rows(j->x, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->N * c / j->C, j->N * (c + 1) / j->C);
}

/* Threads for a linear: several only from PAR_MIN_MACS multiply-adds. */
static int linear_threads(int nt, int64_t M, int64_t N, int64_t K) {
    return nt > 1 && M * N * K >= PAR_MIN_MACS ? nt : 1;
}

/* Row chunks of a linear on T threads. OpenMP: one contiguous row range per thread; the pool:
 * LINEAR_CHUNKS ranges per thread (a late worker leaves the caller at most one chunk's imbalance),
 * at least 16 rows each. */
static int64_t linear_chunks(int T, int64_t N) {
    int64_t C = T;
    if (T > 1 && pool_enabled()) {
        C = (int64_t)T * LINEAR_CHUNKS;
        if (C > N / 16) C = N / 16 > T ? N / 16 : T;
    }
    return C;
}

/* y [M, N] (+)= x [M, K] W^T + bias;  x, y contiguous; acc: add into y (the residual). */
static void linear(const Model *m, const float *x, int64_t M, int64_t K, const float *W,
                   const float *bias, int64_t N, float *y, int acc, int nt) {
    if (m->sgemm && M >= m->gemm_min_m && M < (1 << 30)) {
        /* Column-major view: y^T [N, M] = W [K, N]^T x^T [K, M]. */
        const int n_ = (int)N, m_ = (int)M, k_ = (int)K;
        const float one = 1.f, beta = acc ? 1.f : 0.f;
        m->sgemm("T", "N", &n_, &m_, &k_, &one, W, &k_, x, &k_, &beta, y, &n_);
        if (bias)
            for (int64_t t = 0; t < M; t++)
                for (int64_t n = 0; n < N; n++) y[t * N + n] += bias[n];
        return;
    }
    const int T = linear_threads(nt, M, N, K);
    LinearJob j = {x, M, K, W, bias, N, y, acc, linear_chunks(T, N)};
    par_for(T, j.C, linear_chunk, &j, 0);
}

/* The fp32 linear alone (own kernels, no sgemm), for tests and tools: y [M, N] (+)= x W^T + bias. */
void linear_f32(const float *x, int64_t M, int64_t K, const float *W, const float *bias, int64_t N,
                float *y, int acc, int nt) {
    const Model m = {0};
    linear(&m, x, M, K, W, bias, N, y, acc, nt);
}

/* ---- bf16 weights: VDPBF16PS tiles (AVX512-BF16) ------------------------------------------ */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_BF16_DOT 1

/* GCC 12 spells a bf16 vector as shorts, later ones as __bf16: a same-size vector cast either way. */
#define BH(v) ((__m512bh)(v))

/* y[t, r g] (+)= x[t] . w[r g] + bias[r g] for R bf16 weight rows g rows apart and T bf16 input
 * rows: R x T fp32 accumulators of 16 lanes, 32 products per instruction along K (the last < 32
 * through a zeroing mask: zeros add nothing), one horizontal sum per output at the end. */
#define DEFINE_BTILE(R, T)                                                                          \
static void btile_##R##_##T(const uint16_t *x, int64_t K, const uint16_t *w, int64_t g,            \
                            const float *bias, float *y, int64_t ldy, int acc, const uint16_t *pf) { \
    __m512 a[R][T];                                                                                \
    for (int r = 0; r < R; r++) for (int t = 0; t < T; t++) a[r][t] = _mm512_setzero_ps();         \
    const int64_t rs = g * K;                                                                      \
    for (int64_t k = 0; k < K; k += 32) {                                                          \
        const __mmask32 mk = K - k >= 32 ? (__mmask32)~0u : (__mmask32)((1u << (K - k)) - 1);       \
        if (pf)                                                                                    \
            for (int r = 0; r < R; r++) __builtin_prefetch(pf + r * rs + k);                       \
        __m512i wv[R];                                                                             \
        for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_epi16(mk, w + r * rs + k);          \
        for (int t = 0; t < T; t++) {                                                              \
            const __m512i xv = _mm512_maskz_loadu_epi16(mk, x + t * K + k);                        \
            for (int r = 0; r < R; r++) a[r][t] = _mm512_dpbf16_ps(a[r][t], BH(wv[r]), BH(xv));    \
        }                                                                                          \
    }                                                                                              \
    for (int r = 0; r < R; r++)                                                                    \
        for (int t = 0; t < T; t++) {                                                              \
            float s = _mm512_reduce_add_ps(a[r][t]);                                               \
            if (bias) s += bias[r * g];                                                            \
            float *o = y + t * ldy + r * g;                                                        \
            *o = acc ? *o + s : s;                                                                 \
        }                                                                                          \
}
DEFINE_BTILE(4, 1) DEFINE_BTILE(4, 2) DEFINE_BTILE(4, 3) DEFINE_BTILE(4, 4)
DEFINE_BTILE(1, 1) DEFINE_BTILE(1, 2) DEFINE_BTILE(1, 3) DEFINE_BTILE(1, 4)

/* Rows [n0, n1) of y [M, N] (+)= xb [M, K] W^T + bias, bf16 xb and W: 4-row tiles whose rows come
 * from the STREAMS parts of the range (as linear_rows), up to 4 input rows per tile. */
static void linear_rows_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, const float *bias,
                             int64_t N, float *y, int acc, int64_t n0, int64_t n1) {
    const int64_t g = (n1 - n0) / STREAMS;
    for (int64_t i = 0; i < g; i++) {
        const int64_t n = n0 + i;
        const uint16_t *w = W + n * K;
        const float *b = bias ? bias + n : NULL;
        const uint16_t *pf = i + 1 < g ? w + K : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4, pf = NULL) {
            const uint16_t *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: btile_4_1(xt, K, w, g, b, yt, N, acc, pf); break;
            case 2: btile_4_2(xt, K, w, g, b, yt, N, acc, pf); break;
            case 3: btile_4_3(xt, K, w, g, b, yt, N, acc, pf); break;
            default: btile_4_4(xt, K, w, g, b, yt, N, acc, pf);
            }
        }
    }
    for (int64_t n = n0 + STREAMS * g; n < n1; n++) {
        const uint16_t *w = W + n * K;
        const float *b = bias ? bias + n : NULL;
        for (int64_t t0 = 0; t0 < M; t0 += 4) {
            const uint16_t *xt = x + t0 * K;
            float *yt = y + t0 * N + n;
            switch (M - t0 >= 4 ? 4 : M - t0) {
            case 1: btile_1_1(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 2: btile_1_2(xt, K, w, 1, b, yt, N, acc, NULL); break;
            case 3: btile_1_3(xt, K, w, 1, b, yt, N, acc, NULL); break;
            default: btile_1_4(xt, K, w, 1, b, yt, N, acc, NULL);
            }
        }
    }
}

typedef struct {
    const uint16_t *x; int64_t M, K; const uint16_t *W; const float *bias; int64_t N; float *y; int acc; int64_t C;
} BLinearJob;

static void blinear_chunk(void *p, int64_t c) {
    const BLinearJob *j = p;
    linear_rows_bf16(j->x, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->N * c / j->C, j->N * (c + 1) / j->C);
}
#endif

/* bf16 elements a bf16 linear's input scratch needs for M rows of K: the rows rounded to bf16,
 * then (from a 64-byte boundary) their AMX re-layout with the tokens padded to 16. */
static int64_t bf16_input_elems(int64_t M, int64_t K) {
    return ((M * K + 31) & ~(int64_t)31) + (M + 15) / 16 * 16 * K;
}

int bf16_dot_supported(void) {
#ifdef HAVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* ---- bf16 weights on AMX (TDPBF16PS) ---------------------------------------------------------
 * y^T = W x^T in 16 x 16 tiles: C [16 weight rows x mb <= 16 tokens] fp32 += A [16 weight rows x 32
 * k, read in place from W with a row stride of K] . B [16 k-pairs x mb token pairs], B being the
 * step's bf16 inputs re-laid once per linear as VNNI pairs (xv below). Four C tiles (64 weight rows)
 * share each B tile. Needs K % 32 == 0; the N % 16 rows left take the VDPBF16PS tiles. The kernel
 * asks Linux for the AMX tile state once per process (arch_prctl ARCH_REQ_XCOMP_PERM). */
#if defined(HAVE_BF16_DOT) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Below 6 tokens the VDPBF16PS tiles make the faster step where the weights stream from DRAM: one
 * sequential stream per row instead of a tile's 16 strided rows (a 49152 x 768 matrix alone at M = 1:
 * 2.7 against 6.1 ms; whole decode steps of bench-110m / SmolLM2 at M = 4: 13.5 / 20.3 ms against
 * 17.0 / 24.9, at M = 6 even, at 8 AMX ahead, 20.7 / 27.3 against 23.1 / 32.6). bench-15m, whose
 * weights stay in cache, would gain from AMX at 4 already (0.95 against 1.08 ms). Smaller group
 * sizes and software prefetch of the next tile rows did not move AMX at M = 4. Sweep:
 * tools/ab_dtype_step.py MODEL --amx-sweep. */
#define AMX_MIN_M 6

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileCfg;

/* Loaded by each amx_rows call and released at its end: other AMX users in the process (oneDNN
 * under torch's bf16 matmuls) release the tiles after their own work, so a config kept across
 * calls may be gone (the next tile instruction then faults: SIGILL). */
static void tile_config(int mb) {
    TileCfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) { c.rows[t] = 16; c.colsb[t] = (uint16_t)(mb * 4); }   /* C0..C3 */
    c.rows[4] = 16; c.colsb[4] = (uint16_t)(mb * 4);                                   /* B */
    c.rows[5] = c.rows[6] = 16; c.colsb[5] = c.colsb[6] = 64;                          /* A */
    _tile_loadconfig(&c);
}

/* xv: bf16 rows xb [M, K] -> [ceil(M/16)][K/32][16 k-pairs][16 tokens] of 32-bit pairs. */
static void to_vnni(const uint16_t *xb, int64_t M, int64_t K, uint32_t *xv) {
    const int64_t KB = K / 32, K2 = K / 2;
    for (int64_t m = 0; m < M; m++) {
        const uint32_t *src = (const uint32_t *)(xb + m * K);
        uint32_t *dst = xv + (m / 16) * KB * 256 + (m % 16);
        for (int64_t k2 = 0; k2 < K2; k2++) dst[(k2 / 16) * 256 + (k2 % 16) * 16] = src[k2];
    }
}

/* Row blocks [nb0, nb1) (16 weight rows each) of y [M, N] (+)= x W^T + bias. */
static void amx_rows(const uint32_t *xv, int64_t M, int64_t K, const uint16_t *W, const float *bias,
                     int64_t N, float *y, int acc, int64_t nb0, int64_t nb1) {
    const int64_t KB = K / 32, ws = K * 2;
    float buf[16 * 16] __attribute__((aligned(64)));
    int cfg = 0;
    /* Weight rows outside, tokens inside: a group's 64 rows (64 K bf16: 96 KB at K = 768) are read
     * from memory once and from L2 for every further 16 tokens (tokens outside read all of W once
     * per 16 tokens: bench-110m's 136-token prefill 25 % slower than oneDNN that way). */
    for (int64_t nb = nb0; nb < nb1; nb += 4) {
        const int nn = nb1 - nb >= 4 ? 4 : (int)(nb1 - nb);
        const uint16_t *w = W + nb * 16 * K;
        for (int64_t m0 = 0; m0 < M; m0 += 16) {
            const int mb = M - m0 >= 16 ? 16 : (int)(M - m0);
            if (mb != cfg) { tile_config(mb); cfg = mb; }
            const uint32_t *xt = xv + (m0 / 16) * KB * 256;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t kb = 0; kb < KB; kb++) {
                _tile_loadd(4, xt + kb * 256, 64);
                _tile_loadd(5, w + kb * 32, ws);
                _tile_dpbf16ps(0, 5, 4);
                if (nn > 1) { _tile_loadd(6, w + 16 * K + kb * 32, ws); _tile_dpbf16ps(1, 6, 4); }
                if (nn > 2) { _tile_loadd(5, w + 32 * K + kb * 32, ws); _tile_dpbf16ps(2, 5, 4); }
                if (nn > 3) { _tile_loadd(6, w + 48 * K + kb * 32, ws); _tile_dpbf16ps(3, 6, 4); }
            }
            for (int i = 0; i < nn; i++) {
                switch (i) {
                case 0: _tile_stored(0, buf, 64); break;
                case 1: _tile_stored(1, buf, 64); break;
                case 2: _tile_stored(2, buf, 64); break;
                default: _tile_stored(3, buf, 64);
                }
                const int64_t n0 = (nb + i) * 16;
                for (int t = 0; t < mb; t++) {
                    float *o = y + (m0 + t) * N + n0;
                    for (int r = 0; r < 16; r++) {
                        float v = buf[r * 16 + t] + (bias ? bias[n0 + r] : 0.f);
                        o[r] = acc ? o[r] + v : v;
                    }
                }
            }
        }
    }
    if (cfg) _tile_release();
}

typedef struct {
    const uint32_t *xv; int64_t M, K; const uint16_t *W; const float *bias; int64_t N; float *y; int acc;
    int64_t NB, C;
} AmxJob;

static void amx_chunk(void *p, int64_t c) {
    const AmxJob *j = p;
    amx_rows(j->xv, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->NB * c / j->C, j->NB * (c + 1) / j->C);
}
#endif

static int amx_state = -1;               /* -1: not asked yet; amx_set(0) turns it off */

int amx_supported(void) {
#ifdef HAVE_AMX
    if (amx_state < 0) {
        amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return amx_state;
#else
    return 0;
#endif
}

void amx_set(int on) { amx_state = on ? -1 : 0; }

typedef struct {
    const float *x; int64_t M, K; const uint16_t *W; const float *bias; int64_t N; float *y; int acc; int64_t C;
} ALinearJob;

static void alinear_chunk(void *p, int64_t c) {
    const ALinearJob *j = p;
    bf16_avx2_rows(j->x, j->M, j->K, j->W, j->bias, j->N, j->y, j->acc, j->N * c / j->C, j->N * (c + 1) / j->C);
}

/* Rows of W widened per BLAS call on the AVX2 path (256 x K floats: 576 KB at K = 576). */
#define WIDEN_ROWS 256

/* The AVX2 path from m->gemm_min_m rows, where BLAS beats register tiles (compute-bound): bf16(x)
 * (unpermuted) times W widened to fp32 WIDEN_ROWS rows at a time, through m->sgemm. -1: no memory. */
static int linear_bf16_blas(const Model *m, const float *xr, int64_t M, int64_t K, const uint16_t *W,
                            const float *bias, int64_t N, float *y, int acc) {
    float *wf = malloc(sizeof(float) * (size_t)(WIDEN_ROWS * K));
    if (!wf) return -1;
    const int m_ = (int)M, k_ = (int)K, ldc = (int)N;
    const float one = 1.f, beta = acc ? 1.f : 0.f;
    for (int64_t n0 = 0; n0 < N; n0 += WIDEN_ROWS) {
        const int nb = (int)(N - n0 < WIDEN_ROWS ? N - n0 : WIDEN_ROWS);
        bf16_avx2_widen(W + n0 * K, nb * K, wf);
        m->sgemm("T", "N", &nb, &m_, &k_, &one, wf, &k_, xr, &k_, &beta, y + n0, &ldc);   /* as linear() */
    }
    free(wf);
    if (bias)
        for (int64_t t = 0; t < M; t++)
            for (int64_t n = 0; n < N; n++) y[t * N + n] += bias[n];
    return 0;
}

/* y [M, N] (+)= bf16(x) [M, K] W^T + bias with W bf16 [N, K]; xb: bf16_input_elems(M, K) (>= 2 M K:
 * room for the AVX2 kernels' M K rounded fp32 inputs too). AVX512-BF16 (AMX from AMX_MIN_M rows)
 * unless avx2 is set or the CPU lacks it; then the AVX2 kernels (bf16_avx2.c), same contract: BLAS
 * on widened weights from m->gemm_min_m rows (m->sgemm set), register tiles below. */
static void linear_bf16(const Model *m, const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias,
                        int64_t N, float *y, int acc, uint16_t *xb, int nt, int avx2) {
    const int T = linear_threads(nt, M, N, K);
#ifdef HAVE_BF16_DOT
    if (!avx2) {
        f32_to_half(x, xb, M * K, KV_BF16);             /* RNE, as torch's .to(bfloat16) */
#ifdef HAVE_AMX
        if (M >= AMX_MIN_M && K % 32 == 0 && N >= 16 && amx_supported()) {
            uint32_t *xv = (uint32_t *)(xb + ((M * K + 31) & ~(int64_t)31));   /* bf16_input_elems' layout */
            to_vnni(xb, M, K, xv);
            const int64_t NB = N / 16, C = linear_chunks(T, N);                  /* chunks of 16-row blocks */
            AmxJob aj = {xv, M, K, W, bias, N, y, acc, NB, C < NB ? C : NB};
            par_for(T, aj.C, amx_chunk, &aj, 0);
            if (NB * 16 < N) {                                /* the last N % 16 rows */
                linear_rows_bf16(xb, M, K, W, bias, N, y, acc, NB * 16, N);
            }
            return;
        }
#endif
        BLinearJob j = {xb, M, K, W, bias, N, y, acc, linear_chunks(T, N)};
        par_for(T, j.C, blinear_chunk, &j, 0);
        return;
    }
#endif
    (void)avx2;
    float *xr = (float *)xb;                             /* 64-byte aligned by the callers */
    const int blas = m->sgemm && M >= m->gemm_min_m && M < (1 << 30) && N < (1 << 30);
    bf16_avx2_inputs(x, M, K, xr, !blas);
    if (blas && linear_bf16_blas(m, xr, M, K, W, bias, N, y, acc) == 0) return;
    if (blas) bf16_avx2_inputs(x, M, K, xr, 1);         /* no memory for a weight block: the tiles */
    ALinearJob j = {xr, M, K, W, bias, N, y, acc, linear_chunks(T, N)};
    par_for(T, j.C, alinear_chunk, &j, 0);
}

/* 1: a bf16 model can take the fused step on this CPU (VDPBF16PS or AVX2 + FMA). */
int bf16_supported(void) { return bf16_dot_supported() || bf16_avx2_supported(); }

/* bf16 linear alone, for tests: y [M, N] (+)= bf16(x) W^T + bias; avx2: the AVX2 kernels even
 * where VDPBF16PS runs. -1 where the CPU has neither (or avx2 is asked without AVX2) or no memory. */
int linear_bf16_test(const float *x, int64_t M, int64_t K, const uint16_t *W, const float *bias, int64_t N,
                     float *y, int acc, int nt, int avx2) {
    if (avx2 ? !bf16_avx2_supported() : !bf16_supported()) return -1;
    uint16_t *xb = aligned_alloc(64, (sizeof(uint16_t) * (size_t)bf16_input_elems(M, K) + 63) & ~(size_t)63);
    if (!xb) return -1;
    const Model m = {0};                                 /* no sgemm: the kernels of this library */
    linear_bf16(&m, x, M, K, W, bias, N, y, acc, xb, nt, avx2 || !bf16_dot_supported());
    free(xb);
    return 0;
}

/* A projection that may be quantized or bf16: q NULL or fp32 -> linear(); bf16 -> linear_bf16 (xb
 * its input scratch); else the quant GEMM into y, or, with acc, into tmp [M, N] and then y += tmp
 * (as QuantLinear's output is added on the torch path). */
static void linear_q(const Model *m, const QW *q, const float *x, int64_t M, int64_t K, const float *W,
                     const float *bias, int64_t N, float *y, int acc, float *tmp, uint16_t *xb, int nt) {
    if (!q || q->kind == Q_F32) { linear(m, x, M, K, W, bias, N, y, acc, nt); return; }
    if (q->kind == Q_BF16) {
        linear_bf16(m, x, M, K, (const uint16_t *)q->w, bias, N, y, acc, xb, nt, m->bf16_avx2 || !bf16_dot_supported());
        return;
    }
    float *out = acc ? tmp : y;
    /* The quant library threads with OpenMP regions (a barrier each): the old, higher threshold. */
    const int t = nt > 1 && M * N * K >= QUANT_PAR_MIN_MACS ? nt : 1;
    if (q->kind == Q_INT8)
        m->w8(x, M, K, K, (const int8_t *)q->w, q->scales, q->group, bias, N, out, N, t);
    else
        m->w4(x, M, K, K, (const uint8_t *)q->w, q->scales, q->zeros, q->group, bias, N, out, N, t);
    if (acc)
        for (int64_t i = 0; i < M * N; i++) y[i] += tmp[i];
}

/* out = x * rsqrt(mean(x^2) + eps) * w, one row of n. */
static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    v8 a = (v8){0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { v8 v = ld(x + i); a += v * v; }
    float ss = hsum(a);
    for (; i < n; i++) ss += x[i] * x[i];
    const float inv = 1.f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = (x[i] * inv) * w[i];
}

/* Rotate-half RoPE of one head: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). */
static void rope(const float *x, const float *c, const float *s, int64_t half, float *out) {
    for (int64_t i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        out[i] = x1 * c[i] - x2 * s[i];
        out[i + half] = x2 * c[i] + x1 * s[i];
    }
}

/* Bytes of float scratch step_forward needs for M rows (the caller allocates it). */
int64_t decode_scratch_floats(const Model *m, int64_t M) {
    const int64_t q = m->num_heads * m->head_dim, kv = m->num_kv_heads * m->head_dim;
    int64_t kmax = m->hidden > q ? m->hidden : q;
    if (m->inter > kmax) kmax = m->inter;
    /* + the bf16 input scratch of the widest linear (bf16 projections), two per float, and 16
     * floats to align it to 64 bytes */
    return M * (2 * m->hidden + (q + 2 * kv) + 2 * q + 3 * m->inter) + (bf16_input_elems(M, kmax) + 1) / 2 + 16;
}

/* Rows per thread below which the per-row loops (norms, RoPE, SiLU) stay serial. */
#define PAR_MIN_ELEMS (1 << 16)
#define ROW_CHUNKS 4           /* the pool's chunks per thread of a row loop */


/* a[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u, as torch's F.silu(gate) * up (one rounding
 * order; exp from exp8 where AVX2 is there, ~2 ulp). */
static void silu_mul(const float *g, const float *u, int64_t n, float *a) {
    int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 one = _mm256_set1_ps(1.f);
    for (; j + 8 <= n; j += 8) {
        __m256 gv = _mm256_loadu_ps(g + j);
        __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(a + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < n; j++) a[j] = g[j] / (1.f + expf(-g[j])) * u[j];
}

/* The step's per-row loops as chunks of rows (par_for): rows [M c / C, M (c + 1) / C). */
typedef struct {
    const Model *m; int64_t M, C, l;
    const int64_t *pos, *slots, *rows; const int32_t *seq, *ctx, *tables; int64_t table_stride;
    float *h, *xn, *qkv, *qb, *att, *gu, *act;
    const float *ln;
    _Atomic int rc;
} RowJob;

#define ROWS_OF(j, c, i0, i1) const int64_t i0 = (j)->M * (c) / (j)->C, i1 = (j)->M * ((c) + 1) / (j)->C

static void norm_chunk(void *p, int64_t c) {
    RowJob *j = p;
    const int64_t H = j->m->hidden;
    ROWS_OF(j, c, i0, i1);
    for (int64_t i = i0; i < i1; i++) rmsnorm(j->h + i * H, j->ln, H, j->m->eps, j->xn + i * H);
}

static void rope_store_chunk(void *p, int64_t c) {
    RowJob *j = p;
    const Model *m = j->m;
    const int64_t l = j->l, D = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads, half = D / 2;
    const int64_t q = hq * D, kv = hkv * D, qkvn = q + 2 * kv;
    ROWS_OF(j, c, i0, i1);
    for (int64_t i = i0; i < i1; i++) {
        const int64_t *pos = j->pos, *slots = j->slots;
        float *qkv = j->qkv, *qb = j->qb;
        const float *cs = m->cos + pos[i] * half, *sn = m->sin + pos[i] * half, *r = qkv + i * qkvn;
        for (int64_t hd = 0; hd < hq; hd++) rope(r + hd * D, cs, sn, half, qb + i * q + hd * D);
        if (slots[i] < 0) continue;
        if (m->kv_dtype == KV_F32) {
            float *kc = (float *)m->k_cache[l] + slots[i] * kv, *vc = (float *)m->v_cache[l] + slots[i] * kv;
            for (int64_t hd = 0; hd < hkv; hd++) rope(r + q + hd * D, cs, sn, half, kc + hd * D);
            memcpy(vc, r + q + kv, sizeof(float) * (size_t)kv);
        } else {                    /* half cache: rotate K in place (in this row of qkv), convert */
            float *kr = qkv + i * qkvn + q;
            for (int64_t hd = 0; hd < hkv; hd++) rope(kr + hd * D, cs, sn, half, kr + hd * D);
            f32_to_half(kr, (uint16_t *)m->k_cache[l] + slots[i] * kv, kv, (int)m->kv_dtype);
            f32_to_half(kr + kv, (uint16_t *)m->v_cache[l] + slots[i] * kv, kv, (int)m->kv_dtype);
        }
    }
}

static void attend_chunk(void *p, int64_t c) {
    RowJob *j = p;
    const Model *m = j->m;
    const int64_t l = j->l, D = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
    ROWS_OF(j, c, i0, i1);
    int rc = 0;
    for (int64_t i = i0; i < i1; i++) {
        if (m->kv_dtype == KV_F32)
            rc |= attend_f32(j->qb, m->k_cache[l], m->v_cache[l], j->tables, j->table_stride, j->rows + i,
                             j->seq + i, j->ctx + i, 1, hq, hkv, D, m->block_size, m->scale, j->att);
        else
            rc |= (m->kv_dtype == KV_F16 ? attend_f16 : attend_bf16)(
                j->qb, m->k_cache[l], m->v_cache[l], j->tables, j->table_stride, j->rows + i, j->seq + i,
                j->ctx + i, 1, hq, hkv, D, m->block_size, m->scale, j->att);
    }
    if (rc) atomic_fetch_or(&j->rc, rc);
}

static void silu_chunk(void *p, int64_t c) {
    RowJob *j = p;
    const int64_t I = j->m->inter;
    ROWS_OF(j, c, i0, i1);
    for (int64_t i = i0; i < i1; i++) silu_mul(j->gu + i * 2 * I, j->gu + i * 2 * I + I, I, j->act + i * I);
}

/* One model step over a varlen batch (fused prefill chunks + decodes, issue 15).
 *
 * nseqs sequences back to back: sequence s owns rows [cu[s], cu[s+1]) (q_len >= 1 new tokens; a
 * decode has 1) and has seq_lens[s] tokens of context including them, whose block-table row is
 * tables[s]. Row r = cu[s] + i sits at position seq_lens[s] - q_len + i and attends causally to the
 * first seq_lens[s] - q_len + i + 1 tokens of its sequence (kernels/reference.py's contract); all
 * rows' K/V are stored before any attention, so a chunk sees its own earlier tokens. logits[j] is
 * the row logit_rows[j] (the sampler's rows; none for a chunk that does not sample yet).
 *
 * Returns 0, -1 (attention scratch allocation failed), -2 (a position, token id, logits row or
 * the cu / seq_lens layout out of range). */
int step_forward(const Model *m, int64_t M, int64_t nseqs, const int64_t *ids, const int64_t *pos,
                 const int64_t *slots, const int32_t *cu, const int32_t *seq_lens, const int32_t *tables,
                 int64_t table_stride, int64_t nlogits, const int64_t *logit_rows, float *scratch,
                 float *logits, int nt) {
    const int64_t H = m->hidden, D = m->head_dim, hq = m->num_heads, hkv = m->num_kv_heads;
    const int64_t q = hq * D, kv = hkv * D, I = m->inter, qkvn = q + 2 * kv;
    for (int64_t i = 0; i < M; i++)
        if (pos[i] < 0 || pos[i] >= m->max_pos || ids[i] < 0 || ids[i] >= m->vocab) return -2;
    for (int64_t j = 0; j < nlogits; j++)
        if (logit_rows[j] < 0 || logit_rows[j] >= M) return -2;
    if (nseqs < 1 || cu[0] != 0 || cu[nseqs] != M) return -2;
    for (int64_t s = 0; s < nseqs; s++)
        if (cu[s + 1] <= cu[s] || seq_lens[s] < cu[s + 1] - cu[s]) return -2;
    float *h = scratch, *xn = h + M * H, *qkv = xn + M * H, *qb = qkv + M * qkvn, *att = qb + M * q;
    float *gu = att + M * q, *act = gu + 2 * M * I;
    uint16_t *xb = (uint16_t *)(((uintptr_t)(act + M * I) + 63) & ~(uintptr_t)63);   /* bf16 linear inputs */
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)M);
    int32_t *seq = malloc(sizeof(int32_t) * (size_t)M), *ctx = malloc(sizeof(int32_t) * (size_t)M);
    if (!rows || !seq || !ctx) { free(rows); free(seq); free(ctx); return -1; }
    int64_t att_macs = 0;          /* per layer: q.k and p.v over every row's context */
    for (int64_t s = 0; s < nseqs; s++) {
        const int64_t first = seq_lens[s] - (cu[s + 1] - cu[s]) - cu[s] + 1;   /* ctx of row r: first + r */
        for (int64_t r = cu[s]; r < cu[s + 1]; r++) {
            rows[r] = r; seq[r] = (int32_t)s; ctx[r] = (int32_t)(first + r);
            att_macs += 2 * (int64_t)ctx[r] * q;
        }
    }
    if (m->embed_dtype == KV_BF16) {                     /* bf16 rows: widening is exact */
        const uint16_t *e = (const uint16_t *)m->embed;
        for (int64_t i = 0; i < M; i++)
            for (int64_t c = 0; c < H; c++) {
                const uint32_t u = (uint32_t)e[ids[i] * H + c] << 16;
                memcpy(h + i * H + c, &u, sizeof u);
            }
    } else {
        for (int64_t i = 0; i < M; i++) memcpy(h + i * H, m->embed + ids[i] * H, sizeof(float) * (size_t)H);
    }
    const int par_att = nt > 1 && M > 1 && att_macs >= PAR_MIN_MACS;
    const int par_rows = nt > 1 && M > 1 && M * (H + I) >= PAR_MIN_ELEMS;
    /* Row loops: OpenMP splits the M rows statically (attention: dynamically, one row at a time);
     * the pool takes ROW_CHUNKS chunks per thread (attention: one row per chunk). */
    const int pool = pool_enabled();
    const int64_t row_c = pool ? (M < ROW_CHUNKS * nt ? M : ROW_CHUNKS * nt) : M;
    const int nr = par_rows ? nt : 1, na = par_att ? nt : 1;
    RowJob rj = {.m = m, .M = M, .C = row_c, .pos = pos, .slots = slots, .rows = rows, .seq = seq, .ctx = ctx,
                .tables = tables, .table_stride = table_stride, .h = h, .xn = xn, .qkv = qkv, .qb = qb,
                .att = att, .gu = gu, .act = act};
    atomic_init(&rj.rc, 0);
    RowJob ja = rj;                 /* attention: one row per chunk */
    ja.C = M;
#define QP(l, p) (m->qw ? m->qw + (l) * P_COUNT + (p) : NULL)
    for (int64_t l = 0; l < m->num_layers && atomic_load(&ja.rc) == 0; l++) {
        rj.l = ja.l = l;
        rj.ln = m->ln1[l];
        par_for(nr, row_c, norm_chunk, &rj, 0);
        linear_q(m, QP(l, P_QKV), xn, M, H, m->qkv_w[l], m->qkv_b[l], qkvn, qkv, 0, NULL, xb, nt);
        par_for(nr, row_c, rope_store_chunk, &rj, 0);
        par_for(na, M, attend_chunk, &ja, 1);
        linear_q(m, QP(l, P_O), att, M, q, m->o_w[l], m->o_b[l], H, h, 1, xn, xb, nt);
        rj.ln = m->ln2[l];
        par_for(nr, row_c, norm_chunk, &rj, 0);
        linear_q(m, QP(l, P_GU), xn, M, H, m->gu_w[l], m->gu_b[l], 2 * I, gu, 0, NULL, xb, nt);
        par_for(nr, row_c, silu_chunk, &rj, 0);
        linear_q(m, QP(l, P_DOWN), act, M, I, m->down_w[l], m->down_b[l], H, h, 1, xn, xb, nt);
    }
    const int rc = atomic_load(&ja.rc);
    free(rows);
    free(seq);
    free(ctx);
    if (rc != 0) return -1;
    for (int64_t j = 0; j < nlogits; j++) rmsnorm(h + logit_rows[j] * H, m->norm, H, m->eps, xn + j * H);
#undef QP
    if (nlogits > 0)
        linear_q(m, m->head_q, xn, nlogits, H, m->lm_head, NULL, m->vocab, logits, 0, NULL, xb, nt);
    return 0;
}
