//! GPU check and bench for the CUDA backend (run on the GPU machine).
//!
//! `gpu_check fixtures [DIR…]`: every fixture's prompts through the CPU reference and CUDA, greedy,
//!   comparing ids and logits (contract: ids equal, relative L2 ≤ 1e-3).
//! `gpu_check verify [DIR…]`: a T-token forward equals T single decode steps bit for bit, on the
//!   fixtures and on synthetic models (head dims 256/512).
//! `gpu_check bench [e4b|e2b|tiny…]`: synthetic q4 decode speed against measured bandwidth.
//! `gpu_check prefill [NAME] [TOKENS]`: synthetic q4 prefill speed (default e4b, 2048 tokens); with
//!   `MEGAGEMMA_CUDA_PROFILE=1` the time per kernel and per cuBLAS product.
//! `gpu_check megakernel [DIR…]`: the megakernel's decode steps against the graph's, bit for bit,
//!   on the fixtures and synthetic models; an unsatisfiable schedule must fail within a second;
//!   then decode speed of both on synthetic E4B and E2B.
//! `gpu_check batch [DIR…]`: decode steps of several sequences in one `step` (one weight pass)
//!   against the same sequences stepped alone, bit for bit, on the fixtures and synthetic models.
//! `gpu_check drafts [ASSISTANT_DIR…]`: the MTP drafter on CUDA against the CPU backend's (default:
//!   every assistant under tests/fixtures/assistants, stored and q4): each round's drafts and
//!   verify argmaxes equal, and speculative decoding with CUDA's drafts prints the greedy ids.
//! `gpu_check draftcost [e4b|e2b]`: where a draft round of a random assistant of the real shapes
//!   goes, kernel by kernel (run with `MEGAGEMMA_CUDA_PROFILE=1 MEGAGEMMA_CUDA_GRAPHS=0`).
//! `gpu_check verifycost [e4b|e2b] [COLS]`: a decode step against a verify pass of COLS tokens (default
//!   3), kernel by kernel (run with `MEGAGEMMA_CUDA_PROFILE=1 MEGAGEMMA_CUDA_GRAPHS=0`).
//! `gpu_check seqcost [e4b|e2b] [REQUESTS]`: what a request costs beside its passes: REQUESTS short
//!   requests (new sequence, 64-token prefill, 16 greedy tokens, free) at the model's default
//!   context, with freed sequences reused (the default) and with each allocated anew.
//! `gpu_check all`: fixtures, verify and bench in turn. Exit status 1 when a check fails.

use megagemma_cuda::check::{
    assistant_fixture, batch_matches_lone, compare_greedy, drafts_match, fixture_cases, fixture_dirs, fixture_models,
    long_prompt, megakernel_broken_schedule, megakernel_matches_graph, verify_columns, MK_VERIFY_TOKENS, REL_L2_MAX,
};
use megagemma_cuda::{CudaModel, CudaSeq, Decode, Want};
use megagemma_model::Result;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const STEPS: usize = 24;
/// Tokens of the long prompts (the long-pass path, in one chunk and in several).
const LONG_PROMPT: usize = 200;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r.to_vec()),
        None => ("all", vec![]),
    };
    let ok = match run(cmd, &rest) {
        Ok(ok) => ok,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if !ok {
        eprintln!("gpu_check: FAILED");
        std::process::exit(1);
    }
    println!("gpu_check: all checks passed");
}

