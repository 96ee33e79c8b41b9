// 4-bit affine matvec on the tensor cores: y[t] = W·x[t] for up to 8 columns t, weights in the
// tiled layout built at upload (`tile_q4` in src/tiled.rs). Checked against the CPU reference
// (every fixture's logits, `gpu_check fixtures --quant q4`) and against itself (verify columns
// bit-identical to single-token passes); the layout follows `probes/q4_mma_gemv.cu`.
//
// Layout (FMT_Q4T; rows padded to 16, columns to 64 with zero codes, scales and inputs):
//   codes `W.w`:  [tiles][chunks][32 lanes] uint4. A tile is 16 rows, a chunk 64 columns = four
//                 16-wide k-tiles; word kt of lane (gid = lane/4, tig = lane%4) is that lane's A
//                 fragment of `mma.m16n8k16` for k-tile kt: nibble i at bits 4i is element a_i
//                 (rows gid, gid+8, gid, gid+8; columns 2tig, 2tig, 2tig+8, 2tig+8) and nibble i
//                 at bits 16+4i the element one column right of it.
//   scales `W.sb`: [tiles][padded groups][8 gid] float4 = (scale, bias) of row gid, then of gid+8.
//
// Math: w = s·q + b, so Σ w·x = s·Σ (q−8)·x + (b + 8s)·Σ x over each group. (q−8) is exact in
// fp16; x is split into an fp16 high part and an fp16 low part (x − hi), which go to two
// neighbouring columns of the B operand (token j: columns 2j and 2j+1, four tokens per mma), so
// the tensor core's f32 sums carry x to ~2^-22 of its value. Σ x per 64 (or 32) columns is summed
// in f32 in a fixed order. Scales are applied per unit of min(group, 64) columns.
//
// Exactness across batch sizes: a token's result only ever depends on its own two B columns
// (mma columns are independent: `probes/mma_invariance.cu`), on its own Σ x and on a work split
// that depends on the matrix shape alone, so column t of an 8-token pass is bit-identical to a
// 1-token pass.
#include "common.cuh"

#define MMA_WARPS 8
// Blocks per SM the register budget is set for (src/seq.rs `MMA_BLOCKS_PER_SM`): 2 leaves 128
// registers a thread, room for two batches of chunks in flight per warp.
#define MMA_BLOCKS_PER_SM 2
// Dynamic shared memory for the inputs: 1024·H bytes of fragments and 32·UPC of sums per 64-column
// chunk (a slice is as many chunks as fit: 46 chunks for H = 1, which a part never exceeds).
#define MMA_SLICE_BYTES (48 * 1024)

__device__ __forceinline__ void mma_f16(float c[4], const unsigned a[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (lo, hi) → half2 bits (lo in the low half), round to nearest.
__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float f16_lo(unsigned h2) { return f16_to_f32((unsigned short)(h2 & 0xffffu)); }
__device__ __forceinline__ float f16_hi(unsigned h2) { return f16_to_f32((unsigned short)(h2 >> 16)); }

// The A fragment of one k-tile from its code word, as four half2(q − 8): nibble pairs at bits
// (0, 16) and (8, 24) are OR-ed into the mantissa of 1024 and 1032 subtracted; pairs at bits
// (4, 20) and (12, 28) become 1024 + 16q, scaled by 1/16 and 72 subtracted in one fma. Every step
// is exact in fp16. The fragment order is a0..a3 = pairs at bits 0, 4, 8, 12 (see the layout).
__device__ __forceinline__ void q4_fragment(unsigned w, unsigned a[4]) {
  const unsigned w8 = w >> 8;
  unsigned lo0, hi0, lo1, hi1;
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(lo0) : "r"(w));   // (w & mask) | magic
  asm("lop3.b32 %0, %1, 0x00F000F0, 0x64006400, 0xEA;" : "=r"(hi0) : "r"(w));
  asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(lo1) : "r"(w8));
  asm("lop3.b32 %0, %1, 0x00F000F0, 0x64006400, 0xEA;" : "=r"(hi1) : "r"(w8));
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(a[0]) : "r"(lo0), "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(a[1]) : "r"(hi0), "r"(0x2C002C00u), "r"(0xD480D480u));
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(a[2]) : "r"(lo1), "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(a[3]) : "r"(hi1), "r"(0x2C002C00u), "r"(0xD480D480u));
}

// The `add_norm` (ops.cu) of the sub-block before this matvec, folded into its input (`o`
// non-null): x' = (x + norm(o)·w1)·scale is the new residual and the input is norm(x')·w2 (or x'
// itself when w2 is null). Every block recomputes it for its tokens — the two row statistics, then
// the inputs element by element — with the operations and sums of `add_norm_body` in the same
// order, so the bits are those of the separate kernel; block 0 writes x' to `x_out`, never to `x`,
// which the other blocks are still reading. Rows are `cols` wide.
struct Residual {
  const float* x;
  const float* o;
  const float* w1;
  const float* w2;
  float* x_out;
  float scale;
  float eps;
};

