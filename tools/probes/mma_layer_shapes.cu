// Probe for the decode matvecs (issue 9/10, docs/perf-notes.md "Megakernel, second round"): how fast
// does a tensor-core 4-bit GEMV run at the shapes of one E4B layer, one launch per matrix on cold
// weights, against the same kernel on one huge matrix (shared/probes/q4_mma_gemv.cu: 82% of the read
// bandwidth)? megagemma's own kernel streams gate+up at ~1.5 TB/s as a separate kernel and ~1.1 TB/s
// inside the megakernel; this separates "the shape is too small to stream" from "the kernel is slow".
//
// Kernels: the layout and arithmetic of shared/probes/q4_mma_gemv.cu (weights in mma.m16n8k16
// A-fragment order, one uint4 per lane per 16 rows × 64 columns; x as fp16 in column 0 of B), with
// the columns of each 16-row tile optionally split S ways (partial sums added atomically), since a
// 2560-row matrix has only 160 tiles for ~1000 warps; codes in registers (that probe's form) or in a
// cp.async ring per warp (the megakernel's form). Weights are random bytes: only time matters.
// For every shape, 42 distinct matrices (one per layer, far beyond L2) are multiplied back to back,
// 5 rounds; reported per launch.
//
// Measured on the H200, 2026-12-01 (docs/perf-notes.md, "Sixth session"): best per launch, regs form —
// gate+up 19.6 µs (1.50 TB/s), down 24.6, Q/K/V 7.7, O 6.6, LM head 139 µs (2.72 TB/s at 528 blocks,
// 2.0 at 264); the ring form about half as fast at every shape (gate+up 33.3 µs, LM head 1.12 TB/s).
//
// The bulk form (TMA `cp.async.bulk` into per-warp slots with mbarriers; `check_bulk` compares its
// outputs with the register form's bit for bit), first run in the seventh session: 0 outputs differ;
// best per launch gate+up 24.2 µs, down 25.8, Q/K/V 9.4, O 7.8, LM head 191 µs (1.97 TB/s) — faster
// than the ring form everywhere, slower than the register form everywhere.
//
// Build and run on the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/p tools/probes/mma_layer_shapes.cu && /tmp/p
#include <vector>
#include <cstring>
#include "probe.cuh"

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// Ring form (megagemma's megakernel matvec): the same work, but each warp keeps DEPTH groups' codes in
// flight by cp.async into a ring in shared memory, streaming on across its work items (one commit
// group per group of codes; the lane waits for its own copies only).
template <int DEPTH>
__global__ void __launch_bounds__(256) gemv_ring(const uint4* __restrict__ w, const half2* __restrict__ sb,
                                                 const float* __restrict__ x, float* __restrict__ y, int N, int K,
                                                 int S) {
  extern __shared__ unsigned char smem[];
  half* xh = (half*)smem;
  float* gsum = (float*)(smem + K * 2);
  uint4* ring = (uint4*)(smem + ((K * 2 + (K / 64) * 4 + 15) / 16) * 16) + (threadIdx.x >> 5) * DEPTH * 32;
  load_x(xh, gsum, x, K);
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nwarps = (gridDim.x * blockDim.x) >> 5;
  const int G = K / 64, items = (N / 16) * S, per = G / S;
  // The warp's groups in order: item it = warp + j·nwarps, group g_lo(it) + i; n = its count.
  const int mine = warp < items ? (items - warp + nwarps - 1) / nwarps : 0, n = mine * per;
  auto src = [&](int k) {  // the k-th group of this warp's sequence
    const int it = warp + (k / per) * nwarps, t = it / S, g = (it % S) * per + k % per;
    return w + ((size_t)t * G + g) * 32 + lane;
  };
  int issued = 0;
  for (; issued < min(n, DEPTH); ++issued) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(ring + (issued % DEPTH) * 32 + lane)),
                 "l"(src(issued)) : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  float y0 = 0.f, y1 = 0.f;
  for (int k = 0; k < n; ++k) {
    // Copies still allowed pending: those issued after group k (at most DEPTH - 1).
    if (issued - k - 1 >= DEPTH - 1) asm volatile("cp.async.wait_group %0;" ::"n"(DEPTH - 1) : "memory");
    else asm volatile("cp.async.wait_group 0;" ::: "memory");
    const uint4 q = ring[(k % DEPTH) * 32 + lane];
    if (issued < n) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(ring + (issued % DEPTH) * 32 + lane)),
                   "l"(src(issued)) : "memory");
      asm volatile("cp.async.commit_group;" ::: "memory");
      ++issued;
    }
    const int it = warp + (k / per) * nwarps, t = it / S, g = (it % S) * per + k % per;
    group(q, sb + (size_t)t * G * 16, xh, gsum, g, y0, y1);
    if (k % per == per - 1) {
      store(y, t, S, y0, y1);
      y0 = y1 = 0.f;
    }
  }
}


