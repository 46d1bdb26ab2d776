/* Cleave's native CPU kernels (bf16, AVX512-BF16), built on first use by native/build.py.
 *
 * linear_bf16: y = x @ w.T (+ bias) for the few rows of a decode step. Stock kernels (oneDNN's
 * bf16 inner product, packed or not) stream decode's weights at 6-9 GB/s on one core here,
 * a third of what the core can read (bench/linear_micro.py): they are built for compute-bound
 * shapes. This one reads w row-major, four rows at a time, and prefetches the rows two tiles
 * ahead in address order, so the whole matrix is one forward stream the memory system can keep
 * full; each tile of w is applied to up to four rows of x while it is in registers. Products
 * are bf16 x bf16 summed in fp32 (VDPBF16PS), rounded once to bf16 at the end (round to
 * nearest even), as oneDNN does; only the order of the fp32 sums differs.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#define TILE 4   /* rows of w per tile */
#define AHEAD 2  /* tiles prefetched ahead */

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
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, x);
}

static inline void store_bf16x16(uint16_t *p, __m512 x) { /* x already bf16-valued */
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(
      _mm512_castps_si512(x), 16)));
}

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
     * 50 against 40 ms) */
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
  float sums[TILE][4];
  if (mb == 4) /* lane 4 i + j of sum16 holds acc[i][j]'s sum */
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

static inline __mmask16 first(long n) { return (__mmask16)(n >= 16 ? 0xffffu : (1u << n) - 1); }

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
 * own too), read in place through its block table. Four query rows at a time share each value
 * row's conversion; scores, softmax and sums are fp32, the output rounded to bf16 once.
 * torch's tiled path (two bmm's and a softmax per 64-query tile, over keys gathered out of the
 * pool) took about twice as long here.
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

/* ---- One whole decoder layer for a decode step (Llama-shaped families) ----
 * A decode step of the default model issued about 1,700 torch calls for its small ops (norms,
 * rotary, residual adds, SiLU-and-mul, KV writes): several microseconds of dispatch and a new
 * tensor each, a fixed cost of milliseconds per step whatever the batch. This runs a layer's
 * whole decode forward in one call, with the same roundings as the torch path: every op's
 * result is rounded to bf16 where torch's bf16 op would round it. */



static inline __m512 exp_any(__m512 x) { /* e^x, |x| <= 88 after clamping */
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
  return exp_nonpositive_or_small(x);
}

typedef struct {
  long hidden, nq, nkv, d, inter;
  float eps, scale;
  const uint16_t *in_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *down;
} layer_t;

