//! The decode megakernel's schedule, built on the host from the layer plan (issue 10; plan in
//! `docs/megakernel-plan.md`): which job each block runs, in which order, which counters it waits
//! for and which one it signals. The persistent kernel that executes it is not written yet; this
//! is the data it will read, checked here on the CPU.
//!
//! One decode token is a chain of *items* (a layer's Q/K/V, its attention output, the residual
//! stream after the attention block, …). Each item is produced by one or more *jobs* (slices of a
//! matrix's 16-row tiles, one attention head, a residual update) and has one counter: every
//! producing job increments it once when its part is written (release), and a consumer waits
//! until it reaches `generation × producers` (acquire), so counters are monotonic across tokens
//! and never reset. A job waits only for the items it reads. Norms get no jobs of their own: a
//! matvec job recomputes the RMS statistics of its (one-row) input, and a single residual job per
//! update writes the new residual stream.
//!
//! Blocks take jobs from the global order round-robin and run their own in increasing order.
//! Every job waits only for items produced by earlier jobs, so with all blocks co-resident the
//! schedule cannot deadlock: the lowest unfinished job always has its inputs and its block free.
//! [`Schedule::simulate`] checks that and the counters' expected values with random job times.

use megagemma_model::plan::ModelPlan;
use megagemma_model::{bail, Result};
use std::fmt;

/// Rows per matvec tile (one `mma.m16n8k16` A fragment).
pub const TILE_ROWS: usize = 16;

/// A weight matrix of one decode step, named by its place in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mat {
    PleProj,
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
    PleGate(usize),
    PleOut(usize),
    Head,
}

/// What a job computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Work {
    /// Gather the token's embedding row (scaled) and its PLE table row.
    Embed,
    /// Rows `tiles.start·16 .. tiles.end·16` of `mat` times its (recomputed-norm) input.
    Matvec { mat: Mat, tiles: std::ops::Range<usize> },
    /// Combine the PLE projection with the PLE table row into the per-layer inputs.
    PleCombine,
    /// Q/K norms and RoPE of a layer, and the K/V rows written to its cache.
    NormRope { layer: usize },
    /// One query head's attention over the layer's (or its donor's) cache.
    Attention { layer: usize, head: usize },
    /// One residual-stream update (`x += norm(y)·w`, the layer scalar after the last).
    Residual { layer: usize, step: ResidualStep },
    /// The argmax over the LM head's per-job maxima.
    Argmax,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResidualStep {
    Attention,
    Mlp,
    Ple,
}

/// A produced piece of data with its counter.
#[derive(Clone, Debug)]
pub struct Item {
    pub name: String,
    /// Jobs that each increment the counter once per token.
    pub producers: u32,
}

#[derive(Clone, Debug)]
pub struct Job {
    pub work: Work,
    /// Items read: wait until each counter reaches `generation × producers`.
    pub waits: Vec<usize>,
    /// The item this job (partly) produces.
    pub signals: usize,
}

/// A decode step's jobs in dependency order, their items, and each block's list.
#[derive(Clone, Debug)]
pub struct Schedule {
    pub jobs: Vec<Job>,
    pub items: Vec<Item>,
    /// `blocks[b]`: the job indices block `b` runs, increasing.
    pub blocks: Vec<Vec<usize>>,
}

/// Builder state: items by name, jobs in order.
struct Builder {
    jobs: Vec<Job>,
    items: Vec<Item>,
    /// Jobs per matvec: about one per block, at least one tile each.
    grid: usize,
}

impl Builder {
    fn item(&mut self, name: String) -> usize {
        self.items.push(Item { name, producers: 0 });
        self.items.len() - 1
    }

    fn job(&mut self, work: Work, waits: &[usize], signals: usize) {
        self.items[signals].producers += 1;
        self.jobs.push(Job { work, waits: waits.to_vec(), signals });
    }

