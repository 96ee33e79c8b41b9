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
// Blocks per SM the registers must allow (`__launch_bounds__`; an experiment may set it in
// MEGAGEMMA_CUDA_DEFINES). Four (64 registers, 8 bytes spilled) put an 8k context's 512 blocks of a
// full layer in one wave instead of 1.94; measured on the H200 against two (twentieth session): 8k
// −1.1%, a 5-column verify −3%, one-token steps ±1%. Three is slower than either (1.3 waves).
#ifndef ATT_MIN_BLOCKS
#define ATT_MIN_BLOCKS 4
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

// Split loads the combine keeps in flight per thread in decode steps (`attention_1_*`; a define
// for experiments). Twenty-sixth session, E4B at 256 tokens: 8 (every entry's before) 2.220 ms,
// 16 2.213, 32 2.217; the general entry keeps 8 (16 made a 5-column verify 0.6% slower: spills).
#ifndef ATT_COMBINE_LOADS
#define ATT_COMBINE_LOADS 16
#endif

// A query's splits combined in split order: m = max m_s, w_s = e^(m_s − m), l = Σ Σe_s·w_s, out =
// Σ (Σe·v)_s·w_s / l. ml(s) gives split s's (m, Σe), part(s, d) its Σe·v at dim d. (The loaders are
// parameters because a cluster combine, measured ±0 and removed in the fifteenth session, had its own;
// with one caller left plain pointers would do, but that form compiles to different SASS — the
// megakernel inlines this — so it waits for a session that can time it.) Every split's (m, Σe) is
// loaded at once into shared memory, m is a warp maximum (the same value in any order), and each
// thread's Σe·v terms come LOADS at a time, so the combine waits for a few L2 round trips (the sums
// keep split order: the same bits whatever LOADS is).
template <int LOADS, class Ml, class Part>
__device__ __forceinline__ void att_combine(int nsplit, int hd, float* o, float2* att_ml, float* att_w, Ml ml,
                                            Part part) {
  if ((int)threadIdx.x < nsplit) att_ml[threadIdx.x] = ml(threadIdx.x);
  __syncthreads();
  float m = NEG_INF;
  for (int s = threadIdx.x & 31; s < nsplit; s += 32) m = fmaxf(m, att_ml[s].x);
  m = warp_reduce(m, MaxOp());
  if ((int)threadIdx.x < nsplit) att_w[threadIdx.x] = expf(att_ml[threadIdx.x].x - m);
  __syncthreads();
  float l = 0.f;
  for (int s = 0; s < nsplit; s++) l = fmaf(att_ml[s].y, att_w[s], l);
  const float inv = 1.f / l;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc_d = 0.f;
    for (int s0 = 0; s0 < nsplit; s0 += LOADS) {
      float v[LOADS];
#pragma unroll
      for (int i = 0; i < LOADS; i++) v[i] = s0 + i < nsplit ? part(s0 + i, d) : 0.f;
#pragma unroll
      for (int i = 0; i < LOADS; i++)
        if (s0 + i < nsplit) acc_d = fmaf(v[i], att_w[s0 + i], acc_d);
    }
    o[d] = __fmul_rn(acc_d, inv);
  }
}

