// The highest logits of a row for top-k sampling (`Want::Candidates`): the k best (token, logit)
// pairs without copying the vocabulary to the host. The reference is `top_candidates` in
// crates/megagemma-model/src/backend.rs (the order `f32::total_cmp` gives, then the lower token;
// NaN and −∞ never listed); the GPU tests `candidates_equal_the_host_selection` (fixtures, crafted
// rows) and `wide_rows_select_and_draw_as_the_host` (262,144-wide rows) compare them.
//
// Two launches for all rows of a pass (row = blockIdx.y): each block keeps the TOP best keys
// (`rank_key`) of CAND_BLOCK logits and writes its k best (`top_candidates_blocks`), then one block
// per row merges those blocks' lists and keeps the k best of all (`top_candidates_merge`; also the
// first half of `sample_draw`). NaN and −∞ get key 0, the padding, which sorts last and is never a
// real key. Keys are unique (the token is in the low half), so any exact selection gives the host's.
//
// A list of TOP keys lives in one warp's registers, element j·32 + lane in v[j], best first; sorting
// and merging are bitonic networks over shuffles (a warp's 64 keys sort in 21 exchange steps, two
// sorted lists merge into their best 64 in 7), and a block's 32 lists merge in a tree through shared
// memory (5 rounds): a few µs a row, where sorting all 4,096 keys of a block in shared memory took 78
// barrier-separated steps.
#include "common.cuh"

#define CAND_BLOCK 4096  // logits a block of `top_candidates_blocks` takes: 128 a warp of 1,024 threads
#define TOP 64           // keys a list keeps (MAX_CANDIDATES in src/candidates.rs)
#define CAND_WARPS 32    // warps of every selection block (1,024 threads; a power of two)

// Exchange step of a bitonic network between element e = j·32 + lane and e ^ stride (stride < 32:
// another lane): the pair's lower element keeps the larger key where the block of e is descending.
__device__ __forceinline__ u64 exchange_lanes(u64 v, int stride, bool desc) {
  const u64 o = __shfl_xor_sync(0xffffffffu, v, stride);
  const bool lower = (threadIdx.x & stride) == 0;
  return lower == desc ? (v > o ? v : o) : (v < o ? v : o);
}

// The warp's 64 keys (v[0], v[1]) sorted best first.
__device__ __forceinline__ void warp_sort64(u64 v[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int size = 2; size <= 2 * 32; size <<= 1) {
#pragma unroll
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      if (stride == 32) {  // size 64: element lane against lane + 32, both in this lane
        const u64 hi = v[0] > v[1] ? v[0] : v[1];
        v[1] = v[0] > v[1] ? v[1] : v[0];
        v[0] = hi;
        continue;
      }
#pragma unroll
      for (int j = 0; j < 2; j++) v[j] = exchange_lanes(v[j], stride, ((j * 32 + lane) & size) == 0);
    }
  }
}

// The best 64 of the warp's sorted list v and another sorted list w, into v best first; the caller
// gives w reversed: rev0 = w[63 − lane], rev1 = w[31 − lane]. max(v[e], w[63 − e]) holds the 64
// largest of both as a bitonic sequence, which one bitonic merge sorts.
__device__ __forceinline__ void warp_merge64(u64 v[2], u64 rev0, u64 rev1) {
  v[0] = v[0] > rev0 ? v[0] : rev0;
  v[1] = v[1] > rev1 ? v[1] : rev1;
  const u64 hi = v[0] > v[1] ? v[0] : v[1];
  v[1] = v[0] > v[1] ? v[1] : v[0];
  v[0] = hi;
#pragma unroll
  for (int stride = 16; stride > 0; stride >>= 1)
#pragma unroll
    for (int j = 0; j < 2; j++) v[j] = exchange_lanes(v[j], stride, true);
}