fn run(cmd: &str, rest: &[String]) -> Result<bool> {
    let fixtures = || -> Result<Vec<PathBuf>> {
        if !rest.is_empty() {
            return Ok(rest.iter().map(PathBuf::from).collect());
        }
        fixture_dirs(Path::new("tests/fixtures"))
    };
    match cmd {
        "fixtures" => fixtures_check(&fixtures()?),
        "verify" => verify_all(&fixtures()?),
        "bench" => {
            let names: Vec<String> = if rest.is_empty() { vec!["e4b".into(), "e2b".into()] } else { rest.to_vec() };
            for n in names {
                bench(&n)?;
            }
            Ok(true)
        }
        "megakernel" => megakernel_check(&fixtures()?),
        "batch" => batch_check(&fixtures()?, rest.is_empty()),
        "drafts" => drafts_check(rest),
        "draftcost" => draft_cost(rest.first().map_or("e4b", String::as_str)),
        "verifycost" => {
            let cols = rest.get(1).and_then(|c| c.parse().ok()).unwrap_or(3);
            verify_cost(rest.first().map_or("e4b", String::as_str), cols)
        }
        "seqcost" => {
            let requests = rest.get(1).and_then(|t| t.parse().ok()).unwrap_or(8);
            seq_cost(rest.first().map_or("e4b", String::as_str), requests)
        }
        "prefill" => {
            let name = rest.first().map_or("e4b", String::as_str);
            let tokens = rest.get(1).and_then(|t| t.parse().ok()).unwrap_or(2048);
            prefill_bench(name, tokens)?;
            Ok(true)
        }
        "all" => {
            let f = fixtures()?;
            let a = fixtures_check(&f)?;
            let b = verify_all(&f)?;
            bench("e4b")?;
            bench("e2b")?;
            Ok(a && b)
        }
        other => {
            megagemma_model::bail!(
                "unknown command '{other}' (fixtures, verify, bench, prefill, megakernel, batch, all)"
            )
        }
    }
}

fn fixtures_check(dirs: &[PathBuf]) -> Result<bool> {
    let mut all_ok = true;
    for dir in dirs {
        for (label, model) in fixture_models(dir)? {
            let cm = CudaModel::load(&model)?;
            let mut cases: Vec<(String, Vec<u32>, Option<usize>)> =
                fixture_cases(dir)?.into_iter().map(|(n, p)| (n, p, None)).collect();
            // Long prompts: one long pass, and chunks of 48 tokens across sliding-window wraps.
            if let Some((_, p, _)) = cases.first() {
                let long = long_prompt(p, model.plan.vocab_size, LONG_PROMPT);
                cases.push(("long".into(), long.clone(), None));
                cases.push(("long/48".into(), long, Some(48)));
            }
            for (name, prompt, chunk) in cases {
                let r = compare_greedy(&model, &cm, &prompt, STEPS, chunk)?;
                all_ok &= r.ok();
                println!(
                    "fixture {label:<22} {:<10} prompt {:>3}  ids equal {:>2}/{STEPS}  max rel L2 {:.2e}  {}",
                    name,
                    prompt.len(),
                    r.ids_equal,
                    r.max_rel_l2,
                    if r.ok() { "ok" } else { "FAIL" }
                );
                if !r.ok() {
                    println!("  cpu  {:?}\n  cuda {:?}", r.cpu_ids, r.cuda_ids);
                }
            }
        }
    }
    Ok(all_ok)
}

fn verify_one(label: &str, cm: &Arc<CudaModel>, prompt: &[u32], t: usize) -> Result<bool> {
    let r = verify_columns(cm, prompt, t)?;
    println!(
        "verify {label:<28} prompt {:>3}  T={t}: {}/{t} columns bit-identical to decode, partial commit {}  {}",
        prompt.len(),
        r.columns_equal,
        if r.partial_commit_exact { "exact" } else { "DIFFERS" },
        if r.ok() { "ok" } else { "FAIL" }
    );
    Ok(r.ok())
}

fn verify_all(dirs: &[PathBuf]) -> Result<bool> {
    let mut ok = true;
    for dir in dirs {
        for (label, model) in fixture_models(dir)? {
            let cm = CudaModel::load(&model)?;
            if let Some((_, prompt)) = fixture_cases(dir)?.into_iter().next() {
                ok &= verify_one(&label, &cm, &prompt, 8)?;
                ok &= verify_one(&label, &cm, &prompt, 5)?;
            }
        }
    }
    for name in ["tiny", "e4b"] {
        let cm = CudaModel::synthetic(name, "q4")?;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7919 + 11) as u32 % cm.plan().vocab_size as u32).collect();
        ok &= verify_one(&format!("synthetic {name}"), &cm, &prompt, 8)?;
    }
    Ok(ok)
}