/* y = weight * bf16(x * rsqrt(mean(x^2) + eps)), per row of n (n % 16 == 0) */
void rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long rows, long n,
                     float eps) {
  for (long r = 0; r < rows; r++, x += n, y += n) {
    __m512 ss = _mm512_setzero_ps();
    for (long c = 0; c < n; c += 16) {
      __m512 v = load_bf16x16(x + c);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
    for (long c = 0; c < n; c += 16) {
      __m512 v = round_bf16(_mm512_mul_ps(load_bf16x16(x + c), inv));
      store_bf16x16(y + c, round_bf16(_mm512_mul_ps(v, load_bf16x16(w + c))));
    }
  }
}

/* h = bf16(h + o), per element */
static void add_into(uint16_t *h, const uint16_t *o, long count) {
  for (long c = 0; c < count; c += 16)
    store_bf16x16(h + c, round_bf16(_mm512_add_ps(load_bf16x16(h + c), load_bf16x16(o + c))));
}

/* x' = bf16(bf16(x * cos) + bf16(roll(x, d/2) * sin)), sin's first half negated (rotary.py) */
static void rotate(uint16_t *x, const uint16_t *cos, const uint16_t *sin, long heads, long d) {
  float tmp[256];
  for (long hh = 0; hh < heads; hh++, x += d) {
    for (long c = 0; c < d; c++) tmp[c] = bf16_to_float(x[c]);
    for (long c = 0; c < d; c += 16) {
      __m512 a = round_bf16(_mm512_mul_ps(_mm512_loadu_ps(tmp + c), load_bf16x16(cos + c)));
      long src = (c + d / 2) % d; /* roll by d/2: out[c] = x[c - d/2] */
      __m512 b = round_bf16(_mm512_mul_ps(_mm512_loadu_ps(tmp + src), load_bf16x16(sin + c)));
      store_bf16x16(x + c, round_bf16(_mm512_add_ps(a, b)));
    }
  }
}

/* x [rows] of row_stride elements, each heads of d: rotated in place, row r by cos/sin [r] */
void rotary_bf16(uint16_t *x, long rows, long row_stride, long heads, long d,
                 const uint16_t *cos, const uint16_t *sin) {
  for (long r = 0; r < rows; r++) rotate(x + r * row_stride, cos + r * d, sin + r * d, heads, d);
}

/* a = bf16(bf16(silu(gate)) * up) for gate_up rows [gate | up] of 2 * inter */
void silu_mul_bf16(const uint16_t *gu, uint16_t *a, long rows, long inter) {
  for (long r = 0; r < rows; r++, gu += 2 * inter, a += inter)
    for (long c = 0; c < inter; c += 16) {
      __m512 g = load_bf16x16(gu + c);
      __m512 e = exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g));
      __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
      store_bf16x16(a + c, round_bf16(_mm512_mul_ps(s, load_bf16x16(gu + inter + c))));
    }
}

/* h [rows, hidden] in place. cos/sin: [rows, d]. slots: [rows] pool slots for the new KV.
 * fbuf: floats for the attention scratch; bbuf: bf16 scratch of
 * rows * (hidden + (nq + 2 nkv) d + nq d + 2 inter + inter) elements. */
void decode_layer_bf16(const layer_t *L, uint16_t *h, long rows, const uint16_t *cos,
                       const uint16_t *sin, uint16_t *k_pool, uint16_t *v_pool, long blocks,
                       long bs, const int64_t *slots, const int64_t *tables, long table_width,
                       const int64_t *lengths, float *fbuf, uint16_t *bbuf) {
  long H = L->hidden, d = L->d, nq = L->nq, nkv = L->nkv, I = L->inter;
  long width = (nq + 2 * nkv) * d;
  uint16_t *xn = bbuf, *qkv = xn + rows * H, *attn = qkv + rows * width,
           *gu = attn + rows * nq * d, *act = gu + rows * 2 * I, *out = xn;
  rms_norm_bf16(h, L->in_norm, xn, rows, H, L->eps);
  linear_bf16(xn, H, L->qkv, L->qkv_bias, qkv, width, rows, width, H);
  for (long r = 0; r < rows; r++) {
    uint16_t *row = qkv + r * width;
    rotate(row, cos + r * d, sin + r * d, nq + nkv, d); /* q and k heads are adjacent */
    for (long hh = 0; hh < nkv; hh++) {
      long at = (hh * blocks * bs + slots[r]) * d;
      memcpy(k_pool + at, row + (nq + hh) * d, d * 2);
      memcpy(v_pool + at, row + (nq + nkv + hh) * d, d * 2);
    }
  }
  decode_attention_bf16(qkv, width, k_pool, v_pool, blocks, bs, tables, table_width, lengths,
                        rows, nq, nkv, d, L->scale, fbuf, attn);
  linear_bf16(attn, nq * d, L->o, L->o_bias, out, H, rows, H, nq * d);
  add_into(h, out, rows * H);
  rms_norm_bf16(h, L->post_norm, xn, rows, H, L->eps);
  linear_bf16(xn, H, L->gate_up, NULL, gu, 2 * I, rows, 2 * I, H);
  silu_mul_bf16(gu, act, rows, I);
  linear_bf16(act, I, L->down, NULL, out, H, rows, H, I);
  add_into(h, out, rows * H);
}
