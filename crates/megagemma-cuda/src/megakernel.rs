//! The decode step in one persistent launch (`kernels/megakernel.cu`), first version: the step's
//! kernel launches are recorded once per sequence (the same calls the graph captures) into a table
//! of stages in device memory, and one co-resident grid runs them in order through the kernels'
//! own device functions, a counter per stage. Results are bit-identical to the graph path
//! (`gpu_check megakernel`). Selected with `--decode megakernel` or `MEGAGEMMA_CUDA_DECODE=megakernel`.

use crate::device::{cuda_err, mma_ring_bytes, Arg, DevBuf, Gpu, Recorded, MK_ENTRIES, MMA_KERNELS};
use megagemma_model::{bail, Result};

/// Kernels the megakernel runs, by stage id (the `case`s of `mk_dispatch` in `megakernel.cu`).
pub const MK_KERNELS: [&str; 29] = [
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
    "kv_commit_step",
    "kv_commit_columns",
    "router_scale",
    "moe_route",
    "matvec_experts",
    "moe_combine",
];

/// Stage kernels only the general entry runs (`megakernel_lean` reports them as unknown stages):
/// the CUDA-core and dense matvecs, and a mixture-of-experts layer's own stages.
const NOT_LEAN: [&str; 7] =
    ["matvec", "matvec_q4", "matvec_q4_gated", "router_scale", "moe_route", "matvec_experts", "moe_combine"];
/// Tensor-core stages of five to eight tokens and a batched step's commits: the general and
/// `megakernel_lean_wide` entries run them, `megakernel_lean` does not (a decode step's entry
/// carries none of their code).
const WIDE: [&str; 5] = [MMA_KERNELS[1], MMA_KERNELS[3], MMA_KERNELS[5], MMA_KERNELS[7], "kv_commit_columns"];

/// Argument slots of a stage (`MK_ARGS`).
const MK_ARGS: usize = 32;
/// Threads per block: every stage kernel of a decode step is launched with this many (or fewer).
const MK_THREADS: u32 = 256;
/// Blocks per SM the megakernel's registers allow (`__launch_bounds__(256, 2)`).
const MK_BLOCKS_PER_SM: u32 = 2;
/// Dynamic shared memory the megakernel may use (`Gpu::megakernel_fn` sets it).
pub(crate) const MK_SMEM_MAX: u32 = 96 * 1024;

/// Shared memory of a residual-step stage: its norm weights, `[2][RES_F4][MK_THREADS]` float4s
/// (`add_norm_body` in `kernels/common.cuh`).
const ADD_NORM_MK_SMEM: u32 = 2 * 3 * MK_THREADS * 16;

/// One stage as the device reads it (`struct MkStage`).
#[repr(C)]
#[derive(Clone, Copy)]
struct MkStage {
    kernel: i32,
    grid: i32,
    waits_itself: i32,
    /// Bit i: at this stage's start each block asks L2 for its share of stage s + 1 + i's weights
    /// (a tensor-core matvec stage; `prefetch_plan`).
    prefetch: u32,
    a: [u64; MK_ARGS],
}

/// Whether stage kernel `id` (an index of `MK_KERNELS`) is a tensor-core matvec.
fn is_mma(id: i32) -> bool {
    MK_KERNELS.get(id as usize).is_some_and(|n| MMA_KERNELS.contains(n))
}

/// Which later matvec stages each stage asks L2 for (`MkStage::prefetch`). Weights never depend
/// on activations, and HBM idles between a layer's matvecs (q/k/v norms, attention: ~20 µs per
/// E4B layer), so at the first stage after a run of matvec stages every block asks L2 for the next
/// `count` matvec stages within 8 stages (the O projection and gate+up: 36 MB for E4B, within
/// L2). Never during a matvec stage: there the next one's bytes competed with the stage's own
/// (E4B 5.70 → 6.16 ms when every stage prefetched the next matvec).
fn prefetch_plan(kernels: &[i32], count: usize) -> Vec<u32> {
    (0..kernels.len())
        .map(|s| {
            if count == 0 || s == 0 || is_mma(kernels[s]) || !is_mma(kernels[s - 1]) {
                return 0;
            }
            (0..8)
                .filter(|i| kernels.get(s + 1 + i).is_some_and(|&k| is_mma(k)))
                .take(count)
                .fold(0u32, |m, i| m | 1 << i)
        })
        .collect()
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
        Ok(MkStage { kernel: kernel as i32, grid: r.grid.0 as i32, waits_itself: 1, prefetch: 0, a })
    }
}

