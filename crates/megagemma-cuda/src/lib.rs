//! megagemma-cuda: the Gemma 4 (and Gemma 3) text decoder on an NVIDIA GPU.
//!
//! Kernels are header-free `.cu` files compiled by NVRTC at start-up ([`compile`]); weights are
//! uploaded into arenas ([`weights`]); [`CudaModel`] holds them and the device, [`CudaSeq`] one
//! sequence's KV cache and scratch, and runs the forward pass stage by stage on one stream
//! (single-token passes replayed from a captured CUDA graph).
//!
//! Without a GPU, [`CudaModel::load`] returns one error line ("no CUDA device found: …"). On the GPU
//! machine: `gpu_check all` (example) compares every fixture with the CPU reference, checks verify
//! columns against decode steps bit for bit and benchmarks synthetic E4B/E2B; the tests in
//! `tests/gpu_forward.rs` run with `--include-ignored`. Environment: `MEGAGEMMA_CUDA_LIB_DIR`
//! (where libnvrtc is), `MEGAGEMMA_KERNELS` (read `.cu` files from a folder), `MEGAGEMMA_CACHE`
//! (CUBIN cache), `MEGAGEMMA_CUDA_CUBINS` (CUBINs prebuilt without a GPU by the `prebuild_cubins` example),
//! `MEGAGEMMA_CUDA_GRAPHS=0`, `MEGAGEMMA_CUDA_PIPELINE=0` (greedy decoding waits for each token before
//! queuing the next step; same ids), `MEGAGEMMA_CUDA_PROFILE=1` (per-kernel timing), `MEGAGEMMA_CUDA_PDL=0`
//! (no programmatic dependent launch), `MEGAGEMMA_CUDA_Q4_BLOCKS_PER_SM` / `MEGAGEMMA_CUDA_Q4_AHEAD`
//! (the CUDA-core 4-bit matvecs' grid and L2 look-ahead; no result depends on them),
//! `MEGAGEMMA_CUDA_PREP_INPUTS=0` (passes of 2–8 tokens build every matvec input in each block
//! instead of copying what their residual step prepared; same results), `MEGAGEMMA_CUDA_PREP_MIN`
//! (the fewest tokens of such a pass, default 2), `MEGAGEMMA_CUDA_PREP_SLICES` (blocks per token of
//! its residual step, default 8; same results),
//! `MEGAGEMMA_CUDA_MMA_AHEAD` (the tensor-core matvec's L2 look-ahead in passes of several tokens,
//! default 0), `MEGAGEMMA_CUDA_Q4_MMA=0` (no
//! tensor-core matvec), `MEGAGEMMA_CUDA_CUBLAS=0` (prefill on the matvecs), `MEGAGEMMA_CUDA_PREFILL_CHUNK`
//! (tokens per prefill pass), `MEGAGEMMA_CUDA_DECODE=graph|megakernel`, `MEGAGEMMA_CUDA_MK_TRACE=FILE`
//! (the megakernel's per-block trace of each step), `MEGAGEMMA_CUDA_FOLD_NORMS=0` (residual steps as
//! their own kernels rather than folded into the next matvec), `MEGAGEMMA_CUDA_FUSE_NORMS=0|1` (Q/K/V
//! norms and RoPE inside the attention kernel of short passes: default in the megakernel only; same
//! results), `MEGAGEMMA_CUDA_ATT_SPLIT_KEYS` (fewest
//! keys per attention block, default 16; part of the arithmetic), `MEGAGEMMA_CUDA_MK_PREFETCH=N` (the
//! megakernel asks L2 for the next N matvec stages' weights where HBM idles; default 0),
//! `MEGAGEMMA_CUDA_MK_SMEM_EXTRA=BYTES` (the megakernel takes that much more shared memory than its
//! stages use, so less L1 is left: an experiment; same results),
//! `MEGAGEMMA_CUDA_MMA_WAVES` (most virtual blocks per grid slot the tensor-core split aims for, default 1),
//! `MEGAGEMMA_CUDA_MMA_PART_CHUNKS` (most chunks per column part) and `MEGAGEMMA_CUDA_MMA_SPLITS=
//! ROWSxCOLS=KS:PARTS;...` (the split of launches of that shape; all three part of the arithmetic),
//! `MEGAGEMMA_CUDA_BATCH=0` (a step of several sequences runs one pass per sequence instead of one
//! weight pass per eight), `MEGAGEMMA_CUDA_SEQ_POOL=0` (freed sequences are not kept for reuse:
//! each new one allocates and zeroes its caches), `MEGAGEMMA_CUDA_MMA_RING=1` (launched passes of up to four tokens stream
//! the tensor-core matvec's weights through the megakernel's cp.async ring; same results),
//! `MEGAGEMMA_CUDA_MMA_ONE=0` (single-token launches run the four-token tensor-core entries with
//! one token instead of the entries built for one; same results), `MEGAGEMMA_CUDA_ATT_ONE=0` (decode steps
//! run the general attention entry instead of the one built for one token and its head dim; same results),
//! `MEGAGEMMA_CUDA_DEFINES=NAME[=VALUE],...` (or `;`-separated: kernel experiments compiled in on
//! request, e.g. `MMA_SCALES_F4`: the matvec's unit scales as one 16-byte load per lane instead of
//! four shuffles; `MMA_U1=N`: N chunks per register batch; `RES_KEEP=0`: the folded residual step
//! re-reads x' instead of keeping it; `MMA_BLOCKS_PER_SM=3` (the host's grid and
//! splits follow it); `MMA_RING=N`: N slots per warp in the cp.async ring, default 4 (the host's
//! shared memory follows it);
//! `MK_MARK=1|2`: the megakernel's trace records, as a matvec stage's "wait satisfied" time, when
//! its folded residual statistics (1) or its first inputs (2) are done — where a stage's fixed path
//! goes, with `tools/mk_trace.py`).

pub mod backend;
mod candidates;
mod capture;
pub mod check;
pub mod compile;
pub mod device;
pub mod draft;
pub mod libs;
mod long_pass;
mod megakernel;
mod mma_split;
pub mod model;
pub mod schedule;
pub mod seq;
pub mod synthetic;
pub mod tiled;
pub mod weights;

pub use backend::{CudaBackend, DefaultContext};
pub use candidates::MAX_CANDIDATES;
pub use long_pass::{FEW_TOKENS, LONG_PASS_TOKENS};
pub use megakernel::{MkKindTime, MkTrace, MK_KERNELS};
pub use model::CudaModel;
pub use seq::{CudaSeq, Decode, PosOut, Want, MAX_CHUNK, MAX_VERIFY};
