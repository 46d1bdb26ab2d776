/* Decode attention over the paged KV pool, read in place through block tables (one query a
 * sequence); prefill is prefill.c. */
#include "simd.h"

/* sc[g * len + p] = scale * q_g.k_p for the group's query heads g (rows q + g * d) and keys
 * 0..len-1, 16 keys at a time: each block of keys is read from memory once for all the heads
 * (a head at a time read it once each, from L2 after the first: 350 keys of 64 are 45 KB).
 * dz = d / 32 is a constant at each call site, so a head's query stays in registers. Each
 * key's value row (at the same place in vh) is fetched into L2 for the values' pass that
 * follows. */
static inline __attribute__((always_inline)) void group_scores(
    const uint16_t *q, long group, const uint16_t *kh, const uint16_t *vh,
    const int64_t *table, long bs, const int dz, long len, float scale, float *sc) {
  rows_t rows = {kh, table, bs, dz * 32, 0, 0};
  const uint16_t *keys[16];
  const uint16_t *key = kh;
  for (long p0 = 0; p0 < len; p0 += 16) {
    for (int j = 0; j < 16; j++) {
      if (p0 + j < len) key = next_row(&rows); /* a short last chunk repeats its last key */
      keys[j] = key;
      for (int c = 0; c < dz; c++)
        _mm_prefetch((const char *)(vh + (key - kh) + 32 * c), _MM_HINT_T1);
    }
    for (long g = 0; g < group; g++) {
      __m512bh qv[8];
      for (int c = 0; c < dz; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + (g * dz + c) * 32);
      __m512 acc[16];
      for (int j = 0; j < 16; j++) {
        acc[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0],
                                  (__m512bh)_mm512_loadu_si512(keys[j]));
        for (int c = 1; c < dz; c++)
          acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(keys[j] + 32 * c));
      }
      _mm512_mask_storeu_ps(sc + g * len + p0, first(len - p0),
                            _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
  }
}

static void scores(const uint16_t *q, long group, const uint16_t *kh, const uint16_t *vh,
                   const int64_t *table, long bs, long d, long len, float scale, float *sc) {
  switch (d) {
    case 64: group_scores(q, group, kh, vh, table, bs, 2, len, scale, sc); break;
    case 128: group_scores(q, group, kh, vh, table, bs, 4, len, scale, sc); break;
    default: group_scores(q, group, kh, vh, table, bs, (int)(d / 32), len, scale, sc);
  }
}

/* Scores sc[0..len) -> unnormalised probabilities e_p = bf16(exp(sc_p - max)), written as bf16
 * over the front of the same buffer (chunk p is read before its half-size write lands at or
 * below it), with a zero after an odd last one so the values' product takes them in pairs.
 * Returns 1 / sum_p e_p: the sum of the rounded e_p, so the weights used sum to one (0 for
 * no keys). */
static float exp_bf16_inplace(float *sc, long len) {
  __m512 vmx = _mm512_set1_ps(-INFINITY), vsum = _mm512_setzero_ps();
  for (long p = 0; p < len; p += 16) {
    __mmask16 m = first(len - p);
    vmx = _mm512_mask_max_ps(vmx, m, vmx, _mm512_maskz_loadu_ps(m, sc + p));
  }
  vmx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
  uint16_t *e16 = (uint16_t *)sc;
  for (long p = 0; p < len; p += 16) {
    __mmask16 m = first(len - p);
    __m512 e = _mm512_maskz_mov_ps(m, round_bf16(exp_nonpositive_or_small(
        _mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + p), vmx))));
    vsum = _mm512_add_ps(vsum, e);
    store_bf16x16_masked(e16 + p, m, e);
  }
  if (len & 1) _mm256_mask_storeu_epi16(e16 + len, 1, _mm256_setzero_si256());
  float sum = _mm512_reduce_add_ps(vsum);
  return sum > 0.0f ? 1.0f / sum : 0.0f; /* no keys: a zero output, not 0 * inf */
}

