// 4-bit affine matvec on the tensor cores: y[t] = W·x[t] for up to 8 columns t, weights in the
// tiled layout built at upload (`tile_q4` in src/tiled.rs). Checked against the CPU reference
// (every fixture's logits, `gpu_check fixtures --quant q4`) and against itself (verify columns
// bit-identical to single-token passes); the layout follows `probes/q4_mma_gemv.cu`.
//
// Layout (FMT_Q4T; rows padded to 16, columns to 64 with zero nibbles, scales and inputs):
//   codes `W.w`:  [tiles][chunks][32 lanes] uint4. A tile is 16 rows, a chunk 64 columns = two
//                 32-wide k-steps of `mma.m16n8k32` on bytes. For lane (gid = lane/4, tig = lane%4),
//                 bits 8i + 4s of word r hold t = q XOR 8 (q − 8 as a 4-bit two's complement) of row
//                 gid + 8·(r & 1), column 32s + 16·(r >> 1) + 4·tig + i. With t in a byte's high
//                 nibble and zeros below, the byte read as s8 is 16·(q − 8): `(w << 4) & 0xF0F0F0F0`
//                 is the lane's A fragment (register r) of k-step 0, `w & 0xF0F0F0F0` that of k-step 1.
//   scales `W.sb`: [tiles][padded groups][8 gid] float4 = (scale, bias) of row gid, then of gid+8.
//
// Math: w = s·q + b, so Σ w·x = s·Σ (q−8)·x + (b + 8s)·Σ x over each group (centred codes: the two
// terms do not cancel). The input becomes exact integers: per 64-column chunk, v = round(x·2^E)
// with E from the chunk's largest |x| (|v| < 2^30: 30 bits against the chunk's largest element),
// written as four balanced base-256 digits d_p ∈ [−128, 127] (v = Σ d_p·256^p), the "planes",
// which are four columns of the B operand (s8). A chunk is two integer mmas into one int32
// accumulator, Σ 16·(q−8)·d — exact (|Σ| ≤ 16·8·128·64) — whose columns are converted and scaled
// in f32: acc += (s·2^(−E−4))·(c_{p+1}·256 + c_p) for the lane's two planes, plus (b + 8s)·Σx;
// planes 2–3 (×65536) and 0–1 are added once per tile, not per chunk. So the sums carry the input
// to ~2^-30 of the chunk's largest element, like an f32 dot product; Σ x per 64 (or 32) columns is
// summed in f32 in a fixed order; scales apply per unit of min(group, 64) columns. Tokens go two
// per mma (token pair p: tokens 2p and 2p+1 in columns 0–3 and 4–7).
//
// Exactness across batch sizes: a token's result only ever depends on its own B columns (integer
// mma columns are independent and exact), on its own exponents and Σ x and on a work split that
// depends on the matrix shape alone, so column t of an 8-token pass is bit-identical to a 1-token
// pass.
#include "common.cuh"

#define MMA_WARPS 8
// Chunks per batch of a one-token-group warp (`tile_slice`). This and MMA_BLOCKS_PER_SM can be set
// for an experiment (`MEGAGEMMA_CUDA_DEFINES`; the host's grid and splits follow MMA_BLOCKS_PER_SM:
// `mma_blocks_per_sm` in src/device.rs).
#ifndef MMA_U1
#define MMA_U1 3
#endif
// Blocks per SM the register budget is set for: 2 leaves 128 registers a thread, room for two
// batches of chunks in flight per warp (eighteenth session: 1 block with 255 registers and deeper
// batches is 13–18% slower, 3 blocks 25–33%).
#ifndef MMA_BLOCKS_PER_SM
#define MMA_BLOCKS_PER_SM 2
#endif
// Dynamic shared memory for the inputs: per 64-column chunk 512 bytes of B fragments per token pair
// (2·H pairs) and UPC + 1 rows of 8·H floats (Σ x per unit, then 2^(−E−4); see `build_inputs`). A
// slice is as many chunks as fit (45 for H = 1), which a column part never exceeds.
#define MMA_SLICE_BYTES (48 * 1024)
#define MMA_CHUNK_BYTES(H, UPC) (1024 * (H) + 32 * (H) * ((UPC) + 1))
// Floats of one chunk's xs: UPC rows of Σ x, then one of 2^(−E−4).
#define MMA_XS_FLOATS(H, UPC) (8 * (H) * ((UPC) + 1))