// The best TOP keys of the block's warps' lists (each warp's v), best first in lists[0, TOP);
// `lists` is shared, CAND_WARPS · TOP keys. Every thread of the block calls it.
__device__ __forceinline__ void block_top(u64 v[2], u64* lists) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  lists[warp * TOP + lane] = v[0];
  lists[warp * TOP + 32 + lane] = v[1];
  __syncthreads();
  // Round by round the lower half of the warps merge in the upper half's lists; a warp writes only
  // its own slot, which no warp reads in that round.
  for (int half = CAND_WARPS / 2; half > 0; half >>= 1) {
    if (warp < half) {
      const u64* w = lists + (warp + half) * TOP;
      warp_merge64(v, w[63 - lane], w[31 - lane]);
      lists[warp * TOP + lane] = v[0];
      lists[warp * TOP + 32 + lane] = v[1];
    }
    __syncthreads();
  }
}

// keys[(row·gridDim.x + b)·k + r] = the r-th best key of logits [b·CAND_BLOCK, (b + 1)·CAND_BLOCK)
// of row `row` of n (0 past its end), for r < k ≤ TOP. Grid (⌈n / CAND_BLOCK⌉, rows), 1024 threads.
extern "C" __global__ void top_candidates_blocks(const float* __restrict__ logits, int n, int k, u64* __restrict__ keys) {
  __shared__ u64 lists[CAND_WARPS * TOP];
  const float* row = logits + (u64)blockIdx.y * n;
  const int lane = threadIdx.x & 31;
  const int base = blockIdx.x * CAND_BLOCK + (threadIdx.x >> 5) * 128;
  u64 v[4];
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const int t = base + j * 32 + lane;
    const float x = t < n ? row[t] : NEG_INF;
    v[j] = isnan(x) || x == NEG_INF ? 0 : rank_key(x, (unsigned)t);
  }
  // The warp's 128 keys as two sorted lists of 64, merged (the second reversed across lanes).
  warp_sort64(v);
  warp_sort64(v + 2);
  warp_merge64(v, __shfl_sync(0xffffffffu, v[3], 31 - lane), __shfl_sync(0xffffffffu, v[2], 31 - lane));
  block_top(v, lists);
  for (int r = threadIdx.x; r < k; r += blockDim.x) keys[((u64)blockIdx.y * gridDim.x + blockIdx.x) * k + r] = lists[r];
}

// The best TOP of `count` keys that are sorted lists of k ≤ TOP keys each (list i at row + i·k),
// best first in lists[0, TOP) (shared, CAND_WARPS · TOP keys): the warps take the lists in turn, each
// padded with key 0 to TOP, then merge their own. Every thread of the block calls it.
__device__ __forceinline__ void merge_keys(const u64* row, int count, int k, u64* lists) {
  const int lane = threadIdx.x & 31;
  u64 v[2] = {0, 0};
  for (int i = threadIdx.x >> 5; i < count / k; i += CAND_WARPS) {
    const u64* w = row + (u64)i * k;
    warp_merge64(v, 63 - lane < k ? w[63 - lane] : 0, 31 - lane < k ? w[31 - lane] : 0);
  }
  block_top(v, lists);
}

// out[row·k + r] = the r-th best of row `row`'s `count` keys (keys + row·count: the lists of k that
// `top_candidates_blocks` wrote), for r < k. Grid (1, rows), 1024 threads.
extern "C" __global__ void top_candidates_merge(const u64* __restrict__ keys, int count, int k, u64* __restrict__ out) {
  __shared__ u64 lists[CAND_WARPS * TOP];
  merge_keys(keys + (u64)blockIdx.y * count, count, k, lists);
  for (int r = threadIdx.x; r < k; r += blockDim.x) out[(u64)blockIdx.y * k + r] = lists[r];
}

// e^x for x ≤ 0 with the bits of `exp_det` in crates/megagemma-model/src/draw.rs: the same IEEE
// operations in the same order (every product and sum written out, so none is contracted).
__device__ __forceinline__ double exp_det(double x) {
  const double inv_fact[12] = {1.6059043836821613e-10, 2.08767569878681e-9, 2.505210838544172e-8,
                               2.755731922398589e-7,   2.7557319223985893e-6, 2.48015873015873e-5,
                               1.984126984126984e-4,   1.388888888888889e-3, 8.333333333333333e-3,
                               4.1666666666666664e-2,  1.6666666666666666e-1, 0.5};
  if (isnan(x)) return x;
  if (x < -746.0) return 0.0;
  if (x > 0.0) return __longlong_as_double(0x7ff0000000000000ll);
  const double k = rint(__dmul_rn(x, 1.4426950408889634));
  double r = fma(-k, 0.6931471803691238, x);
  r = fma(-k, 1.9082149292705877e-10, r);
  double p = inv_fact[0];
#pragma unroll
  for (int i = 1; i < 12; i++) p = fma(p, r, inv_fact[i]);
  p = fma(p, r, 1.0);
  p = fma(p, r, 1.0);
  // 2^k in two exact factors below the normal range, so a subnormal result rounds once.
  const long long ki = (long long)k;
  const bool two = ki < -1022;
  const double y = __dmul_rn(p, __longlong_as_double((ki + (two ? 200 : 0) + 1023) << 52));
  return two ? __dmul_rn(y, __longlong_as_double((long long)(-200 + 1023) << 52)) : y;
}

