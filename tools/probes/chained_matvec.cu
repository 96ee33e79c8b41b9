// Probe for the decode megakernel (issue 10, docs/megakernel-plan.md, "First steps" 1): what does a
// dependency between two 4-bit matvecs cost inside one persistent kernel, against one launch per
// matvec replayed from a CUDA graph?
//
// Work: 42 "layers" of E4B's MLP shapes, each gate+up (20480 × 2560) then down (2560 × 10240, input
// = the first 10240 outputs of gate+up), MLX affine 4-bit (group 64, bf16 scale/bias): 84 dependent
// matvecs, 1.64 GB of weights per token (far beyond L2). The matvec is the plain CUDA-core one of
// shared/probes/q4_gemv_bench.cu (~2 TB/s alone), so only differences between variants matter.
//   graph:      84 launches captured in a CUDA graph, replayed once per token.
//   persistent: one launch per token; after each matvec every block release-adds a monotonic counter
//               and waits (acquire spin) for all blocks before reading the next input.
//   prefetch:   as persistent, but a block asks L2 for its first rows of the next matvec before it waits
//               (weights never depend on activations).
// Build and run on the GPU machine: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/p chained_matvec.cu && /tmp/p
#include <cstdio>
#include <cstdint>
#include <vector>
#include <cuda_bf16.h>

struct Mat { const uint4* w; const __nv_bfloat16* s; const __nv_bfloat16* b; int rows, cols; };
constexpr int LAYERS = 42, H = 2560, F = 10240, THREADS = 256, ROWS = 2, PAD = F + F / 32;

// Rows r0.. of one matvec by one warp (ROWS rows per step, each lane 16 B of each row per iteration).
__device__ void matvec_rows(const Mat m, const float* xs, const float* gs, float* y, int warp, int nwarps) {
  const int lane = threadIdx.x & 31, wpr = m.cols / 32;
  for (int r0 = warp * ROWS; r0 < m.rows; r0 += nwarps * ROWS) {
    float acc[ROWS] = {};
    for (int c = lane; c < wpr; c += 32) {
      const int k0 = c * 32, g = k0 / 64;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        uint4 q = __ldg(&m.w[(size_t)(r0 + r) * wpr + c]);
        float s = __bfloat162float(m.s[(size_t)(r0 + r) * (m.cols / 64) + g]);
        float b = __bfloat162float(m.b[(size_t)(r0 + r) * (m.cols / 64) + g]);
        uint32_t ws[4] = {q.x, q.y, q.z, q.w};
        const float* xp = xs + k0 + k0 / 32;  // 32 inputs in one padded row: no bank conflicts
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int n = 0; n < 8; ++n) dot += (float)((ws[j] >> (4 * n)) & 15) * xp[j * 8 + n];
        acc[r] += s * dot + b * (gs[g] * 0.5f);
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v = acc[r];
      for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0) y[r0 + r] = v;
    }
  }
}

// x (cols floats) into shared memory with one pad float per 32, and its 64-wide group sums.
__device__ void load_input(const float* x, int cols, float* xs, float* gs) {
  for (int i = threadIdx.x; i < cols; i += blockDim.x) xs[i + i / 32] = x[i];
  __syncthreads();
  for (int g = threadIdx.x; g < cols / 64; g += blockDim.x) { float t = 0.f; for (int i = g * 64; i < g * 64 + 64; ++i) t += xs[i + i / 32]; gs[g] = t; }
  __syncthreads();
}

__global__ void __launch_bounds__(THREADS) one_matvec(Mat m, const float* x, float* y) {
  extern __shared__ float sm[];
  load_input(x, m.cols, sm, sm + PAD);
  matvec_rows(m, sm, sm + PAD, y, (blockIdx.x * blockDim.x + threadIdx.x) >> 5, (gridDim.x * blockDim.x) >> 5);
}

// All 84 matvecs; buffers bufs[i] is matvec i's input, bufs[i + 1] its output.
__global__ void __launch_bounds__(THREADS) persistent(const Mat* mats, float* const* bufs, unsigned* counter,
                                                      unsigned gen, int prefetch) {
  extern __shared__ float sm[];
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nwarps = (gridDim.x * blockDim.x) >> 5;
  for (int i = 0; i < 2 * LAYERS; ++i) {
    const Mat m = mats[i];
    if (i > 0) {
      if (prefetch) {  // this warp's first rows of matvec i, before waiting for its input
        const int lane = threadIdx.x & 31;
        const char* p = (const char*)(m.w + (size_t)(warp * ROWS) * (m.cols / 32));
        for (int o = lane * 128; o < ROWS * m.cols / 2; o += 32 * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + o));
      }
      // Wait for every block's part of matvec i − 1 (monotonic counter: gen·84·blocks + i·blocks).
      if (threadIdx.x == 0) {
        const unsigned want = (gen * 2 * LAYERS + i) * gridDim.x;
        unsigned v;
        do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter)); } while ((int)(v - want) < 0);
      }
      __syncthreads();
    }
    load_input(bufs[i], m.cols, sm, sm + PAD);
    matvec_rows(m, sm, sm + PAD, bufs[i + 1], warp, nwarps);
    __syncthreads();
    if (threadIdx.x == 0) { __threadfence(); atomicAdd(counter, 1u); }
  }
}