// The folded step keeps x' in registers for the input build (`build_inputs`) in the separate
// kernel; the megakernel re-reads it (its stages share one register allocation: 12 more live
// registers there cost more than the L2 round trip they save).
#ifdef MEGAKERNEL
#define RES_KEEP 0
#else
#define RES_KEEP 1
#endif

// 1/rms(o) and 1/rms(x') (+ eps) of token j's row into r[0][j], r[1][j]; block 0 also writes x'.
// Called by every thread of the block. The elements and sums of `add_norm_body` (ops.cu), in the
// same order, so the bits are those of the separate step: float4s f = tid + q·blockDim, in
// registers for rows of up to 4·RES_F4·blockDim elements (one load round trip). x' of those float4s
// is left in `keep` (`kept`: all of the row is there).
__device__ __forceinline__ void residual_stats(const Residual& res, int j, int dim, bool write, float r[2][8],
                                               float4 (&keep)[RES_F4], bool& kept) {
  const u64 base = (u64)j * dim;
  const int n4 = dim / 4, bd = blockDim.x;
  const float* xr = res.x + base;
  const float* orow = res.o + base;
  const bool in_regs = n4 <= RES_F4 * bd;
  float4 ov[RES_F4], wv[RES_F4];
  double ss = 0.0;
  if (in_regs) {
    // The separate kernel loads w1 with o and x, so the second statistic waits for no load after
    // the first reduction (graph E4B −2.2%); the megakernel loads it after (12 more registers cost
    // it 4%). Same values, same bits.
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
      ov[q] = f < n4 ? ld4(orow, f) : z;
      keep[q] = f < n4 ? ld4(xr, f) : z;
      if (RES_KEEP) wv[q] = f < n4 ? ld4(res.w1, f) : z;
    }
#pragma unroll
    for (int q = 0; q < RES_F4; q++)
      if (threadIdx.x + q * bd < n4) ss = sumsq4(ss, ov[q]);
  } else {
    for (int f = threadIdx.x; f < n4; f += bd) ss = sumsq4(ss, ld4(orow, f));
  }
  ss = block_sum_d(ss);
  const float r1 = (float)(1.0 / sqrt(ss / (double)dim + (double)res.eps));
  double ss2 = 0.0;
  if (in_regs) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      if (f >= n4) continue;
      keep[q] = residual4(keep[q], ov[q], r1, RES_KEEP ? wv[q] : ld4(res.w1, f), res.scale);
      if (write) st4(res.x_out + base, f, keep[q]);
      ss2 = sumsq4(ss2, keep[q]);
    }
  } else {
    for (int f = threadIdx.x; f < n4; f += bd) {
      const float4 v = residual4(ld4(xr, f), ld4(orow, f), r1, ld4(res.w1, f), res.scale);
      if (write) st4(res.x_out + base, f, v);
      ss2 = sumsq4(ss2, v);
    }
  }
  kept = RES_KEEP && in_regs;
  ss2 = block_sum_d(ss2);
  if (threadIdx.x == 0) {
    r[0][j] = r1;
    r[1][j] = (float)(1.0 / sqrt(ss2 / (double)dim + (double)res.eps));
  }
}

// The input float4 at element k of token j with the residual step folded in (see `Residual`), from
// x' when the caller has it (`have`), else from x, o and w1 again.
__device__ __forceinline__ float4 residual_inputs(const Residual& res, int j, int k, int dim, const float r[2][8],
                                                  bool have, float4 xk) {
  const float4 v = have ? xk : residual4(ld4(res.x + (u64)j * dim, k / 4), ld4(res.o + (u64)j * dim, k / 4), r[0][j],
                                         ld4(res.w1, k / 4), res.scale);
  return res.w2 ? norm4(v, r[1][j], ld4(res.w2, k / 4)) : v;
}

