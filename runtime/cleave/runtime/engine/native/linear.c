/* linear_bf16: y = x @ w.T (+ bias) for the few rows of a decode step. Stock kernels (oneDNN's
 * bf16 inner product, packed or not) stream decode's weights at 6-9 GB/s on one core here,
 * a third of what the core can read (bench/linear_micro.py): they are built for compute-bound
 * shapes. This one reads w row-major, four rows at a time, and prefetches the rows two tiles
 * ahead in address order, so the whole matrix is one forward stream the memory system can keep
 * full; each tile of w is applied to up to four rows of x while it is in registers. Products
 * are bf16 x bf16 summed in fp32 (VDPBF16PS), rounded once to bf16 at the end (round to
 * nearest even), as oneDNN does; only the order of the fp32 sums differs.
 */
#include "simd.h"

#define TILE 4   /* rows of w per tile */
#define AHEAD 2  /* tiles prefetched ahead */

/* y[j * ldy + i] = bf16(s[4 i + j] + bias[i]) for i, j < 4, in vector registers: the scalar
 * stores it replaces cost a tenth of a 16-row forward's GEMVs */
static inline void store_tile(__m512 s, const uint16_t *bias, uint16_t *y, long ldy) {
  if (bias) { /* lane 4 i + j takes bias[i] */
    __m512 b = _mm512_castps128_ps512(_mm_castsi128_ps(_mm_slli_epi32(
        _mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)bias)), 16)));
    s = _mm512_add_ps(s, _mm512_permutexvar_ps(
        _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), b));
  }
  /* lane 4 j + i takes lane 4 i + j: each row of y's four outputs side by side */
  s = _mm512_permutexvar_ps(
      _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), s);
  uint16_t out[16];
  store_bf16x16(out, round_bf16(s));
  for (int j = 0; j < 4; j++) memcpy(y + j * ldy, out + 4 * j, 8);
}

/* One tile of ``rows`` (<= TILE) rows of w against ``mb`` rows of x (a compile-time constant
 * at each call site, so the accumulators stay in registers). K is a multiple of 32. */
static inline __attribute__((always_inline)) void tile(
    const uint16_t *x, long ldx, const uint16_t *t, long K, const uint16_t *bias, long n0,
    int rows, uint16_t *y, long ldy, const int mb, const char *prefetch, const char *end,
    int l1) {
  __m512 acc[TILE][4];
  for (int i = 0; i < TILE; i++)
    for (int j = 0; j < mb; j++) acc[i][j] = _mm512_setzero_ps();
  for (long k = 0; k < K; k += 32) {
    /* one tile's worth of lines over the tile's K/32 steps, in address order. Into L1 for a
     * few input rows (1 row: a decode step 14-15 against 16-18 ms into L2); into L2 for more,
     * where in L1 they evicted the input rows and the tile in use (16 rows: a forward's GEMVs
     * 44 against 33 ms) */
    if (prefetch)
      for (int i = 0; i < TILE; i++, prefetch += 64)
        if (prefetch < end) {
          if (l1) _mm_prefetch(prefetch, _MM_HINT_T0);
          else _mm_prefetch(prefetch, _MM_HINT_T1);
        }
    __m512bh xv[4];
    for (int j = 0; j < mb; j++) xv[j] = (__m512bh)_mm512_loadu_si512(x + j * ldx + k);
    for (int i = 0; i < TILE; i++) {
      __m512bh wv = (__m512bh)_mm512_loadu_si512(t + (i < rows ? i : 0) * K + k);
      for (int j = 0; j < mb; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv, xv[j]);
    }
  }
  if (mb == 4 && rows == TILE) { /* lane 4 i + j of sum16 holds acc[i][j]'s sum */
    store_tile(sum16((const __m512 *)acc), bias ? bias + n0 : NULL, y + n0, ldy);
    return;
  }
  float sums[TILE][4];
  if (mb == 4)
    _mm512_storeu_ps(&sums[0][0], sum16((const __m512 *)acc));
  else
    for (int i = 0; i < TILE; i++)
      for (int j = 0; j < mb; j++) sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
  for (int i = 0; i < rows; i++) {
    float b = bias ? bf16_to_float(bias[n0 + i]) : 0.0f;
    for (int j = 0; j < mb; j++) y[j * ldy + n0 + i] = float_to_bf16(sums[i][j] + b);
  }
}

/* y[m * ldy + n] = sum_k x[m * ldx + k] * w[n * K + k] + bias[n], for m < M, n < N.
 * x, w, bias, y are bf16 bit patterns; bias may be NULL; K % 32 == 0. */
void linear_bf16(const uint16_t *x, long ldx, const uint16_t *w, const uint16_t *bias,
                 uint16_t *y, long ldy, long M, long N, long K) {
  const char *end = (const char *)(w + N * K);
  for (long n0 = 0; n0 < N; n0 += TILE) {
    const uint16_t *t = w + n0 * K;
    int rows = N - n0 < TILE ? (int)(N - n0) : TILE;
    const char *prefetch = (const char *)(t + AHEAD * TILE * K);
    long m = 0;
    int l1 = M < 8;
    for (; m + 4 <= M; m += 4, prefetch = 0)
      tile(x + m * ldx, ldx, t, K, bias, n0, rows, y + m * ldy, ldy, 4, prefetch, end, l1);
    switch (M - m) {
      case 3: tile(x + m * ldx, ldx, t, K, bias, n0, rows, y + m * ldy, ldy, 3, prefetch, end, l1); break;
      case 2: tile(x + m * ldx, ldx, t, K, bias, n0, rows, y + m * ldy, ldy, 2, prefetch, end, l1); break;
      case 1: tile(x + m * ldx, ldx, t, K, bias, n0, rows, y + m * ldy, ldy, 1, prefetch, end, l1); break;
      default: break;
    }
  }
}

