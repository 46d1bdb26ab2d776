/* Causal prefill attention over the paged KV pool, flash-style: a chunk's queries attend over
 * all their keys (earlier context and the chunk's own) in blocks of KB keys, with an online
 * softmax, so no score row is ever materialised.
 *
 * Both products run on VDPBF16PS as small GEMMs with no horizontal sums: each kv head's keys
 * and values are first copied out of the pool (through the block table) into pair-interleaved
 * layouts, once per chunk (O(keys * d), against O(queries * keys * d) for the products):
 * - keys by pairs of dimensions, 32 keys a vector pair, so one broadcast pair of a query row
 *   meets 32 keys at once (scores: QR rows x 32 keys in 24 accumulators);
 * - values by pairs of keys, so one broadcast pair of probabilities meets 16 dimensions of two
 *   value rows at once.
 * Query rows are (token, head) pairs of the kv head's group, QR at a time: the rows of one
 * block share every key and value load. Scores and softmax are fp32; the probabilities are
 * rounded to bf16 for the values' product (torch's bf16 attention rounds them too, after
 * normalising), and the sum they are divided by adds up those same rounded values, so each
 * output is a true weighted average; sums are fp32, the output rounded to bf16 once. */
#include "simd.h"

/* two bf16 as one 32-bit lane, read out of uint16_t arrays (no alignment or aliasing assumed) */
typedef uint32_t pair_t __attribute__((may_alias, aligned(2)));

enum { KB = 32, QR = 12 }; /* keys per block; query rows per block */

/* Floats of prefill_attention_bf16's scratch for ``keys`` keys of head width d: the packed
 * keys and values of one kv head, then one block of query rows' running sums of values, maxima,
 * sums of probabilities (16 lanes a row) and probabilities. */
long prefill_attention_scratch(long keys, long d) {
  long blocks = (keys + KB - 1) / KB;
  return blocks * KB * d + QR * d + QR + 16 * QR + QR * KB / 2;
}

/* kp[(b * d/2 + c) * KB + j] = key b KB + j's dimensions 2c, 2c+1 (one 32-bit pair);
 * vp[((b * KB/2 + j) * d + c) * 2 + e] = value b KB + 2j + e's dimension c. Keys past n are
 * zero (their probabilities are zero too, and 0 * garbage could be NaN). */
static void pack(const uint16_t *kh, const uint16_t *vh, const int64_t *table, long bs, long d,
                 long n, pair_t *kp, uint16_t *vp) {
  long blocks = (n + KB - 1) / KB, half = d / 2;
  rows_t krows = {kh, table, bs, d, 0, 0}, vrows = {vh, table, bs, d, 0, 0};
  /* out[2 c + e] = (e ? b : a)[c] for 16 dims: a's 16 then b's 16 in one vector, permuted */
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  for (long b = 0; b < blocks; b++) {
    pair_t *kb = kp + b * half * KB;
    uint16_t *vb = vp + b * KB * d;
    for (long j = 0; j < KB; j += 2) {
      const uint16_t *v[2] = {NULL, NULL};
      for (int e = 0; e < 2; e++) {
        if (b * KB + j + e < n) {
          const pair_t *k = (const pair_t *)next_row(&krows);
          v[e] = next_row(&vrows);
          for (long c = 0; c < half; c++) kb[c * KB + j + e] = k[c];
        } else {
          for (long c = 0; c < half; c++) kb[c * KB + j + e] = 0;
        }
      }
      uint16_t *vd = vb + j * d; /* keys j, j + 1 interleaved: one permute a 16 dims (scalar
                                  * stores of every element cost 5-14 % of a chunk's attention) */
      for (long c = 0; c < d; c += 16) {
        __m256i a = v[0] ? _mm256_loadu_si256((const __m256i *)(v[0] + c)) : _mm256_setzero_si256(),
                z = v[1] ? _mm256_loadu_si256((const __m256i *)(v[1] + c)) : _mm256_setzero_si256();
        __m512i az = _mm512_inserti64x4(_mm512_castsi256_si512(a), z, 1);
        _mm512_storeu_si512(vd + 2 * c, _mm512_permutexvar_epi16(pairs, az));
      }
    }
  }
}

