// Probe for a matvec stage's fixed path (issues 9/10, docs/perf-notes.md "Sixteenth session", item 4):
// in the megakernel's trace a folded stage (gate+up: post-attention and pre-FFN norms folded in) spends
// 2.5–3 µs on its residual statistics and 2.5–3 µs on its input build after the wait, while
// `residual_step.cu` (eighth session) timed the same prologue alone at 1.6 µs a round. Is the gap the
// weight stream — each warp's first batch of weights is loaded before the wait, so 264 blocks' loads
// are in flight when the statistics' L2 loads go out — or the code around it?
//
// Every block of a 264-block grid (2 per SM, 256 threads, the decode launches' shape) runs PROBE_ROUNDS
// rounds of gate+up's first virtual block of E4B (4 tiles of 16 rows, 2 warps a tile, 2,560 columns),
// with megagemma's own device functions (`#include` of kernels/matvec_mma.cu, the launched kernels'
// form: x' kept in registers): a grid barrier (a release-add and an acquire spin, the megakernel's
// wait), `residual_stats`, `build_inputs`, then `tile_slice` over the warp's chunks. Thread 0 reads
// `clock64()` after the block barrier that ends each phase. Each round reads another region of a
// 2 GB weight buffer (from HBM) and another of 16 rows of x and o (from L2, as rows other blocks
// just wrote). Modes:
//   0  no weight loads before the barrier (the first batch is loaded when the chunk loop starts)
//   1  the first batch loaded before the barrier, as the kernels do (`tile_start`)
//   2  as 1, and ahead of it every warp asks L2 for its whole slice of the round's weights
//      (`prefetch.global.L2`: HBM busy with the whole stage's bytes, as when a stage streams)
// Printed per mode: µs per round of the barrier, the statistics, the build and the chunk loop (mean
// over blocks; the slowest block's in brackets).
//
// Build and run on the GPU machine (the megakernel's form, x' re-read: add -DRES_KEEP=0):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/pl tools/probes/prologue_under_load.cu && /tmp/pl
// nvcc's host pass parses the member initialisers of `SmallDiv`'s device constructor (NVRTC never
// sees a host pass): give it a declaration it can parse; the device code uses the intrinsic.
#ifndef __CUDA_ARCH__
#define __frcp_rn(x) (1.0f / (x))
#endif
#include "../../crates/megagemma-cuda/kernels/matvec_mma.cu"
#undef __frcp_rn
#include "probe.cuh"  // fill_hash

#include <cstdio>
#include <vector>

// GRID=132 (-DGRID=132): one block per SM, the fixed path issued once per SM instead of twice.
#ifndef GRID
#define GRID 264
#endif
#define THREADS 256
#define PROBE_ROUNDS 64
#define DIM 2560
#define ROWS_OUT 20480  // gate and up stacked: 1,280 tiles
#define PHASES 4

__device__ unsigned g_arrived, g_timed_out;

