// Probe for the decode megakernel (issue 10): a stage's link and its input load as one L2 round
// trip. Today a megakernel stage pays two round trips before it can build its inputs: thread 0
// polls the previous stage's counter (`ld.acquire.gpu`), a block barrier, then every thread loads
// the row the producers wrote. If each producer writes every value beside a flag (the token that
// wrote it) in one 8-byte store, a consumer's input load is its wait: it loads its elements and
// polls again only while a flag is stale (the "LL" protocol of NCCL's low-latency collectives).
// docs/perf-notes.md "Forty-sixth session" puts a stage's link at ~1.2 µs and its input build at
// ~2 µs, of ~303 stages a token: how much of that does the flag remove, with HBM busy?
//
// One persistent launch per token: GRID blocks (2 per SM) × 256 threads run STAGES stages. In
// stage s every block
//   1. issues its share of the stage's weights (WEIGHT_BYTES over the grid, from a 2 GB buffer:
//      HBM, never L2) into registers — before its wait, as the megakernel does;
//   2. waits for row s − 1 and loads it (DIM floats, 10 a thread), as the mode says;
//   3. computes the row's sum of squares (a block reduction: the statistic a folded build needs);
//   4. if it is one of the DIM / 16 producer blocks, writes its 16 elements of row s (the
//      normalised input, plus a term of its weights so the loads are kept), as the mode says;
//   5. signals, as the mode says.
// Rows are per stage (no slot is rewritten within a token), so only the link orders them. Modes:
//   0 counter, all   every block signals a counter per stage (`red.release.gpu` after a block
//                    barrier); a block waits for all GRID signals (today's megakernel)
//   1 counter, prod  the same, but only producer blocks signal and are waited for
//   2 flagged        no counters: values are written as (value, token) pairs by 64-bit relaxed
//                    stores and read by 64-bit relaxed loads until every flag is the token's
//   3 no wait        rows read whenever (stale values: timing only) — the work without links
// Every wait is bounded (~1 s: the error flag is set and the block leaves). Printed per mode:
// µs per stage and ms per token (STAGES stages), medians over TOKENS launches.
//
// Measured on an H100 80GB HBM3, 2026-12-06 (docs/perf-notes.md "Forty-seventh session"), 264 × 256, 303 stages,
// 8.8 MB of weights a stage, medians of 35 tokens (two runs each, ms a token / µs a stage):
//   counter, all   1.247–1.253 / 4.12–4.14     counter, prod   1.209–1.242 / 3.99–4.10
//   flagged        1.286 / 4.24 (BACKOFF_NS=256 the same; POLL_FIRST=1 1.326 / 4.38)
//   no wait        0.856–0.860 / 2.83 (the weight stream: 8.8 MB in 2.83 µs, 3.1 TB/s)
// A first version that checked each flag right after its load (one round trip per element, in
// sequence) took 1.52 ms. With -DLIGHT_PRODUCERS=1 (producers stream no weights): counter, all
// 0.768 / 2.54; counter, prod 0.709 / 2.34; flagged 0.858 / 2.83; no wait 0.402 / 1.33. So the flag
// does not pay: the links cost ~1.2 µs a stage over the work whether or not producers stream, and
// a poll of the data itself costs more than a poll of a counter and a load after it.
//
// Build and run on the GPU machine:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/fl tools/probes/flagged_link.cu && /tmp/fl
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>

#ifndef DIM
#define DIM 2560  // E4B's hidden width
#endif
#ifndef STAGES
#define STAGES 303  // an E4B token's dependent stages in the megakernel
#endif
#ifndef WEIGHT_BYTES
#define WEIGHT_BYTES (8600 * 1024)  // 2.61 GB / 303 stages
#endif
#ifndef BACKOFF_NS
#define BACKOFF_NS 64  // a flagged poll's sleep between rounds
#endif
#ifndef POLL_FIRST
#define POLL_FIRST 0
#endif
#ifndef LIGHT_PRODUCERS
#define LIGHT_PRODUCERS 0
#endif
#define THREADS 256
#define PER_THREAD (DIM / THREADS)
#define CHUNK 16
#define PRODUCERS (DIM / CHUNK)
#define TOKENS 40
#define TIMEOUT_NS 1000000000ull

static_assert(DIM % THREADS == 0 && DIM % CHUNK == 0, "row shape");

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; w++) t += red[w];
  __syncthreads();
  return t;
}

