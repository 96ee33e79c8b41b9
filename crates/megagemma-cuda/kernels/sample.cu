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

// out[row·k + r] = the r-th best of row `row`'s `count` ≤ CAND_BLOCK keys (keys + row·count), for
// r < k. Grid (1, rows), 1024 threads.
extern "C" __global__ void top_candidates_merge(const u64* __restrict__ keys, int count, int k, u64* __restrict__ out) {
  __shared__ u64 key[CAND_BLOCK];
  const u64* row = keys + (u64)blockIdx.y * count;
  int size = 1;
  while (size < count) size <<= 1;
  for (int i = threadIdx.x; i < size; i += blockDim.x) key[i] = i < count ? row[i] : 0;
  __syncthreads();
  bitonic_sort_desc(key, size);
  for (int r = threadIdx.x; r < k; r += blockDim.x) out[(u64)blockIdx.y * k + r] = key[r];
}