    /// Matvec jobs over `mats` (rows each), together producing one new item.
    fn matvecs(&mut self, name: String, mats: &[(Mat, usize)], waits: &[usize]) -> usize {
        let out = self.item(name);
        let tiles: usize = mats.iter().map(|(_, rows)| rows.div_ceil(TILE_ROWS)).sum();
        // Contiguous tile ranges of near-equal size, about one per block, not crossing matrices.
        let per_job = tiles.div_ceil(self.grid).max(1);
        for &(mat, rows) in mats {
            let n = rows.div_ceil(TILE_ROWS);
            let mut t = 0;
            while t < n {
                let end = (t + per_job).min(n);
                self.job(Work::Matvec { mat, tiles: t..end }, waits, out);
                t = end;
            }
        }
        out
    }
}

impl Schedule {
    /// The schedule of one decode token of `plan` on `grid` co-resident blocks. MoE layers are
    /// not scheduled yet (an error says so).
    pub fn build(plan: &ModelPlan, grid: usize) -> Result<Schedule> {
        if grid == 0 {
            bail!("a schedule needs at least one block");
        }
        if plan.layers.iter().any(|l| l.has_moe) {
            bail!("the megakernel schedule does not cover MoE layers yet");
        }
        let h = plan.hidden;
        let mut b = Builder { jobs: vec![], items: vec![], grid };
        let mut x = b.item("x0".into());
        b.job(Work::Embed, &[], x);
        let ple_inputs = if plan.ple_dim > 0 {
            let proj = b.matvecs("ple.proj".into(), &[(Mat::PleProj, plan.layers.len() * plan.ple_dim)], &[x]);
            let pli = b.item("ple.inputs".into());
            b.job(Work::PleCombine, &[proj, x], pli);
            Some(pli)
        } else {
            None
        };
        // The item holding each layer's rotated K/V rows (KV-shared layers read their donor's).
        let mut kv_ready = vec![usize::MAX; plan.layers.len()];
        for l in &plan.layers {
            let i = l.index;
            let mut qkv = vec![(Mat::Q(i), l.q_width())];
            if !l.is_kv_shared() {
                qkv.push((Mat::K(i), l.kv_width()));
                if !l.k_eq_v {
                    qkv.push((Mat::V(i), l.kv_width()));
                }
            }
            let proj = b.matvecs(format!("{i}.qkv"), &qkv, &[x]);
            let rotated = b.item(format!("{i}.rope"));
            b.job(Work::NormRope { layer: i }, &[proj], rotated);
            kv_ready[i] = rotated;
            let mut attn_waits = vec![rotated];
            if l.is_kv_shared() {
                let donor = kv_ready[l.kv_source];
                if donor == usize::MAX {
                    bail!("layer {i} reads the cache of layer {}, which comes after it", l.kv_source);
                }
                attn_waits.push(donor);
            }
            let attn = b.item(format!("{i}.attn"));
            for head in 0..l.num_heads {
                b.job(Work::Attention { layer: i, head }, &attn_waits, attn);
            }
            let o = b.matvecs(format!("{i}.o"), &[(Mat::O(i), h)], &[attn]);
            let x_attn = b.item(format!("{i}.x_attn"));
            b.job(Work::Residual { layer: i, step: ResidualStep::Attention }, &[o, x], x_attn);
            let gu =
                b.matvecs(format!("{i}.gate_up"), &[(Mat::Gate(i), l.mlp_width), (Mat::Up(i), l.mlp_width)], &[x_attn]);
            let down = b.matvecs(format!("{i}.down"), &[(Mat::Down(i), h)], &[gu]);
            let x_mlp = b.item(format!("{i}.x_mlp"));
            b.job(Work::Residual { layer: i, step: ResidualStep::Mlp }, &[down, x_attn], x_mlp);
            x = match (l.has_ple, ple_inputs) {
                (true, Some(pli)) => {
                    let gate = b.matvecs(format!("{i}.ple_gate"), &[(Mat::PleGate(i), plan.ple_dim)], &[x_mlp]);
                    let out = b.matvecs(format!("{i}.ple_out"), &[(Mat::PleOut(i), h)], &[gate, pli]);
                    let x_ple = b.item(format!("{i}.x_ple"));
                    b.job(Work::Residual { layer: i, step: ResidualStep::Ple }, &[out, x_mlp], x_ple);
                    x_ple
                }
                _ => x_mlp,
            };
        }
        let head = b.matvecs("head".into(), &[(Mat::Head, plan.vocab_size)], &[x]);
        let token = b.item("token".into());
        b.job(Work::Argmax, &[head], token);

        let mut blocks = vec![vec![]; grid];
        for j in 0..b.jobs.len() {
            blocks[j % grid].push(j);
        }
        Ok(Schedule { jobs: b.jobs, items: b.items, blocks })
    }

