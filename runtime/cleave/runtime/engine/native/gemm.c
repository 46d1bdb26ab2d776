/* packed_linear_bf16: y = x @ w.T (+ bias) over w packed once, at load, into panels of 64
 * outputs, each [K/2][64][2]: for every pair of inputs, the 64 outputs' weight pairs side by
 * side (kernels.py packs). One VDPBF16PS then adds a broadcast pair of x to 16 outputs at
 * once, so a block of up to 6 rows of x against a panel (24 accumulators) needs no horizontal
 * sums, and every weight byte is read once per block of rows in address order.
 *
 * It runs every linear at every row count (bench/linear_micro.py, one thread, a forward's four
 * shapes over 30 layers, docs/architecture.md's fifth and sixth passes): 1 row streams the
 * weights in 8.0 ms (26 GB/s, six panels at once) where the row-major GEMV it replaced (4x4
 * tiles of dot products, then horizontal sums) took 14.7; 32 rows 172 GFLOP/s against 136;
 * 512 rows (prefill) 199 against oneDNN's 191. Products are bf16 x bf16 summed in fp32,
 * rounded once to bf16 (nearest even), as oneDNN; only the order of the fp32 sums differs,
 * and it is the same for a row whatever its batch. */
#include "simd.h"

#define NP 64   /* outputs a panel */
#define MR 6    /* rows of x a block: 24 accumulators, 4 weight vectors, 1 broadcast */
#define SP 6    /* panels a block of one row: 24 accumulators, 6 streams */

/* Where the next panel is fetched into L2 while this one is computed: ``lines`` lines of it a
 * pair of inputs, from ``at`` up to ``end``. Every block carries it on, so the next panel
 * arrives over the whole of this one's work (from the first block alone, 8 rows took 16 ms a
 * forward's linears against 11). Up to 4 rows fetch nothing: the hardware prefetcher follows
 * their one forward stream best (1 row: 11.1-11.7 ms against 12.2-13.0 with the next panel
 * fetched, 12.3-13.5 fetching 1 KB ahead into L1). */
typedef struct {
  const char *at, *end;
  int lines;
} ahead_t;

/* rows [0, mr) of x against panels p.. p + sp - 1 (sp > 1 for up to 3 rows: one stream a
 * panel): y[m, 64 q + n] for each panel q and n < min(64, N - 64 q); with silu,
 * y[m, 32 q + n] = silu(gate) * up for n < 32, a panel's first 32 outputs being gate rows
 * 32 q.. and its last 32 the matching up rows (bias NULL) */
static inline __attribute__((always_inline)) void block(
    const uint16_t *x, long ldx, const uint16_t *w, long K, const uint16_t *bias, long p,
    long N, uint16_t *y, long ldy, const int mr, const int sp, ahead_t *pf, int silu) {
  __m512 acc[MR][4 * SP];
  long panel = K * NP;
  for (int m = 0; m < mr; m++)
    for (int j = 0; j < 4 * sp; j++) acc[m][j] = _mm512_setzero_ps();
  for (long k2 = 0; k2 < K / 2; k2++, w += 2 * NP) {
    for (int l = 0; l < pf->lines && pf->at < pf->end; l++, pf->at += 64)
      _mm_prefetch(pf->at, _MM_HINT_T1);
    __m512bh xb[MR];
    for (int m = 0; m < mr; m++) {
      uint32_t pair;
      memcpy(&pair, x + m * ldx + 2 * k2, 4);
      xb[m] = (__m512bh)_mm512_set1_epi32((int)pair);
    }
    for (int j = 0; j < 4 * sp; j++) { /* each weight vector loaded once for all the rows */
      __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (j / 4) * panel + 32 * (j % 4));
      for (int m = 0; m < mr; m++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv, xb[m]);
    }
  }
  for (int s = 0; s < sp; s++) {
    long q = p + s;
    if (silu) { /* the gate_up output is rounded to bf16 first, as torch's would be */
      for (int j = 0; j < 2; j++)
        for (int m = 0; m < mr; m++)
          store_bf16x16(y + m * ldy + NP / 2 * q + 16 * j, silu_mul16(
              round_bf16(acc[m][4 * s + j]), round_bf16(acc[m][4 * s + j + 2])));
      continue;
    }
    for (int j = 0; j < 4 && NP * q + 16 * j < N; j++) {
      long n = NP * q + 16 * j;
      __mmask16 keep = first(N - n);
      __m512 b = _mm512_setzero_ps();
      if (bias)
        b = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + n)), 16));
      for (int m = 0; m < mr; m++)
        store_bf16x16_masked(y + m * ldy + n, keep,
                             round_bf16(_mm512_add_ps(acc[m][4 * s + j], b)));
    }
  }
}

