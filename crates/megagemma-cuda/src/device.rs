//! The device: context, one non-default stream, the compiled kernel modules, raw allocations and
//! a launch helper. Everything here is reached only after [`crate::libs::driver_present`] said yes.

use crate::compile::{cubin_for, KERNEL_FILES};
use crate::libs::{cublas_present, driver_present, nvrtc_present};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaStream};
use cudarc::nvrtc::Ptx;
use megagemma_model::{bail, Error, Result};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// Every kernel entry point, by file.
const FUNCTIONS: [(&str, &[&str]); 8] = [
    ("matvec.cu", &["matvec", "matvec_q4", "matvec_q4_gated", "matvec_experts"]),
    ("matvec_mma.cu", &MMA_KERNELS),
    (
        "ops.cu",
        &[
            "embed_gather",
            "rms_norm",
            "qkv_norm_rope",
            "add_norm",
            "gelu_gate",
            "ple_combine",
            "scale",
            "add",
            "copy",
            "router_scale",
            "moe_route",
            "moe_combine",
            "kv_commit",
            "kv_commit_step",
            "kv_restore",
            "kv_commit_columns",
            "softcap_argmax_partial",
            "argmax_final",
        ],
    ),
    ("attention.cu", &["attention", "attention_1_256", "attention_1_512"]),
    (
        "prefill.cu",
        &["widen_rows", "widen_tiles", "split_inputs", "swap_rows", "split_queries", "kv_gather", "masked_softmax"],
    ),
    ("synth.cu", &["fill_random_u32", "fill_q4_scales", "fill_const", "read_bandwidth"]),
    ("draft.cu", &["centroid_candidates", "rows_dot", "argmax_ids"]),
    ("sample.cu", &["top_candidates_blocks", "top_candidates_merge", "sample_draw", "exp_det_values"]),
];

/// The tensor-core 4-bit matvecs (`kernels/matvec_mma.cu`): four tokens or eight, groups of
/// ≥ 64 columns or of 32, plain or gated — indexed `(tokens / 4 − 1) + 2·g32 + 4·gated`; then
/// the cp.async-ring form of the four-token ones (`MEGAGEMMA_CUDA_MMA_RING=1`), indexed
/// `8 + g32 + 2·gated` ([`mma_kernel`]); then the plain entries that copy prepared inputs and the
/// residual steps that prepare them, indexed `12 + (tokens / 4 − 1) + 2·g32` and `16 + …`
/// ([`mma_prep_kernels`]); then the single-token entries, indexed `20 + g32 + 2·gated`
/// ([`mma_one_kernel`]).
pub const MMA_KERNELS: [&str; 24] = [
    "matvec_q4t_4",
    "matvec_q4t_8",
    "matvec_q4t_4_g32",
    "matvec_q4t_8_g32",
    "matvec_q4t_4_gated",
    "matvec_q4t_8_gated",
    "matvec_q4t_4_g32_gated",
    "matvec_q4t_8_g32_gated",
    "matvec_q4t_4_ring",
    "matvec_q4t_4_g32_ring",
    "matvec_q4t_4_ring_gated",
    "matvec_q4t_4_g32_ring_gated",
    "matvec_q4t_4_prep",
    "matvec_q4t_8_prep",
    "matvec_q4t_4_g32_prep",
    "matvec_q4t_8_g32_prep",
    "add_norm_prep_4",
    "add_norm_prep_8",
    "add_norm_prep_4_g32",
    "add_norm_prep_8_g32",
    "matvec_q4t_1",
    "matvec_q4t_1_g32",
    "matvec_q4t_1_gated",
    "matvec_q4t_1_g32_gated",
];

/// The tensor-core matvec entry of single-token passes (decode steps): the four-token entry's code
/// with one token at compile time (`MEGAGEMMA_CUDA_MMA_ONE=0`: the four-token entry instead).
pub fn mma_one_kernel(g32: bool, gated: bool) -> &'static str {
    MMA_KERNELS[20 + usize::from(g32) + 2 * usize::from(gated)]
}

/// For `h` groups of four tokens and groups of 32 columns or not: the residual step that also
/// prepares the next plain matvecs' inputs, and the plain tensor-core entry that copies them.
pub fn mma_prep_kernels(h: usize, g32: bool) -> (&'static str, &'static str) {
    let i = (h - 1) + 2 * usize::from(g32);
    (MMA_KERNELS[16 + i], MMA_KERNELS[12 + i])
}

