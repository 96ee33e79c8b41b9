// Long passes (prefill chunks of at least 20 tokens): the matrix products run in cuBLAS
// (src/long_pass.rs), these kernels prepare their operands and run attention's masked softmax.
// Attention's products split their operands the same way (queries, keys, values, probabilities).
// Checked against the CPU reference like every stage: `gpu_check fixtures` and
// `tests/gpu_forward.rs` prefill long prompts through this path, in one pass and in chunks.
//
// Precision: a weight w (exact in f32 after dequantisation) is split into fp16 parts
// w = w_hi + w_lo, an input x likewise; Σ w·x is taken as Σ (w_hi·x_hi + w_lo·x_hi + w_hi·x_lo)
// with f32 accumulation, so each product carries ~2^-22 of its value, as the tensor-core matvec
// does for its inputs (matvec_mma.cu).
#include "common.cuh"

__device__ __forceinline__ unsigned short f32_to_f16(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}

// x → (high, low) fp16 parts.
__device__ __forceinline__ void split_f16(float x, unsigned short& hi, unsigned short& lo) {
  hi = f32_to_f16(x);
  lo = f32_to_f16(__fsub_rn(x, f16_to_f32(hi)));
}

// Rows [r0, r0 + n) of a 4-bit row-major matrix (FMT_Q4), or of any dense one, widened into
// `out` [n, 2·cols] fp16: high parts in columns [0, cols), low parts in [cols, 2·cols). One thread
// per 8 consecutive weights (one code word; 8 divides every group size).
extern "C" __global__ void widen_rows(Mat W, int r0, int n, unsigned short* __restrict__ out) {
  const u64 words = (u64)n * (W.cols / 8);
  const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= words) return;
  const u64 r = i / (W.cols / 8);
  const int k0 = (int)(i % (W.cols / 8)) * 8;
  unsigned short hi[8], lo[8];
  if (W.fmt == FMT_Q4) {
    const unsigned word = ((const unsigned*)W.w)[(r0 + r) * (u64)(W.cols / 8) + k0 / 8];
    const float2 sb = ((const float2*)W.sb)[(r0 + r) * (u64)(W.cols / W.gs) + k0 / W.gs];
#pragma unroll
    for (int j = 0; j < 8; j++) split_f16(q4_weight((word >> (4 * j)) & 15u, sb.x, sb.y), hi[j], lo[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; j++) split_f16(mat_elem(W, r0 + r, k0 + j), hi[j], lo[j]);
  }
  uint4* dh = (uint4*)(out + r * 2 * (u64)W.cols + k0);
  uint4* dl = (uint4*)(out + r * 2 * (u64)W.cols + W.cols + k0);
  *dh = make_uint4(hi[0] | (unsigned)hi[1] << 16, hi[2] | (unsigned)hi[3] << 16, hi[4] | (unsigned)hi[5] << 16,
                   hi[6] | (unsigned)hi[7] << 16);
  *dl = make_uint4(lo[0] | (unsigned)lo[1] << 16, lo[2] | (unsigned)lo[3] << 16, lo[4] | (unsigned)lo[5] << 16,
                   lo[6] | (unsigned)lo[7] << 16);
}

