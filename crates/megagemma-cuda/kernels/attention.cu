// Scaled dot-product attention for each (token, query head), keys in chronological order: the
// committed cache (inside the window) followed by this pass's staged rows up to the query.
// Checked against the CPU reference (`gpu_check fixtures`, `tests/gpu_forward.rs`).
//
// Split along the keys (flash-decoding): a query's n keys are cut into nsplit contiguous ranges,
// one block each, so a long context streams from many SMs at once. Each block writes its range's
// maximum score m, Σ exp(s − m) and Σ exp(s − m)·v; the last of the query's blocks to finish (an
// arrival counter per query, reset by that block) combines them in split order. nsplit depends only
// on n, on the host's `split_keys` and on whether the pass has at most ATT_FEW_TOKENS tokens (decode and speculative verify
// split alike), and every reduction runs in a fixed order, so a query's result never depends on the
// other tokens of its pass or on timing.
#include "common.cuh"

#define ATT_MAX_DPL 16      // dims per lane: head dims up to 512
#define ATT_WARPS 8
#define ATT_FEW_TOKENS 8    // passes up to this many tokens split up to ATT_MAX_SPLITS ways
#define ATT_MAX_SPLITS 64
#define ATT_LONG_SPLITS 4   // longer passes (prefill) split at most this many ways
#define ATT_MAX_HPB 8       // query heads a block takes (of one KV group)
#define ATT_VDIMS 128       // dims of Σe·v summed per round: four a lane
// Floats of shared memory for committed K and V rows copied before the wait: a range's first
// ATT_PRE_FLOATS / (2·hd) committed keys (16 at head dim 256, 8 at 512); the rest are asked of L2.
#define ATT_PRE_FLOATS 8192
// Not in the megakernel: its stages share one register allocation, and the copy's registers made
// its entries spill more (lean entry 200 → 340 bytes of spill stores).
#ifdef MEGAKERNEL
#define ATT_PRE 0
#else
#define ATT_PRE 1
#endif

// Norms fused into a short pass's attention (`fused`, bit flags; 0 = the pass ran `qkv_norm_rope`):
#define ATT_FUSED_Q 1       // q holds the raw projection: each block norms (wq) and rotates its head
#define ATT_FUSED_KV 2      // (with Q) this pass's K/V rows are raw in kr/vr: norms, RoPE; ks/vs written here
#define ATT_FUSED_VNORM 4   // with ATT_FUSED_KV: values are RMS-normed (no weight), else taken as they are

// A batched step's column (`cols` non-null: one entry per token of the pass): the sequence the
// token belongs to — that sequence's committed and staged K/V of this layer, its ring and the
// token's position. Each column runs as the one token of its own sequence's pass: the same keys,
// splits and arithmetic as that sequence's lone step (`AttColumnDesc` in src/seq.rs).
struct AttColumn {
  const float* kc;
  const float* vc;
  float* ks;
  float* vs;
  int pos;
  int ring;
};

// Splits of a query over n keys in a pass of T tokens.
// split_keys: the fewest keys a split gets (the host's choice, `AttentionSplit` in src/seq.rs).
__device__ __forceinline__ int att_splits(int n, int T, int split_keys) {
  const int cap = T <= ATT_FEW_TOKENS ? ATT_MAX_SPLITS : ATT_LONG_SPLITS;
  return min(cap, (n + split_keys - 1) / split_keys);
}

