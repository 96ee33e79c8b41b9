// Probe for the decode megakernel (issue 10, docs/megakernel-plan.md "Shape of the kernel" item 2 and
// "What 1,000 tok/s needs"): weights streamed into shared memory by a loader warp that runs ahead of
// the dependency chain. Today's megakernel (and every launch of the graph path) loads a stage's
// weights only once the stage may start — at most a first register batch before its wait — so each
// of a token's ~300 dependent stages pays its link, its input build and its own weight stream in a
// row. Weights never depend on activations: a loader warp per SM can stream the next stages' bytes
// into a ring while the consumer warps wait for the current stage's inputs. How close does that put
// a token to the weight stream alone?
//
// One persistent launch per token, 1 block per SM: 8 consumer warps and 1 loader warp. Weights are
// laid out per block (each block's share of every stage contiguous, as an upload could lay them),
// as 640-byte units (one 16-row tile × 64 columns: 512 B of codes in megagemma's `mma.m16n8k32`
// fragment order, 128 B of scales: the `MMA_RING_SLOT` layout of kernels/matvec_mma.cu). The loader's
// lane 0 copies 16 units at a time (`cp.async.bulk`, one mbarrier per ring slot for "full" and one for
// "empty"); consumer warp w multiplies units w, w + 8 of each slot with megagemma's own device
// functions (`float4_inputs` builds the digit planes, `compute_batch` the two integer mmas and the
// scaling), keeps per-tile sums in shared memory and adds them to the stage's output (float atomics:
// timing, not bits). Stages wait for the one before through a monotonic counter per stage
// (`red.release.gpu` / `ld.acquire.gpu`, bounded waits), as the megakernel does.
//
// Stages per layer (the E4B / E2B shapes; MLX 4-bit, group 64): Q/K/V with the residual step and
// input norm folded (two block reductions), attention (a stand-in: ATT_NS ns of spinning, then a
// copy of q to its output), O, gate+up (folded), down (gated input, column parts of 40 chunks), the
// PLE gate (folded, no second norm), the PLE projection (gated by the layer's input); then the LM
// head (folded). Modes, each timed over TOKENS launches:
//   0 ahead    the loader streams every stage's weights as soon as ring slots are free
//   1 behind   the loader waits for a stage's input counter before its first copy (today's order)
//   2 stream   the loader alone: consumers release slots unread, no waits (the ring's stream floor)
//   3 chain    no weight copies: consumers wait, build and multiply whatever the ring holds (the
//              dependency chain's floor with the probe's per-stage work)
//
// With mode 0 and 3 at att 0 it also prints where a stage's time goes, per stage of a layer (thread 0's
// %globaltimer, mean over blocks): the wait since the block's last signal, the input build, the
// multiplication (ring waits included), adding out and signalling.
//
// Measured on the H200, 2026-12-04 (docs/perf-notes.md, "Twenty-ninth session", item 2), ms a token, att 0:
//   config (consumers × units a batch, copy)     E4B stream / chain / behind / ahead    E2B same
//   8 × 1, bulk 10 KB (first run)                 0.915 / 3.048 / 3.540 / 3.324          0.488 / 1.615 / 1.810 / 1.742
//   8 × 2, bulk 10 KB                             0.961 / 2.668 / 3.152 / 2.935          0.508 / 1.506 / 1.688 / 1.619
//   8 × 4, bulk 20 KB                             0.771 / 2.282 / 2.763 / 2.500          0.455 / 1.407 / 1.613 / 1.504
//   16 × 2, bulk 20 KB                            0.798 / 2.246 / 2.710 / 2.478          0.473 / 1.354 / 1.546 / 1.452
//   16 × 4, bulk 40 KB (the defaults)             0.717 / 1.967 / 2.435 / 2.220          0.429 / 1.282 / 1.477 / 1.430
//   16 × 2, warp cp.async                         1.119 / 2.234 / 2.567 / 2.565          0.565 / 1.351 / 1.483 / 1.465
//   16 × 2, bulk, NO_MMA                          0.800 / 2.009 / 2.476 / 2.240          0.474 / 1.290 / 1.482 / 1.383
// (megagemma's graph path, real attention included: E4B 2.18 ms, E2B 1.45.) Per E4B stage, 16 × 4 ahead, µs wait /
// build / multiply / add out: Q/K/V 0.85 / 3.52 / 1.40 / 1.89, O 0.88 / 1.51 / 1.25 / 1.84, gate+up 0.79 / 3.44 /
// 8.61 / 1.39, down 0.77 / 2.40 / 4.98 / 1.38, PLE gate 0.79 / 3.10 / 0.96 / 1.60, PLE projection 0.85 / 1.62 / 1.24
// / 1.40, LM head 0.84 / 3.59 / 101.3 / 1.12: the weights' share of a layer is 18 of ~50 µs. Running ahead saves
// 9% (E4B) and 3% (E2B) over loading behind the wait; the per-stage fixed path (wait, build, add out: 3–6 µs) is
// what a token is made of, with the weights streamed or not. (The probe's folded build loads w1 and w2 after
// its reductions, two round trips megagemma's kernels do not make: its 3.4 µs overstates theirs.)
//
// Build and run on the GPU machine (the defaults are the fastest configuration above; -DCONSUMERS, -DUPW,
// -DLOADER=1, -DNO_MMA=1 choose the others):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/lr tools/probes/loader_ring.cu && /tmp/lr
// nvcc's host pass parses the member initialisers of `SmallDiv`'s device constructor (NVRTC never
// sees a host pass): give it a declaration it can parse; the device code uses the intrinsic.
#ifndef __CUDA_ARCH__
#define __frcp_rn(x) (1.0f / (x))
#endif
#include "../../crates/megagemma-cuda/kernels/matvec_mma.cu"
#undef __frcp_rn