int main() {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int blocks = sms * 2;  // co-resident: 2 × 256 threads per SM, ~42 KB shared memory each
  std::vector<Mat> mats;
  double bytes = 0;
  for (int l = 0; l < LAYERS; ++l)
    for (auto [rows, cols] : {std::pair{2 * F, H}, std::pair{H, F}}) {
      size_t wb = (size_t)rows * cols / 2, sb = (size_t)rows * (cols / 64) * 2;
      uint4* w; __nv_bfloat16 *s, *b;
      cudaMalloc(&w, wb); cudaMalloc(&s, sb); cudaMalloc(&b, sb);
      cudaMemset(w, 0x5a, wb); cudaMemset(s, 0x38, sb); cudaMemset(b, 0x38, sb);  // bf16 4.4e-5: outputs stay O(1)
      mats.push_back({w, s, b, rows, cols});
      bytes += wb + 2.0 * sb;
    }
  std::vector<float*> bufs(2 * LAYERS + 1);
  for (auto& p : bufs) { cudaMalloc(&p, 2 * F * 4); cudaMemset(p, 0, 2 * F * 4); }
  Mat* dmats; float** dbufs; unsigned* counter;
  cudaMalloc(&dmats, mats.size() * sizeof(Mat)); cudaMemcpy(dmats, mats.data(), mats.size() * sizeof(Mat), cudaMemcpyHostToDevice);
  cudaMalloc(&dbufs, bufs.size() * sizeof(float*)); cudaMemcpy(dbufs, bufs.data(), bufs.size() * sizeof(float*), cudaMemcpyHostToDevice);
  cudaMalloc(&counter, 128); cudaMemset(counter, 0, 128);
  const int smem = (PAD + F / 64) * 4;
  cudaFuncSetAttribute(one_matvec, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaFuncSetAttribute(persistent, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  int per_sm; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent, THREADS, smem);
  if (per_sm < 2) { printf("only %d blocks per SM fit; the persistent kernel needs 2\n", per_sm); return 1; }
  cudaStream_t st; cudaStreamCreate(&st);
  cudaGraph_t g; cudaGraphExec_t ge;
  cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal);
  for (int i = 0; i < 2 * LAYERS; ++i) one_matvec<<<blocks, THREADS, smem, st>>>(mats[i], bufs[i], bufs[i + 1]);
  cudaStreamEndCapture(st, &g); cudaGraphInstantiate(&ge, g, 0);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  const int TOKENS = 20;
  unsigned gen = 0;
  auto time = [&](const char* name, auto launch) {
    launch(); cudaStreamSynchronize(st);  // warm-up
    cudaEventRecord(e0, st);
    for (int t = 0; t < TOKENS; ++t) launch();
    cudaEventRecord(e1, st); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    double per = ms / TOKENS;
    printf("%-11s %.3f ms/token  %.2f TB/s  (%.2f us per matvec)  %s\n", name, per, bytes / (per * 1e-3) / 1e12,
           per * 1e3 / (2 * LAYERS), cudaGetErrorString(cudaGetLastError()));
    return per;
  };
  printf("%d blocks x %d threads, %.2f GB of weights per token, 84 dependent matvecs\n", blocks, THREADS, bytes / 1e9);
  // Both paths must compute the same token: a non-zero input, then the last output of each.
  std::vector<float> x0(H), out_graph(H), out_persistent(H);
  for (int i = 0; i < H; ++i) x0[i] = 0.001f * (i % 97) - 0.04f;
  auto final_output = [&](std::vector<float>& out, auto launch) {
    cudaMemcpy(bufs[0], x0.data(), H * 4, cudaMemcpyHostToDevice);
    launch(); cudaStreamSynchronize(st);
    cudaMemcpy(out.data(), bufs[2 * LAYERS], H * 4, cudaMemcpyDeviceToHost);
  };
  final_output(out_graph, [&] { cudaGraphLaunch(ge, st); });
  final_output(out_persistent, [&] { persistent<<<blocks, THREADS, smem, st>>>(dmats, dbufs, counter, gen++, 0); });
  int differ = 0;
  for (int i = 0; i < H; ++i) differ += out_graph[i] != out_persistent[i];
  printf("final outputs: %d of %d differ between graph and persistent (output[0] = %g)\n", differ, H, out_graph[0]);
  for (int rep = 0; rep < 2; ++rep) {
    time("graph", [&] { cudaGraphLaunch(ge, st); });
    for (int pf = 0; pf < 2; ++pf)
      time(pf ? "prefetch" : "persistent", [&] { persistent<<<blocks, THREADS, smem, st>>>(dmats, dbufs, counter, gen++, pf); });
  }
  // One matvec alone (the largest), for the kernel's own streaming rate.
  cudaEventRecord(e0, st);
  for (int t = 0; t < 20; ++t) one_matvec<<<blocks, THREADS, smem, st>>>(mats[0], bufs[0], bufs[1]);
  cudaEventRecord(e1, st); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  double mb = (double)mats[0].rows * mats[0].cols / 2 + 2.0 * mats[0].rows * (mats[0].cols / 64) * 2;
  printf("gate+up alone: %.1f us = %.2f TB/s (L2 may hold part of it between repeats)\n", ms / 20 * 1e3, mb / (ms / 20 * 1e-3) / 1e12);
  return 0;
}