// The same for a matrix in the tensor-core tiled layout (FMT_Q4T, see matvec_mma.cu): tiles
// [t0, t0 + nt) into `out` [16·nt, 2·cols]. A block takes 16 rows × WIDEN_CHUNKS 64-column chunks:
// a warp per chunk decodes its codes into shared memory (lane (gid, tig)'s word r holds at bits
// 8i + 4s the code XOR 8 of row gid + 8·(r % 2), column 32s + 16·(r / 2) + 4·tig + i), then the block
// writes whole rows. Padding rows and columns are not written.
#define WIDEN_CHUNKS 8
#define WIDEN_ROW_WORDS (WIDEN_CHUNKS * 32 + 4)  // a row's fp16 pairs, padded: conflict-free stores
extern "C" __global__ void __launch_bounds__(WIDEN_CHUNKS * 32)
widen_tiles(Mat W, int t0, int nt, unsigned short* __restrict__ out) {
  __shared__ __align__(16) unsigned hi_s[16][WIDEN_ROW_WORDS];
  __shared__ __align__(16) unsigned lo_s[16][WIDEN_ROW_WORDS];
  const int chunks = (W.cols + 63) / 64, groups = chunks * 64 / W.gs;
  const int per_tile = (chunks + WIDEN_CHUNKS - 1) / WIDEN_CHUNKS;
  const int tl = blockIdx.x / per_tile, c0 = (blockIdx.x % per_tile) * WIDEN_CHUNKS, tile = t0 + tl;
  const int lane = threadIdx.x & 31, cl = threadIdx.x >> 5, c = c0 + cl, gid = lane >> 2, tig = lane & 3;
  if (tl >= nt) return;
  if (c < chunks) {
    const uint4 q = ((const uint4*)W.w)[((u64)tile * chunks + c) * 32 + lane];
    const unsigned words[4] = {q.x, q.y, q.z, q.w};
    const float4* sb = (const float4*)W.sb + (u64)tile * groups * 8 + gid;
#pragma unroll
    for (int r = 0; r < 4; r++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {  // k-step e / 2, columns 2·(e % 2) and 2·(e % 2) + 1 of the lane's four
        const int row = gid + 8 * (r & 1), col = 32 * (e >> 1) + 16 * (r >> 1) + 4 * tig + 2 * (e & 1);
        const float4 s = sb[(u64)((c * 64 + col) / W.gs) * 8];
        const float scale = (r & 1) ? s.z : s.x, bias = (r & 1) ? s.w : s.y;
        const int sh = 4 * (e >> 1) + 16 * (e & 1);  // bits of column col; col + 1 is 8 bits up
        unsigned short h0, l0, h1, l1;
        split_f16(q4_weight(((words[r] >> sh) & 15u) ^ 8u, scale, bias), h0, l0);
        split_f16(q4_weight(((words[r] >> (sh + 8)) & 15u) ^ 8u, scale, bias), h1, l1);
        hi_s[row][cl * 32 + col / 2] = h0 | (unsigned)h1 << 16;
        lo_s[row][cl * 32 + col / 2] = l0 | (unsigned)l1 << 16;
      }
    }
  }
  __syncthreads();
  const int vecs = (min(WIDEN_CHUNKS * 64, W.cols - c0 * 64)) / 8;  // uint4s (8 halfs) per row
  for (int i = threadIdx.x; i < 16 * vecs; i += blockDim.x) {
    const int r = i / vecs, v = i % vecs;
    if (tile * 16 + r >= W.rows) break;  // rows past the end come last
    unsigned short* dst = out + (u64)(tl * 16 + r) * 2 * W.cols + c0 * 64 + 8 * v;
    *(uint4*)dst = *(const uint4*)&hi_s[r][4 * v];
    *(uint4*)(dst + W.cols) = *(const uint4*)&lo_s[r][4 * v];
  }
}

// Inputs x [t, cols] (row stride `cols`) split into `out` [t, 3·cols] fp16 as (high | high | low):
// the first 2·cols columns meet a widened matrix's (high | low), the last its high parts. With
// `gate` non-null the input is gelu(x)·gate (row stride `gstride`), as the matvecs fuse it.
extern "C" __global__ void split_inputs(const float* __restrict__ x, const float* __restrict__ gate, int gstride,
                                        int cols, int t, unsigned short* __restrict__ out) {
  const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (u64)t * cols) return;
  const u64 j = i / cols;
  const int k = (int)(i % cols);
  float v = x[i];
  if (gate) v = __fmul_rn(gelu_tanh(v), gate[j * gstride + k]);
  unsigned short hi, lo;
  split_f16(v, hi, lo);
  unsigned short* row = out + j * 3 * (u64)cols;
  row[k] = hi;
  row[cols + k] = hi;
  row[2 * cols + k] = lo;
}

// dst[b][a][c] = src[a][b][c] for a < A, b < B, c < C (floats): attention's outputs
// [kv_heads, t, group·hd] back to [t, kv_heads, group·hd].
extern "C" __global__ void swap_rows(const float* __restrict__ src, float* __restrict__ dst, int A, int B, int C) {
  const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (u64)A * B * C) return;
  const int c = (int)(i % C);
  const u64 ab = i / C;
  const int b = (int)(ab % B), a = (int)(ab / B);
  dst[((u64)b * A + a) * C + c] = src[i];
}

