// Per-row and elementwise stages of a layer: embedding, norms, RoPE, activations, residual
// updates, PLE inputs, MoE routing, KV commit, softcap + argmax. Activations are f32 [T, width].
#include "common.cuh"

// The token t and element c of this thread in a row gather over rows of `cols`: one element per
// thread, ⌈cols / blockDim⌉ blocks per token (`gather_blocks` on the host).
struct RowElement {
  int t, c;
};
__device__ __forceinline__ RowElement row_element(int vb, int cols) {
  const int per_token = (cols + blockDim.x - 1) / blockDim.x;
  const int t = vb / per_token;
  return RowElement{t, (vb - t * per_token) * (int)blockDim.x + (int)threadIdx.x};
}

// x[t] = embed[tokens[t]] · scale, a row gather (one block walking the row was 5.5 µs of a step).
STAGE void embed_gather_body(const int vb, Mat E, const unsigned* __restrict__ tokens, float* __restrict__ x, float scale) {
  pdl_start();
  const RowElement e = row_element(vb, E.cols);
  if (e.c >= E.cols) return;
  x[(u64)e.t * E.cols + e.c] = __fmul_rn(mat_elem(E, tokens[e.t], e.c), scale);
}
extern "C" __global__ void embed_gather(Mat E, const unsigned* __restrict__ tokens, float* __restrict__ x, float scale) { embed_gather_body(blockIdx.x, E, tokens, x, scale); }

// RMSNorm of each `dim`-wide chunk (one block per chunk): n = x̂·w (w may be null).
// mode 0: y = n; mode 1: y += n (residual add). The mean square is accumulated in `stat_t` (common.cuh).
STAGE void rms_norm_body(const int vb, float* y, const float* x, const float* __restrict__ w, int dim, float eps,
                                    int mode) {
  pdl_start();
  u64 base = (u64)vb * dim;
  float r = inv_rms(x + base, dim, eps);
  __syncthreads();
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float n = __fmul_rn(x[base + i], r);
    if (w) n = __fmul_rn(n, w[i]);
    if (mode == 1) y[base + i] = __fadd_rn(y[base + i], n);
    else y[base + i] = n;
  }
}
extern "C" __global__ void rms_norm(float* y, const float* x, const float* __restrict__ w, int dim, float eps,
                                    int mode) { rms_norm_body(blockIdx.x, y, x, w, dim, eps, mode); }

// Q, K and V heads after their projections, in one launch: Q heads normed with wq and rotated,
// K heads normed with wk and rotated, V heads normed without weight (nk = 0 skips K and V; wv
// unused when nv = 0). Each buffer is [T, heads, hd]; one block per (t, head); blocks run Q, then
// K, then V. Not run where a short pass's attention norms its rows itself (`ATT_FUSED_*` in
// attention.cu: the megakernel's table, batched steps), which uses the same functions.
STAGE void qkv_norm_rope_body(const int vb, float* q, const float* __restrict__ wq, int nq, float* k,
                                         const float* __restrict__ wk, int nk, float* v, int nv,
                                         const float* __restrict__ inv_freq, int hd, const int* __restrict__ pos,
                                         int T, float eps) {
  int b = vb, heads = nq;
  float* h = q;
  const float* w = wq;
  const float* freq = inv_freq;
  if (b >= T * nq) {
    b -= T * nq;
    if (b < T * nk) {
      h = k, w = wk, heads = nk;
    } else {
      b -= T * nk;
      h = v, w = nullptr, freq = nullptr, heads = nv;
    }
  }
  // Weights before the wait.
  const int half = hd / 2;
  const float2 wp = weight_pair(w, half);
  const float f = freq && (int)threadIdx.x < half ? freq[threadIdx.x] : 0.f;
  pdl_start();
  float* row = h + (u64)b * hd;
  const float2 x = head_pair(row, half);
  const float r = rms_scale(block_sum_stat(pair_sq(x)), hd, eps);
  store_pair(row, half, norm_rope_pair(x, r, w != nullptr, wp, f, pos[0] + b / heads));
}
extern "C" __global__ void qkv_norm_rope(float* q, const float* __restrict__ wq, int nq, float* k,
                                         const float* __restrict__ wk, int nk, float* v, int nv,
                                         const float* __restrict__ inv_freq, int hd, const int* __restrict__ pos,
                                         int T, float eps) { qkv_norm_rope_body(blockIdx.x, q, wq, nq, k, wk, nk, v, nv, inv_freq, hd, pos, T, eps); }

