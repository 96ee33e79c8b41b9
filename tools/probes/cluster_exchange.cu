// Probe for sharing a matvec launch's input build across a thread-block cluster (docs/perf-notes.md,
// "Twenty-seventh session", end): today every block of a one-token launch builds the whole row's digit
// planes (E4B: 2,560 columns, 40 chunks of 1,088 bytes in `build_inputs`' layout) — 250–500
// instructions of each launch's fixed path, ~1–2 µs at the ~9 cycles an instruction these launches
// issue. With clusters of C blocks each could build 1/C of the row and hand it to the others. What does
// one such exchange round cost, by each mechanism Hopper offers?
//
// Every block of a 264-block grid (2 per SM, 256 threads, the decode launches' shape) runs ROUNDS
// rounds; a round writes the row (ROW_U4 16-byte words, double-buffered by round parity) and then reads
// one word of it. Modes:
//   0 local   every block writes the whole row itself, then a block barrier (what the exchange replaces,
//             without the build's arithmetic: a floor)
//   1 push    each block writes its slice into every cluster block's buffer (distributed shared memory
//             through `mapa` addresses), then a cluster barrier (barrier.cluster arrive.release /
//             wait.acquire, `cluster_sync`)
//   2 pull    each block writes its slice into its own buffer, a cluster barrier, then copies the other
//             slices from the other blocks' buffers, then a block barrier
//   3 async   each block writes its slice locally and into every other block's buffer by `st.async`,
//             each store completing its bytes on the receiving block's mbarrier; a block waits for its
//             own mbarrier's phase (no cluster barrier, no release fence)
//   4 barrier the cluster barrier alone
// Printed per mode and cluster size (%globaltimer): ns per round (mean over blocks, the slowest block's in brackets)
// and the words that differ from what the last round wrote (must be 0).
//
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/ce tools/probes/cluster_exchange.cu && /tmp/ce
#include <cstdint>
#include <cstdio>
#include <vector>

#include "mbarrier.cuh"

#define GRID 264
#define THREADS 256
#define ROUNDS 400
#define ROW_U4 2720  // 40 chunks × 1,088 bytes / 16

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Every thread of every block of the cluster (release / acquire: the blocks' shared-memory writes
// before it are visible after it).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The same shared-memory object in cluster block `rank`, as a generic pointer.
template <class T>
__device__ __forceinline__ T* peer(T* p, unsigned rank) {
  unsigned long long r;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(r) : "l"(p), "r"(rank));
  return (T*)r;
}
__device__ __forceinline__ unsigned mapa(unsigned a, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ void st_async4(unsigned addr, uint4 v, unsigned mbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(addr),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(mbar)
               : "memory");
}

// Word i of round r's row.
__device__ __forceinline__ uint4 word(int i, int r) {
  const unsigned t = 131u * r + 7u;
  return make_uint4(t ^ i, i, t, 3u * i + r);
}
__device__ __forceinline__ int2 slice(int rank, int c) {
  const int per = (ROW_U4 + c - 1) / c;
  return make_int2(min(ROW_U4, rank * per), min(ROW_U4, (rank + 1) * per));
}