/// The tensor-core matvec entry for `h` groups of four tokens, groups of 32 columns or not, gated
/// or not, in the ring form or not (which only the four-token entries have).
pub fn mma_kernel(h: usize, g32: bool, gated: bool, ring: bool) -> &'static str {
    match ring && h == 1 {
        true => MMA_KERNELS[8 + usize::from(g32) + 2 * usize::from(gated)],
        false => MMA_KERNELS[(h - 1) + 2 * usize::from(g32) + 4 * usize::from(gated)],
    }
}

/// Slots per warp of the tensor-core matvec's cp.async ring (`MMA_RING` in `kernels/matvec_mma.cu`).
pub(crate) const MMA_RING_SLOTS: u32 = 4;

/// Shared memory of the tensor-core matvec's cp.async rings beside its inputs (`MMA_RING` slots
/// of `MMA_RING_SLOT(UPC)` bytes per warp in `kernels/matvec_mma.cu`; 8 warps). `MMA_RING=N` in
/// `MEGAGEMMA_CUDA_DEFINES` sets the slots for an experiment, here and in the kernel.
pub(crate) fn mma_ring_bytes(upc: u32) -> u32 {
    static SLOTS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    let slots = *SLOTS.get_or_init(|| defined_count("MMA_RING", 1..=16).map_or(MMA_RING_SLOTS, |n| n as u32));
    8 * slots * (512 + 128 * upc)
}

/// Kernels that call `pdl_start()` before touching activations (see `kernels/common.cuh`), besides
/// every one of [`MMA_KERNELS`]: on compute capability ≥ 9 they are launched with programmatic
/// stream serialization, so each may start (and prefetch its weights) while the kernel before it
/// finishes.
pub(crate) const PDL_KERNELS: [&str; 23] = [
    "matvec_experts",
    "router_scale",
    "moe_route",
    "moe_combine",
    "matvec",
    "matvec_q4",
    "matvec_q4_gated",
    "attention",
    "attention_1_256",
    "attention_1_512",
    "embed_gather",
    "rms_norm",
    "qkv_norm_rope",
    "add_norm",
    "gelu_gate",
    "ple_combine",
    "scale",
    "add",
    "copy",
    "softcap_argmax_partial",
    "argmax_final",
    "kv_commit_step",
    "kv_commit_columns",
];

/// Default fewest keys per attention block. Measured on the H200 (E4B q4, 64–192-key contexts):
/// 64 keys 3.86 ms/token, 32 keys 3.70 (sixth session); 16 keys with one wave of matvec blocks
/// (`Q4Stream::mma_waves`) 3.555–3.574 against 3.655–3.668, megakernel 4.98 against 5.23–5.24
/// (seventh session, same runs).
pub const ATT_SPLIT_KEYS: usize = 16;

/// Default most columns (64-wide chunks) one part of a split tensor-core matvec covers
/// (`Q4Stream::mma_part_chunks`): wider matrices are split along their columns into parts summed
/// at the end (down projections, wide O).
pub const MMA_PART_CHUNKS: usize = 40;

/// How the 4-bit matvecs stream a matrix: blocks launched per SM (each loops over its share of
/// virtual blocks) and how many virtual blocks ahead each asks L2 for. Results do not depend on
/// either. `MEGAGEMMA_CUDA_Q4_BLOCKS_PER_SM` and `MEGAGEMMA_CUDA_Q4_AHEAD` override them.
#[derive(Clone, Copy, Debug)]
pub struct Q4Stream {
    pub blocks_per_sm: usize,
    pub ahead: usize,
    /// Virtual blocks ahead the tensor-core matvec asks L2 for in passes of several tokens
    /// (`MEGAGEMMA_CUDA_MMA_AHEAD`, default 0). Twenty-fourth session (H200, E4B graph, two rounds):
    /// 1 ahead against none, verify of 2 / 3 / 4 / 5 / 8 tokens 3.09 / 3.58 / 3.82 / 4.68 / 5.63 ms
    /// against 2.94 / 3.45 / 3.69 / 4.58 / 5.54, four sequences in one pass 3.71–3.74 against
    /// 3.58, E2B's 3-token verify 2.37 against 2.28: the requests only compete with the stream.
    pub mma_ahead: usize,
    /// The tensor-core matvec's split aims for at most this many virtual blocks per grid slot
    /// (`MEGAGEMMA_CUDA_MMA_WAVES`; `CudaSeq::mma_split`).
    pub mma_waves: usize,
    /// Blocks per SM the tensor-core matvec's grid assumes (its `__launch_bounds__`): the
    /// `MMA_BLOCKS_PER_SM` of `MEGAGEMMA_CUDA_DEFINES` when set, else 2;
    /// `MEGAGEMMA_CUDA_MMA_BLOCKS_PER_SM` overrides it (for kernels read from `MEGAGEMMA_KERNELS`).
    pub mma_blocks_per_sm: usize,
    /// Most 64-column chunks in one column part of a split matvec (`MEGAGEMMA_CUDA_MMA_PART_CHUNKS`,
    /// default 40; part of the arithmetic, like `mma_waves`).
    pub mma_part_chunks: usize,
    /// Launched passes of up to four tokens stream the tensor-core matvec's weights through the
    /// megakernel's cp.async ring (`MEGAGEMMA_CUDA_MMA_RING=1`; same bits). Off by default.
    pub mma_ring: bool,
    /// Which launches of fewer virtual blocks than a round take fewer tiles per virtual block
    /// (`MEGAGEMMA_CUDA_MMA_FILL=0|1|2`, default 1; `MmaFill`). No result depends on it.
    pub mma_fill: MmaFill,
    /// Single-token launched passes use the single-token entries (`mma_one_kernel`;
    /// `MEGAGEMMA_CUDA_MMA_ONE=0`: the four-token ones with m = 1; same bits).
    pub mma_one: bool,
}

