//! Checks of the CUDA forward against the CPU reference and against itself, shared by the
//! `gpu_check` example and the opt-in GPU tests: greedy ids and logits on the same prompt, and
//! multi-token (verify) columns against single decode steps, bit for bit.

use crate::{CudaModel, CudaSeq, Decode, PosOut, Want};
use megagemma_model::cpu::forward::forward_chunk;
use megagemma_model::cpu::kv::KvCache;
use megagemma_model::cpu::ops::argmax;
use megagemma_model::quant::load::QuantMode;
use megagemma_model::{Error, Model, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The numerical contract with the CPU path: ids equal and logits within this relative L2.
pub const REL_L2_MAX: f64 = 1e-3;

/// Fixture directories (those holding an `expected.json`) under `root`, sorted.
pub fn fixture_dirs(root: &Path) -> Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(|e| Error::msg(format!("{}: {e}", root.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    v.sort();
    Ok(v)
}

/// A fixture as stored, and (unless it is an already-quantized checkpoint) quantized on load
/// as `q4` (groups of 64) and `q4_0` (groups of 32, which take the tensor-core matvec), each with
/// a label `dir-name/mode`.
pub fn fixture_models(dir: &Path) -> Result<Vec<(String, Model)>> {
    let quantized = std::fs::read_to_string(dir.join("config.json")).is_ok_and(|c| c.contains("\"quantization\""));
    let mut out = vec![];
    for quant in [QuantMode::Stored, QuantMode::Q4, QuantMode::Q4_0] {
        if quantized && quant != QuantMode::Stored {
            continue;
        }
        let label = format!("{}/{quant}", dir.file_name().unwrap_or_default().to_string_lossy());
        let model = Model::load_with(dir, quant).map_err(|e| Error::msg(format!("{label}: {e}")))?;
        out.push((label, model));
    }
    Ok(out)
}

/// A fixture's `expected.json`, parsed.
fn expected_json(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("expected.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::msg(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| Error::msg(format!("{}: {e}", path.display())))
}

/// `(name, prompt ids)` of each case of a fixture's `expected.json`.
pub fn fixture_cases(dir: &Path) -> Result<Vec<(String, Vec<u32>)>> {
    let v = expected_json(dir)?;
    let mut out = Vec::new();
    for c in v["cases"].as_array().into_iter().flatten() {
        let ids: Vec<u32> =
            c["prompt_ids"].as_array().into_iter().flatten().filter_map(|x| x.as_u64()).map(|x| x as u32).collect();
        if !ids.is_empty() {
            out.push((c["name"].as_str().unwrap_or("?").to_string(), ids));
        }
    }
    Ok(out)
}

/// An assistant fixture's target directory and drafts per round, from its `expected.json`.
pub fn assistant_fixture(dir: &Path) -> Result<(PathBuf, usize)> {
    let v = expected_json(dir)?;
    let target = PathBuf::from(v["target"].as_str().unwrap_or("tests/fixtures/ple_shared_dw"));
    Ok((target, v["draft_tokens"].as_u64().unwrap_or(3) as usize))
}

/// `prompt` extended to `len` tokens with deterministic in-vocabulary ids: a prompt long enough for
/// the long-pass path (cuBLAS products, batched attention) to run several chunks across
/// sliding-window wraps.
pub fn long_prompt(prompt: &[u32], vocab: usize, len: usize) -> Vec<u32> {
    let extra = (prompt.len()..len).map(|i| ((i as u64 * 7919 + 13) % vocab as u64) as u32);
    prompt.iter().copied().chain(extra).collect()
}

/// `|a − b| / |b|` in f64.
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Greedy CPU reference: the chosen ids and the logits they were chosen from (`steps` of each).
pub fn cpu_greedy(model: &Model, prompt: &[u32], steps: usize) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut kv = KvCache::new(&model.plan);
    let (mut ids, mut logits) = (vec![], vec![]);
    let mut input = prompt.to_vec();
    for _ in 0..steps {
        let out = forward_chunk(&model.plan, &model.weights, &mut kv, &input, 1);
        kv.commit(input.len())?;
        let next = argmax(&out.logits);
        ids.push(next);
        logits.push(out.logits);
        input = vec![next];
    }
    Ok((ids, logits))
}

/// Greedy on the GPU, same shape of result as [`cpu_greedy`]; the prompt prefilled in chunks of
/// `chunk` tokens when given.
pub fn cuda_greedy(
    cm: &Arc<CudaModel>,
    prompt: &[u32],
    steps: usize,
    chunk: Option<usize>,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut seq = CudaSeq::new(cm, prompt.len() + steps + 1)?;
    if let Some(c) = chunk {
        seq.set_prefill_chunk(c);
    }
    let mut out = seq.prefill(prompt, true)?;
    let (mut ids, mut logits) = (vec![], vec![]);
    for step in 0..steps {
        ids.push(out.argmax);
        logits.push(out.logits.take().unwrap_or_default());
        if step + 1 < steps {
            out = seq.forward(&[out.argmax], Want { all_positions: false, logits: true })?.remove(0);
            seq.commit(1)?;
        }
    }
    Ok((ids, logits))
}

pub struct GreedyReport {
    pub steps: usize,
    /// Leading steps whose ids agree.
    pub ids_equal: usize,
    /// Largest relative L2 of the logits over the agreeing steps.
    pub max_rel_l2: f64,
    pub cpu_ids: Vec<u32>,
    pub cuda_ids: Vec<u32>,
}

impl GreedyReport {
    pub fn ok(&self) -> bool {
        self.ids_equal == self.steps && self.max_rel_l2 <= REL_L2_MAX
    }
}

/// `steps` greedy tokens from `prompt` on the CPU and on the GPU (prefill chunks of `chunk`
/// tokens when given), compared.
pub fn compare_greedy(
    model: &Model,
    cm: &Arc<CudaModel>,
    prompt: &[u32],
    steps: usize,
    chunk: Option<usize>,
) -> Result<GreedyReport> {
    let (cpu_ids, cpu_logits) = cpu_greedy(model, prompt, steps)?;
    let (cuda_ids, cuda_logits) = cuda_greedy(cm, prompt, steps, chunk)?;
    let ids_equal = cpu_ids.iter().zip(&cuda_ids).take_while(|(a, b)| a == b).count();
    let max_rel_l2 =
        cpu_logits.iter().zip(&cuda_logits).take(ids_equal.max(1)).map(|(c, g)| rel_l2(g, c)).fold(0.0, f64::max);
    Ok(GreedyReport { steps, ids_equal, max_rel_l2, cpu_ids, cuda_ids })
}

pub struct VerifyReport {
    pub t: usize,
    /// Columns of the T-token pass whose logits equal the decode step's bit for bit.
    pub columns_equal: usize,
    /// After committing half the candidates, the next decode step equals the reference step.
    pub partial_commit_exact: bool,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.columns_equal == self.t && self.partial_commit_exact
    }
}

/// A `t`-token forward (speculative verify) against `t` single decode steps on the same tokens,
/// then a partial commit followed by one more step.
pub fn verify_columns(cm: &Arc<CudaModel>, prompt: &[u32], t: usize) -> Result<VerifyReport> {
    let max_len = prompt.len() + t + 2;
    let mut dec = CudaSeq::new(cm, max_len)?;
    let mut ver = CudaSeq::new(cm, max_len)?;
    let first = dec.prefill(prompt, false)?.argmax;
    ver.prefill(prompt, false)?;
    let mut feed = vec![first];
    let mut step_logits = vec![];
    for i in 0..t {
        let o = dec.forward(&[feed[i]], Want { all_positions: false, logits: true })?.remove(0);
        dec.commit(1)?;
        feed.push(o.argmax);
        step_logits.push(o.logits.unwrap_or_default());
    }
    let cols = ver.forward(&feed[..t], Want { all_positions: true, logits: true })?;
    let columns_equal = cols.iter().zip(&step_logits).filter(|(c, s)| c.logits.as_deref() == Some(&s[..])).count();
    let keep = t / 2;
    ver.commit(keep)?;
    let next = ver.forward(&[feed[keep]], Want { all_positions: false, logits: true })?.remove(0);
    let partial_commit_exact = next.logits.as_deref() == Some(&step_logits[keep][..]);
    Ok(VerifyReport { t, columns_equal, partial_commit_exact })
}

/// How the megakernel's decode steps compare with the graph's.
pub struct MegakernelReport {
    /// Steps whose logits are bit-identical.
    pub identical: usize,
    /// Steps whose argmax agrees.
    pub ids_equal: usize,
    /// Largest relative L2 between the two paths' logits.
    pub max_rel_l2: f64,
    /// Verify passes of 2, 3 and 4 tokens (the megakernel's multi-column passes) whose every
    /// position's logits are bit-identical to the graph path's (its stages launched one by one).
    pub verify_identical: usize,
}

/// Token counts of the verify passes `megakernel_matches_graph` compares.
pub const MK_VERIFY_TOKENS: [usize; 5] = [2, 3, 4, 5, 8];

/// How a lockstep sequence runs a decode step: `forward` then `commit(1)` (two launches), or
/// `step` (the commit inside the pass's launch on the graph and megakernel paths).
#[derive(Clone, Copy)]
enum StepForm {
    ForwardCommit,
    Step,
}

fn decode_one(s: &mut CudaSeq, tok: u32, form: StepForm) -> Result<PosOut> {
    match form {
        StepForm::Step => s.step(tok, true),
        StepForm::ForwardCommit => {
            let o = s.forward(&[tok], Want { all_positions: false, logits: true })?.remove(0);
            s.commit(1)?;
            Ok(o)
        }
    }
}

/// `steps` greedy decode steps of two sequences fed the same ids (`a`'s argmax, from `tok` on),
/// each committed (`a` through `step`, `b` through `forward` and `commit`, so every comparison
/// also checks the committing launch against the separate commit): the two outputs of every step.
fn lockstep(a: &mut CudaSeq, b: &mut CudaSeq, mut tok: u32, steps: usize) -> Result<Vec<(PosOut, PosOut)>> {
    let mut outs = Vec::with_capacity(steps);
    for _ in 0..steps {
        let oa = decode_one(a, tok, StepForm::Step)?;
        let ob = decode_one(b, tok, StepForm::ForwardCommit)?;
        tok = oa.argmax;
        outs.push((oa, ob));
    }
    Ok(outs)
}

/// `steps` greedy decode steps after `prompt`, once with the graph-launched step and once with the
/// megakernel, on two sequences (ids follow the megakernel's); then verify passes of
/// `MK_VERIFY_TOKENS` tokens on both (staged, not committed).
pub fn megakernel_matches_graph(cm: &Arc<CudaModel>, prompt: &[u32], steps: usize) -> Result<MegakernelReport> {
    let max_len = prompt.len() + steps + 1 + MK_VERIFY_TOKENS.iter().max().expect("not empty");
    let (mut graph, mut mk) = (CudaSeq::new(cm, max_len)?, CudaSeq::new(cm, max_len)?);
    graph.set_decode(Decode::Graph);
    mk.set_decode(Decode::Megakernel);
    let tok = graph.prefill(prompt, false)?.argmax;
    mk.prefill(prompt, false)?;
    let mut r = MegakernelReport { identical: 0, ids_equal: 0, max_rel_l2: 0.0, verify_identical: 0 };
    // The megakernel commits inside its launch; the graph's reference commits separately.
    let mut last = tok;
    for (m, g) in lockstep(&mut mk, &mut graph, tok, steps)? {
        r.identical += usize::from(g.logits == m.logits);
        r.ids_equal += usize::from(g.argmax == m.argmax);
        let (gl, ml) = (g.logits.unwrap_or_default(), m.logits.unwrap_or_default());
        r.max_rel_l2 = r.max_rel_l2.max(rel_l2(&ml, &gl));
        last = m.argmax;
    }
    let vocab = cm.plan.vocab_size as u32;
    let want = Want { all_positions: true, logits: true };
    for t in MK_VERIFY_TOKENS {
        // The last output, then arbitrary drafts.
        let tokens: Vec<u32> = std::iter::once(last).chain((1..t as u32).map(|i| (last + 7 * i) % vocab)).collect();
        let (m, g) = (mk.forward(&tokens, want)?, graph.forward(&tokens, want)?);
        r.verify_identical += usize::from(m.len() == t && m.iter().zip(&g).all(|(a, b)| a.logits == b.logits));
    }
    Ok(r)
}

/// Batched decode steps against lone ones (issue 9: several sequences in one weight pass).
pub struct BatchReport {
    /// Steps × sequences whose logits were bit-identical to the lone sequence's.
    pub identical: usize,
    pub outputs: usize,
    /// Under `Decode::Megakernel`: steps whose batched pass ran as one megakernel launch (seen
    /// from the first sequence, which is in the first pass of eight); under `Decode::Graph`: 0.
    pub megakernel_passes: usize,
    pub steps: usize,
    pub decode: Decode,
}

impl BatchReport {
    pub fn ok(&self) -> bool {
        let in_kernel = self.decode != Decode::Megakernel || self.megakernel_passes == self.steps;
        self.identical == self.outputs && self.outputs > 0 && in_kernel
    }
}

/// Through the backend interface: `prompts.len()` sequences prefilled with their own prompts
/// (different lengths, so different positions), then `steps` decode steps of all of them in one
/// `step` call (one weight pass per eight: a graph or a megakernel launch, as `decode` says)
/// against the same sequences stepped one by one. Every output's logits must be bit-identical.
pub fn batch_matches_lone(
    cm: &Arc<CudaModel>,
    prompts: &[Vec<u32>],
    steps: usize,
    decode: Decode,
) -> Result<BatchReport> {
    use megagemma_model::backend::{Backend, Want as BWant};
    let ctx = prompts.iter().map(Vec::len).max().unwrap_or(0) + steps + 2;
    let mut b = crate::CudaBackend::new(cm.clone(), ctx).with_decode(decode);
    let (mut batched, mut lone) = (vec![], vec![]);
    for p in prompts {
        let (x, y) = (b.new_sequence()?, b.new_sequence()?);
        let tok = b.prefill(x, p, BWant::Argmax)?.argmax;
        b.prefill(y, p, BWant::Argmax)?;
        batched.push((x, tok));
        lone.push(y);
    }
    let mut r = BatchReport { identical: 0, outputs: 0, megakernel_passes: 0, steps, decode };
    for _ in 0..steps {
        let outs = b.step(&batched, BWant::Logits)?;
        r.megakernel_passes += usize::from(b.seq(batched[0].0)?.last_megakernel_was_batched());
        for ((_, tok), (o, &y)) in batched.iter_mut().zip(outs.iter().zip(&lone)) {
            let l = b.decode(y, *tok, BWant::Logits)?;
            r.outputs += 1;
            r.identical += usize::from(o.argmax == l.argmax && o.logits == l.logits && !o.logits.is_empty());
            *tok = l.argmax;
        }
    }
    Ok(r)
}

/// A megakernel step whose schedule can never be satisfied: how long it took to come back, and
/// the error it came back with (an `Ok` here means the failure was not detected).
pub fn megakernel_broken_schedule(cm: &Arc<CudaModel>, prompt: &[u32]) -> Result<(std::time::Duration, String)> {
    let mut seq = CudaSeq::new(cm, prompt.len() + 2)?;
    seq.set_decode(Decode::Megakernel);
    let tok = seq.prefill(prompt, false)?.argmax;
    // A good step first, so the recorded table exists and the failure is the schedule's alone.
    seq.forward(&[tok], Want { all_positions: false, logits: false })?;
    let t = std::time::Instant::now();
    match seq.megakernel_step_with_broken_schedule(tok) {
        Ok(()) => Err(Error::msg("a megakernel step with an unsatisfiable schedule reported no error")),
        Err(e) => Ok((t.elapsed(), e.to_string())),
    }
}

/// How a forked sequence continues against its original and a fresh run.
pub struct ForkReport {
    pub steps: usize,
    /// Steps whose logits equal the original's bit for bit (fork and original fed the same ids).
    pub identical: usize,
    /// Greedy ids of the fork equal those of a fresh sequence prefilled with the same prompt.
    pub ids_equal_fresh: bool,
}

impl ForkReport {
    pub fn ok(&self) -> bool {
        self.identical == self.steps && self.ids_equal_fresh
    }
}

/// Prefills `prompt`, forks the sequence, then runs `steps` greedy steps on the fork and on the
/// original (the original first, so it writes its cache after the fork was taken; the original
/// through `step`, the fork through `forward` and `commit`).
pub fn fork_matches(cm: &Arc<CudaModel>, prompt: &[u32], steps: usize) -> Result<ForkReport> {
    let max_len = prompt.len() + steps + 1;
    let mut orig = CudaSeq::new(cm, max_len)?;
    let first = orig.prefill(prompt, false)?.argmax;
    let mut fork = orig.fork()?;
    let outs = lockstep(&mut orig, &mut fork, first, steps - 1)?;
    let identical = outs.iter().filter(|(o, f)| o.logits == f.logits).count();
    let ids: Vec<u32> = std::iter::once(first).chain(outs.iter().map(|(_, f)| f.argmax)).collect();
    let (fresh, _) = cuda_greedy(cm, prompt, steps, None)?;
    Ok(ForkReport { steps: steps - 1, identical, ids_equal_fresh: fresh == ids })
}

/// A sequence the backend reused (`CudaBackend`'s pool of freed sequences) against a fresh
/// backend's new sequence.
pub struct ReuseReport {
    /// The pool held the two freed sequences, and the new ones took them.
    pub reused: bool,
    /// Logit rows (the prefill's, then each step's) bit-identical to the fresh sequence's.
    pub identical: usize,
    pub rows: usize,
    /// Pipelined greedy decoding on a reused sequence gave the fresh sequence's ids.
    pub greedy_equal: bool,
    /// A fork into a reused sequence then stepped as its original, bit for bit.
    pub fork_identical: bool,
}

impl ReuseReport {
    pub fn ok(&self) -> bool {
        self.reused && self.identical == self.rows && self.greedy_equal && self.fork_identical
    }
}

/// Runs a longer request (`prompt` and 160 more tokens, pipelined greedy steps, a fork) on a
/// backend, frees its sequences, then runs `prompt` on the sequences the backend reuses: `steps`
/// steps with logits, pipelined greedy decoding, and a fork. Everything must equal a fresh
/// backend's run, bit for bit: a reused sequence reads nothing its earlier request left.
pub fn reuse_matches(cm: &Arc<CudaModel>, prompt: &[u32], steps: usize, decode: Decode) -> Result<ReuseReport> {
    use crate::backend::CudaBackend;
    use megagemma_model::backend::{Backend, SeqId, Want as BWant};
    const FORK_STEPS: usize = 4;
    let long = long_prompt(prompt, cm.plan().vocab_size, prompt.len() + 160);
    let max_len = long.len() + steps + FORK_STEPS + 24;
    let backend = |pool: bool| CudaBackend::new(cm.clone(), max_len).with_decode(decode).with_sequence_pool(pool);
    // Prefill and `steps` steps with logits; returns the sequence and its rows.
    let rows_of = |b: &mut CudaBackend| -> Result<(SeqId, Vec<Vec<f32>>, u32)> {
        let seq = b.new_sequence()?;
        let o = b.prefill(seq, prompt, BWant::Logits)?;
        let (mut rows, mut tok) = (vec![o.logits], o.argmax);
        for _ in 0..steps {
            let o = b.decode(seq, tok, BWant::Logits)?;
            rows.push(o.logits);
            tok = o.argmax;
        }
        Ok((seq, rows, tok))
    };
    let greedy_of = |b: &mut CudaBackend| -> Result<(SeqId, Vec<u32>)> {
        let seq = b.new_sequence()?;
        let tok = b.prefill(seq, prompt, BWant::Argmax)?.argmax;
        let mut ids = vec![tok];
        b.decode_greedy(seq, tok, steps, &mut |t| {
            ids.push(t);
            true
        })?;
        Ok((seq, ids))
    };
    let fork_steps = |b: &mut CudaBackend, seq: SeqId, tok: u32| -> Result<bool> {
        let f = b.fork(seq)?;
        let (mut a, mut c) = (tok, tok);
        let mut same = true;
        for _ in 0..FORK_STEPS {
            let oa = b.decode(seq, a, BWant::Logits)?;
            let oc = b.decode(f, c, BWant::Logits)?;
            same &= oa.logits == oc.logits;
            (a, c) = (oa.argmax, oc.argmax);
        }
        Ok(same)
    };

    let mut fresh = backend(false);
    let (_, want_rows, _) = rows_of(&mut fresh)?;
    let (_, want_ids) = greedy_of(&mut fresh)?;

    let mut b = backend(true);
    let a = b.new_sequence()?;
    let tok = b.prefill(a, &long, BWant::Argmax)?.argmax;
    b.decode_greedy(a, tok, 20, &mut |_| true)?;
    let a2 = b.fork(a)?;
    b.decode_greedy(a2, tok, 3, &mut |_| true)?;
    b.free(a)?;
    b.free(a2)?;
    let pooled = b.spare_sequences() == 2;
    let (seq, rows, tok) = rows_of(&mut b)?;
    let (greedy, ids) = greedy_of(&mut b)?;
    let reused = pooled && b.spare_sequences() == 0;
    let identical = rows.iter().zip(&want_rows).filter(|(r, w)| r == w).count();
    // The greedy sequence goes back to the pool; the fork takes it.
    b.free(greedy)?;
    let fork_identical = fork_steps(&mut b, seq, tok)? && b.spare_sequences() == 0;
    Ok(ReuseReport { reused, identical, rows: want_rows.len(), greedy_equal: ids == want_ids, fork_identical })
}

/// Pipelined greedy decoding (`CudaSeq::decode_greedy`) against `step` in a loop.
pub struct PipelineReport {
    pub steps: usize,
    /// One `decode_greedy` call of every step gave the loop's ids.
    pub one_call_equal: bool,
    /// Calls stopped by the caller after 1, 2, 3, 1, … tokens (each taking back the step queued
    /// ahead), each continuing from the last id, gave the loop's ids.
    pub pieces_equal: bool,
    /// After the pieces, the committed cache rows equal the loop's, bit for bit (the rings' rows
    /// that a step taken back had replaced were restored).
    pub cache_equal: bool,
}

impl PipelineReport {
    pub fn ok(&self) -> bool {
        self.one_call_equal && self.pieces_equal && self.cache_equal
    }
}

/// Prefills `prompt` on three sequences and decodes `steps` greedy tokens on each, every step
/// through `decode` (graph or megakernel): `step` in a loop, one pipelined call, and pipelined
/// calls stopped early by the caller.
pub fn pipeline_matches(cm: &Arc<CudaModel>, prompt: &[u32], steps: usize, decode: Decode) -> Result<PipelineReport> {
    let max_len = prompt.len() + steps + 2;
    let new_seq = || -> Result<CudaSeq> {
        let mut s = CudaSeq::new(cm, max_len)?;
        s.set_decode(decode);
        Ok(s)
    };
    let mut looped = new_seq()?;
    let first = looped.prefill(prompt, false)?.argmax;
    let mut ids = vec![];
    let mut tok = first;
    for _ in 0..steps {
        tok = looped.step(tok, false)?.argmax;
        ids.push(tok);
    }

    let mut one = new_seq()?;
    let tok = one.prefill(prompt, false)?.argmax;
    let mut one_ids = vec![];
    one.decode_greedy(tok, steps, &mut |t| {
        one_ids.push(t);
        true
    })?;

    let mut pieces = new_seq()?;
    let mut tok = pieces.prefill(prompt, false)?.argmax;
    let mut piece_ids: Vec<u32> = vec![];
    let mut piece = 0;
    while piece_ids.len() < steps {
        let want = (piece % 3 + 1).min(steps - piece_ids.len());
        let mut got = 0;
        pieces.decode_greedy(tok, steps - piece_ids.len(), &mut |t| {
            piece_ids.push(t);
            got += 1;
            got < want
        })?;
        tok = *piece_ids.last().expect("a step ran");
        piece += 1;
    }
    Ok(PipelineReport {
        steps,
        one_call_equal: one_ids == ids,
        pieces_equal: piece_ids == ids,
        cache_equal: pieces.len() == looped.len() && pieces.committed_rows()? == looped.committed_rows()?,
    })
}

/// The MTP drafter on CUDA against the CPU backend's, on one target and assistant.
pub struct DraftReport {
    /// Draft rounds, and those whose k ids equal the CPU's.
    pub rounds: usize,
    pub rounds_equal: usize,
    /// Verify passes (the same tokens on both backends), and those whose argmaxes are equal.
    pub verifies: usize,
    pub verifies_equal: usize,
    /// The plain step before the first round gave the CPU's token.
    pub step_equal: bool,
    /// A round with the drafter's probabilities (speculative sampling): ids equal, and the largest
    /// relative L2 between the CPU's and CUDA's probabilities of a step.
    pub probs_ids_equal: bool,
    pub probs_rel_l2: f64,
    /// The first round that differs: position, CPU drafts, CUDA drafts.
    pub first_diff: Option<(usize, Vec<u32>, Vec<u32>)>,
    /// Greedy speculative decoding driven by the CUDA drafter, on CUDA, printed the CPU's greedy
    /// ids; its acceptance (accepted drafts / drafts).
    pub speculative_equals_greedy: bool,
    pub acceptance: f64,
}

impl DraftReport {
    pub fn ok(&self) -> bool {
        self.step_equal
            && self.probs_ids_equal
            && self.probs_rel_l2 <= REL_L2_MAX
            && self.rounds_equal == self.rounds
            && self.verifies_equal == self.verifies
            && self.speculative_equals_greedy
    }
}

/// Runs `prompt` through the CPU and CUDA backends, both with `assistant`, in lockstep: one plain
/// step, then rounds that each draft `k` on both (compared) and verify on both (argmaxes compared)
/// the CPU's drafts, or — every second and third round, since random fixture assistants are
/// never right — greedy's own continuation (all k accepted) or greedy's with its second token
/// wrong (one accepted); then commit the accepted tokens and the target's own one. So the drafts
/// read hidden states kept by `step`, by `prefill` and by commits of each verify row the rounds
/// reach, `tokens` tokens in all. Then speculative decoding on CUDA alone, its own drafts
/// verified, against the CPU's greedy ids.
pub fn drafts_match(
    model: &Arc<Model>,
    assistant: &Arc<megagemma_model::assistant::AssistantModel>,
    prompt: &[u32],
    k: usize,
    tokens: usize,
) -> Result<DraftReport> {
    use crate::backend::CudaBackend;
    use megagemma_model::backend::{Backend, Want as BWant};
    use megagemma_model::cpu::CpuBackend;
    let (greedy, _) = cpu_greedy(model, prompt, tokens + k + 1)?;
    let vocab = model.plan.vocab_size as u32;
    let mut cpu = CpuBackend::new(model.clone()).with_assistant(assistant.clone());
    let cm = CudaModel::load(model)?;
    let mut gpu = CudaBackend::new(cm, prompt.len() + tokens + k + 2).with_assistant(assistant)?;
    let (sc, sg) = (cpu.new_sequence()?, gpu.new_sequence()?);
    let mut tok = cpu.prefill(sc, prompt, BWant::Argmax)?.argmax;
    gpu.prefill(sg, prompt, BWant::Argmax)?;
    let mut r = DraftReport {
        rounds: 0,
        rounds_equal: 0,
        verifies: 0,
        verifies_equal: 0,
        step_equal: false,
        probs_ids_equal: false,
        probs_rel_l2: f64::INFINITY,
        first_diff: None,
        speculative_equals_greedy: false,
        acceptance: 0.0,
    };
    // A round with probabilities (the logits path, launched step by step), then a greedy one right
    // after prefill, then one plain step: the next draft reads the hidden state its commit kept.
    let (pc, pg) = (cpu.draft(sc, tok, k, true)?, gpu.draft(sg, tok, k, true)?);
    r.probs_ids_equal = pc.ids == pg.ids && pc.probs.len() == k && pg.probs.len() == k;
    r.probs_rel_l2 = pc.probs.iter().zip(&pg.probs).map(|(c, g)| rel_l2(g, c)).fold(0.0, f64::max);
    let mut rounds = Vec::new();
    rounds.push((cpu.draft(sc, tok, k, false)?.ids, gpu.draft(sg, tok, k, false)?.ids, cpu.seq_len(sc)?));
    let next = cpu.step(&[(sc, tok)], BWant::Argmax)?[0].argmax;
    r.step_equal = next == gpu.step(&[(sg, tok)], BWant::Argmax)?[0].argmax;
    let mut out = vec![tok, next];
    tok = next;
    while out.len() < tokens {
        let pos = cpu.seq_len(sc)?;
        let dc = cpu.draft(sc, tok, k, false)?.ids;
        let dg = gpu.draft(sg, tok, k, false)?.ids;
        let cont = &greedy[out.len()..out.len() + k];
        let drafts: Vec<u32> = match rounds.len() % 3 {
            0 => dc.clone(),
            1 => cont.to_vec(),
            _ => cont.iter().enumerate().map(|(i, &t)| if i == 1 { (t + 1) % vocab } else { t }).collect(),
        };
        rounds.push((dc, dg, pos));
        let cand: Vec<u32> = std::iter::once(tok).chain(drafts.iter().copied()).collect();
        let vc: Vec<u32> = cpu.verify(sc, &cand, BWant::Argmax)?.iter().map(|o| o.argmax).collect();
        let vg: Vec<u32> = gpu.verify(sg, &cand, BWant::Argmax)?.iter().map(|o| o.argmax).collect();
        r.verifies += 1;
        r.verifies_equal += usize::from(vc == vg);
        let n = drafts.iter().zip(&vc).take_while(|(d, t)| d == t).count();
        cpu.commit(sc, n + 1)?;
        gpu.commit(sg, n + 1)?;
        out.extend_from_slice(&drafts[..n]);
        out.push(vc[n]);
        tok = vc[n];
    }
    r.rounds = rounds.len();
    for (dc, dg, pos) in rounds {
        if dc == dg {
            r.rounds_equal += 1;
        } else if r.first_diff.is_none() {
            r.first_diff = Some((pos, dc, dg));
        }
    }
    out.truncate(tokens);
    let greedy = &greedy[..tokens];

    // Speculative decoding on CUDA alone, driven by its own drafts.
    let s = gpu.new_sequence()?;
    let mut tok = gpu.prefill(s, prompt, BWant::Argmax)?.argmax;
    let (mut spec, mut drafted, mut accepted) = (vec![tok], 0usize, 0usize);
    while spec.len() < tokens {
        let d = gpu.draft(s, tok, k, false)?.ids;
        let cand: Vec<u32> = std::iter::once(tok).chain(d.iter().copied()).collect();
        let v: Vec<u32> = gpu.verify(s, &cand, BWant::Argmax)?.iter().map(|o| o.argmax).collect();
        let n = d.iter().zip(&v).take_while(|(a, b)| a == b).count();
        gpu.commit(s, n + 1)?;
        (drafted, accepted) = (drafted + k, accepted + n);
        spec.extend_from_slice(&d[..n]);
        spec.push(v[n]);
        tok = v[n];
    }
    spec.truncate(tokens);
    r.speculative_equals_greedy = spec == greedy && out == greedy;
    r.acceptance = accepted as f64 / drafted.max(1) as f64;
    Ok(r)
}

/// The device's candidate selection (`CudaSeq::candidates`, `Want::Candidates`) against
/// `top_candidates` on the same rows, in every way a backend hands candidates out: prefill,
/// graph and megakernel decode steps, a batched step and a verify pass of `cm` from `prompt`,
/// each against the logits of the same pass asked for whole; then crafted rows (ties, ±0, NaN,
/// ±∞, fewer finite logits than k) written into a sequence's logits. Returns the first mismatch.
pub fn candidates_match_host(cm: &Arc<CudaModel>, prompt: &[u32], k: usize) -> std::result::Result<usize, String> {
    use megagemma_model::backend::{top_candidates, Backend, SeqId, Want as BWant};
    let err = |e: Error| e.to_string();
    let mut compared = 0;
    let mut same = |what: &str, whole: &megagemma_model::backend::PosOut, got: &megagemma_model::backend::PosOut| {
        let want = top_candidates(&whole.logits, k);
        compared += 1;
        if got.candidates != want || got.argmax != whole.argmax {
            return Err(format!(
                "{what}: device {:?} / argmax {}, host {:?} / argmax {}",
                got.candidates, got.argmax, want, whole.argmax
            ));
        }
        Ok(())
    };
    for decode in [Decode::Graph, Decode::Megakernel] {
        let mut b = crate::CudaBackend::new(cm.clone(), prompt.len() + 16).with_decode(decode);
        let (x, y) = (b.new_sequence().map_err(err)?, b.new_sequence().map_err(err)?);
        let (px, py) = (
            b.prefill(x, prompt, BWant::Logits).map_err(err)?,
            b.prefill(y, prompt, BWant::Candidates(k)).map_err(err)?,
        );
        same("prefill", &px, &py)?;
        let mut tok = px.argmax;
        for i in 0..4 {
            let ox = b.step(&[(x, tok)], BWant::Logits).map_err(err)?.remove(0);
            let oy = b.step(&[(y, tok)], BWant::Candidates(k)).map_err(err)?.remove(0);
            same(&format!("{decode:?} step {i}"), &ox, &oy)?;
            tok = ox.argmax;
        }
        if decode == Decode::Graph {
            // A batched step: the rows of both sequences from the first one's scratch.
            let z = b.fork(x).map_err(err)?;
            let both: Vec<(SeqId, u32)> = vec![(y, tok), (z, tok)];
            let whole = b.step(&[(x, tok)], BWant::Logits).map_err(err)?.remove(0);
            for (i, o) in b.step(&both, BWant::Candidates(k)).map_err(err)?.iter().enumerate() {
                same(&format!("batched column {i}"), &whole, o)?;
            }
            let block = [whole.argmax, 1, 2];
            let vx = b.verify(x, &block, BWant::Logits).map_err(err)?;
            let vy = b.verify(y, &block, BWant::Candidates(k)).map_err(err)?;
            for (i, (ox, oy)) in vx.iter().zip(&vy).enumerate() {
                same(&format!("verify column {i}"), ox, oy)?;
            }
        }
    }
    // Crafted rows in a sequence's logits rows.
    let vocab = cm.plan.vocab_size;
    let seq = CudaSeq::new(cm, 8).map_err(err)?;
    let mut rows: Vec<Vec<f32>> = vec![];
    let mut r: Vec<f32> = (0..vocab).map(|i| ((i * 7919) % 13) as f32 * 0.25 - 1.0).collect(); // many ties
    rows.push(r.clone());
    r.iter_mut().enumerate().for_each(|(i, v)| {
        *v = match i % 5 {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            2 => 0.0,
            3 => -0.0,
            _ => -1e-30,
        }
    });
    rows.push(r.clone());
    let mut sparse = vec![f32::NEG_INFINITY; vocab];
    sparse[vocab / 2] = 2.0;
    sparse[vocab - 1] = f32::INFINITY;
    sparse[1] = f32::INFINITY;
    rows.push(sparse);
    let flat: Vec<f32> = rows.concat();
    cm.gpu.upload(seq.s.logits.ptr, &flat).map_err(err)?;
    let got = seq.candidates(rows.len(), k).map_err(err)?.ok_or("no device selection for this vocabulary")?;
    Ok(compared + lists_match_host(&rows, &got, k, "crafted row")?)
}

/// Each device list of `got` against `top_candidates(row, k)` of its row, bit for bit (±0 and
/// NaN payloads included); the rows compared, or the first mismatch (`what` names the row).
fn lists_match_host(
    rows: &[Vec<f32>],
    got: &[crate::candidates::Candidates],
    k: usize,
    what: &str,
) -> std::result::Result<usize, String> {
    use megagemma_model::backend::top_candidates;
    let bits = |c: &[(u32, f32)]| c.iter().map(|&(t, l)| (t, l.to_bits())).collect::<Vec<_>>();
    for (i, (row, g)) in rows.iter().zip(got).enumerate() {
        let want = top_candidates(row, k);
        if bits(g) != bits(&want) {
            return Err(format!("{what} {i}, k {k}: device {g:?}, host {want:?}"));
        }
    }
    Ok(rows.len())
}

/// The device's selection (`top_candidates_blocks`, `top_candidates_merge`) and draw
/// (`sample_draw`) on rows as wide as Gemma's vocabulary, where 64 blocks' lists are merged (the
/// fixtures' vocabularies fit one block), and on a row that ends inside a block, against
/// `top_candidates` and `draw_candidates` on the host: ties, NaN, ±∞, fewer finite logits than k,
/// the best keys all in one block or in the last, k from 1 to 64. Returns the comparisons made.
pub fn wide_rows_match_host(cm: &CudaModel) -> std::result::Result<usize, String> {
    let gpu = &cm.gpu;
    use crate::candidates::{launch_draw, select_candidates, survivors, DrawBuffers, CAND_BLOCK};
    use megagemma_model::backend::top_candidates;
    use megagemma_model::draw::{draw_candidates, DrawParams};
    let err = |e: Error| e.to_string();
    let hash = |i: usize| (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    let mut compared = 0;
    for n in [262_144, 262_144 - 5 * CAND_BLOCK + 123] {
        let mut rows: Vec<Vec<f32>> = vec![];
        // Many ties: 5,000 values over the row.
        rows.push((0..n).map(|i| (hash(i) % 5000) as f32 * 1e-3 - 2.5).collect());
        // Mostly −∞ and NaN, 70 finite values and two +∞ scattered.
        let mut sparse: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { f32::NAN } else { f32::NEG_INFINITY }).collect();
        for j in 0..70 {
            sparse[(hash(j) as usize) % n] = (j % 9) as f32 - 4.0;
        }
        sparse[n / 3] = f32::INFINITY;
        sparse[n - 1] = f32::INFINITY;
        rows.push(sparse);
        // Ten finite logits: fewer than most k.
        let mut few = vec![f32::NEG_INFINITY; n];
        (0..10).for_each(|j| few[(j * 7919 + 11) % n] = -(j as f32) * 0.5);
        rows.push(few);
        // The best 100 in one block, and the best 100 at the row's end.
        let small: Vec<f32> = (0..n).map(|i| -10.0 - (hash(i) % 1000) as f32 * 1e-2).collect();
        let mut one = small.clone();
        (0..100).for_each(|j| one[7 * CAND_BLOCK + 5 + j] = j as f32 * 0.125);
        rows.push(one);
        let mut last = small;
        (0..100).for_each(|j| last[n - 1 - j] = (j % 37) as f32);
        rows.push(last);
        let logits = gpu.alloc(rows.len() * n * 4).map_err(err)?;
        gpu.upload(logits.ptr, &rows.concat()).map_err(err)?;
        let mut keys = None;
        for k in [1, 2, 17, 64] {
            let got = select_candidates(gpu, &mut keys, logits.ptr, rows.len(), n, k).map_err(err)?;
            compared += lists_match_host(&rows, &got, k, &format!("{n}-wide row"))?;
        }
        // Draws: each row's block lists, then `sample_draw` with a uniform the meta word points at.
        let (uniforms, meta, ids, flag) = (
            gpu.alloc(8 * 8).map_err(err)?,
            gpu.alloc(8).map_err(err)?,
            gpu.alloc(8).map_err(err)?,
            gpu.alloc(8).map_err(err)?,
        );
        let us = [0.0, 0.37, 0.999_999, 0.5, 0.81, 0.02, 0.64, 0.25];
        gpu.upload(uniforms.ptr, &us).map_err(err)?;
        let survivor_keys = gpu.alloc(survivors(n, 64) * 8).map_err(err)?;
        let buffers = DrawBuffers {
            keys: survivor_keys.ptr,
            uniforms: uniforms.ptr,
            meta: meta.ptr,
            ids: ids.ptr,
            flag: flag.ptr,
        };
        let draws = [
            DrawParams { temperature: 1.0, top_k: 64, top_p: 0.95, min_p: 0.0 },
            DrawParams { temperature: 0.3, top_k: 17, top_p: 1.0, min_p: 0.05 },
            DrawParams { temperature: 2.0, top_k: 2, top_p: 1.0, min_p: 0.0 },
        ];
        for (i, row) in rows.iter().enumerate() {
            for (d, params) in draws.iter().enumerate() {
                let at = (i + d) % us.len();
                gpu.upload(meta.ptr, &[at as u32, 0]).map_err(err)?;
                gpu.upload(flag.ptr, &[0u32]).map_err(err)?;
                let row_at = logits.ptr + (i * n * 4) as u64;
                launch_draw(gpu, row_at, n, params, &buffers).map_err(err)?;
                let (mut id, mut set) = ([0u32], [0u32]);
                gpu.download(&mut id, ids.ptr).map_err(err)?;
                gpu.download(&mut set, flag.ptr).map_err(err)?;
                let device = (set[0] == 0).then_some(id[0]);
                let host = draw_candidates(&top_candidates(row, params.top_k), params, us[at]);
                compared += 1;
                if device != host {
                    return Err(format!(
                        "{n}-wide row {i}, {params:?}, u {}: device {device:?}, host {host:?}",
                        us[at]
                    ));
                }
            }
        }
    }
    Ok(compared)
}

/// Pipelined sampled decoding (`CudaSeq::decode_sampled`, the draw on the device) against the
/// host's: first the device's `exp_det` against the host's, bit for bit, over the exponents a
/// draw meets (0 down past the subnormals); then `conformance::sampled_in_one_call` on the graph
/// and megakernel paths for several draws (temperatures, top-k, top-p, min-p) — the tokens of
/// `decode` with candidates and the host's `draw_candidates` in a loop. Returns the draws checked.
pub fn sampled_match_host(cm: &Arc<CudaModel>, prompt: &[u32]) -> std::result::Result<usize, String> {
    use megagemma_model::draw::{exp_det, DrawParams};
    let err = |e: Error| e.to_string();
    let mut xs: Vec<f64> = (0..200_000).map(|i| -(i as f64) * 0.003_75 - (i % 11) as f64 * 1.3e-7).collect();
    xs.extend([0.0, -0.0, -1e-300, -708.4, -709.8, -744.4, -745.2, -746.0, -1e6, f64::NEG_INFINITY]);
    let n = xs.len();
    let (x, y) = (cm.gpu.alloc(n * 8).map_err(err)?, cm.gpu.alloc(n * 8).map_err(err)?);
    cm.gpu.upload(x.ptr, &xs).map_err(err)?;
    let args = [crate::device::Arg::Ptr(x.ptr), crate::device::Arg::Ptr(y.ptr), crate::device::Arg::I32(n as i32)];
    cm.gpu.launch("exp_det_values", n.div_ceil(256) as u32, 256, 0, &args).map_err(err)?;
    let mut got = vec![0f64; n];
    cm.gpu.download(&mut got, y.ptr).map_err(err)?;
    if let Some(i) = (0..n).find(|&i| got[i].to_bits() != exp_det(xs[i]).to_bits()) {
        return Err(format!("exp_det({:e}): device {:e}, host {:e}", xs[i], got[i], exp_det(xs[i])));
    }
    let draws = [
        DrawParams { temperature: 1.0, top_k: 40, top_p: 1.0, min_p: 0.0 },
        DrawParams { temperature: 1.5, top_k: 64, top_p: 0.95, min_p: 0.0 },
        DrawParams { temperature: 0.7, top_k: 8, top_p: 0.9, min_p: 0.05 },
        DrawParams { temperature: 3.0, top_k: 2, top_p: 1.0, min_p: 0.0 },
    ];
    let mut checked = 0;
    for decode in [Decode::Graph, Decode::Megakernel] {
        for params in &draws {
            let mut b =
                crate::CudaBackend::new(cm.clone(), prompt.len() + 24).with_decode(decode).with_device_draw(true);
            megagemma_model::conformance::sampled_in_one_call(&mut b, prompt, params)
                .map_err(|e| format!("{decode:?} {params:?}: {e}"))?;
            checked += 1;
        }
    }
    Ok(checked)
}
