//! `megagemma bench`: how fast a model decodes and how close that is to the memory wall.
//!
//! One run measures, on the backend that decodes: the read bandwidth the machine reaches (a
//! streaming read over a buffer much larger than the caches), prefill speed, decode ms/token,
//! the cost of a verify pass of k + 1 columns against a decode step, and — from the weight
//! bytes one decode step streams — the achieved GB/s and its share of the measured bandwidth.
//! A table for people, then one JSON line for tools. Speculative drafting (`--draft`) is timed
//! end to end on the same prompt.

use crate::backend_args::BackendArgs;
use crate::run::{resolve_model, DraftArgs};
use anyhow::{bail, Result};
use clap::Args;
use megagemma_engine::backends::{open_backend_with, Decode};
use megagemma_engine::generate::decode::{choose, want_for};
use megagemma_engine::generate::{generate, DraftMode, DraftParams, GenerateParams};
use megagemma_engine::sampling::{Sampler, SamplingParams};
use megagemma_model::assistant::AssistantModel;
use megagemma_model::backend::{Backend, SeqId, Want};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model: checkpoint directory, .gguf file or a name `megagemma pull` knows.
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Random weights of a real shape built on the device, no checkpoint needed:
    /// e2b, e4b, 26b-a4b, 31b or tiny (CUDA backend).
    #[arg(long, conflicts_with = "model")]
    pub synthetic: Option<String>,
    /// Weights: none (as stored), q4 (MLX affine g64), q4_0 (symmetric g32); synthetic: q4, q4_0, bf16.
    #[arg(long, default_value = "none")]
    pub quant: String,
    /// Prompt tokens prefilled before decoding.
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// Decode steps timed.
    #[arg(long, default_value_t = 128)]
    pub tokens: usize,
    /// Also decode N sequences together, one `step` of all of them per token (one weight pass on
    /// CUDA for up to 8; a batched matmul on the CPU), and report the aggregate tok/s.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub batch: usize,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// After the timed run, one more decode step with a per-block timeline recorded (CUDA,
    /// --decode megakernel), written to FILE as JSON (`tools/mk_trace.py FILE --png` draws it),
    /// and a table of where its time went; with --draft, also a verify pass of k + 1 tokens
    /// (FILE's name with `.verify` before its extension).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Worker threads on the CPU (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub draft: DraftArgs,
    /// Also time sampled decoding at this temperature (`--top-k`, `--top-p`, `--seed`): plain
    /// decoding as `run` samples, the next token chosen on the host from what the backend returns.
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// Top-k of the sampled run (Gemma's generation default: 64). A top-k up to 64 takes only the
    /// k highest logits from the CUDA backend (selected on the device); above, the whole row.
    #[arg(long, default_value_t = 64, requires = "temperature")]
    pub top_k: usize,
    /// Top-p of the sampled run (Gemma's generation default: 0.95).
    #[arg(long, default_value_t = 0.95, requires = "temperature")]
    pub top_p: f32,
    /// Seed of the sampled run.
    #[arg(long, default_value_t = 0, requires = "temperature")]
    pub seed: u64,
}

/// Figures of one bench run.
struct Figures {
    read_gbps: f64,
    prefill_tps: f64,
    decode_ms: f64,
    /// With `--decode megakernel` on CUDA: the graph path's decode ms per token, same run.
    graph_ms: Option<f64>,
    verify_cols: usize,
    verify_ms: f64,
    weight_bytes: usize,
    spec_tps: Option<(f64, f64)>,
    /// `--draft mtp`: ms per draft round of k tokens.
    draft_ms: Option<f64>,
    /// Launches per token of the single-sequence decode (before the batched run).
    launches: Option<f64>,
    /// `--batch N`: ms per step of all N sequences.
    batch_ms: Option<f64>,
    /// `--temperature T`: sampled decoding's tok/s.
    sampled_tps: Option<f64>,
}

