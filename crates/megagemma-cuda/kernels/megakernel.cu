// The decode step in one persistent launch (first version): the stage kernels of a decode step,
// recorded on the host as a table of stages (kernel, grid, arguments: src/megakernel.rs), run in
// order by one grid of co-resident blocks. A stage's blocks are spread over the grid (block b runs
// the stage's blocks b, b + gridDim, …) through the same device functions the separate kernels
// call, so every result is bit-identical to the graph-launched step (`gpu_check megakernel`).
//
// Between stages: every block signals the stage's own counter (one 128-byte line per stage,
// monotonic across launches) when it has finished its part (release), and a stage's body waits,
// where the separate kernel would wait for its predecessor (`pdl_start()`), until the previous
// stage's counter shows every block finished it (acquire). So weights are still fetched before the
// wait, as with programmatic dependent launch, and a block with nothing to do in a stage moves on
// at once. (One shared counter would not do: a block that skips a stage's work would count for a
// block still busy with the stage before.) Every wait is
// bounded: past MK_TIMEOUT_NS, or once another block has failed, the block sets the error flag
// and leaves, so a broken table is an error the host reads, never a hung GPU.
//
// This is the stage-by-stage form of issue 10's megakernel (one grid-wide dependency per stage);
// the job table of src/schedule.rs (dependencies per produced item) is the next step.
#define MEGAKERNEL 1
// Activations are written and read by different blocks within the launch, so no load may take
// the non-coherent read-only path: no `__restrict__` (which lets the compiler use it) and no
// `__ldg`. Weights still stream through `__ldcs`.
#define __restrict__
#define __ldg(p) (*(p))
#include "common.cuh"
#ifdef MK_MARK
// A trace experiment: MK_MARK=1 records, as a stage's "wait satisfied" time, when a folded
// residual step's statistics are done; MK_MARK=2 when a matvec's first inputs are built.
__device__ __forceinline__ void mk_mark(int where);
#endif
#include "ops.cu"
#include "matvec.cu"
#include "matvec_mma.cu"
#include "attention.cu"

#define MK_ARGS 32
// 1 s per wait. Under compute-sanitizer (racecheck runs shared-memory code many times slower) the
// session script compiles it longer (MEGAGEMMA_CUDA_DEFINES=MK_TIMEOUT_NS=…), so a slow stage is
// not taken for a broken schedule.
#ifndef MK_TIMEOUT_NS
#define MK_TIMEOUT_NS 1000000000ull
#endif

// One stage (`MkStage` in src/megakernel.rs): kernel id (MK_KERNELS there, the cases below),
// its grid, whether its body waits itself (`pdl_start()`), and its arguments in 8-byte slots
// (a Mat takes four).
struct MkStage {
  int kernel;
  int grid;
  int waits_itself;
  unsigned prefetch;  // bit i: ask L2 for stage s + 1 + i's matvec weights at this stage's start
  u64 a[MK_ARGS];
};

__shared__ unsigned mk_target;    // counter value that means "done in this launch"
__shared__ unsigned* mk_counter;  // the previous stage's counter (null in the first stage)
__shared__ unsigned* mk_err;
__shared__ int mk_failed;
__shared__ unsigned long long mk_waited;  // when this stage's first wait was satisfied (0: none)

__device__ __forceinline__ unsigned long long mk_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#ifdef MK_MARK
__device__ __forceinline__ void mk_mark(int where) {
  if (where == MK_MARK && threadIdx.x == 0 && !mk_waited) mk_waited = mk_now();
}
#endif

__device__ void mk_wait() {
  if (threadIdx.x == 0 && mk_counter && !mk_failed) {
    const unsigned long long deadline = mk_now() + MK_TIMEOUT_NS;
    for (unsigned spins = 0;; spins++) {
      unsigned v;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(mk_counter) : "memory");
      if ((int)(v - mk_target) >= 0) break;
      // Back off a little: hundreds of blocks poll the same line while the stage's blocks work.
      if (spins > 4) __nanosleep(64);
      if (*(volatile unsigned*)mk_err || mk_now() > deadline) {
        atomicExch(mk_err, 1u);
        mk_failed = 1;
        break;
      }
    }
#ifndef MK_MARK
    if (!mk_waited) mk_waited = mk_now();
#endif
  }
  __syncthreads();
}

// The matrices of a tensor-core matvec stage, read from the table when needed: at slots 0, 4, 8
// (`stride` 4) or one matrix at slot 0 (`stride` 0).
struct MatSlots {
  const u64* a;
  int stride;
  __device__ __forceinline__ Mat get(int i) const { return *(const Mat*)(a + i * stride); }
};