// D = A·B + C on bytes: A 16×32 s8 codes (16·(q − 8)), B 32×8 s8 digits, int32 sums (exact).
__device__ __forceinline__ void mma_s8(int c[4], const unsigned a[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^e as a float, for −126 ≤ e ≤ 127.
__device__ __forceinline__ float exp2i(int e) { return __int_as_float((e + 127) << 23); }

// Index arithmetic without the integer division sequence (~20 instructions each; Nsight Compute
// counted ~10 of them per warp and virtual block, 10–20% of a launch's instructions). The warps per
// tile `ks` are a power of two: shifts. Column parts are usually one: no division then.
__device__ __forceinline__ int log2_pow2(int v) { return __ffs(v) - 1; }
// A power-of-two count of column parts (E4B's down projection: 4) divides by a shift: the division
// sequence was ~116 instructions per warp of the down launch (fourteenth session, source-line
// profile; fifteenth: 5-column verify −2.6%, decode ±0). The same quotients.
__device__ __forceinline__ int div_parts(int a, int parts) {
  if ((parts & (parts - 1)) == 0) return a >> log2_pow2(parts);
  return (int)((unsigned)a / (unsigned)parts);
}

// a / d for 0 ≤ a < 2^20 and a block-uniform d ≥ 1: a float estimate from a reciprocal taken once,
// corrected by one step either way (its error is far below one for such a; replayed on the host by
// `small_div_tests` in src/seq.rs).
struct SmallDiv {
  int d;
  float inv;
  __device__ __forceinline__ explicit SmallDiv(int d) : d(d), inv(__frcp_rn((float)d)) {}
  __device__ __forceinline__ int operator()(int a) const {
    int q = __float2int_rz(__fmul_rz((float)a, inv));
    q -= q * d > a;
    q += (q + 1) * d <= a;
    return q;
  }
};

// The chunk exponent E: |x|·2^E < 2^30 for every |x| ≤ amax (0 for an all-zero chunk), kept where
// 2^E and 2^(−E−4) are normal floats.
__device__ __forceinline__ int chunk_exponent(float amax) {
  if (!(amax > 0.f)) return 0;
  const int e = (int)((__float_as_uint(amax) >> 23) & 0xffu) - 126;  // amax < 2^e
  return min(122, max(-126, 30 - e));
}

// The four planes of four input elements already scaled by 2^E: word p holds digit p of each
// element (byte i for element i). Balanced digits: with u = v + 0x80808080 (no carry out for
// |v| < 2^30) byte p of u is d_p + 128, so d_p as s8 is that byte XOR 0x80.
__device__ __forceinline__ void planes4(const float v[4], float up, unsigned planes[4]) {
  unsigned u[4];
#pragma unroll
  for (int i = 0; i < 4; i++) u[i] = ((unsigned)__float2int_rn(__fmul_rn(v[i], up)) + 0x80808080u) ^ 0x80808080u;
  const unsigned t0 = __byte_perm(u[0], u[1], 0x5140), t1 = __byte_perm(u[2], u[3], 0x5140);  // bytes 0, 1
  const unsigned t2 = __byte_perm(u[0], u[1], 0x7362), t3 = __byte_perm(u[2], u[3], 0x7362);  // bytes 2, 3
  planes[0] = __byte_perm(t0, t1, 0x5410);
  planes[1] = __byte_perm(t0, t1, 0x7632);
  planes[2] = __byte_perm(t2, t3, 0x5410);
  planes[3] = __byte_perm(t2, t3, 0x7632);
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
#ifndef RES_KEEP
#ifdef MEGAKERNEL
#define RES_KEEP 0
#else
#define RES_KEEP 1
#endif
#endif

// With RES_KEEP the second norm weight w2 of the kept float4s is loaded into registers before the
// wait (`NormW2`), and the statistics step leaves norm(x')·w2 in `keep`, so the input build reads no
// w2 after the statistics (the same products: same bits; fourteenth session: E4B −1.2%, E2B −0.6%).
struct NormW2 {
  float4 v[RES_KEEP ? RES_F4 : 1];
};

// 1/rms(o) and 1/rms(x') (+ eps) of token j's row into r[0][j], r[1][j] (the second only with w2);
// block 0 also writes x'.
// Called by every thread of the block. The elements and sums of `add_norm_body` (ops.cu), in the
// same order, so the bits are those of the separate step: float4s f = tid + q·blockDim, in
// registers for rows of up to 4·RES_F4·blockDim elements (one load round trip). x' of those float4s
// is left in `keep` (`kept`: all of the row is there).
__device__ __forceinline__ void residual_stats(const Residual& res, int j, int dim, bool write, float r[2][8],
                                               float4 (&keep)[RES_F4], bool& kept, const NormW2& w2) {
  const u64 base = (u64)j * dim;
  const int n4 = dim / 4, bd = blockDim.x;
  const float* xr = res.x + base;
  const bool in_regs = n4 <= RES_F4 * bd;
  float4 ov[RES_F4], wv[RES_F4];
  stat_t ss = 0;
  if (in_regs) {
    // The separate kernel loads w1 with o and x, so the second statistic waits for no load after
    // the first reduction (graph E4B −2.2%); the megakernel loads it after (12 more registers cost
    // it 4%). Same values, same bits.
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
      ov[q] = f < n4 ? ld4_sum(res.o, base, f) : z;
      keep[q] = f < n4 ? ld4(xr, f) : z;
      if (RES_KEEP) wv[q] = f < n4 ? ld4(res.w1, f) : z;
    }
#pragma unroll
    for (int q = 0; q < RES_F4; q++)
      if (threadIdx.x + q * bd < n4) ss = sumsq4(ss, ov[q]);
  } else {
    for (int f = threadIdx.x; f < n4; f += bd) ss = sumsq4(ss, ld4_sum(res.o, base, f));
  }
  ss = block_sum_stat(ss);
  const float r1 = rms_scale(ss, dim, res.eps);
  stat_t ss2 = 0;
  if (in_regs) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * bd;
      if (f >= n4) continue;
      keep[q] = residual4(keep[q], ov[q], r1, RES_KEEP ? wv[q] : ld4(res.w1, f), res.scale);
      if (write) st4(res.x_out + base, f, keep[q]);
      if (res.w2) ss2 = sumsq4(ss2, keep[q]);
    }
  } else {
    for (int f = threadIdx.x; f < n4; f += bd) {
      const float4 v = residual4(ld4(xr, f), ld4_sum(res.o, base, f), r1, ld4(res.w1, f), res.scale);
      if (write) st4(res.x_out + base, f, v);
      if (res.w2) ss2 = sumsq4(ss2, v);
    }
  }
  kept = RES_KEEP && in_regs;
  if (threadIdx.x == 0) r[0][j] = r1;
  // Without w2 the input is x' itself (the PLE gate's): no second statistic, no second reduction.
  if (!res.w2) return;
  ss2 = block_sum_stat(ss2);
  if (threadIdx.x == 0) r[1][j] = rms_scale(ss2, dim, res.eps);
  if constexpr (RES_KEEP) {
    if (kept) {
      const float r2 = rms_scale(ss2, dim, res.eps);  // every thread has the block's sum
#pragma unroll
      for (int q = 0; q < RES_F4; q++) keep[q] = norm4(keep[q], r2, w2.v[q]);
    }
  }
}

// The input float4 at element k of token j with the residual step folded in (see `Residual`), from
// x, o, w1 and w2 again (a row `residual_stats` kept in registers is converted from there instead).
__device__ __forceinline__ float4 residual_inputs(const Residual& res, int j, int k, int dim, const float r[2][8]) {
  const float4 v = residual4(ld4(res.x + (u64)j * dim, k / 4), ld4_sum(res.o, (u64)j * dim, k / 4), r[0][j],
                             ld4(res.w1, k / 4), res.scale);
  return res.w2 ? norm4(v, r[1][j], ld4(res.w2, k / 4)) : v;
}

// One float4 of token j's input, elements 4·f4 … 4·f4 + 3 of local chunk lc (`in`: a real element;
// lanes past the end still join the shuffles with zeros), into the slice layout of `build_inputs`:
// B fragments at `words`, unit sums and the exponent row at `xs` (chunk lc's rows at lc·MMA_XS_FLOATS,
// indexed in `Index`). The chunk's largest |x| and the unit sums come from the half-warp that holds
// the chunk's 16 float4s, so whole warps call it.
template <int H, int UPC, class Index = int>
__device__ __forceinline__ void float4_inputs(unsigned* words, float* xs, const float w[4], int j, int lc, int f4,
                                              bool in) {
  constexpr int P = 2 * H, XW = 8 * H;
  float amax = fmaxf(fmaxf(fabsf(w[0]), fabsf(w[1])), fmaxf(fabsf(w[2]), fabsf(w[3])));
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const int E = chunk_exponent(amax);
  unsigned planes[4];
  planes4(w, exp2i(E), planes);
  if (in) {
    // Elements 4·f4 .. 4·f4+3: k-step f4 / 8, register (f4 / 4) % 2, lane tig f4 % 4 of the
    // columns 4·(j % 2) + plane; plane p is 4 lanes (16 words) after plane p − 1.
    unsigned* frag = words + ((lc * P + (j >> 1)) * 32 + 16 * (j & 1) + (f4 & 3)) * 4 + (f4 >> 3) * 2 + ((f4 >> 2) & 1);
#pragma unroll
    for (int p = 0; p < 4; p++) frag[16 * p] = planes[p];
  }
  // Σ x of the unit: 16 / UPC neighbouring lanes hold its float4s (units never straddle a warp).
  float sum = __fadd_rn(__fadd_rn(w[0], w[1]), __fadd_rn(w[2], w[3]));
#pragma unroll
  for (int o = 1; o < 16 / UPC; o <<= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, o));
  float* row = xs + (Index)lc * MMA_XS_FLOATS(H, UPC);
  if (in && f4 % (16 / UPC) == 0) {
    const int u = f4 / (16 / UPC);
    row[u * XW + j] = sum;
    row[u * XW + 4 * H + j] = 0.f;
  }
  if (in && f4 == 0) row[UPC * XW + j] = exp2i(-E - 4);
}

