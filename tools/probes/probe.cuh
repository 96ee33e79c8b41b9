// Shared pieces of the matvec probes (included by mma_layer_shapes.cu, imma_gemv.cu,
// stream_floor.cu and prologue_under_load.cu; each probe stays one `nvcc FILE.cu` program): the fp16 tensor-core 4-bit GEMV of
// shared/probes/q4_mma_gemv.cu in its register form (the baseline the others are read against; imma_gemv.cu
// measured its fp16 column with its own copy, the same arithmetic),
// hashed weights, the shapes of one E4B layer and the per-launch timing loop.
#pragma once
#include <cstdio>
#include <cstdint>
#include <cuda_fp16.h>

__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The inputs in shared memory (fp16) and their sums per 64-column group; every block builds them.
__device__ __forceinline__ void load_x(half* xh, float* gsum, const float* x, int K) {
  for (int i = threadIdx.x; i < K; i += blockDim.x) xh[i] = __float2half_rn(x[i]);
  __syncthreads();
  for (int g = threadIdx.x; g < K / 64; g += blockDim.x) {
    float t = 0;
    for (int i = 0; i < 64; ++i) t += __half2float(xh[g * 64 + i]);
    gsum[g] = t;
  }
  __syncthreads();
}

// One 64-column group of a 16-row tile: the lane's code word q (A fragments of four k-tiles) times x,
// scaled, into y0 (row gid) and y1 (row gid + 8) on the lanes with tig == 0.
__device__ __forceinline__ void group(uint4 q, const half2* st, const half* xh, const float* gsum, int g, float& y0,
                                      float& y1) {
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const half2 off = __float2half2_rn(1032.f);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t ws[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    uint32_t a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t m = ((ws[kt] >> (4 * i)) & 0x000F000Fu) | 0x64006400u;
      half2 v = __hsub2(*reinterpret_cast<half2*>(&m), off);
      a[i] = *reinterpret_cast<uint32_t*>(&v);
    }
    const int k0 = g * 64 + kt * 16;
    uint32_t b0 = 0, b1 = 0;
    if (gid == 0) {
      b0 = *(const uint32_t*)&xh[k0 + tig * 2];
      b1 = *(const uint32_t*)&xh[k0 + tig * 2 + 8];
    }
    mma16816(c, a, b0, b1);
  }
  if (tig == 0) {
    float2 s0 = __half22float2(st[g * 16 + gid]), s1 = __half22float2(st[g * 16 + gid + 8]);
    y0 += s0.x * c[0] + (s0.y + 8.f * s0.x) * gsum[g];
    y1 += s1.x * c[2] + (s1.y + 8.f * s1.x) * gsum[g];
  }
}

__device__ __forceinline__ void store(float* y, int t, int S, float y0, float y1) {
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  if (tig != 0) return;
  if (S == 1) {
    y[t * 16 + gid] = y0;
    y[t * 16 + gid + 8] = y1;
  } else {
    atomicAdd(&y[t * 16 + gid], y0);
    atomicAdd(&y[t * 16 + gid + 8], y1);
  }
}

// Register form (shared/probes/q4_mma_gemv.cu): y[N] (+)= W[N, K]·x[K]; work item i = (tile i / S,
// column part i % S), items spread over all warps; UNROLL groups' codes in registers at a time.
template <int UNROLL>
__global__ void __launch_bounds__(256) gemv(const uint4* __restrict__ w, const half2* __restrict__ sb,
                                            const float* __restrict__ x, float* __restrict__ y, int N, int K, int S) {
  extern __shared__ unsigned char smem[];
  half* xh = (half*)smem;
  float* gsum = (float*)(smem + K * 2);
  load_x(xh, gsum, x, K);
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nwarps = (gridDim.x * blockDim.x) >> 5;
  const int G = K / 64, items = (N / 16) * S, per = G / S;
  for (int it = warp; it < items; it += nwarps) {
    const int t = it / S, g_lo = (it % S) * per, g_hi = g_lo + per;
    const uint4* wt = w + (size_t)t * G * 32;
    const half2* st = sb + (size_t)t * G * 16;
    float y0 = 0.f, y1 = 0.f;
    for (int g0 = g_lo; g0 < g_hi; g0 += UNROLL) {
      uint4 q[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) q[u] = g0 + u < g_hi ? __ldcs(&wt[(g0 + u) * 32 + lane]) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u)
        if (g0 + u < g_hi) group(q[u], st, xh, gsum, g0 + u, y0, y1);
    }
    store(y, t, S, y0, y1);
  }
}

__global__ void fill_hash(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = h;
  }
}

struct Shape {
  const char* name;
  int N, K;
};

// One E4B layer's 4-bit matrices and the LM head; each probe multiplies LAYERS distinct cold copies
// of a layer matrix (the LM head: 2), ROUNDS passes.
static const Shape E4B_SHAPES[] = {{"gate+up 20480x2560", 20480, 2560}, {"down 2560x10240", 2560, 10240},
                                   {"qkv 3072x2560", 3072, 2560},       {"o 2560x2048", 2560, 2048},
                                   {"ple gate 256x2560", 256, 2560},     {"lm head 262144x2560", 262144, 2560}};
static const int LAYERS = 42, ROUNDS = 5;

// µs per launch of `launch(l)` over `layers` distinct buffers (l = 0 .. layers − 1), after one
// warm-up pass: `rounds` passes back to back, launch gaps included.
template <class Launch>
double per_launch_us(Launch launch, int layers, int rounds) {
  static cudaEvent_t e0 = nullptr, e1 = nullptr;
  if (!e0) cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int l = 0; l < layers; ++l) launch(l);
  cudaDeviceSynchronize();
  cudaEventRecord(e0);
  for (int r = 0; r < rounds; ++r)
    for (int l = 0; l < layers; ++l) launch(l);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms;
  cudaEventElapsedTime(&ms, e0, e1);
  return ms * 1e3 / ((double)rounds * layers);
}