/// Greedy decode of `steps` tokens from `tok`; returns (seconds, launches) over the steps.
fn decode_loop(cm: &CudaModel, seq: &mut CudaSeq, mut tok: u32, steps: usize) -> Result<(f64, u64)> {
    let l0 = cm.launches();
    let t = Instant::now();
    for _ in 0..steps {
        tok = seq.forward(&[tok], Want { all_positions: false, logits: false })?[0].argmax;
        seq.commit(1)?;
    }
    Ok((t.elapsed().as_secs_f64(), cm.launches() - l0))
}

fn bench(name: &str) -> Result<()> {
    let (prompt_len, steps) = (64, 256);
    let t0 = Instant::now();
    let cm = CudaModel::synthetic(name, "q4")?;
    let load_s = t0.elapsed().as_secs_f64();
    let bw = cm.read_bandwidth(8 << 30)?;
    let vocab = cm.plan().vocab_size as u32;
    let prompt: Vec<u32> = (0..prompt_len).map(|i| (i as u32 * 7919 + 11) % vocab).collect();
    let bytes = cm.decode_weight_bytes() as f64;
    println!(
        "bench synthetic {name} q4 on {}: weights {:.2} GB on device ({:.2} GB/token from the plan), generated in {load_s:.1} s",
        cm.device_name(),
        cm.device_weight_bytes() as f64 / 1e9,
        bytes / 1e9
    );
    println!("  measured read bandwidth {bw:.0} GB/s");
    cm.take_profile();
    for graphs in [false, true] {
        let mut seq = CudaSeq::new(&cm, prompt_len + steps + 2)?;
        seq.set_graphs(graphs);
        let t1 = Instant::now();
        let tok = seq.prefill(&prompt, false)?.argmax;
        let prefill_ms = t1.elapsed().as_secs_f64() * 1e3;
        // One warm-up step (captures the graph), then the timed decode.
        let tok = seq.forward(&[tok], Want { all_positions: false, logits: false })?[0].argmax;
        seq.commit(1)?;
        let (dt, launches) = decode_loop(&cm, &mut seq, tok, steps)?;
        let ms = dt / steps as f64 * 1e3;
        let launches = launches as f64 / steps as f64;
        let gbs = bytes / (dt / steps as f64) / 1e9;
        let mode = if graphs { "graph" } else { "launches" };
        println!("  prefill {prompt_len} tokens: {prefill_ms:.1} ms");
        println!(
            "  decode {steps} ({mode}): {ms:.3} ms/token, {:.1} tok/s, {gbs:.0} GB/s = {:.1}% of measured bandwidth, {launches:.1} launches/token",
            1e3 / ms,
            100.0 * gbs / bw
        );
        println!(
            "{{\"bench\":\"synthetic-{name}-q4\",\"mode\":\"{mode}\",\"device\":\"{}\",\"prompt\":{prompt_len},\"decode_tokens\":{steps},\"ms_per_token\":{ms:.4},\"tok_per_s\":{:.2},\"weight_bytes_per_token\":{},\"gb_per_s\":{gbs:.1},\"read_bw_gb_per_s\":{bw:.1},\"pct_of_bw\":{:.2},\"launches_per_token\":{launches:.1},\"prefill_ms\":{prefill_ms:.2}}}",
            cm.device_name(),
            1e3 / ms,
            bytes as u64,
            100.0 * gbs / bw
        );
        let profile = cm.take_profile();
        if !profile.is_empty() {
            println!("  per-kernel time (synchronised launches; prefill and decode):");
            for (k, n, secs) in profile {
                println!("    {k:<40} {n:>7} launches {:>9.3} ms  {:>7.2} us each", secs * 1e3, secs * 1e6 / n as f64);
            }
        }
    }
    Ok(())
}