/// A sequence's recorded decode step on the device, and its counters.
pub(crate) struct Megakernel {
    /// Which of `MK_ENTRIES` runs this table.
    entry: &'static str,
    /// `MEGAGEMMA_CUDA_MK_STEPWISE=1`: one launch per stage (a debugging aid: the stages' order is
    /// then kept by the stream as well as by the counter).
    stepwise: bool,
    table: DevBuf,
    stages: usize,
    /// Each stage's kernel, for the trace.
    names: Vec<&'static str>,
    /// `[blocks][stages][3]` timestamps of the last launch, when tracing.
    trace: Option<DevBuf>,
    grid: u32,
    smem: u32,
    /// Per stage (128 bytes apart): blocks that finished it, over all launches; `gen` launches so far.
    counters: DevBuf,
    gen: u32,
    err: DevBuf,
}

impl Megakernel {
    /// Uploads the recorded launches of one decode step as a stage table (with a trace buffer
    /// when `trace`).
    pub(crate) fn new(gpu: &Gpu, recorded: &[Recorded], trace: bool) -> Result<Megakernel> {
        let mut stages: Vec<MkStage> = recorded.iter().map(MkStage::new).collect::<Result<_>>()?;
        // `MEGAGEMMA_CUDA_MK_PREFETCH=N`: at the first stage after a layer's matvecs, the next N
        // matvec stages' weights into L2 (default 0 until measured; results never depend on it).
        let ahead = crate::device::env_count("MEGAGEMMA_CUDA_MK_PREFETCH", 0..=8, 0);
        let kernels: Vec<i32> = stages.iter().map(|s| s.kernel).collect();
        for (s, p) in stages.iter_mut().zip(prefetch_plan(&kernels, ahead)) {
            s.prefetch = p;
        }
        // Each tensor-core matvec keeps its warps' cp.async rings after its inputs; a residual step
        // copies its norm weights there before its wait.
        let smem = recorded
            .iter()
            .map(|r| match r.name.as_str() {
                n if n.starts_with("matvec_q4t_") => r.smem + mma_ring_bytes(if n.contains("g32") { 2 } else { 1 }),
                "add_norm" => r.smem.max(ADD_NORM_MK_SMEM),
                _ => r.smem,
            })
            .max()
            .unwrap_or(0);
        // `MEGAGEMMA_CUDA_MK_SMEM_EXTRA=BYTES`: more dynamic shared memory than the stages use, for
        // measuring what the L1 cache left beside it is worth (the two share each SM's 256 KB).
        let smem = smem + crate::device::env_count("MEGAGEMMA_CUDA_MK_SMEM_EXTRA", 0..=65536, 0) as u32;
        if smem > MK_SMEM_MAX {
            bail!("a stage needs {smem} bytes of shared memory: the megakernel has {MK_SMEM_MAX}");
        }
        // A lean entry when no stage needs the CUDA-core or dense matvecs: the one for passes of up
        // to four tokens of one sequence unless a tensor-core stage takes more or the pass is a
        // batched step.
        let named = |names: &[&str]| stages.iter().any(|s| names.contains(&MK_KERNELS[s.kernel as usize]));
        let entry = match (named(&NOT_LEAN), named(&WIDE)) {
            (true, _) => MK_ENTRIES[0],
            (false, false) => MK_ENTRIES[1],
            (false, true) => MK_ENTRIES[2],
        };
        let f = gpu.megakernel_fn(entry)?;
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
        let grid = per_sm * gpu.sms;
        let names = stages.iter().map(|s| MK_KERNELS[s.kernel as usize]).collect();
        let trace = if trace { Some(gpu.alloc_zeros(grid as usize * stages.len() * 3 * 8)?) } else { None };
        let stepwise = std::env::var("MEGAGEMMA_CUDA_MK_STEPWISE").is_ok_and(|v| v == "1");
        Ok(Megakernel { entry, stepwise, table, stages: stages.len(), names, trace, grid, smem, counters, gen: 0, err })
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
        let stepwise = self.stepwise;
        let per_launch = if stepwise { 1 } else { self.stages };
        self.gen = self.gen.wrapping_add(1);
        for first in (0..self.stages).step_by(per_launch) {
            let args = [
                Arg::Ptr(self.table.ptr + (first * std::mem::size_of::<MkStage>()) as u64),
                Arg::I32(per_launch as i32),
                Arg::Ptr(self.counters.ptr + (first * 128) as u64),
                Arg::I32(self.gen.wrapping_add(skew) as i32),
                Arg::Ptr(self.err.ptr),
                // The trace indexes stages within a launch: only whole-token launches are traced.
                Arg::Ptr(self.trace.as_ref().filter(|_| !stepwise).map_or(0, |t| t.ptr)),
            ];
            gpu.launch(self.entry, self.grid, MK_THREADS, self.smem, &args)?;
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
            bail!(
                "megakernel: a block waited more than a second for a stage, or met a stage it cannot run \
                 (schedule error); the step was abandoned"
            );
        }
        Ok(())
    }
}