// Shared memory of one block, for the chunks [c0, c0 + n) of a slice:
//   xf[(kt·H + h)·32 + lane] = uint2 (b0, b1): B fragment of local k-tile kt for lane (gid, tig)
//     of token group h (tokens 4h .. 4h+3), stored only for the lanes that carry a token below m
//     (gid < 2·(m − 4h): column 2j holds token j's fp16 high parts, column 2j+1 its low parts);
//     the other lanes multiply zeros.
//   xs[u·8 + j] = Σ x over local unit u (64 / UPC columns) for token j, in a fixed order.
// With GATED the input is gelu(x)·gate (the GeGLU and PLE gates fused in; `gstride` % 4 == 0);
// with `res.o` set, the residual step and norm before the matvec (`Residual`; stats in rstat).
// Every value depends only on its own token's inputs, never on m.
template <int H, int UPC, bool GATED>
__device__ __forceinline__ void build_inputs(uint2* xf, float* xs, const float* __restrict__ x,
                                             const float* __restrict__ gate, int gstride, int cols, int m, int c0,
                                             int n, const Residual& res, const float rstat[2][8],
                                             const float4 (&keep)[RES_F4], bool kept) {
  constexpr int R = GATED ? 2 : 4;  // float4s of input (and of gate) each thread has in flight at once
  unsigned* words = (unsigned*)xf;
  const int per_token = n * 16;  // float4s of one token in the slice (a multiple of 16)
  const int total = m * per_token;
  // Whole warps iterate (the unit sums shuffle across lanes); lanes past the end add zeros.
  for (int base = threadIdx.x & ~31; base < total; base += R * blockDim.x) {
    // One token, the row's first slice, the first round: element e = tid + r·blockDim is float4 r of
    // this thread's row in `residual_stats`, whose x' the thread still holds.
    const bool from_keep = kept && m == 1 && c0 == 0 && base == (int)(threadIdx.x & ~31);
    float v[R][4];
#pragma unroll
    for (int r = 0; r < R; r++) {
      const int e = base + r * blockDim.x + (threadIdx.x & 31);
      const int j = e / per_token, k = c0 * 64 + 4 * (e % per_token);
      v[r][0] = v[r][1] = v[r][2] = v[r][3] = 0.f;
      if (e < total && k < cols) {  // cols % 32 == 0: the four elements are all inside
        const float4 t = !GATED && res.o ? residual_inputs(res, j, k, cols, rstat, r < RES_F4 && from_keep,
                                                           keep[r < RES_F4 ? r : 0])
                                         : *(const float4*)(x + (u64)j * cols + k);
        v[r][0] = t.x, v[r][1] = t.y, v[r][2] = t.z, v[r][3] = t.w;
        if (GATED) {
          const float4 g = *(const float4*)(gate + (u64)j * gstride + k);
          v[r][0] = __fmul_rn(gelu_tanh(v[r][0]), g.x);
          v[r][1] = __fmul_rn(gelu_tanh(v[r][1]), g.y);
          v[r][2] = __fmul_rn(gelu_tanh(v[r][2]), g.z);
          v[r][3] = __fmul_rn(gelu_tanh(v[r][3]), g.w);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      const int e = base + r * blockDim.x + (threadIdx.x & 31);
      const bool in = e < total;
      const int j = in ? e / per_token : 0, k4 = e % per_token;
      // Elements kk .. kk+3 of local k-tile lk: pairs (kk, kk+1) and (kk+2, kk+3) belong to lanes
      // tig0 and tig0 + 1 of the token's two columns, in register b0 (kk < 8) or b1.
      const int lk = k4 >> 2, kk = (k4 & 3) * 4, reg = kk >> 3, tig0 = (kk & 7) >> 1;
      const int h = j >> 2, col = 2 * (j & 3);
      const float* w = v[r];
      const unsigned hi0 = pack_f16x2(w[0], w[1]), hi1 = pack_f16x2(w[2], w[3]);
      const unsigned lo0 = pack_f16x2(__fsub_rn(w[0], f16_lo(hi0)), __fsub_rn(w[1], f16_hi(hi0)));
      const unsigned lo1 = pack_f16x2(__fsub_rn(w[2], f16_lo(hi1)), __fsub_rn(w[3], f16_hi(hi1)));
      if (in) {
        unsigned* frag = words + (lk * H + h) * 64 + reg;
        frag[(col * 4 + tig0) * 2] = hi0;
        frag[((col + 1) * 4 + tig0) * 2] = lo0;
        frag[(col * 4 + tig0 + 1) * 2] = hi1;
        frag[((col + 1) * 4 + tig0 + 1) * 2] = lo1;
      }
      // Σ x of the unit: 16 / UPC neighbouring lanes hold its float4s (units never straddle a warp).
      float sum = __fadd_rn(__fadd_rn(w[0], w[1]), __fadd_rn(w[2], w[3]));
#pragma unroll
      for (int o = 1; o < 16 / UPC; o <<= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
      if (in && k4 % (16 / UPC) == 0) xs[(k4 / (16 / UPC)) * 8 + j] = sum;
    }
  }
}

// log2 of the group size (32, 64 or 128): group indices by shifts, not divisions.
__device__ __forceinline__ int gs_shift(const Mat& W) { return 31 - __clz(W.gs); }

// Chunks [lo, hi) of part p of `parts` (the same split on host and device).
__device__ __forceinline__ int2 part_range(int chunks, int parts, int p) {
  const int per = (chunks + parts - 1) / parts;
  return make_int2(min(chunks, p * per), min(chunks, (p + 1) * per));
}

// What this warp does in virtual block vb of a matrix of `chunks` columns split `ks` warps per tile
// and `parts` column parts: its tile, its place among the tile's warps, its column range.
struct VbWarp {
  int tile, ws;
  int2 range;
};
__device__ __forceinline__ VbWarp vb_warp(int vb, int ks, int parts, int chunks) {
  const int warp = threadIdx.x >> 5, tl = warp / ks, g = vb / parts;
  return VbWarp{g * (MMA_WARPS / ks) + tl, warp % ks, part_range(chunks, parts, vb - g * parts)};
}

// Asks L2 for the codes and scales of one virtual block (tile group g, part p; the block's
// threads split the lines of each tile).
__device__ __forceinline__ void prefetch_block(const Mat& W, int tpb, int parts, int vb) {
  const int gsh = gs_shift(W), chunks = (W.cols + 63) / 64, tiles = (W.rows + 15) / 16, groups = (chunks * 64) >> gsh;
  const int g = vb / parts, t0 = g * tpb, nt = min(tpb, tiles - t0);
  const int2 r = part_range(chunks, parts, vb - g * parts);
  const int code_lines = (r.y - r.x) * 4;                                           // per tile
  const int g0 = (r.x * 64) >> gsh, sb_lines = ((r.y - r.x) * 64 + W.gs - 1) >> gsh;  // 128 B each
  for (int t = t0; t < t0 + nt; t++) {
    const char* cp = (const char*)W.w + ((u64)t * chunks + r.x) * 512;
    const char* sp = (const char*)W.sb + ((u64)t * groups + g0) * 128;
    for (int i = threadIdx.x; i < code_lines; i += blockDim.x) prefetch_l2(cp + i * 128);
    for (int i = threadIdx.x; i < sb_lines; i += blockDim.x) prefetch_l2(sp + i * 128);
  }
}

// A batch of one warp's chunks: chunk cc = c + u·ks for u < U (those below `end`), their codes and
// the (scale or bias) value this lane holds for each of their UPC scale units.
template <int U, int UPC>
struct Batch {
  uint4 q[U];
  float sb[U][UPC];
};

template <int U, int UPC>
__device__ __forceinline__ void load_batch(Batch<U, UPC>& bt, const uint4* __restrict__ codes,
                                           const float* __restrict__ sbt, int c, int ks, int end, int gsh) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int cc = c + u * ks;
    if (cc < end) {
      bt.q[u] = __ldcs(codes + (u64)cc * 32);
#pragma unroll
      for (int p = 0; p < UPC; p++) bt.sb[u][p] = sbt[(u64)((cc * 64 + p * (64 / UPC)) >> gsh) * 32];
    }
  }
}

// Multiplies a loaded batch into y[h][r] (token 4h + tig; rows gid and gid + 8), chunk by chunk in
// increasing order.
template <int H, int U, int UPC>
__device__ __forceinline__ void compute_batch(const Batch<U, UPC>& bt, int c, int ks, int c0, int end,
                                              const uint2* xf, const float* xs, const bool live[H], float y[H][2]) {
  const int lane = threadIdx.x & 31, tig = lane & 3;
  constexpr int unit = 64 / UPC;
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int cc = c + u * ks;
    if (cc >= end) break;
    const unsigned words[4] = {bt.q[u].x, bt.q[u].y, bt.q[u].z, bt.q[u].w};
    const uint2* xb = xf + (cc - c0) * 4 * H * 32 + lane;
    float acc[H][4];
#pragma unroll
    for (int h = 0; h < H; h++) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.f;
#pragma unroll
    for (int kt = 0; kt < 4; kt++) {
      unsigned a[4];
      q4_fragment(words[kt], a);
#pragma unroll
      for (int h = 0; h < H; h++) {
        // Columns past the launch's tokens multiply zeros (their fragments are never written).
        const uint2 b = live[h] ? xb[(kt * H + h) * 32] : make_uint2(0u, 0u);
        mma_f16(acc[h], a, b.x, b.y);
      }
      if (((kt + 1) * 16) % unit == 0) {
        const int p = (kt * 16) / unit;
        const int quad = lane & ~3;
        const float v = bt.sb[u][p];
        const float s0 = __shfl_sync(0xffffffffu, v, quad), b0 = __shfl_sync(0xffffffffu, v, quad + 1);
        const float s1 = __shfl_sync(0xffffffffu, v, quad + 2), b1 = __shfl_sync(0xffffffffu, v, quad + 3);
        const float* xsu = xs + ((cc - c0) * UPC + p) * 8 + tig;
#pragma unroll
        for (int h = 0; h < H; h++) {
          // Lanes whose token is past m accumulate values nobody writes out.
          const float sx = xsu[4 * h];
          y[h][0] = fmaf(s0, __fadd_rn(acc[h][0], acc[h][1]), fmaf(fmaf(8.f, s0, b0), sx, y[h][0]));
          y[h][1] = fmaf(s1, __fadd_rn(acc[h][2], acc[h][3]), fmaf(fmaf(8.f, s1, b1), sx, y[h][1]));
          acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.f;
        }
      }
    }
  }
}