template <int MODE>
__global__ void __launch_bounds__(THREADS, 2)
chain(const uint4* __restrict__ weights, size_t weight_words, float* rows, uint2* flagged, unsigned* counters,
      unsigned token, unsigned* err, float* sink) {
  __shared__ float red[THREADS / 32];
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const bool producer = blockIdx.x < PRODUCERS;
  const unsigned waiters = MODE == 0 ? gridDim.x : PRODUCERS;
  // uint4s of weights per block and stage (rounded down), spread over the threads.
  const size_t per_block = WEIGHT_BYTES / 16 / gridDim.x;
  float acc = 0.f;
  for (int s = 0; s < STAGES; s++) {
    // 1. Weights before the wait: this block's share of stage s, into registers.
    const size_t base = ((size_t)(token * STAGES + s) * gridDim.x + blockIdx.x) * per_block % (weight_words - per_block);
    uint4 w[(WEIGHT_BYTES / 16 / 256 + THREADS - 1) / THREADS + 1];
    // LIGHT_PRODUCERS: producer blocks load no weights (is a stage's link the slowest producer's
    // weights, arriving late, rather than the signal's round trips?).
    const int nw = LIGHT_PRODUCERS && producer ? 0 : (int)((per_block + THREADS - 1 - threadIdx.x) / THREADS);
#pragma unroll
    for (int i = 0; i < (int)(sizeof(w) / sizeof(w[0])); i++)
      w[i] = i < nw ? __ldcs(weights + base + threadIdx.x + (size_t)i * THREADS) : make_uint4(0, 0, 0, 0);
    // 2. The wait and row s − 1 (stage 0 reads row STAGES − 1 of the last token: no wait).
    float x[PER_THREAD];
    const int prev = s == 0 ? STAGES - 1 : s - 1;
    if (MODE == 0 || MODE == 1) {
      if (threadIdx.x == 0 && s > 0) {
        const unsigned target = token * waiters;
        const unsigned long long deadline = now_ns() + TIMEOUT_NS;
        for (unsigned spins = 0;; spins++) {
          unsigned v;
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counters + 32 * prev) : "memory");
          if ((int)(v - target) >= 0) break;
          if (spins > 4) __nanosleep(64);
          if (now_ns() > deadline) { atomicExch(err, 1u); failed = 1; break; }
        }
      }
      __syncthreads();
      if (failed) return;
#pragma unroll
      for (int k = 0; k < PER_THREAD; k++) x[k] = __ldcg(rows + (size_t)prev * DIM + threadIdx.x + k * THREADS);
    } else if (MODE == 2) {
      const unsigned want = s == 0 ? token - 1 : token;
      const uint2* row = flagged + (size_t)prev * DIM;
      unsigned stale = (1u << PER_THREAD) - 1;  // elements whose flag is not yet the token's
      const unsigned long long deadline = now_ns() + TIMEOUT_NS;
      for (unsigned spins = 0; stale; spins++) {
        // Every stale element's load in flight at once, then the flags (a check right after
        // each load would wait a round trip per element).
        unsigned long long v[PER_THREAD];
#pragma unroll
        for (int k = 0; k < PER_THREAD; k++) {
          v[k] = 0;
          // POLL_FIRST: while the thread's first element is stale, poll only it (a tenth of
          // the loads in flight while producers are still working).
          if (!(stale >> k & 1) || (POLL_FIRST && k > 0 && (stale & 1))) continue;
          // One 64-bit access: value and flag are read together (single-copy atomic).
          asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v[k]) : "l"(row + threadIdx.x + k * THREADS));
        }
#pragma unroll
        for (int k = 0; k < PER_THREAD; k++) {
          if ((stale >> k & 1) && ((unsigned)(v[k] >> 32) == want || s == 0)) {
            x[k] = __uint_as_float((unsigned)v[k]);
            stale &= ~(1u << k);
          }
        }
        if (stale && spins > 4) __nanosleep(BACKOFF_NS);
        if (stale && now_ns() > deadline) {
          atomicExch(err, 1u);  // stale values from here on: the printed figure says TIMED OUT
          for (int k = 0; k < PER_THREAD; k++) if (stale >> k & 1) x[k] = 0.f;
          stale = 0;
        }
      }
    } else {
#pragma unroll
      for (int k = 0; k < PER_THREAD; k++) x[k] = __ldcg(rows + (size_t)prev * DIM + threadIdx.x + k * THREADS);
    }
    // 3. The statistic.
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < PER_THREAD; k++) ss += x[k] * x[k];
    const float r = rsqrtf(block_sum(ss, red) / DIM + 1e-6f);
    // The weights' term (keeps the loads; ~0 in value).
    float wsum = 0.f;