/* y[m * ldy + n] = sum_k x[m * ldx + k] * w[n, k] + bias[n] for m < M, n < N, w packed as
 * above (N rounded up to whole panels, zero-padded); bias may be NULL; K even. With silu, w is
 * a gated MLP's [gate; up] (2 N rows, N % 32 == 0) packed with 32 rows of each half a panel,
 * and y[m * ldy + n] = silu(gate_n) * up_n (the SiLU-and-mul fused into the epilogue: the
 * 2 N-wide product is never written out and read back). */
void packed_linear_bf16(const uint16_t *x, long ldx, const uint16_t *wp, const uint16_t *bias,
                        uint16_t *y, long ldy, long M, long N, long K, int silu) {
  if (M <= 0)
    return; /* no rows (a step whose chunks need no logits): SP / M below would trap */
  long panels = silu ? N / (NP / 2) : (N + NP - 1) / NP, panel = K * NP;
  /* rows in even blocks of at most MR (8 rows: 4 + 4, not 6 + 2) */
  long nblocks = (M + MR - 1) / MR;
  /* Up to 3 rows take 6 / M panels at once: the weights then come as that many forward
   * streams, of which the hardware prefetchers keep more lines in flight than of one. 1 row,
   * a forward's linears from memory, the two builds alternating in one process (a one-off
   * A/B, docs/architecture.md's sixth pass): 10.0-10.6 ms against 12.2-12.5; 3 rows 4 %
   * faster, 2 even. Each output's sum still runs over the inputs in order: the same bits in
   * any batch. */
  int sp = M <= 3 ? (int)(SP / M) : 1;
  for (long p = 0; p < panels; p += sp) {
    if (p + sp > panels) sp = 1; /* the last few panels one at a time */
    const uint16_t *w = wp + p * panel;
    const char *next = (const char *)(w + panel);
    /* a panel is 4 lines a pair of inputs: 4, 2, 2, 1, 1... of them a block; the next single
     * panel only, which is all blocks of one panel (M > 4) need */
    ahead_t pf = {next, p + 1 < panels ? next + 2 * panel : next,
                  M <= 4 ? 0 : (int)((4 + nblocks - 1) / nblocks)};
    if (sp > 1) {
      switch (M) {
        case 1: block(x, ldx, w, K, bias, p, N, y, ldy, 1, SP, &pf, silu); break;
        case 2: block(x, ldx, w, K, bias, p, N, y, ldy, 2, SP / 2, &pf, silu); break;
        default: block(x, ldx, w, K, bias, p, N, y, ldy, 3, SP / 3, &pf, silu); break;
      }
      continue;
    }
    long m = 0;
    for (long b = 0; b < nblocks; b++) {
      int mr = (int)(M / nblocks + (b < M % nblocks));
      const uint16_t *xb = x + m * ldx;
      uint16_t *yb = y + m * ldy;
      switch (mr) {
        case 6: block(xb, ldx, w, K, bias, p, N, yb, ldy, 6, 1, &pf, silu); break;
        case 5: block(xb, ldx, w, K, bias, p, N, yb, ldy, 5, 1, &pf, silu); break;
        case 4: block(xb, ldx, w, K, bias, p, N, yb, ldy, 4, 1, &pf, silu); break;
        case 3: block(xb, ldx, w, K, bias, p, N, yb, ldy, 3, 1, &pf, silu); break;
        case 2: block(xb, ldx, w, K, bias, p, N, yb, ldy, 2, 1, &pf, silu); break;
        default: block(xb, ldx, w, K, bias, p, N, yb, ldy, 1, 1, &pf, silu); break;
      }
      m += mr;
    }
  }
}