impl Megakernel {
    /// The last launch's trace (after the stream has run it), when tracing.
    pub(crate) fn trace(&self, gpu: &Gpu) -> Result<Option<MkTrace>> {
        let Some(buf) = &self.trace else { return Ok(None) };
        let mut t = vec![0u64; self.grid as usize * self.stages * 3];
        gpu.download(&mut t, buf.ptr)?;
        Ok(Some(MkTrace { grid: self.grid as usize, stages: self.names.clone(), t }))
    }
}

/// One megakernel token as each block saw it: per (block, stage) the `%globaltimer` nanoseconds at
/// the stage's start, when its wait was satisfied (0: it did not wait) and at its end.
pub struct MkTrace {
    pub grid: usize,
    pub stages: Vec<&'static str>,
    /// `[grid][stages][3]`.
    pub t: Vec<u64>,
}

/// Where a traced token's time went, per stage kernel.
#[derive(Clone, Debug)]
pub struct MkKindTime {
    pub kernel: &'static str,
    pub stages: usize,
    /// Token time attributed to these stages: from the previous stage's last block to finish to
    /// this stage's last block to finish, summed.
    pub critical_us: f64,
    /// Mean over the blocks that waited, of the wait (start to satisfied), µs.
    pub wait_us: f64,
    /// Mean over the blocks that worked, of the time from the wait (or the start) to the end, µs.
    pub work_us: f64,
}

impl MkTrace {
    fn at(&self, block: usize, stage: usize) -> [u64; 3] {
        let i = 3 * (block * self.stages.len() + stage);
        [self.t[i], self.t[i + 1], self.t[i + 2]]
    }

    /// Wall time of the token, µs (first start to last end).
    pub fn total_us(&self) -> f64 {
        let n = self.stages.len();
        let first = (0..self.grid).map(|b| self.at(b, 0)[0]).min().unwrap_or(0);
        let last = (0..self.grid).map(|b| self.at(b, n - 1)[2]).max().unwrap_or(0);
        last.saturating_sub(first) as f64 / 1e3
    }

    /// Per stage kernel: stages, attributed token time, mean wait and work; largest first.
    pub fn by_kernel(&self) -> Vec<MkKindTime> {
        let mut out: Vec<MkKindTime> = Vec::new();
        let mut prev_end = (0..self.grid).map(|b| self.at(b, 0)[0]).min().unwrap_or(0);
        for (s, &name) in self.stages.iter().enumerate() {
            let rows: Vec<[u64; 3]> = (0..self.grid).map(|b| self.at(b, s)).collect();
            let end = rows.iter().map(|r| r[2]).max().unwrap_or(prev_end);
            let waited: Vec<&[u64; 3]> = rows.iter().filter(|r| r[1] != 0).collect();
            let mean =
                |v: Vec<u64>| if v.is_empty() { 0.0 } else { v.iter().sum::<u64>() as f64 / v.len() as f64 / 1e3 };
            let wait = mean(waited.iter().map(|r| r[1].saturating_sub(r[0])).collect());
            let work = mean(waited.iter().map(|r| r[2].saturating_sub(r[1])).collect());
            let k = match out.iter().position(|k| k.kernel == name) {
                Some(i) => i,
                None => {
                    out.push(MkKindTime { kernel: name, stages: 0, critical_us: 0.0, wait_us: 0.0, work_us: 0.0 });
                    out.len() - 1
                }
            };
            let e = &mut out[k];
            // Running means over this kernel's stages.
            e.wait_us = (e.wait_us * e.stages as f64 + wait) / (e.stages + 1) as f64;
            e.work_us = (e.work_us * e.stages as f64 + work) / (e.stages + 1) as f64;
            e.stages += 1;
            e.critical_us += end.saturating_sub(prev_end) as f64 / 1e3;
            prev_end = end.max(prev_end);
        }
        out.sort_by(|a, b| b.critical_us.total_cmp(&a.critical_us));
        out
    }