// One warp's share of a tile: chunks ≡ ws (mod ks) in [c0, c0 + n), accumulated into y[h][r].
// Batches of U chunks are double-buffered: the next batch's loads are in flight while the current
// one is multiplied, so a warp keeps up to 2U chunks of weights on their way.
template <int H, int UPC>
__device__ __forceinline__ void tile_slice(const Mat& W, int tile, int ws, int ks, int c0, int n, const uint2* xf,
                                           const float* xs, float y[H][2], int m) {
  const int lane = threadIdx.x & 31, gid = lane >> 2;
  const int gsh = gs_shift(W), chunks = (W.cols + 63) / 64, groups = (chunks * 64) >> gsh;
  const uint4* __restrict__ codes = (const uint4*)W.w + (u64)tile * chunks * 32 + lane;
  // Lane (gid, tig) loads one of the four values (s, b of row gid, s, b of row gid + 8) its quad
  // needs; the quad shares them by shuffles.
  const float* __restrict__ sbt = (const float*)W.sb + (u64)tile * groups * 32 + lane;
  constexpr int U = (H == 1 ? 4 : 2) / UPC;  // chunks per batch (registers allow two batches)
  // The warp's chunks are those ≡ ws (mod ks) whatever the slicing, taken in increasing order, so
  // the sums do not depend on how many tokens (and so how large a slice) a launch has.
  const int first = c0 + ((ws - c0) & (ks - 1));  // ks is a power of two
  const int end = c0 + n, step = U * ks;
  bool live[H];
#pragma unroll
  for (int h = 0; h < H; h++) live[h] = gid < 2 * (m - 4 * h);
  Batch<U, UPC> ba, bb;
  load_batch<U, UPC>(ba, codes, sbt, first, ks, end, gsh);
  for (int c = first; c < end; c += 2 * step) {
    load_batch<U, UPC>(bb, codes, sbt, c + step, ks, end, gsh);
    compute_batch<H, U, UPC>(ba, c, ks, c0, end, xf, xs, live, y);
    if (c + step >= end) break;
    load_batch<U, UPC>(ba, codes, sbt, c + 2 * step, ks, end, gsh);
    compute_batch<H, U, UPC>(bb, c + step, ks, c0, end, xf, xs, live, y);
  }
}