#ifndef __CUDACC_RTC__  // NVRTC checks the device code alone (tools' local compile check)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#endif

#include "mbarrier.cuh"

// Consumer warps, and consecutive units each multiplies per slot (one register batch: UPW chunks'
// loads and mmas in flight together, as the launched kernels' batches of MMA_U1).
#ifndef CONSUMERS
#define CONSUMERS 16
#endif
#ifndef UPW
#define UPW 4
#endif
// 0: lane 0 of the loader warp copies a slot with one `cp.async.bulk`; 1: the loader warp's 32 lanes
// copy it 16 bytes each (`cp.async`, each lane's completion counted on the slot's mbarrier).
#ifndef LOADER
#define LOADER 0
#endif
#define CTHREADS (CONSUMERS * 32)
#define THREADS (CTHREADS + 32)
#define UNIT 640  // one tile × chunk: codes, then scales
#define SLOT_UNITS (CONSUMERS * UPW)
#define SLOT_BYTES (UNIT * SLOT_UNITS)
#define MAX_SLICE 40  // input chunks a block builds (the launched kernels' slice holds 45)
#ifndef MAXT
#define MAXT 20  // tiles whose cross-warp sums a block holds before adding them out
#endif
// NO_MMA: the units' codes and scales are read from the ring but not multiplied (the loop's
// bookkeeping alone).
#ifndef NO_MMA
#define NO_MMA 0
#endif
static_assert(SLOT_UNITS / 4 + 2 <= MAXT, "a slot's units (≥ 4 a tile) must fit the held tiles");

enum { K_MATVEC, K_ATT };
enum { IN_PLAIN, IN_FOLD, IN_FOLD_NOW2, IN_GATED, IN_PLE };

struct Stage {
  int kind, in_kind;
  int rows, tiles, n, parts, bpp;  // n chunks per part, bpp blocks per part
  int cols;                        // input width
  const float* in;                 // the producer's output (o of a fold)
  float* out;                      // this stage's output, accumulated
  float* zero;                     // stage s − 2's output, zeroed here (its readers are done)
  int zero_rows;
  int xi;                          // residual buffer a fold reads (it writes the other)
  int tag;                         // which of a layer's stages (the profile's row)
  int gate_off;                    // IN_GATED: the second factor's offset in `in`
  const unsigned char* w;          // units, part-major, tile-major inside a part
  const float* ple;                // IN_PLE: the layer's per-layer input
};