// Shared memory of one block, for the chunks [c0, c0 + n) of a slice (local chunk lc = c − c0):
//   xf[(lc·2H + p)·32 + lane] = uint4: the B fragments of token pair p (tokens 2p, 2p+1) for lane
//     (gid, tig): (b0, b1) of k-step 0, then of k-step 1. Column gid is plane gid of token 2p
//     (gid < 4) or plane gid − 4 of token 2p + 1; b0 holds the digits of columns 32s + 4·tig + i
//     (byte i), b1 those 16 further. Stored only for tokens below m; other lanes multiply zeros.
//   xs[lc·MMA_XS_FLOATS + u·8H + j] = Σ x over unit u (64 / UPC columns) of token j < 4H, in a
//     fixed order, and 0 at j + 4H (what the lanes of planes 2–3 add instead); row UPC holds
//     2^(−E−4) of token j's chunk (the 16 of the codes' bytes folded in).
// With GATED the input is gelu(x)·gate (the GeGLU and PLE gates fused in; `gstride` % 4 == 0);
// with `res.o` set, the residual step and norm before the matvec (`Residual`; stats in rstat).
// Every value depends only on its own token's inputs, never on m.
template <int H, int UPC, bool GATED, bool ONE = false>
__device__ __forceinline__ void build_inputs(uint4* xf, float* xs, const float* __restrict__ x,
                                             const float* __restrict__ gate, int gstride, int cols, int m, int c0,
                                             int n, const Residual& res, const float rstat[2][8],
                                             const float4 (&keep)[RES_F4], bool kept) {
  constexpr int R = GATED ? 2 : 4;  // float4s of input (and of gate) each thread has in flight at once
  unsigned* words = (unsigned*)xf;
#if RES_KEEP
  // One token with the whole input row kept in registers (`residual_stats`): thread t holds float4s
  // t + q·blockDim (zeros past the row's end, as the loop below converts them), so it converts
  // those of them inside the slice — any slice, also a column part's (a chunk's 16 float4s are still
  // one half-warp's: the same lanes, the same bits) — and loads nothing. Warps with none of the
  // slice's float4s skip the round (warp-uniform). Fifty-second session (H100, graph, 256 tokens,
  // three rounds; same logits): E2B 1.488 → 1.469 ms (−1.3%), E4B 2.278 → 2.264 (−0.6%), against
  // the loop below reading the kept row only for a slice that starts the row.
  if (!GATED && kept && m == 1) {
#pragma unroll
    for (int q = 0; q < RES_F4; q++) {
      const int f = threadIdx.x + q * blockDim.x, lc = (f >> 4) - c0;
      const bool in = lc >= 0 && lc < n;
      if (!__any_sync(0xffffffffu, in)) continue;
      const float w[4] = {in ? keep[q].x : 0.f, in ? keep[q].y : 0.f, in ? keep[q].z : 0.f, in ? keep[q].w : 0.f};
      float4_inputs<H, UPC>(words, xs, w, 0, in ? lc : 0, f & 15, in);
    }
    return;
  }
#endif
  const int per_token = n * 16;  // float4s of one token in the slice (a multiple of 16)
  const int total = m * per_token;
  const SmallDiv div_token(per_token);  // e / per_token: the token of float4 e
  // Whole warps iterate (the unit sums shuffle across lanes); lanes past the end add zeros.
  for (int base = threadIdx.x & ~31; base < total; base += R * blockDim.x) {
    float v[R][4];
#pragma unroll
    for (int r = 0; r < R; r++) {
      const int e = base + r * blockDim.x + (threadIdx.x & 31);
      const int j = ONE ? 0 : div_token(e), k = c0 * 64 + 4 * (e - j * per_token);
      v[r][0] = v[r][1] = v[r][2] = v[r][3] = 0.f;
      if (e < total && k < cols) {  // cols % 32 == 0: the four elements are all inside
        const float4 t = !GATED && res.o ? residual_inputs(res, j, k, cols, rstat)
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
      // A warp none of whose lanes has element r stops here (warp-uniform, so the shuffles below
      // keep every lane): a 2,560-wide row is 640 float4s for R·256 = 1,024 slots, so warps 0–3
      // stop after r = 2 and warps 4–7 after r = 1 (O's 2,048: after r = 1) instead of converting
      // zeros. Same results; seventeenth session: megakernel E4B −2.6%, E2B −4.2%, graph E2B −1.5%,
      // E4B ±0. The guarded loads above stay unskipped: skipping them too made the plain entries spill.
      if (base + r * (int)blockDim.x >= total) break;
      const int e = base + r * blockDim.x + (threadIdx.x & 31);
      const bool in = e < total;
      const int je = ONE ? 0 : div_token(e), j = in ? je : 0, k4 = e - je * per_token;
      const int lc = k4 >> 4, f4 = k4 & 15;  // local chunk, float4 within it
      // A chunk's 16 float4s are one half-warp's (per_token and base are multiples of 16).
      float4_inputs<H, UPC>(words, xs, v[r], j, lc, f4, in);
    }
  }
}

// The inputs of passes of several tokens prepared once, in global memory, for every plain matvec
// that reads them (`add_norm_prep`): per 64-column chunk c of the whole row, the B fragments of the
// slice layout at `prep + c·1024·H` (chunks·1024·H bytes), then the sums and exponents of its xs
// rows at `chunks·1024·H + c·MMA_XS_FLOATS` floats — `build_inputs`' layout with the slice starting
// at chunk 0, so a slice [c0, c0 + n) is two contiguous copies.
__device__ __forceinline__ u64 prep_xs_offset(int H, int chunks) { return (u64)chunks * 1024 * H; }

// Only the token pairs below m: a chunk's fragments are 2·H pairs of 32 uint4s, pair by pair.
// COPY_LOADS loads are in flight per thread before any is stored: a plain load-store loop waited
// for one L2 round trip per iteration (E4B's 40-chunk slices of a 3-token pass: 10 in a row).
// Twenty-eighth session, E4B 3-token verify: 1 load 3.51 ms, 4 loads 3.37, 8 3.46 (the prep entries
// spill), every copy a cp.async waited for at once 3.58.
#ifndef COPY_LOADS
#define COPY_LOADS 4
#endif
template <int H, int UPC>
__device__ __forceinline__ void copy_inputs(uint4* xf, float* xs, const unsigned char* prep, int chunks, int c0, int n,
                                            int m) {
  const uint4* src = (const uint4*)(prep + (u64)c0 * 1024 * H);
  const int live = 32 * ((m + 1) >> 1);  // uint4s of a chunk's live pairs
  const int total = n * 64 * H;
  const float4* ssrc = (const float4*)(prep + prep_xs_offset(H, chunks)) + (u64)c0 * MMA_XS_FLOATS(H, UPC) / 4;
  float4* sdst = (float4*)xs;
  // The first sums and exponents are loaded with the first words, so both arrive in one round trip
  // (they came after the words' loop, a round trip of their own: fiftieth session, H100, 3-token
  // verify of E4B 3.241 / 3.238 → 3.227 / 3.233 ms).
  const int nxs = n * MMA_XS_FLOATS(H, UPC) / 4;
  const float4 xs0 = (int)threadIdx.x < nxs ? __ldcg(ssrc + threadIdx.x) : make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = threadIdx.x; base < total; base += COPY_LOADS * blockDim.x) {
    uint4 v[COPY_LOADS];
    bool live_word[COPY_LOADS];  // inside the slice and in a live token pair
#pragma unroll
    for (int r = 0; r < COPY_LOADS; r++) {
      const int i = base + r * blockDim.x;
      live_word[r] = i < total && (i & (64 * H - 1)) < live;
      if (live_word[r]) v[r] = __ldcg(src + i);
    }
#pragma unroll
    for (int r = 0; r < COPY_LOADS; r++)
      if (live_word[r]) xf[base + r * blockDim.x] = v[r];
  }
  if ((int)threadIdx.x < nxs) sdst[threadIdx.x] = xs0;
  for (int i = threadIdx.x + blockDim.x; i < nxs; i += blockDim.x) sdst[i] = __ldcg(ssrc + i);
}

