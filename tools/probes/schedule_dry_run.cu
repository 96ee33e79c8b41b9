// Probe for the decode megakernel (issue 10): what do the waits of the real schedule cost per
// token? Runs the job table of `crates/megagemma-cuda/src/schedule.rs` (written by
// `cargo run --release -p megagemma-cuda --example schedule_dump -- e4b 264 e4b.bin`) in one
// persistent kernel with empty jobs: per job, one thread per input waits (acquire spin, bounded:
// a stuck wait sets an error flag) until that input's counter reaches generation × producers, the block
// optionally spins WORK_NS nanoseconds (a stand-in for the job's work), then thread 0 signals
// the job's counters: `__threadfence()` + `atomicAdd`, or one `red.release.gpu` each; inputs are
// polled with `ld.acquire.gpu`, or with relaxed loads and one acquire fence (all measured).
// One launch per token, counters monotonic across tokens.
// Build and run on the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/d schedule_dry_run.cu && /tmp/d e4b.bin
#include <cstdio>
#include <cstdint>
#include <vector>

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void __launch_bounds__(256) dry_run(const unsigned* prod, const unsigned* soff, const unsigned* sig, const unsigned* woff,
                                               const unsigned* waits, const unsigned* boff, const unsigned* bjobs,
                                               unsigned* counters, unsigned gen, unsigned work_ns, int red_release,
                                               int relaxed_poll, unsigned* err) {
  for (unsigned k = boff[blockIdx.x]; k < boff[blockIdx.x + 1]; ++k) {
    const unsigned j = bjobs[k];
    // Thread w of the block waits for the job's w-th input (all inputs polled at once: a
    // satisfied wait still costs a round trip to L2, so in sequence they would add up).
    const unsigned nw = woff[j + 1] - woff[j];
    if (threadIdx.x < nw) {
      const unsigned it = waits[woff[j] + threadIdx.x], want = gen * prod[it];
      const long long t0 = clock64();
      unsigned v;
      do {
        if (relaxed_poll) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counters + it * 32));
        else asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counters + it * 32));
        if (clock64() - t0 > (1ll << 32)) { atomicExch(err, 1u); break; }  // ~2 s: a stuck schedule
      } while ((int)(v - want) < 0);
      if (relaxed_poll) asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    if (threadIdx.x == 0 && work_ns) {
      const unsigned long long t0 = now_ns();
      while (now_ns() - t0 < work_ns) {}
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (!red_release) __threadfence();
      for (unsigned s = soff[j]; s < soff[j + 1]; ++s) {
        unsigned* c = counters + sig[s] * 32;
        if (red_release) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
        else atomicAdd(c, 1u);
      }
    }
  }
}

int main(int argc, char** argv) {
  if (argc < 2) { printf("usage: %s SCHEDULE.bin\n", argv[0]); return 1; }
  FILE* f = fopen(argv[1], "rb");
  if (!f) { printf("cannot open %s\n", argv[1]); return 1; }
  std::vector<unsigned> w;
  unsigned v;
  while (fread(&v, 4, 1, f) == 1) w.push_back(v);
  fclose(f);
  size_t p = 0;
  const unsigned grid = w[p++], njobs = w[p++], nitems = w[p++];
  std::vector<unsigned> prod(w.begin() + p, w.begin() + p + nitems);
  p += nitems;
  std::vector<unsigned> soff(njobs + 1), sig, woff(njobs + 1), waits;
  for (unsigned j = 0; j < njobs; ++j) {
    const unsigned ns = w[p++];
    soff[j] = sig.size();
    for (unsigned i = 0; i < ns; ++i) sig.push_back(w[p++]);
    const unsigned n = w[p++];
    woff[j] = waits.size();
    for (unsigned i = 0; i < n; ++i) waits.push_back(w[p++]);
  }
  woff[njobs] = waits.size();
  soff[njobs] = sig.size();
  std::vector<unsigned> boff(grid + 1), bjobs;
  for (unsigned b = 0; b < grid; ++b) {
    const unsigned n = w[p++];
    boff[b] = bjobs.size();
    for (unsigned i = 0; i < n; ++i) bjobs.push_back(w[p++]);
  }
  boff[grid] = bjobs.size();
  int sms, per_sm;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dry_run, 256, 0);
  if ((unsigned)(sms * per_sm) < grid) { printf("%u blocks cannot all be resident (%d per SM)\n", grid, per_sm); return 1; }
  auto up = [](const std::vector<unsigned>& h) {
    unsigned* d;
    cudaMalloc(&d, (h.size() + 1) * 4);
    cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
    return d;
  };
  unsigned *dprod = up(prod), *dsoff = up(soff), *dsig = up(sig), *dwoff = up(woff), *dwaits = up(waits), *dboff = up(boff),
           *dbjobs = up(bjobs), *counters, *err;
  cudaMalloc(&counters, (size_t)nitems * 128);
  cudaMemset(counters, 0, (size_t)nitems * 128);
  cudaMalloc(&err, 4);
  cudaMemset(err, 0, 4);
  printf("%u jobs, %u counters, %zu waits, %u blocks\n", njobs, nitems, waits.size(), grid);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  unsigned gen = 0;
  struct Variant { int red, relaxed; const char* name; };
  for (Variant var : {Variant{0, 0, "fence + atomicAdd, ld.acquire"}, Variant{1, 0, "red.release, ld.acquire"},
                      Variant{1, 1, "red.release, ld.relaxed + fence"}})
    for (unsigned work : {0u, 1000u}) {
      const int tokens = 30;
      auto launch = [&] {
        dry_run<<<grid, 256>>>(dprod, dsoff, dsig, dwoff, dwaits, dboff, dbjobs, counters, ++gen, work, var.red,
                               var.relaxed, err);
      };
      launch();  // warm-up
      cudaEventRecord(e0);
      for (int t = 0; t < tokens; ++t) launch();
      cudaEventRecord(e1);
      cudaEventSynchronize(e1);
      float ms;
      cudaEventElapsedTime(&ms, e0, e1);
      unsigned herr;
      cudaMemcpy(&herr, err, 4, cudaMemcpyDeviceToHost);
      // Each block runs about jobs/grid jobs; with WORK_NS each, a block alone would take that long.
      const double busy = (double)njobs / grid * work / 1e6;
      printf("%-32s work %4u ns/job: %.3f ms/token (a block's own work %.3f ms), error flag %u, %s\n", var.name,
             work, ms / tokens, busy, herr, cudaGetErrorString(cudaGetLastError()));
    }
  return 0;
}