// A query's splits combined in split order: m = max m_s, w_s = e^(m_s − m), l = Σ Σe_s·w_s, out =
// Σ (Σe·v)_s·w_s / l. ml(s) gives split s's (m, Σe), part(s, d) its Σe·v at dim d. (The loaders are
// parameters because a cluster combine, measured ±0 and removed in the fifteenth session, had its own;
// with one caller left plain pointers would do, but that form compiles to different SASS — the
// megakernel inlines this — so it waits for a session that can time it.) Every split's (m, Σe) is
// loaded at once into shared memory and each thread's Σe·v terms eight at a time, so the combine
// waits for a few L2 round trips, not three per split.
template <class Ml, class Part>
__device__ __forceinline__ void att_combine(int nsplit, int hd, float* o, float2* att_ml, float* att_w, Ml ml,
                                            Part part) {
  if ((int)threadIdx.x < nsplit) att_ml[threadIdx.x] = ml(threadIdx.x);
  __syncthreads();
  float m = NEG_INF;
  for (int s = 0; s < nsplit; s++) m = fmaxf(m, att_ml[s].x);
  if ((int)threadIdx.x < nsplit) att_w[threadIdx.x] = expf(att_ml[threadIdx.x].x - m);
  __syncthreads();
  float l = 0.f;
  for (int s = 0; s < nsplit; s++) l = fmaf(att_ml[s].y, att_w[s], l);
  const float inv = 1.f / l;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc_d = 0.f;
    for (int s0 = 0; s0 < nsplit; s0 += 8) {
      float v[8];
#pragma unroll
      for (int i = 0; i < 8; i++) v[i] = s0 + i < nsplit ? part(s0 + i, d) : 0.f;
#pragma unroll
      for (int i = 0; i < 8; i++)
        if (s0 + i < nsplit) acc_d = fmaf(v[i], att_w[s0 + i], acc_d);
    }
    o[d] = __fmul_rn(acc_d, inv);
  }
}