// The megakernel's form of `tile_slice` for up to four tokens (H = 1): the same chunks in the same order
// and the same arithmetic (so the same bits), but the weights arrive by cp.async in a ring of
// MMA_RING chunks per warp in shared memory rather than in register batches. Bytes in flight take
// no registers, so the matvec fits beside every other stage in the megakernel's 128 registers
// without spills. A lane copies, and later reads, only its own 16 bytes of codes and 4 bytes per
// scale unit, so its own `cp.async.wait_group` is all the synchronisation a slot needs.
#define MMA_RING 8
#define MMA_RING_SLOT(UPC) (512 + 128 * (UPC))

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}

// Copies chunk cc's codes (this lane's 16 bytes) and scales to the slot at shared address `dst`
// (this warp's slot; the lane's offsets are added here). `codes` is the chunk's codes for this lane.
template <int UPC>
__device__ __forceinline__ void ring_issue(unsigned dst, const uint4* codes, const float* sbt, int cc, int gsh) {
  const int lane = threadIdx.x & 31;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + lane * 16), "l"(codes) : "memory");
#pragma unroll
  for (int p = 0; p < UPC; p++)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst + 512 + p * 128 + lane * 4),
                 "l"(sbt + (u64)((cc * 64 + p * (64 / UPC)) >> gsh) * 32 + lane)
                 : "memory");
}

// The warp's first chunk in [c0, c0 + n) and how many it takes (chunks ≡ ws mod ks).
__device__ __forceinline__ int2 ring_chunks(int ws, int ks, int c0, int n) {
  const int first = c0 + ((ws - c0) & (ks - 1));
  return make_int2(first, first < c0 + n ? (c0 + n - first + ks - 1) / ks : 0);
}

