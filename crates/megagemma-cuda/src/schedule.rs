//! The decode megakernel's schedule, built on the host from the layer plan (issue 10; plan in
//! `docs/megakernel-plan.md`): which job each block runs, in which order, which counters it waits
//! for and which one it signals. The persistent kernel that executes it is not written yet; this
//! is the data it will read, checked here on the CPU.
//!
//! One decode token is a chain of *items* (a layer's Q/K/V, its attention output, its O, …). Each
//! item is produced by one or more *jobs* (slices of a matrix's 16-row tiles, one attention head)
//! and has one counter: every producing job increments it once when its part is written
//! (release), and a consumer waits until it reaches `generation × producers` (acquire), so
//! counters are monotonic across tokens and never reset. A job waits only for the items it reads.
//!
//! Nothing on the chain exists only to normalise or to add: a job that reads the residual stream
//! rebuilds it from the last written stream `x` plus the deltas produced since (`x + n(o)`,
//! `+ n(down)`, `+ n(ple)`, each `n` an RMSNorm of one row, cheap to recompute per block), and the
//! first Q/K/V job of each layer also writes that layer's `x` (a second signal) for the consumers
//! after it. Q/K norms and RoPE happen inside the attention jobs (the first head of each KV group
//! writes the rotated K/V row to the cache). So a layer is 5 links deep (Q/K/V, attention, O,
//! gate/up, down) or 7 with per-layer embeddings (PLE gate, PLE projection); a probe measured
//! ~1.45 µs per link on the H200 (`docs/megakernel-plan.md`).
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
    /// One query head's attention over the layer's (or its donor's) cache, with the Q (and K)
    /// norms and RoPE; the first head of each KV group writes the rotated K/V row to the cache.
    Attention { layer: usize, head: usize },
    /// The argmax over the LM head's per-job maxima.
    Argmax,
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
    /// The items this job (partly) produces: one, or two for the job that also writes a
    /// layer's residual stream.
    pub signals: Vec<usize>,
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

    fn job(&mut self, work: Work, waits: &[usize], signals: &[usize]) {
        for &i in signals {
            self.items[i].producers += 1;
        }
        self.jobs.push(Job { work, waits: waits.to_vec(), signals: signals.to_vec() });
    }

    /// Matvec jobs over `mats` (rows each), together producing one new item; the first one also
    /// signals `also` when given (it writes the residual stream it rebuilt).
    fn matvecs(&mut self, name: String, mats: &[(Mat, usize)], waits: &[usize], also: Option<usize>) -> usize {
        let out = self.item(name);
        let first = self.jobs.len();
        let tiles: usize = mats.iter().map(|(_, rows)| rows.div_ceil(TILE_ROWS)).sum();
        // Contiguous tile ranges of near-equal size, about one per block, not crossing matrices.
        let per_job = tiles.div_ceil(self.grid).max(1);
        for &(mat, rows) in mats {
            let n = rows.div_ceil(TILE_ROWS);
            let mut t = 0;
            while t < n {
                let end = (t + per_job).min(n);
                let writes_x = also.filter(|_| self.jobs.len() == first);
                self.job(
                    Work::Matvec { mat, tiles: t..end },
                    waits,
                    &[Some(out), writes_x].into_iter().flatten().collect::<Vec<_>>(),
                );
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
        // The residual stream as consumers rebuild it: the last written `x` plus the deltas since.
        let mut x = b.item("x0".into());
        b.job(Work::Embed, &[], &[x]);
        let mut deltas: Vec<usize> = vec![];
        let ple_inputs = if plan.ple_dim > 0 {
            let proj = b.matvecs("ple.proj".into(), &[(Mat::PleProj, plan.layers.len() * plan.ple_dim)], &[x], None);
            let pli = b.item("ple.inputs".into());
            b.job(Work::PleCombine, &[proj, x], &[pli]);
            Some(pli)
        } else {
            None
        };
        // Each layer's attention item: its K/V rows are in the cache once it is complete.
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
            let stream = [&[x][..], &deltas].concat();
            let x_layer = b.item(format!("{i}.x"));
            let proj = b.matvecs(format!("{i}.qkv"), &qkv, &stream, Some(x_layer));
            x = x_layer;
            let mut attn_waits = vec![proj];
            if l.is_kv_shared() {
                let donor = kv_ready[l.kv_source];
                if donor == usize::MAX {
                    bail!("layer {i} reads the cache of layer {}, which comes after it", l.kv_source);
                }
                attn_waits.push(donor);
            }
            let attn = b.item(format!("{i}.attn"));
            for head in 0..l.num_heads {
                b.job(Work::Attention { layer: i, head }, &attn_waits, &[attn]);
            }
            kv_ready[i] = attn;
            let o = b.matvecs(format!("{i}.o"), &[(Mat::O(i), h)], &[attn], None);
            let mlp = [(Mat::Gate(i), l.mlp_width), (Mat::Up(i), l.mlp_width)];
            let gu = b.matvecs(format!("{i}.gate_up"), &mlp, &[x, o], None);
            let down = b.matvecs(format!("{i}.down"), &[(Mat::Down(i), h)], &[gu], None);
            deltas = vec![o, down];
            if let (true, Some(pli)) = (l.has_ple, ple_inputs) {
                let gate = b.matvecs(format!("{i}.ple_gate"), &[(Mat::PleGate(i), plan.ple_dim)], &[x, o, down], None);
                let out = b.matvecs(format!("{i}.ple_out"), &[(Mat::PleOut(i), h)], &[gate, pli], None);
                deltas.push(out);
            }
        }
        let x_final = b.item("x_final".into());
        let stream = [&[x][..], &deltas].concat();
        let head = b.matvecs("head".into(), &[(Mat::Head, plan.vocab_size)], &stream, Some(x_final));
        let token = b.item("token".into());
        b.job(Work::Argmax, &[head], &[token]);

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
            for &i in &j.signals {
                item_depth[i] = item_depth[i].max(d);
            }
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
            for &i in &j.signals {
                truth[i] += 1;
            }
        }
        let mut counters = vec![0u32; self.items.len()];
        let mut now = 0u64;
        for gen in 1..=tokens {
            let mut pos = vec![0usize; grid];
            let mut busy = vec![false; grid];
            let mut running: Vec<(u64, usize, usize)> = vec![]; // (finish time, job, block)
            loop {
                // Start every free block's next job whose counters have reached their targets.
                for b in 0..grid {
                    let Some(&j) = self.blocks[b].get(pos[b]).filter(|_| !busy[b]) else { continue };
                    let job = &self.jobs[j];
                    if job.waits.iter().all(|&i| counters[i] >= gen * self.items[i].producers) {
                        if let Some(&i) = job.waits.iter().find(|&&i| counters[i] < gen * truth[i]) {
                            bail!("job {j} ({:?}) started before item {} was complete", job.work, self.items[i].name);
                        }
                        running.push((now + next(), j, b));
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
                let (t, j, b) = running.swap_remove(k);
                now = t;
                for &i in &self.jobs[j].signals {
                    counters[i] += 1;
                }
                busy[b] = false;
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
            "{} jobs on {} blocks ({} matvec, {} attention, {} other), {} counters, {} waits per token, dependency depth {}",
            self.jobs.len(),
            self.blocks.len(),
            count(&|w| matches!(w, Work::Matvec { .. })),
            count(&|w| matches!(w, Work::Attention { .. })),
            count(&|w| matches!(w, Work::Embed | Work::PleCombine | Work::Argmax)),
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
        // Q/K/V, attention, O, gate/up, down: 5 links per layer (7 with PLE gate and projection),
        // plus the embedding, the head and the argmax.
        let mut c = synthetic_config("tiny").unwrap();
        let with_ple = Schedule::build(&ModelPlan::new(&c).unwrap(), 4).unwrap();
        c.ple_dim = 0;
        let p = ModelPlan::new(&c).unwrap();
        assert_eq!(Schedule::build(&p, 4).unwrap().depth(), 5 * p.layers.len() + 3);
        assert_eq!(with_ple.depth(), 7 * p.layers.len() + 3);
    }

    #[test]
    fn one_job_per_layer_writes_the_residual_stream() {
        let p = plan("e4b");
        let s = Schedule::build(&p, 132).unwrap();
        let writers = s.jobs.iter().filter(|j| j.signals.len() == 2).count();
        assert_eq!(writers, p.layers.len() + 1); // each layer's x, and the final one
        for (i, item) in s.items.iter().enumerate() {
            if item.name.ends_with(".x") || item.name == "x_final" {
                assert_eq!(item.producers, 1, "{}", item.name);
                assert!(s.jobs.iter().any(|j| j.waits.contains(&i)) || item.name == "x_final", "{} unread", item.name);
            }
        }
    }

    #[test]
    fn jobs_wait_only_for_earlier_jobs() {
        let s = Schedule::build(&plan("e2b"), 132).unwrap();
        let mut produced = vec![false; s.items.len()];
        for j in &s.jobs {
            for &i in &j.waits {
                assert!(produced[i], "{:?} waits for {}, produced later", j.work, s.items[i].name);
            }
            for &i in &j.signals {
                produced[i] = true;
            }
        }
    }

    #[test]
    fn moe_is_refused_with_one_clear_error() {
        let e = Schedule::build(&plan("26b-a4b"), 132).unwrap_err();
        assert!(e.to_string().contains("MoE"), "{e}");
        assert!(Schedule::build(&plan("tiny"), 0).is_err());
    }
}