// Token j's part of the prepared inputs (see `copy_inputs`) from its row `x` of `cols`: the digit
// planes, unit sums and exponent of `build_inputs` with the same operations on the same lanes (a
// chunk's 16 float4s are one half-warp's), so a matvec that copies them computes the bits of one
// that builds them. Called by every thread of one block, for chunks [c_lo, c_hi) (a chunk's lanes
// keep their place in a half-warp wherever the range starts, so the sums are the same).
template <int H, int UPC>
__device__ __forceinline__ void prep_inputs(unsigned char* prep, const float* x, int j, int cols, int c_lo, int c_hi) {
  const int chunks = (cols + 63) / 64, lo = c_lo * 16, hi = c_hi * 16;
  unsigned* words = (unsigned*)prep;
  float* xsg = (float*)(prep + prep_xs_offset(H, chunks));
  for (int base = lo + (threadIdx.x & ~31); base < hi; base += blockDim.x) {
    const int e = base + (threadIdx.x & 31), k = 4 * e;
    const bool in = e < hi;
    float w[4] = {0.f, 0.f, 0.f, 0.f};
    if (in && k < cols) {
      const float4 t = __ldcg((const float4*)(x + (u64)j * cols + k));
      w[0] = t.x, w[1] = t.y, w[2] = t.z, w[3] = t.w;
    }
    float4_inputs<H, UPC, u64>(words, xsg, w, j, e >> 4, e & 15, in);
  }
}

// log2 of the group size (32, 64 or 128): group indices by shifts, not divisions.
__device__ __forceinline__ int gs_shift(const Mat& W) { return 31 - __clz(W.gs); }

// Chunks [lo, hi) of part p of `parts` (the same split on host and device).
__device__ __forceinline__ int2 part_range(int chunks, int parts, int p) {
  const int per = div_parts(chunks + parts - 1, parts);
  return make_int2(min(chunks, p * per), min(chunks, (p + 1) * per));
}

// A launch's split as its `split` argument carries it: ks warps per tile (a power of two up to
// MMA_WARPS) in bits 0-3, tpb tiles per virtual block (1 to MMA_WARPS / ks) from bit 4. A virtual
// block of fewer tiles than its warps could take leaves the rest idle: it spreads a launch's tiles
// over more of the grid's slots (src/mma_split.rs, `mma_split`).
struct Split {
  int ks, tpb;
};
__device__ __forceinline__ Split decode_split(int split) { return Split{split & 15, split >> 4}; }

// A tile index past every matrix's tiles: an idle warp's (16 times it still fits an int).
#define MMA_IDLE_TILE (1 << 26)

// What this warp does in virtual block vb of a matrix of `chunks` columns split `ks` warps per tile,
// `tpb` tiles per virtual block and `parts` column parts: its tile (MMA_IDLE_TILE if none), its
// place among the tile's warps, its column range.
struct VbWarp {
  int tile, ws;
  int2 range;
};
__device__ __forceinline__ VbWarp vb_warp(int vb, Split sp, int parts, int chunks) {
  const int ksh = log2_pow2(sp.ks), warp = threadIdx.x >> 5, tl = warp >> ksh, g = div_parts(vb, parts);
  return VbWarp{tl < sp.tpb ? g * sp.tpb + tl : MMA_IDLE_TILE, warp & (sp.ks - 1),
                part_range(chunks, parts, vb - g * parts)};
}

// Asks L2 for the codes and scales of one virtual block (tile group g, part p; the block's
// threads split the lines of each tile).
__device__ __forceinline__ void prefetch_block(const Mat& W, int tpb, int parts, int vb) {
  const int gsh = gs_shift(W), chunks = (W.cols + 63) / 64, tiles = (W.rows + 15) / 16, groups = (chunks * 64) >> gsh;
  const int g = div_parts(vb, parts), t0 = g * tpb, nt = min(tpb, tiles - t0);
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

// A unit's scales as a lane holds them: by default one of the four values (s, b of row gid, s, b of
// row gid + 8) its quad needs, shared by shuffles (`unit_scales`); whole (F4), all four, one 16-byte
// load that the quad's lanes share a line for — the same values, so the same bits, without the four
// shuffles. F4 is an opt-in experiment (`MEGAGEMMA_CUDA_DEFINES=MMA_SCALES_F4`; docs/perf-notes.md,
// twelfth and thirteenth sessions: decode +1.4% or ±0, verify −1.9%).
__device__ constexpr bool scales_f4() {
#if defined(MMA_SCALES_F4)
  return true;
#else
  return false;
#endif
}
template <bool F4>
struct ScaleOf {
  typedef float type;
};
template <>
struct ScaleOf<true> {
  typedef float4 type;
};
// Where lane `lane` reads its scales within a unit's 32 floats.
template <bool F4>
__device__ __forceinline__ int sb_lane(int lane) {
  return F4 ? (lane >> 2) * 4 : lane;
}
__device__ __forceinline__ void sb_load(float& v, const float* p) { v = __ldcs(p); }
__device__ __forceinline__ void sb_load(float4& v, const float* p) { v = __ldcs((const float4*)p); }

// A batch of one warp's chunks: chunk cc = c + u·ks for u < U (those below `end`), their codes and
// the scales this lane holds for each of their UPC scale units.
template <int U, int UPC, bool F4>
struct Batch {
  uint4 q[U];
  typename ScaleOf<F4>::type sb[U][UPC];
};

template <int U, int UPC, bool F4>
__device__ __forceinline__ void load_batch(Batch<U, UPC, F4>& bt, const uint4* __restrict__ codes,
                                           const float* __restrict__ sbt, int c, int ks, int end, int gsh) {
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int cc = c + u * ks;
    if (cc < end) {
      bt.q[u] = __ldcs(codes + (u64)cc * 32);
#pragma unroll
      for (int p = 0; p < UPC; p++) sb_load(bt.sb[u][p], sbt + (u64)((cc * 64 + p * (64 / UPC)) >> gsh) * 32);
    }
  }
}

// A unit's scales and biases of rows gid and gid + 8, gathered from the quad's four lanes (each
// loaded one of them): once per unit, whatever the number of token pairs.
struct UnitScales {
  float s0, b0, s1, b1;
};
__device__ __forceinline__ UnitScales unit_scales(float v) {
  const int quad = (threadIdx.x & 31) & ~3;
  return UnitScales{__shfl_sync(0xffffffffu, v, quad), __shfl_sync(0xffffffffu, v, quad + 1),
                    __shfl_sync(0xffffffffu, v, quad + 2), __shfl_sync(0xffffffffu, v, quad + 3)};
}
__device__ __forceinline__ UnitScales unit_scales(float4 v) { return UnitScales{v.x, v.y, v.z, v.w}; }

