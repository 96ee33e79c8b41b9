// Scaled dot-product attention for each (token, query head), keys in chronological order: the
// committed cache (inside the window) followed by this pass's staged rows up to the query.
// One block per (token, head). Dynamic shared memory: q (hd floats), one score per key, and one
// partial output row per warp. Every reduction runs in a fixed order that depends only on the
// query's position, never on how many tokens share the pass.
#include "common.cuh"

#define ATT_MAX_DPL 16  // dims per lane: head dims up to 512

// q, out: [T, heads·hd]. Committed rows: kc/vc [slots or max_len, kv_heads·hd]; staged rows
// (positions p0 + i, p0 = pos[0]): ks/vs [T, kv_heads·hd]. window 0 = full attention; ring 0 =
// full cache, else the number of ring slots (slot = pos mod ring).
extern "C" __global__ void __launch_bounds__(1024)
attention(const float* __restrict__ q, const float* __restrict__ kc, const float* __restrict__ vc,
          const float* __restrict__ ks, const float* __restrict__ vs, float* __restrict__ out, int heads,
          int kv_heads, int hd, const int* __restrict__ pos_ptr, int window, int ring, float scale) {
  extern __shared__ float smem[];
  // The positions and the committed cache rows were written before this pass began (positions
  // upload, K/V commit): both may be read before `pdl_start()`, and the rows are pulled into L2
  // while the previous kernel finishes. Staged rows (this pass's) only after it.
  int p0 = pos_ptr[0];
  int t = blockIdx.x / heads, head = blockIdx.x % heads;
  int kvh = head / (heads / kv_heads);
  int pos = p0 + t;
  int lo = window > 0 ? max(0, pos + 1 - window) : 0;
  int n = pos - lo + 1;
  int kvw = kv_heads * hd;
  {
    const int lines = (hd + 31) / 32;  // 128-byte lines per head row
    const int committed = max(0, p0 - lo);
    for (int i = threadIdx.x; i < 2 * committed * lines; i += blockDim.x) {
      const int j = lo + (i / lines) % committed, l = i % lines;
      const float* base = i < committed * lines ? kc : vc;
      prefetch_l2(base + (u64)(ring > 0 ? j % ring : j) * kvw + kvh * hd + l * 32);
    }
  }
  pdl_start();
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  float* qs = smem;
  float* scores = smem + hd;
  float* part = scores + n;  // [nw, hd]
  for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = q[((u64)t * heads + head) * hd + d];
  __syncthreads();

  // Scores: one warp per key, lanes over the head dim (unrolled so several keys' loads overlap).
#pragma unroll 4
  for (int jj = warp; jj < n; jj += nw) {
    int j = lo + jj;
    const float* k = (j < p0 ? kc + (u64)(ring > 0 ? j % ring : j) * kvw : ks + (u64)(j - p0) * kvw) + kvh * hd;
    float s = 0.f;
#pragma unroll 4
    for (int d = lane; d < hd; d += 32) s = fmaf(qs[d], k[d], s);
    s = warp_sum(s);
    if (lane == 0) scores[jj] = __fmul_rn(s, scale);
  }
  __syncthreads();
  float mx = NEG_INF;
  for (int jj = threadIdx.x; jj < n; jj += blockDim.x) mx = fmaxf(mx, scores[jj]);
  mx = block_max(mx);
  float sum = 0.f;
  for (int jj = threadIdx.x; jj < n; jj += blockDim.x) {
    float e = expf(scores[jj] - mx);
    scores[jj] = e;
    sum += e;
  }
  sum = block_sum(sum);
  float inv = 1.f / sum;
  __syncthreads();

  // Weighted values: warp w takes keys w, w + nw, …; lane holds dims lane + 32·i.
  float acc[ATT_MAX_DPL];
#pragma unroll
  for (int i = 0; i < ATT_MAX_DPL; i++) acc[i] = 0.f;
#pragma unroll 2
  for (int jj = warp; jj < n; jj += nw) {
    int j = lo + jj;
    const float* v = (j < p0 ? vc + (u64)(ring > 0 ? j % ring : j) * kvw : vs + (u64)(j - p0) * kvw) + kvh * hd;
    float p = __fmul_rn(scores[jj], inv);
#pragma unroll
    for (int i = 0; i < ATT_MAX_DPL; i++) {
      int d = lane + 32 * i;
      if (d < hd) acc[i] = fmaf(p, v[d], acc[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < ATT_MAX_DPL; i++) {
    int d = lane + 32 * i;
    if (d < hd) part[warp * hd + d] = acc[i];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < nw; w++) o += part[w * hd + d];
    out[((u64)t * heads + head) * hd + d] = o;
  }
}
