// The MTP assistant's centroid head (spec §6.4) on the device: the `top_k` best centroids, the
// head's logits of just their member tokens, the best of those. The reference is
// `centroid_scores` and `greedy_token` in crates/megagemma-model/src/assistant/draft.rs; `gpu_check
// drafts` compares whole draft rounds of both. (The assistant's other stages are the target's
// stage kernels; a dense head is the target's matvec and argmax.)
#include "common.cuh"

#define MAX_CENTROIDS 4096  // 32 KB of sort keys

// The member tokens of the `top_k` best of `n` centroid logits, in the order of the reference's
// stable sort by `total_cmp` (higher first; among equal logits the lower centroid index): the
// logits as sortable keys (`rank_key`) in a bitonic sort of shared memory, then the whole block
// copies the first `top_k` centroids' `per` token ids each (`ordering`, centroid by centroid) to
// ids[r·per ..], coalesced. (Counting each
// centroid's rank against all others took 240 µs a round on the H200: most warps hold a top
// centroid and scan all 2048.) One block of 1024 threads; n ≤ MAX_CENTROIDS.
extern "C" __global__ void centroid_candidates(const float* __restrict__ logits, int n, int top_k,
                                               const unsigned* __restrict__ ordering, int per,
                                               unsigned* __restrict__ ids) {
  __shared__ u64 key[MAX_CENTROIDS];
  pdl_start();
  int size = 1;
  while (size < n) size <<= 1;
  for (int i = threadIdx.x; i < size; i += blockDim.x) {
    u64 k = 0;  // padding sorts last
    if (i < n) k = rank_key(logits[i], i);
    key[i] = k;
  }
  __syncthreads();
  bitonic_sort_desc(key, size);
  for (int i = threadIdx.x; i < top_k * per; i += blockDim.x) {
    const int r = i / per, m = i - r * per;
    const int c = (int)~(unsigned)key[r];
    ids[i] = ordering[(u64)c * per + m];
  }
}

// scores[i] = row ids[i] of H · x, for n rows of a row-major matrix (any format `mat_elem`
// reads): one warp a row, f32 sums.
extern "C" __global__ void rows_dot(Mat H, const unsigned* __restrict__ ids, int n, const float* __restrict__ x,
                                    float* __restrict__ scores) {
  pdl_start();
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (row >= n) return;
  const u64 r = ids[row];
  float acc = 0.f;
  for (int c = lane; c < H.cols; c += 32) acc = fmaf(mat_elem(H, r, c), x[c], acc);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) scores[row] = acc;
}

// out[0] = the token id of the best of n (scores[i], ids[i]): the highest score and, among equal
// scores, the lowest token id (what an argmax over full logits gives). One block of 256.
extern "C" __global__ void argmax_ids(const float* __restrict__ scores, const unsigned* __restrict__ ids, int n,
                                      unsigned* out) {
  pdl_start();
  float best = NEG_INF;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    if (better(scores[i], (int)ids[i], best, bi)) best = scores[i], bi = (int)ids[i];
  warp_argmax(best, bi);
  __shared__ float sv[32];
  __shared__ int si[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = best, si[warp] = bi;
  __syncthreads();
  if (warp == 0) {
    best = lane < (int)(blockDim.x >> 5) ? sv[lane] : NEG_INF;
    bi = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
    warp_argmax(best, bi);
    if (lane == 0) out[0] = (unsigned)bi;
  }
}