/// Prefill of `tokens` tokens on a fresh sequence, after one warm-up prefill (kernel loading,
/// cuBLAS, scratch); the per-kernel profile of the timed one when profiling.
fn prefill_bench(name: &str, tokens: usize) -> Result<()> {
    let cm = CudaModel::synthetic(name, "q4")?;
    let vocab = cm.plan().vocab_size as u32;
    let prompt: Vec<u32> = (0..tokens).map(|i| (i as u32 * 7919 + 11) % vocab).collect();
    CudaSeq::new(&cm, tokens + 1)?.prefill(&prompt, false)?;
    cm.take_profile();
    let mut seq = CudaSeq::new(&cm, tokens + 1)?;
    let t = Instant::now();
    seq.prefill(&prompt, false)?;
    let s = t.elapsed().as_secs_f64();
    println!(
        "prefill synthetic {name} q4, {tokens} tokens in chunks of {}: {:.1} ms = {:.0} tok/s",
        seq.prefill_chunk(),
        s * 1e3,
        tokens as f64 / s
    );
    let profile = cm.take_profile();
    let total: f64 = profile.iter().map(|p| p.2).sum();
    for (k, n, secs) in profile.iter().take(40) {
        println!("  {k:<52} {n:>6} x {:>9.3} ms  {:>5.1}%", secs * 1e3, 100.0 * secs / total);
    }
    Ok(())
}

/// Several sequences stepped together against each stepped alone (bit for bit), in CUDA graphs
/// and in the megakernel: three on every fixture, 12 steps; with `synthetic` (no fixture named)
/// also nine (a pass of eight and one alone) on synthetic tiny and E4B, else 4 steps (a quick
/// run, as compute-sanitizer's in tools/gpu_session.sh).
fn batch_check(dirs: &[PathBuf], synthetic: bool) -> Result<bool> {
    let steps = if synthetic { 12 } else { 4 };
    let mut ok = true;
    let mut report = |label: &str, cm: &Arc<CudaModel>, prompts: &[Vec<u32>]| -> Result<()> {
        for decode in [Decode::Graph, Decode::Megakernel] {
            let r = batch_matches_lone(cm, prompts, steps, decode)?;
            ok &= r.ok();
            let launches = match decode {
                Decode::Megakernel => format!(", {}/{} passes one megakernel launch", r.megakernel_passes, r.steps),
                Decode::Graph => String::new(),
            };
            println!(
                "batch {label:<28} {:<10} {} sequences: {:>3}/{} outputs bit-identical to lone steps{launches}  {}",
                format!("{decode:?}"),
                prompts.len(),
                r.identical,
                r.outputs,
                if r.ok() { "ok" } else { "FAIL" }
            );
        }
        Ok(())
    };
    // Three sequences at different positions: each fixture prompt, shortened and rotated.
    for dir in dirs {
        for (label, model) in fixture_models(dir)? {
            let cm = CudaModel::load(&model)?;
            if let Some((_, p)) = fixture_cases(dir)?.into_iter().next() {
                let prompts: Vec<Vec<u32>> = (0..3)
                    .map(|i| p.iter().cycle().skip(i).take((p.len() + 2 * i).max(1)).copied().collect())
                    .collect();
                report(&label, &cm, &prompts)?;
            }
        }
    }
    // Nine sequences: a pass of eight and one alone.
    for name in ["tiny", "e4b"].into_iter().filter(|_| synthetic) {
        let cm = CudaModel::synthetic(name, "q4")?;
        let vocab = cm.plan().vocab_size as u32;
        let prompts: Vec<Vec<u32>> =
            (0..9u32).map(|s| (0..20 + 3 * s).map(|i| (i * 7919 + 11 + s * 131) % vocab).collect()).collect();
        report(&format!("synthetic {name}"), &cm, &prompts)?;
    }
    Ok(ok)
}

