// Probe for the decode matvecs (issues 9/10, docs/perf-notes.md "Eighth session"): are megagemma's
// tensor-core 4-bit matvecs bound by instruction issue, and would 8-bit integer MMA halve their
// instructions? Today's form (fp16 `mma.m16n8k16`) spends 36 of ~84 instructions per 64-column chunk
// of a 16-row tile turning codes into fp16 (q − 8), plus the input's fp16 high and low parts in two B
// columns; the third session's stall profile found it latency/issue-bound at 16 warps per SM, and the
// read floor (stream_floor.cu) is 2–3.5× below it at every layer shape.
//
// The integer form: codes stay integers. `mma.m16n8k32.s32.u8.s8` multiplies bytes, so a code word of
// eight nibbles becomes two A registers with one AND and one shift+AND (3 instructions per 8 weights
// instead of 9), and the input becomes an exact integer: per 64-column chunk, x · 2^E rounded to an
// int32 (|v| < 2^30, E from the chunk's largest |x|: 30 bits relative to it), written as four
// balanced base-256 digits d_p ∈ [−128, 127] (v = Σ d_p·256^p) in four B columns ("planes"). One
// chunk is two integer MMAs into one int32 accumulator (exact: |Σ| ≤ 15·128·64); then per lane
// acc_i += (s·2^−E)·float(c_i) for its two rows × two planes, and b·Σx per row. The planes are
// combined (×256^p) and the lanes added once per tile, not per chunk. ~30 instructions per chunk.
// Accuracy: the input carries 30 bits against its chunk's largest element, the sums are f32 — as
// close to an f32 dot product as today's two-fp16 split (~2^-22); checked here against f64.
//
// Measured on the H200, 2026-12-01 (docs/perf-notes.md, "Eighth session"): integer form 3.2e-7 rel L2 from f64; best
// per launch fp16 / integer: gate+up 18.5 / 13.5 µs, down 23.6 / 16.9, Q/K/V 7.5 / 6.7, O 6.4 / 5.7, LM head
// — / 113.6 µs (3.69 TB/s). megagemma's matvec took this form (centred differently: its codes are stored XOR 8 and
// read as s8 high nibbles); the token got 5% faster, not the 27% the large matvecs promise here.
//
// Both forms run the shapes of one E4B layer, 42 cold matrices back to back, 5 rounds, µs per launch
// (launch gap included, as mma_layer_shapes.cu and stream_floor.cu report), for U chunks in flight
// per warp, 1–4 blocks per SM and S column parts per tile (partial sums by atomics).
//
// Build and run on the GPU machine:
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -o /tmp/i tools/probes/imma_gemv.cu && /tmp/i
#include <cmath>
#include <vector>
#include "probe.cuh"  // the fp16 form (`gemv`, the same-run baseline), store, fill_hash, per_launch_us

__device__ __forceinline__ void imma16832(int c[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ---- integer form ----
// Codes: [tiles][chunks][32] uint4; for lane (gid, tig), bits 8i + 4s of word r hold the code of
//   row gid + 8·(r & 1), column 32s + 16·(r >> 1) + 4·tig + i  (the A fragment of m16n8k32 for k-step s).
// Scales: [tiles][chunks][8 gid] float4 = (s, b) of row gid, then of gid + 8.
// Shared: B fragments [chunks][16 lanes] uint4 = (step 0 b0, b1, step 1 b0, b1) of lane (plane gid < 4,
//   tig), then per chunk float2 (2^−E, Σx).
__device__ __forceinline__ void build_planes(uint4* bf, float2* cf, const float* x, int K) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  unsigned char* bytes = (unsigned char*)bf;
  for (int c = warp; c < K / 64; c += nw) {
    const float2 v = *(const float2*)(x + c * 64 + 2 * lane);
    float amax = fmaxf(fabsf(v.x), fabsf(v.y)), sum = v.x + v.y;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
    }
    int e;
    frexpf(amax, &e);  // amax < 2^e
    const int E = amax > 0.f ? 30 - e : 0;
    int iv[2] = {__float2int_rn(ldexpf(v.x, E)), __float2int_rn(ldexpf(v.y, E))};
    if (lane == 0) cf[c] = make_float2(ldexpf(1.f, -E), sum);
    // element k = 2·lane + j: step s = k / 32, kk = k % 32, reg = kk / 16, tig = (kk % 16) / 4, byte i = k % 4
    const int k = 2 * lane, s = k >> 5, kk = k & 31, reg = kk >> 4, tg = (kk & 15) >> 2, i = k & 3;
#pragma unroll
    for (int p = 0; p < 4; p++) {
      unsigned short pair = 0;
#pragma unroll
      for (int j = 0; j < 2; j++) {
        const int d = (int)(signed char)(iv[j] & 0xff);
        iv[j] = (iv[j] - d) >> 8;
        pair |= (unsigned short)((unsigned char)d) << (8 * j);
      }
      *(unsigned short*)(bytes + (size_t)c * 256 + (p * 4 + tg) * 16 + (s * 2 + reg) * 4 + i) = pair;
    }
  }
  __syncthreads();
}