// q, out: [T, heads·hd]. Committed rows: kc/vc [slots or max_len, kv_heads·hd]; staged rows
// (positions p0 + i, p0 = pos[0]): ks/vs [T, kv_heads·hd]. window 0 = full attention; ring 0 =
// full cache, else the number of ring slots (slot = pos mod ring). hd is a multiple of 4.
//
// A block takes `hpb` query heads of one KV group (hpb divides heads / kv_heads, at most
// ATT_MAX_HPB) over one split of their keys: each K and V row it reads serves all hpb queries,
// so a KV group's rows leave L2 once per split, not once per query head. Grid: T·(heads / hpb)·
// grid_splits blocks (grid_splits ≥ every query's nsplit; extra blocks return at once).
// part_o [T·heads·grid_splits, hd], part_ml [T·heads·grid_splits] and counters [T·heads] are
// scratch. Every query's sums run in the same order whatever hpb is (the scores lane by lane over
// dims lane + 32·i, Σe·v warp by warp over its keys, then over the warps in order): the same bits.
//
// Fused norms (`fused`, ATT_FUSED_*): a short pass skips the `qkv_norm_rope` stage. Each block
// norms and rotates its query heads (wq, inv_freq) into shared memory, and, on a layer that owns
// its cache, the staged keys of its range from the raw rows kr/vr [T, kv_heads·hd] (wk; values
// RMS-normed without weight when ATT_FUSED_VNORM). The block of each KV group's first head whose
// range ends at its own token's key writes that token's normed row to ks/vs, for the K/V commit
// and the layers that share this cache (they run later and read ks/vs with `fused` = ATT_FUSED_Q).
// Every block that needs a row computes it with the same function as `qkv_norm_rope`: same bits.
//
// Shared memory (floats): queries [hpb, hd] | per-warp Σe·v [ATT_WARPS, hpb, ATT_VDIMS] | the
// range's normed staged K and V [2, ns, hd] | scores [hpb, per] | (16-byte aligned) the committed
// rows copied before the wait [ATT_PRE_FLOATS], last, so that the megakernel (ATT_PRE 0) needs none.
STAGE void attention_body(const int vb, const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
          float* ks, float* vs, float* __restrict__ out, int heads,
          int kv_heads, int hd, const int* __restrict__ pos_ptr, int window, int ring, float scale, int T,
          int grid_splits, float* part_o, float2* part_ml, unsigned* counters, int split_keys, int fused,
          const float* __restrict__ wq, const float* __restrict__ wk, const float* __restrict__ inv_freq, float eps,
          const float* __restrict__ kr, const float* __restrict__ vr, const AttColumn* __restrict__ cols, int hpb) {
  extern __shared__ __align__(16) float smem[];
  __shared__ int last;
  __shared__ float2 att_ml[ATT_MAX_SPLITS];  // the combine's per-split (m, Σe) and weights
  __shared__ float att_w[ATT_MAX_SPLITS];
  __shared__ float2 head_ml[ATT_MAX_HPB];    // this range's (max score, Σe) per query head
  // The positions and the committed cache rows were written before this pass began (positions
  // upload, K/V commit): both may be read before `pdl_start()`, and the rows are pulled into L2
  // while the previous kernel finishes. Staged rows (this pass's) only after it.
  const int split = vb % grid_splits, group = vb / grid_splits, groups = heads / hpb;
  const int t = group / groups, head0 = (group % groups) * hpb;
  // tl: the token's index in its own sequence's pass (its staged row); raw0: that pass's first
  // row of kr/vr. A batched column is token 0 of a one-token pass whose raw row is column t.
  int p0, tl = t, raw0 = 0;
  if (cols) {
    const AttColumn c = cols[t];
    kc = c.kc, vc = c.vc, ks = c.ks, vs = c.vs, ring = c.ring, p0 = c.pos;
    tl = 0, raw0 = t;
  } else {
    p0 = pos_ptr[0];
  }
  const int kvh = head0 / (heads / kv_heads);
  const int pos = p0 + tl;
  const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
  const int n = pos - lo + 1;
  const int nsplit = att_splits(n, T, split_keys);
  if (split >= nsplit) return;
  const int per = (n + nsplit - 1) / nsplit;
  const int k0 = lo + split * per, nk = min(per, n - split * per);  // keys k0 .. k0 + nk
  const int kvw = kv_heads * hd;
  // This pass's keys in the range (positions js0 .. k0 + nk), normed here from the raw rows.
  const int js0 = max(k0, p0), ns = (fused & ATT_FUSED_KV) ? max(0, k0 + nk - js0) : 0;
  float* qs = smem;
  float* part = qs + hpb * hd;
  float* kn = part + ATT_WARPS * hpb * ATT_VDIMS;
  float* vn = kn + ns * hd;
  float* scores = vn + ns * hd;
  float* kpre = smem + ((hpb * hd + ATT_WARPS * hpb * ATT_VDIMS + 2 * ns * hd + hpb * per + 3) & ~3);
  float* vpre = kpre + ATT_PRE_FLOATS / 2;
  // Fused norms: this thread's weight pairs (`weight_pair` in common.cuh) before the wait.
  const int half = hd / 2;
  const float2 wqp = weight_pair(fused & ATT_FUSED_Q ? wq : nullptr, half);
  const float2 wkp = weight_pair(fused & ATT_FUSED_KV ? wk : nullptr, half);
  const float f = fused & ATT_FUSED_Q && inv_freq && (int)threadIdx.x < half ? inv_freq[threadIdx.x] : 0.f;
  // The range's first `npre` committed keys and values are copied into shared memory (cp.async:
  // nothing waits for them before the scores), the rest asked of L2.
  const int committed = max(0, min(k0 + nk, p0) - k0);
  const int npre = ATT_PRE ? min(committed, ATT_PRE_FLOATS / (2 * hd)) : 0;
  {
    const int q4 = hd / 4;  // 16-byte pieces of a row
    const unsigned sk = smem_addr(kpre), sv = smem_addr(vpre);
    for (int i = threadIdx.x; i < npre * q4; i += blockDim.x) {
      const int jj = i / q4, c = 4 * (i - jj * q4), j = k0 + jj;
      const u64 g = (u64)(ring > 0 ? j % ring : j) * kvw + kvh * hd + c;
      const unsigned o = (unsigned)(jj * hd + c) * 4;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sk + o), "l"(kc + g) : "memory");
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(sv + o), "l"(vc + g) : "memory");
    }
    if (ATT_PRE) asm volatile("cp.async.commit_group;" ::: "memory");
    const int lines = (hd + 31) / 32, rest = committed - npre;  // 128-byte lines per head row
    for (int i = threadIdx.x; i < 2 * rest * lines; i += blockDim.x) {
      const int j = k0 + npre + (i / lines) % rest, l = i % lines;
      const float* base = i < rest * lines ? kc : vc;
      prefetch_l2(base + (u64)(ring > 0 ? j % ring : j) * kvw + kvh * hd + l * 32);
    }
  }
  pdl_start();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* qrow = q + ((u64)t * heads + head0) * hd;  // the block's hpb query rows, one after another
  if (fused & ATT_FUSED_Q) {
    // The queries and the range's staged keys and values, normed and rotated into shared memory:
    // one block reduction for query i with key and value i.
    for (int i = 0; i < max(hpb, ns); i++) {
      const u64 raw = (u64)(js0 + i - p0 + raw0) * kvw + kvh * hd;
      const float2 x = i < hpb ? head_pair(qrow + (u64)i * hd, half) : make_float2(0.f, 0.f);
      const float2 kx = i < ns ? head_pair(kr + raw, half) : make_float2(0.f, 0.f);
      const float2 vx = i < ns ? head_pair(vr + raw, half) : make_float2(0.f, 0.f);
      double sx = pair_sq(x), sk = pair_sq(kx), sv = pair_sq(vx);
      block_sum_d3(sx, sk, sv);
      if (i < hpb)
        store_pair(qs + i * hd, half, norm_rope_pair(x, rms_scale(sx, hd, eps), wq != nullptr, wqp, f, pos));
      if (i < ns) {
        store_pair(kn + i * hd, half, norm_rope_pair(kx, rms_scale(sk, hd, eps), wk != nullptr, wkp, f, js0 + i));
        const bool vnorm = fused & ATT_FUSED_VNORM;
        store_pair(vn + i * hd, half,
                   vnorm ? norm_rope_pair(vx, rms_scale(sv, hd, eps), false, wkp, 0.f, 0) : vx);
      }
    }
  } else {
    for (int i = threadIdx.x; i < hpb * hd; i += blockDim.x) qs[i] = qrow[i];
  }
  if (ATT_PRE) asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  if (ns > 0 && head0 % (heads / kv_heads) == 0 && split == nsplit - 1) {
    // The range ends at this token's own key (position pos): its row goes to the staging.
    const u64 row = (u64)tl * kvw + kvh * hd;
    const int i = pos - js0;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      ks[row + d] = kn[i * hd + d];
      vs[row + d] = vn[i * hd + d];
    }
  }
  // Key or value row j of the range (jj = j − k0): copied, in the cache, normed here or staged.
  auto kv_row = [&](const float* pre, const float* cache, const float* normed, const float* staged, int jj) {
    const int j = k0 + jj;
    return j < p0 ? (jj < npre ? pre + jj * hd : cache + (u64)(ring > 0 ? j % ring : j) * kvw + kvh * hd)
           : ns > 0 ? normed + (j - js0) * hd
                    : staged + (u64)(j - p0) * kvw + kvh * hd;
  };

  // Scores: one warp per key, its row in registers (lane: dims lane + 32·i), one dot product
  // per query head.