// One unit's scaled sums into a pair accumulator: c = the int32 columns of the lane's two planes
// for rows gid (c[0], c[1]) and gid + 8 (c[2], c[3]); u = the unit's scales and biases (`unit_scales`);
// f = 2^−E of the lane's token; sx = its Σ x (0 on plane 2–3 lanes).
// The lane's two planes combine in int32 before one conversion: |c| ≤ 2^20 (see the layout notes), so
// c1·256 + c0 is exact and the conversion rounds it once — the value of fmaf((float)c1, 256, (float)c0)
// with half the (quarter-rate) integer-to-float conversions.
__device__ __forceinline__ void scale_unit(const int c[4], const UnitScales& u, float f, float sx, float y[2]) {
  const float r0 = (float)(c[1] * 256 + c[0]), r1 = (float)(c[3] * 256 + c[2]);
  y[0] = fmaf(fmaf(8.f, u.s0, u.b0), sx, fmaf(__fmul_rn(u.s0, f), r0, y[0]));
  y[1] = fmaf(fmaf(8.f, u.s1, u.b1), sx, fmaf(__fmul_rn(u.s1, f), r1, y[1]));
}

// Multiplies a loaded batch into the pair accumulators y[p][r] (rows gid and gid + 8; token
// 2p + tig/2, planes 2·(tig % 2) and 2·(tig % 2) + 1), chunk by chunk in increasing order.
template <int H, int U, int UPC, bool F4>
__device__ __forceinline__ void compute_batch(const Batch<U, UPC, F4>& bt, int c, int ks, int c0, int end,
                                              const uint4* xf, const float* xs, const bool live[2 * H],
                                              const bool pairs[2 * H], float y[2 * H][2]) {
  constexpr int P = 2 * H, XW = 8 * H;
  const int lane = threadIdx.x & 31, tig = lane & 3;
  // This lane's column of xs: its token in pair 0, on the zero half for planes 2–3.
  const int xcol = (tig >> 1) + ((tig & 1) ? 4 * H : 0), fcol = tig >> 1;
#pragma unroll
  for (int u = 0; u < U; u++) {
    const int cc = c + u * ks;
    if (cc >= end) break;
    const unsigned w[4] = {bt.q[u].x, bt.q[u].y, bt.q[u].z, bt.q[u].w};
    unsigned a0[4], a1[4];  // the A fragments of k-steps 0 and 1: 16·(q − 8) as s8
#pragma unroll
    for (int r = 0; r < 4; r++) a0[r] = (w[r] << 4) & 0xF0F0F0F0u, a1[r] = w[r] & 0xF0F0F0F0u;
    const uint4* xb = xf + (cc - c0) * P * 32 + lane;
    const float* xsc = xs + (cc - c0) * MMA_XS_FLOATS(H, UPC);
    UnitScales us[UPC];
#pragma unroll
    for (int q = 0; q < UPC; q++) us[q] = unit_scales(bt.sb[u][q]);
#pragma unroll
    for (int p = 0; p < P; p++) {
      if (!pairs[p]) break;  // pairs past the launch's tokens (uniform across the warp)
      // Columns past the launch's tokens multiply zeros (their fragments are never written).
      const uint4 b = live[p] ? xb[p * 32] : make_uint4(0u, 0u, 0u, 0u);
      const float f = xsc[UPC * XW + 2 * p + fcol];
      if constexpr (UPC == 1) {
        int acc[4] = {0, 0, 0, 0};
        mma_s8(acc, a0, b.x, b.y);
        mma_s8(acc, a1, b.z, b.w);
        scale_unit(acc, us[0], f, xsc[2 * p + xcol], y[p]);
      } else {  // groups of 32: one unit per k-step
        int acc0[4] = {0, 0, 0, 0}, acc1[4] = {0, 0, 0, 0};
        mma_s8(acc0, a0, b.x, b.y);
        mma_s8(acc1, a1, b.z, b.w);
        scale_unit(acc0, us[0], f, xsc[2 * p + xcol], y[p]);
        scale_unit(acc1, us[UPC - 1], f, xsc[XW + 2 * p + xcol], y[p]);
      }
    }
  }
}

// Which token pairs' B fragments this lane reads (lane (gid, tig) carries token 2p + gid/4), and
// which pairs hold a token at all.
template <int H>
__device__ __forceinline__ void live_pairs(int m, bool live[2 * H], bool pairs[2 * H]) {
  const int half = ((threadIdx.x & 31) >> 2) >> 2;
#pragma unroll
  for (int p = 0; p < 2 * H; p++) live[p] = 2 * p + half < m, pairs[p] = 2 * p < m;
}

// The pair accumulators as token sums y[h][r] of token 4h + tig (rows gid, gid + 8): planes 2–3
// (×65536) and 0–1 added on both lanes of a token (the same bits either way round), then each lane
// takes its token from the lane that holds it. Called once per tile, after its last chunk.
template <int H>
__device__ __forceinline__ void pairs_to_tokens(const float yp[2 * H][2], float y[H][2]) {
  const int lane = threadIdx.x & 31, tig = lane & 3;
  float tot[2 * H][2];
#pragma unroll
  for (int p = 0; p < 2 * H; p++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const float v = (tig & 1) ? __fmul_rn(65536.f, yp[p][r]) : yp[p][r];
      tot[p][r] = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
    }
  const int src = (lane & ~3) + 2 * (tig & 1);
#pragma unroll
  for (int h = 0; h < H; h++)
#pragma unroll
    for (int r = 0; r < 2; r++) {
      const float a = __shfl_sync(0xffffffffu, tot[2 * h][r], src), b = __shfl_sync(0xffffffffu, tot[2 * h + 1][r], src);
      y[h][r] = (tig >> 1) ? b : a;
    }
}

// Chunks per register batch (registers allow two batches in flight).
template <int H, int UPC>
__device__ constexpr int batch_chunks() {
  return H == 1 && UPC == 1 ? MMA_U1 : 2 / UPC;
}
template <int H, int UPC>
using TileBatch = Batch<batch_chunks<H, UPC>(), UPC, scales_f4()>;

// Where a warp's share of a tile starts: this lane's codes and scales of the tile, and its first
// chunk in [c0, c0 + n). The warp's chunks are those ≡ ws (mod ks) whatever the slicing, taken in
// increasing order, so the sums do not depend on how many tokens (and so how large a slice) a
// launch has.
struct TileWalk {
  const uint4* codes;
  const float* sbt;
  int first, end, gsh;
};
template <bool F4>
__device__ __forceinline__ TileWalk tile_walk(const Mat& W, int tile, int ws, int ks, int c0, int n) {
  const int lane = threadIdx.x & 31;
  const int gsh = gs_shift(W), chunks = (W.cols + 63) / 64, groups = (chunks * 64) >> gsh;
  // Lane (gid, tig) loads its share of the quad's scales (`ScaleOf`, `sb_lane`).
  return TileWalk{(const uint4*)W.w + (u64)tile * chunks * 32 + lane,
                  (const float*)W.sb + (u64)tile * groups * 32 + sb_lane<F4>(lane),
                  c0 + ((ws - c0) & (ks - 1)),  // ks is a power of two
                  c0 + n, gsh};
}