// The ring's first MMA_RING copies (one commit group each, empty past the warp's chunks): weights
// only, so `mma_kernel` issues them for a block's first virtual block before it waits.
template <int UPC>
__device__ __forceinline__ void ring_start(const Mat& W, int tile, int ws, int ks, int c0, int n, unsigned char* ring) {
  const int lane = threadIdx.x & 31;
  const int gsh = gs_shift(W), chunks = (W.cols + 63) / 64, groups = (chunks * 64) >> gsh;
  const int2 fc = ring_chunks(ws, ks, c0, n);
  const uint4* codes = (const uint4*)W.w + ((u64)tile * chunks + fc.x) * 32 + lane;
  const float* sbt = (const float*)W.sb + (u64)tile * groups * 32;
  const unsigned ring_s = smem_addr(ring);
#pragma unroll
  for (int i = 0; i < MMA_RING; i++) {
    if (i < fc.y)
      ring_issue<UPC>(ring_s + i * MMA_RING_SLOT(UPC), codes + i * (u64)ks * 32, sbt, fc.x + i * ks, gsh);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
}

// `started`: ring_start has run for this slice already.
template <int UPC>
__device__ __forceinline__ void ring_slice(const Mat& W, int tile, int ws, int ks, int c0, int n, const uint2* xf,
                                           const float* xs, float y[1][2], unsigned char* ring, int m, bool started) {
  const int lane = threadIdx.x & 31;
  const int gsh = gs_shift(W), chunks = (W.cols + 63) / 64, groups = (chunks * 64) >> gsh;
  const int2 fc = ring_chunks(ws, ks, c0, n);
  const int first = fc.x, count = fc.y;
  // This lane's codes of the warp's first chunk, the step to its next, the tile's scales; the
  // ring's shared-memory address, computed once (a generic-to-shared conversion is not free).
  const uint4* codes = (const uint4*)W.w + ((u64)tile * chunks + first) * 32 + lane;
  const u64 step = (u64)ks * 32;
  const float* sbt = (const float*)W.sb + (u64)tile * groups * 32;
  const unsigned ring_s = smem_addr(ring);
  const bool live[1] = {(lane >> 2) < 2 * m};  // as in tile_slice: columns past the pass's m ≤ 4 tokens read zeros
  if (!started) ring_start<UPC>(W, tile, ws, ks, c0, n, ring);
  for (int i = 0; i < count; i++) {
    asm volatile("cp.async.wait_group %0;" ::"n"(MMA_RING - 1) : "memory");
    const int off = (i % MMA_RING) * MMA_RING_SLOT(UPC);
    Batch<1, UPC> bt;
    bt.q[0] = *(const uint4*)(ring + off + lane * 16);
#pragma unroll
    for (int p = 0; p < UPC; p++) bt.sb[0][p] = *(const float*)(ring + off + 512 + p * 128 + lane * 4);
    if (i + MMA_RING < count)
      ring_issue<UPC>(ring_s + off, codes + (i + MMA_RING) * step, sbt, first + (i + MMA_RING) * ks, gsh);
    asm volatile("cp.async.commit_group;" ::: "memory");
    const int cc = first + i * ks;
    compute_batch<1, 1, UPC>(bt, cc, ks, c0, cc + 1, xf, xs, live, y);
  }
}

// Cross-warp sums and the last-arrival flag of `mma_block`: one copy per module, not one per
// template instance (the megakernel inlines four).
__shared__ float mma_red[MMA_WARPS][8][16];
__shared__ int mma_last;
// Per token, the row statistics of a folded residual step (`residual_stats`).
__shared__ float mma_rstat[2][8];

// The work of one virtual block of one matrix: tile group g = vb / parts (tiles [g·tpb, (g+1)·tpb),
// ks = 8 / tpb warps per tile splitting its chunks, summed in warp order) over the chunks of part
// p = vb % parts. With one part the sums are the outputs; with several, each part's sums go to
// `partial` and the last of the group's blocks to finish adds them in part order (a counter per
// group, reset by that block), so no result depends on timing.
template <int H, int UPC, bool GATED, bool RING>
__device__ __forceinline__ void mma_block(const Mat& W, float* __restrict__ out, int vb, int ks, int parts,
                                          const float* x, const float* gate, int gstride, int m, uint2* xf,
                                          float* xs, int slice_chunks, int& built, float* partial,
                                          unsigned* counters, unsigned char* ring, const Residual& res,
                                          bool& started, const float4 (&keep)[RES_F4], bool kept) {
  float(&red)[MMA_WARPS][8][16] = mma_red;
  int& last = mma_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int tpb = MMA_WARPS / ks, tl = warp / ks;
  const int g = vb / parts, p = vb - g * parts;
  const int chunks = (W.cols + 63) / 64, tiles = (W.rows + 15) / 16;
  const VbWarp vw = vb_warp(vb, ks, parts, chunks);
  const int tile = vw.tile, ws = vw.ws;
  const int2 range = vw.range;
  float y[H][2];
#pragma unroll
  for (int h = 0; h < H; h++) y[h][0] = y[h][1] = 0.f;
  for (int c0 = range.x; c0 < range.y; c0 += slice_chunks) {
    const int n = min(slice_chunks, range.y - c0);
    if (built != c0) {  // block-uniform: the slice in shared memory is another one
      __syncthreads();  // its fragments are no longer read
      build_inputs<H, UPC, GATED>(xf, xs, x, gate, gstride, W.cols, m, c0, n, res, mma_rstat, keep, kept);
      __syncthreads();
      built = c0;
    }
    if (tile < tiles) {
      if constexpr (RING) {
        static_assert(H == 1, "the cp.async ring serves passes of up to four tokens");
        ring_slice<UPC>(W, tile, ws, ks, c0, n, xf, xs, y, ring + warp * MMA_RING * MMA_RING_SLOT(UPC), m, started);
      } else {
        tile_slice<H, UPC>(W, tile, ws, ks, c0, n, xf, xs, y, m);
      }
    }
    started = false;
  }
  started = false;  // also when this virtual block had no chunks
  float* dst = parts == 1 ? out : partial + (u64)p * m * W.rows;
  if (ks == 1) {  // the warp owns the whole tile: its lanes write their rows directly
#pragma unroll
    for (int h = 0; h < H; h++) {
      const int j = 4 * h + tig, row = tile * 16 + gid;
      if (j < m && row < W.rows) dst[(u64)j * W.rows + row] = y[h][0];
      if (j < m && row + 8 < W.rows) dst[(u64)j * W.rows + row + 8] = y[h][1];
    }
  } else {
    // The ks warps of a tile add their partial sums in warp order; they sync among themselves only.
#pragma unroll
    for (int h = 0; h < H; h++) {
      const int j = 4 * h + tig;
      if (j < m) {
        red[warp][j][gid] = y[h][0];
        red[warp][j][gid + 8] = y[h][1];
      }
    }
    asm volatile("bar.sync %0, %1;" ::"r"(1 + tl), "r"(ks * 32) : "memory");
    if (ws == 0) {
      for (int i = lane; i < 16 * m; i += 32) {
        const int j = i / 16, r = i % 16, row = tile * 16 + r;
        float s = 0.f;
        for (int w = 0; w < ks; w++) s += red[tl * ks + w][j][r];
        if (row < W.rows) dst[(u64)j * W.rows + row] = s;
      }
    }
    asm volatile("bar.sync %0, %1;" ::"r"(1 + tl), "r"(ks * 32) : "memory");  // `red` is reused next
  }
  if (parts == 1) return;
  __threadfence();  // this block's partial sums are visible before its arrival is counted
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&counters[g], 1u) == (unsigned)(parts - 1);
  __syncthreads();
  if (last) {
    __threadfence();
    const int t0 = g * tpb;
    for (int i = threadIdx.x; i < tpb * 16 * m; i += blockDim.x) {
      const int j = i / (tpb * 16), row = t0 * 16 + i % (tpb * 16);
      if (row >= W.rows) continue;
      float s = 0.f;
      for (int q = 0; q < parts; q++) s += __ldcg(partial + ((u64)q * m + j) * W.rows + row);
      out[(u64)j * W.rows + row] = s;
    }
    if (threadIdx.x == 0) counters[g] = 0u;
  }
  __syncthreads();  // `last` is reused next
}