/// Which tensor-core matvec launches that fit in less than a round of virtual blocks are spread
/// over more of it: fewer tiles per virtual block (idle warps in each), as few as keep the launch
/// in one round. Each tile's sums stay in the same order, so no result depends on it.
/// Nineteenth session (H200, q4, three rounds in one call, docs/perf-notes.md): fill 1 against 0,
/// E4B's gate+up at 5 tiles a virtual block instead of 8 (256 virtual blocks instead of 160):
/// graph −1.3%, megakernel −1.2%; E2B (its double-wide gate+up, 192 → 256) +0.5% / +0.4%.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmaFill {
    /// Eight tiles per virtual block over one warp each, or 8 / ks over ks warps each.
    Off,
    /// Launches of one warp per tile (`1`, the default).
    OneWarpTiles,
    /// Every launch (`2`).
    All,
}

/// A tuning knob from the environment: `name` parsed as a count within `range`, else `default`.
pub(crate) fn env_count(name: &str, range: std::ops::RangeInclusive<usize>, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).filter(|v| range.contains(v)).unwrap_or(default)
}

/// `NAME=N` in `MEGAGEMMA_CUDA_DEFINES`, N within `range`: a kernel experiment's count that the
/// host's grid or shared memory must follow (`MMA_BLOCKS_PER_SM`, `MMA_RING`).
fn defined_count(name: &str, range: std::ops::RangeInclusive<usize>) -> Option<usize> {
    let list = std::env::var("MEGAGEMMA_CUDA_DEFINES").ok()?;
    crate::compile::define_in(&list, name)?.parse().ok().filter(|n| range.contains(n))
}

impl Q4Stream {
    fn from_env() -> Q4Stream {
        let var = |name: &str, default: usize| env_count(name, 0..=64, default);
        Q4Stream {
            // Measured on the H200 (E4B, graph): 4 per SM and 1 ahead 4.11 ms/token; 2 and 2
            // 4.36 (one wave: the next kernel's blocks find no free SM slot until it ends).
            blocks_per_sm: var("MEGAGEMMA_CUDA_Q4_BLOCKS_PER_SM", 4).max(1),
            ahead: var("MEGAGEMMA_CUDA_Q4_AHEAD", 1),
            mma_ahead: var("MEGAGEMMA_CUDA_MMA_AHEAD", 0),
            // One wave: measured with 16-key attention splits, above ATT_SPLIT_KEYS (2 waves:
            // the seventh session's baseline; 3: slower in both paths).
            mma_waves: var("MEGAGEMMA_CUDA_MMA_WAVES", 1).max(1),
            // The kernels' `MMA_BLOCKS_PER_SM` (their register budget) when a define sets it, so
            // the grid and the split's round follow it without a second knob.
            mma_blocks_per_sm: var(
                "MEGAGEMMA_CUDA_MMA_BLOCKS_PER_SM",
                defined_count("MMA_BLOCKS_PER_SM", 1..=64).unwrap_or(2),
            )
            .max(1),
            mma_part_chunks: env_count("MEGAGEMMA_CUDA_MMA_PART_CHUNKS", 1..=4096, MMA_PART_CHUNKS),
            mma_ring: std::env::var("MEGAGEMMA_CUDA_MMA_RING").is_ok_and(|v| v == "1"),
            mma_one: std::env::var("MEGAGEMMA_CUDA_MMA_ONE").map_or(true, |v| v != "0"),
            mma_fill: match env_count("MEGAGEMMA_CUDA_MMA_FILL", 0..=2, 1) {
                0 => MmaFill::Off,
                1 => MmaFill::OneWarpTiles,
                _ => MmaFill::All,
            },
        }
    }
}