// q, out: [T, heads·hd]. Committed rows: kc/vc [slots or max_len, kv_heads·hd]; staged rows
// (positions p0 + i, p0 = pos[0]): ks/vs [T, kv_heads·hd]. window 0 = full attention; ring 0 =
// full cache, else the number of ring slots (slot = pos mod ring). Grid: T·heads·grid_splits
// blocks (grid_splits ≥ every query's nsplit; extra blocks return at once). part_o
// [T·heads·grid_splits, hd], part_ml [T·heads·grid_splits] and counters [T·heads] are scratch.
//
// Fused norms (`fused`, ATT_FUSED_*): a short pass skips the `qkv_norm_rope` stage. Each block
// norms and rotates its query head (wq, inv_freq) into shared memory, and, on a layer that owns
// its cache, the staged keys of its range from the raw rows kr/vr [T, kv_heads·hd] (wk; values
// RMS-normed without weight when ATT_FUSED_VNORM). The block of each KV group's first head whose
// range ends at its own token's key writes that token's normed row to ks/vs, for the K/V commit
// and the layers that share this cache (they run later and read ks/vs with `fused` = ATT_FUSED_Q).
// Every block that needs a row computes it with the same function as `qkv_norm_rope`: same bits.
// HD > 0: the head dim at compile time; ONE: a one-token pass of one sequence (a decode step: T = 1,
// no column table). Both only fold constants: the same operations in the same order, the same bits.
template <int HD = 0, bool ONE = false>
STAGE void attention_body(const int vb, const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
          float* ks, float* vs, float* __restrict__ out, int heads,
          int kv_heads, int hd, const int* __restrict__ pos_ptr, int window, int ring, float scale, int T,
          int grid_splits, float* part_o, float2* part_ml, unsigned* counters, int split_keys, int fused,
          const float* __restrict__ wq, const float* __restrict__ wk, const float* __restrict__ inv_freq, float eps,
          const float* __restrict__ kr, const float* __restrict__ vr, const AttColumn* __restrict__ cols) {
  extern __shared__ __align__(16) float smem[];
  __shared__ int last;
  __shared__ float2 att_ml[ATT_MAX_SPLITS];  // the combine's per-split (m, Σe) and weights
  __shared__ float att_w[ATT_MAX_SPLITS];
  // The positions and the committed cache rows were written before this pass began (positions
  // upload, K/V commit): both may be read before `pdl_start()`, and the rows are pulled into L2
  // while the previous kernel finishes. Staged rows (this pass's) only after it.
  if constexpr (HD > 0) hd = HD;
  if constexpr (ONE) T = 1;
  // Split-major: the blocks with keys come first (a query's splits past its keys return at once).
  // The megakernel's blocks take virtual blocks b, b + gridDim, …, so while fewer than gridDim have
  // keys each gets at most one; query-major, a block got two or three once a pass's queries had
  // more than eight splits (264 blocks ≡ 8 mod 64 splits), and the stage waited for it.
  const int queries = T * heads;
  const int split = vb / queries, query = vb % queries;
  const int t = ONE ? 0 : query / heads, head = ONE ? query : query % heads;
  // tl: the token's index in its own sequence's pass (its staged row); raw0: that pass's first
  // row of kr/vr. A batched column is token 0 of a one-token pass whose raw row is column t.
  int p0, tl = t, raw0 = 0;
  if (!ONE && cols) {
    const AttColumn c = cols[t];
    kc = c.kc, vc = c.vc, ks = c.ks, vs = c.vs, ring = c.ring, p0 = c.pos;
    tl = 0, raw0 = t;
  } else {
    p0 = pos_ptr[0];
  }
  const int kvh = head / (heads / kv_heads);
  const int pos = p0 + tl;
  const int lo = window > 0 ? max(0, pos + 1 - window) : 0;
  const int n = pos - lo + 1;
  const int nsplit = att_splits(n, T, split_keys);
  if (split >= nsplit) return;
  const int per = (n + nsplit - 1) / nsplit;
  const int k0 = lo + split * per, nk = min(per, n - split * per);  // keys k0 .. k0 + nk
  const int kvw = kv_heads * hd;
  // Fused norms: this thread's weight pairs (`weight_pair` in common.cuh) before the wait.
  const int half = hd / 2;
  const float2 wqp = weight_pair(fused & ATT_FUSED_Q ? wq : nullptr, half);
  const float2 wkp = weight_pair(fused & ATT_FUSED_KV ? wk : nullptr, half);
  const float f = fused & ATT_FUSED_Q && inv_freq && (int)threadIdx.x < half ? inv_freq[threadIdx.x] : 0.f;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Shared memory: the query [hd], per-warp Σe·v [ATT_WARPS, hd], this pass's keys in the range
  // (positions js0 .. k0 + nk) normed from the raw rows kn/vn [ns, hd], scores [per].
  const int js0 = max(k0, p0), ns = (fused & ATT_FUSED_KV) ? max(0, k0 + nk - js0) : 0;
  float* qs = smem;
  float* part = qs + hd;
  float* kn = part + ATT_WARPS * hd;
  float* vn = kn + ns * hd;
  float* scores = vn + ns * hd;
  // The range's committed keys come first (positions before p0): rows of the cache. A ring's
  // slots of keys k0 + jj: from k0's slot, wrapping once at most (the committed keys of a window
  // are at most `ring`), without a division per key.
  const int committed = max(0, min(k0 + nk, p0) - k0);
  const int slot0 = ring > 0 ? k0 % ring : k0;
  auto cached_row = [&](const float* cache, int jj) {
    const int s = slot0 + jj;
    return cache + (u64)(ring > 0 && s >= ring ? s - ring : s) * kvw + kvh * hd;
  };
  {
    // Every committed key and value row asked of L2 before the wait.
    const int lines = (hd + 31) / 32;  // 128-byte lines per head row
    for (int i = threadIdx.x; i < 2 * committed * lines; i += blockDim.x) {
      const int r = (i / lines) % committed, l = i % lines;
      prefetch_l2(cached_row(i < committed * lines ? kc : vc, r) + l * 32);
    }
  }
  pdl_start();
  const float* qrow = q + ((u64)t * heads + head) * hd;
  if (fused & ATT_FUSED_Q) {
    // The query and the range's staged keys and values, normed and rotated into shared memory:
    // one block reduction for the query and the first key and value, one per further key.
    float2 x = head_pair(qrow, half);
    for (int i = 0; i == 0 || i < ns; i++) {
      const u64 raw = (u64)(js0 + i - p0 + raw0) * kvw + kvh * hd;
      const float2 kx = i < ns ? head_pair(kr + raw, half) : make_float2(0.f, 0.f);
      const float2 vx = i < ns ? head_pair(vr + raw, half) : make_float2(0.f, 0.f);
      stat_t sx = pair_sq(x), sk = pair_sq(kx), sv = pair_sq(vx);
      block_sum_stat3(sx, sk, sv);
      if (i == 0) store_pair(qs, half, norm_rope_pair(x, rms_scale(sx, hd, eps), wq != nullptr, wqp, f, pos));
      if (i < ns) {
        store_pair(kn + i * hd, half, norm_rope_pair(kx, rms_scale(sk, hd, eps), wk != nullptr, wkp, f, js0 + i));
        const bool vnorm = fused & ATT_FUSED_VNORM;
        store_pair(vn + i * hd, half,
                   vnorm ? norm_rope_pair(vx, rms_scale(sv, hd, eps), false, wkp, 0.f, 0) : vx);
      }
      x = make_float2(0.f, 0.f);
    }
  } else {
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = qrow[d];
  }
  __syncthreads();
  if (ns > 0 && head % (heads / kv_heads) == 0 && split == nsplit - 1) {
    // The range ends at this token's own key (position pos): its row goes to the staging.
    const u64 row = (u64)tl * kvw + kvh * hd;
    const int i = pos - js0;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      ks[row + d] = kn[i * hd + d];
      vs[row + d] = vn[i * hd + d];
    }
  }

  // Scores: one warp per key, lanes over the head dim in 16-byte loads (lane: dims 4·lane + 128·i,
  // as Σe·v below; a quarter of the 4-byte form's load instructions: an 8k context's E4B token
  // −2.7% in the graph, −10% in the megakernel, twenty-second session). Key row jj: committed (in
  // the cache), normed here or staged.
  auto score = [&](int jj, const float* k) {
    float s = 0.f;
#pragma unroll
    for (int d = 4 * lane; d < hd; d += 128) {
      const float4 x = *(const float4*)(k + d), y = *(const float4*)(qs + d);
      s = fmaf(y.w, x.w, fmaf(y.z, x.z, fmaf(y.y, x.y, fmaf(y.x, x.x, s))));
    }
    s = warp_sum(s);
    if (lane == 0) scores[jj] = __fmul_rn(s, scale);
  };
  auto direct = [&](const float* cache, const float* normed, const float* staged, int jj) {
    const int j = k0 + jj;
    return j < p0 ? cached_row(cache, jj) : ns > 0 ? normed + (j - js0) * hd : staged + (u64)(j - p0) * kvw + kvh * hd;
  };