    /// Where the token's time went, one line per stage kernel (largest first).
    pub fn table(&self) -> String {
        let mut out = format!(
            "traced step: {:.1} us, {} stages on {} blocks; per stage kernel (token time, mean wait, mean work):\n",
            self.total_us(),
            self.stages.len(),
            self.grid
        );
        for k in self.by_kernel() {
            out += &format!(
                "    {:<26} {:>4} stages {:>8.1} us  wait {:>6.2} us  work {:>6.2} us\n",
                k.kernel, k.stages, k.critical_us, k.wait_us, k.work_us
            );
        }
        out
    }

    /// The trace as JSON (times in ns from the token's first start) for `tools/mk_trace.py`.
    pub fn to_json(&self) -> String {
        let first = (0..self.grid).map(|b| self.at(b, 0)[0]).min().unwrap_or(0);
        let rel = |v: u64| if v == 0 { 0 } else { v.saturating_sub(first) };
        let rows: Vec<String> = (0..self.grid)
            .map(|b| {
                let cells: Vec<String> = (0..self.stages.len())
                    .map(|s| {
                        let [a, w, e] = self.at(b, s);
                        format!("[{},{},{}]", rel(a), rel(w), rel(e))
                    })
                    .collect();
                format!("[{}]", cells.join(","))
            })
            .collect();
        let names: Vec<String> = self.stages.iter().map(|n| format!("\"{n}\"")).collect();
        format!("{{\"grid\":{},\"stages\":[{}],\"t\":[{}]}}\n", self.grid, names.join(","), rows.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two blocks, three stages: block 0 works in every stage, block 1 only in the last.
    fn trace() -> MkTrace {
        #[rustfmt::skip]
        let t = vec![
            // block 0: (start, waited, end) per stage
            1000, 1000, 3000,   3000, 4000, 6000,   6000, 7000, 9000,
            // block 1
            1000, 0, 1000,      1000, 0, 1000,      1000, 6500, 10000,
        ];
        MkTrace { grid: 2, stages: vec!["embed_gather", "matvec_q4t_4", "matvec_q4t_4"], t }
    }

    #[test]
    fn trace_time_is_attributed_to_the_last_block_of_each_stage() {
        let t = trace();
        assert_eq!(t.total_us(), 9.0);
        let k = t.by_kernel();
        assert_eq!(k[0].kernel, "matvec_q4t_4");
        assert_eq!(k[0].stages, 2);
        // Stage 1 ends at 6000 (from 3000), stage 2 at 10000: 3 + 4 µs.
        assert!((k[0].critical_us - 7.0).abs() < 1e-9, "{}", k[0].critical_us);
        assert!((k[1].critical_us - 2.0).abs() < 1e-9, "{}", k[1].critical_us);
        // Waits: stage 1 block 0 waited 1 µs; stage 2: blocks waited 1 and 5.5 µs (mean 3.25).
        assert!((k[0].wait_us - (1.0 + 3.25) / 2.0).abs() < 1e-9, "{}", k[0].wait_us);
    }

    #[test]
    fn stage_ids_match_the_kernel_file_and_every_stage_waits_itself() {
        let src = include_str!("../kernels/megakernel.cu");
        for (id, name) in MK_KERNELS.iter().enumerate() {
            // `case ID:  // name` for the plain stages; MK_MMA_H(ID, H, …) // name, name_gated
            // for the tensor-core ones (H groups of four tokens).
            let plain = format!("case {id}:  // {name}\n");
            let mma = MMA_KERNELS.iter().position(|k| k == name).map(|i| {
                // The gated entry of MK_MMA_H(ID) is ID + 4.
                let first = if i < 4 { id } else { id - 4 };
                let base = MMA_KERNELS[first - 15];
                let h = if base.starts_with("matvec_q4t_8") { 2 } else { 1 };
                (format!("MK_MMA_H({first}, {h}, "), format!("// {base}, {base}_gated"))
            });
            let found = match &mma {
                Some((call, comment)) => src.lines().any(|l| l.contains(call) && l.contains(comment)),
                None => src.contains(&plain),
            };
            assert!(found, "stage id {id} ({name}) is not dispatched as such in megakernel.cu");
            // Passes of five to eight tokens and batched steps run on the entries built for them.
            let wide = name.starts_with("matvec_q4t_8") || *name == "kv_commit_columns";
            assert_eq!(WIDE.contains(name), wide, "{name}: in WIDE");
            // The stages `mk_dispatch_more` runs (the wide ones, MoE's) are what `mk_more_stage`
            // sends there, and never what the host gives the lean entry.
            let more = (wide && id < 24 && src.contains(&format!("kernel == {id} ||")))
                || (id >= 24 && src.contains("|| kernel >= 24;"));
            assert_eq!(more, wide || id >= 24, "{name}: sent to mk_dispatch_more");
            assert!(!more || WIDE.contains(name) || NOT_LEAN.contains(name), "{name} reaches the lean entry");
            // MkStage::new marks every stage as waiting inside its body (pdl_start).
            assert!(
                crate::device::PDL_KERNELS.contains(name) || MMA_KERNELS.contains(name),
                "{name} does not call pdl_start()"
            );
        }
    }

    #[test]
    fn prefetch_plan_asks_for_the_next_matvecs_where_hbm_idles() {
        let id = |name: &str| MK_KERNELS.iter().position(|&k| k == name).expect(name) as i32;
        let (mma, gated) = (id("matvec_q4t_4"), id("matvec_q4t_4_gated"));
        let (rope, att, argmax) = (id("qkv_norm_rope"), id("attention"), id("argmax_final"));
        // Q/K/V, norms, attention, O, gate+up, down, PLE gate, PLE projection, next Q/K/V, norms.
        let layer = [mma, rope, att, mma, mma, gated, gated, mma, mma, rope, att, mma, argmax];
        let plan = prefetch_plan(&layer, 2);
        // At the norms after Q/K/V: stages +2 (O) and +3 (gate+up); nowhere else.
        assert_eq!(plan, [0, 0b110, 0, 0, 0, 0, 0, 0, 0, 0b10, 0, 0, 0]);
        assert!(prefetch_plan(&layer, 0).iter().all(|&p| p == 0));
        // Only matvec stages are ever asked for.
        for (s, p) in prefetch_plan(&layer, 8).iter().enumerate() {
            (0..8).filter(|i| p >> i & 1 == 1).for_each(|i| assert!(is_mma(layer[s + 1 + i])));
        }
    }

    /// The host picks the lean entry unless a stage is one the kernel runs in the general entry only.
    #[test]
    fn lean_entry_refuses_exactly_the_not_lean_stages() {
        let src = include_str!("../kernels/megakernel.cu");
        for name in NOT_LEAN {
            let id = MK_KERNELS.iter().position(|&k| k == name).expect(name);
            let case = src.find(&format!("case {id}:  // {name}\n")).expect(name);
            assert!(src[case..].lines().nth(1).unwrap().contains("if constexpr (GENERAL)"), "{name}");
        }
        assert_eq!(src.matches("if constexpr (GENERAL)").count(), NOT_LEAN.len());
    }

    /// `ADD_NORM_MK_SMEM` mirrors `RES_F4` of common.cuh.
    #[test]
    fn add_norm_smem_matches_the_kernel() {
        let res_f4: u32 = crate::compile::kernel_define("common.cuh", "RES_F4").parse().unwrap();
        assert_eq!(ADD_NORM_MK_SMEM, 2 * res_f4 * MK_THREADS * 16);
    }

    /// `mma_ring_bytes` mirrors `MMA_WARPS`, `MMA_RING` and `MMA_RING_SLOT` of matvec_mma.cu.
    #[test]
    fn ring_bytes_match_the_kernel() {
        let define = |name: &str| crate::compile::kernel_define("matvec_mma.cu", name);
        let (warps, ring): (u32, u32) = (define("MMA_WARPS").parse().unwrap(), define("MMA_RING").parse().unwrap());
        assert_eq!(define("MMA_RING_SLOT(UPC)"), "(512 + 128 * (UPC))");
        for upc in [1, 2] {
            assert_eq!(mma_ring_bytes(upc), warps * ring * (512 + 128 * upc));
        }
    }

    #[test]
    fn trace_json_is_relative_to_the_first_start() {
        let j = trace().to_json();
        assert!(j.starts_with("{\"grid\":2,\"stages\":[\"embed_gather\",\"matvec_q4t_4\",\"matvec_q4t_4\"]"), "{j}");
        assert!(j.contains("[[0,0,2000],[2000,3000,5000],[5000,6000,8000]]"), "{j}");
        assert!(j.contains("[[0,0,0],[0,0,0],[0,5500,9000]]"), "{j}");
    }
}
