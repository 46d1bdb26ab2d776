/* Attention over the paged KV pool, read in place through block tables: decode (one query a
 * sequence) and prefill (a fresh chunk, causal). */
#include "simd.h"

/* Walks a sequence's rows through its block table in order, without a division per row
 * (a 64-bit division by the runtime block size cost more than the row's arithmetic). */
typedef struct {
  const uint16_t *base;
  const int64_t *table;
  long bs, d, block, offset;
} rows_t;

static inline const uint16_t *next_row(rows_t *r) {
  const uint16_t *row = r->base + (r->table[r->block] * r->bs + r->offset) * r->d;
  if (++r->offset == r->bs) {
    r->offset = 0;
    r->block++;
  }
  return row;
}

/* sc[p] = scale * q.k_p for keys 0..len-1, 16 keys at a time */
static void scores(const uint16_t *q, const uint16_t *kh, const int64_t *table, long bs, long d,
                   long len, float scale, float *sc) {
  rows_t rows = {kh, table, bs, d, 0, 0};
  const uint16_t *key = kh;
  for (long p0 = 0; p0 < len; p0 += 16) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
      if (p0 + j < len) key = next_row(&rows); /* a short last chunk repeats its last key */
      acc[j] = _mm512_setzero_ps();
      for (long c = 0; c < d; c += 32)
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(q + c),
                                  (__m512bh)_mm512_loadu_si512(key + c));
    }
    __m512 r = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
    long n = len - p0 < 16 ? len - p0 : 16;
    _mm512_mask_storeu_ps(sc + p0, (__mmask16)((1u << n) - 1), r);
  }
}

/* sc[0..len) = softmax(sc[0..len)) */
static void softmax_inplace(float *sc, long len) {
  __m512 vmx = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
  for (long p = 0; p < len; p += 16) {
    __mmask16 m = first(len - p);
    vmx = _mm512_mask_max_ps(vmx, m, vmx, _mm512_maskz_loadu_ps(m, sc + p));
  }
  vmx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
  for (long p = 0; p < len; p += 16) {
    __mmask16 m = first(len - p);
    __m512 e = exp_nonpositive_or_small(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + p), vmx));
    _mm512_mask_storeu_ps(sc + p, m, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
  }
  __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  for (long p = 0; p < len; p += 16) {
    __mmask16 m = first(len - p);
    _mm512_mask_storeu_ps(sc + p, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sc + p), inv));
  }
}

/* o_r = bf16(sum_p prob_r[p] * v_p) for rows r < nr (<= 16 / dv) attending over the same
 * values, each value row converted once for them all; dv = d / 16 is a constant at each call
 * site, so the accumulators stay in registers. prob_r = prob + r * prob_stride (zero past a
 * row's own keys), o_r = o + r * o_stride. */