// The first batch of a warp's share of a tile: `mma_kernel` loads it for a block's first virtual
// block before it waits (weights never depend on activations), so its loads are in flight during the
// wait, the residual step and the input build (thirteenth session: E4B −2.5%, E2B −3.2%).
// (The gated entries' second batch before the wait too was measured slower: +1.5–2%, fourteenth
// session.)
template <int H, int UPC>
__device__ __forceinline__ void tile_start(const Mat& W, int tile, int ws, int ks, int c0, int n,
                                           TileBatch<H, UPC>& first) {
  const TileWalk tw = tile_walk<scales_f4()>(W, tile, ws, ks, c0, n);
  load_batch(first, tw.codes, tw.sbt, tw.first, ks, tw.end, tw.gsh);
}

// One warp's share of a tile: chunks ≡ ws (mod ks) in [c0, c0 + n), accumulated into y[h][r].
// Batches of U chunks are double-buffered: the next batch's loads are in flight while the current
// one is multiplied, so a warp keeps up to 2U chunks of weights on their way. `started`: `first`
// holds the first batch already (`tile_start`).
template <int H, int UPC, bool F4>
__device__ __forceinline__ void tile_slice(const Mat& W, int tile, int ws, int ks, int c0, int n, const uint4* xf,
                                           const float* xs, float y[2 * H][2], int m,
                                           const TileBatch<H, UPC>& first_batch, bool started) {
  constexpr int U = batch_chunks<H, UPC>();
  const TileWalk tw = tile_walk<F4>(W, tile, ws, ks, c0, n);
  const uint4* __restrict__ codes = tw.codes;
  const float* __restrict__ sbt = tw.sbt;
  const int first = tw.first, end = tw.end, gsh = tw.gsh, step = U * ks;
  bool live[2 * H], pairs[2 * H];
  live_pairs<H>(m, live, pairs);
  Batch<U, UPC, F4> ba, bb;
  if (started)
    ba = first_batch;
  else
    load_batch<U, UPC, F4>(ba, codes, sbt, first, ks, end, gsh);
  for (int c = first; c < end; c += 2 * step) {
    load_batch<U, UPC, F4>(bb, codes, sbt, c + step, ks, end, gsh);
    compute_batch<H, U, UPC, F4>(ba, c, ks, c0, end, xf, xs, live, pairs, y);
    if (c + step >= end) break;
    load_batch<U, UPC, F4>(ba, codes, sbt, c + 2 * step, ks, end, gsh);
    compute_batch<H, U, UPC, F4>(bb, c + step, ks, c0, end, xf, xs, live, pairs, y);
  }
}

// The megakernel's form of `tile_slice` (H groups of four tokens): the same chunks in the same order
// and the same arithmetic (so the same bits), but the weights arrive by cp.async in a ring of
// MMA_RING chunks per warp in shared memory rather than in register batches. Bytes in flight take
// no registers, so the matvec fits beside every other stage in the megakernel's 128 registers
// without spills. A lane copies, and later reads, only its own 16 bytes of codes and 4 bytes per
// scale unit, so its own `cp.async.wait_group` is all the synchronisation a slot needs.
// Four slots, not eight: the megakernel's shared memory and its L1 cache share each SM's 256 KB, and
// 20 KB less ring a block moves the carveout from 196 to 164 KB, the L1 from 60 to 92 KB, which its
// register spills and re-read activations use (forty-fifth session, H100: decode E4B −1.6%, E2B
// −2.6%, 3-column verify −3%; 12 KB more shared memory instead: +2.1%). `MMA_RING=N` in
// MEGAGEMMA_CUDA_DEFINES sets it for an experiment (the host's `mma_ring_bytes` follows).
#ifndef MMA_RING
#define MMA_RING 4
#endif
#define MMA_RING_SLOT(UPC) (512 + 128 * (UPC))

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
  return make_int2(first, first < c0 + n ? (c0 + n - first + ks - 1) >> log2_pow2(ks) : 0);
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
template <int H, int UPC, bool F4>
__device__ __forceinline__ void ring_slice(const Mat& W, int tile, int ws, int ks, int c0, int n, const uint4* xf,
                                           const float* xs, float y[2 * H][2], unsigned char* ring, int m,
                                           bool started) {
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
  bool live[2 * H], pairs[2 * H];  // as in tile_slice: columns past the pass's m tokens read zeros
  live_pairs<H>(m, live, pairs);
  if (!started) ring_start<UPC>(W, tile, ws, ks, c0, n, ring);
  for (int i = 0; i < count; i++) {
    asm volatile("cp.async.wait_group %0;" ::"n"(MMA_RING - 1) : "memory");
    const int off = (i % MMA_RING) * MMA_RING_SLOT(UPC);
    Batch<1, UPC, F4> bt;
    bt.q[0] = *(const uint4*)(ring + off + lane * 16);
    if constexpr (F4) {
      // The quad's four lanes copied the line this lane reads: their copies are complete (each
      // waited) and visible once the warp has met; and none refills the slot before all have read.
      __syncwarp();
#pragma unroll
      for (int p = 0; p < UPC; p++) bt.sb[0][p] = *(const float4*)(ring + off + 512 + p * 128 + sb_lane<F4>(lane) * 4);
      __syncwarp();
    } else {
#pragma unroll
      for (int p = 0; p < UPC; p++) bt.sb[0][p] = *(const float*)(ring + off + 512 + p * 128 + lane * 4);
    }
    if (i + MMA_RING < count)
      ring_issue<UPC>(ring_s + off, codes + (i + MMA_RING) * step, sbt, first + (i + MMA_RING) * ks, gsh);
    asm volatile("cp.async.commit_group;" ::: "memory");
    const int cc = first + i * ks;
    compute_batch<H, 1, UPC, F4>(bt, cc, ks, c0, cc + 1, xf, xs, live, pairs, y);
  }
}

// Column parts the last block of a split launch loads at once when it adds them (`sum_in_order`):
// E2B's down projection has 20–22 parts, E4B's 13, so all of them in one round trip. Thirtieth
// session (H200, graph, two rounds, same bits): 24 against 8, E2B 1.518 → 1.511 ms, E4B ±0.
#ifndef MMA_COMBINE_LOADS
#define MMA_COMBINE_LOADS 24
#endif

// Cross-warp sums and the last-arrival flag of `mma_block`: one copy per module, not one per
// template instance (the megakernel inlines four).
__shared__ float mma_red[MMA_WARPS][8][16];
__shared__ int mma_last;
// Per token, the row statistics of a folded residual step (`residual_stats`).
__shared__ float mma_rstat[2][8];

