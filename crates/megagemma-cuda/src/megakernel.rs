//! The decode step in one persistent launch (`kernels/megakernel.cu`), first version: the step's
//! kernel launches are recorded once per sequence (the same calls the graph captures) into a table
//! of stages in device memory, and one co-resident grid runs them in order through the kernels'
//! own device functions, a grid-wide counter between stages. Results are bit-identical to the
//! graph path (`gpu_check megakernel`). Selected with `MEGAGEMMA_CUDA_DECODE=megakernel`.

use crate::device::{cuda_err, Arg, DevBuf, Gpu, Recorded, MMA_KERNELS};
use megagemma_model::{bail, Result};

/// Kernels the megakernel runs, by stage id (the `case`s of `mk_dispatch` in `megakernel.cu`).
pub const MK_KERNELS: [&str; 23] = [
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
    "matvec",
    "matvec_q4",
    "matvec_q4_gated",
    "attention",
    MMA_KERNELS[0],
    MMA_KERNELS[1],
    MMA_KERNELS[2],
    MMA_KERNELS[3],
    MMA_KERNELS[4],
    MMA_KERNELS[5],
    MMA_KERNELS[6],
    MMA_KERNELS[7],
];

/// Argument slots of a stage (`MK_ARGS`).
const MK_ARGS: usize = 26;
/// Threads per block: every stage kernel of a decode step is launched with this many (or fewer).
const MK_THREADS: u32 = 256;
/// Blocks per SM the megakernel's registers allow (`__launch_bounds__(256, 2)`).
const MK_BLOCKS_PER_SM: u32 = 2;
/// Dynamic shared memory the megakernel may use (`megakernel_fn` sets it).
const MK_SMEM_MAX: u32 = 96 * 1024;

/// One stage as the device reads it (`struct MkStage`).
#[repr(C)]
#[derive(Clone, Copy)]
struct MkStage {
    kernel: i32,
    grid: i32,
    waits_itself: i32,
    pad: i32,
    a: [u64; MK_ARGS],
}

impl MkStage {
    fn new(r: &Recorded) -> Result<MkStage> {
        let Some(kernel) = MK_KERNELS.iter().position(|&k| k == r.name) else {
            bail!("the megakernel does not run kernel {} yet", r.name)
        };
        if r.grid.1 != 1 || r.block > MK_THREADS {
            bail!(
                "the megakernel runs 1-D stages of at most {MK_THREADS} threads ({}: {:?} × {})",
                r.name,
                r.grid,
                r.block
            );
        }
        let mut a = [0u64; MK_ARGS];
        let mut i = 0;
        for arg in &r.args {
            let words: &[u64] = &match *arg {
                Arg::Ptr(v) | Arg::U64(v) => [v, 0, 0, 0],
                Arg::I32(v) => [v as u32 as u64, 0, 0, 0],
                Arg::F32(v) => [v.to_bits() as u64, 0, 0, 0],
                Arg::Mat(m) => [
                    m.w,
                    m.sb,
                    (m.rows as u32 as u64) | ((m.cols as u32 as u64) << 32),
                    (m.fmt as u32 as u64) | ((m.gs as u32 as u64) << 32),
                ],
            }[..if matches!(arg, Arg::Mat(_)) { 4 } else { 1 }];
            if i + words.len() > MK_ARGS {
                bail!("{}: more than {MK_ARGS} argument slots", r.name);
            }
            a[i..i + words.len()].copy_from_slice(words);
            i += words.len();
        }
        // Every kernel the megakernel runs waits inside its body (`pdl_start()`).
        Ok(MkStage { kernel: kernel as i32, grid: r.grid.0 as i32, waits_itself: 1, pad: 0, a })
    }
}

/// A sequence's recorded decode step on the device, and its counter.
pub(crate) struct Megakernel {
    table: DevBuf,
    stages: usize,
    grid: u32,
    smem: u32,
    /// Per stage (128 bytes apart): blocks that finished it, over all launches; `gen` launches so far.
    counters: DevBuf,
    gen: u32,
    err: DevBuf,
}

impl Megakernel {
    /// Uploads the recorded launches of one decode step as a stage table.
    pub(crate) fn new(gpu: &Gpu, recorded: &[Recorded]) -> Result<Megakernel> {
        let stages: Vec<MkStage> = recorded.iter().map(MkStage::new).collect::<Result<_>>()?;
        let smem = recorded.iter().map(|r| r.smem).max().unwrap_or(0);
        if smem > MK_SMEM_MAX {
            bail!("a stage needs {smem} bytes of shared memory: the megakernel has {MK_SMEM_MAX}");
        }
        let f = gpu.megakernel_fn()?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(MK_THREADS, smem as usize, None)
            .map_err(|e| cuda_err("megakernel occupancy", e))?
            .min(MK_BLOCKS_PER_SM);
        if per_sm == 0 {
            bail!("the megakernel does not fit on an SM");
        }
        // SAFETY of the layout: MkStage is repr(C) plain data, uploaded as bytes.
        let table = gpu.alloc(std::mem::size_of_val(stages.as_slice()))?;
        gpu.upload(table.ptr, &stages)?;
        let (counters, err) = (gpu.alloc_zeros(stages.len() * 128)?, gpu.alloc_zeros(4)?);
        Ok(Megakernel { table, stages: stages.len(), grid: per_sm * gpu.sms, smem, counters, gen: 0, err })
    }

    /// Stages per token.
    pub(crate) fn stages(&self) -> usize {
        self.stages
    }

    /// Blocks of the persistent grid.
    pub(crate) fn grid(&self) -> u32 {
        self.grid
    }

    /// Enqueues one decode step. `skew` shifts what the waits expect (a test of the timeout: a
    /// large skew can never be met).
    pub(crate) fn launch(&mut self, gpu: &Gpu, skew: u32) -> Result<()> {
        // MEGAGEMMA_CUDA_MK_STEPWISE=1: one launch per stage (a debugging aid: the stages' order
        // is then kept by the stream as well as by the counter).
        let stepwise = std::env::var("MEGAGEMMA_CUDA_MK_STEPWISE").is_ok_and(|v| v == "1");
        let per_launch = if stepwise { 1 } else { self.stages };
        self.gen = self.gen.wrapping_add(1);
        for first in (0..self.stages).step_by(per_launch) {
            let args = [
                Arg::Ptr(self.table.ptr + (first * std::mem::size_of::<MkStage>()) as u64),
                Arg::I32(per_launch as i32),
                Arg::Ptr(self.counters.ptr + (first * 128) as u64),
                Arg::I32(self.gen.wrapping_add(skew) as i32),
                Arg::Ptr(self.err.ptr),
            ];
            gpu.launch("megakernel", self.grid, MK_THREADS, self.smem, &args)?;
        }
        Ok(())
    }

    /// After the stream has run a launch: an error if a wait timed out (the counter and the
    /// error flag are reset, so the next launch starts clean).
    pub(crate) fn check(&mut self, gpu: &Gpu) -> Result<()> {
        let mut err = [0u32];
        gpu.download(&mut err, self.err.ptr)?;
        if err[0] != 0 {
            gpu.upload(self.counters.ptr, &vec![0u32; self.stages * 32])?;
            gpu.upload(self.err.ptr, &[0u32])?;
            self.gen = 0;
            bail!("megakernel: a block waited more than a second for a stage (schedule error); the step was abandoned");
        }
        Ok(())
    }
}
