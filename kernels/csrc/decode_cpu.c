/* One whole model step of a Llama-family model in one C call (fp32, bf16 or int8/int4 weights, CPU).
 *
 * Built by kernels/cpu.py with the other DECODE_SOURCES (paged_cpu.c's attend_f32 among them) into
 * one library, loaded through ctypes by backend/model/fused_decode.py. The M rows are the step's new tokens, sequences back to
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
 * The linears are x W^T with W [N, K] row-major as stored by torch: linear_f32.c (fp32), linear_bf16.c
 * and amx_bf16.c (bf16), the quant library (int8 / int4, below). Every parallel loop runs on the
 * step's worker pool (step_pool.c). Shared declarations: decode_cpu.h.
 *
 * Weight-only quantized projections (issue 16): when ``qw`` is set, each layer's qkv/o/gate_up/down
 * (and ``head_q`` for the lm_head) may be int8 or int4 (backend/quant/layout.py); those linears call
 * the quant library's own w8_gemm / w4_gemm (backend/quant/csrc/quant_cpu.c) through the function
 * pointers the caller passes, so they compute exactly what QuantLinear computes on the torch path.
 * The residual projections (o, down) write into the free ``xn`` rows and are added to h after.
 *
 * bf16 models: a projection of kind Q_BF16 (and ``head_q`` for the lm_head) is the model's own bf16
 * weight [N, K] (linear_bf16.c). The embedding rows are bf16 too (``embed_dtype``); the rest of the
 * step (norms, RoPE, residual stream, attention over a bf16 KV cache, SiLU) stays fp32, with the
 * caller's fp32 copies of the norm weights and biases.
 */
#include "decode_cpu.h"
#include <stdatomic.h>

#include "simd_exp.h"

#define QUANT_PAR_MIN_MACS (1 << 22)   /* int8 / int4 linears: the quant library's OpenMP regions */

/* Columns [c W, (c + 1) W) of an int8 linear (W a multiple of 16), on this thread, through the quant
 * library's slice convention (backend/quant/csrc/quant_cpu.h): a packed weight (G <= -32) takes
 * the slice's first 16-column block in G, a row-major one pointer offsets. Each output's bits do
 * not depend on the slicing. */
typedef struct {
    const Model *m; const QW *q; const float *x; int64_t M, K; const float *bias; int64_t N; float *y; int64_t W;
} Q8Job;

static void q8_chunk(void *p, int64_t c) {
    const Q8Job *j = p;
    const int64_t n0 = c * j->W, n1 = n0 + j->W < j->N ? n0 + j->W : j->N, K = j->K;
    const int8_t *w = (const int8_t *)j->q->w;
    const uint16_t *sc = j->q->scales;
    int64_t G = j->q->group;
    if (G < 0) G -= n0 / 16;
    else w += n0 * K, sc += n0 * ((K + G - 1) / G);
    j->m->w8(j->x, j->M, K, K, w, sc, G, j->bias ? j->bias + n0 : NULL, n1 - n0, j->y + n0, j->N, 1);
}

/* A projection that may be quantized or bf16: q NULL or fp32 -> linear(); bf16 -> linear_bf16 (xb
 * its input scratch); else the quant GEMM into y, or, with acc, into tmp [M, N] and then y += tmp
 * (as QuantLinear's output is added on the torch path). */
static void linear_q(const Model *m, const QW *q, const float *x, int64_t M, int64_t K, const float *W,
                     const float *bias, int64_t N, float *y, int acc, float *tmp, uint16_t *xb, int nt) {
    if (!q || q->kind == Q_F32) { linear(m, x, M, K, W, bias, N, y, acc, nt); return; }
    if (q->kind == Q_BF16) {
        linear_bf16(m, x, M, K, (const uint16_t *)q->w, q->packed, bias, N, y, acc, xb, nt, m->bf16_avx2 || !bf16_dot_supported());
        return;
    }
    float *out = acc ? tmp : y;
    const int T = linear_threads(nt, M, N, K);
    /* The quant library threads with OpenMP regions (a barrier each): the old, higher threshold. */
    const int t = nt > 1 && M * N * K >= QUANT_PAR_MIN_MACS ? nt : 1;
    if (q->kind == Q_INT8 && T > 1) {
        /* int8 on the step's pool instead: column slices of 16k columns, w8_gemm on one thread each
         * (its OpenMP regions inside the step waited on a core that the pool or the serving
         * processes held: 0.6x fp32 at 16 streams on 2 threads, 2.3x on one). Two slices per
         * thread: each call rounds all M input rows to int16 again, so few and wide. */
        const int64_t C = 2 * (int64_t)T, W = ((N + C - 1) / C + 15) / 16 * 16;
        Q8Job j = {m, q, x, M, K, bias, N, out, W};
        par_for(T, (N + W - 1) / W, q8_chunk, &j, 0);
    } else if (q->kind == Q_INT8)
        m->w8(x, M, K, K, (const int8_t *)q->w, q->scales, q->group, bias, N, out, N, 1);
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
    if (m->lora && lora_check(m->lora, M)) return -2;
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
    /* adapter rows (issue 31): after each projection, before anything reads its output */
#define LORA(p, x, y) \
    do { if (m->lora && lora_apply(m->lora, l, p, x, y, nt, par_for)) atomic_store(&ja.rc, -1); } while (0)
    for (int64_t l = 0; l < m->num_layers && atomic_load(&ja.rc) == 0; l++) {
        rj.l = ja.l = l;
        rj.ln = m->ln1[l];
        par_for(nr, row_c, norm_chunk, &rj, 0);
        linear_q(m, QP(l, P_QKV), xn, M, H, m->qkv_w[l], m->qkv_b[l], qkvn, qkv, 0, NULL, xb, nt);
        LORA(P_QKV, xn, qkv);
        par_for(nr, row_c, rope_store_chunk, &rj, 0);
        par_for(na, M, attend_chunk, &ja, 1);
        linear_q(m, QP(l, P_O), att, M, q, m->o_w[l], m->o_b[l], H, h, 1, xn, xb, nt);
        LORA(P_O, att, h);
        rj.ln = m->ln2[l];
        par_for(nr, row_c, norm_chunk, &rj, 0);
        linear_q(m, QP(l, P_GU), xn, M, H, m->gu_w[l], m->gu_b[l], 2 * I, gu, 0, NULL, xb, nt);
        LORA(P_GU, xn, gu);
        par_for(nr, row_c, silu_chunk, &rj, 0);
        linear_q(m, QP(l, P_DOWN), act, M, I, m->down_w[l], m->down_b[l], H, h, 1, xn, xb, nt);
        LORA(P_DOWN, act, h);
    }
    const int rc = atomic_load(&ja.rc);
    free(rows);
    free(seq);
    free(ctx);
    if (rc != 0) return -1;
    for (int64_t j = 0; j < nlogits; j++) rmsnorm(h + logit_rows[j] * H, m->norm, H, m->eps, xn + j * H);
#undef QP
#undef LORA
    if (nlogits > 0)
        linear_q(m, m->head_q, xn, nlogits, H, m->lm_head, NULL, m->vocab, logits, 0, NULL, xb, nt);
    return 0;
}