// Grid barrier for round r (monotonic counter, as the megakernel's stage counters), bounded: after
// ~1 s it gives up and flags it, so a grid that is not all resident cannot hang the GPU.
__device__ void grid_wait(unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(&g_arrived) : "memory");
    const long long deadline = clock64() + 2000000000ll;
    unsigned v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(&g_arrived) : "memory");
      if (clock64() > deadline) {
        g_timed_out = 1;
        break;
      }
    } while ((int)(v - target) < 0);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(THREADS, 2)
    prologue(Mat w, u64 round_bytes, const float* xs_rows, const float* os_rows, const float* w1, const float* w2n,
             float* x_out, int mode, long long* clocks, float* sink) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int chunks = DIM / 64, ks = 2, tpb = MMA_WARPS / ks;
  uint4* xf = (uint4*)smem;
  float* xsm = (float*)(smem + chunks * 1024);
  const int warp = threadIdx.x >> 5, tile = blockIdx.x * tpb + warp / ks, ws = warp % ks;
  float total = 0.f;
  for (int r = 0; r < PROBE_ROUNDS; r++) {
    Mat wr = w;
    wr.w += (u64)r * round_bytes;  // another region each round: the weights come from HBM
    wr.sb += (u64)r * round_bytes;
    TileBatch<1, 1> first;
    if (mode == 2) {
      // The warp's whole slice of this round's weights asked of L2 (codes and scales, 128-byte lines).
      const char* cp = (const char*)wr.w + ((u64)tile * chunks + ws) * 512;
      for (int c = threadIdx.x & 31; c < chunks / ks * 4; c += 32) prefetch_l2(cp + (u64)(c / 4) * ks * 512 + (c % 4) * 128);
    }
    if (mode >= 1) tile_start<1, 1>(wr, tile, ws, ks, 0, chunks, first);
    // The second norm's weights into registers before the wait, as `mma_kernel` loads them.
    NormW2 nw = {};
    if constexpr (RES_KEEP) {
#pragma unroll
      for (int q = 0; q < RES_F4; q++) {
        const int f = threadIdx.x + q * blockDim.x;
        nw.v[q] = f < DIM / 4 ? ld4(w2n, f) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    long long t[PHASES + 1];
    t[0] = clock64();
    grid_wait((unsigned)(r + 1) * gridDim.x);
    t[1] = clock64();
    const int row = r % 16;
    const Residual res{xs_rows + (u64)row * DIM, os_rows + (u64)row * DIM, w1, w2n, x_out, 1.f, 1e-6f};
    float4 keep[RES_F4] = {};
    bool kept = false;
    residual_stats(res, 0, DIM, false, mma_rstat, keep, kept, nw);
    __syncthreads();
    t[2] = clock64();
    build_inputs<1, 1, false>(xf, xsm, nullptr, nullptr, 0, DIM, 1, 0, chunks, res, mma_rstat, keep, kept);
    __syncthreads();
    t[3] = clock64();
    float y[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    tile_slice<1, 1, false>(wr, tile, ws, ks, 0, chunks, xf, xsm, y, 1, first, mode >= 1);
    total += y[0][0] + y[0][1] + y[1][0] + y[1][1];
    __syncthreads();
    t[4] = clock64();
    if (threadIdx.x == 0)
      for (int p = 0; p < PHASES; p++) clocks[((u64)blockIdx.x * PROBE_ROUNDS + r) * PHASES + p] = t[p + 1] - t[p];
    __syncthreads();  // the fragments are rebuilt next round
  }
  sink[blockIdx.x * blockDim.x + threadIdx.x] = total;
}

// Scales and biases: small finite floats (the random words above would be NaNs as floats).
__global__ void fill_scales(float* p, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
    p[i] = 1e-3f * (float)((i * 7919u) % 97u) - 0.04f;
}

int main() {
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  const int chunks = DIM / 64, tiles = ROWS_OUT / 16, groups = chunks;
  const u64 code_bytes = (u64)tiles * chunks * 512, scale_bytes = (u64)tiles * groups * 128;
  const u64 round_bytes = code_bytes + scale_bytes;  // one region a round: codes, then scales
  const u64 total = round_bytes * (PROBE_ROUNDS + 1);
  char* wbuf;
  float *xs, *os, *w1, *w2, *xo, *sink;
  long long* clocks;
  if (cudaMalloc(&wbuf, total) != cudaSuccess) {
    printf("cannot allocate %.1f GB\n", total / 1e9);
    return 1;
  }
  cudaMalloc(&xs, 16 * DIM * 4);
  cudaMalloc(&os, 16 * DIM * 4);
  cudaMalloc(&w1, DIM * 4);
  cudaMalloc(&w2, DIM * 4);
  cudaMalloc(&xo, DIM * 4);
  cudaMalloc(&sink, GRID * THREADS * 4);
  cudaMalloc(&clocks, (u64)GRID * PROBE_ROUNDS * PHASES * 8);
  fill_hash<<<1024, 256>>>((uint32_t*)wbuf, total / 4, 1u);
  for (int r = 0; r <= PROBE_ROUNDS; r++) fill_scales<<<256, 256>>>((float*)(wbuf + r * round_bytes + code_bytes), scale_bytes / 4);
  fill_scales<<<64, 256>>>(xs, 16 * DIM);
  fill_scales<<<64, 256>>>(os, 16 * DIM);
  fill_scales<<<16, 256>>>(w1, DIM);
  fill_scales<<<16, 256>>>(w2, DIM);
  Mat w{(u64)wbuf, (u64)(wbuf + code_bytes), ROWS_OUT, DIM, FMT_Q4T, 64};
  const int smem = chunks * MMA_CHUNK_BYTES(1, 1);
  cudaFuncSetAttribute(prologue, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, prologue, THREADS, smem);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (per_sm * sms < GRID) {  // the grid barrier needs every block resident
    printf("only %d blocks fit at once (%d per SM): the grid barrier would hang\n", per_sm * sms, per_sm);
    return 1;
  }
  printf("prologue_under_load: %d blocks of %d threads (%d per SM fit), %d rounds, %.0f MHz, RES_KEEP %d\n", GRID,
         THREADS, per_sm, PROBE_ROUNDS, clock_khz / 1e3, RES_KEEP);
  const char* names[PHASES] = {"barrier", "statistics", "input build", "chunk loop"};
  std::vector<long long> h((u64)GRID * PROBE_ROUNDS * PHASES);
  unsigned arrived = 0;
  for (int mode = 0; mode < 3; mode++) {
    for (int rep = 0; rep < 2; rep++) {  // the first run warms up; the second is reported
      cudaMemcpyToSymbol(g_arrived, &arrived, 4);
      prologue<<<GRID, THREADS, smem>>>(w, round_bytes, xs, os, w1, w2, xo, mode, clocks, sink);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        printf("mode %d: %s\n", mode, cudaGetErrorString(e));
        return 1;
      }
    }
    unsigned timed_out = 0;
    cudaMemcpyFromSymbol(&timed_out, g_timed_out, 4);
    if (timed_out) {
      printf("mode %d: a grid barrier timed out\n", mode);
      return 1;
    }
    cudaMemcpy(h.data(), clocks, h.size() * 8, cudaMemcpyDeviceToHost);
    printf("mode %d:", mode);
    for (int p = 0; p < PHASES; p++) {
      double sum = 0, worst = 0;
      for (int b = 0; b < GRID; b++) {
        double blk = 0;
        for (int r = 1; r < PROBE_ROUNDS; r++) blk += h[((u64)b * PROBE_ROUNDS + r) * PHASES + p];  // round 0 is cold
        blk /= PROBE_ROUNDS - 1;
        sum += blk;
        worst = blk > worst ? blk : worst;
      }
      const double us = 1e3 / clock_khz;
      printf("  %s %.2f µs (%.2f)", names[p], sum / GRID * us, worst * us);
    }
    printf("\n");
  }
  return 0;
}