struct Ctl {
  unsigned* cnt;  // per stage, monotonic across tokens
  unsigned* err;  // 1: a counter wait timed out, 2: a ring wait did
  float* xb0;
  float* xb1;
  const float* w1;
  const float* w2;
  int S, mode, ring;
  unsigned target;  // (token + 1) · grid
  long long att_ns;
  unsigned long long* prof;  // per tag: ns waiting, building, multiplying, adding out; stage count
};

__device__ __forceinline__ void cbar() { asm volatile("bar.sync 1, %0;" ::"n"(CTHREADS) : "memory"); }
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Waits until ready() holds, bounded: after 1 s (or once another wait has given up) it sets *err to
// `code` and returns, so a broken schedule ends the run instead of hanging the GPU.
template <class Ready>
__device__ void wait_bounded(Ready ready, unsigned* err, unsigned code) {
  unsigned long long t0 = 0;
  while (!ready()) {
    if (*(volatile unsigned*)err) return;
    const unsigned long long t = now_ns();
    if (!t0) t0 = t;
    else if (t - t0 > 1000000000ull) {
      atomicExch(err, code);
      return;
    }
  }
}
// One thread waits until *p reaches target.
__device__ void spin_until(const unsigned* p, unsigned target, unsigned* err) {
  wait_bounded([&] { return (int)(ld_acquire(p) - target) >= 0; }, err, 1u);
}
__device__ void mbar_wait(unsigned a, unsigned parity, unsigned* err) {
  wait_bounded([&] { return mbar_done(a, parity); }, err, 2u);
}
__device__ __forceinline__ void mbar_arrive(unsigned a) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(a) : "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// This block's units [u0, u1) of part p of a matvec stage (empty for blocks past parts · bpp).
__device__ __forceinline__ void block_units(const Stage& s, int b, int& p, int& u0, int& u1) {
  p = b / s.bpp;
  const int i = b - p * s.bpp, U = s.tiles * s.n;
  u0 = u1 = 0;
  if (p >= s.parts) return;
  u0 = (int)((long long)U * i / s.bpp);
  u1 = (int)((long long)U * (i + 1) / s.bpp);
}

// Block sum of a double over the consumer threads (two named barriers).
__device__ double csum(double v, double* sh) {
  v = warp_reduce(v, SumOp());
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) sh[warp] = v;
  cbar();
  double t = 0.0;
#pragma unroll
  for (int i = 0; i < CONSUMERS; i++) t += sh[i];
  cbar();
  return t;
}

