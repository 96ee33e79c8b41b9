// Shared helpers for every kernel file; inlined by the Rust preprocessor (no CUDA headers).
#pragma once

typedef unsigned short bf16_t;
typedef unsigned long long u64;

#define NEG_INF __int_as_float(0xff800000)

// Weight storage formats (`fmt` of DevMat; keep in sync with src/weights.rs).
#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define FMT_Q4 3
#define FMT_Q4T 4  // 4-bit affine, tensor-core tiled layout (matvec_mma.cu)

// A weight matrix on the device, passed by value. Q4: `w` holds [rows, cols/8] u32 words
// (nibble k of word j is weight 8j+k), `sb` holds [rows, cols/gs] (scale, bias) float pairs.
struct Mat {
  u64 w;
  u64 sb;
  int rows;
  int cols;
  int fmt;
  int gs;
};

// Programmatic dependent launch. Kernels launched with the PDL attribute (`PDL_KERNELS` in
// src/device.rs) may start while the previous kernel is still running: each calls `pdl_start()`
// before it reads or writes any activation (it waits for the previous kernel to finish and its
// writes to be visible, then lets the next kernel launch). Only weights may be touched before it.
// Both instructions are no-ops for a kernel launched without the attribute.
//
// Inside the decode megakernel (megakernel.cu, compiled with MEGAKERNEL defined) the same point
// waits for every block to have finished the previous stage instead.
// STAGE marks a stage kernel's body as a device function (the megakernel calls it too); BIG_STAGE
// one that is a real call in the megakernel, with its own register allocation (the matvecs).
#ifdef MEGAKERNEL
#define STAGE __device__ __forceinline__
#define BIG_STAGE __device__ __noinline__
__device__ void mk_wait();
__device__ __forceinline__ void pdl_start() { mk_wait(); }
#else
#define STAGE __device__ __forceinline__
#define BIG_STAGE __device__ __forceinline__
__device__ __forceinline__ void pdl_start() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#endif

// (value, index) pair order for the argmax: larger value first, then the lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, o);
    int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// The shared-window address of a pointer into shared memory (for cp.async).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// Asks for the 128-byte line holding `p` in L2 (a hint: no register waits for it).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

__device__ __forceinline__ float bf16_to_f32(bf16_t h) { return __uint_as_float(((unsigned)h) << 16); }

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
  float f;
  asm("{.reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t;}" : "=f"(f) : "h"(h));
  return f;
}

// w = q·scale + bias as two rounded operations (never fused), exactly as the CPU dequantizes.
__device__ __forceinline__ float q4_weight(unsigned q, float s, float b) {
  return __fadd_rn(__fmul_rn((float)q, s), b);
}

struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp()); }

// Block-wide reduction (blockDim.x a multiple of 32, at most 1024), combined in warp order so
// the result does not depend on timing; every thread gets it. Safe to call repeatedly.
// Blocks of eight warps (every launch on the decode path) read the warp results with a fixed,
// unrolled count of 16-byte loads instead of a loop of dependent-address loads: the same adds in
// the same order (fifteenth session: E4B decode −1.5%, same bits).
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op) {
  __shared__ __align__(16) T sh[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (nw == 8) {
    T w[8];
#pragma unroll
    for (int i = 0; i < 8; i++) w[i] = sh[i];
    T t = w[0];
#pragma unroll
    for (int i = 1; i < 8; i++) t = op(t, w[i]);
    return t;
  }
  T t = sh[0];
  for (int i = 1; i < nw; i++) t = op(t, sh[i]);
  return t;
}

// The type a row's sum of squares is accumulated and reduced in: f32, as DESIGN.md's CUDA
// contract allows (f32 accumulation). `STATS_F64` (MEGAGEMMA_CUDA_DEFINES) restores the f64 form of
// the CPU reference, which the forty-ninth session measured slower on the chain of every norm (f64
// conversions, double shuffles, the f64 `rsqrt`: graph E2B +2.1%, E4B +1.3%, megakernel +3.3% /
// +2.3% on an H100). Every GPU path uses these functions, so decode and verify stay bit-identical
// either way.
#ifdef STATS_F64
typedef double stat_t;
#else
typedef float stat_t;
#endif

__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, SumOp()); }
__device__ __forceinline__ stat_t block_sum_stat(stat_t v) { return block_reduce(v, SumOp()); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, MaxOp()); }

