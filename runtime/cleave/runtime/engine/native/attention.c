/* Decode attention over the paged KV pool, read in place through block tables (one query a
 * sequence); prefill is prefill.c. */
#include "simd.h"

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

/* o_r = bf16(sum_p prob_r[p] * v_p) for rows r < nr (<= 16 / dv: the query heads of one kv
 * head) attending over the same values, each value row converted once for them all; dv = d / 16
 * is a constant at each call site, so the accumulators stay in registers. prob_r = prob + r *
 * prob_stride, o_r = o + r * o_stride. */
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
