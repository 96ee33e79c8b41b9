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

extern "C" __global__ void __launch_bounds__(ROWS_PER_BLOCK * 32)
matvec(Mat W, const float* __restrict__ x, float* __restrict__ y, int m) {
  int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5);
  if (r >= W.rows) return;
  if (W.fmt == FMT_Q4) matvec_q4_row(W, r, x, y, m);
  else matvec_dense_row(W, r, x, y, m);
}