typedef struct {
  const pair_t *q; /* the row's query, as pairs */
  long pos;         /* its position: it sees keys 0..pos */
} qrow_t;

/* scores of the QR rows over key block kb, scaled, then the online softmax: each row's
 * running max m and sum l (16 lanes, added up at the end), its sums o rescaled when m grows,
 * and its probabilities for this block as bf16 pairs in p (QR rows of KB/2 pairs). l adds up
 * the rounded pairs with one VDPBF16PS against ones, exactly (x 1.0, fp32 sums), where
 * rounding each half and adding lanes across cost a tenth of the block's instructions. */
static inline __attribute__((always_inline)) void block_probs(
    const qrow_t *rows, const pair_t *kb, long half, long first_key, float scale, float *m,
    float *l, float *o, long d, pair_t *p) {
  __m512 s[QR][2];
  for (int r = 0; r < QR; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (long c = 0; c < half; c++) {
    __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + c * KB);
    __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + c * KB + 16);
#pragma GCC unroll 12
    for (int r = 0; r < QR; r++) {
      __m512bh qv = (__m512bh)_mm512_set1_epi32((int)rows[r].q[c]);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], qv, k0);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], qv, k1);
    }
  }
  __m512 vscale = _mm512_set1_ps(scale);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80); /* bf16 1.0 */
  for (int r = 0; r < QR; r++) {
    long seen = rows[r].pos - first_key + 1; /* keys of this block the row sees */
    __mmask16 lo = first(seen), hi = first(seen - 16);
    __m512 x0 = _mm512_mul_ps(s[r][0], vscale), x1 = _mm512_mul_ps(s[r][1], vscale);
    __m512 ninf = _mm512_set1_ps(-INFINITY);
    float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, lo, x0),
                                                  _mm512_mask_mov_ps(ninf, hi, x1)));
    if (mx > m[r]) { /* a new max: rescale what was summed under the old one */
      float alpha = expf(m[r] - mx);
      __m512 va = _mm512_set1_ps(alpha);
      _mm512_storeu_ps(l + 16 * r, _mm512_mul_ps(_mm512_loadu_ps(l + 16 * r), va));
      for (long c = 0; c < d; c += 16)
        _mm512_storeu_ps(o + r * d + c, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), va));
      m[r] = mx;
    }
    __m512 vm = _mm512_set1_ps(m[r]);
    __m512 p0 = _mm512_maskz_mov_ps(lo, exp_nonpositive_or_small(_mm512_sub_ps(x0, vm)));
    __m512 p1 = _mm512_maskz_mov_ps(hi, exp_nonpositive_or_small(_mm512_sub_ps(x1, vm)));
    __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);
    _mm512_storeu_si512(p + r * (KB / 2), (__m512i)pb);
    _mm512_storeu_ps(l + 16 * r, _mm512_dpbf16_ps(_mm512_loadu_ps(l + 16 * r), pb, ones));
  }
}

/* o[r] += p[r] . values of block vb, rp rows at a time with their dv = d/16 accumulators in
 * registers (dv and rp are constants at each call site) */
static inline __attribute__((always_inline)) void block_values(const uint16_t *vb,
                                                               const pair_t *p, float *o,
                                                               long d, const int dv,
                                                               const int rp) {
  for (int r0 = 0; r0 < QR; r0 += rp) {
    __m512 acc[16];
    for (int r = 0; r < rp; r++)
      for (int c = 0; c < dv; c++) acc[r * dv + c] = _mm512_loadu_ps(o + (r0 + r) * d + 16 * c);
    for (int j = 0; j < KB / 2; j++) {
      __m512bh v[16];
      for (int c = 0; c < dv; c++)
        v[c] = (__m512bh)_mm512_loadu_si512(vb + j * 2 * d + 32 * c);
      for (int r = 0; r < rp; r++) {
        __m512bh pr = (__m512bh)_mm512_set1_epi32((int)p[(r0 + r) * (KB / 2) + j]);
        for (int c = 0; c < dv; c++) acc[r * dv + c] = _mm512_dpbf16_ps(acc[r * dv + c], pr, v[c]);
      }
    }
    for (int r = 0; r < rp; r++)
      for (int c = 0; c < dv; c++) _mm512_storeu_ps(o + (r0 + r) * d + 16 * c, acc[r * dv + c]);
  }
}