pub fn bench(args: BenchArgs) -> Result<()> {
    if let Some(n) = args.threads {
        crate::run::rayon_threads(n)?;
    }
    if args.prompt_len == 0 || args.tokens == 0 {
        bail!("--prompt-len and --tokens must be at least 1");
    }
    if !(1..=256).contains(&args.batch) {
        bail!("--batch must be between 1 and 256");
    }
    let mut opts = args.backend.options()?;
    // `--batch N` holds N sequences beside the timed one.
    opts.sequences = args.batch + 1;
    if args.trace.is_some() && opts.decode != Some(Decode::Megakernel) {
        bail!("--trace records the decode megakernel: give --backend cuda --decode megakernel");
    }
    // A synthetic model drafts with a random assistant of the real shapes: no --assistant then.
    let synthetic_mtp = args.synthetic.is_some() && args.draft.draft == "mtp" && args.draft.assistant.is_none();
    let draft = if synthetic_mtp {
        DraftParams { mode: DraftMode::Mtp, k: args.draft.k, trace: args.draft.trace_drafts }
    } else {
        args.draft.params(None)?
    };
    let (label, mut backend): (String, Box<dyn Backend>) = match (&args.model, &args.synthetic) {
        (Some(m), None) => {
            let path = resolve_model(m)?;
            let quant: megagemma_model::quant::load::QuantMode = args.quant.parse()?;
            let model = Arc::new(megagemma_engine::model_files::load_model(&path, quant, opts.kind.runs_on_cpu())?);
            let assistant = match &args.draft.assistant {
                Some(dir) => Some(Arc::new(AssistantModel::load(dir, &model, quant)?)),
                None => None,
            };
            (path.display().to_string(), open_backend_with(model, assistant, &opts)?)
        }
        (None, Some(name)) => {
            if args.draft.assistant.is_some() {
                bail!("--assistant drafts for a checkpoint's model: --synthetic {name} --draft mtp drafts with a random assistant");
            }
            let label = format!("synthetic {name} {}", args.quant);
            (label, megagemma_engine::backends::open_synthetic(name, &args.quant, synthetic_mtp, &opts)?)
        }
        _ => bail!("give --model M or --synthetic e2b|e4b|26b-a4b|31b|tiny"),
    };
    let need = args.prompt_len + args.tokens + draft.k + 2;
    if need > backend.max_context() {
        bail!("--prompt-len + --tokens need a context of {need}, more than {}: raise --ctx", backend.max_context());
    }
    let f = measure(backend.as_mut(), &args, &draft)?;
    report(&label, backend.as_ref(), &args, &f);
    if let Some(path) = &args.trace {
        let seq = backend.new_sequence()?;
        let prompt = prompt_ids(args.prompt_len, backend.vocab_size());
        let tok = backend.prefill(seq, &prompt, Want::Argmax)?.argmax;
        print!("{}", backend.trace_pass(seq, &[tok], path)?);
        println!("trace            {} (tools/mk_trace.py {} --png timeline.png)", path.display(), path.display());
        // With drafting, also a verify pass of k + 1 tokens (the output and arbitrary drafts).
        if draft.mode != DraftMode::None {
            let vocab = backend.vocab_size() as u32;
            let tokens: Vec<u32> =
                std::iter::once(tok).chain((1..=draft.k as u32).map(|i| (tok + 7 * i) % vocab)).collect();
            let vpath = verify_trace_path(path);
            print!("{}", backend.trace_pass(seq, &tokens, &vpath)?);
            println!("trace            {} ({}-token verify pass)", vpath.display(), tokens.len());
        }
        backend.free(seq)?;
    }
    Ok(())
}

/// Where `--trace FILE` puts the verify pass's trace: `trace.json` → `trace.verify.json`.
fn verify_trace_path(path: &std::path::Path) -> PathBuf {
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    path.with_file_name(format!("{stem}.verify{ext}"))
}

/// The sampled run's parameters (`--temperature` and the options that go with it).
fn sampling_params(args: &BenchArgs) -> Option<SamplingParams> {
    let (top_k, top_p, seed) = (args.top_k, args.top_p, Some(args.seed));
    args.temperature.map(|temperature| SamplingParams { temperature, top_k, top_p, min_p: 0.0, seed })
}

/// A deterministic prompt of in-vocabulary ids that avoids the special tokens at the bottom.
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    let span = (vocab.saturating_sub(1000)).max(1) as u64;
    (0..n as u64).map(|i| (1000.min(vocab as u64 - 1) + (i * 7919 + 13) % span) as u32).collect()
}