// A stage this entry cannot run: an error for the host, like a timed-out wait.
__device__ __forceinline__ void mk_unknown_stage() {
  if (threadIdx.x == 0) {
    atomicExch(mk_err, 1u);
    mk_failed = 1;
  }
}

#define P(T, i) ((T)st.a[i])
#define I(i) ((int)(unsigned)st.a[i])
#define F(i) __uint_as_float((unsigned)st.a[i])
#define M(i) (*(const Mat*)&st.a[i])

// The tensor-core matvecs (ids 15 and 17 plain, 19 and 21 gated, for up to four tokens; 16, 18, 20
// and 22 for five to eight, in the WIDE entries only; UPC scale units per 64 columns), inlined in
// their cp.async-ring form (`ring_slice` in matvec_mma.cu).
#define MK_MMA_H(ID, H, UPC)                                                                                        \
  case ID:                                                                                                          \
    mma_kernel<H, UPC, false, true>(b, g, MatSlots{st.a, 4}, P(const float*, 12), P(float*, 13), P(float*, 14),      \
                                    P(float*, 15), I(16), I(17), I(18), I(19), I(20), I(21), I(22),                 \
                                    P(float*, 23), P(unsigned*, 24), nullptr, 0,                                    \
                                    Residual{P(const float*, 25), P(const float*, 26), P(const float*, 27),         \
                                             P(const float*, 28), P(float*, 29), F(30), F(31)});                    \
    break;                                                                                                          \
  case ID + 4:                                                                                                      \
    mma_kernel<H, UPC, true, true>(b, g, MatSlots{st.a, 0}, P(const float*, 4), P(float*, 5), P(float*, 5),          \
                                   P(float*, 5), I(9), 0, I(6), I(7), I(8), I(9), I(10), P(float*, 11),             \
                                   P(unsigned*, 12), P(const float*, 13), I(14), Residual{});                       \
    break;

// The stages only the WIDE entries run (`mk_more_stage`), a call of their own, so the lean entry's
// dispatch (and code) is what it was for decode steps alone: the tensor-core stages of five to
// eight tokens (inlined into the dispatch, they made NVRTC take minutes over the module), a
// batched step's commits, and in the general entry a mixture-of-experts layer's stages.
template <bool GENERAL>
__device__ __noinline__ void mk_dispatch_more(const MkStage& st, int b, int g) {
  switch (st.kernel) {
    MK_MMA_H(16, 2, 1)  // matvec_q4t_8, matvec_q4t_8_gated
    MK_MMA_H(18, 2, 2)  // matvec_q4t_8_g32, matvec_q4t_8_g32_gated
    case 24:  // kv_commit_columns
      kv_commit_columns_body(b, P(const u64*, 0), P(const int*, 1), I(2));
      break;
    // A mixture-of-experts layer's own stages (26B-A4B): the general entry only.
    case 25:  // router_scale
      if constexpr (GENERAL) router_scale_body(b, P(float*, 0), P(const float*, 1), F(2), I(3), I(4));
      else mk_unknown_stage();
      break;
    case 26:  // moe_route
      if constexpr (GENERAL)
        moe_route_body(b, P(const float*, 0), P(const float*, 1), P(int*, 2), P(float*, 3), I(4), I(5), I(6));
      else mk_unknown_stage();
      break;
    case 27:  // matvec_experts
      if constexpr (GENERAL)
        matvec_experts_body(b, P(const Mat*, 0), I(1), P(const int*, 2), I(3), P(const float*, 4), I(5),
                            P(float*, 6), I(7));
      else mk_unknown_stage();
      break;
    case 28:  // moe_combine
      if constexpr (GENERAL) moe_combine_body(b, P(float*, 0), P(const float*, 1), P(const float*, 2), I(3), I(4), I(5));
      else mk_unknown_stage();
      break;
    default:
      mk_unknown_stage();
      break;
  }
}
__device__ __forceinline__ bool mk_more_stage(int kernel) {
  return kernel == 16 || kernel == 18 || kernel == 20 || kernel == 22 || kernel >= 24;
}

