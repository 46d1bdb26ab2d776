/* Shared helpers of the native kernels (bf16 on AVX512-BF16): conversions, rounding, a
 * 16-way sum and exp. Each kernel file includes it; all of them are compiled into one library
 * (build.py). */
#ifndef CLEAVE_SIMD_H
#define CLEAVE_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline __m512 round_bf16(__m512 x) { /* fp32 -> nearest-even bf16 -> fp32 */
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
  /* NaN: quieted, so its top 16 bits stay NaN */
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x00400000));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, _mm512_castsi512_ps(quiet));
}

/* the lanes in ``keep`` of x (already bf16-valued) to p */
static inline void store_bf16x16_masked(uint16_t *p, __mmask16 keep, __m512 x) {
  _mm256_mask_storeu_epi16(p, keep, _mm512_cvtepi32_epi16(
      _mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

static inline void store_bf16x16(uint16_t *p, __m512 x) { store_bf16x16_masked(p, 0xffff, x); }

static inline __m512 load_bf16x16(const uint16_t *p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The sums of 16 vectors, lane n holding a[n]'s: a transpose tree (48 shuffles and adds)
 * instead of 16 lane reductions (about 160). */
static inline __m512 sum16(const __m512 a[16]) {
  __m512 s[8], u[4];
  for (int p = 0; p < 8; p++) {
    __m512 x = a[(p >> 1) * 4 + (p & 1) * 2], y = a[(p >> 1) * 4 + (p & 1) * 2 + 1];
    s[p] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int p = 0; p < 4; p++) {
    __m512d x = _mm512_castps_pd(s[2 * p]), y = _mm512_castps_pd(s[2 * p + 1]);
    u[p] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                            _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
  __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                            _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0x88), _mm512_shuffle_f32x4(v0, v1, 0xdd));
}

/* e^x for 16 lanes, x <= 88: 2^n * p(r) with x = n ln2 + r, |r| <= ln2/2, p a degree-6
 * Taylor polynomial (relative error < 2e-7). */
static inline __m512 exp_nonpositive_or_small(__m512 x) {
  /* e^-87 is below fp32's normal range; NaN stays NaN (max/min return their second
   * operand when either is NaN) */
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

/* bf16(bf16(silu(g)) * u) for bf16-valued g, u, as torch's bf16 F.silu(gate) * up rounds.
 * e^-g overflows to inf past g < -88.7, as torch's does (silu = -0 there): the clamp at 89
 * keeps the polynomial's argument small and still scales to inf */
static inline __m512 silu_mul16(__m512 g, __m512 u) {
  __m512 e = exp_nonpositive_or_small(_mm512_min_ps(_mm512_set1_ps(89.0f),
                                                    _mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
  return round_bf16(_mm512_mul_ps(s, u));
}

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

/* the first n of 16 lanes (none for n <= 0) */
static inline __mmask16 first(long n) {
  return (__mmask16)(n <= 0 ? 0u : n >= 16 ? 0xffffu : (1u << n) - 1);
}

/* The kernels one file calls from another. */
void packed_linear_bf16(const uint16_t *x, long ldx, const uint16_t *wp, const uint16_t *bias,
                        uint16_t *y, long ldy, long M, long N, long K, int silu);
void decode_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_pool,
                           const uint16_t *v_pool, long blocks, long bs, const int64_t *tables,
                           long table_width, const int64_t *lengths, long seqs, long nq,
                           long nkv, long d, float scale, float *scratch, uint16_t *out);
void prefill_attention_bf16(const uint16_t *q, long q_stride, const uint16_t *k_pool,
                            const uint16_t *v_pool, long blocks, long bs, const int64_t *table,
                            long context, long len, long nq, long nkv, long d, float scale,
                            float *scratch, uint16_t *out);

#endif
