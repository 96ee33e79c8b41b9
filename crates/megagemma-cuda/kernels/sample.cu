// The highest logits of a row for top-k sampling (`Want::Candidates`): the k best (token, logit)
// pairs without copying the vocabulary to the host. The reference is `top_candidates` in
// crates/megagemma-model/src/backend.rs (the order `f32::total_cmp` gives, then the lower token;
// NaN and −∞ never listed); the GPU test `candidates_equal_the_host_selection` compares them.
//
// Two launches: each block sorts the keys of CAND_BLOCK logits in shared memory and keeps its k
// best (`top_candidates_blocks`), then one block sorts those blocks' survivors and keeps the k best
// of all (`top_candidates_merge`). A key holds the logit's total order in its high word and the
// complement of the token id below, so one descending sort orders by logit and then by the lower
// token; NaN and −∞ get key 0 (never a real key: its high word would be a NaN's) and sort last.
#include "common.cuh"

#define CAND_BLOCK 4096  // logits a block sorts (32 KB of keys); also the merge's most keys

__device__ __forceinline__ u64 candidate_key(float v, unsigned token) {
  if (isnan(v) || v == NEG_INF) return 0;
  return ((u64)total_order(v) << 32) | (0xffffffffu - token);
}

// keys[b·k + r] = the r-th best key of logits [b·CAND_BLOCK, (b + 1)·CAND_BLOCK) of the row (0
// past its end). One block of 1024 threads per CAND_BLOCK logits.
extern "C" __global__ void top_candidates_blocks(const float* __restrict__ logits, int n, int k, u64* __restrict__ keys) {
  __shared__ u64 key[CAND_BLOCK];
  const int base = blockIdx.x * CAND_BLOCK;
  for (int i = threadIdx.x; i < CAND_BLOCK; i += blockDim.x)
    key[i] = base + i < n ? candidate_key(logits[base + i], (unsigned)(base + i)) : 0;
  __syncthreads();
  bitonic_sort_desc(key, CAND_BLOCK);
  for (int r = threadIdx.x; r < k; r += blockDim.x) keys[(u64)blockIdx.x * k + r] = key[r];
}

// out[r] = the r-th best of `count` ≤ CAND_BLOCK keys, for r < k. One block of 1024 threads.
extern "C" __global__ void top_candidates_merge(const u64* __restrict__ keys, int count, int k, u64* __restrict__ out) {
  __shared__ u64 key[CAND_BLOCK];
  int size = 1;
  while (size < count) size <<= 1;
  for (int i = threadIdx.x; i < size; i += blockDim.x) key[i] = i < count ? keys[i] : 0;
  __syncthreads();
  bitonic_sort_desc(key, size);
  for (int r = threadIdx.x; r < k; r += blockDim.x) out[r] = key[r];
}
