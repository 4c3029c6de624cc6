/* Shared declarations of the fused model step's sources (kernels/cpu.py DECODE_SOURCES builds them
 * into one library): the Model / QW structs mirrored by backend/model/fused_decode.py, the vector
 * helpers of the register tiles, and the functions one source calls in another. Those are
 * INTERNAL (hidden): the library exports only what kernels/cpu.py declares.
 *
 *   step_pool.c     the worker pool and par_for (every parallel loop of the step)
 *   linear_f32.c    fp32 linears: register tiles, MKL sgemm from gemm_min_m rows
 *   linear_bf16.c   bf16 linears: dispatch, VDPBF16PS tiles, the AVX2 path's BLAS
 *   amx_bf16.c      bf16 linears on AMX tiles (TDPBF16PS)
 *   bf16_avx2.c     bf16 weights widened in AVX2 registers
 *   bf16_packed.c   bf16 linears on weights packed at load (VDPBF16PS, no horizontal sums)
 *   decode_cpu.c    step_forward: the step itself (norms, RoPE, KV store, attention, MLP, lm_head)
 *   paged_cpu.c, kv_half.c   attention through the block table; f32_to_half
 *   lora_cpu.c      LoRA adapter rows: shrink / expand after each projection (Model.lora)
 */
#ifndef TRITON_LLM_DECODE_CPU_H
#define TRITON_LLM_DECODE_CPU_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define INTERNAL __attribute__((visibility("hidden")))

typedef float v8 __attribute__((vector_size(32)));

typedef void (*sgemm_fn)(const char *ta, const char *tb, const int *m, const int *n, const int *k,
                         const float *alpha, const float *a, const int *lda, const float *b,
                         const int *ldb, const float *beta, float *c, const int *ldc);

/* MKL's cblas_gemm_bf16bf16f32 (exported by torch's libtorch_cpu.so): C = alpha op(A) op(B) + beta C
 * with A, B bf16 and C fp32; MKL picks AMX, AVX512-BF16 or AVX2 code by CPU. CBLAS enums as ints. */
typedef void (*bgemm_fn)(int layout, int transa, int transb, int m, int n, int k, float alpha,
                         const uint16_t *a, int lda, const uint16_t *b, int ldb, float beta, float *c, int ldc);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };
typedef int (*threads_local_fn)(int nt);     /* MKL_Set_Num_Threads_Local: returns the previous value */

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
    const uint16_t *packed;         /* bf16 only: w packed by bf16_pack (bf16_packed.c), or NULL */
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
    bgemm_fn bgemm;                 /* NULL: this library's bf16 kernels for every M */
    int64_t bgemm_min_m;            /* M at or above which bgemm (if set) runs the bf16 linears */
    threads_local_fn mkl_threads_local;   /* NULL, or MKL's: its calls run on one thread each */
    const void *lora;               /* NULL, or this step's LoRA groups (lora_cpu.c's LoraStep) */
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
 * (python -m bench.ab_dtype_step --threads 2); through the stack, bench-110m fp32 at 1 stream 39-40 ->
 * 59-63 tok/s, at 16 streams +5-8 %, at 32 the same (load.overhead_ab, docs/benchmarks.md). */
#define PAR_MIN_MACS (1 << 18)

/* paged_cpu.c / kv_half.c */
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

/* step_pool.c */
typedef void (*chunk_fn)(void *ctx, int64_t c);
INTERNAL int pool_enabled(void);
INTERNAL void par_for(int nt, int64_t n, chunk_fn fn, void *ctx, int dynamic);

/* linear_f32.c */
INTERNAL int linear_threads(int nt, int64_t M, int64_t N, int64_t K);
INTERNAL int64_t linear_chunks(int T, int64_t N);
INTERNAL void linear(const Model *m, const float *x, int64_t M, int64_t K, const float *W,
                     const float *bias, int64_t N, float *y, int acc, int nt);

/* linear_bf16.c */
INTERNAL int64_t bf16_input_elems(int64_t M, int64_t K);
INTERNAL void linear_bf16(const Model *m, const float *x, int64_t M, int64_t K, const uint16_t *W,
                          const uint16_t *Wp, const float *bias, int64_t N, float *y, int acc, uint16_t *xb,
                          int nt, int avx2);
int bf16_dot_supported(void);
INTERNAL void linear_rows_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *W, const float *bias,
                               int64_t N, float *y, int acc, int64_t n0, int64_t n1);

/* bf16_packed.c: y (+)= xb Wp^T + bias, Wp = bf16_pack(W); 0 done, -1 not taken (no AVX512-BF16 / AVX2, K odd). */
int64_t bf16_packed_elems(int64_t N, int64_t K);
void bf16_pack(const uint16_t *W, int64_t N, int64_t K, uint16_t *out);
INTERNAL int linear_packed_bf16(const uint16_t *xb, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                                int64_t N, float *y, int acc, int T);
/* The same on AVX2 + FMA: xr fp32 rows already rounded to bf16 (bf16_avx2_inputs, not permuted). */
INTERNAL int linear_packed_avx2(const float *xr, int64_t M, int64_t K, const uint16_t *Wp, const float *bias,
                                int64_t N, float *y, int acc, int T);

/* amx_bf16.c: y (+)= xb W^T + bias on AMX tiles; 0 done, -1 not taken (no AMX, K % 32, N < 16). */
int amx_supported(void);
INTERNAL int linear_amx(uint16_t *xb, int64_t M, int64_t K, const uint16_t *W, const float *bias,
                        int64_t N, float *y, int acc, int T);
/* lora_cpu.c: the adapters' rows of one projection, added into its output (issue 31) */
int lora_check(const void *step, int64_t M);
int lora_apply(const void *step, int64_t layer, int64_t proj, const float *x, float *y, int nt,
               void (*par)(int nt, int64_t n, chunk_fn fn, void *ctx, int dynamic));
#endif