// Bulk form (a candidate for the megakernel's matvec): the same work, the warp's codes brought into
// shared memory by the copy engine (TMA `cp.async.bulk`, one instruction from one lane per batch of
// B contiguous groups of a work item), D batches in flight, each slot with its own mbarrier that the
// copy completes; every lane waits on the barrier's phase, reads the batch into registers and frees
// the slot. Few instructions per group besides the arithmetic, unlike the per-lane cp.async ring.
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned phase) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n" ::"r"(
          bar),
      "r"(phase)
      : "memory");
}

template <int D, int B>
__global__ void __launch_bounds__(256) gemv_bulk(const uint4* __restrict__ w, const half2* __restrict__ sb,
                                                 const float* __restrict__ x, float* __restrict__ y, int N, int K,
                                                 int S) {
  extern __shared__ __align__(128) unsigned char smem[];
  half* xh = (half*)smem;
  float* gsum = (float*)(smem + K * 2);
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
  unsigned char* base = smem + ((K * 2 + (K / 64) * 4 + 127) / 128) * 128;
  uint4* ring = (uint4*)base + wid * D * B * 32;
  const unsigned bars = smem_addr(base + 8 * D * B * 512) + wid * D * 8;
  if (lane == 0) {
    for (int d = 0; d < D; ++d) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bars + d * 8) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  load_x(xh, gsum, x, K);  // its __syncthreads also publishes the barriers' initialisation
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nwarps = (gridDim.x * blockDim.x) >> 5;
  const int G = K / 64, items = (N / 16) * S, per = G / S, batches = (per + B - 1) / B;  // the last may be short
  const int mine = warp < items ? (items - warp + nwarps - 1) / nwarps : 0, n = mine * batches;
  // Batch j of this warp: item warp + (j / batches)·nwarps, groups from g_lo + (j % batches)·B.
  int it = warp, jb = 0;  // the next batch to issue, as (item, batch within it)
  auto issue = [&](int j) {
    const int t = it / S, g = (it % S) * per + jb * B, cnt = min(B, per - jb * B);
    const unsigned slot = smem_addr(ring + (j % D) * B * 32), bar = bars + (j % D) * 8;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(cnt * 512) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(slot),
        "l"(w + ((size_t)t * G + g) * 32), "r"(cnt * 512), "r"(bar)
        : "memory");
    if (++jb == batches) jb = 0, it += nwarps;
  };
  if (lane == 0)
    for (int j = 0; j < min(n, D); ++j) issue(j);
  int ct = warp, cb = 0;  // the batch being multiplied
  float y0 = 0.f, y1 = 0.f;
  for (int j = 0; j < n; ++j) {
    mbar_wait(bars + (j % D) * 8, (j / D) & 1);
    const int cnt = min(B, per - cb * B);
    uint4 q[B];
#pragma unroll
    for (int u = 0; u < B; ++u)
      if (u < cnt) q[u] = ring[((j % D) * B + u) * 32 + lane];
    __syncwarp();
    if (lane == 0 && j + D < n) issue(j + D);
    const int t = ct / S, g0 = (ct % S) * per + cb * B;
#pragma unroll
    for (int u = 0; u < B; ++u)
      if (u < cnt) group(q[u], sb + (size_t)t * G * 16, xh, gsum, g0 + u, y0, y1);
    if (++cb == batches) {
      store(y, t, S, y0, y1);
      y0 = y1 = 0.f;
      cb = 0, ct += nwarps;
    }
  }
}

// Shared memory of gemv_bulk<D, B>: inputs (128-byte aligned), 8 warps' rings, their mbarriers.
static int bulk_smem(int K, int D, int B) { return ((K * 2 + (K / 64) * 4 + 127) / 128) * 128 + 8 * D * B * 512 + 8 * D * 8; }