// The stage's input slice as digit planes (xf) and sums (xs): `build_inputs`' layout for one token.
__device__ void build(const Stage& s, const Ctl& c, int p, uint4* xf, float* xs, double* sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nf4 = s.n * 16, k0 = p * s.n * 64;
  float4 keep[3];
  if (s.in_kind == IN_FOLD || s.in_kind == IN_FOLD_NOW2) {
    // x' = x + norm(o)·w1, the input norm(x')·w2 (or x'): the folded residual step's shape.
    const float* x = s.xi ? c.xb1 : c.xb0;
    float* xo = s.xi ? c.xb0 : c.xb1;
    const int n4 = s.cols / 4;
    float4 ov[3];
    double ss = 0.0;
#pragma unroll
    for (int q = 0; q < 3; q++) {
      const int f = threadIdx.x + q * CTHREADS;
      const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
      ov[q] = f < n4 ? __ldcg((const float4*)s.in + f) : z;
      keep[q] = f < n4 ? __ldcg((const float4*)x + f) : z;
      ss += (double)ov[q].x * ov[q].x + (double)ov[q].y * ov[q].y + (double)ov[q].z * ov[q].z +
            (double)ov[q].w * ov[q].w;
    }
    const float r1 = rms_scale(csum(ss, sh), s.cols, 1e-6f);
    double ss2 = 0.0;
#pragma unroll
    for (int q = 0; q < 3; q++) {
      const int f = threadIdx.x + q * CTHREADS;
      if (f >= n4) continue;
      const float4 w1 = __ldg((const float4*)c.w1 + f);
      keep[q] = make_float4(keep[q].x + ov[q].x * r1 * w1.x, keep[q].y + ov[q].y * r1 * w1.y,
                            keep[q].z + ov[q].z * r1 * w1.z, keep[q].w + ov[q].w * r1 * w1.w);
      if (blockIdx.x == 0) __stcg((float4*)xo + f, keep[q]);
      ss2 += (double)keep[q].x * keep[q].x + (double)keep[q].y * keep[q].y + (double)keep[q].z * keep[q].z +
             (double)keep[q].w * keep[q].w;
    }
    if (s.in_kind == IN_FOLD) {
      const float r2 = rms_scale(csum(ss2, sh), s.cols, 1e-6f);
#pragma unroll
      for (int q = 0; q < 3; q++) {
        const int f = threadIdx.x + q * CTHREADS;
        if (f >= n4) continue;
        const float4 w2 = __ldg((const float4*)c.w2 + f);
        keep[q] = make_float4(keep[q].x * r2 * w2.x, keep[q].y * r2 * w2.y, keep[q].z * r2 * w2.z, keep[q].w * r2 * w2.w);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 3; r++) {
    const int base = warp * 32 + r * CTHREADS;
    if (base >= nf4) break;  // warp-uniform
    const int e = base + lane;
    const bool in = e < nf4;
    float w[4] = {0.f, 0.f, 0.f, 0.f};
    if (in) {
      float4 v;
      const int k = k0 + 4 * e;
      if (s.in_kind == IN_FOLD || s.in_kind == IN_FOLD_NOW2) {
        v = keep[r];  // element e is this thread's float4 r (a fold's slice is the whole row)
      } else if (s.in_kind == IN_PLAIN) {
        v = __ldcg((const float4*)(s.in + k));
      } else {
        const float4 a = __ldcg((const float4*)(s.in + k));
        const float4 g = s.in_kind == IN_GATED ? __ldcg((const float4*)(s.in + s.gate_off + k))
                                               : __ldg((const float4*)(s.ple + k));
        v = make_float4(gelu_tanh(a.x) * g.x, gelu_tanh(a.y) * g.y, gelu_tanh(a.z) * g.z, gelu_tanh(a.w) * g.w);
      }
      w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    }
    float4_inputs<1, 1>((unsigned*)xf, xs, w, 0, e >> 4, e & 15, in);
  }
  cbar();
}

// Tiles [tb, te) (part-local = global tile indices: parts split columns): the 8 warps' sums added
// out, the sums cleared.
__device__ void flush(const Stage& s, float* red, int tb, int te) {
  const int i = threadIdx.x;
  if (i < (te - tb) * 16) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < CONSUMERS; w++) {
      t += red[(w * MAXT) * 16 + i];
      red[(w * MAXT) * 16 + i] = 0.f;
    }
    atomicAdd(s.out + tb * 16 + i, t);
  }
}

// A warp's sums of tile t into its row of `red` (the whole warp calls it: shuffles).
__device__ __forceinline__ void finish_tile(float yp[2][2], float* red, int slot) {
  float y[1][2];
  pairs_to_tokens<1>(yp, y);
  const int lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3, warp = threadIdx.x >> 5;
  if (tig == 0) {
    red[(warp * MAXT + slot) * 16 + gid] = y[0][0];
    red[(warp * MAXT + slot) * 16 + gid + 8] = y[0][1];
  }
  yp[0][0] = yp[0][1] = yp[1][0] = yp[1][1] = 0.f;
}