// Block `b` of a stage whose launch had `g` blocks; ids as MK_KERNELS in src/megakernel.rs. The
// CUDA-core and dense matvecs are real calls (BIG_STAGE: they need more registers than the rest);
// the tensor-core matvec is inlined in its lean cp.async-ring form. GENERAL: the entry runs the
// CUDA-core and dense matvecs (and, with WIDE, a mixture-of-experts layer's stages); WIDE:
// tensor-core stages of five to eight tokens and the commits of a batched step too.
template <bool GENERAL, bool WIDE>
__device__ __forceinline__ void mk_dispatch(const MkStage& st, int b, int g) {
  if constexpr (WIDE) {
    if (mk_more_stage(st.kernel)) return mk_dispatch_more<GENERAL>(st, b, g);
  }
  switch (st.kernel) {
    case 0:  // embed_gather
      embed_gather_body(b, M(0), P(const unsigned*, 4), P(float*, 5), F(6));
      break;
    case 1:  // rms_norm
      rms_norm_body(b, P(float*, 0), P(const float*, 1), P(const float*, 2), I(3), F(4), I(5));
      break;
    case 2:  // qkv_norm_rope
      qkv_norm_rope_body(b, P(float*, 0), P(const float*, 1), I(2), P(float*, 3), P(const float*, 4), I(5),
                         P(float*, 6), I(7), P(const float*, 8), I(9), P(const int*, 10), I(11), F(12));
      break;
    case 3:  // add_norm
      add_norm_body(b, P(float*, 0), P(const float*, 1), P(const float*, 2), F(3), P(float*, 4), P(const float*, 5),
                    I(6), F(7), P(float*, 8), I(9));
      break;
    case 4:  // gelu_gate
      gelu_gate_body(b, P(float*, 0), P(const float*, 1), I(2), I(3), I(4));
      break;
    case 5:  // ple_combine
      ple_combine_body(b, P(float*, 0), M(1), P(const unsigned*, 5), F(6), F(7));
      break;
    case 6:  // scale
      scale_body(b, P(float*, 0), F(1), st.a[2]);
      break;
    case 7:  // add
      add_body(b, P(float*, 0), P(const float*, 1), st.a[2]);
      break;
    case 8:  // copy
      copy_body(b, P(float*, 0), P(const float*, 1), st.a[2]);
      break;
    case 9:  // softcap_argmax_partial
      softcap_argmax_partial_body(b, P(float*, 0), I(1), F(2), P(float2*, 3), I(4));
      break;
    case 10:  // argmax_final
      argmax_final_body(b, P(const float2*, 0), I(1), P(unsigned*, 2));
      break;
    case 11:  // matvec
      if constexpr (GENERAL) matvec_body(b, M(0), P(const float*, 4), P(float*, 5), I(6));
      else mk_unknown_stage();
      break;
    case 12:  // matvec_q4
      if constexpr (GENERAL)
        matvec_q4_run(b, g, M(0), M(4), M(8), P(const float*, 12), P(float*, 13), P(float*, 14), P(float*, 15), I(16),
                      I(17), I(18), I(19), I(20), I(21));
      else mk_unknown_stage();
      break;
    case 13:  // matvec_q4_gated
      if constexpr (GENERAL)
        matvec_q4_gated_run(b, g, M(0), P(const float*, 4), P(float*, 5), I(6), I(7), P(const float*, 8), I(9), I(10),
                            I(11));
      else mk_unknown_stage();
      break;
    case 14:  // attention
      attention_body(b, P(const float*, 0), P(const float*, 1), P(const float*, 2), P(float*, 3), P(float*, 4),
                     P(float*, 5), I(6), I(7), I(8), P(const int*, 9), I(10), I(11), F(12), I(13), I(14),
                     P(float*, 15), P(float2*, 16), P(unsigned*, 17), I(18), I(19), P(const float*, 20),
                     P(const float*, 21), P(const float*, 22), F(23), P(const float*, 24), P(const float*, 25),
                     P(const AttColumn*, 26));
      break;
    case 23:  // kv_commit_step
      kv_commit_step_body(b, P(const KvLayer*, 0), P(const int*, 1), P(unsigned*, 2), P(const unsigned*, 3),
                          P(u64*, 4), I(5));
      break;
      // The tensor-core matvecs of up to four tokens, inlined (MK_MMA_H above).
      MK_MMA_H(15, 1, 1)  // matvec_q4t_4, matvec_q4t_4_gated
      MK_MMA_H(17, 1, 2)  // matvec_q4t_4_g32, matvec_q4t_4_g32_gated
#undef MK_MMA_H
    default:  // a kernel the megakernel does not run (the host refuses such tables)
      mk_unknown_stage();
      break;
  }
}

// Weights never depend on activations: a block asks L2 for every virtual block it will run in a
// later tensor-core matvec stage (ids as in MK_MMA), where the host's plan says so (`prefetch`).
__device__ __noinline__ void mk_prefetch_mma(const MkStage& st) {
  const int g = st.grid;
  const bool gated = st.kernel == 19 || st.kernel == 21;
  const int nb0 = gated ? I(9) : I(16), nb1 = gated ? 0 : I(17);
  const int split = gated ? I(7) : I(19), parts = gated ? I(8) : I(20), nblocks = gated ? I(9) : I(21);
  const MatSlots mats{st.a, gated ? 0 : 4};
  const int tpb = decode_split(split).tpb;
  for (int vb = blockIdx.x; vb < nblocks; vb += g) {
    const int which = vb < nb0 ? 0 : vb < nb0 + nb1 ? 1 : 2;
    const int local = vb - (which > 0 ? nb0 : 0) - (which > 1 ? nb1 : 0);
    prefetch_block(mats.get(which), tpb, parts, local);
  }
}