fn measure(b: &mut dyn Backend, args: &BenchArgs, draft: &megagemma_engine::generate::DraftParams) -> Result<Figures> {
    let read_gbps = measure_read_bandwidth(b)?;
    let vocab = b.vocab_size();
    let prompt = prompt_ids(args.prompt_len, vocab);

    // Warm up (kernel compilation, caches, graph capture), then time prefill and decode.
    let warm = b.new_sequence()?;
    // The warm-up prefill is long enough to load the long-pass kernels (cuBLAS on CUDA) too.
    let o = b.prefill(warm, &prompt[..prompt.len().min(2048)], Want::Argmax)?;
    b.decode(warm, o.argmax, Want::Argmax)?;
    b.free(warm)?;

    let DecodeRun { seq, tok, prefill_s, decode_ms } = decode_run(b, &prompt, args.tokens)?;

    // Verify passes of k + 1 columns, each discarded (commit 0) so the position stays put.
    let verify_cols = draft.k + 1;
    let block: Vec<u32> = (0..verify_cols).map(|i| prompt[i % prompt.len()]).collect();
    b.verify(seq, &block, Want::Argmax)?;
    b.commit(seq, 0)?;
    let reps = (args.tokens / verify_cols).clamp(4, 64);
    let t2 = Instant::now();
    for _ in 0..reps {
        b.verify(seq, &block, Want::Argmax)?;
        b.commit(seq, 0)?;
    }
    let verify_ms = t2.elapsed().as_secs_f64() * 1e3 / reps as f64;
    // A draft round of k tokens from the position decode reached (nothing is committed).
    let draft_ms = if b.has_drafter() && draft.mode == DraftMode::Mtp {
        b.draft(seq, tok, draft.k, false)?;
        let t3 = Instant::now();
        for _ in 0..reps {
            b.draft(seq, tok, draft.k, false)?;
        }
        Some(t3.elapsed().as_secs_f64() * 1e3 / reps as f64)
    } else {
        None
    };
    b.free(seq)?;

    let spec_tps = if draft.mode == DraftMode::None {
        None
    } else {
        let params = GenerateParams { draft: draft.clone(), ..GenerateParams::greedy(args.tokens) };
        let g = generate(b, &prompt, &params, |_| true)?;
        let mean = g.spec.as_ref().map_or(0.0, |s| s.mean_accepted());
        Some((g.decode_tokens_per_second(), mean))
    };
    let launches = b.launches_per_token();
    let graph_ms = graph_baseline(b, &prompt, args.tokens)?;
    let batch_ms = if args.batch > 1 { Some(measure_batch(b, args, &prompt)?) } else { None };
    let sampled_tps = match sampling_params(args) {
        Some(sampling) => Some(measure_sampled(b, args, &prompt, sampling)?),
        None => None,
    };
    Ok(Figures {
        read_gbps,
        prefill_tps: args.prompt_len as f64 / prefill_s,
        decode_ms,
        graph_ms,
        verify_cols,
        verify_ms,
        weight_bytes: b.decode_weight_bytes(),
        spec_tps,
        draft_ms,
        launches,
        batch_ms,
        sampled_tps,
    })
}

/// A timed sequence: its prefill, then greedy decoding as `run` does it.
struct DecodeRun {
    seq: SeqId,
    /// The last token decoded (not yet fed).
    tok: u32,
    prefill_s: f64,
    decode_ms: f64,
}

/// Prefills a new sequence with `prompt`, then decodes `tokens` greedily as `run` does (steps
/// queued ahead of the host where the backend can), after one untimed step: graphs are captured
/// per sequence, on its first step. The sequence is left for the caller.
fn decode_run(b: &mut dyn Backend, prompt: &[u32], tokens: usize) -> Result<DecodeRun> {
    let seq = b.new_sequence()?;
    let t0 = Instant::now();
    let mut tok = b.prefill(seq, prompt, Want::Argmax)?.argmax;
    let prefill_s = t0.elapsed().as_secs_f64();
    b.decode_greedy(seq, tok, 1, &mut |t| {
        tok = t;
        true
    })?;
    let t1 = Instant::now();
    b.decode_greedy(seq, tok, tokens, &mut |t| {
        tok = t;
        true
    })?;
    let decode_ms = t1.elapsed().as_secs_f64() * 1e3 / tokens as f64;
    Ok(DecodeRun { seq, tok, prefill_s, decode_ms })
}

/// Decode ms per token of the graph path, timed after the megakernel's figures: the baseline the
/// megakernel is measured against, in the same run. `None` unless the backend ran the megakernel.
fn graph_baseline(b: &mut dyn Backend, prompt: &[u32], tokens: usize) -> Result<Option<f64>> {
    if b.decode_launch() != Some(Decode::Megakernel) {
        return Ok(None);
    }
    b.set_decode_launch(Decode::Graph)?;
    let run = decode_run(b, prompt, tokens);
    b.set_decode_launch(Decode::Megakernel)?;
    let run = run?;
    b.free(run.seq)?;
    Ok(Some(run.decode_ms))
}