__global__ void __launch_bounds__(THREADS, 1) token_kernel(const Stage* __restrict__ st, Ctl c) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* ring = smem;
  uint4* xf = (uint4*)(smem + (size_t)c.ring * SLOT_BYTES);
  float* xs = (float*)((unsigned char*)xf + MAX_SLICE * 1024);
  float* red = xs + MAX_SLICE * MMA_XS_FLOATS(1, 1);
  double* sh = (double*)(red + CONSUMERS * MAXT * 16);
  unsigned long long* bars = (unsigned long long*)(sh + 32);  // full[ring], then empty[ring]
  const unsigned ring_s = smem_addr(ring), full_s = smem_addr(bars), empty_s = full_s + 8 * c.ring;
  const int b = blockIdx.x, G = gridDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  if (threadIdx.x == 0) {
    for (int i = 0; i < c.ring; i++) mbar_init(full_s + 8 * i, LOADER ? 32 : 1), mbar_init(empty_s + 8 * i, CONSUMERS);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  for (int i = threadIdx.x; i < CONSUMERS * MAXT * 16; i += blockDim.x) red[i] = 0.f;
  for (int i = threadIdx.x; i < MAX_SLICE * 1024 / 4; i += blockDim.x) ((unsigned*)xf)[i] = 0u;
  for (int i = threadIdx.x; i < MAX_SLICE * MMA_XS_FLOATS(1, 1); i += blockDim.x) xs[i] = 0.f;
  __syncthreads();

  if (warp == CONSUMERS) {  // the loader
    if ((LOADER == 0 && lane != 0) || c.mode == 3) return;
    int k = 0;
    for (int si = 0; si < c.S; si++) {
      const Stage& s = st[si];
      if (s.kind != K_MATVEC) continue;
      int p, u0, u1;
      block_units(s, b, p, u0, u1);
      if (u1 <= u0) continue;
      if (c.mode == 1 && si > 0) spin_until(c.cnt + si - 1, c.target, c.err);
      const unsigned char* src = s.w + ((size_t)p * s.tiles * s.n + u0) * UNIT;
      for (int u = u0; u < u1; u += SLOT_UNITS, k++) {
        const int ri = k % c.ring;
        if (k >= c.ring) mbar_wait(empty_s + 8 * ri, ((k / c.ring) - 1) & 1, c.err);
        const unsigned bytes = min(SLOT_UNITS, u1 - u) * UNIT;
        const unsigned char* from = src + (size_t)(u - u0) * UNIT;
        if (LOADER == 0) {
          mbar_expect(full_s + 8 * ri, bytes);
          bulk_copy(ring_s + ri * SLOT_BYTES, from, bytes, full_s + 8 * ri);
        } else {
          for (unsigned o = lane * 16; o < bytes; o += 512)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(ring_s + ri * SLOT_BYTES + o), "l"(from + o)
                         : "memory");
          asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full_s + 8 * ri) : "memory");
        }
      }
    }
    return;
  }

  // The consumers.
  bool live[2], pairs[2];
  live_pairs<1>(1, live, pairs);
  int k = 0;
  long long tp = (long long)now_ns(), tw = 0, tb_ = 0, tl_ = 0;  // the profile's phase ends (thread 0)
  for (int si = 0; si < c.S; si++) {
    const Stage& s = st[si];
    if (si > 0 && c.mode != 2) {
      if (threadIdx.x == 0) spin_until(c.cnt + si - 1, c.target, c.err);
      cbar();
    }
    if (threadIdx.x == 0) tw = tb_ = tl_ = (long long)now_ns();
    if (s.zero)
      for (int i = b * CTHREADS + threadIdx.x; i < s.zero_rows; i += G * CTHREADS) __stcg(s.zero + i, 0.f);
    if (s.kind == K_ATT) {
      if (c.mode != 2) {
        if (threadIdx.x == 0) {
          const long long t0 = (long long)now_ns();
          while ((long long)now_ns() - t0 < c.att_ns) {
          }
        }
        cbar();
        for (int i = b * CTHREADS + threadIdx.x; i < s.rows; i += G * CTHREADS) __stcg(s.out + i, __ldcg(s.in + i));
      }
    } else {
      int p, u0, u1;
      block_units(s, b, p, u0, u1);
      if (u1 > u0) {
        if (c.mode != 2) build(s, c, p, xf, xs, sh);
        if (threadIdx.x == 0) tb_ = tl_ = (long long)now_ns();
        const int n = s.n;
        int tb = u0 / n, cur = -1;
        float yp[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
        for (int u = u0; u < u1; u += SLOT_UNITS, k++) {
          const int ri = k % c.ring;
          if (c.mode != 3) mbar_wait(full_s + 8 * ri, (k / c.ring) & 1, c.err);
          if (c.mode != 2) {
            // Hold at most MAXT tiles of sums: add out the finished ones first (uniform: by slot).
            const int tf = u / n, tl = (min(u + SLOT_UNITS, u1) - 1) / n;
            if (tl - tb >= MAXT) {
              if (cur >= 0 && cur < tf) finish_tile(yp, red, cur - tb), cur = -1;
              cbar();
              flush(s, red, tb, tf);
              cbar();
              tb = tf;
            }
            // Units j0 … j0 + UPW − 1 of the slot: one batch when they are one tile's, else one by one.
            const unsigned char* slot = ring + ri * SLOT_BYTES;
            const int j0 = warp * UPW, ua = u + j0;
            if (ua < u1) {
              int t = ua / n, cc = ua - t * n;
              if (t != cur) {
                if (cur >= 0) finish_tile(yp, red, cur - tb);
                cur = t;
              }
              if (ua + UPW <= u1 && cc + UPW <= n) {
                Batch<UPW, 1, false> bt;
#pragma unroll
                for (int i = 0; i < UPW; i++) {
                  bt.q[i] = *(const uint4*)(slot + (j0 + i) * UNIT + lane * 16);
                  bt.sb[i][0] = *(const float*)(slot + (j0 + i) * UNIT + 512 + lane * 4);
                }
                if (NO_MMA) {
#pragma unroll
                  for (int i = 0; i < UPW; i++) yp[0][0] += __uint_as_float((bt.q[i].x ^ bt.q[i].w) & 0x3f8fffffu) * bt.sb[i][0];
                } else {
                  compute_batch<1, UPW, 1, false>(bt, cc, 1, 0, cc + UPW, xf, xs, live, pairs, yp);
                }
              } else {
                for (int i = 0; i < UPW && ua + i < u1; i++, cc++) {
                  if (cc == n) {
                    finish_tile(yp, red, cur - tb);
                    cur = ++t, cc = 0;
                  }
                  Batch<1, 1, false> bt;
                  bt.q[0] = *(const uint4*)(slot + (j0 + i) * UNIT + lane * 16);
                  bt.sb[0][0] = *(const float*)(slot + (j0 + i) * UNIT + 512 + lane * 4);
                  compute_batch<1, 1, 1, false>(bt, cc, 1, 0, cc + 1, xf, xs, live, pairs, yp);
                }
              }
            }
          }
          __syncwarp();
          if (c.mode != 3 && lane == 0) mbar_arrive(empty_s + 8 * ri);
        }
        if (threadIdx.x == 0) tl_ = (long long)now_ns();
        if (c.mode != 2) {
          if (cur >= 0) finish_tile(yp, red, cur - tb);
          cbar();
          flush(s, red, tb, (u1 - 1) / n + 1);
        }
      }
    }
    cbar();
    if (threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(c.cnt + si) : "memory");
      if (c.prof) {
        const long long te = (long long)now_ns();
        unsigned long long* pr = c.prof + s.tag * 5;
        atomicAdd(pr, (unsigned long long)(tw - tp));
        atomicAdd(pr + 1, (unsigned long long)(tb_ - tw));
        atomicAdd(pr + 2, (unsigned long long)(tl_ - tb_));
        atomicAdd(pr + 3, (unsigned long long)(te - tl_));
        atomicAdd(pr + 4, 1ull);
        tp = te;
      }
    }
  }
}