/// Ten greedy draft rounds of k = 3 after a 64-token prompt on synthetic `name` with a random
/// assistant; with `MEGAGEMMA_CUDA_PROFILE=1` the time per kernel.
fn draft_cost(name: &str) -> Result<bool> {
    use megagemma_cuda::backend::CudaBackend;
    use megagemma_model::backend::{Backend, Want as BWant};
    let cm = CudaModel::synthetic(name, "q4")?;
    let vocab = cm.plan().vocab_size as u32;
    let mut b = CudaBackend::new(cm.clone(), 256).with_synthetic_assistant()?;
    let seq = b.new_sequence()?;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 1000) % vocab).collect();
    let tok = b.prefill(seq, &prompt, BWant::Argmax)?.argmax;
    b.draft(seq, tok, 3, false)?;
    cm.take_profile();
    let t = Instant::now();
    for _ in 0..10 {
        b.draft(seq, tok, 3, false)?;
    }
    println!("draft round of 3 on synthetic {name}: {:.3} ms", t.elapsed().as_secs_f64() * 1e2);
    for (k, n, secs) in cm.take_profile() {
        println!("  {k:<48} {:>5} launches {:>8.3} ms  {:>7.2} us each", n / 10, secs * 1e2, secs * 1e6 / n as f64);
    }
    Ok(true)
}

/// `requests` short requests on synthetic `name` at its default context for one sequence, timed
/// per request (the first of each run apart: it allocates and captures in both), with the
/// backend's pool of freed sequences on and off.
fn seq_cost(name: &str, requests: usize) -> Result<bool> {
    use megagemma_cuda::backend::{CudaBackend, DefaultContext};
    use megagemma_model::backend::{Backend, Want as BWant};
    let cm = CudaModel::synthetic(name, "q4")?;
    let vocab = cm.plan().vocab_size as u32;
    let ctx = DefaultContext::measure(&cm, 1)?.tokens;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 1000) % vocab).collect();
    let mut ids_of = vec![];
    for pool in [true, false] {
        let mut b = CudaBackend::new(cm.clone(), ctx).with_sequence_pool(pool);
        let mut ms = vec![];
        let mut ids = vec![];
        for _ in 0..requests.max(2) {
            let t = Instant::now();
            let seq = b.new_sequence()?;
            let tok = b.prefill(seq, &prompt, BWant::Argmax)?.argmax;
            ids.clear();
            b.decode_greedy(seq, tok, 16, &mut |t| {
                ids.push(t);
                true
            })?;
            b.free(seq)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let rest = &ms[1..];
        println!(
            "synthetic {name}, context {ctx}, pool {}: first request {:.2} ms, then {:.2} ms a request (min {:.2}, max {:.2})",
            if pool { "on " } else { "off" },
            ms[0],
            rest.iter().sum::<f64>() / rest.len() as f64,
            rest.iter().cloned().fold(f64::MAX, f64::min),
            rest.iter().cloned().fold(0.0, f64::max)
        );
        ids_of.push(ids);
    }
    let same = ids_of[0] == ids_of[1];
    println!("same ids with and without the pool: {same}");
    Ok(same)
}