/// Sampled tok/s as `run` decodes (the k highest logits drawn through `decode_sampled` where the
/// top-k allows it, whole rows a step at a time otherwise), timed as greedy decoding is: after the
/// prefill and one untimed sampled step of the timed sequence (graphs are captured per sequence,
/// on its first step).
fn measure_sampled(b: &mut dyn Backend, args: &BenchArgs, prompt: &[u32], sampling: SamplingParams) -> Result<f64> {
    let mut sampler = Sampler::new(sampling.clone())?;
    let want = want_for(&sampling, false);
    let seq = b.new_sequence()?;
    let out = b.prefill(seq, prompt, want)?;
    let mut tok = choose(&mut sampler, &out, want)?;
    let mut steps = |b: &mut dyn Backend, n: usize| -> Result<()> {
        if let Want::Candidates(_) = want {
            let uniforms = sampler.uniforms_ahead(n);
            let ran = b.decode_sampled(seq, tok, &sampling.draw_params(), &uniforms, &mut |t| {
                tok = t;
                true
            })?;
            sampler.skip(ran);
        } else {
            for _ in 0..n {
                tok = choose(&mut sampler, &b.decode(seq, tok, want)?, want)?;
            }
        }
        Ok(())
    };
    steps(b, 1)?;
    let t0 = Instant::now();
    steps(b, args.tokens)?;
    let tps = args.tokens as f64 / t0.elapsed().as_secs_f64();
    b.free(seq)?;
    Ok(tps)
}

/// ms per decode step of `--batch` sequences stepped together (after a prefill of each and one
/// untimed step: kernels, caches).
fn measure_batch(b: &mut dyn Backend, args: &BenchArgs, prompt: &[u32]) -> Result<f64> {
    let mut batch = Vec::with_capacity(args.batch);
    for i in 0..args.batch {
        let seq = b.new_sequence()?;
        // Each sequence its own prompt (a rotation of the bench prompt).
        let mut p = prompt.to_vec();
        p.rotate_left(i % prompt.len());
        batch.push((seq, b.prefill(seq, &p, Want::Argmax)?.argmax));
    }
    let mut step = |batch: &mut Vec<(megagemma_model::backend::SeqId, u32)>| -> Result<()> {
        let outs = b.step(batch, Want::Argmax)?;
        for ((_, tok), o) in batch.iter_mut().zip(outs) {
            *tok = o.argmax;
        }
        Ok(())
    };
    step(&mut batch)?;
    let t = Instant::now();
    for _ in 0..args.tokens {
        step(&mut batch)?;
    }
    let ms = t.elapsed().as_secs_f64() * 1e3 / args.tokens as f64;
    for (seq, _) in batch {
        b.free(seq)?;
    }
    Ok(ms)
}

/// Read bandwidth of the memory the backend streams weights from: the device's (from the
/// backend) or, for the CPU, a parallel sum over a 1 GiB buffer.
fn measure_read_bandwidth(b: &mut dyn Backend) -> Result<f64> {
    if let Some(gbps) = b.measure_read_bandwidth()? {
        return Ok(gbps);
    }
    use rayon::prelude::*;
    let data: Vec<f32> = vec![1.0; 256 << 20];
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: f32 = data.par_chunks(1 << 16).map(lane_sum).sum();
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((data.len() * 4) as f64 / secs / 1e9);
    }
    Ok(best)
}

/// Sum over 32 independent lanes, which LLVM vectorises. A plain `iter().sum::<f32>()` is one
/// dependent add per value: it measured the adder, not memory (9.7 GB/s on the 2-core dev VM,
/// where the GGUF decode kernels stream weights at over 16 GB/s).
fn lane_sum(c: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    let chunks = c.chunks_exact(32);
    let tail: f32 = chunks.remainder().iter().sum();
    for ch in chunks {
        for (a, v) in acc.iter_mut().zip(ch) {
            *a += v;
        }
    }
    acc.iter().sum::<f32>() + tail
}