pub(crate) fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::msg(format!("CUDA {what}: {e:?}"))
}

/// A weight matrix as the kernels see it (`struct Mat` in `kernels/common.cuh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DevMat {
    pub w: u64,
    pub sb: u64,
    pub rows: i32,
    pub cols: i32,
    pub fmt: i32,
    pub gs: i32,
}

pub const FMT_F32: i32 = 0;
pub const FMT_BF16: i32 = 1;
pub const FMT_F16: i32 = 2;
pub const FMT_Q4: i32 = 3;
/// 4-bit affine in the tensor-core tiled layout (`tiled.rs`).
pub const FMT_Q4T: i32 = 4;

/// One kernel argument.
#[derive(Clone, Copy, Debug)]
pub enum Arg {
    Ptr(u64),
    I32(i32),
    U64(u64),
    F32(f32),
    Mat(DevMat),
}

impl Arg {
    fn as_mut_ptr(&mut self) -> *mut c_void {
        match self {
            Arg::Ptr(v) | Arg::U64(v) => v as *mut u64 as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
            Arg::Mat(m) => m as *mut DevMat as *mut c_void,
        }
    }
}

/// A raw device allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    /// Device pointer `offset` bytes in.
    pub fn at(&self, offset: usize) -> u64 {
        debug_assert!(offset <= self.bytes);
        self.ptr + offset as u64
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `Gpu::alloc` in this context and freed once.
            // The free synchronises the device: never during another thread's graph capture.
            crate::capture::device_wide(|| unsafe {
                let _ = result::free_sync(self.ptr);
            });
        }
    }
}

/// The megakernel's entry points (`kernels/megakernel.cu`): every stage kernel; all but the
/// CUDA-core and dense matvecs (whose calls cost the rest of the kernel registers) for passes of
/// up to four tokens of one sequence; the same for passes of five to eight tokens and batched steps.
pub const MK_ENTRIES: [&str; 3] = ["megakernel", "megakernel_lean", "megakernel_lean_wide"];

impl Drop for Gpu {
    /// Destroying the cuBLAS handle and unloading the modules synchronise the device: never
    /// during another thread's graph capture.
    fn drop(&mut self) {
        crate::capture::device_wide(|| {
            self.blas = None;
            self.funcs.clear();
            self.megakernel.take();
        });
    }
}

/// Page-locked host memory that kernels write through a mapped device pointer: what a decode step
/// hands the host (its argmax, `kv_commit_step`) arrives without a copy or an event on the stream,
/// and the host polls for it.
pub struct HostLog {
    host: *mut u64,
    /// The device's address of the same memory.
    pub dev: u64,
    len: usize,
    /// Bound again when the memory is freed (the drop may run on another thread).
    ctx: Arc<CudaContext>,
}

// SAFETY: the memory is owned by this value and only read through `read`.
unsafe impl Send for HostLog {}

impl HostLog {
    /// `len` zeroed u64 slots.
    pub fn new(gpu: &Gpu, len: usize) -> Result<HostLog> {
        gpu.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        // SAFETY: a fresh allocation of `len` u64s, zeroed before use, owned (and freed on drop)
        // by the value from here on; its device address comes from the driver.
        unsafe {
            let host = result::malloc_host(len * 8, sys::CU_MEMHOSTALLOC_DEVICEMAP)
                .map_err(|e| cuda_err("mapped host allocation", e))? as *mut u64;
            std::ptr::write_bytes(host, 0, len);
            let mut log = HostLog { host, dev: 0, len, ctx: gpu.ctx.clone() };
            sys::cuMemHostGetDevicePointer_v2(&mut log.dev, host as *mut c_void, 0)
                .result()
                .map_err(|e| cuda_err("mapped host pointer", e))?;
            Ok(log)
        }
    }

    /// Slot `i` (mod the length) as the device last wrote it.
    pub fn read(&self, i: usize) -> u64 {
        // SAFETY: in bounds and aligned; volatile, since the device writes it behind the compiler's back.
        unsafe { std::ptr::read_volatile(self.host.add(i % self.len)) }
    }

    /// Clears slot `i` (mod the length).
    pub fn clear(&self, i: usize) {
        // SAFETY: as `read`.
        unsafe { std::ptr::write_volatile(self.host.add(i % self.len), 0) }
    }
}