    /// Waits per token: one per (job, item read) pair.
    pub fn waits(&self) -> usize {
        self.jobs.iter().map(|j| j.waits.len()).sum()
    }

    /// Dependency depth of a token: the most items on any chain from the embedding to the argmax
    /// (each link is a point where consumers wait for every producer of the item before).
    pub fn depth(&self) -> usize {
        let mut item_depth = vec![0usize; self.items.len()];
        for j in &self.jobs {
            let d = 1 + j.waits.iter().map(|&i| item_depth[i]).max().unwrap_or(0);
            item_depth[j.signals] = item_depth[j.signals].max(d);
        }
        item_depth.into_iter().max().unwrap_or(0)
    }

    /// Run the schedule for `tokens` generations on the CPU with pseudo-random job durations
    /// (`seed`): each block runs its jobs in order, a job starts once its block is free and every
    /// counter it waits for has reached `generation × producers`. Fails on a deadlock, or if a
    /// job starts before every producer of an item it reads has finished (a wrong expected
    /// count). Returns the simulated time of the last job.
    pub fn simulate(&self, tokens: u32, seed: u64) -> Result<u64> {
        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % 1000 + 1
        };
        let grid = self.blocks.len();
        // The real number of producers of each item, to check the counts the waits use.
        let mut truth = vec![0u32; self.items.len()];
        for j in &self.jobs {
            truth[j.signals] += 1;
        }
        let mut counters = vec![0u32; self.items.len()];
        let mut now = 0u64;
        for gen in 1..=tokens {
            let mut pos = vec![0usize; grid];
            let mut busy = vec![false; grid];
            let mut running: Vec<(u64, usize)> = vec![]; // (finish time, job)
            loop {
                // Start every free block's next job whose counters have reached their targets.
                for b in 0..grid {
                    let Some(&j) = self.blocks[b].get(pos[b]).filter(|_| !busy[b]) else { continue };
                    let job = &self.jobs[j];
                    if job.waits.iter().all(|&i| counters[i] >= gen * self.items[i].producers) {
                        if let Some(&i) = job.waits.iter().find(|&&i| counters[i] < gen * truth[i]) {
                            bail!("job {j} ({:?}) started before item {} was complete", job.work, self.items[i].name);
                        }
                        running.push((now + next(), j));
                        pos[b] += 1;
                        busy[b] = true;
                    }
                }
                // Then finish the earliest running job.
                let Some(k) = (0..running.len()).min_by_key(|&k| running[k].0) else {
                    if pos.iter().zip(&self.blocks).all(|(p, js)| *p == js.len()) {
                        break;
                    }
                    bail!("deadlock in generation {gen}: no block can start its next job");
                };
                let (t, j) = running.swap_remove(k);
                now = t;
                counters[self.jobs[j].signals] += 1;
                busy[j % grid] = false;
            }
        }
        Ok(now)
    }
}