// Queries q [t, heads·hd] (head h = g·group + j) to `out` [kv_heads g][t][group j][3·hd] fp16 as
// (high | low | high): each KV head's queries one matrix, meeting keys split (high | high | low).
extern "C" __global__ void split_queries(const float* __restrict__ q, unsigned short* __restrict__ out, int t,
                                         int heads, int kv_heads, int hd) {
  const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (u64)t * heads * hd) return;
  const int d = (int)(i % hd), h = (int)(i / hd % heads), tok = (int)(i / hd / heads);
  const int group = heads / kv_heads, g = h / group, j = h % group;
  unsigned short hi, lo;
  split_f16(q[i], hi, lo);
  unsigned short* row = out + ((((u64)g * t + tok) * group + j) * 3) * hd;
  row[d] = hi;
  row[hd + d] = lo;
  row[2 * hd + d] = hi;
}

// Keys and values of positions [first, first + n) in order, from the committed cache (before p0;
// ring slot pos mod ring when ring > 0) or this pass's staged rows (from p0), split into fp16:
// keys to kg [n][kv_heads][3·hd] as (high | high | low), values to vg [2][n][kv_heads·hd] (high
// parts, then low parts).
extern "C" __global__ void kv_gather(const float* __restrict__ kc, const float* __restrict__ vc,
                                     const float* __restrict__ ks, const float* __restrict__ vs,
                                     unsigned short* __restrict__ kg, unsigned short* __restrict__ vg, int first,
                                     int n, int p0, int ring, int kv_heads, int hd) {
  const int kvw = kv_heads * hd;
  const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (u64)n * kvw) return;
  const int j = (int)(i / kvw), e = (int)(i % kvw), pos = first + j;
  const u64 src = pos < p0 ? (u64)(ring > 0 ? pos % ring : pos) * kvw + e : (u64)(pos - p0) * kvw + e;
  unsigned short hi, lo;
  split_f16(pos < p0 ? kc[src] : ks[src], hi, lo);
  unsigned short* krow = kg + ((u64)j * kv_heads + e / hd) * 3 * hd;
  krow[e % hd] = hi;
  krow[hd + e % hd] = hi;
  krow[2 * hd + e % hd] = lo;
  split_f16(pos < p0 ? vc[src] : vs[src], hi, lo);
  vg[i] = hi;
  vg[(u64)n * kvw + i] = lo;
}

// Scores s [rows, n] (f32, row stride ld) → probabilities p [rows, 2·ld] fp16 (high parts in
// [0, n), low parts in [ld, ld + n)), one block per row. Row r is query token t0 + (r / group) % tq (rows run over (kv head, token, head
// in group)), at position p0 + that; column j is key position k0 + j. A key is seen when
// k ≤ pos and, with a window, k > pos − window. p = exp(score·scale − max) / Σ, zero for keys
// not seen (the decode kernel's arithmetic: scores rounded after scaling, exp of the difference,
// one division per row).
extern "C" __global__ void __launch_bounds__(256) masked_softmax(const float* __restrict__ s,
                                                                 unsigned short* __restrict__ p, int n, int ld,
                                                                 int group,
                                                                 int tq, int t0, int p0, int k0, int window,
                                                                 float scale) {
  const float* row = s + (u64)blockIdx.x * ld;
  unsigned short* out = p + (u64)blockIdx.x * 2 * ld;
  const int pos = p0 + t0 + (blockIdx.x / group) % tq;
  const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
  const int j0 = max(0, lo - k0), j1 = min(n, pos - k0 + 1);  // seen keys: [j0, j1)
  float mx = NEG_INF;
  for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) mx = fmaxf(mx, __fmul_rn(row[j], scale));
  mx = block_max(mx);
  float sum = 0.f;
  for (int j = j0 + threadIdx.x; j < j1; j += blockDim.x) sum += expf(__fmul_rn(row[j], scale) - mx);
  sum = block_sum(sum);
  const float inv = 1.f / sum;
  for (int j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = (j >= j0 && j < j1) ? __fmul_rn(expf(__fmul_rn(row[j], scale) - mx), inv) : 0.f;
    unsigned short hi, lo16;
    split_f16(v, hi, lo16);
    out[j] = hi;
    out[ld + j] = lo16;
  }
}