// `add_norm_body` is in common.cuh (the prepared-input variant in matvec_mma.cu runs it too):
// `slices` blocks per row, x' into x_out (x itself with one slice).
extern "C" __global__ void __launch_bounds__(256) add_norm(float* x, const float* __restrict__ o, const float* __restrict__ w1, float scale,
                                    float* a, const float* __restrict__ w2, int dim, float eps, float* x_out, int slices) {
  add_norm_body(blockIdx.x, x, o, w1, scale, a, w2, dim, eps, x_out, slices);
}

// x[t, i] = gelu(x[t, i]) · gate[t·stride + i] for x: [T, n] (the unfused GeGLU / PLE gate).
STAGE void gelu_gate_body(const int vb, float* x, const float* __restrict__ gate, int n, int stride, int T) {
  pdl_start();
  int i = vb * blockDim.x + threadIdx.x;
  if (i >= T * n) return;
  int t = i / n, k = i % n;
  x[i] = __fmul_rn(gelu_tanh(x[i]), gate[(u64)t * stride + k]);
}
extern "C" __global__ void gelu_gate(float* x, const float* __restrict__ gate, int n, int stride, int T) { gelu_gate_body(blockIdx.x, x, gate, n, stride, T); }

// PLE inputs: c[t] = (c[t] + table[tokens[t]] · embed_scale) · input_scale, c already projected
// and normed. A row gather (`row_element`): a token's row is all layers' inputs (E2B 8,960
// elements), and one block walking it took 18 µs of an E2B step (each iteration's loads waited for
// the previous store, which may alias them).
STAGE void ple_combine_body(const int vb, float* c, Mat table, const unsigned* __restrict__ tokens, float embed_scale,
                                       float input_scale) {
  pdl_start();
  const RowElement e = row_element(vb, table.cols);
  if (e.c >= table.cols) return;
  const u64 j = (u64)e.t * table.cols + e.c;
  c[j] = __fmul_rn(__fadd_rn(c[j], __fmul_rn(mat_elem(table, tokens[e.t], e.c), embed_scale)), input_scale);
}
extern "C" __global__ void ple_combine(float* c, Mat table, const unsigned* __restrict__ tokens, float embed_scale,
                                       float input_scale) { ple_combine_body(blockIdx.x, c, table, tokens, embed_scale, input_scale); }

// x *= s over n elements.
STAGE void scale_body(const int vb, float* x, float s, u64 n) {
  pdl_start();
  u64 i = (u64)vb * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __fmul_rn(x[i], s);
}
extern "C" __global__ void scale(float* x, float s, u64 n) { scale_body(blockIdx.x, x, s, n); }

// x += y over n elements.
STAGE void add_body(const int vb, float* x, const float* __restrict__ y, u64 n) {
  pdl_start();
  u64 i = (u64)vb * blockDim.x + threadIdx.x;
  if (i < n) x[i] = __fadd_rn(x[i], y[i]);
}
extern "C" __global__ void add(float* x, const float* __restrict__ y, u64 n) { add_body(blockIdx.x, x, y, n); }

// y = x over n elements.
STAGE void copy_body(const int vb, float* y, const float* __restrict__ x, u64 n) {
  pdl_start();
  u64 i = (u64)vb * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}
extern "C" __global__ void copy(float* y, const float* __restrict__ x, u64 n) { copy_body(blockIdx.x, y, x, n); }

// Router input: z[t, i] = z[t, i] · s[i] · root (z already RMS-normed without weight).
STAGE void router_scale_body(const int vb, float* z, const float* __restrict__ s, float root, int h, int T) {
  pdl_start();
  int i = vb * blockDim.x + threadIdx.x;
  if (i < T * h) z[i] = __fmul_rn(__fmul_rn(z[i], s[i % h]), root);
}
extern "C" __global__ void router_scale(float* z, const float* __restrict__ s, float root, int h, int T) {
  router_scale_body(blockIdx.x, z, s, root, h, T);
}

// MoE routing, one thread per token: softmax over the E router logits, top-k by probability
// (lower index first among equals), weight = p / Σ_topk p · per_expert_scale.
STAGE void moe_route_body(const int vb, const float* __restrict__ logits, const float* __restrict__ per_expert_scale,
                          int* idx, float* wts, int E, int k, int T) {
  pdl_start();
  int t = vb * blockDim.x + threadIdx.x;
  if (t >= T) return;
  const float* l = logits + (u64)t * E;
  float mx = NEG_INF;
  for (int e = 0; e < E; e++) mx = fmaxf(mx, l[e]);
  float sum = 0.f;
  for (int e = 0; e < E; e++) sum += expf(l[e] - mx);
  float inv = 1.f / sum;
  unsigned long long taken[4] = {0, 0, 0, 0};  // up to 256 experts
  float total = 0.f;
  for (int s = 0; s < k; s++) {
    int best = -1;
    float bp = -1.f;
    for (int e = 0; e < E; e++) {
      if (taken[e >> 6] & (1ull << (e & 63))) continue;
      float p = expf(l[e] - mx) * inv;
      if (p > bp) { bp = p; best = e; }
    }
    taken[best >> 6] |= 1ull << (best & 63);
    idx[t * k + s] = best;
    wts[t * k + s] = bp;
    total += bp;
  }
  for (int s = 0; s < k; s++) wts[t * k + s] = wts[t * k + s] / total * per_expert_scale[idx[t * k + s]];
}
extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ per_expert_scale,
                                     int* idx, float* wts, int E, int k, int T) {
  moe_route_body(blockIdx.x, logits, per_expert_scale, idx, wts, E, k, T);
}