// Runs stages [0, n) for one token, the `gen`-th launch: stage s's counter (counters[32·s])
// reaches gen·gridDim.x when every block has finished it. err: set on a timed-out wait. trace (when
// not null): per (block, stage), trace[3·(block·n + s) ..] = %globaltimer at the stage's start, when
// its wait was satisfied (0 if the block did not wait) and at its end.
template <bool GENERAL, bool WIDE>
__device__ __forceinline__ void mk_run(const MkStage* __restrict__ stages, int n, unsigned* counters, unsigned gen,
                                       unsigned* err, unsigned long long* trace) {
  if (threadIdx.x == 0) {
    mk_target = gen * gridDim.x;
    mk_err = err;
    mk_failed = 0;
    mk_counter = nullptr;  // stage 0 waits for nothing
    mk_waited = 0;
  }
  // No block barrier at a stage's start (E4B −1.1%, E2B −1.5%, sixteenth session): thread 0 names
  // the next stage's counter before the barrier that ends a stage, when no other thread can be
  // reading it, and only thread 0 touches mk_waited. So a stage has two barriers: its wait's and its
  // end's.
  __syncthreads();
  for (int s = 0; s < n; s++) {
    const MkStage& st = stages[s];
    for (unsigned p = st.prefetch; p; p &= p - 1) {
      const MkStage& later = stages[s + 1 + __ffs(p) - 1];
      if (blockIdx.x < later.grid) mk_prefetch_mma(later);
    }
    const unsigned long long start = trace && threadIdx.x == 0 ? mk_now() : 0;
    const int g = st.grid;
    if (blockIdx.x < g && !st.waits_itself) mk_wait();
    for (int b = blockIdx.x; b < g; b += gridDim.x) mk_dispatch<GENERAL, WIDE>(st, b, g);
    if (threadIdx.x == 0) mk_counter = counters + 32 * s;  // what stage s + 1 waits for
    __syncthreads();
    if (mk_failed) return;
    if (trace && threadIdx.x == 0) {
      unsigned long long* t = trace + 3 * ((u64)blockIdx.x * n + s);
      t[0] = start;
      t[1] = mk_waited;
#ifndef MK_END_AFTER_RELEASE
      t[2] = mk_now();
#endif
    }
    // The barrier above orders every thread's writes before thread 0's release, and a release is
    // cumulative: the waiter's acquire sees them all. A full `__threadfence()` before it cost 1.5%.
    if (threadIdx.x == 0) {
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + 32 * s) : "memory");
      mk_waited = 0;
    }
#ifdef MK_END_AFTER_RELEASE
    // A trace experiment: a stage's end recorded after its release, which waits until the block's
    // writes — its 64-bit reductions included — are performed (fifty-ninth session, perf-notes).
    if (trace && threadIdx.x == 0) trace[3 * ((u64)blockIdx.x * n + s) + 2] = mk_now();
#endif
  }
}

// Entry points (`MK_ENTRIES` in src/device.rs): every stage kernel; all but the CUDA-core and dense
// matvecs, which are real calls (BIG_STAGE) whose calling convention costs the rest of the kernel
// registers (without them the lean entry spills far less and runs ~15% faster, E4B), for passes
// of up to four tokens of one sequence; and the same for passes of five to eight tokens and for
// batched steps. Those are an entry of their own so that a decode step's entry carries none of
// their code (code carried but not run costs 1–7% here).
extern "C" __global__ void __launch_bounds__(256, 2)
megakernel(const MkStage* __restrict__ stages, int n, unsigned* counters, unsigned gen, unsigned* err,
           unsigned long long* trace) {
  mk_run<true, true>(stages, n, counters, gen, err, trace);
}
extern "C" __global__ void __launch_bounds__(256, 2)
megakernel_lean(const MkStage* __restrict__ stages, int n, unsigned* counters, unsigned gen, unsigned* err,
                unsigned long long* trace) {
  mk_run<false, false>(stages, n, counters, gen, err, trace);
}
extern "C" __global__ void __launch_bounds__(256, 2)
megakernel_lean_wide(const MkStage* __restrict__ stages, int n, unsigned* counters, unsigned gen, unsigned* err,
                     unsigned long long* trace) {
  mk_run<false, true>(stages, n, counters, gen, err, trace);
}