// The token of a sampled decode step (`CudaSeq::decode_sampled`): the step's `count` block
// survivors merged as `top_candidates_merge` merges them, then drawn with the uniform of the
// step's position (uniforms[meta[0]]) exactly as `draw_candidates` in
// crates/megagemma-model/src/draw.rs draws (top-k, weights at the temperature, top-p, min-p, the
// walk), into ids[0], where the step's commit hands it to the next step and the host. A row
// without a finite logit sets *flag and continues with token 0. One block of 1024 threads.
extern "C" __global__ void sample_draw(const u64* __restrict__ keys, int count, int k, float temperature, float top_p,
                                       float min_p, const double* __restrict__ uniforms,
                                       const unsigned* __restrict__ meta, unsigned* ids, unsigned* flag) {
  __shared__ u64 key[CAND_WARPS * TOP];
  __shared__ double w[TOP];
  merge_keys(keys, count, k, key);
  // The listed candidates come first (key 0: NaN, −∞ or padding); k ≤ 64.
  const int r = threadIdx.x;
  const u64 kr = r < k ? key[r] : 0;
  const unsigned order = (unsigned)(kr >> 32);
  const float logit = __uint_as_float(order & 0x80000000u ? order & 0x7fffffffu : ~order);
  const float best = __uint_as_float((unsigned)(key[0] >> 32) & 0x80000000u ? (unsigned)(key[0] >> 32) & 0x7fffffffu
                                                                               : ~(unsigned)(key[0] >> 32));
  if (r < k && kr != 0) {
    const double inv_t = __ddiv_rn(1.0, (double)temperature);
    w[r] = exp_det(__dmul_rn(__dsub_rn((double)logit, (double)best), inv_t));
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  int n = 0;
  while (n < k && key[n] != 0) n++;
  if (n == 0) {
    *flag = 1u;
    ids[0] = 0u;
    return;
  }
  const unsigned first = ~(unsigned)key[0];
  if (best == __int_as_float(0x7f800000)) {
    ids[0] = first;
    return;
  }
  // Top-p: the shortest prefix whose weight reaches top_p of the whole.
  int keep = n;
  if (top_p < 1.f) {
    double total = 0.0, cumulative = 0.0;
    for (int i = 0; i < n; i++) total = __dadd_rn(total, w[i]);
    const double target = __dmul_rn((double)top_p, total);
    for (int i = 0; i < n; i++) {
      cumulative = __dadd_rn(cumulative, w[i]);
      if (cumulative >= target) {
        keep = i + 1;
        break;
      }
    }
  }
  // Min-p, then the walk over what is left, in order.
  auto kept = [&](int i) { return min_p <= 0.f || w[i] >= (double)min_p; };
  double total = 0.0;
  int last = 0;
  for (int i = 0; i < keep; i++)
    if (kept(i)) total = __dadd_rn(total, w[i]), last = i;
  double remaining = __dmul_rn(uniforms[meta[0]], total);
  for (int i = 0; i < keep; i++) {
    if (!kept(i)) continue;
    if (remaining < w[i]) {
      ids[0] = ~(unsigned)key[i];
      return;
    }
    remaining = __dsub_rn(remaining, w[i]);
  }
  ids[0] = ~(unsigned)key[last];
}

// y[i] = exp_det(x[i]): the GPU test compares these bits with the host's `exp_det`.
extern "C" __global__ void exp_det_values(const double* __restrict__ x, double* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = exp_det(x[i]);
}