template <int U>
__global__ void __launch_bounds__(256) gemv_i8(const uint4* __restrict__ w, const float4* __restrict__ sb,
                                               const float* __restrict__ x, float* __restrict__ y, int N, int K,
                                               int S) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* bf = (uint4*)smem;
  float2* cf = (float2*)(smem + (size_t)(K / 64) * 256);
  build_planes(bf, cf, x, K);
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, nwarps = (gridDim.x * blockDim.x) >> 5;
  const int G = K / 64, items = (N / 16) * S, per = G / S;
  const bool has_b = gid < 4;
  for (int it = warp; it < items; it += nwarps) {
    const int t = it / S, g_lo = (it % S) * per, g_hi = g_lo + per;
    const uint4* wt = w + (size_t)t * G * 32 + lane;
    const float4* st = sb + (size_t)t * G * 8 + gid;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, yb0 = 0.f, yb1 = 0.f;
    for (int g0 = g_lo; g0 < g_hi; g0 += U) {
      uint4 q[U];
      float4 sc[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (g0 + u < g_hi) {
          q[u] = __ldcs(wt + (g0 + u) * 32);
          sc[u] = __ldcs(st + (g0 + u) * 8);
        }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int g = g0 + u;
        if (g >= g_hi) break;
        const uint4 b = has_b ? bf[g * 16 + lane] : make_uint4(0, 0, 0, 0);
        const float2 f = cf[g];
        int c[4] = {0, 0, 0, 0};
        const uint32_t m = 0x0F0F0F0Fu;
        imma16832(c, q[u].x & m, q[u].y & m, q[u].z & m, q[u].w & m, b.x, b.y);
        imma16832(c, (q[u].x >> 4) & m, (q[u].y >> 4) & m, (q[u].z >> 4) & m, (q[u].w >> 4) & m, b.z, b.w);
        const float s0 = sc[u].x * f.x, s1 = sc[u].z * f.x;
        a0 = fmaf(s0, (float)c[0], a0);
        a1 = fmaf(s0, (float)c[1], a1);
        a2 = fmaf(s1, (float)c[2], a2);
        a3 = fmaf(s1, (float)c[3], a3);
        yb0 = fmaf(sc[u].y, f.y, yb0);
        yb1 = fmaf(sc[u].w, f.y, yb1);
      }
    }
    // Planes 2·tig and 2·tig + 1 live in this lane (tig < 2; lanes 2, 3 hold the empty columns 4–7).
    const float w0 = tig == 0 ? 1.f : tig == 1 ? 65536.f : 0.f, w1 = w0 * 256.f;
    float y0 = fmaf(w1, a1, w0 * a0), y1 = fmaf(w1, a3, w0 * a2);
    y0 += __shfl_xor_sync(0xffffffffu, y0, 1);
    y1 += __shfl_xor_sync(0xffffffffu, y1, 1);
    store(y, t, S, y0 + yb0, y1 + yb1);
  }
}

