// The highest logits of a row for top-k sampling (`Want::Candidates`): the k best (token, logit)
// pairs without copying the vocabulary to the host. The reference is `top_candidates` in
// crates/megagemma-model/src/backend.rs (the order `f32::total_cmp` gives, then the lower token;
// NaN and −∞ never listed); the GPU test `candidates_equal_the_host_selection` compares them.
//
// Two launches for all rows of a pass (row = blockIdx.y): each block sorts the keys (`rank_key`) of
// CAND_BLOCK logits in shared memory and keeps its k best (`top_candidates_blocks`), then one block
// per row sorts those blocks' survivors and keeps the k best of all (`top_candidates_merge`). NaN
// and −∞ get key 0, the padding, which sorts last and is never a real key.
#include "common.cuh"

#define CAND_BLOCK 4096  // logits a block sorts (32 KB of keys); also the merge's most keys

// keys[(row·gridDim.x + b)·k + r] = the r-th best key of logits [b·CAND_BLOCK, (b + 1)·CAND_BLOCK)
// of row `row` of n (0 past its end). Grid (⌈n / CAND_BLOCK⌉, rows), 1024 threads.
extern "C" __global__ void top_candidates_blocks(const float* __restrict__ logits, int n, int k, u64* __restrict__ keys) {
  __shared__ u64 key[CAND_BLOCK];
  const float* row = logits + (u64)blockIdx.y * n;
  const int base = blockIdx.x * CAND_BLOCK;
  for (int i = threadIdx.x; i < CAND_BLOCK; i += blockDim.x) {
    const int t = base + i;
    const float v = t < n ? row[t] : NEG_INF;
    key[i] = isnan(v) || v == NEG_INF ? 0 : rank_key(v, (unsigned)t);
  }
  __syncthreads();
  bitonic_sort_desc(key, CAND_BLOCK);
  for (int r = threadIdx.x; r < k; r += blockDim.x) keys[((u64)blockIdx.y * gridDim.x + blockIdx.x) * k + r] = key[r];
}

// `count` ≤ CAND_BLOCK keys of `row` sorted into `key`, best first (the block's threads).
__device__ __forceinline__ void merge_keys(const u64* row, int count, u64* key) {
  int size = 1;
  while (size < count) size <<= 1;
  for (int i = threadIdx.x; i < size; i += blockDim.x) key[i] = i < count ? row[i] : 0;
  __syncthreads();
  bitonic_sort_desc(key, size);
}

// out[row·k + r] = the r-th best of row `row`'s `count` ≤ CAND_BLOCK keys (keys + row·count), for
// r < k. Grid (1, rows), 1024 threads.
extern "C" __global__ void top_candidates_merge(const u64* __restrict__ keys, int count, int k, u64* __restrict__ out) {
  __shared__ u64 key[CAND_BLOCK];
  merge_keys(keys + (u64)blockIdx.y * count, count, key);
  for (int r = threadIdx.x; r < k; r += blockDim.x) out[(u64)blockIdx.y * k + r] = key[r];
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
  __shared__ u64 key[CAND_BLOCK];
  __shared__ double w[64];
  merge_keys(keys, count, key);
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