#pragma unroll
    for (int i = 0; i < (int)(sizeof(w) / sizeof(w[0])); i++) wsum += (float)(w[i].x ^ w[i].y ^ w[i].z ^ w[i].w);
    acc += wsum;
    // 4. Producers write their 16 elements of row s: element e = CHUNK·block + lane, from the
    //    thread that holds element e's predecessor row value (x[k] at e = tid + k·THREADS).
    if (producer) {
      const int e0 = blockIdx.x * CHUNK;
#pragma unroll
      for (int k = 0; k < PER_THREAD; k++) {
        const int e = threadIdx.x + k * THREADS;
        if (e < e0 || e >= e0 + CHUNK) continue;
        const float v = 0.999f * x[k] * r + wsum * 1e-30f;
        if (MODE == 2) {
          const unsigned long long pair = (unsigned long long)token << 32 | __float_as_uint(v);
          asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(flagged + (size_t)s * DIM + e), "l"(pair) : "memory");
        } else {
          __stcg(rows + (size_t)s * DIM + e, v);
        }
      }
    }
    // 5. The signal.
    if (MODE == 0 || (MODE == 1 && producer)) {
      __syncthreads();
      if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + 32 * s) : "memory");
    }
  }
  if (acc == 12345.f) *sink = acc;
}

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));     \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

template <int MODE>
int run(const char* name, int grid, const uint4* weights, size_t words, float* rows, uint2* flagged,
        unsigned* counters, unsigned* err, float* sink) {
  CK(cudaMemset(counters, 0, STAGES * 128));
  CK(cudaMemset(flagged, 0, (size_t)STAGES * DIM * 8));
  CK(cudaMemset(err, 0, 4));
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms;
  for (unsigned t = 1; t <= TOKENS; t++) {
    CK(cudaEventRecord(a));
    chain<MODE><<<grid, THREADS>>>(weights, words, rows, flagged, counters, t, err, sink);
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float m;
    CK(cudaEventElapsedTime(&m, a, b));
    if (t > 5) ms.push_back(m);
  }
  CK(cudaGetLastError());
  unsigned e;
  CK(cudaMemcpy(&e, err, 4, cudaMemcpyDeviceToHost));
  std::sort(ms.begin(), ms.end());
  const float med = ms[ms.size() / 2];
  printf("%-16s %7.3f ms a token  %5.2f µs a stage  (min %.3f)%s\n", name, med, med * 1e3 / STAGES, ms[0],
         e ? "  TIMED OUT" : "");
  return 0;
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int grid = 2 * sms;
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain<2>, THREADS, 0));
  if (per_sm < 2) {
    printf("only %d blocks an SM fit: the grid would not be co-resident\n", per_sm);
    return 1;
  }
  const size_t bytes = 2ull << 30, words = bytes / 16;
  uint4* weights;
  float *rows, *sink;
  uint2* flagged;
  unsigned *counters, *err;
  CK(cudaMalloc(&weights, bytes));
  CK(cudaMemset(weights, 0x5a, bytes));
  CK(cudaMalloc(&rows, (size_t)STAGES * DIM * 4));
  std::vector<float> one((size_t)STAGES * DIM, 1.f);
  CK(cudaMemcpy(rows, one.data(), one.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&flagged, (size_t)STAGES * DIM * 8));
  CK(cudaMalloc(&counters, STAGES * 128));
  CK(cudaMalloc(&err, 4));
  CK(cudaMalloc(&sink, 4));
  printf("%d SMs, grid %d × %d, %d stages, row %d, %.1f MB of weights a stage\n", sms, grid, THREADS, STAGES, DIM,
         WEIGHT_BYTES / 1e6);
  for (int rep = 0; rep < 2; rep++) {
    if (run<0>("counter, all", grid, weights, words, rows, flagged, counters, err, sink)) return 1;
    if (run<1>("counter, prod", grid, weights, words, rows, flagged, counters, err, sink)) return 1;
    if (run<2>("flagged", grid, weights, words, rows, flagged, counters, err, sink)) return 1;
    if (run<3>("no wait", grid, weights, words, rows, flagged, counters, err, sink)) return 1;
  }
  return 0;
}