impl fmt::Display for Schedule {
    /// Jobs and waits per token, and jobs by kind.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |p: &dyn Fn(&Work) -> bool| self.jobs.iter().filter(|j| p(&j.work)).count();
        write!(
            f,
            "{} jobs on {} blocks ({} matvec, {} attention, {} residual, {} other), {} counters, {} waits per token, dependency depth {}",
            self.jobs.len(),
            self.blocks.len(),
            count(&|w| matches!(w, Work::Matvec { .. })),
            count(&|w| matches!(w, Work::Attention { .. })),
            count(&|w| matches!(w, Work::Residual { .. })),
            count(&|w| matches!(w, Work::Embed | Work::PleCombine | Work::NormRope { .. } | Work::Argmax)),
            self.items.len(),
            self.waits(),
            self.depth()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::synthetic_config;

    fn plan(name: &str) -> ModelPlan {
        ModelPlan::new(&synthetic_config(name).unwrap()).unwrap()
    }

    #[test]
    fn every_matrix_row_is_computed_exactly_once() {
        let p = plan("e4b");
        let s = Schedule::build(&p, 132).unwrap();
        // The matvec jobs cover exactly the rows of the matrices a decode step streams.
        let mut rows: Vec<usize> = vec![];
        let mut last: Option<(Mat, usize)> = None;
        for j in &s.jobs {
            if let Work::Matvec { mat, tiles } = &j.work {
                match last {
                    Some((m, end)) if m == *mat => {
                        assert_eq!(tiles.start, end, "{mat:?}: tiles not contiguous");
                        *rows.last_mut().unwrap() += tiles.len();
                    }
                    _ => {
                        assert_eq!(tiles.start, 0, "{mat:?} does not start at tile 0");
                        rows.push(tiles.len());
                    }
                }
                last = Some((*mat, tiles.end));
            }
        }
        let want: Vec<usize> = {
            let mut m = p.decode_matrices();
            // The plan lists the head first; the schedule computes it last.
            m.rotate_left(1);
            m.into_iter().map(|(r, _)| r.div_ceil(TILE_ROWS)).collect()
        };
        assert_eq!(rows, want);
    }

    #[test]
    fn schedules_run_without_deadlock_and_with_complete_inputs() {
        for (name, grid) in [("e4b", 132), ("e2b", 132), ("tiny", 7), ("e4b", 1), ("31b", 264)] {
            let s = Schedule::build(&plan(name), grid).unwrap();
            for seed in 1..4 {
                s.simulate(2, seed).unwrap_or_else(|e| panic!("{name} on {grid} blocks: {e}"));
            }
            eprintln!("{name}: {s}");
        }
    }

    #[test]
    fn a_wrong_expected_count_is_caught() {
        let mut s = Schedule::build(&plan("tiny"), 5).unwrap();
        // Claim the first layer's Q/K/V has one producer fewer than it has: its consumer would
        // start before the last slice is written.
        let qkv = s.items.iter().position(|i| i.name == "0.qkv").unwrap();
        assert!(s.items[qkv].producers > 1);
        s.items[qkv].producers -= 1;
        let err = (1..20).find_map(|seed| s.simulate(1, seed).err()).expect("never caught");
        assert!(err.to_string().contains("before item 0.qkv was complete"), "{err}");
    }

    #[test]
    fn depth_counts_the_chain_of_a_layer() {
        // Gemma 3-like layers without PLE: Q/K/V, RoPE, attention, O, residual, gate/up, down,
        // residual = 8 links per layer, plus the embedding, the head and the argmax.
        let mut c = synthetic_config("tiny").unwrap();
        c.ple_dim = 0;
        let p = ModelPlan::new(&c).unwrap();
        let s = Schedule::build(&p, 4).unwrap();
        assert_eq!(s.depth(), 8 * p.layers.len() + 3);
    }

    #[test]
    fn jobs_wait_only_for_earlier_jobs() {
        let s = Schedule::build(&plan("e2b"), 132).unwrap();
        let mut produced = vec![false; s.items.len()];
        for j in &s.jobs {
            for &i in &j.waits {
                assert!(produced[i], "{:?} waits for {}, produced later", j.work, s.items[i].name);
            }
            produced[j.signals] = true;
        }
    }

    #[test]
    fn moe_is_refused_with_one_clear_error() {
        let e = Schedule::build(&plan("26b-a4b"), 132).unwrap_err();
        assert!(e.to_string().contains("MoE"), "{e}");
        assert!(Schedule::build(&plan("tiny"), 0).is_err());
    }
}
