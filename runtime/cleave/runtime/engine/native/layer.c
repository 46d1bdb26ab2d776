/* One whole decoder layer for an engine step (Llama-shaped families), and its row kernels.
 * A step of the default model issued about 1,700 torch calls for its small ops (norms,
 * rotary, residual adds, KV writes, slicing): several microseconds of dispatch and a new
 * tensor each, a fixed cost of milliseconds per step whatever the batch, and passes over
 * fresh tensors that grow with it (prefill steps of 384-512 tokens spent 6 % of their forwards
 * there).
 * This runs a layer's whole forward, decodes and prefill chunks alike, in one call, with the
 * same roundings as the torch path: every op's result is rounded to bf16 where torch's bf16
 * op would round it. */
#include "simd.h"

typedef struct {
  long hidden, nq, nkv, d, inter;
  float eps, scale;
  /* qkv, o, down: packed (gemm.c); gate_up packed with its halves' rows interleaved, so the
   * GEMM's epilogue applies SiLU-and-mul */
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

/* idx[r] = the index torch.argmax gives for row r of x [rows, n] (fp32): its first largest
 * value's, or its first NaN's. The sampler's greedy pick over a step's logits: torch's CPU
 * argmax read them at 4-6 GB/s (1.4 ms for 32 rows of a 49k vocabulary). Each lane keeps its
 * first largest (strictly greater replaces), then the lowest index among the lanes holding
 * the row's largest. */
void argmax_f32(const float *x, long rows, long n, int64_t *idx) {
  const __m512i step = _mm512_set1_epi32(16);
  for (long r = 0; r < rows; r++, x += n) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setzero_si512(),
            lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    for (long c = 0; c < n; c += 16, lane = _mm512_add_epi32(lane, step)) {
      __mmask16 m = first(n - c);
      __m512 v = _mm512_mask_loadu_ps(best, m, x + c); /* lanes past n change nothing */
      __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_mask_mov_ps(best, gt, v);
      at = _mm512_mask_mov_epi32(at, gt, lane);
    }
    if (nan) {
      long c = 0;
      while (!isnan(x[c])) c++;
      idx[r] = c;
      continue;
    }
    __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)),
                                       _CMP_EQ_OQ);
    idx[r] = _mm512_mask_reduce_min_epi32(top, at);
  }
}

/* h [rows, hidden] in place: the step's first ``decodes`` rows are one token of a sequence
 * each, over tables [decodes, table_width] and lengths; then ``chunks`` prefill chunks, chunk
 * c the rows spans[3c].. of spans[3c+1] tokens after spans[3c+2] of context, over its block
 * table, row c of chunk_tables [chunks, chunk_width]. cos/sin: [rows, d]. slots: [rows] pool
 * slots for the new KV. fbuf: floats for the attention scratch, the most any one call takes;
 * bbuf: bf16 scratch of rows * (hidden + (nq + 2 nkv) d + nq d + inter) elements. */
void step_layer_bf16(const layer_t *L, uint16_t *h, long rows, const uint16_t *cos,
                     const uint16_t *sin, uint16_t *k_pool, uint16_t *v_pool, long blocks,
                     long bs, const int64_t *slots, long decodes, const int64_t *tables,
                     long table_width, const int64_t *lengths, long chunks,
                     const int64_t *spans, const int64_t *chunk_tables, long chunk_width,
                     float *fbuf, uint16_t *bbuf) {
  long H = L->hidden, d = L->d, nq = L->nq, nkv = L->nkv, I = L->inter;
  long width = (nq + 2 * nkv) * d;
  uint16_t *xn = bbuf, *qkv = xn + rows * H, *attn = qkv + rows * width,
           *act = attn + rows * nq * d, *out = xn;
  rms_norm_bf16(h, L->in_norm, xn, rows, H, L->eps);
  packed_linear_bf16(xn, H, L->qkv, L->qkv_bias, qkv, width, rows, width, H, 0);
  for (long r = 0; r < rows; r++) {
    uint16_t *row = qkv + r * width;
    rotate(row, cos + r * d, sin + r * d, nq + nkv, d); /* q and k heads are adjacent */
    for (long hh = 0; hh < nkv; hh++) {
      long at = (hh * blocks * bs + slots[r]) * d;
      memcpy(k_pool + at, row + (nq + hh) * d, d * 2);
      memcpy(v_pool + at, row + (nq + nkv + hh) * d, d * 2);
    }
  }
  if (decodes)
    decode_attention_bf16(qkv, width, k_pool, v_pool, blocks, bs, tables, table_width, lengths,
                          decodes, nq, nkv, d, L->scale, fbuf, attn);
  for (long c = 0; c < chunks; c++) {
    long row0 = spans[3 * c];
    prefill_attention_bf16(qkv + row0 * width, width, k_pool, v_pool, blocks, bs,
                           chunk_tables + c * chunk_width, spans[3 * c + 2], spans[3 * c + 1],
                           nq, nkv, d, L->scale, fbuf, attn + row0 * nq * d);
  }
  packed_linear_bf16(attn, nq * d, L->o, L->o_bias, out, H, rows, H, nq * d, 0);
  add_into(h, out, rows * H);
  rms_norm_bf16(h, L->post_norm, xn, rows, H, L->eps);
  packed_linear_bf16(xn, H, L->gate_up, NULL, act, I, rows, I, H, 1);
  packed_linear_bf16(act, I, L->down, NULL, out, H, rows, H, I, 0);
  add_into(h, out, rows * H);
}