// out[t, :] = Σ_s wts[t, s] · ys[t·k + s, :] in routing order.
STAGE void moe_combine_body(const int vb, float* out, const float* __restrict__ ys, const float* __restrict__ wts,
                            int k, int h, int T) {
  pdl_start();
  int i = vb * blockDim.x + threadIdx.x;
  if (i >= T * h) return;
  int t = i / h, c = i % h;
  float a = 0.f;
  for (int s = 0; s < k; s++) a = __fadd_rn(a, __fmul_rn(wts[t * k + s], ys[((u64)t * k + s) * h + c]));
  out[i] = a;
}
extern "C" __global__ void moe_combine(float* out, const float* __restrict__ ys, const float* __restrict__ wts, int k,
                                       int h, int T) {
  moe_combine_body(blockIdx.x, out, ys, wts, k, h, T);
}

// Commit of `accepted` staged K/V rows (positions p0 + i) into every cache-owning layer's cache,
// in one launch: grid (layers·2, accepted), block (layer, K or V) copies row i. A ring keeps
// `ring` slots (slot = pos mod ring); rows that a later row of the same commit overwrites are
// skipped. Layout of a table entry: `struct KvLayer` (src/seq.rs `KvLayerDesc`).
struct KvLayer {
  u64 k, v, staged_k, staged_v;
  int width, ring;
};

// Row i of layer-half b (layer b / 2, K or V by b's low bit). With `undo`, a ring's row that this
// one replaces is first kept in staged row 1 (`kv_restore` puts it back).
__device__ __forceinline__ void kv_commit_row(const KvLayer* __restrict__ layers, int b, int i, int accepted, int p0,
                                              bool undo = false) {
  const KvLayer L = layers[b >> 1];
  if (L.ring > 0 && i < accepted - L.ring) return;
  float* cache = (float*)((b & 1) ? L.v : L.k);
  float* staged = (float*)((b & 1) ? L.staged_v : L.staged_k);
  const int pos = p0 + i;
  const u64 slot = L.ring > 0 ? (u64)(pos % L.ring) : (u64)pos;
  undo = undo && L.ring > 0;
  for (int c = threadIdx.x; c < L.width; c += blockDim.x) {
    const float old = undo ? cache[slot * L.width + c] : 0.f;
    cache[slot * L.width + c] = staged[(u64)i * L.width + c];
    if (undo) staged[L.width + c] = old;
  }
}

extern "C" __global__ void kv_commit(const KvLayer* __restrict__ layers, int accepted, int p0) {
  kv_commit_row(layers, blockIdx.x, blockIdx.y, accepted, p0);
}

// The last stage of a decode step that commits its own row (one launch per token): the single
// staged row, at the position the step ran (meta[0], as every stage reads it), after every
// stage before it, keeping the ring rows it replaces (`kv_commit_row`'s undo). It also hands the
// step's argmax on, for decode steps queued before the host has read it (`CudaSeq::decode_greedy`):
// next = (position + 1, argmax) — the next step's meta, in the sequence's other meta buffer — and
// log[position & log_mask] = (position + 1) << 32 | argmax, one 8-byte store into host memory mapped
// for the device, which the host polls for its position's tag. Grid: layers·2 blocks.
STAGE void kv_commit_step_body(int b, const KvLayer* __restrict__ layers, const int* __restrict__ meta,
                               unsigned* next, const unsigned* __restrict__ ids, u64* log, int log_mask) {
  const int p0 = meta[0];
  pdl_start();
  if (b == 0 && threadIdx.x == 0) {
    const unsigned id = ids[0];
    next[0] = (unsigned)p0 + 1u;
    next[1] = id;
    *(volatile u64*)&log[p0 & log_mask] = (u64)(p0 + 1) << 32 | id;
  }
  kv_commit_row(layers, b, 0, 1, p0, true);
}