// 1 / RMS of a row from its sum of squares (+ eps): every norm's scale. The mean square as
// ss · (1/dim), the reciprocal independent of ss (scheduled before the reduction ends), not a
// division after it (fifteenth session: E4B decode −1.3% and −1%); then `rsqrtf` (with STATS_F64,
// the f64 `rsqrt`, about 1 ulp of a double). Every GPU path calls this one function, so decode and
// verify stay bit-identical.
__device__ __forceinline__ float rms_scale(stat_t ss, int dim, float eps) {
#ifndef STATS_F64
  return rsqrtf(__fadd_rn(__fmul_rn(ss, __frcp_rn((float)dim)), eps));
#else
  return (float)rsqrt(__dadd_rn(__dmul_rn(ss, __drcp_rn((double)dim)), (double)eps));
#endif
}

// 1 / RMS of x[0 .. dim) (+ eps), the mean square accumulated in `stat_t`. Called by every thread
// of the block.
__device__ __forceinline__ float inv_rms(const float* x, int dim, float eps) {
  stat_t ss = 0;
#pragma unroll 4
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    stat_t v = x[i];
    ss += v * v;
  }
  return rms_scale(block_sum_stat(ss), dim, eps);
}

// Whether this block is the last of `n` to arrive at `counter` (the same answer in every thread;
// `flag` is a __shared__ int of the caller's). Every block's writes before the call are visible to
// the last block after it: the block barrier orders them before thread 0's release, a release is
// cumulative, and the last block's acquire orders them before its barrier and reads (through L2:
// `__ldcg`). No `__threadfence()` in every thread, which cost more than this pair.
__device__ __forceinline__ bool last_to_arrive(unsigned* counter, int n, int& flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned old;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    flag = old == (unsigned)(n - 1);
  }
  __syncthreads();
  return flag;
}

// p[0] + p[stride] + … + p[(n − 1)·stride], added in that order, read through L2 (other blocks
// wrote them) LOADS loads at a time: one round trip per LOADS terms, not one per term.
template <int LOADS = 8>
__device__ __forceinline__ float sum_in_order(const float* p, u64 stride, int n) {
  float s = 0.f;
  for (int q0 = 0; q0 < n; q0 += LOADS) {
    float v[LOADS];
#pragma unroll
    for (int i = 0; i < LOADS; i++) v[i] = q0 + i < n ? __ldcg(p + (u64)(q0 + i) * stride) : 0.f;
#pragma unroll
    for (int i = 0; i < LOADS; i++)
      if (q0 + i < n) s += v[i];
  }
  return s;
}