// The (up to three) matrices of a launch, as `mma_kernel` reads them: here the kernel's
// parameters; the megakernel reads them from its stage table when a virtual block needs one
// (`MatSlots` in megakernel.cu), so the three never sit in registers.
struct MatParams {
  Mat w0, w1, w2;
  __device__ __forceinline__ Mat get(int i) const { return i == 0 ? w0 : i == 1 ? w1 : w2; }
};

// Up to three matrices of the same width on the same input in one launch (Q/K/V, gate/up):
// virtual blocks [0, nb0) compute y0 = W0·x, the next nb1 y1 = W1·x, the rest y2 = W2·x (several
// matrices only with parts = 1). With `gate` non-null the input is gelu(x)·gate (row stride
// `gstride`). Grid-stride over virtual blocks, each asked of L2 `ahead` blocks early; weights only
// before `pdl_start()`.
template <int H, int UPC, bool GATED, bool RING = false, class Mats = MatParams>
STAGE void mma_kernel(const int bid, const int nbid, const Mats& mats, const float* x, float* y0, float* y1,
                      float* y2, int nb0, int nb1, int m, int ks, int parts, int nblocks, int ahead, float* partial,
                      unsigned* counters, const float* gate, int gstride, const Residual& res) {
  extern __shared__ __align__(16) unsigned char mma_smem[];
  const int tpb = MMA_WARPS / ks;
  const int chunks = (mats.get(0).cols + 63) / 64;
  const int slice_chunks = min(chunks, MMA_SLICE_BYTES / (1024 * H + 32 * UPC));
  uint2* xf = (uint2*)mma_smem;
  float* xs = (float*)(mma_smem + slice_chunks * 1024 * H);
  // With RING, the warps' rings follow the inputs (16-byte aligned: 32·UPC bytes per chunk).
  unsigned char* ring = mma_smem + slice_chunks * (1024 * H + 32 * UPC);
  // Which matrix a virtual block belongs to, and its index within that matrix's blocks (one
  // inlined body for all three, selected by value).
  auto pick = [&](int b, Mat& W, float*& y) {
    if (b < nb0) {
      W = mats.get(0), y = y0;
      return b;
    }
    if (b < nb0 + nb1) {
      W = mats.get(1), y = y1;
      return b - nb0;
    }
    W = mats.get(2), y = y2;
    return b - nb0 - nb1;
  };
  Mat W;
  float* y;
  for (int i = 0; i < ahead; i++) {
    const int vb = bid + i * nbid;
    if (vb < nblocks) {
      const int local = pick(vb, W, y);
      prefetch_block(W, tpb, parts, local);
    }
  }
  // A folded residual step's norm weights are weights too: asked of L2 before the wait, they are not
  // a cold read between the step's two row reductions (they are 10 KB, but evicted every token).
  if (!GATED && res.o) {
    const int cols = mats.get(0).cols;
    for (int i = threadIdx.x * 32; i < cols; i += blockDim.x * 32) {
      prefetch_l2(res.w1 + i);
      if (res.w2) prefetch_l2(res.w2 + i);
    }
  }
  // The ring form copies its first virtual block's first chunks into shared memory before the wait
  // (weights never depend on activations; the block's shared memory is free: its previous stage
  // ended with a barrier), so they arrive while the previous stage finishes.
  bool started = false;
  if constexpr (RING) {
    if (bid < nblocks) {
      const VbWarp vw = vb_warp(pick(bid, W, y), ks, parts, chunks);
      if (vw.tile < (W.rows + 15) / 16)
        ring_start<UPC>(W, vw.tile, vw.ws, ks, vw.range.x, min(slice_chunks, vw.range.y - vw.range.x),
                        ring + (threadIdx.x >> 5) * MMA_RING * MMA_RING_SLOT(UPC));
      started = true;
    }
  }
  pdl_start();
  float4 keep[RES_F4] = {};  // x' of this thread's float4s of a one-token folded step
  bool kept = false;
  if (!GATED && res.o) {
    for (int j = 0; j < m; j++) residual_stats(res, j, mats.get(0).cols, bid == 0, mma_rstat, keep, kept);
    kept = kept && m == 1;
    __syncthreads();
  }
  int built = -1;  // first chunk of the slice whose inputs are in shared memory
  for (int vb = bid; vb < nblocks; vb += nbid) {
    const int next = vb + ahead * nbid;
    if (ahead > 0 && next < nblocks) {
      const int local = pick(next, W, y);
      prefetch_block(W, tpb, parts, local);
    }
    const int local = pick(vb, W, y);
    mma_block<H, UPC, GATED, RING>(W, y, local, ks, parts, x, gate, gstride, m, xf, xs, slice_chunks, built,
                                   partial, counters, ring, res, started, keep, kept);
  }
}