#pragma unroll 2
  for (int jj = warp; jj < nk; jj += ATT_WARPS) {
    const float* k = kv_row(kpre, kc, kn, ks, jj);
    float kd[ATT_MAX_DPL];
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL; i++) kd[i] = lane + 32 * i < hd ? k[lane + 32 * i] : 0.f;
#pragma unroll
    for (int h = 0; h < ATT_MAX_HPB; h++) {
      if (h >= hpb) break;
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < ATT_MAX_DPL; i++)
        if (lane + 32 * i < hd) s = fmaf(qs[h * hd + lane + 32 * i], kd[i], s);
      s = warp_sum(s);
      if (lane == 0) scores[h * per + jj] = __fmul_rn(s, scale);
    }
  }
  __syncthreads();
  // Softmax weights e = exp(s − max) in place, per query head.
  for (int h = 0; h < hpb; h++) {
    float* sc = scores + h * per;
    float mx = NEG_INF;
    for (int jj = threadIdx.x; jj < nk; jj += blockDim.x) mx = fmaxf(mx, sc[jj]);
    mx = block_max(mx);
    float sum = 0.f;
    for (int jj = threadIdx.x; jj < nk; jj += blockDim.x) {
      const float e = expf(sc[jj] - mx);
      sc[jj] = e;
      sum += e;
    }
    sum = block_sum(sum);
    if (threadIdx.x == 0) head_ml[h] = make_float2(mx, sum);
  }
  __syncthreads();

  // Weighted values Σ e·v, ATT_VDIMS dims at a time: warp w takes keys w, w + ATT_WARPS, …, each
  // lane four dims (one 16-byte load a key serves every query head); then the warps' sums in order.
  for (int c0 = 0; c0 < hd; c0 += ATT_VDIMS) {
    const int d = c0 + 4 * lane;
    float4 acc[ATT_MAX_HPB];
#pragma unroll
    for (int h = 0; h < ATT_MAX_HPB; h++) acc[h] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (d < hd) {
#pragma unroll 8
      for (int jj = warp; jj < nk; jj += ATT_WARPS) {
        const float4 v = *(const float4*)(kv_row(vpre, vc, vn, vs, jj) + d);
#pragma unroll
        for (int h = 0; h < ATT_MAX_HPB; h++) {
          if (h >= hpb) break;
          const float e = scores[h * per + jj];
          acc[h] = make_float4(fmaf(e, v.x, acc[h].x), fmaf(e, v.y, acc[h].y), fmaf(e, v.z, acc[h].z),
                               fmaf(e, v.w, acc[h].w));
        }
      }
    }
#pragma unroll
    for (int h = 0; h < ATT_MAX_HPB; h++)
      if (h < hpb) *(float4*)(part + (warp * hpb + h) * ATT_VDIMS + 4 * lane) = acc[h];
    __syncthreads();
    for (int i = threadIdx.x; i < hpb * ATT_VDIMS; i += blockDim.x) {
      const int h = i / ATT_VDIMS, dim = c0 + i % ATT_VDIMS;
      if (dim >= hd) continue;
      float s = 0.f;
      for (int w = 0; w < ATT_WARPS; w++) s += part[(w * hpb + h) * ATT_VDIMS + i % ATT_VDIMS];
      const u64 query = (u64)t * heads + head0 + h;
      if (nsplit == 1) {
        const float inv = 1.f / head_ml[h].y;
        out[query * hd + dim] = __fmul_rn(s, inv);
      } else {
        part_o[(query * grid_splits + split) * hd + dim] = s;  // this split's Σe·v
      }
    }
    __syncthreads();
  }
  if (nsplit == 1) return;
  // Several splits: publish this one's (m, Σe); the last of the group's blocks to arrive combines
  // every split of each of its query heads in order.
  const u64 query0 = (u64)t * heads + head0;
  if ((int)threadIdx.x < hpb) part_ml[(query0 + threadIdx.x) * grid_splits + split] = head_ml[threadIdx.x];
  if (!last_to_arrive(&counters[query0], nsplit, last)) return;
  for (int h = 0; h < hpb; h++) {
    const u64 first = (query0 + h) * grid_splits;
    att_combine(nsplit, hd, out + (query0 + h) * hd, att_ml, att_w, [&](int s) { return __ldcg(&part_ml[first + s]); },
                [&](int s, int d) { return __ldcg(&part_o[(first + s) * hd + d]); });
    __syncthreads();  // att_ml and att_w are the next head's
  }
  if (threadIdx.x == 0) counters[query0] = 0u;
}
extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, 2) attention(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
          float* ks, float* vs, float* __restrict__ out, int heads,
          int kv_heads, int hd, const int* __restrict__ pos_ptr, int window, int ring, float scale, int T,
          int grid_splits, float* part_o, float2* part_ml, unsigned* counters, int split_keys, int fused,
          const float* __restrict__ wq, const float* __restrict__ wk, const float* __restrict__ inv_freq, float eps,
          const float* __restrict__ kr, const float* __restrict__ vr, const AttColumn* __restrict__ cols, int hpb) {
  attention_body(blockIdx.x, q, kc, vc, ks, vs, out, heads, kv_heads, hd, pos_ptr, window, ring, scale, T, grid_splits,
                 part_o, part_ml, counters, split_keys, fused, wq, wk, inv_freq, eps, kr, vr, cols, hpb);
}