template <int MODE>
__global__ void __launch_bounds__(THREADS, 2) probe(int c, unsigned long long* ns, unsigned* errors, unsigned* sink) {
  extern __shared__ __align__(16) uint4 buf[];  // [2][ROW_U4]
  __shared__ __align__(8) unsigned long long mbar[2];
  const int rank = (int)cluster_rank(), tid = threadIdx.x;
  const int2 mine = slice(rank, c);
  if (MODE == 3 && tid == 0) {
    mbar_init(smem_u32(&mbar[0]), 1);
    mbar_init(smem_u32(&mbar[1]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();
  unsigned acc = 0;
  const unsigned long long t0 = now_ns();
  for (int r = 0; r < ROUNDS; r++) {
    uint4* b = buf + (r & 1) * ROW_U4;
    if (MODE == 0) {
      for (int i = tid; i < ROW_U4; i += THREADS) b[i] = word(i, r);
      __syncthreads();
    } else if (MODE == 1) {
      for (int p = 0; p < c; p++) {
        uint4* pb = peer(b, p);
        for (int i = mine.x + tid; i < mine.y; i += THREADS) pb[i] = word(i, r);
      }
      cluster_sync();
    } else if (MODE == 2) {
      for (int i = mine.x + tid; i < mine.y; i += THREADS) b[i] = word(i, r);
      cluster_sync();
      for (int p = 0; p < c; p++) {
        if (p == rank) continue;
        const uint4* pb = peer(b, p);
        const int2 s = slice(p, c);
        for (int i = s.x + tid; i < s.y; i += THREADS) b[i] = pb[i];
      }
      __syncthreads();
    } else if (MODE == 3) {
      const unsigned mb = smem_u32(&mbar[r & 1]);
      if (tid == 0) mbar_expect(mb, (unsigned)(ROW_U4 - (mine.y - mine.x)) * 16u);
      for (int i = mine.x + tid; i < mine.y; i += THREADS) b[i] = word(i, r);
      for (int p = 0; p < c; p++) {
        if (p == rank) continue;
        const unsigned ra = mapa(smem_u32(b), p), rm = mapa(mb, p);
        for (int i = mine.x + tid; i < mine.y; i += THREADS) st_async4(ra + 16u * i, word(i, r), rm);
      }
      while (!mbar_done(mb, (r >> 1) & 1)) {
      }
      __syncthreads();  // the block's own slice (plain stores)
    } else {
      cluster_sync();
    }
    acc += b[(tid * 37 + r) % ROW_U4].x;
  }
  const unsigned long long t1 = now_ns();
  if (MODE != 4) {  // the last round's row, word by word
    const uint4* b = buf + ((ROUNDS - 1) & 1) * ROW_U4;
    unsigned bad = 0;
    for (int i = tid; i < ROW_U4; i += THREADS) {
      const uint4 w = b[i], e = word(i, ROUNDS - 1);
      bad += w.x != e.x || w.y != e.y || w.z != e.z || w.w != e.w;
    }
    if (bad) atomicAdd(errors, bad);
  }
  cluster_sync();  // no block leaves while others may still write into its shared memory
  if (tid == 0) ns[blockIdx.x] = t1 - t0;
  if (acc == 0xdeadbeef) *sink = acc;
}

template <int MODE>
void run(const char* name, int c, unsigned long long* d_ns, unsigned* d_err, unsigned* d_sink) {
  const size_t smem = 2 * ROW_U4 * sizeof(uint4);
  cudaFuncSetAttribute(probe<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(GRID);
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = c;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  int clusters = 0;
  cudaOccupancyMaxActiveClusters(&clusters, probe<MODE>, &cfg);
  for (int rep = 0; rep < 2; rep++) {  // the first launch warms up
    cudaMemset(d_err, 0, 4);
    cudaError_t e = cudaLaunchKernelEx(&cfg, probe<MODE>, c, d_ns, d_err, d_sink);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      printf("%-8s C=%d: %s\n", name, c, cudaGetErrorString(e));
      return;
    }
  }
  std::vector<unsigned long long> t(GRID);
  unsigned err = 0;
  cudaMemcpy(t.data(), d_ns, GRID * 8, cudaMemcpyDeviceToHost);
  cudaMemcpy(&err, d_err, 4, cudaMemcpyDeviceToHost);
  double sum = 0, mx = 0;
  for (auto v : t) sum += (double)v, mx = v > mx ? (double)v : mx;
  const double ns = 1.0 / ROUNDS;
  printf("%-8s C=%d  %7.1f ns a round [%7.1f]  wrong words %u  (co-resident clusters %d of %d)\n", name, c,
         sum / GRID * ns, mx * ns, err, clusters, GRID / c);
}

int main() {
  unsigned long long* d_ns;
  unsigned *d_err, *d_sink;
  cudaMalloc(&d_ns, GRID * 8);
  cudaMalloc(&d_err, 4);
  cudaMalloc(&d_sink, 4);
  printf("%d blocks of %d threads, %d rounds of a %d-byte row (%%globaltimer per block)\n", GRID, THREADS, ROUNDS,
         ROW_U4 * 16);
  run<0>("local", 1, d_ns, d_err, d_sink);
  for (int c : {2, 4, 8}) {
    run<1>("push", c, d_ns, d_err, d_sink);
    run<2>("pull", c, d_ns, d_err, d_sink);
    run<3>("async", c, d_ns, d_err, d_sink);
    run<4>("barrier", c, d_ns, d_err, d_sink);
  }
  return 0;
}
