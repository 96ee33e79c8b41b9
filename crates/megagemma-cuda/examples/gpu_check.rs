//! GPU check and bench for the CUDA backend (run on the GPU machine).
//!
//! `gpu_check fixtures [DIR…]`: every fixture's prompts through the CPU reference and CUDA, greedy,
//!   comparing ids and logits (contract: ids equal, relative L2 ≤ 1e-3).
//! `gpu_check verify [DIR…]`: a T-token forward equals T single decode steps bit for bit, on the
//!   fixtures and on synthetic models (head dims 256/512).
//! `gpu_check bench [e4b|e2b|tiny…]`: synthetic q4 decode speed against measured bandwidth.
//! `gpu_check all`: the three in turn. Exit status 1 when a check fails.

use megagemma_cuda::{CudaModel, CudaSeq, Want};
use megagemma_model::cpu::forward::forward_chunk;
use megagemma_model::cpu::kv::KvCache;
use megagemma_model::cpu::ops::argmax;
use megagemma_model::{Model, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

const STEPS: usize = 24;
const REL_L2_MAX: f64 = 1e-3;

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
        let mut v: Vec<PathBuf> = std::fs::read_dir("tests/fixtures")
            .map_err(|e| megagemma_model::Error::msg(format!("tests/fixtures: {e}")))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.join("expected.json").is_file())
            .collect();
        v.sort();
        Ok(v)
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
        "all" => {
            let f = fixtures()?;
            let a = fixtures_check(&f)?;
            let b = verify_all(&f)?;
            bench("e4b")?;
            bench("e2b")?;
            Ok(a && b)
        }
        other => megagemma_model::bail!("unknown command '{other}' (fixtures, verify, bench, all)"),
    }
}

/// `(name, prompt ids)` of each case of a fixture's expected.json.
fn cases(dir: &Path) -> Result<Vec<(String, Vec<u32>)>> {
    let path = dir.join("expected.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| megagemma_model::Error::msg(format!("{}: {e}", path.display())))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| megagemma_model::Error::msg(format!("{}: {e}", path.display())))?;
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

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Greedy CPU reference: logits of the prompt's last position and of each of `steps − 1` decode steps.
fn cpu_greedy(model: &Model, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut kv = KvCache::new(&model.plan);
    let (mut ids, mut logits) = (vec![], vec![]);
    let mut input = prompt.to_vec();
    for _ in 0..steps {
        let out = forward_chunk(&model.plan, &model.weights, &mut kv, &input, 1);
        kv.commit(input.len()).expect("commit");
        let next = argmax(&out.logits);
        ids.push(next);
        logits.push(out.logits);
        input = vec![next];
    }
    (ids, logits)
}

fn cuda_greedy(cm: &Arc<CudaModel>, prompt: &[u32], steps: usize) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut seq = CudaSeq::new(cm, prompt.len() + steps + 1)?;
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

fn fixtures_check(dirs: &[PathBuf]) -> Result<bool> {
    let mut all_ok = true;
    for dir in dirs {
        let model = Model::load(dir)?;
        let cm = CudaModel::load(&model)?;
        for (name, prompt) in cases(dir)? {
            let (cpu_ids, cpu_logits) = cpu_greedy(&model, &prompt, STEPS);
            let (gpu_ids, gpu_logits) = cuda_greedy(&cm, &prompt, STEPS)?;
            let same = cpu_ids.iter().zip(&gpu_ids).take_while(|(a, b)| a == b).count();
            let worst =
                cpu_logits.iter().zip(&gpu_logits).take(same.max(1)).map(|(c, g)| rel_l2(g, c)).fold(0.0, f64::max);
            let ok = same == STEPS && worst <= REL_L2_MAX;
            all_ok &= ok;
            println!(
                "fixture {:<14} {:<10} prompt {:>3}  ids equal {:>2}/{STEPS}  max rel L2 {:.2e}  {}",
                dir.file_name().unwrap_or_default().to_string_lossy(),
                name,
                prompt.len(),
                same,
                worst,
                if ok { "ok" } else { "FAIL" }
            );
            if !ok {
                println!("  cpu  {cpu_ids:?}\n  cuda {gpu_ids:?}");
            }
        }
    }
    Ok(all_ok)
}

/// A T-token forward (verify) against T single decode steps, then a partial commit.
fn verify_one(label: &str, cm: &Arc<CudaModel>, prompt: &[u32], t: usize) -> Result<bool> {
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
        step_logits.push(o.logits.unwrap());
    }
    let cols = ver.forward(&feed[..t], Want { all_positions: true, logits: true })?;
    let mut equal = cols.iter().zip(&step_logits).filter(|(c, s)| c.logits.as_deref() == Some(&s[..])).count();
    // Accept part of the candidates, then decode the next one: must equal that decode step.
    let keep = t / 2;
    ver.commit(keep)?;
    let next = ver.forward(&[feed[keep]], Want { all_positions: false, logits: true })?.remove(0);
    let after_commit = next.logits.as_deref() == Some(&step_logits[keep][..]);
    equal += after_commit as usize;
    let ok = equal == t + 1;
    println!(
        "verify {label:<28} prompt {:>3}  T={t}: {}/{t} columns bit-identical to decode, partial commit {}  {}",
        prompt.len(),
        equal - after_commit as usize,
        if after_commit { "exact" } else { "DIFFERS" },
        if ok { "ok" } else { "FAIL" }
    );
    Ok(ok)
}

fn verify_all(dirs: &[PathBuf]) -> Result<bool> {
    let mut ok = true;
    for dir in dirs {
        let model = Model::load(dir)?;
        let cm = CudaModel::load(&model)?;
        if let Some((_, prompt)) = cases(dir)?.into_iter().next() {
            let label = dir.file_name().unwrap_or_default().to_string_lossy().to_string();
            ok &= verify_one(&label, &cm, &prompt, 8)?;
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
