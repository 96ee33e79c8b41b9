// Probe for the decode matvecs (issues 9/10, docs/perf-notes.md "Seventh session"): how long does the
// plainest possible kernel take to *read* the bytes of one E4B layer matrix, one launch per matrix on
// cold buffers? No arithmetic on the data, no inputs, no reductions: each thread keeps U 16-byte loads
// in flight (grid-stride, XOR-folded so they are not optimised away). That time is the floor a
// separate launch per matrix can reach at that size — ramp, tail and launch gap included — against
// which megagemma's kernels (gate+up ~21 µs, down ~21, Q/K/V 8–13, O 8.5 per launch; the register
// probe of mma_layer_shapes.cu 19.5 / 24.2 / 7.7 / 6.5) can be read: a kernel near this floor is
// short of nothing but overlap between launches; one far above it loses time in its own work.
//
// Bytes as megagemma stores a 4-bit matrix: codes N·K/2 plus a float (scale, bias) pair per row and
// 64 columns. For every shape, 42 distinct buffers (one per layer, far beyond L2) are read back to
// back, 5 rounds; reported per launch. An empty kernel gives the launch gap alone.
//
// Measured on the H200, 2026-12-01 (docs/perf-notes.md, "Seventh session", item 8), best per launch:
// gate+up 32.8 MB 9.8 µs (3.36 TB/s), down 16.4 MB 6.0, Q/K/V 4.9 MB 3.6, O 3.3 MB 3.7, PLE gate 0.4 MB
// 3.8, LM head 419 MB 93.5 µs (4.49 TB/s) — megagemma's kernels take 2–3.5× these at the layer shapes.
//
// Build and run on the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/s tools/probes/stream_floor.cu && /tmp/s
#include <vector>
#include "probe.cuh"

template <int U>
__global__ void __launch_bounds__(256) stream(const uint4* __restrict__ p, size_t n, unsigned* out) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned acc = 0;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (U - 1) * stride < n; i += U * stride) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) out[0] = acc;  // never true for the fill below; keeps the loads
}

__global__ void empty_kernel(unsigned* out) {
  if (threadIdx.x == 1024) out[0] = 1;
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  unsigned* out;
  cudaMalloc(&out, 4);
  auto time = [&](auto launch, int layers) { return per_launch_us(launch, layers, ROUNDS); };
  printf("empty kernel, %d blocks: %.2f us/launch (%s)\n", sms * 2,
         time([&](int) { empty_kernel<<<sms * 2, 256>>>(out); }, LAYERS), cudaGetErrorString(cudaGetLastError()));
  printf("%-22s %9s %-6s %6s %9s %9s\n", "shape", "MB", "loads", "blocks", "us/launch", "GB/s");
  for (const Shape& sh : E4B_SHAPES) {
    const int layers = sh.N > 100000 ? 2 : LAYERS;  // the LM head once per token
    const size_t bytes = (size_t)sh.N * sh.K / 2 + (size_t)sh.N * (sh.K / 64) * 8, n = bytes / 16;
    std::vector<uint4*> bufs(layers);
    for (int l = 0; l < layers; ++l) {
      cudaMalloc(&bufs[l], bytes);
      cudaMemset(bufs[l], 0x5a, bytes);
    }
    struct Variant {
      const char* name;
      void (*kern)(const uint4*, size_t, unsigned*);
    } variants[] = {{"U 2", stream<2>}, {"U 4", stream<4>}, {"U 8", stream<8>}};
    for (const Variant& v : variants)
      for (int bps : {1, 2, 4, 8}) {
        const double us = time([&](int l) { v.kern<<<sms * bps, 256>>>(bufs[l], n, out); }, layers);
        printf("%-22s %9.2f %-6s %6d %9.2f %9.0f %s\n", sh.name, bytes / 1e6, v.name, sms * bps, us, bytes / us / 1e3,
               cudaGetErrorString(cudaGetLastError()));
      }
    for (int l = 0; l < layers; ++l) cudaFree(bufs[l]);
  }
  return 0;
}