impl Drop for HostLog {
    fn drop(&mut self) {
        // The memory belongs to the context that allocated it.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_host` in `new`, freed once, with its context current.
            unsafe {
                let _ = result::free_host(self.host as *mut c_void);
            }
        }
    }
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    pub name: String,
    pub sms: u32,
    launches: AtomicU64,
    capturing: AtomicBool,
    /// Programmatic dependent launch for `PDL_KERNELS` (off below compute capability 9, with
    /// `MEGAGEMMA_CUDA_PDL=0`, and while profiling).
    pdl: bool,
    pub q4_stream: Q4Stream,
    /// Fewest keys one attention block takes (`MEGAGEMMA_CUDA_ATT_SPLIT_KEYS`, default
    /// [`ATT_SPLIT_KEYS`]); the split is part of the arithmetic (summation order), the same for
    /// decode and verify.
    pub att_split_keys: usize,
    /// One-token passes of one sequence run the attention entries built for them, with the head
    /// dim at compile time (`attention_1_256`, `attention_1_512`; `MEGAGEMMA_CUDA_ATT_ONE=0`: the
    /// general entry; the same bits).
    pub att_one: bool,
    /// Whether passes of up to eight tokens norm and rotate Q/K/V inside the attention kernel
    /// instead of a `qkv_norm_rope` stage (the same bits either way). By default (`None`) only in
    /// the megakernel's stage table, where a stage costs a grid-wide wait (E4B −2%); in the graph
    /// the separate stage overlaps its neighbours and fusing cost ~1% (docs/perf-notes.md, tenth
    /// session). `MEGAGEMMA_CUDA_FUSE_NORMS=0|1` forces it off or on.
    pub fuse_norms: Option<bool>,
    /// Split tensor-core launches whose output is a residual step's input add their column parts
    /// as 64-bit integers (`matvec_sum` in src/seq/stages.rs; the kernels' `FIXED_SUMS`, the
    /// default) instead of combining them in part order (the define `ORDERED_SUMS` in
    /// `MEGAGEMMA_CUDA_DEFINES`: off).
    pub fixed_sums: bool,
    /// `MEGAGEMMA_CUDA_PROFILE=1`: every launch is synchronised and timed, per kernel name.
    profile: Option<std::sync::Mutex<HashMap<String, (u64, f64)>>>,
    /// cuBLAS on the same stream, for the matrix products of long passes (`src/long_pass.rs`);
    /// `None` without libcublas or with `MEGAGEMMA_CUDA_CUBLAS=0` (passes then take the matvecs).
    pub blas: Option<CudaBlas>,
    /// While recording (the megakernel's stage table), launches are kept here instead of run.
    recording: std::sync::Mutex<Option<Vec<Recorded>>>,
    recording_on: AtomicBool,
    /// The megakernel (`kernels/megakernel.cu`), compiled on first use.
    megakernel: std::sync::OnceLock<Vec<CudaFunction>>,
    arch: String,
    device_key: String,
}

/// A launch kept while recording.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub name: String,
    pub grid: (u32, u32),
    pub block: u32,
    pub smem: u32,
    pub args: Vec<Arg>,
}