extern "C" __global__ void kv_commit_step(const KvLayer* __restrict__ layers, const int* __restrict__ meta,
                                          unsigned* next, const unsigned* __restrict__ ids, u64* log,
                                          int log_mask) {
  kv_commit_step_body(blockIdx.x, layers, meta, next, ids, log, log_mask);
}

// Takes back a decode step queued ahead of the host (`CudaSeq::decode_greedy`) that committed
// its row at position `pos`: each ring layer's replaced row, kept in staged row 1, goes back to
// its slot (a full cache's row past the sequence's length is simply unused). Grid: layers·2.
extern "C" __global__ void kv_restore(const KvLayer* __restrict__ layers, int pos) {
  const KvLayer L = layers[blockIdx.x >> 1];
  if (L.ring == 0) return;
  float* cache = (float*)((blockIdx.x & 1) ? L.v : L.k);
  const float* staged = (const float*)((blockIdx.x & 1) ? L.staged_v : L.staged_k);
  const u64 slot = (u64)(pos % L.ring);
  for (int c = threadIdx.x; c < L.width; c += blockDim.x) cache[slot * L.width + c] = staged[L.width + c];
}

// A batched step's commits: sequence c's staged row 0 (its `KvLayer` table tables[c]) at its
// position positions[c]; block b commits K (b even) or V of layer (b mod rows) / 2 of sequence
// b / rows, rows = layers·2. Grid: rows·sequences.
STAGE void kv_commit_columns_body(int b, const u64* __restrict__ tables, const int* __restrict__ positions, int rows) {
  const int c = b / rows;
  const KvLayer* layers = (const KvLayer*)tables[c];
  const int p0 = positions[c];
  pdl_start();
  kv_commit_row(layers, b - c * rows, 0, 1, p0);
}

extern "C" __global__ void kv_commit_columns(const u64* __restrict__ tables, const int* __restrict__ positions,
                                             int rows) {
  kv_commit_columns_body(blockIdx.x, tables, positions, rows);
}

// Final softcap (cap > 0) in place, and each block's argmax candidate over its slice of the row:
// `split` blocks per row write (value, index) pairs to partial[row·split + b].
STAGE void softcap_argmax_partial_body(const int vb, float* logits, int V, float cap, float2* partial, int split) {
  pdl_start();
  int row = vb / split, b = vb % split;
  float* l = logits + (u64)row * V;
  int per = (V + split - 1) / split;
  int lo = b * per, hi = min(V, lo + per);
  float best = NEG_INF;
  int bi = 0x7fffffff;
  // Eight logits loaded before any is written back: the stores may alias later loads for the
  // compiler, which otherwise issued one load round trip per element (7 µs of an E2B step with
  // 16 a thread). `better` is a total order, so the candidate does not depend on the visiting order.
  const int bd = blockDim.x;
  for (int i0 = lo + threadIdx.x; i0 < hi; i0 += 8 * bd) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = i0 + k * bd < hi ? l[i0 + k * bd] : 0.f;
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const int i = i0 + k * bd;
      if (i >= hi) break;
      if (cap > 0.f) {
        v[k] = __fmul_rn(cap, tanhf(__fdiv_rn(v[k], cap)));
        l[i] = v[k];
      }
      if (better(v[k], i, best, bi)) { best = v[k]; bi = i; }
    }
  }
  warp_argmax(best, bi);
  __shared__ float sv[32];
  __shared__ int si[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) { sv[warp] = best; si[warp] = bi; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); w++)
      if (better(sv[w], si[w], best, bi)) { best = sv[w]; bi = si[w]; }
    partial[vb] = make_float2(best, __int_as_float(bi));
  }
}
extern "C" __global__ void softcap_argmax_partial(float* logits, int V, float cap, float2* partial, int split) { softcap_argmax_partial_body(blockIdx.x, logits, V, cap, partial, split); }

// ids[row] = the best of the row's `split` candidates. One warp per row.
STAGE void argmax_final_body(const int vb, const float2* __restrict__ partial, int split, unsigned* ids) {
  pdl_start();
  if (threadIdx.x >= 32) return;  // one warp (the megakernel runs it in a block of 256)
  float best = NEG_INF;
  int bi = 0x7fffffff;
  for (int b = threadIdx.x; b < split; b += 32) {
    float2 p = partial[vb * split + b];
    if (better(p.x, __float_as_int(p.y), best, bi)) { best = p.x; bi = __float_as_int(p.y); }
  }
  warp_argmax(best, bi);
  if (threadIdx.x == 0) ids[vb] = (unsigned)bi;
}
extern "C" __global__ void argmax_final(const float2* __restrict__ partial, int split, unsigned* ids) { argmax_final_body(blockIdx.x, partial, split, ids); }