/// Twenty decode steps, then twenty verify passes of `cols` tokens (discarded) on synthetic `name`;
/// with `MEGAGEMMA_CUDA_PROFILE=1` each's time per kernel, per pass.
fn verify_cost(name: &str, cols: usize) -> Result<bool> {
    const PASSES: usize = 20;
    let cm = CudaModel::synthetic(name, "q4")?;
    let vocab = cm.plan().vocab_size as u32;
    let mut seq = CudaSeq::new(&cm, 320)?;
    let prompt: Vec<u32> = (0..64u32).map(|i| (i * 7919 + 1000) % vocab).collect();
    let mut tok = seq.prefill(&prompt, false)?.argmax;
    let block: Vec<u32> = (0..cols as u32).map(|i| prompt[i as usize]).collect();
    let want = Want { all_positions: true, logits: false };
    seq.forward(&block, want)?;
    seq.commit(0)?;
    tok = seq.step(tok, false)?.argmax;
    let report = |label: &str, secs: f64| {
        println!("{label}: {:.3} ms a pass", secs * 1e3 / PASSES as f64);
        for (k, n, s) in cm.take_profile() {
            println!("  {k:<52} {:>6.1} launches {:>8.2} us a pass", n as f64 / PASSES as f64, s * 1e6 / PASSES as f64);
        }
    };
    cm.take_profile();
    let t = Instant::now();
    for _ in 0..PASSES {
        tok = seq.step(tok, false)?.argmax;
    }
    report("decode step", t.elapsed().as_secs_f64());
    // The same step's graph replayed back to back (no host round trip between steps); with
    // MEGAGEMMA_CUDA_GRAPHS=0 (the per-kernel profile) there is no graph to replay.
    if seq.uses_graphs() {
        let t = Instant::now();
        seq.replay_last_step(PASSES)?;
        report("decode step replayed back to back", t.elapsed().as_secs_f64());
    } else {
        println!("decode step replayed back to back: skipped (MEGAGEMMA_CUDA_GRAPHS=0: no graph)");
    }
    // Pipelined greedy steps (each step's token from the one before, one step queued ahead), after
    // one untimed step that captures the second graph.
    seq.decode_greedy(tok, 1, &mut |t| {
        tok = t;
        true
    })?;
    let t = Instant::now();
    seq.decode_greedy(tok, PASSES, &mut |t| {
        tok = t;
        true
    })?;
    report("pipelined greedy steps", t.elapsed().as_secs_f64());
    let t = Instant::now();
    for _ in 0..PASSES {
        seq.forward(&block, want)?;
        seq.commit(0)?;
    }
    report(&format!("verify of {cols}"), t.elapsed().as_secs_f64());
    Ok(true)
}

/// The MTP drafter on CUDA against the CPU's, for each assistant fixture (`expected.json` names its
/// target) stored and quantized on load as q4, on the target's prompts.
fn drafts_check(dirs: &[String]) -> Result<bool> {
    use megagemma_model::assistant::AssistantModel;
    use megagemma_model::quant::load::QuantMode;
    const TOKENS: usize = 48;
    let dirs: Vec<PathBuf> = if dirs.is_empty() {
        fixture_dirs(Path::new("tests/fixtures/assistants"))?
    } else {
        dirs.iter().map(PathBuf::from).collect()
    };
    let mut ok = true;
    for dir in dirs {
        let (target_dir, k) = assistant_fixture(&dir)?;
        for quant in [QuantMode::Stored, QuantMode::Q4] {
            let model = Arc::new(megagemma_model::Model::load_with(&target_dir, quant)?);
            let asst = Arc::new(AssistantModel::load(&dir, &model, quant)?);
            for (case, prompt) in fixture_cases(&target_dir)? {
                let r = drafts_match(&model, &asst, &prompt, k, TOKENS)?;
                ok &= r.ok();
                let label = format!("{}/{quant} {case}", dir.file_name().unwrap_or_default().to_string_lossy());
                println!(
                    "drafts {label:<28} rounds {:>2}/{} equal, verifies {:>2}/{} equal, step {}, speculative = greedy: {} \
                     (acceptance {:.2})  {}",
                    r.rounds_equal,
                    r.rounds,
                    r.verifies_equal,
                    r.verifies,
                    if r.step_equal { "equal" } else { "DIFFERS" },
                    r.speculative_equals_greedy,
                    r.acceptance,
                    if r.ok() { "ok" } else { "FAIL" }
                );
                if !r.probs_ids_equal || r.probs_rel_l2 > REL_L2_MAX {
                    println!(
                        "  round with probabilities: ids equal {}, max rel L2 {:.2e}",
                        r.probs_ids_equal, r.probs_rel_l2
                    );
                }
                if let Some((pos, c, g)) = &r.first_diff {
                    println!("  first differing round at position {pos}: CPU {c:?}, CUDA {g:?}");
                }
            }
        }
    }
    Ok(ok)
}