/* o_r = bf16(inv[r] * sum_p e_r[p] * v_p) for rows r < nr (<= MAXR: query heads of one kv
 * head) over the same values, two keys at a time (and two rows of the ``ahead`` stream, the
 * next sequence's keys, fetched into L2 while ahead_left lasts): each pair of value rows is
 * interleaved (a_0 b_0 a_1 b_1 ...) once for all the rows, whose bf16 weight pairs
 * (e_r[p], e_r[p+1]) it meets in VDPBF16PS, half the instructions of fp32 multiply-adds on
 * converted values.
 * e_r = e + r * e_stride (bf16, even-padded); dz = d / 32 is a constant at each call site so
 * the accumulators (2 dz a row) stay in registers. */
static inline __attribute__((always_inline)) void weighted_values(
    const uint16_t *e, long e_stride, const float *inv, long nr, const uint16_t *vh,
    const int64_t *table, long bs, long len, const int dz, uint16_t *o, long o_stride,
    rows_t *ahead, long ahead_left) {
  enum { MAXR = 4 };
  __m512 acc[MAXR][16];
  for (int r = 0; r < MAXR; r++)
    for (int c = 0; c < 2 * dz; c++) acc[r][c] = _mm512_setzero_ps();
  rows_t rows = {vh, table, bs, dz * 32, 0, 0};
  for (long p = 0; p < len; p += 2) {
    const uint16_t *va = next_row(&rows), *vb = p + 1 < len ? next_row(&rows) : NULL;
    for (int a = 0; a < 2 && ahead_left > 0; a++, ahead_left--) {
      const uint16_t *k = next_row(ahead);
      for (int c = 0; c < dz; c++) _mm_prefetch((const char *)(k + 32 * c), _MM_HINT_T1);
    }
    __m512i lo[8], hi[8];
    for (int c = 0; c < dz; c++) {
      __m512i a = _mm512_loadu_si512(va + 32 * c);
      __m512i b = vb ? _mm512_loadu_si512(vb + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(a, b); /* lane 4 L + j: dim 8 L + j of keys p, p + 1 */
      hi[c] = _mm512_unpackhi_epi16(a, b); /* lane 4 L + j: dim 8 L + 4 + j */
    }
    for (int r = 0; r < MAXR && r < nr; r++) {
      uint32_t pair;
      memcpy(&pair, e + r * e_stride + p, 4);
      __m512bh w = (__m512bh)_mm512_set1_epi32((int)pair);
      for (int c = 0; c < dz; c++) {
        acc[r][2 * c] = _mm512_dpbf16_ps(acc[r][2 * c], (__m512bh)lo[c], w);
        acc[r][2 * c + 1] = _mm512_dpbf16_ps(acc[r][2 * c + 1], (__m512bh)hi[c], w);
      }
    }
  }
  /* back to dim order: dims 0-15 of a 32 are lo 0-3, hi 0-3, lo 4-7, hi 4-7; 16-31 the next */
  const __m512i first16 = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second16 = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11,
                                            10, 9, 8);
  for (int r = 0; r < MAXR && r < nr; r++) {
    __m512 s = _mm512_set1_ps(inv[r]);
    for (int c = 0; c < dz; c++) {
      __m512 x = acc[r][2 * c], y = acc[r][2 * c + 1];
      uint16_t *dst = o + r * o_stride + 32 * c;
      store_bf16x16(dst, round_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(x, first16, y), s)));
      store_bf16x16(dst + 16,
                    round_bf16(_mm512_mul_ps(_mm512_permutex2var_ps(x, second16, y), s)));
    }
  }
}