#pragma unroll 4
  for (int jj = warp; jj < nk; jj += ATT_WARPS) score(jj, direct(kc, kn, ks, jj));
  __syncthreads();
  float mx = NEG_INF;
  for (int jj = threadIdx.x; jj < nk; jj += blockDim.x) mx = fmaxf(mx, scores[jj]);
  mx = block_max(mx);
  float sum = 0.f;
  for (int jj = threadIdx.x; jj < nk; jj += blockDim.x) {
    const float e = expf(scores[jj] - mx);
    scores[jj] = e;
    sum += e;
  }
  sum = block_sum(sum);
  __syncthreads();

  // Weighted values Σ e·v: warp w takes keys w, w + ATT_WARPS, … (in that order); a lane holds
  // dims 4·lane + 128·i (16-byte loads; which lane holds a dim changes no sum).
  float4 acc[ATT_MAX_DPL / 4];
#pragma unroll
  for (int i = 0; i < ATT_MAX_DPL / 4; i++) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  auto accumulate = [&](int jj, const float* v) {
    const float e = scores[jj];
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL / 4; i++) {
      const int d = 4 * lane + 128 * i;
      if (d < hd) {
        const float4 x = *(const float4*)(v + d);
        acc[i] = make_float4(fmaf(e, x.x, acc[i].x), fmaf(e, x.y, acc[i].y), fmaf(e, x.z, acc[i].z),
                             fmaf(e, x.w, acc[i].w));
      }
    }
  };