// Both forms against f64 on one matrix with known codes, scales and a heavy-tailed input.
static void check(int sms) {
  const int N = 256, K = 2560, G = K / 64;
  std::vector<uint8_t> q((size_t)N * K);
  std::vector<float> s((size_t)N * G), b((size_t)N * G), x(K);
  uint32_t h = 12345;
  auto rnd = [&]() { h ^= h << 13, h ^= h >> 17, h ^= h << 5; return h; };
  for (auto& v : q) v = rnd() & 15;
  for (size_t i = 0; i < s.size(); i++) {
    s[i] = 0.001f + (rnd() % 1000) * 2e-5f;
    b[i] = -8.f * s[i] + ((int)(rnd() % 200) - 100) * 1e-4f;
  }
  for (int i = 0; i < K; i++) x[i] = ((int)(rnd() % 20001) - 10000) * 1e-4f * ((rnd() % 97) == 0 ? 300.f : 1.f);
  // fp16 form: scales as half2, input rounded to fp16 by the kernel; integer form: f32 scales.
  std::vector<uint4> w16((size_t)N / 16 * G * 32), w8((size_t)N / 16 * G * 32);
  std::vector<half2> sb16((size_t)N / 16 * G * 16);
  std::vector<float4> sb8((size_t)N / 16 * G * 8);
  for (int t = 0; t < N / 16; t++)
    for (int g = 0; g < G; g++) {
      for (int lane = 0; lane < 32; lane++) {
        const int gid = lane >> 2, tig = lane & 3;
        uint32_t a[4] = {0, 0, 0, 0}, c[4] = {0, 0, 0, 0};
        for (int kt = 0; kt < 4; kt++) {
          const int rows[4] = {gid, gid + 8, gid, gid + 8}, cols[4] = {tig * 2, tig * 2, tig * 2 + 8, tig * 2 + 8};
          for (int i = 0; i < 4; i++) {
            const int r = t * 16 + rows[i], k = g * 64 + kt * 16 + cols[i];
            a[kt] |= (uint32_t)q[(size_t)r * K + k] << (4 * i);
            a[kt] |= (uint32_t)q[(size_t)r * K + k + 1] << (16 + 4 * i);
          }
        }
        for (int r = 0; r < 4; r++)
          for (int st = 0; st < 2; st++)
            for (int i = 0; i < 4; i++) {
              const int row = t * 16 + gid + 8 * (r & 1), k = g * 64 + 32 * st + 16 * (r >> 1) + 4 * tig + i;
              c[r] |= (uint32_t)q[(size_t)row * K + k] << (8 * i + 4 * st);
            }
        w16[((size_t)t * G + g) * 32 + lane] = make_uint4(a[0], a[1], a[2], a[3]);
        w8[((size_t)t * G + g) * 32 + lane] = make_uint4(c[0], c[1], c[2], c[3]);
      }
      for (int r = 0; r < 16; r++) sb16[((size_t)t * G + g) * 16 + r] = __floats2half2_rn(s[(t * 16 + r) * G + g], b[(t * 16 + r) * G + g]);
      for (int gd = 0; gd < 8; gd++) {
        const int r0 = t * 16 + gd, r1 = r0 + 8;
        sb8[((size_t)t * G + g) * 8 + gd] = make_float4(s[r0 * G + g], b[r0 * G + g], s[r1 * G + g], b[r1 * G + g]);
      }
    }
  uint4 *dw16, *dw8; half2* dsb16; float4* dsb8; float *dx, *dy;
  cudaMalloc(&dw16, w16.size() * 16), cudaMalloc(&dw8, w8.size() * 16), cudaMalloc(&dsb16, sb16.size() * 4);
  cudaMalloc(&dsb8, sb8.size() * 16), cudaMalloc(&dx, K * 4), cudaMalloc(&dy, 2 * N * 4);
  cudaMemcpy(dw16, w16.data(), w16.size() * 16, cudaMemcpyHostToDevice);
  cudaMemcpy(dw8, w8.data(), w8.size() * 16, cudaMemcpyHostToDevice);
  cudaMemcpy(dsb16, sb16.data(), sb16.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dsb8, sb8.data(), sb8.size() * 16, cudaMemcpyHostToDevice);
  cudaMemcpy(dx, x.data(), K * 4, cudaMemcpyHostToDevice);
  gemv<4><<<sms, 256, K * 2 + G * 4>>>(dw16, dsb16, dx, dy, N, K, 1);
  gemv_i8<4><<<sms, 256, G * 256 + G * 8>>>(dw8, dsb8, dx, dy + N, N, K, 1);
  std::vector<float> y(2 * N);
  cudaMemcpy(y.data(), dy, 2 * N * 4, cudaMemcpyDeviceToHost);
  double e16 = 0, e8 = 0, nr = 0, m16 = 0, m8 = 0;
  for (int r = 0; r < N; r++) {
    double ref = 0, ref16 = 0;
    for (int k = 0; k < K; k++) {
      const int g = k / 64;
      ref += ((double)s[r * G + g] * q[(size_t)r * K + k] + b[r * G + g]) * x[k];
      const float2 sbh = __half22float2(sb16[((size_t)(r / 16) * G + g) * 16 + r % 16]);
      ref16 += ((double)sbh.x * q[(size_t)r * K + k] + sbh.y) * x[k];
    }
    e16 += (y[r] - ref16) * (y[r] - ref16), e8 += (y[N + r] - ref) * (y[N + r] - ref), nr += ref * ref;
    m16 = fmax(m16, fabs(y[r] - ref16) / (fabs(ref16) + 1e-30)), m8 = fmax(m8, fabs(y[N + r] - ref) / (fabs(ref) + 1e-30));
  }
  printf("check (N %d, K %d, input with 1%% outliers x300): rel L2 error vs f64 — fp16 form %.2e (max %.2e), "
         "integer form %.2e (max %.2e) (%s)\n", N, K, sqrt(e16 / nr), m16, sqrt(e8 / nr), m8,
         cudaGetErrorString(cudaGetLastError()));
  cudaFree(dw16), cudaFree(dw8), cudaFree(dsb16), cudaFree(dsb8), cudaFree(dx), cudaFree(dy);
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  check(sms);
  float *x, *y;
  cudaMalloc(&x, 10240 * 4);
  cudaMalloc(&y, 262144 * 4);
  {
    std::vector<float> hx(10240);
    for (int i = 0; i < 10240; i++) hx[i] = (i % 13 - 6) * 0.25f;
    cudaMemcpy(x, hx.data(), 10240 * 4, cudaMemcpyHostToDevice);
  }
  printf("%-22s %-8s %6s %3s %9s %9s\n", "shape", "kernel", "blocks", "S", "us/launch", "GB/s");
  for (const Shape& sh : E4B_SHAPES) {
    const int layers = sh.N > 100000 ? 2 : LAYERS;
    const int G = sh.K / 64;
    const size_t wbytes = (size_t)sh.N * sh.K / 2, s16 = (size_t)sh.N * G * 4, s8 = (size_t)sh.N * G * 8;
    std::vector<uint4*> ws(layers);
    std::vector<void*> ss(layers);
    for (int l = 0; l < layers; ++l) {
      cudaMalloc(&ws[l], wbytes);
      cudaMalloc(&ss[l], s8);
      fill_hash<<<1024, 256>>>((uint32_t*)ws[l], wbytes / 4, l);
      cudaMemset(ss[l], 0x1c, s8);
    }
    struct Variant {
      const char* name;
      int form;  // 0 fp16, 1 integer
      void* kern;
    } variants[] = {{"f16 U4", 0, (void*)gemv<4>}, {"f16 U8", 0, (void*)gemv<8>},
                    {"i8 U4", 1, (void*)gemv_i8<4>},   {"i8 U8", 1, (void*)gemv_i8<8>},
                    {"i8 U16", 1, (void*)gemv_i8<16>}};
    for (const Variant& v : variants) {
      const int smem = v.form == 0 ? sh.K * 2 + G * 4 : G * 256 + G * 8;
      const size_t sbytes = v.form == 0 ? s16 : s8;
      cudaFuncSetAttribute(v.kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      for (int bps : {1, 2, 3, 4}) {
        for (int S : {1, 2, 4, 8}) {
          if (G % S) continue;
          auto launch = [&](int l) {
            if (v.form == 0)
              ((void (*)(const uint4*, const half2*, const float*, float*, int, int, int))v.kern)<<<sms * bps, 256, smem>>>(
                  ws[l], (const half2*)ss[l], x, y, sh.N, sh.K, S);
            else
              ((void (*)(const uint4*, const float4*, const float*, float*, int, int, int))v.kern)<<<sms * bps, 256, smem>>>(
                  ws[l], (const float4*)ss[l], x, y, sh.N, sh.K, S);
          };
          const double us = per_launch_us(launch, layers, ROUNDS);
          printf("%-22s %-8s %6d %3d %9.2f %9.0f %s\n", sh.name, v.name, sms * bps, S, us, (wbytes + sbytes) / us / 1e3,
                 cudaGetErrorString(cudaGetLastError()));
        }
      }
    }
    for (int l = 0; l < layers; ++l) cudaFree(ws[l]), cudaFree(ss[l]);
  }
  return 0;
}