// Three block sums at once (one barrier round), each combined exactly as `block_sum_stat` combines
// one: the same bits as three calls.
__device__ __forceinline__ void block_sum_stat3(stat_t& x, stat_t& y, stat_t& z) {
  __shared__ stat_t sh[3][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  x = warp_reduce(x, SumOp());
  y = warp_reduce(y, SumOp());
  z = warp_reduce(z, SumOp());
  __syncthreads();
  if (lane == 0) {
    sh[0][warp] = x;
    sh[1][warp] = y;
    sh[2][warp] = z;
  }
  __syncthreads();
  x = sh[0][0];
  y = sh[1][0];
  z = sh[2][0];
  for (int i = 1; i < nw; i++) {
    x = x + sh[0][i];
    y = y + sh[1][i];
    z = z + sh[2][i];
  }
}

// Per-head RMSNorm (weight w, or none) and rotate-half RoPE (inv_freq, or none) of head rows of
// hd ≤ 2·blockDim elements, in registers: thread i < hd/2 holds the pair (i, i + hd/2) of a row,
// the two elements the rotation mixes. A row's sum of squares is a² + b² per thread, then the
// block's in warp order. The long passes' `qkv_norm_rope` (ops.cu) and a short pass's attention
// (`ATT_FUSED_*` in attention.cu) both use these, so a cached K/V row has the same bits whichever
// pass wrote it.
__device__ __forceinline__ float2 head_pair(const float* row, int half) {
  const int i = threadIdx.x;
  return i < half ? make_float2(row[i], row[i + half]) : make_float2(0.f, 0.f);
}
__device__ __forceinline__ stat_t pair_sq(float2 v) {
  const stat_t a = v.x, b = v.y;
  return a * a + b * b;
}
// The pair normed (r), times the weight pair w when `weighted`, then rotated by pos·f (not when f = 0).
__device__ __forceinline__ float2 norm_rope_pair(float2 v, float r, bool weighted, float2 w, float f, int pos) {
  float a = __fmul_rn(v.x, r), b = __fmul_rn(v.y, r);
  if (weighted) {
    a = __fmul_rn(a, w.x);
    b = __fmul_rn(b, w.y);
  }
  if (f != 0.f) {
    float sn, cs;
    sincosf(__fmul_rn((float)pos, f), &sn, &cs);
    const float a2 = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
    b = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
    a = a2;
  }
  return make_float2(a, b);
}
// This thread's pair of a weight row (w[i], w[i + half]); ones where there is none.
__device__ __forceinline__ float2 weight_pair(const float* __restrict__ w, int half) {
  const int i = threadIdx.x;
  return w && i < half ? make_float2(w[i], w[i + half]) : make_float2(1.f, 1.f);
}
__device__ __forceinline__ void store_pair(float* row, int half, float2 v) {
  if (threadIdx.x < half) {
    row[threadIdx.x] = v.x;
    row[threadIdx.x + half] = v.y;
  }
}

// A residual step (`add_norm_body` in ops.cu, and folded into a matvec: `residual_stats` in
// matvec_mma.cu), four elements at a time. Both take a row's elements as float4s f = tid + q·blockDim
// and use these functions in the same order, so the step gives the same bits either way.
#define RES_F4 3  // float4s per thread kept in registers (rows up to 12·blockDim elements)

// s + Σ v², element by element: f32 fused multiply-adds, or with STATS_F64 in f64 (each square
// exact; four f32 squares per f64 add measured ±0, fifteenth session).
__device__ __forceinline__ stat_t sumsq4(stat_t s, float4 v) {
#ifndef STATS_F64
  return fmaf(v.w, v.w, fmaf(v.z, v.z, fmaf(v.y, v.y, fmaf(v.x, v.x, s))));
#else
  s += (double)v.x * (double)v.x;
  s += (double)v.y * (double)v.y;
  s += (double)v.z * (double)v.z;
  return s + (double)v.w * (double)v.w;
#endif
}

// (x + o·r·w)·scale per element: the residual update.
__device__ __forceinline__ float4 residual4(float4 x, float4 o, float r, float4 w, float scale) {
  float4 v;
  v.x = __fadd_rn(x.x, __fmul_rn(__fmul_rn(o.x, r), w.x));
  v.y = __fadd_rn(x.y, __fmul_rn(__fmul_rn(o.y, r), w.y));
  v.z = __fadd_rn(x.z, __fmul_rn(__fmul_rn(o.z, r), w.z));
  v.w = __fadd_rn(x.w, __fmul_rn(__fmul_rn(o.w, r), w.w));
  if (scale != 1.f) v = make_float4(__fmul_rn(v.x, scale), __fmul_rn(v.y, scale), __fmul_rn(v.z, scale), __fmul_rn(v.w, scale));
  return v;
}

// v·r·w per element: the norm after the step.
__device__ __forceinline__ float4 norm4(float4 v, float r, float4 w) {
  return make_float4(__fmul_rn(__fmul_rn(v.x, r), w.x), __fmul_rn(__fmul_rn(v.y, r), w.y),
                     __fmul_rn(__fmul_rn(v.z, r), w.z), __fmul_rn(__fmul_rn(v.w, r), w.w));
}

__device__ __forceinline__ float4 ld4(const float* p, u64 f) { return *(const float4*)(p + 4 * f); }
__device__ __forceinline__ void st4(float* p, u64 f, float4 v) { *(float4*)(p + 4 * f) = v; }

// A residual step's `o` row (token rows of `dim` floats, `base` = token · dim), float4 f. A split
// tensor-core launch may instead add its column parts' sums as 64-bit integers in units of 2^-32
// (`mma_block`: fire-and-forget adds, exact, so the same bits in any order; FIXED_SUMS, the default),
// and its readers get the row's pointer with bit 0 set: the sums converted here, each rounded once.
// ORDERED_SUMS (an experiment) keeps the older combine: the last block of each tile group adds the
// parts' stored sums in part order.
#if !defined(ORDERED_SUMS) && !defined(FIXED_SUMS)
#define FIXED_SUMS
#endif
#ifdef FIXED_SUMS
#define SUM_UNIT 4294967296.0f  // 2^32
// Adds v to the 64-bit sum at p (global memory), fire and forget. Spelled out as `red.global`: the
// megakernel's pointers come from its stage table, so `atomicAdd` compiled there to a generic
// atomic with a shared-memory fallback loop (ATOM.E.ADD.64 + ATOMS.CAST.SPIN) instead of the
// separate kernel's REDG.E.ADD.64.
__device__ __forceinline__ void red_add_sum(long long* p, long long v) {
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ float4 ld4_sum(const float* o, u64 base, u64 f) {
  if (!((u64)o & 1)) return ld4(o + base, f);
  const longlong2* p = (const longlong2*)((u64)o - 1) + base / 2 + 2 * f;
  const longlong2 a = p[0], b = p[1];
  const float u = 1.f / SUM_UNIT;
  return make_float4(__fmul_rn(__ll2float_rn(a.x), u), __fmul_rn(__ll2float_rn(a.y), u),
                     __fmul_rn(__ll2float_rn(b.x), u), __fmul_rn(__ll2float_rn(b.y), u));
}
#else
__device__ __forceinline__ float4 ld4_sum(const float* o, u64 base, u64 f) { return ld4(o + base, f); }
#endif

// Chunks [x, y) of slice s of `slices` of a row of n4 float4s: whole 64-column chunks (16 float4s),
// so a slice's prepared inputs (`prep_inputs`) are its own elements (the last chunk may be partial).
__device__ __forceinline__ int2 slice_chunks(int n4, int slices, int s) {
  const int chunks = (n4 + 15) / 16, per = (chunks + slices - 1) / slices;
  return make_int2(min(chunks, s * per), min(chunks, (s + 1) * per));
}
// The same slice's float4s [x, y).
__device__ __forceinline__ int2 norm_slice(int n4, int slices, int s) {
  const int2 c = slice_chunks(n4, slices, s);
  return make_int2(min(n4, c.x * 16), min(n4, c.y * 16));
}

// End of a sub-block, one block per row: x = (x + o·r_o·w1) · scale (the residual update and the
// per-layer scalar), then a = x·r_x·w2 (the next sub-block's pre-norm; skipped when w2 is null).
// A thread's elements are the float4s f = tid + q·blockDim (`residual4` and friends in common.cuh;
// `dim` % 4 == 0), kept in registers for rows of up to 4·RES_F4·blockDim elements: the norm
// weights w1 and w2 are loaded before `pdl_start()` (weights never depend on activations, so
// neither reduction waits for a load after it), o and x together right after it, so the row costs
// one load round trip and two block reductions. Wider rows (31B) re-read them, summing in the same
// order (w1 is then only asked of L2 before the wait).
// `residual_stats` (matvec_mma.cu) computes the same step folded into the next matvec: same bits.
// `slices` blocks per row (`add_norm`, `add_norm_prep_*`), each computing the row's
// statistics and writing its chunk-aligned slice (`norm_slice`) of x' into `x_out` and of a, so
// no block writes a whole row after its reductions. With several slices x_out is never x (the
// row's other blocks are still reading x); with one it may be (the step in place).
STAGE void add_norm_body(const int vb, float* x, const float* __restrict__ o, const float* __restrict__ w1, float scale,
                         float* a, const float* __restrict__ w2, int dim, float eps, float* x_out, int slices) {
  const int row = vb / slices;
  const u64 base = (u64)row * dim;
  const int n4 = dim / 4, bd = blockDim.x;
  const int2 mine = norm_slice(n4, slices, vb - row * slices);
  const bool in_regs = n4 <= RES_F4 * bd;
  // Launched, a thread holds its norm weights in registers across the wait. The megakernel copies
  // them to shared memory instead (its dynamic shared memory is free between stages: `[2][RES_F4]
  // [blockDim]` float4s, ADD_NORM_MK_SMEM on the host): held in registers across its wait (a
  // call), they changed the register allocation of its whole decode entry. Each thread reads back
  // only what it copied, so its own `cp.async.wait_all` is all the synchronisation needed.
#ifdef MEGAKERNEL
  extern __shared__ __align__(16) float4 norm_w[];
  const auto w1q = [&](int q) { return norm_w[q * bd + threadIdx.x]; };
  const auto w2q = [&](int q) { return norm_w[(RES_F4 + q) * bd + threadIdx.x]; };
  if (in_regs) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      if (f < n4)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(&norm_w[q * bd + threadIdx.x])),
                     "l"(w1 + 4 * f) : "memory");
      if (w2 && f < mine.y && f >= mine.x)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(&norm_w[(RES_F4 + q) * bd + threadIdx.x])),
                     "l"(w2 + 4 * f) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