__global__ void fill_units(unsigned* w, size_t words) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    const unsigned wi = (unsigned)(i % (UNIT / 4));
    unsigned h = (unsigned)i * 2654435761u ^ (unsigned)(i >> 32) * 40503u;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    w[i] = wi < 128 ? h : ((wi & 1) ? 0u : __float_as_uint(0.002f));  // scale, bias pairs
  }
}
__global__ void fill_const(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}

#ifndef __CUDACC_RTC__
#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

struct Model {
  const char* name;
  int hidden, qkv, q, ffn, layers, ple, vocab;
};

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? atoi(argv[1]) : 20;
  int dev = 0, G = 0;
  CK(cudaDeviceGetAttribute(&G, cudaDevAttrMultiProcessorCount, dev));
  const Model models[] = {{"e4b", 2560, 3072, 2048, 10240, 42, 256, 262144}, {"e2b", 1536, 2560, 2048, 6144, 35, 256, 262144}};
  const int max_smem = 227 * 1024;
  printf("CONSUMERS=%d UPW=%d LOADER=%d (%s) MAXT=%d NO_MMA=%d\n", CONSUMERS, UPW, LOADER,
         LOADER ? "warp cp.async" : "cp.async.bulk", MAXT, NO_MMA);
  const size_t fixed = MAX_SLICE * 1024 + MAX_SLICE * MMA_XS_FLOATS(1, 1) * 4 + CONSUMERS * MAXT * 16 * 4 + 32 * 8;
  for (const Model& m : models) {
    std::vector<Stage> st;
    std::vector<void*> allocs;
    size_t wbytes = 0;
    auto dalloc = [&](size_t bytes) {
      void* p;
      CK(cudaMalloc(&p, bytes));
      CK(cudaMemset(p, 0, bytes));
      allocs.push_back(p);
      return p;
    };
    float* xb0 = (float*)dalloc(m.hidden * 4);
    float* xb1 = (float*)dalloc(m.hidden * 4);
    float* emb = (float*)dalloc(m.hidden * 4);
    float* w1 = (float*)dalloc(m.hidden * 4);
    float* w2 = (float*)dalloc(m.hidden * 4);
    float* ple = (float*)dalloc((size_t)m.layers * m.ple * 4);
    fill_const<<<64, 256>>>(xb0, m.hidden, 0.5f);
    fill_const<<<64, 256>>>(xb1, m.hidden, 0.5f);
    fill_const<<<64, 256>>>(emb, m.hidden, 0.25f);
    fill_const<<<64, 256>>>(w1, m.hidden, 1.f);
    fill_const<<<64, 256>>>(w2, m.hidden, 1.f);
    fill_const<<<64, 256>>>(ple, (size_t)m.layers * m.ple, 0.5f);
    int fold = 0;
    auto matvec = [&](int rows, int cols, int in_kind, const float* in, int gate_off, const float* ple_in) {
      Stage s{};
      s.kind = K_MATVEC, s.in_kind = in_kind, s.rows = rows, s.tiles = rows / 16, s.cols = cols;
      const int chunks = cols / 64;
      s.parts = (chunks + MAX_SLICE - 1) / MAX_SLICE;
      s.n = chunks / s.parts;
      s.bpp = G / s.parts;
      s.in = in, s.gate_off = gate_off, s.ple = ple_in;
      s.out = (float*)dalloc((size_t)rows * 4);
      const size_t bytes = (size_t)s.parts * s.tiles * s.n * UNIT;
      unsigned char* w = (unsigned char*)dalloc(bytes);
      fill_units<<<1024, 256>>>((unsigned*)w, bytes / 4);
      s.w = w, wbytes += bytes;
      s.tag = (int)st.size() % 7;  // Q/K/V, attention, O, gate+up, down, PLE gate, PLE projection; the head: 7
      if (in_kind == IN_FOLD || in_kind == IN_FOLD_NOW2) s.xi = fold++ & 1;
      st.push_back(s);
      return s.out;
    };
    const float* prev = nullptr;
    for (int l = 0; l < m.layers; l++) {
      const float* qkv = l == 0 ? matvec(m.qkv, m.hidden, IN_PLAIN, emb, 0, nullptr)
                                : matvec(m.qkv, m.hidden, IN_FOLD, prev, 0, nullptr);
      Stage a{};
      a.kind = K_ATT, a.tag = 1, a.rows = m.q, a.in = qkv, a.out = (float*)dalloc(m.q * 4);
      st.push_back(a);
      const float* o = matvec(m.hidden, m.q, IN_PLAIN, a.out, 0, nullptr);
      const float* gu = matvec(2 * m.ffn, m.hidden, IN_FOLD, o, 0, nullptr);
      const float* dn = matvec(m.hidden, m.ffn, IN_GATED, gu, m.ffn, nullptr);
      const float* pg = matvec(m.ple, m.hidden, IN_FOLD_NOW2, dn, 0, nullptr);
      prev = matvec(m.hidden, m.ple, IN_PLE, pg, 0, ple + (size_t)l * m.ple);
    }
    matvec(m.vocab, m.hidden, IN_FOLD, prev, 0, nullptr);
    st.back().tag = 7;
    const int S = (int)st.size();
    for (int i = 0; i < S; i++) {
      const Stage& z = st[(i + S - 2) % S];
      if (z.kind == K_MATVEC) st[i].zero = z.out, st[i].zero_rows = z.rows;
    }
    Stage* dst = (Stage*)dalloc(S * sizeof(Stage));
    CK(cudaMemcpy(dst, st.data(), S * sizeof(Stage), cudaMemcpyHostToDevice));
    unsigned* cnt = (unsigned*)dalloc(S * 4 + 64);
    unsigned* err = cnt + S;
    unsigned long long* prof = (unsigned long long*)dalloc(8 * 5 * 8);
    CK(cudaDeviceSynchronize());
    const int ring = (int)((max_smem - fixed - 8 * 64) / (SLOT_BYTES + 16));
    const size_t smem = ring * (size_t)SLOT_BYTES + fixed + 16 * ring;
    CK(cudaFuncSetAttribute(token_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    printf("%s: %d stages, %.3f GB of weights a token, grid %d × %d threads, ring %d slots × %d KB\n", m.name, S,
           wbytes / 1e9, G, THREADS, ring, SLOT_BYTES / 1024);
    const char* names[] = {"ahead", "behind", "stream", "chain"};
    const long long atts[] = {0, 5000};
    for (int mode : {2, 3, 1, 0}) {
      for (long long att : atts) {
        if (mode == 2 && att) continue;
        CK(cudaMemset(cnt, 0, S * 4 + 64));
        const bool profile = att == 0 && (mode == 0 || mode == 3);
        CK(cudaMemset(prof, 0, 8 * 5 * 8));
        Ctl c{cnt, err, xb0, xb1, w1, w2, S, mode, ring, 0, att, nullptr};
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        const int warm = 3;
        for (int t = 0; t < warm + tokens; t++) {
          if (t == warm) CK(cudaEventRecord(e0));
          c.target = (unsigned)(t + 1) * G;
          c.prof = profile && t >= warm ? prof : nullptr;
          token_kernel<<<G, THREADS, smem>>>(dst, c);
        }
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        CK(cudaGetLastError());
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        unsigned herr = 0;
        CK(cudaMemcpy(&herr, err, 4, cudaMemcpyDeviceToHost));
        const double per = ms / tokens;
        printf("  %-6s att %5lld ns: %.3f ms a token (%.0f tok/s, %.2f TB/s)%s\n", names[mode], att, per, 1e3 / per,
               wbytes / (per * 1e-3) / 1e12, herr ? (herr == 1 ? "  COUNTER WAIT TIMED OUT" : "  RING WAIT TIMED OUT") : "");
        if (herr) CK(cudaMemset(err, 0, 4));
        if (profile) {
          unsigned long long h[40];
          CK(cudaMemcpy(h, prof, sizeof h, cudaMemcpyDeviceToHost));
          const char* tags[] = {"Q/K/V", "attention", "O", "gate+up", "down", "PLE gate", "PLE proj", "LM head"};
          printf("    µs a stage, mean over blocks: wait (since the last signal) / build / multiply / add out; a token's total\n");
          for (int g = 0; g < 8; g++) {
            if (!h[g * 5 + 4]) continue;
            const double k = 1e3 * h[g * 5 + 4], per_token = (double)h[g * 5 + 4] / tokens / G;
            printf("    %-10s %6.2f %6.2f %6.2f %6.2f   %7.1f µs\n", tags[g], h[g * 5] / k, h[g * 5 + 1] / k,
                   h[g * 5 + 2] / k, h[g * 5 + 3] / k,
                   per_token * (h[g * 5] + h[g * 5 + 1] + h[g * 5 + 2] + h[g * 5 + 3]) / k);
          }
        }
      }
    }
    for (void* p : allocs) CK(cudaFree(p));
  }
  return 0;
}
#endif