// SAFETY: the context and stream handles may be used from any thread (the driver API is
// thread-safe; every call binds the context first); kernel launches are serialised by the
// caller holding `&mut CudaSeq`.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Opens device 0, compiles (or loads from the cache) every kernel module. All of it runs as
    /// one device-wide call (context, stream, module loads, cuBLAS handle; the NVRTC compilation
    /// too, which a cold kernel cache makes long for other threads waiting to capture).
    pub fn new() -> Result<Gpu> {
        crate::capture::device_wide(Gpu::open)
    }

    fn open() -> Result<Gpu> {
        if !driver_present() {
            bail!("no CUDA device found: the CUDA driver library (libcuda.so.1) could not be loaded");
        }
        let count = CudaContext::device_count().map_err(|e| Error::msg(format!("no CUDA device found: {e:?}")))?;
        if count < 1 {
            bail!("no CUDA device found: the driver reports {count} devices");
        }
        if !nvrtc_present() {
            bail!("libnvrtc.so.13 not found: set MEGAGEMMA_CUDA_LIB_DIR to the directory that holds it");
        }
        let ctx = CudaContext::new(0).map_err(|e| Error::msg(format!("no CUDA device found: device 0: {e:?}")))?;
        // SAFETY: this crate orders all work on one stream itself.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().map_err(|e| cuda_err("device name", e))?;
        let (maj, min) = ctx.compute_capability().map_err(|e| cuda_err("compute capability", e))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda_err("SM count", e))? as u32;
        let mut driver = 0i32;
        // SAFETY: one out-parameter.
        unsafe { sys::cuDriverGetVersion(&mut driver) }.result().map_err(|e| cuda_err("driver version", e))?;
        let arch = if maj >= 9 { format!("{maj}{min}a") } else { format!("{maj}{min}") };
        let device_key = format!("{name} sm_{arch} driver {driver}");
        let stream = ctx.new_stream().map_err(|e| cuda_err("stream", e))?;
        let mut funcs = HashMap::new();
        for (file, names) in FUNCTIONS {
            debug_assert!(KERNEL_FILES.iter().any(|(f, _)| *f == file));
            let cubin = cubin_for(file, &arch, &device_key)?;
            let module = ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| cuda_err(&format!("load {file}"), e))?;
            for &n in names {
                let f = module.load_function(n).map_err(|e| cuda_err(&format!("function {n}"), e))?;
                funcs.insert(n, f);
            }
        }
        // Attention keeps one score per key in shared memory: allow up to 200 KB (50k keys).
        for name in ["attention", "attention_1_256", "attention_1_512"] {
            funcs[name]
                .set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 200 * 1024)
                .map_err(|e| cuda_err("attention smem", e))?;
        }
        // The tensor-core matvecs keep a slice of input fragments (up to 48 KB) beside 4 KB of sums,
        // the ring form its weights' rings too (up to 48 KB).
        for name in MMA_KERNELS {
            let kb = if name.contains("_ring") { 110 } else { 60 };
            funcs[name]
                .set_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kb * 1024)
                .map_err(|e| cuda_err("matvec smem", e))?;
        }
        let profile = (std::env::var("MEGAGEMMA_CUDA_PROFILE").is_ok_and(|v| v == "1")).then(Default::default);
        let pdl = maj >= 9 && profile.is_none() && std::env::var("MEGAGEMMA_CUDA_PDL").map_or(true, |v| v != "0");
        let blas = match std::env::var("MEGAGEMMA_CUDA_CUBLAS").map_or(true, |v| v != "0") && cublas_present() {
            true => Some(CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cuBLAS", e))?),
            false => None,
        };
        Ok(Gpu {
            ctx,
            stream,
            funcs,
            name,
            sms,
            launches: AtomicU64::new(0),
            capturing: AtomicBool::new(false),
            pdl,
            q4_stream: Q4Stream::from_env(),
            att_split_keys: env_count("MEGAGEMMA_CUDA_ATT_SPLIT_KEYS", 1..=4096, ATT_SPLIT_KEYS),
            att_one: std::env::var("MEGAGEMMA_CUDA_ATT_ONE").map_or(true, |v| v != "0"),
            fuse_norms: std::env::var("MEGAGEMMA_CUDA_FUSE_NORMS").ok().and_then(|v| match v.as_str() {
                "0" => Some(false),
                "1" => Some(true),
                _ => None,
            }),
            fixed_sums: !std::env::var("MEGAGEMMA_CUDA_DEFINES")
                .is_ok_and(|list| crate::compile::define_named(&list, "ORDERED_SUMS")),
            profile,
            blas,
            recording: Default::default(),
            recording_on: AtomicBool::new(false),
            megakernel: Default::default(),
            arch,
            device_key,
        })
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        // SAFETY: a plain device allocation of at least one byte.
        let ptr = crate::capture::device_wide(|| unsafe { result::malloc_sync(bytes.max(1)) })
            .map_err(|e| cuda_err(&format!("allocating {} MB", bytes >> 20), e))?;
        Ok(DevBuf { ptr, bytes, ctx: self.ctx.clone() })
    }

    /// Zero-filled allocation (ordered on the stream).
    pub fn alloc_zeros(&self, bytes: usize) -> Result<DevBuf> {
        let b = self.alloc(bytes)?;
        // SAFETY: `b` is `bytes` long.
        unsafe { result::memset_d8_async(b.ptr, 0, bytes, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("memset", e))?;
        Ok(b)
    }

    /// Host → device copy of `src` to `dst` (ordered on the stream; returns once `src` is read).
    pub fn upload<T>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        // SAFETY: the caller sized `dst` for `src`; the synchronous copy finishes reading `src`.
        unsafe {
            result::memcpy_htod_async(dst, src, self.stream.cu_stream()).map_err(|e| cuda_err("upload", e))?;
        }
        self.sync()
    }

    /// Device → host copy into `dst` (waits for the stream).
    pub fn download<T>(&self, dst: &mut [T], src: u64) -> Result<()> {
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        // SAFETY: the caller sized `src` for `dst`; synchronised before `dst` is used.
        unsafe {
            result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()).map_err(|e| cuda_err("download", e))?;
        }
        self.sync()
    }

    /// Device → device copy of `bytes` (ordered on the stream).
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        // SAFETY: the caller sized both allocations for `bytes`; both live on this context.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("device copy", e))
    }

    /// Whether all work queued on the stream has finished (an error if some of it failed).
    pub fn stream_done(&self) -> Result<bool> {
        // SAFETY: a query of this context's live stream.
        match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
            sys::cudaError_enum::CUDA_SUCCESS => Ok(true),
            sys::cudaError_enum::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(cuda_err("stream query", e)),
        }
    }

    /// Device memory free now and in all, in bytes.
    pub fn memory(&self) -> Result<(usize, usize)> {
        self.ctx.bind_to_thread().map_err(|e| cuda_err("bind", e))?;
        result::mem_get_info().map_err(|e| cuda_err("memory query", e))
    }

    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| cuda_err("synchronize", e))
    }

    /// Launches kernel `name` on a 1-D grid.
    pub fn launch(&self, name: &str, grid: u32, block: u32, smem: u32, args: &[Arg]) -> Result<()> {
        self.launch_2d(name, (grid, 1), block, smem, args)
    }

    /// [`Gpu::launch`] with a two-dimensional grid `(x, y)`.
    pub fn launch_2d(&self, name: &str, grid2: (u32, u32), block: u32, smem: u32, args: &[Arg]) -> Result<()> {
        let (grid, grid_y) = grid2;
        if grid == 0 || grid_y == 0 {
            return Ok(());
        }
        if self.recording_on.load(Ordering::Relaxed) {
            let mut rec = self.recording.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(r) = rec.as_mut() {
                r.push(Recorded { name: name.to_string(), grid: grid2, block, smem, args: args.to_vec() });
                return Ok(());
            }
        }
        let f = match self.funcs.get(name) {
            Some(f) => f,
            None if MK_ENTRIES.contains(&name) => self.megakernel_fn(name)?,
            None => bail!("no kernel named {name}"),
        };
        let mut args = args.to_vec();
        let mut ptrs: Vec<*mut c_void> = args.iter_mut().map(Arg::as_mut_ptr).collect();
        if !self.capturing.load(Ordering::Relaxed) {
            self.count_launch();
        }
        let start = self.profile_start()?;
        let launched = if self.pdl && (MMA_KERNELS.contains(&name) || PDL_KERNELS.contains(&name)) {
            // SAFETY: as below; the attribute array outlives the call.
            unsafe {
                let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
                attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attr.value.programmaticStreamSerializationAllowed = 1;
                let config = sys::CUlaunchConfig {
                    gridDimX: grid,
                    gridDimY: grid_y,
                    gridDimZ: 1,
                    blockDimX: block,
                    blockDimY: 1,
                    blockDimZ: 1,
                    sharedMemBytes: smem,
                    hStream: self.stream.cu_stream(),
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                sys::cuLaunchKernelEx(&config, f.cu_function(), ptrs.as_mut_ptr(), std::ptr::null_mut()).result()
            }
        } else {
            // SAFETY: argument lists match the kernels' signatures (see kernels/*.cu); every
            // pointer is a live device allocation sized by the caller.
            unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    (grid, grid_y, 1),
                    (block, 1, 1),
                    smem,
                    self.stream.cu_stream(),
                    &mut ptrs,
                )
            }
        };
        launched.map_err(|e| cuda_err(&format!("launch {name}"), e))?;
        self.profile_end(start, || match args.first() {
            Some(Arg::Mat(m)) => format!("{name} {}x{} grid {grid}", m.rows, m.cols),
            _ => format!("{name} grid {grid}"),
        })
    }

    /// Work enqueued outside [`Gpu::launch`] (cuBLAS), timed under `key` when profiling.
    pub fn timed(&self, key: impl FnOnce() -> String, work: impl FnOnce() -> Result<()>) -> Result<()> {
        let start = self.profile_start()?;
        work()?;
        self.profile_end(start, key)
    }

    /// When profiling (and not capturing a graph): waits for the stream and starts a clock.
    fn profile_start(&self) -> Result<Option<std::time::Instant>> {
        if self.profile.is_none() || self.capturing.load(Ordering::Relaxed) {
            return Ok(None);
        }
        self.sync()?;
        Ok(Some(std::time::Instant::now()))
    }

    /// Waits for the work started at `start` and adds its time under `key`.
    fn profile_end(&self, start: Option<std::time::Instant>, key: impl FnOnce() -> String) -> Result<()> {
        let (Some(p), Some(t0)) = (&self.profile, start) else { return Ok(()) };
        self.sync()?;
        let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
        let e = p.entry(key()).or_default();
        e.0 += 1;
        e.1 += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Starts keeping launches instead of running them (see [`Gpu::stop_recording`]).
    pub fn start_recording(&self) {
        *self.recording.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
        self.recording_on.store(true, Ordering::Relaxed);
    }

    /// Whether launches are being kept (a megakernel stage table is being recorded).
    pub fn is_recording(&self) -> bool {
        self.recording_on.load(Ordering::Relaxed)
    }

    /// The launches kept since [`Gpu::start_recording`], in order; launches run again.
    pub fn stop_recording(&self) -> Vec<Recorded> {
        self.recording_on.store(false, Ordering::Relaxed);
        self.recording.lock().unwrap_or_else(|e| e.into_inner()).take().unwrap_or_default()
    }

    /// The megakernel's entry points (`MK_ENTRIES`), compiled (or read from the kernel cache) on
    /// first use.
    pub fn megakernel_fn(&self, name: &str) -> Result<&CudaFunction> {
        let fs = match self.megakernel.get() {
            Some(fs) => fs,
            None => {
                let cubin = cubin_for("megakernel.cu", &self.arch, &self.device_key)?;
                let module = crate::capture::device_wide(|| self.ctx.load_module(Ptx::from_binary(cubin)))
                    .map_err(|e| cuda_err("load megakernel.cu", e))?;
                let mut fs = Vec::new();
                for n in MK_ENTRIES {
                    let f = module.load_function(n).map_err(|e| cuda_err(&format!("function {n}"), e))?;
                    f.set_attribute(
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        crate::megakernel::MK_SMEM_MAX as i32,
                    )
                    .map_err(|e| cuda_err("megakernel smem", e))?;
                    fs.push(f);
                }
                self.megakernel.get_or_init(|| fs)
            }
        };
        match MK_ENTRIES.iter().position(|&n| n == name) {
            Some(i) => Ok(&fs[i]),
            None => bail!("no megakernel entry named {name}"),
        }
    }

    /// While set, kernel launches are being captured into a graph and are not counted.
    pub fn set_capturing(&self, on: bool) {
        self.capturing.store(on, Ordering::Relaxed);
    }

    /// Counts one launch (a kernel or a whole graph).
    pub fn count_launch(&self) {
        self.launches.fetch_add(1, Ordering::Relaxed);
    }

    /// With `MEGAGEMMA_CUDA_PROFILE=1`: `(kernel, launches, seconds)` so far, slowest first; then cleared.
    pub fn take_profile(&self) -> Vec<(String, u64, f64)> {
        let Some(p) = &self.profile else { return vec![] };
        let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
        let mut v: Vec<_> = p.drain().map(|(k, (n, s))| (k, n, s)).collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    }

    /// Launches so far (kernels, and graphs as one each).
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::{mma_kernel, mma_one_kernel, mma_prep_kernels, MMA_KERNELS};

    /// Every (token groups, g32, gated, ring) names the entry of that shape, and the ring form
    /// falls back to the register form where it has no entry (eight tokens).
    #[test]
    fn mma_kernel_names_match_their_shape() {
        for h in 1..=2 {
            for g32 in [false, true] {
                for gated in [false, true] {
                    for ring in [false, true] {
                        let name = mma_kernel(h, g32, gated, ring);
                        assert!(name.starts_with(&format!("matvec_q4t_{}", 4 * h)), "{name}");
                        assert_eq!(name.contains("_g32"), g32, "{name}");
                        assert_eq!(name.ends_with("_gated"), gated, "{name}");
                        assert_eq!(name.contains("_ring"), ring && h == 1, "{name}");
                    }
                }
            }
        }
        for h in 1..=2 {
            for g32 in [false, true] {
                let (step, mv) = mma_prep_kernels(h, g32);
                assert_eq!(mv, format!("{}_prep", mma_kernel(h, g32, false, false)));
                let shape = mma_kernel(h, g32, false, false).trim_start_matches("matvec_q4t");
                assert_eq!(step, format!("add_norm_prep{shape}"));
            }
        }
        for g32 in [false, true] {
            for gated in [false, true] {
                let four = mma_kernel(1, g32, gated, false);
                assert_eq!(mma_one_kernel(g32, gated), four.replacen("matvec_q4t_4", "matvec_q4t_1", 1));
            }
        }
        let mut all: Vec<&str> = MMA_KERNELS.to_vec();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), MMA_KERNELS.len(), "duplicate entry names");
    }
}