fn report(label: &str, b: &dyn Backend, args: &BenchArgs, f: &Figures) {
    let tps = 1e3 / f.decode_ms;
    let gbps = f.weight_bytes as f64 / (f.decode_ms / 1e3) / 1e9;
    let pct = 100.0 * gbps / f.read_gbps;
    let ceiling = f.read_gbps * 1e9 / f.weight_bytes as f64;
    let launches = f.launches;
    println!("model            {label}");
    println!("build            megagemma {} ({})", env!("CARGO_PKG_VERSION"), env!("MEGAGEMMA_COMMIT"));
    println!("backend          {} ({})", b.name(), b.device_name());
    println!("read bandwidth   {:.1} GB/s (measured now)", f.read_gbps);
    println!("weights/token    {:.3} GB", f.weight_bytes as f64 / 1e9);
    println!("prefill          {:.1} tok/s ({} tokens)", f.prefill_tps, args.prompt_len);
    println!("decode           {:.3} ms/token = {:.1} tok/s ({} tokens)", f.decode_ms, tps, args.tokens);
    println!("achieved         {gbps:.1} GB/s = {pct:.1}% of the measured bandwidth (ceiling {ceiling:.0} tok/s)");
    println!(
        "verify           {} columns in {:.3} ms = {:.2}x a decode step",
        f.verify_cols,
        f.verify_ms,
        f.verify_ms / f.decode_ms
    );
    if let Some(l) = launches {
        println!("launches/token   {l:.1}");
    }
    if let Some(ms) = f.graph_ms {
        println!(
            "graph path       {ms:.3} ms/token = {:.1} tok/s in the same run: the megakernel is {:.2}x the graph",
            1e3 / ms,
            ms / f.decode_ms
        );
    }
    if let Some(ms) = f.draft_ms {
        let k = f.verify_cols - 1;
        println!(
            "draft            {k} tokens in {ms:.3} ms = {:.3} ms a draft step ({:.2}x a decode step)",
            ms / k as f64,
            ms / k as f64 / f.decode_ms
        );
    }
    if let Some((s, mean)) = f.spec_tps {
        println!("speculative      {s:.1} tok/s with --draft {} (mean accepted/round {mean:.2})", args.draft.draft);
    }
    if let (Some(s), Some(p)) = (f.sampled_tps, sampling_params(args)) {
        // What plain decoding asked the backend for.
        let how = match want_for(&p, false) {
            Want::Candidates(_) => "the k highest logits from the backend",
            _ => "whole logits rows",
        };
        println!(
            "sampled          {s:.1} tok/s at temperature {}, top-k {}, top-p {} ({how}; {:.2}x greedy)",
            p.temperature,
            p.top_k,
            p.top_p,
            s / tps
        );
    }
    let batch_tps = f.batch_ms.map(|ms| args.batch as f64 * 1e3 / ms);
    if let (Some(ms), Some(agg)) = (f.batch_ms, batch_tps) {
        println!(
            "batch            {} sequences: {ms:.3} ms/step = {agg:.1} tok/s aggregate ({:.2}x one sequence's)",
            args.batch,
            agg / tps
        );
    }
    let json = serde_json::json!({
        "model": label,
        "commit": env!("MEGAGEMMA_COMMIT"),
        "backend": b.name(),
        "device": b.device_name(),
        "read_gbps": f.read_gbps,
        "weight_bytes_per_token": f.weight_bytes,
        "prompt_len": args.prompt_len,
        "prefill_tok_s": f.prefill_tps,
        "decode_tokens": args.tokens,
        "decode_ms_per_token": f.decode_ms,
        "decode_tok_s": tps,
        "achieved_gbps": gbps,
        "bandwidth_pct": pct,
        "ceiling_tok_s": ceiling,
        "verify_columns": f.verify_cols,
        "verify_ms": f.verify_ms,
        "verify_over_decode": f.verify_ms / f.decode_ms,
        "launches_per_token": launches,
        "graph_decode_ms_per_token": f.graph_ms,
        "megakernel_over_graph": f.graph_ms.map(|ms| ms / f.decode_ms),
        "draft": args.draft.draft,
        "draft_ms": f.draft_ms,
        "spec_tok_s": f.spec_tps.map(|s| s.0),
        "spec_mean_accepted": f.spec_tps.map(|s| s.1),
        "batch": args.batch,
        "batch_ms_per_step": f.batch_ms,
        "batch_tok_s": batch_tps,
        "sampled_tok_s": f.sampled_tps,
    });
    println!("{json}");
}

#[cfg(test)]
mod tests {
    use super::verify_trace_path;
    use std::path::Path;

    #[test]
    fn the_verify_trace_sits_beside_the_step_trace() {
        assert_eq!(verify_trace_path(Path::new("out/e4b.json")), Path::new("out/e4b.verify.json"));
        assert_eq!(verify_trace_path(Path::new("trace")), Path::new("trace.verify"));
        assert_eq!(verify_trace_path(Path::new("a.b.json")), Path::new("a.b.verify.json"));
    }
}