/// The megakernel against the graph path (bit for bit), its failure on a broken schedule, and
/// both paths' decode speed.
fn megakernel_check(dirs: &[PathBuf]) -> Result<bool> {
    const STEPS: usize = 16;
    let mut ok = true;
    let mut report = |label: &str, cm: &Arc<CudaModel>, prompt: &[u32]| -> Result<()> {
        match megakernel_matches_graph(cm, prompt, STEPS) {
            Ok(r) => {
                let nv = MK_VERIFY_TOKENS.len();
                let good = r.identical == STEPS && r.verify_identical == nv;
                ok &= good;
                let verdict = if good { "ok" } else { "FAIL" };
                println!(
                    "megakernel {label:<28} {:>2}/{STEPS} steps bit-identical to the graph, ids {:>2}/{STEPS}, max rel L2 {:.1e}, verify passes {}/{nv}  {verdict}",
                    r.identical, r.ids_equal, r.max_rel_l2, r.verify_identical
                );
            }
            Err(e) => return Err(e),
        }
        Ok(())
    };
    for dir in dirs {
        for (label, model) in fixture_models(dir)? {
            let cm = CudaModel::load(&model)?;
            if let Some((_, prompt)) = fixture_cases(dir)?.into_iter().next() {
                report(&label, &cm, &prompt)?;
            }
        }
    }
    for name in ["tiny", "e2b", "e4b"] {
        let cm = CudaModel::synthetic(name, "q4")?;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 7919 + 11) as u32 % cm.plan().vocab_size as u32).collect();
        report(&format!("synthetic {name}"), &cm, &prompt)?;
    }
    let cm = CudaModel::synthetic("tiny", "q4")?;
    let (took, err) = megakernel_broken_schedule(&cm, &[1, 2, 3])?;
    let fast = took.as_secs_f64() < 1.5;
    ok &= fast;
    println!(
        "megakernel broken schedule: error after {:.2} s ({})  {}",
        took.as_secs_f64(),
        err,
        if fast { "ok" } else { "FAIL" }
    );
    for name in ["e4b", "e2b"] {
        let cm = CudaModel::synthetic(name, "q4")?;
        let vocab = cm.plan().vocab_size as u32;
        let prompt: Vec<u32> = (0..64).map(|i| (i as u32 * 7919 + 11) % vocab).collect();
        for decode in [Decode::Graph, Decode::Megakernel] {
            let mut seq = CudaSeq::new(&cm, 64 + 256 + 4)?;
            seq.set_decode(decode);
            let tok = seq.prefill(&prompt, false)?.argmax;
            let tok = seq.forward(&[tok], Want { all_positions: false, logits: false })?[0].argmax;
            seq.commit(1)?;
            let (dt, launches) = decode_loop(&cm, &mut seq, tok, 256)?;
            let shape = seq.megakernel_shape().map_or(String::new(), |(s, g)| format!(", {s} stages on {g} blocks"));
            println!(
                "decode synthetic {name} ({decode:?}): {:.3} ms/token, {:.1} tok/s, {:.1} launches/token{shape}",
                dt / 256.0 * 1e3,
                256.0 / dt,
                launches as f64 / 256.0
            );
            if decode == Decode::Megakernel {
                // One traced step: where the token's time goes, per stage kernel.
                seq.set_megakernel_trace(true);
                let tok = seq.forward(&[tok], Want { all_positions: false, logits: false })?[0].argmax;
                seq.commit(1)?;
                seq.forward(&[tok], Want { all_positions: false, logits: false })?;
                if let Some(t) = seq.megakernel_trace()? {
                    print!("  {}", t.table());
                }
            }
        }
    }
    Ok(ok)
}
