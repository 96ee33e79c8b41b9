// Probe for the folded residual step (issues 9/10, docs/perf-notes.md "Seventh session", item 9): a
// tensor-core matvec that follows an attention or MLP output starts by rebuilding its own input,
// input = norm2(x') · w2 with x' = (x + norm1(o) · w1) · scale, in every block. Folded, that prologue
// adds 4.7–6.6 µs of block work to each of three stages a layer (megakernel traces). How much of it
// is the arithmetic's shape, and how much would another shape save? Each variant runs the prologue
// of one E4B row (2,560 floats, one token) in every block of a 264-block grid, ITER times in a row
// inside one launch (each round on another of 16 rows, loads through L2 only, as for rows another
// block just wrote), and writes the input to shared memory as the matvec would; reported per round.
//
//   A  megagemma today (`residual_stats` + `residual_inputs`): elements i = tid + e·256 in registers;
//      Σ o² (f64) → block reduction → r1; w1 loaded; x' and Σ x'² → block reduction → r2; then the
//      input build re-reads x, o, w1, w2 per float4 from L2.
//   B  A with w1 loaded beside o and x (branch `next`, graph kernels).
//   C  one float4 mapping for both: x, o, w1, w2 loaded once, x' and the input built from registers
//      (other summation order: add_norm_body would have to follow).
//   D  C with one reduction: Σ o², Σ x², Σ x·o·w1, Σ (o·w1)² together, Σ x'² by expansion in f64
//      (not the bits of the f32 x'; add_norm_body would have to follow).
//   E  the block's inputs alone (the cost of a stage without a folded step): x loaded, written.
//
// Measured on the H200, 2026-12-01 (docs/perf-notes.md, "Eighth session", item 1), µs per round: A 3.636, B 3.149,
// C 1.616, D 1.901, E 0.584. megagemma's residual step took form C (commit ea9418e).
//
// Build and run on the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/r tools/probes/residual_step.cu && /tmp/r
#include <cstdio>
#include <cstdint>

#define DIM 2560
#define THREADS 256
#define EPT 12  // as RES_EPT: elements per thread in the elementwise mapping
#define F4 ((DIM / 4 + THREADS - 1) / THREADS)  // float4s per thread in the float4 mapping (3)
#define ROWS 16
#define ITER 32

template <int N>
__device__ __forceinline__ void block_sum(double (&v)[N], double (*sh)[32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int n = 0; n < N; n++)
    for (int o = 16; o > 0; o >>= 1) v[n] += __shfl_xor_sync(0xffffffffu, v[n], o);
  __syncthreads();
  if (lane == 0)
#pragma unroll
    for (int n = 0; n < N; n++) sh[n][warp] = v[n];
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; n++) {
    double t = sh[n][0];
    for (int i = 1; i < THREADS / 32; i++) t += sh[n][i];
    v[n] = t;
  }
}

__device__ __forceinline__ float rinv(double ss) { return (float)(1.0 / sqrt(ss / (double)DIM + 1e-6)); }

__device__ __forceinline__ float lane4(float4 v, int c) { return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w; }

// x' = (x + o·r1·w1)·scale, in megagemma's operation order.
__device__ __forceinline__ float xprime(float x, float o, float w1, float r1, float scale) {
  return __fmul_rn(__fadd_rn(x, __fmul_rn(__fmul_rn(o, r1), w1)), scale);
}

// Writes one float4 of input to shared memory (the matvec would split it into fp16 fragments).
__device__ __forceinline__ void put(float* in, int k, float4 v) { *(float4*)(in + k) = v; }

