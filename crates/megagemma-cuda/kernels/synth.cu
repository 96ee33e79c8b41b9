// Synthetic weights generated on the device (random codes, scales and biases from a hash of the
// element index and a seed) and the read-bandwidth probe the bench compares against.
#include "common.cuh"

__device__ __forceinline__ unsigned hash32(u64 x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return (unsigned)x;
}

extern "C" __global__ void fill_random_u32(unsigned* p, u64 n, u64 seed) {
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    p[i] = hash32(i * 0x9e3779b97f4a7c15ull + seed);
}

// (scale, bias) pairs: scale in [s0, 2·s0), bias = −7.5·scale (zero-mean weights).
extern "C" __global__ void fill_q4_scales(float2* p, u64 n, u64 seed, float s0) {
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    float s = s0 * (1.f + (hash32(i * 0x9e3779b97f4a7c15ull + seed) >> 8) * (1.f / 16777216.f));
    p[i] = make_float2(s, -7.5f * s);
  }
}

extern "C" __global__ void fill_const(float* p, u64 n, float v) {
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) p[i] = v;
}

// Reads n uint4 once (grid-stride) and folds them into one word, so the loads cannot be elided.
extern "C" __global__ void read_bandwidth(const uint4* __restrict__ p, u64 n, unsigned* out) {
  unsigned a = 0;
#pragma unroll 4
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    uint4 v = __ldcs(p + i);
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  a = __reduce_xor_sync(0xffffffffu, a);
  if ((threadIdx.x & 31) == 0) atomicXor(out, a);
}