// The work of one virtual block of one matrix: tile group g = vb / parts (tiles [g·tpb, (g+1)·tpb),
// ks ≤ 8 / tpb warps per tile splitting its chunks, summed in warp order) over the chunks of part
// p = vb % parts. With one part the sums are the outputs; with several, each part's sums go to
// `partial` and the last of the group's blocks to finish adds them in part order (a counter per
// group, reset by that block), so no result depends on timing.
template <int H, int UPC, bool GATED, bool RING, bool PREP = false, bool ONE = false>
__device__ __forceinline__ void mma_block(const Mat& W, float* __restrict__ out, int vb, Split sp, int parts,
                                          const float* x, const float* gate, int gstride, int m, uint4* xf,
                                          float* xs, int slice_chunks, int& built, float* partial,
                                          unsigned* counters, unsigned char* ring, const Residual& res,
                                          bool& started, const TileBatch<H, UPC>& first_batch,
                                          const float4 (&keep)[RES_F4], bool kept) {
  float(&red)[MMA_WARPS][8][16] = mma_red;
  int& last = mma_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int ks = sp.ks, tpb = sp.tpb, tl = warp >> log2_pow2(ks);
  const int g = div_parts(vb, parts), p = vb - g * parts;
  const int chunks = (W.cols + 63) / 64, tiles = (W.rows + 15) / 16;
  const VbWarp vw = vb_warp(vb, sp, parts, chunks);
  const int tile = vw.tile, ws = vw.ws;
  const int2 range = vw.range;
  float yp[2 * H][2];  // pair accumulators (`compute_batch`)
#pragma unroll
  for (int p = 0; p < 2 * H; p++) yp[p][0] = yp[p][1] = 0.f;
#ifdef FIXED_SUMS
  // A split launch without counters adds its parts into 64-bit integers at `out` (`put`), and
  // the blocks of part 0 clear `partial`, the launch's other sum buffer, for the next such launch
  // (the host alternates the two: src/seq/stages.rs, `matvec_sum`). Its readers ran before this
  // launch's wait, and the next writer waits for this launch.
  const bool fixed = parts > 1 && !counters;
  if (fixed && p == 0) {
    long long* zero = (long long*)partial;
    for (int i = threadIdx.x; i < tpb * 16 * m; i += blockDim.x) {
      const int j = i / (tpb * 16), row = g * tpb * 16 + i % (tpb * 16);
      if (row < W.rows) zero[(u64)j * W.rows + row] = 0;
    }
  }
#else
  constexpr bool fixed = false;
#endif
  // One output: stored, or with FIXED_SUMS added to the launch's 64-bit sums.
  const auto put = [&](float* dst, u64 i, float v) {
#ifdef FIXED_SUMS
    if (fixed) {
      red_add_sum((long long*)out + i, __float2ll_rn(__fmul_rn(v, SUM_UNIT)));
      return;
    }
#endif
    dst[i] = v;
  };
  for (int c0 = range.x; c0 < range.y; c0 += slice_chunks) {
    const int n = min(slice_chunks, range.y - c0);
    if (built != c0) {  // block-uniform: the slice in shared memory is another one
      __syncthreads();  // its fragments are no longer read
      if constexpr (PREP)
        copy_inputs<H, UPC>(xf, xs, (const unsigned char*)x, (W.cols + 63) / 64, c0, n, m);
      else
        build_inputs<H, UPC, GATED, ONE>(xf, xs, x, gate, gstride, W.cols, m, c0, n, res, mma_rstat, keep, kept);
      __syncthreads();
#if defined(MK_MARK) && defined(MEGAKERNEL)
      mk_mark(2);  // the megakernel's trace experiment: the inputs are built
#endif
      built = c0;
    }
    if (tile < tiles) {
      if constexpr (RING) {
        ring_slice<H, UPC, scales_f4()>(W, tile, ws, ks, c0, n, xf, xs, yp,
                                        ring + warp * MMA_RING * MMA_RING_SLOT(UPC), m, started);
      } else {
        tile_slice<H, UPC, scales_f4()>(W, tile, ws, ks, c0, n, xf, xs, yp, m, first_batch, started);
      }
    }
    started = false;
  }
  started = false;  // also when this virtual block had no chunks
  float y[H][2];
  pairs_to_tokens<H>(yp, y);
  float* dst = parts == 1 ? out : partial + (u64)p * m * W.rows;
  if (ks == 1) {  // the warp owns the whole tile: its lanes write their rows directly
#pragma unroll
    for (int h = 0; h < H; h++) {
      const int j = 4 * h + tig, row = tile * 16 + gid;
      if (j < m && row < W.rows) put(dst, (u64)j * W.rows + row, y[h][0]);
      if (j < m && row + 8 < W.rows) put(dst, (u64)j * W.rows + row + 8, y[h][1]);
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
        if (row < W.rows) put(dst, (u64)j * W.rows + row, s);
      }
    }
    asm volatile("bar.sync %0, %1;" ::"r"(1 + tl), "r"(ks * 32) : "memory");  // `red` is reused next
  }
  if (parts == 1 || fixed) return;
  if (last_to_arrive(&counters[g], parts, last)) {
    const int t0 = g * tpb;
    for (int i = threadIdx.x; i < tpb * 16 * m; i += blockDim.x) {
      const int j = i / (tpb * 16), row = t0 * 16 + i % (tpb * 16);
      if (row >= W.rows) continue;
      out[(u64)j * W.rows + row] = sum_in_order<MMA_COMBINE_LOADS>(partial + (u64)j * W.rows + row, (u64)m * W.rows, parts);
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
// With PREP, `x` is the inputs prepared in the slices' layout (`prep_inputs`), copied, not built.
template <int H, int UPC, bool GATED, bool RING = false, class Mats = MatParams, bool PREP = false,
          bool ONE = false>
STAGE void mma_kernel(const int bid, const int nbid, const Mats& mats, const float* x, float* y0, float* y1,
                      float* y2, int nb0, int nb1, int m, int split, int parts, int nblocks, int ahead, float* partial,
                      unsigned* counters, const float* gate, int gstride, const Residual& res) {
  extern __shared__ __align__(16) unsigned char mma_smem[];
  if constexpr (ONE) m = 1;  // a single-token entry: every m-dependent branch folds away
  const Split sp = decode_split(split);
  const int ks = sp.ks, tpb = sp.tpb;
  const int chunks = (mats.get(0).cols + 63) / 64;
  const int slice_chunks = min(chunks, MMA_SLICE_BYTES / MMA_CHUNK_BYTES(H, UPC));
  uint4* xf = (uint4*)mma_smem;
  float* xs = (float*)(mma_smem + slice_chunks * 1024 * H);
  // With RING, the warps' rings follow the inputs (16-byte aligned: MMA_CHUNK_BYTES is a multiple of 32).
  unsigned char* ring = mma_smem + slice_chunks * MMA_CHUNK_BYTES(H, UPC);
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
  // Each warp's first weights of its block's first virtual block are fetched before the wait
  // (weights never depend on activations): the ring form copies its first chunks into shared memory
  // (free: the previous stage ended with a barrier), the register form loads its first batch into
  // registers. They arrive while the previous stage finishes and the inputs are built.
  bool started = false;
  TileBatch<H, UPC> first_batch;
  if (bid < nblocks) {
    const VbWarp vw = vb_warp(pick(bid, W, y), sp, parts, chunks);
    if (vw.tile < (W.rows + 15) / 16) {
      if constexpr (RING)
        ring_start<UPC>(W, vw.tile, vw.ws, ks, vw.range.x, min(slice_chunks, vw.range.y - vw.range.x),
                        ring + (threadIdx.x >> 5) * MMA_RING * MMA_RING_SLOT(UPC));
      else
        tile_start<H, UPC>(W, vw.tile, vw.ws, ks, vw.range.x, min(slice_chunks, vw.range.y - vw.range.x),
                           first_batch);
    }
    started = true;
  }
  NormW2 w2 = {};
  if constexpr (RES_KEEP && !GATED) {
    if (res.o && res.w2 && m == 1) {
      const int n4 = mats.get(0).cols / 4;
#pragma unroll
      for (int q = 0; q < RES_F4; q++) {
        const int f = threadIdx.x + q * blockDim.x;
        w2.v[q] = f < n4 ? ld4(res.w2, f) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
  pdl_start();
  float4 keep[RES_F4] = {};  // x' of this thread's float4s of a one-token folded step
  bool kept = false;
  if (!GATED && res.o) {
    for (int j = 0; j < m; j++) residual_stats(res, j, mats.get(0).cols, bid == 0, mma_rstat, keep, kept, w2);
    kept = kept && m == 1;
    __syncthreads();
#if defined(MK_MARK) && defined(MEGAKERNEL)
    mk_mark(1);  // the megakernel's trace experiment: the folded residual step's statistics are in
#endif
  }
  int built = -1;  // first chunk of the slice whose inputs are in shared memory
  for (int vb = bid; vb < nblocks; vb += nbid) {
    const int next = vb + ahead * nbid;
    if (ahead > 0 && next < nblocks) {
      const int local = pick(next, W, y);
      prefetch_block(W, tpb, parts, local);
    }
    const int local = pick(vb, W, y);
    mma_block<H, UPC, GATED, RING, PREP, ONE>(W, y, local, sp, parts, x, gate, gstride, m, xf, xs, slice_chunks, built,
                                         partial, counters, ring, res, started, first_batch, keep, kept);
  }
}

// Entry points: H = token groups of four (m ≤ 4 or m ≤ 8), UPC = scale units per 64-column chunk
// (1 for groups of ≥ 64 columns, 2 for groups of 32), RING: the weights through the cp.async ring
// (`ring_slice`) instead of register batches (`tile_slice`), one token group only; ONE: a single
// token, `m` = 1 at compile time (decode steps; MEGAGEMMA_CUDA_MMA_ONE=0 runs the four-token entries
// with m = 1 instead — the same functions, so the same bits). The plain ones end with a `Residual`
// (rx … reps; ro null: none).
#define MMA_ENTRY(NAME, H, UPC, RING, ONE)                                                                    \
  extern "C" __global__ void __launch_bounds__(256, MMA_BLOCKS_PER_SM)                                        \
      NAME(Mat W0, Mat W1, Mat W2, const float* x, float* y0, float* y1, float* y2, int nb0, int nb1, int m,   \
           int split, int parts, int nblocks, int ahead, float* partial, unsigned* counters, const float* rx,  \
           const float* ro, const float* rw1, const float* rw2, float* rx_out, float rscale, float reps) {     \
    mma_kernel<H, UPC, false, RING, MatParams, false, ONE>(                                                   \
        blockIdx.x, gridDim.x, MatParams{W0, W1, W2}, x, y0, y1, y2, nb0, nb1, m, split, parts, nblocks, ahead, \
        partial, counters, nullptr, 0, Residual{rx, ro, rw1, rw2, rx_out, rscale, reps});                     \
  }                                                                                                            \
  extern "C" __global__ void __launch_bounds__(256, MMA_BLOCKS_PER_SM)                                        \
      NAME##_gated(Mat W, const float* x, float* y, int m, int split, int parts, int nblocks, int ahead,        \
                   float* partial, unsigned* counters, const float* gate, int gstride) {                      \
    mma_kernel<H, UPC, true, RING, MatParams, false, ONE>(blockIdx.x, gridDim.x, MatParams{W, W, W}, x, y, y, y, \
                                                        nblocks, 0, m, split, parts, nblocks, ahead, partial,  \
                                                        counters, gate, gstride, Residual{});                 \
  }

MMA_ENTRY(matvec_q4t_4, 1, 1, false, false)
MMA_ENTRY(matvec_q4t_8, 2, 1, false, false)
MMA_ENTRY(matvec_q4t_4_g32, 1, 2, false, false)
MMA_ENTRY(matvec_q4t_8_g32, 2, 2, false, false)
#ifndef MEGAKERNEL
MMA_ENTRY(matvec_q4t_1, 1, 1, false, true)
MMA_ENTRY(matvec_q4t_1_g32, 1, 2, false, true)
#endif

// Passes of several tokens whose residual step is a launch of its own: `add_norm_prep_*` runs it
// (as `add_norm` in ops.cu, one block per token) and prepares its output — the normed input, or
// the new residual when w2 is null — for the plain matvecs after it, whose `*_prep` entries copy
// their slices of it (`copy_inputs`) instead of building them in every block. Separate entries, so
// the decode step's kernels carry none of it.
#ifndef MEGAKERNEL
#define MMA_PREP_ENTRY(NAME, SUFFIX, H, UPC)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, MMA_BLOCKS_PER_SM)                                        \
      NAME##_prep(Mat W0, Mat W1, Mat W2, const unsigned char* prep, float* y0, float* y1, float* y2, int nb0,  \
                  int nb1, int m, int split, int parts, int nblocks, int ahead, float* partial,                 \
                  unsigned* counters) {                                                                        \
    mma_kernel<H, UPC, false, false, MatParams, true>(blockIdx.x, gridDim.x, MatParams{W0, W1, W2},            \
                                                      (const float*)prep, y0, y1, y2, nb0, nb1, m, split,       \
                                                      parts, nblocks, ahead, partial, counters, nullptr, 0,     \
                                                      Residual{});                                              \
  }                                                                                                            \
  /* `slices` blocks per token, each preparing its slice of the row (`slice_chunks`); x' goes to x_out. */ \
  extern "C" __global__ void __launch_bounds__(256) add_norm_prep##SUFFIX(                                     \
      float* x, const float* __restrict__ o, const float* __restrict__ w1, float scale, float* a,             \
      const float* __restrict__ w2, int dim, float eps, unsigned char* prep, float* x_out, int slices) {       \
    add_norm_body(blockIdx.x, x, o, w1, scale, a, w2, dim, eps, x_out, slices);                                \
    __syncthreads(); /* the block's slice of a (or x') is written */                                           \
    const int j = blockIdx.x / slices;                                                                         \
    const int2 c = slice_chunks(dim / 4, slices, blockIdx.x - j * slices);                                     \
    prep_inputs<H, UPC>(prep, w2 ? a : x_out, j, dim, c.x, c.y);                                               \
  }
MMA_PREP_ENTRY(matvec_q4t_4, _4, 1, 1)
MMA_PREP_ENTRY(matvec_q4t_8, _8, 2, 1)
MMA_PREP_ENTRY(matvec_q4t_4_g32, _4_g32, 1, 2)
MMA_PREP_ENTRY(matvec_q4t_8_g32, _8_g32, 2, 2)
#endif
// The ring form for the launched kernels (`MEGAGEMMA_CUDA_MMA_RING=1`, src/seq/stages.rs): the same
// chunks in the same order, so the same bits; the megakernel inlines it instead.
#ifndef MEGAKERNEL
MMA_ENTRY(matvec_q4t_4_ring, 1, 1, true, false)
MMA_ENTRY(matvec_q4t_4_g32_ring, 1, 2, true, false)
#endif