// Entry points: H = token groups of four (m ≤ 4 or m ≤ 8), UPC = scale units per 64-column chunk
// (1 for groups of ≥ 64 columns, 2 for groups of 32). The plain ones end with a `Residual` (rx …
// reps; ro null: none).
#define MMA_ENTRY(NAME, H, UPC)                                                                               \
  extern "C" __global__ void __launch_bounds__(256, MMA_BLOCKS_PER_SM)                                        \
      NAME(Mat W0, Mat W1, Mat W2, const float* x, float* y0, float* y1, float* y2, int nb0, int nb1, int m,   \
           int ks, int parts, int nblocks, int ahead, float* partial, unsigned* counters, const float* rx,     \
           const float* ro, const float* rw1, const float* rw2, float* rx_out, float rscale, float reps) {     \
    mma_kernel<H, UPC, false>(blockIdx.x, gridDim.x, MatParams{W0, W1, W2}, x, y0, y1, y2, nb0, nb1, m, ks,   \
                              parts, nblocks, ahead, partial, counters, nullptr, 0,                           \
                              Residual{rx, ro, rw1, rw2, rx_out, rscale, reps});                              \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256, MMA_BLOCKS_PER_SM)                                        \
      NAME##_gated(Mat W, const float* x, float* y, int m, int ks, int parts, int nblocks, int ahead,           \
                   float* partial, unsigned* counters, const float* gate, int gstride) {                      \
    mma_kernel<H, UPC, true>(blockIdx.x, gridDim.x, MatParams{W, W, W}, x, y, y, y, nblocks, 0, m, ks, parts,  \
                             nblocks, ahead, partial, counters, gate, gstride, Residual{});                   \
  }

MMA_ENTRY(matvec_q4t_4, 1, 1)
MMA_ENTRY(matvec_q4t_8, 2, 1)
MMA_ENTRY(matvec_q4t_4_g32, 1, 2)
MMA_ENTRY(matvec_q4t_8_g32, 2, 2)