#pragma unroll 2
  for (int jj = warp; jj < nk; jj += ATT_WARPS) accumulate(jj, direct(vc, vn, vs, jj));
#pragma unroll
  for (int i = 0; i < ATT_MAX_DPL / 4; i++) {
    const int d = 4 * lane + 128 * i;
    if (d < hd) *(float4*)(part + warp * hd + d) = acc[i];
  }
  __syncthreads();
  float* o = out + ((u64)t * heads + head) * hd;
  if (nsplit == 1) {
    const float inv = 1.f / sum;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
      float s = 0.f;
      for (int w = 0; w < ATT_WARPS; w++) s += part[w * hd + d];
      o[d] = __fmul_rn(s, inv);
    }
    return;
  }
  // Several splits: publish this one's (m, Σe, Σe·v); the last to arrive combines all in order.
  const u64 slot = (u64)query * grid_splits + split;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < ATT_WARPS; w++) s += part[w * hd + d];
    part_o[slot * hd + d] = s;
  }
  if (threadIdx.x == 0) part_ml[slot] = make_float2(mx, sum);
  if (!last_to_arrive(&counters[query], nsplit, last)) return;
  const u64 first = (u64)query * grid_splits;
  att_combine<ONE ? ATT_COMBINE_LOADS : 8>(nsplit, hd, o, att_ml, att_w, [&](int s) { return __ldcg(&part_ml[first + s]); },
              [&](int s, int d) { return __ldcg(&part_o[(first + s) * hd + d]); });
  if (threadIdx.x == 0) counters[query] = 0u;
}
// Entries: `attention` for every pass; `attention_1_256` / `attention_1_512` for decode steps — one
// token of one sequence, the head dim at compile time (MEGAGEMMA_CUDA_ATT_ONE=0: the general entry
// instead; same bits).
#define ATT_ENTRY(NAME, HD, ONE)                                                                                   \
  extern "C" __global__ void __launch_bounds__(ATT_WARPS * 32, ATT_MIN_BLOCKS) NAME(                               \
      const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc, float* ks,          \
      float* vs, float* __restrict__ out, int heads, int kv_heads, int hd, const int* __restrict__ pos_ptr,        \
      int window, int ring, float scale, int T, int grid_splits, float* part_o, float2* part_ml,                  \
      unsigned* counters, int split_keys, int fused, const float* __restrict__ wq, const float* __restrict__ wk,   \
      const float* __restrict__ inv_freq, float eps, const float* __restrict__ kr, const float* __restrict__ vr,  \
      const AttColumn* __restrict__ cols) {                                                                        \
    attention_body<HD, ONE>(blockIdx.x, q, kc, vc, ks, vs, out, heads, kv_heads, hd, pos_ptr, window, ring, scale, \
                            T, grid_splits, part_o, part_ml, counters, split_keys, fused, wq, wk, inv_freq, eps,   \
                            kr, vr, cols);                                                                         \
  }
ATT_ENTRY(attention, 0, false)
#ifndef MEGAKERNEL
ATT_ENTRY(attention_1_256, 256, true)
ATT_ENTRY(attention_1_512, 512, true)
#endif