#else
  float4 w1v[RES_F4], w2v[RES_F4];  // this thread's norm weights (w2: of its slice only)
  const auto w1q = [&](int q) { return w1v[q]; };
  const auto w2q = [&](int q) { return w2v[q]; };
  if (in_regs) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      w1v[q] = f < n4 ? ld4(w1, f) : make_float4(0.f, 0.f, 0.f, 0.f);
      w2v[q] = w2 && f < mine.y && f >= mine.x ? ld4(w2, f) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
#endif
  if (!in_regs)
    for (int i = threadIdx.x; i < dim; i += blockDim.x) prefetch_l2(w1 + i);
  pdl_start();
#ifdef MEGAKERNEL
  if (in_regs) asm volatile("cp.async.wait_all;" ::: "memory");
#endif
  float* xr = x + base;
  float* xo = x_out + base;
  float4 ov[RES_F4], xv[RES_F4];
  stat_t ss = 0;
  if (in_regs) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      ov[q] = f < n4 ? ld4_sum(o, base, f) : make_float4(0.f, 0.f, 0.f, 0.f);
      xv[q] = f < n4 ? ld4(xr, f) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int q = 0; q < RES_F4; q++)
      if (threadIdx.x + q * bd < n4) ss = sumsq4(ss, ov[q]);
  } else {
    for (int f = threadIdx.x; f < n4; f += bd) ss = sumsq4(ss, ld4_sum(o, base, f));
  }
  ss = block_sum_stat(ss);
  const float r = rms_scale(ss, dim, eps);
  stat_t ss2 = 0;
  if (in_regs) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      if (f >= n4) continue;
      xv[q] = residual4(xv[q], ov[q], r, w1q(q), scale);
      if (f >= mine.x && f < mine.y) st4(xo, f, xv[q]);
      ss2 = sumsq4(ss2, xv[q]);
    }
  } else {
    for (int f = threadIdx.x; f < n4; f += bd) {
      const float4 v = residual4(ld4(xr, f), ld4_sum(o, base, f), r, ld4(w1, f), scale);
      if (f >= mine.x && f < mine.y) st4(xo, f, v);
      ss2 = sumsq4(ss2, v);
    }
  }
  if (!w2) return;
  ss2 = block_sum_stat(ss2);
  const float r2 = rms_scale(ss2, dim, eps);
  if (in_regs) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      if (f >= mine.x && f < mine.y) st4(a + base, f, norm4(xv[q], r2, w2q(q)));
    }
  } else {
    // This thread wrote x' of its slice's float4s itself (x_out), the rest it skips.
    for (int f = threadIdx.x + mine.x - mine.x % bd; f < mine.y; f += bd)
      if (f >= mine.x) st4(a + base, f, norm4(ld4(xo, f), r2, ld4(w2, f)));
  }
}

