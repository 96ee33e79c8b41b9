// y[t] = W · x[t] for up to MAXM activation columns at once, one warp per weight row.
//
// Every column runs exactly the same instruction sequence whatever the number of columns and
// whatever the other columns hold (per-column accumulators, a fixed lane split and a fixed
// shuffle reduction), so column t of a multi-token pass is bit-identical to a single-token pass.
#include "common.cuh"

#define MAXM 8
#define ROWS_PER_BLOCK 8

// x: [m, cols] (row stride cols), y: [m, rows] (row stride rows).
__device__ __forceinline__ void matvec_q4_row(const Mat& W, int r, const float* __restrict__ x, float* __restrict__ y,
                                              int m) {
  const int lane = threadIdx.x & 31;
  const int cols = W.cols, nw = cols >> 3, ng = cols / W.gs;
  const unsigned* __restrict__ wr = (const unsigned*)W.w + (u64)r * nw;
  const float2* __restrict__ sbr = (const float2*)W.sb + (u64)r * ng;
  float acc[MAXM];
#pragma unroll
  for (int j = 0; j < MAXM; j++) acc[j] = 0.f;
  if ((nw & 1) == 0) {
    // Two words (16 weights, always inside one group) per lane per step.
#pragma unroll 4
    for (int wi = lane * 2; wi < nw; wi += 64) {
      uint2 wv = *(const uint2*)(wr + wi);
      float2 sb = sbr[(wi * 8) / W.gs];
      float wf[16];
#pragma unroll
      for (int k = 0; k < 8; k++) {
        wf[k] = q4_weight((wv.x >> (4 * k)) & 15u, sb.x, sb.y);
        wf[8 + k] = q4_weight((wv.y >> (4 * k)) & 15u, sb.x, sb.y);
      }
#pragma unroll
      for (int j = 0; j < MAXM; j++) {
        if (j < m) {
          const float4* xv = (const float4*)(x + (u64)j * cols + wi * 8);
          float a = acc[j];
#pragma unroll
          for (int c = 0; c < 4; c++) {
            float4 xx = __ldg(xv + c);
            a = fmaf(wf[4 * c + 0], xx.x, a);
            a = fmaf(wf[4 * c + 1], xx.y, a);
            a = fmaf(wf[4 * c + 2], xx.z, a);
            a = fmaf(wf[4 * c + 3], xx.w, a);
          }
          acc[j] = a;
        }
      }
    }
  } else {
    for (int wi = lane; wi < nw; wi += 32) {
      unsigned wv = wr[wi];
      float2 sb = sbr[(wi * 8) / W.gs];
#pragma unroll
      for (int j = 0; j < MAXM; j++) {
        if (j < m) {
          const float* xv = x + (u64)j * cols + wi * 8;
          float a = acc[j];
#pragma unroll
          for (int k = 0; k < 8; k++) a = fmaf(q4_weight((wv >> (4 * k)) & 15u, sb.x, sb.y), xv[k], a);
          acc[j] = a;
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < MAXM; j++) {
    float s = warp_sum(acc[j]);
    if (j < m && lane == 0) y[(u64)j * W.rows + r] = s;
  }
}

__device__ __forceinline__ void matvec_dense_row(const Mat& W, int r, const float* __restrict__ x,
                                                 float* __restrict__ y, int m) {
  const int lane = threadIdx.x & 31;
  const int cols = W.cols;
  float acc[MAXM];
#pragma unroll
  for (int j = 0; j < MAXM; j++) acc[j] = 0.f;
  if (W.fmt == FMT_BF16 && (cols & 7) == 0) {
    // Eight bf16 weights (16 bytes) per lane per step.
    const uint4* wr = (const uint4*)((const bf16_t*)W.w + (u64)r * cols);
#pragma unroll 2
    for (int i = lane; i < (cols >> 3); i += 32) {
      uint4 wv = wr[i];
      float wf[8];
      unsigned u[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
      for (int k = 0; k < 4; k++) {
        wf[2 * k] = __uint_as_float(u[k] << 16);
        wf[2 * k + 1] = __uint_as_float(u[k] & 0xffff0000u);
      }
#pragma unroll
      for (int j = 0; j < MAXM; j++) {
        if (j < m) {
          const float4* xv = (const float4*)(x + (u64)j * cols + i * 8);
          float4 x0 = __ldg(xv), x1 = __ldg(xv + 1);
          float a = acc[j];
          a = fmaf(wf[0], x0.x, a);
          a = fmaf(wf[1], x0.y, a);
          a = fmaf(wf[2], x0.z, a);
          a = fmaf(wf[3], x0.w, a);
          a = fmaf(wf[4], x1.x, a);
          a = fmaf(wf[5], x1.y, a);
          a = fmaf(wf[6], x1.z, a);
          a = fmaf(wf[7], x1.w, a);
          acc[j] = a;
        }
      }
    }
  } else {
    for (int c = lane; c < cols; c += 32) {
      float wv = mat_elem(W, (u64)r, c);
#pragma unroll
      for (int j = 0; j < MAXM; j++)
        if (j < m) acc[j] = fmaf(wv, x[(u64)j * cols + c], acc[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < MAXM; j++) {
    float s = warp_sum(acc[j]);
    if (j < m && lane == 0) y[(u64)j * W.rows + r] = s;
  }
}

BIG_STAGE void matvec_body(const int vb, Mat W, const float* __restrict__ x, float* __restrict__ y, int m) {
  pdl_start();
  int r = vb * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (r >= W.rows) return;
  if (W.fmt == FMT_Q4) matvec_q4_row(W, r, x, y, m);
  else matvec_dense_row(W, r, x, y, m);
}
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * 32) matvec(Mat W, const float* __restrict__ x, float* __restrict__ y, int m) { matvec_body(blockIdx.x, W, x, y, m); }

// ---- 4-bit affine, many rows per warp -------------------------------------------------------
//
// A warp takes 8 rows and walks their columns in chunks of 512 (16 weights per lane): the lane's
// 16 activations are loaded once per chunk and reused for all 8 rows, and the 8 rows' weight
// loads are all in flight together. `wpr` warps share the same 8 rows, splitting the chunks
// (chunk c goes to warp c mod wpr); their partial sums are added in warp order. Columns are
// processed one after another with the same instructions, so every column's result is the same
// whatever the number of columns. Needs cols % 16 == 0 (group sizes are ≥ 32).

#define Q4_ROWS 8
#define Q4_CHUNK 512
// Chunks whose weights a warp holds in registers at once, and the blocks per SM the register
// budget must allow. Two chunks at once need ~155 registers: one 256-thread block per SM, eight
// warps to keep loads in flight. One chunk fits 128 registers without spills: two blocks per SM
// (the L2 prefetch keeps the memory busy, not the registers).
#define Q4_STEP 1
#define Q4_MIN_BLOCKS 2

// Nibble k of a word as the float q·2^(4k') without shifting it down: `w` is the word itself for
// k < 5 (k' = k) and the word shifted right by 12 for k ≥ 5 (k' = k − 3); OR-ing the masked bits
// into the mantissa of 2^23 and subtracting 2^23 is exact (q·2^(4k') < 2^23).
__device__ __forceinline__ float nibble_in_place(unsigned w, int k) {
  const int kk = k < 5 ? k : k - 3;
  return __uint_as_float(0x4B000000u | (w & (15u << (4 * kk)))) - 8388608.f;
}

// 2^(−4k'), the factor that undoes nibble_in_place's placement.
__device__ __forceinline__ float nibble_scale(int k) {
  const int kk = k < 5 ? k : k - 3;
  return __uint_as_float((unsigned)(127 - 4 * kk) << 23);
}

// Asks L2 for the codes and (scale, bias) pairs of the 8 rows from row0, the group's `wpr` warps
// splitting the lines. Issued before `pdl_start()`: the weights stream in while the previous
// kernel finishes, and every line of the rows is in flight at once instead of two chunks.
__device__ __forceinline__ void prefetch_rows_q4(const Mat& W, int row0, int ws, int wpr, int lane) {
  const u64 code_bytes = (u64)W.cols / 2, sb_bytes = (u64)(W.cols / W.gs) * 8;
  const int nc = (int)((code_bytes + 127) / 128), ns = (int)((sb_bytes + 127) / 128), per_row = nc + ns;
  for (int i = ws * 32 + lane; i < Q4_ROWS * per_row; i += wpr * 32) {
    const int row = min(row0 + i / per_row, W.rows - 1), l = i % per_row;
    const char* p = l < nc ? (const char*)W.w + row * code_bytes + l * 128
                           : (const char*)W.sb + row * sb_bytes + (l - nc) * 128;
    prefetch_l2(p);
  }
}

// With `gate` non-null the input is gelu(x)·gate instead of x (the GeGLU and PLE gates fused into
// the projection that consumes them); `gate_stride` is the gate's row stride.
template <bool GATED>
__device__ __forceinline__ void matvec_q4_body(const Mat& W, const float* __restrict__ x, float* __restrict__ y, int m,
                                               int wpr, const float* __restrict__ gate, int gate_stride, int blk) {
  __shared__ float red[8][Q4_ROWS][MAXM];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int groups_per_block = 8 / wpr;
  const int g = warp / wpr, ws = warp % wpr;
  const int row0 = (blk * groups_per_block + g) * Q4_ROWS;
  const int cols = W.cols, nw = cols >> 3, ng = cols / W.gs;
  const int nchunks = (cols + Q4_CHUNK - 1) / Q4_CHUNK;
  const unsigned* __restrict__ wbase = (const unsigned*)W.w;
  const float2* __restrict__ sbase = (const float2*)W.sb;
  for (int j = 0; j < m; j++) {
    float acc[Q4_ROWS];
#pragma unroll
    for (int r = 0; r < Q4_ROWS; r++) acc[r] = 0.f;
    // Q4_STEP of this warp's chunks per step, all their weight loads issued before any is used.
    for (int c = ws; c < nchunks; c += Q4_STEP * wpr) {
      uint2 wv[Q4_STEP][Q4_ROWS];
      float2 sb[Q4_STEP][Q4_ROWS];
#pragma unroll
      for (int h = 0; h < Q4_STEP; h++) {
        const int col = (c + h * wpr) * Q4_CHUNK + lane * 16;
        if (c + h * wpr < nchunks && col < cols) {
#pragma unroll
          for (int r = 0; r < Q4_ROWS; r++) {
            const int row = min(row0 + r, W.rows - 1);
            wv[h][r] = __ldcs((const uint2*)(wbase + (u64)row * nw + (col >> 3)));
            sb[h][r] = sbase[(u64)row * ng + col / W.gs];
          }
        }
      }
#pragma unroll
      for (int h = 0; h < Q4_STEP; h++) {
        const int col = (c + h * wpr) * Q4_CHUNK + lane * 16;
        if (c + h * wpr < nchunks && col < cols) {
          float xv[16];
          const float4* xp = (const float4*)(x + (u64)j * cols + col);
#pragma unroll
          for (int i = 0; i < 4; i++) {
            float4 t = __ldg(xp + i);
            xv[4 * i] = t.x;
            xv[4 * i + 1] = t.y;
            xv[4 * i + 2] = t.z;
            xv[4 * i + 3] = t.w;
          }
          if (GATED) {
            const float4* gp = (const float4*)(gate + (u64)j * gate_stride + col);
#pragma unroll
            for (int i = 0; i < 4; i++) {
              float4 t = __ldg(gp + i);
              xv[4 * i] = __fmul_rn(gelu_tanh(xv[4 * i]), t.x);
              xv[4 * i + 1] = __fmul_rn(gelu_tanh(xv[4 * i + 1]), t.y);
              xv[4 * i + 2] = __fmul_rn(gelu_tanh(xv[4 * i + 2]), t.z);
              xv[4 * i + 3] = __fmul_rn(gelu_tanh(xv[4 * i + 3]), t.w);
            }
          }
          // Σ w·x = scale·Σ q·x + bias·Σ x over the lane's 16 weights (one group). Nibble k is
          // read in place as q·2^(4k) (k < 5, or from w >> 12 for k ≥ 5) and paired with x
          // pre-scaled by the inverse power of two, which is exact.
          float xs = 0.f, xq[16];
#pragma unroll
          for (int k = 0; k < 16; k++) {
            xs += xv[k];
            xq[k] = xv[k] * nibble_scale(k & 7);
          }
#pragma unroll
          for (int r = 0; r < Q4_ROWS; r++) {
            const unsigned w0 = wv[h][r].x, w1 = wv[h][r].y, u0 = w0 >> 12, u1 = w1 >> 12;
            float q = 0.f;
#pragma unroll
            for (int k = 0; k < 8; k++) q = fmaf(nibble_in_place(k < 5 ? w0 : u0, k), xq[k], q);
#pragma unroll
            for (int k = 0; k < 8; k++) q = fmaf(nibble_in_place(k < 5 ? w1 : u1, k), xq[8 + k], q);
            acc[r] = fmaf(sb[h][r].x, q, fmaf(sb[h][r].y, xs, acc[r]));
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < Q4_ROWS; r++) {
      float s = warp_sum(acc[r]);
      if (lane == 0) red[warp][r][j] = s;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < groups_per_block * Q4_ROWS * m; i += blockDim.x) {
    const int gg = i / (Q4_ROWS * m), r = (i / m) % Q4_ROWS, j = i % m;
    const int row = (blk * groups_per_block + gg) * Q4_ROWS + r;
    if (row >= W.rows) continue;
    float s = 0.f;
    for (int w = 0; w < wpr; w++) s += red[gg * wpr + w][r][j];
    y[(u64)j * W.rows + row] = s;
  }
  __syncthreads();  // `red` is reused by the block's next row groups
}

// The row groups of virtual block `blk` (as the body splits them) asked of L2 by this block.
__device__ __forceinline__ void prefetch_block_q4(const Mat& W, int wpr, int blk) {
  const int warp = threadIdx.x >> 5, groups_per_block = 8 / wpr;
  const int row0 = (blk * groups_per_block + warp / wpr) * Q4_ROWS;
  prefetch_rows_q4(W, row0, warp % wpr, wpr, threadIdx.x & 31);
}

// Virtual blocks 0 .. nblocks are spread over the grid (block b takes b, b + gridDim.x, …), so a
// grid of a few waves streams a whole matrix (the LM head too). Each block asks L2 for its first `ahead` virtual
// blocks before `pdl_start()` and for virtual block i + ahead before computing block i: the
// matrix streams from memory at full width while the math runs on lines already in L2. A virtual
// block's arithmetic does not depend on the grid, so neither does any result bit.
// `bid` and `nbid` are the block and the grid (the launch's, or the megakernel's stage's).
#define FOR_VIRTUAL_BLOCKS(PREFETCH, BODY)                                            \
  {                                                                                   \
    for (int i = 0; i < ahead; i++) {                                                 \
      const int v = bid + i * nbid;                                                   \
      if (v < nblocks) PREFETCH(v);                                                   \
    }                                                                                 \
    pdl_start();                                                                      \
    for (int v = bid; v < nblocks; v += nbid) {                                       \
      const int next = v + ahead * nbid;                                              \
      if (ahead > 0 && next < nblocks) PREFETCH(next);                                \
      BODY(v);                                                                        \
    }                                                                                 \
  }

// Up to three matrices of the same width on the same input in one launch (Q/K/V, gate/up):
// virtual blocks [0, nb0) compute y0 = W0·x, the next nb1 y1 = W1·x, the rest y2 = W2·x.
BIG_STAGE void matvec_q4_run(const int bid, const int nbid, Mat W0, Mat W1, Mat W2,
                                              const float* __restrict__ x, float* __restrict__ y0,
                                              float* __restrict__ y1, float* __restrict__ y2, int nb0, int nb1, int m,
                                              int wpr, int nblocks, int ahead) {
#define Q4_PREFETCH(b)                                     \
  if ((b) < nb0) prefetch_block_q4(W0, wpr, (b));          \
  else if ((b) < nb0 + nb1) prefetch_block_q4(W1, wpr, (b) - nb0); \
  else prefetch_block_q4(W2, wpr, (b) - nb0 - nb1);
#define Q4_BODY(b)                                                                              \
  if ((b) < nb0) matvec_q4_body<false>(W0, x, y0, m, wpr, nullptr, 0, (b));                     \
  else if ((b) < nb0 + nb1) matvec_q4_body<false>(W1, x, y1, m, wpr, nullptr, 0, (b) - nb0);   \
  else matvec_q4_body<false>(W2, x, y2, m, wpr, nullptr, 0, (b) - nb0 - nb1);
  FOR_VIRTUAL_BLOCKS(Q4_PREFETCH, Q4_BODY)
#undef Q4_PREFETCH
#undef Q4_BODY
}

extern "C" __global__ void __launch_bounds__(256, Q4_MIN_BLOCKS)
matvec_q4(Mat W0, Mat W1, Mat W2, const float* __restrict__ x, float* __restrict__ y0, float* __restrict__ y1,
          float* __restrict__ y2, int nb0, int nb1, int m, int wpr, int nblocks, int ahead) {
  matvec_q4_run(blockIdx.x, gridDim.x, W0, W1, W2, x, y0, y1, y2, nb0, nb1, m, wpr, nblocks, ahead);
}

BIG_STAGE void matvec_q4_gated_run(const int bid, const int nbid, Mat W, const float* __restrict__ x,
                                                    float* __restrict__ y, int m, int wpr,
                                                    const float* __restrict__ gate, int gate_stride, int nblocks,
                                                    int ahead) {
#define Q4_PREFETCH(b) prefetch_block_q4(W, wpr, (b));
#define Q4_BODY(b) matvec_q4_body<true>(W, x, y, m, wpr, gate, gate_stride, (b));
  FOR_VIRTUAL_BLOCKS(Q4_PREFETCH, Q4_BODY)
#undef Q4_PREFETCH
#undef Q4_BODY
}

extern "C" __global__ void __launch_bounds__(256, Q4_MIN_BLOCKS)
matvec_q4_gated(Mat W, const float* __restrict__ x, float* __restrict__ y, int m, int wpr,
                const float* __restrict__ gate, int gate_stride, int nblocks, int ahead) {
  matvec_q4_gated_run(blockIdx.x, gridDim.x, W, x, y, m, wpr, gate, gate_stride, nblocks, ahead);
}

// Routed experts (MoE): y[p] = W_{e(p)}·x[p / k or p] for each (token, slot) pair p = t·k + s,
// with W_e = table[idx[p]·3 + which] (gate 0, up 1, down 2) — only the top-k experts of each
// token are read. One warp per row, one column, exactly as `matvec` computes it. Block b takes
// rows of pair b / row_blocks. Grid: row_blocks = ceil(rows / ROWS_PER_BLOCK) blocks per pair.
BIG_STAGE void matvec_experts_body(const int b, const Mat* __restrict__ table, int which, const int* __restrict__ idx,
                                   int k, const float* __restrict__ x, int x_per_pair, float* __restrict__ y,
                                   int row_blocks) {
  pdl_start();
  const int p = b / row_blocks;
  const Mat W = table[idx[p] * 3 + which];
  const int r = (b - p * row_blocks) * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (r >= W.rows) return;
  const float* xp = x + (u64)(x_per_pair ? p : p / k) * W.cols;
  float* yp = y + (u64)p * W.rows;
  if (W.fmt == FMT_Q4) matvec_q4_row(W, r, xp, yp, 1);
  else matvec_dense_row(W, r, xp, yp, 1);
}
extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * 32)
matvec_experts(const Mat* __restrict__ table, int which, const int* __restrict__ idx, int k,
               const float* __restrict__ x, int x_per_pair, float* __restrict__ y, int row_blocks) {
  matvec_experts_body(blockIdx.x, table, which, idx, k, x, x_per_pair, y, row_blocks);
}