/* One block of QR query rows (the first ``real`` of them real, the rest copies of row 0) over
 * the packed keys and values, into o (QR rows of d fp32 sums) and l. */
static inline __attribute__((always_inline)) void attend(const qrow_t *rows, long real,
                                                         const pair_t *kp,
                                                         const uint16_t *vp, long d,
                                                         float scale, float *work,
                                                         const int dv, const int rp) {
  float *o = work, *m = o + QR * d, *l = m + QR;
  pair_t *p = (pair_t *)(l + 16 * QR);
  for (int r = 0; r < QR; r++) m[r] = -INFINITY;
  memset(o, 0, (size_t)(QR * d) * sizeof(float));
  memset(l, 0, (size_t)(16 * QR) * sizeof(float));
  long last = rows[real - 1].pos; /* rows ascend in position */
  for (long b = 0; b * KB <= last; b++) {
    block_probs(rows, kp + b * (d / 2) * KB, d / 2, b * KB, scale, m, l, o, d, p);
    block_values(vp + b * KB * d, p, o, d, dv, rp);
  }
}

/* prefill_attention_bf16: causal attention of one sequence's chunk of ``len`` new tokens at
 * positions context.. over its keys 0..context+len-1, all already in the pool (the chunk's
 * own too), read through its block table.
 *
 * q: [len] rows of q_stride elements, each nq heads of d; out: [len, nq, d]; d % 32 == 0,
 * d <= 256, nq % nkv == 0; scratch: prefill_attention_scratch(context + len, d) floats. */
void prefill_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_pool,
                            const uint16_t *v_pool, long blocks, long bs, const int64_t *table,
                            long context, long len, long nq, long nkv, long d, float scale,
                            float *scratch, uint16_t *out) {
  long group = nq / nkv, total = context + len, packed = (total + KB - 1) / KB * KB * d;
  pair_t *kp = (pair_t *)scratch;
  uint16_t *vp = (uint16_t *)(scratch + packed / 2);
  float *work = scratch + packed;
  for (long h = 0; h < nkv; h++) {
    pack(k_pool + h * blocks * bs * d, v_pool + h * blocks * bs * d, table, bs, d, total, kp,
         vp);
    for (long row0 = 0; row0 < len * group; row0 += QR) {
      long real = len * group - row0 < QR ? len * group - row0 : QR;
      qrow_t rows[QR];
      uint16_t *dst[QR];
      for (long r = 0; r < QR; r++) {
        long t = (row0 + (r < real ? r : 0)) / group, g = (row0 + (r < real ? r : 0)) % group;
        rows[r].q = (const pair_t *)(q + t * q_stride + (h * group + g) * d);
        rows[r].pos = context + t;
        dst[r] = out + (t * nq + h * group + g) * d;
      }
      switch (d) {
        case 64: attend(rows, real, kp, vp, d, scale, work, 4, 4); break;
        case 128: attend(rows, real, kp, vp, d, scale, work, 8, 2); break;
        case 256: attend(rows, real, kp, vp, d, scale, work, 16, 1); break;
        default: attend(rows, real, kp, vp, d, scale, work, (int)(d / 16), 1);
      }
      const float *o = work, *l = work + QR * d + QR;
      for (long r = 0; r < real; r++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(l + 16 * r)));
        for (long c = 0; c < d; c += 16)
          store_bf16x16(dst[r] + c, round_bf16(_mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), inv)));
      }
    }
  }
}