// The bulk form gives the register form's results bit for bit (one column part per tile, so no
// atomics): on hashed weights and scales, every output of every variant equals regs 8's.
static void check_bulk(int sms) {
  const int N = 4096, K = 2560;
  const size_t wbytes = (size_t)N * K / 2, sbytes = (size_t)N * (K / 64) * 4;
  uint4* w; half2* sb; float *x, *y;
  cudaMalloc(&w, wbytes);
  cudaMalloc(&sb, sbytes);
  cudaMalloc(&x, K * 4);
  cudaMalloc(&y, N * 4 * 4);
  fill_hash<<<256, 256>>>((uint32_t*)w, wbytes / 4, 1);
  std::vector<half2> hs(sbytes / 4);
  for (size_t i = 0; i < hs.size(); ++i) hs[i] = __floats2half2_rn(0.001f * (1 + i % 7), -0.004f * (1 + i % 5));
  cudaMemcpy(sb, hs.data(), sbytes, cudaMemcpyHostToDevice);
  std::vector<float> hx(K);
  for (int i = 0; i < K; ++i) hx[i] = (i % 13 - 6) * 0.25f;
  cudaMemcpy(x, hx.data(), K * 4, cudaMemcpyHostToDevice);
  const int xbytes = ((K * 2 + (K / 64) * 4 + 15) / 16) * 16;
  gemv<8><<<sms, 256, xbytes>>>(w, sb, x, y, N, K, 1);
  auto fn42 = gemv_bulk<4, 2>;
  auto fn44 = gemv_bulk<4, 4>;
  auto fn82 = gemv_bulk<8, 2>;
  void (*fns[3])(const uint4*, const half2*, const float*, float*, int, int, int) = {fn42, fn44, fn82};
  const int smems[3] = {bulk_smem(K, 4, 2), bulk_smem(K, 4, 4), bulk_smem(K, 8, 2)};
  for (int v = 0; v < 3; ++v) {
    cudaFuncSetAttribute(fns[v], cudaFuncAttributeMaxDynamicSharedMemorySize, smems[v]);
    fns[v]<<<sms * 2, 256, smems[v]>>>(w, sb, x, y + (v + 1) * N, N, K, 1);
  }
  std::vector<float> hy(4 * N);
  cudaMemcpy(hy.data(), y, 4 * N * 4, cudaMemcpyDeviceToHost);
  int bad[3] = {0, 0, 0};
  for (int v = 0; v < 3; ++v)
    for (int i = 0; i < N; ++i) bad[v] += memcmp(&hy[i], &hy[(v + 1) * N + i], 4) != 0;
  printf("bulk forms against regs 8 (N %d, K %d): %d / %d / %d outputs differ (%s)\n", N, K, bad[0], bad[1], bad[2],
         cudaGetErrorString(cudaGetLastError()));
  cudaFree(w), cudaFree(sb), cudaFree(x), cudaFree(y);
}


int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float *x, *y;
  cudaMalloc(&x, 10240 * 4);
  cudaMalloc(&y, 262144 * 4);
  cudaMemset(x, 0x3c, 10240 * 4);
  check_bulk(sms);
  printf("%-22s %-8s %6s %3s %9s %9s\n", "shape", "kernel", "blocks", "S", "us/launch", "GB/s");
  for (const Shape& sh : E4B_SHAPES) {
    const int layers = sh.N > 100000 ? 2 : LAYERS;  // the LM head once per token
    const size_t wbytes = (size_t)sh.N * sh.K / 2, sbytes = (size_t)sh.N * (sh.K / 64) * 4;
    std::vector<uint4*> ws(layers);
    std::vector<half2*> ss(layers);
    for (int l = 0; l < layers; ++l) {
      cudaMalloc(&ws[l], wbytes);
      cudaMalloc(&ss[l], sbytes);
      cudaMemset(ws[l], 0x5a, wbytes);
      cudaMemset(ss[l], 0x1c, sbytes);
    }
    const int xbytes = ((sh.K * 2 + (sh.K / 64) * 4 + 15) / 16) * 16;
    // Kernel variants: register form with 4 or 8 groups per batch, ring form 8 or 16 deep.
    struct Variant {
      const char* name;
      void (*kern)(const uint4*, const half2*, const float*, float*, int, int, int);
      int smem;
    } variants[] = {{"regs 4", gemv<4>, xbytes},
                    {"regs 8", gemv<8>, xbytes},
                    {"ring 8", gemv_ring<8>, xbytes + 8 * 8 * 512},
                    {"ring 16", gemv_ring<16>, xbytes + 8 * 16 * 512},
                    {"bulk 4x2", gemv_bulk<4, 2>, bulk_smem(sh.K, 4, 2)},
                    {"bulk 4x4", gemv_bulk<4, 4>, bulk_smem(sh.K, 4, 4)},
                    {"bulk 8x2", gemv_bulk<8, 2>, bulk_smem(sh.K, 8, 2)}};
    for (const Variant& v : variants) {
      cudaFuncSetAttribute(v.kern, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem);
      for (int bps : {1, 2, 4}) {
        for (int S : {1, 2, 4, 8}) {
          if ((sh.K / 64) % S) continue;
          const double us = per_launch_us(
              [&](int l) { v.kern<<<sms * bps, 256, v.smem>>>(ws[l], ss[l], x, y, sh.N, sh.K, S); }, layers, ROUNDS);
          printf("%-22s %-8s %6d %3d %9.2f %9.0f %s\n", sh.name, v.name, sms * bps, S, us,
                 (wbytes + sbytes) / us / 1e3, cudaGetErrorString(cudaGetLastError()));
        }
      }
    }
    for (int l = 0; l < layers; ++l) {
      cudaFree(ws[l]);
      cudaFree(ss[l]);
    }
  }
  return 0;
}
