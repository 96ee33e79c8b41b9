// Scaled dot-product attention for each (token, query head), keys in chronological order: the
// committed cache (inside the window) followed by this pass's staged rows up to the query.
// One block per (token, head); scores live in dynamic shared memory (one float per key).
#include "common.cuh"

// q, out: [T, heads·hd]. Committed rows: kc/vc [slots or max_len, kv_heads·hd]; staged rows
// (positions p0 + i, p0 = pos[0]): ks/vs [T, kv_heads·hd]. window 0 = full attention; ring 0 = full cache,
// else the number of ring slots (slot = pos mod ring).
extern "C" __global__ void attention(const float* __restrict__ q, const float* __restrict__ kc,
                                     const float* __restrict__ vc, const float* __restrict__ ks,
                                     const float* __restrict__ vs, float* __restrict__ out, int heads, int kv_heads,
                                     int hd, const int* __restrict__ pos_ptr, int window, int ring,
                                     float scale) {
  extern __shared__ float scores[];
  int p0 = pos_ptr[0];
  int t = blockIdx.x / heads, head = blockIdx.x % heads;
  int kvh = head / (heads / kv_heads);
  int pos = p0 + t;
  int lo = window > 0 ? max(0, pos + 1 - window) : 0;
  int n = pos - lo + 1;
  int kvw = kv_heads * hd;
  const float* qv = q + ((u64)t * heads + head) * hd;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int jj = warp; jj < n; jj += nw) {
    int j = lo + jj;
    const float* k = j < p0 ? kc + (u64)(ring > 0 ? j % ring : j) * kvw : ks + (u64)(j - p0) * kvw;
    k += kvh * hd;
    float s = 0.f;
    for (int d = lane; d < hd; d += 32) s = fmaf(qv[d], k[d], s);
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
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float o = 0.f;
    for (int jj = 0; jj < n; jj++) {
      int j = lo + jj;
      const float* v = j < p0 ? vc + (u64)(ring > 0 ? j % ring : j) * kvw : vs + (u64)(j - p0) * kvw;
      o = fmaf(__fmul_rn(scores[jj], inv), v[kvh * hd + d], o);
    }
    out[((u64)t * heads + head) * hd + d] = o;
  }
}