// Sorts `size` (a power of two) 64-bit keys in shared memory into descending order, in place.
// Called by every thread of the block; ends with a barrier.
__device__ __forceinline__ void bitonic_sort_desc(u64* key, int size) {
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = threadIdx.x; i < size; i += blockDim.x) {
        const int p = i ^ j;
        if (p > i) {
          const u64 a = key[i], b = key[p];
          if (((i & k) == 0) == (a < b)) key[i] = b, key[p] = a;
        }
      }
      __syncthreads();
    }
  }
}

// A descending sort key of value v at index i: v's place in `f32::total_cmp`'s order (−NaN < −∞
// < … < −0 < +0 < … < +∞ < +NaN) in the high word, !i below, so among equal values the lower index
// sorts first. Never 0 for a non-NaN v (key 0 is the padding that sorts last).
__device__ __forceinline__ u64 rank_key(float v, unsigned i) {
  const unsigned u = __float_as_uint(v);
  return ((u64)((u & 0x80000000u) ? ~u : (u | 0x80000000u)) << 32) | ~i;
}

// GELU, tanh approximation, in the CPU reference's operation order.
__device__ __forceinline__ float gelu_tanh(float x) {
  const float k = 0.7978846f;
  float inner = __fmul_rn(k, __fadd_rn(x, __fmul_rn(__fmul_rn(__fmul_rn(0.044715f, x), x), x)));
  return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

// Element `col` of row `row` of a matrix, widened to f32 (64-bit indexing: PLE tables exceed 2^32).
__device__ __forceinline__ float mat_elem(const Mat& m, u64 row, int col) {
  u64 i = row * (u64)m.cols + (u64)col;
  switch (m.fmt) {
    case FMT_F32: return ((const float*)m.w)[i];
    case FMT_BF16: return bf16_to_f32(((const bf16_t*)m.w)[i]);
    case FMT_F16: return f16_to_f32(((const unsigned short*)m.w)[i]);
    default: {
      unsigned word = ((const unsigned*)m.w)[i >> 3];
      unsigned q = (word >> (4 * (col & 7))) & 15u;
      u64 g = row * (u64)(m.cols / m.gs) + (u64)(col / m.gs);
      float2 sb = ((const float2*)m.sb)[g];
      return q4_weight(q, sb.x, sb.y);
    }
  }
}