/* weighted_values with d's constant picked; nr <= rows_per_pass(d) */
static void values(const uint16_t *e, long e_stride, const float *inv, long nr,
                   const uint16_t *vh, const int64_t *table, long bs, long len, long d,
                   uint16_t *o, long o_stride, rows_t *ahead, long ahead_left) {
  switch (d) {
    case 64:
      weighted_values(e, e_stride, inv, nr, vh, table, bs, len, 2, o, o_stride, ahead,
                      ahead_left);
      break;
    case 128:
      weighted_values(e, e_stride, inv, nr, vh, table, bs, len, 4, o, o_stride, ahead,
                      ahead_left);
      break;
    default:
      for (long r = 0; r < nr; r++)
        weighted_values(e + r * e_stride, 0, inv + r, 1, vh, table, bs, len, (int)(d / 32),
                        o + r * o_stride, 0, ahead, r ? 0 : ahead_left);
  }
}

static inline long rows_per_pass(long d) { return d == 64 ? 4 : d == 128 ? 2 : 1; }

/* decode_attention_bf16: one query token per sequence over its KV in the paged pool, read in
 * place through the block table. The stock path gathers each sequence's blocks into new
 * tensors (index_select) and runs two bf16 bmm's and a softmax: at batch 1 those small calls
 * were a quarter of a decode step. Scores and sums are fp32; the unnormalised probabilities
 * are rounded to bf16 for the values' product (as prefill.c does, and the stock bf16 path
 * rounds them), normalised by the sum of the rounded ones; the output is rounded once.
 *
 * q: [seqs] rows of q_stride elements, each nq heads of d; pools: [nkv, blocks, bs, d];
 * tables: [seqs, table_width] block ids; lengths: [seqs] keys to attend (0..length-1);
 * out: [seqs, nq, d]. d % 32 == 0, d <= 256, nq % nkv == 0. scratch: nq / nkv *
 * max(length) floats. */
void decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_pool,
                           const uint16_t *v_pool, long blocks, long bs, const int64_t *tables,
                           long table_width, const int64_t *lengths, long seqs, long nq,
                           long nkv, long d, float scale, float *scratch, uint16_t *out) {
  long group = nq / nkv, per = rows_per_pass(d);
  float inv[group];
  /* kv head outer: one head's blocks of sequences allocated one after another are then one
   * forward stream the hardware prefetcher follows (32 sequences over 350 keys contiguous,
   * 30 layers: 16 against 19 ms sequence outer; from cache 8 either way) */
  for (long h = 0; h < nkv; h++) {
    const uint16_t *kh = k_pool + h * blocks * bs * d, *vh = v_pool + h * blocks * bs * d;
    for (long s = 0; s < seqs; s++) {
      long len = lengths[s];
      const int64_t *table = tables + s * table_width;
      scores(q + s * q_stride + h * group * d, group, kh, vh, table, bs, d, len, scale, scratch);
      for (long g = 0; g < group; g++) inv[g] = exp_bf16_inplace(scratch + g * len, len);
      /* the next sequence's keys (the next head's first), fetched into L2 while these
       * values are read. With the values fetched during the scores, every stream is
       * requested ahead of its use: a sequence's blocks start cold wherever one does not
       * follow the last (the hardware prefetcher ramps up per run), and the little
       * arithmetic per byte hides none of it. Decode steps of the workload, replayed with
       * their block tables (a one-off A/B of the two builds): 21 % faster; all keys in
       * cache: 15 % slower. */
      long ns = s + 1 < seqs ? s + 1 : 0, nh = s + 1 < seqs ? h : h + 1;
      rows_t ahead = {k_pool + nh * blocks * bs * d, tables + ns * table_width, bs, d, 0, 0};
      long ahead_left = nh < nkv ? lengths[ns] : 0;
      for (long g = 0; g < group; g += per) {
        long nr = group - g < per ? group - g : per;
        values((const uint16_t *)(scratch + g * len), 2 * len, inv + g, nr, vh, table, bs, len,
               d, out + (s * nq + h * group + g) * d, d, &ahead, g ? 0 : ahead_left);
      }
    }
  }
}