static inline __attribute__((always_inline)) void weighted_values(
    const float *prob, long prob_stride, long nr, const uint16_t *vh, const int64_t *table,
    long bs, long len, const int dv, uint16_t *o, long o_stride) {
  enum { MAXR = 4 };
  __m512 acc[MAXR][16];
  for (int r = 0; r < MAXR; r++)
    for (int c = 0; c < dv; c++) acc[r][c] = _mm512_setzero_ps();
  rows_t rows = {vh, table, bs, dv * 16, 0, 0};
  for (long p = 0; p < len; p++) {
    const uint16_t *val = next_row(&rows);
    __m512 v[16];
    for (int c = 0; c < dv; c++) v[c] = load_bf16x16(val + 16 * c);
    for (int r = 0; r < MAXR; r++) {
      if (r >= nr) break;
      __m512 w = _mm512_set1_ps(prob[r * prob_stride + p]);
      for (int c = 0; c < dv; c++) acc[r][c] = _mm512_fmadd_ps(w, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MAXR && r < nr; r++)
    for (int c = 0; c < dv; c++)
      store_bf16x16(o + r * o_stride + 16 * c, round_bf16(acc[r][c]));
}

/* weighted_values with d's constant picked; nr <= rows_per_pass(d) */
static void values(const float *prob, long prob_stride, long nr, const uint16_t *vh,
                   const int64_t *table, long bs, long len, long d, uint16_t *o, long o_stride) {
  switch (d) {
    case 64: weighted_values(prob, prob_stride, nr, vh, table, bs, len, 4, o, o_stride); break;
    case 128: weighted_values(prob, prob_stride, nr, vh, table, bs, len, 8, o, o_stride); break;
    default:
      for (long r = 0; r < nr; r++)
        weighted_values(prob + r * prob_stride, 0, 1, vh, table, bs, len, (int)(d / 16),
                        o + r * o_stride, 0);
  }
}

static inline long rows_per_pass(long d) { return d == 64 ? 4 : d == 128 ? 2 : 1; }

/* decode_attention_bf16: one query token per sequence over its KV in the paged pool, read in
 * place through the block table. The stock path gathers each sequence's blocks into new
 * tensors (index_select) and runs two bf16 bmm's and a softmax: at batch 1 those small calls
 * were a quarter of a decode step. Scores, softmax and the weighted sum of V are fp32; the
 * output is rounded to bf16 once (the stock path rounds scores and probabilities to bf16).
 *
 * q: [seqs] rows of q_stride elements, each nq heads of d; pools: [nkv, blocks, bs, d];
 * tables: [seqs, table_width] block ids; lengths: [seqs] keys to attend (0..length-1);
 * out: [seqs, nq, d]. d % 32 == 0, d <= 256, nq % nkv == 0. scratch: nq / nkv *
 * max(length) floats. */
void decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_pool,
                           const uint16_t *v_pool, long blocks, long bs, const int64_t *tables,
                           long table_width, const int64_t *lengths, long seqs, long nq,
                           long nkv, long d, float scale, float *scratch, uint16_t *out) {
  long group = nq / nkv;
  for (long s = 0; s < seqs; s++) {
    long len = lengths[s];
    const int64_t *table = tables + s * table_width;
    for (long h = 0; h < nkv; h++) {
      const uint16_t *kh = k_pool + h * blocks * bs * d, *vh = v_pool + h * blocks * bs * d;
      for (long g = 0; g < group; g++) {
        scores(q + s * q_stride + (h * group + g) * d, kh, table, bs, d, len, scale,
               scratch + g * len);
        softmax_inplace(scratch + g * len, len);
      }
      long per = rows_per_pass(d);
      for (long g = 0; g < group; g += per) {
        long nr = group - g < per ? group - g : per;
        values(scratch + g * len, len, nr, vh, table, bs, len, d,
               out + (s * nq + h * group + g) * d, d);
      }
    }
  }
}

/* Scores of nr (<= 4) query rows over keys 0..len-1 into rows of ``stride`` floats, four keys
 * by four rows at a time: each key and query load serves four products, and one sum16 gives
 * the sixteen scores. Keys past a row's own count are computed too (the caller masks them). */
static void scores4(const uint16_t *q, long q_stride, long nr, const uint16_t *kh,
                    const int64_t *table, long bs, long d, long len, float scale, float *sc,
                    long stride) {
  __m512 vscale = _mm512_set1_ps(scale);
  rows_t rows = {kh, table, bs, d, 0, 0};
  const uint16_t *key[4] = {kh, kh, kh, kh};
  for (long p0 = 0; p0 < len; p0 += 4) {
    for (int i = 0; i < 4; i++) /* a short last group repeats its last key */
      key[i] = p0 + i < len ? next_row(&rows) : key[i > 0 ? i - 1 : 0];
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
      for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
    for (long c = 0; c < d; c += 32) {
      __m512bh qv[4];
      for (int j = 0; j < 4; j++)
        qv[j] = (__m512bh)_mm512_loadu_si512(q + (j < nr ? j : 0) * q_stride + c);
      for (int i = 0; i < 4; i++) {
        __m512bh kv = (__m512bh)_mm512_loadu_si512(key[i] + c);
        for (int j = 0; j < 4; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], kv, qv[j]);
      }
    }
    float out[16]; /* lane 4 i + j: key p0 + i, row j */
    _mm512_storeu_ps(out, _mm512_mul_ps(sum16((const __m512 *)acc), vscale));
    long n = len - p0 < 4 ? len - p0 : 4;
    for (long j = 0; j < nr; j++)
      for (long i = 0; i < n; i++) sc[j * stride + p0 + i] = out[4 * i + j];
  }
}

/* prefill_attention_bf16: causal attention of one sequence's chunk of ``len`` new tokens at
 * positions context.. over its keys 0..context+len-1, all already in the pool (the chunk's
 * own too), read in place through its block table. Query rows share each value row's
 * conversion, four at a time for 64-wide heads (two for 128, one otherwise); scores, softmax
 * and sums are fp32, the output rounded to bf16 once. Fresh chunks only: over earlier context
 * torch's tiled bmm's win (dense/attention.py, NATIVE_PREFILL_MAX).
 *
 * q: [len] rows of q_stride elements, each nq heads of d; out: [len, nq, d];
 * scratch: 4 * (context + len) floats. */
void prefill_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_pool,
                            const uint16_t *v_pool, long blocks, long bs, const int64_t *table,
                            long context, long len, long nq, long nkv, long d, float scale,
                            float *scratch, uint16_t *out) {
  long group = nq / nkv, per = rows_per_pass(d), total = context + len;
  for (long h = 0; h < nkv; h++) {
    const uint16_t *kh = k_pool + h * blocks * bs * d, *vh = v_pool + h * blocks * bs * d;
    for (long g = 0; g < group; g++) {
      long head = h * group + g;
      for (long i0 = 0; i0 < len; i0 += per) {
        long nr = len - i0 < per ? len - i0 : per, keys = context + i0 + nr;
        scores4(q + i0 * q_stride + head * d, q_stride, nr, kh, table, bs, d, keys, scale,
                scratch, total);
        for (long r = 0; r < nr; r++) {
          long own = context + i0 + r + 1; /* causal: this query sees keys 0..own-1 */
          float *row = scratch + r * total;
          softmax_inplace(row, own);
          memset(row + own, 0, (size_t)(keys - own) * sizeof(float));
        }
        values(scratch, total, nr, vh, table, bs, keys, d, out + (i0 * nq + head) * d,
               nq * d);
      }
    }
  }
}

