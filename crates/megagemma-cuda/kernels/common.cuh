// Shared helpers for every kernel file; inlined by the Rust preprocessor (no CUDA headers).
#pragma once

typedef unsigned short bf16_t;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// Weight storage formats (`fmt` of DevMat; keep in sync with src/weights.rs).
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define FMT_Q4 3

// A weight matrix on the device, passed by value. Q4: `w` holds [rows, cols/8] u32 words
// (nibble k of word j is weight 8j+k), `sb` holds [rows, cols/gs] (scale, bias) float pairs.
struct Mat {
  u64 w;
  u64 sb;
  int rows;
  int cols;
  int fmt;
  int gs;
};

__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("{.reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t;}" : "=f"(f) : "h"(h));
  return f;
}

// w = q·scale + bias as two rounded operations (never fused), exactly as the CPU dequantizes.
__device__ __forceinline__ float q4_weight(unsigned q, float s, float b) {
  return __fadd_rn(__fmul_rn((float)q, s), b);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float sh[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  float t = 0.f;
  for (int i = 0; i < nw; i++) t += sh[i];
  return t;
}

__device__ __forceinline__ double block_sum_d(double v) {
  __shared__ double shd[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum_d(v);
  __syncthreads();
  if (lane == 0) shd[warp] = v;
  __syncthreads();
  double t = 0.0;
  for (int i = 0; i < nw; i++) t += shd[i];
  return t;
}

__device__ __forceinline__ float block_max(float v) {
  __shared__ float shm[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  float t = shm[0];
  for (int i = 1; i < nw; i++) t = fmaxf(t, shm[i]);
  return t;
}

// GELU, tanh approximation, in the CPU reference's operation order.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float k = 0.7978846f;
  float inner = __fmul_rn(k, __fadd_rn(x, __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x)));
  return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

// Element `col` of row `row` of a matrix, widened to f32 (64-bit indexing: PLE tables exceed 2^32).
__device__ __forceinline__ float mat_elem(const Mat& m, u64 row, int col) {
  u64 i = row * (u64)m.cols + (u64)col;
  switch (m.fmt) {
    case FMT_F32: return ((const float*)m.w)[i];
    case FMT_BF16: return bf16_to_f32(((const bf16_t*)m.w)[i]);
    case FMT_F16: return f16_to_f32(((const unsigned short*)m.w)[i]);
    default: {
      unsigned word = ((const unsigned*)m.w)[i >> 3];
      unsigned q = (word >> (4 * (col & 7))) & 15u;
      u64 g = row * (u64)(m.cols / m.gs) + (u64)(col / m.gs);
      float2 sb = ((const float2*)m.sb)[g];
      return q4_weight(q, sb.x, sb.y);
    }
  }
}