template <char V>
__global__ void __launch_bounds__(THREADS) prologue(const float* x, const float* o, const float* w1, const float* w2,
                                                    float scale, float* out) {
  __shared__ double sh[4][32];
  __shared__ __align__(16) float in[DIM];
  float acc = 0.f;
  for (int it = 0; it < ITER; it++) {
    const float* xr = x + (size_t)((it + blockIdx.x) % ROWS) * DIM;
    const float* orow = o + (size_t)((it + blockIdx.x) % ROWS) * DIM;
    if (V == 'A' || V == 'B') {
      float ov[EPT], xv[EPT], wv[EPT];
#pragma unroll
      for (int e = 0; e < EPT; e++) {
        const int i = threadIdx.x + e * THREADS;
        ov[e] = i < DIM ? __ldcg(orow + i) : 0.f;
        xv[e] = i < DIM ? __ldcg(xr + i) : 0.f;
        if (V == 'B') wv[e] = i < DIM ? __ldcg(w1 + i) : 0.f;
      }
      double ss[1] = {0.0};
#pragma unroll
      for (int e = 0; e < EPT; e++)
        if (threadIdx.x + e * THREADS < DIM) ss[0] += (double)ov[e] * (double)ov[e];
      block_sum<1>(ss, sh);
      const float r1 = rinv(ss[0]);
      double s2[1] = {0.0};
#pragma unroll
      for (int e = 0; e < EPT; e++) {
        const int i = threadIdx.x + e * THREADS;
        if (i >= DIM) continue;
        const float v = xprime(xv[e], ov[e], V == 'B' ? wv[e] : __ldcg(w1 + i), r1, scale);
        s2[0] += (double)v * (double)v;
      }
      block_sum<1>(s2, sh);
      const float r2 = rinv(s2[0]);
      for (int f = threadIdx.x; f < DIM / 4; f += THREADS) {  // the input build re-reads its float4s
        const float4 xv4 = __ldcg((const float4*)xr + f), ov4 = __ldcg((const float4*)orow + f);
        const float4 a = __ldcg((const float4*)w1 + f), b = __ldcg((const float4*)w2 + f);
        auto in_c = [&](int c) {
          return __fmul_rn(__fmul_rn(xprime(lane4(xv4, c), lane4(ov4, c), lane4(a, c), r1, scale), r2), lane4(b, c));
        };
        put(in, 4 * f, make_float4(in_c(0), in_c(1), in_c(2), in_c(3)));
      }
    } else if (V == 'C' || V == 'D') {
      float4 xv[F4], ov[F4], av[F4], bv[F4];
#pragma unroll
      for (int q = 0; q < F4; q++) {
        const int f = threadIdx.x + q * THREADS;
        const bool live = f < DIM / 4;
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        xv[q] = live ? __ldcg((const float4*)xr + f) : z;
        ov[q] = live ? __ldcg((const float4*)orow + f) : z;
        av[q] = live ? __ldcg((const float4*)w1 + f) : z;
        bv[q] = live ? __ldcg((const float4*)w2 + f) : z;
      }
      float r1, r2;
      float xs[F4][4];
      if (V == 'C') {
        double ss[1] = {0.0};
#pragma unroll
        for (int q = 0; q < F4; q++) {
          const float e[4] = {ov[q].x, ov[q].y, ov[q].z, ov[q].w};
#pragma unroll
          for (int c = 0; c < 4; c++) ss[0] += (double)e[c] * (double)e[c];
        }
        block_sum<1>(ss, sh);
        r1 = rinv(ss[0]);
        double s2[1] = {0.0};
#pragma unroll
        for (int q = 0; q < F4; q++)
#pragma unroll
          for (int c = 0; c < 4; c++) {
            xs[q][c] = xprime(lane4(xv[q], c), lane4(ov[q], c), lane4(av[q], c), r1, scale);
            s2[0] += (double)xs[q][c] * (double)xs[q][c];
          }
        block_sum<1>(s2, sh);
        r2 = rinv(s2[0]);
      } else {
        double s[4] = {0.0, 0.0, 0.0, 0.0};  // Σ o², Σ x², Σ x·o·w1, Σ (o·w1)²
#pragma unroll
        for (int q = 0; q < F4; q++)
#pragma unroll
          for (int c = 0; c < 4; c++) {
            const double od = lane4(ov[q], c), xd = lane4(xv[q], c), ow = od * (double)lane4(av[q], c);
            s[0] += od * od, s[1] += xd * xd, s[2] += xd * ow, s[3] += ow * ow;
          }
        block_sum<4>(s, sh);
        r1 = rinv(s[0]);
        const double r1d = r1, sc = scale;
        r2 = rinv(sc * sc * (s[1] + 2.0 * r1d * s[2] + r1d * r1d * s[3]));
#pragma unroll
        for (int q = 0; q < F4; q++)
#pragma unroll
          for (int c = 0; c < 4; c++) xs[q][c] = xprime(lane4(xv[q], c), lane4(ov[q], c), lane4(av[q], c), r1, scale);
      }
#pragma unroll
      for (int q = 0; q < F4; q++) {
        const int f = threadIdx.x + q * THREADS;
        if (f >= DIM / 4) continue;
        float r[4];
#pragma unroll
        for (int c = 0; c < 4; c++) r[c] = __fmul_rn(__fmul_rn(xs[q][c], r2), lane4(bv[q], c));
        put(in, 4 * f, make_float4(r[0], r[1], r[2], r[3]));
      }
    } else {  // 'E': the input alone
      for (int f = threadIdx.x; f < DIM / 4; f += THREADS) put(in, 4 * f, __ldcg((const float4*)xr + f));
    }
    __syncthreads();
    acc += in[(threadIdx.x * 7 + it) % DIM];
    __syncthreads();
  }
  if (acc == 1.2345f) out[blockIdx.x] = acc;  // keeps the work
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float *x, *o, *w1, *w2, *out;
  cudaMalloc(&x, ROWS * DIM * 4);
  cudaMalloc(&o, ROWS * DIM * 4);
  cudaMalloc(&w1, DIM * 4);
  cudaMalloc(&w2, DIM * 4);
  cudaMalloc(&out, 4096 * 4);
  cudaMemset(x, 0x3c, ROWS * DIM * 4);
  cudaMemset(o, 0x3d, ROWS * DIM * 4);
  cudaMemset(w1, 0x3e, DIM * 4);
  cudaMemset(w2, 0x3f, DIM * 4);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  struct Variant {
    const char* name;
    void (*k)(const float*, const float*, const float*, const float*, float, float*);
  } vs[] = {{"A today", prologue<'A'>},
            {"B w1 early", prologue<'B'>},
            {"C float4, from registers", prologue<'C'>},
            {"D C + one reduction", prologue<'D'>},
            {"E input alone", prologue<'E'>}};
  printf("per round (one E4B row, %d blocks x %d threads, %d rounds a launch):\n", sms * 2, THREADS, ITER);
  for (const Variant& v : vs) {
    for (int w = 0; w < 3; w++) v.k<<<sms * 2, THREADS>>>(x, o, w1, w2, 1.f, out);
    cudaDeviceSynchronize();
    cudaEventRecord(e0);
    for (int r = 0; r < 20; r++) v.k<<<sms * 2, THREADS>>>(x, o, w1, w2, 1.f, out);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    printf("  %-26s %7.3f us (%s)\n", v.name, ms * 1e3 / (20 * ITER), cudaGetErrorString(cudaGetLastError()));
  }
  return 0;
}
