//! `megagemma run`: one prompt in, generated tokens out.

use crate::backend_args::{BackendArgs, QuantArgs};
use crate::sampling_args::SamplingArgs;
use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use megagemma_engine::backends::open_backend_with;
use megagemma_engine::chat_template::{encode_chat, ChatMessage};
use megagemma_engine::generate::{generate, DraftMode, DraftParams, GenerateParams};
use megagemma_engine::model_files::{concurrently, generation_defaults, stop_ids, text_files, TextFiles};
use megagemma_model::assistant::AssistantModel;
use megagemma_model::backend::Backend;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Generated text, streamed.
    Text,
    /// One line: generated ids, comma-separated.
    Ids,
    /// One JSON object: ids, text, prompt_tokens, tokens_per_second.
    Json,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Model: a Hugging Face checkpoint directory, a .gguf file, or a name `megagemma pull`
    /// knows (fetched on first use). Defaults to the bundled demo model (random weights).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Prompt text; wrapped in the model's chat template unless --raw.
    #[arg(short, long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as token ids, comma-separated (e.g. 2,17,99); used as is.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<String>>,
    /// System message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Tokenize the prompt as is (with BOS), without the chat template.
    #[arg(long)]
    pub raw: bool,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long, default_value_t = 256)]
    pub max_new_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Do not stop at end-of-sequence ids: generate exactly --max-new-tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    pub output: OutputFormat,
    /// Write the final logits of every generated step to FILE as JSON ([steps][vocab]).
    #[arg(long, value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,
    /// Worker threads (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub weights: QuantArgs,
    #[command(flatten)]
    pub backend: BackendArgs,
    #[command(flatten)]
    pub draft: DraftArgs,
}

/// Speculative decoding flags (output ids stay exactly greedy's).
#[derive(Args, Debug)]
pub struct DraftArgs {
    /// Who drafts: none, mtp (the MTP assistant, --assistant DIR), lookup (n-gram match in
    /// prompt + output) or oracle (synthetic: the true greedy continuation, --acceptance A).
    #[arg(long, default_value = "none", value_name = "none|mtp|lookup|oracle")]
    pub draft: String,
    /// The MTP assistant checkpoint (Gemma4AssistantForCausalLM) for --draft mtp.
    #[arg(long, value_name = "DIR")]
    pub assistant: Option<PathBuf>,
    /// Tokens drafted per round.
    #[arg(long = "k", default_value_t = 4, value_name = "N")]
    pub k: usize,
    /// Longest n-gram --draft lookup matches.
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub lookup_ngram: usize,
    /// --draft oracle: probability that each drafted token is right (synthetic, for measuring).
    #[arg(long, default_value_t = 0.7, value_name = "A")]
    pub acceptance: f64,
    /// Print one stderr line of speculation counters at the end.
    #[arg(long)]
    pub stats: bool,
    /// Print one stderr line per speculation round: `draft pos=<p> ids=<a,b,..> accepted=<n>`.
    #[arg(long)]
    pub trace_drafts: bool,
}

impl DraftArgs {
    pub fn params(&self, seed: Option<u64>) -> Result<DraftParams> {
        let mode = match self.draft.as_str() {
            "none" => DraftMode::None,
            "mtp" => DraftMode::Mtp,
            "lookup" => DraftMode::Lookup { max_ngram: self.lookup_ngram },
            "oracle" => DraftMode::Oracle { acceptance: self.acceptance, seed: seed.unwrap_or(0) },
            other => bail!("unknown --draft `{other}` (expected none, mtp, lookup or oracle)"),
        };
        if mode == DraftMode::Mtp && self.assistant.is_none() {
            bail!("--draft mtp needs --assistant DIR (a Gemma 4 assistant checkpoint)");
        }
        if mode != DraftMode::Mtp && self.assistant.is_some() {
            bail!("--assistant is only used with --draft mtp");
        }
        Ok(DraftParams { mode, k: self.k, trace: self.trace_drafts })
    }
}

/// `prompt`, when it is not empty and every id is in the vocabulary.
fn check_prompt(prompt: Vec<u32>, vocab: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("empty prompt: --prompt-ids has no ids");
    }
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!("token id {bad} in the prompt is out of range (vocab_size is {vocab})");
    }
    Ok(prompt)
}

fn parse_ids(raw: &[String]) -> Result<Vec<u32>> {
    raw.iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<u32>().with_context(|| format!("invalid token id `{}` in --prompt-ids", s.trim())))
        .collect()
}

pub fn run(args: RunArgs) -> Result<()> {
    if let Some(n) = args.threads {
        rayon_threads(n)?;
    }
    let dir = match &args.model {
        Some(d) => resolve_model(d)?,
        None => {
            eprintln!("note: no --model given; using the bundled demo model, whose weights are random (its output is gibberish)");
            crate::demo::demo_model_dir()?
        }
    };
    let draft = args.draft.params(args.sampling.seed)?;
    let opts = args.backend.options()?;
    let t_load = Instant::now();
    let quant = args.weights.mode()?;
    let model = Arc::new(args.weights.load(&dir, &opts)?);
    let load_secs = t_load.elapsed().as_secs_f64();
    // Only text in or out needs a tokenizer (building one from GGUF metadata takes a moment).
    let needs_tokenizer = args.prompt.is_some() || args.output != OutputFormat::Ids;
    let vocab = model.plan.vocab_size;
    // Ids are checked now; a text prompt is encoded once the tokenizer is built.
    let prompt_ids = match (&args.prompt, &args.prompt_ids) {
        (Some(_), Some(_)) => bail!("give either --prompt or --prompt-ids, not both"),
        (None, None) => bail!("no prompt: give --prompt TEXT or --prompt-ids 2,17,99"),
        (None, Some(ids)) => Some(check_prompt(parse_ids(ids)?, vocab)?),
        (Some(text), None) if text.trim().is_empty() => bail!("empty prompt"),
        (Some(_), None) => None,
    };

    // The tokenizer (and the chat template) are built on a thread of their own while the
    // backend opens (weights uploaded to a device, CPU kernel layouts built: loading too).
    let load_text = || {
        if needs_tokenizer {
            text_files(&dir, &model, args.prompt.is_some() && !args.raw)
        } else {
            Ok(TextFiles::default())
        }
    };
    let open = || -> Result<(GenerateParams, Box<dyn Backend>, f64)> {
        // A GGUF file carries its stop ids in its metadata (ModelConfig); a checkpoint directory in
        // generation_config.json / config.json, whose errors are reported, not ignored.
        let defaults = generation_defaults(&dir)?;
        let sampling = args.sampling.params(&defaults)?;
        let stop_ids = stop_ids(&defaults, &model);
        let params = GenerateParams {
            max_new_tokens: args.max_new_tokens,
            sampling,
            stop_ids,
            ignore_eos: args.ignore_eos,
            keep_logits: args.dump_logits.is_some(),
            draft,
        };
        let assistant = match &args.draft.assistant {
            Some(dir) => Some(Arc::new(AssistantModel::load(dir, &model, quant)?)),
            None => None,
        };
        let t_open = Instant::now();
        let backend = open_backend_with(model.clone(), assistant, &opts)?;
        Ok((params, backend, t_open.elapsed().as_secs_f64()))
    };
    let (TextFiles { tokenizer, template }, (params, mut backend, open_secs)) = concurrently(load_text, open)?;
    let load_secs = load_secs + open_secs;

    let prompt = match (prompt_ids, &args.prompt) {
        (Some(ids), _) => ids,
        (None, text) => {
            let text = text.as_deref().unwrap_or_default();
            let tok = tokenizer
                .as_ref()
                .with_context(|| format!("no tokenizer found for {}: use --prompt-ids", dir.display()))?;
            let ids = match &template {
                None => tok.encode(text, true)?,
                Some(template) => {
                    let mut messages = Vec::new();
                    if let Some(s) = &args.system {
                        messages.push(ChatMessage::system(s.clone()));
                    }
                    messages.push(ChatMessage::user(text.to_string()));
                    encode_chat(tok, template, &messages)?
                }
            };
            check_prompt(ids, vocab)?
        }
    };
    let stdout = std::io::stdout();
    let mut stream = match (args.output, &tokenizer) {
        (OutputFormat::Text, Some(t)) => Some(t.stream_decoder(true)),
        (OutputFormat::Text, None) => bail!("no tokenizer found for {}: use --output ids", dir.display()),
        _ => None,
    };
    let gen = generate(backend.as_mut(), &prompt, &params, |tok| {
        if let Some(s) = stream.as_mut() {
            if let Ok(Some(piece)) = s.step(tok) {
                let mut out = stdout.lock();
                let _ = out.write_all(piece.as_bytes());
                let _ = out.flush();
            }
        }
        true
    })?;

    if let Some(path) = &args.dump_logits {
        let json = serde_json::to_string(&gen.logits)?;
        std::fs::write(path, json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let text = match &tokenizer {
        Some(t) => Some(t.decode(&gen.ids, true)?),
        None => None,
    };
    match args.output {
        OutputFormat::Text => {
            // Bytes held back as an incomplete character at the very end.
            if let Some(rest) = stream.as_mut().map(|s| s.flush()).transpose()?.flatten() {
                print!("{rest}");
            }
            println!();
        }
        OutputFormat::Ids => {
            println!("{}", gen.ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        }
        OutputFormat::Json => {
            let obj = serde_json::json!({
                "ids": gen.ids,
                "text": text,
                "prompt_tokens": gen.prompt_tokens,
                "tokens_per_second": gen.decode_tokens_per_second(),
                "finish_reason": match gen.finish_reason {
                    megagemma_engine::generate::FinishReason::Stop => "stop",
                    megagemma_engine::generate::FinishReason::Length => "length",
                },
            });
            println!("{obj}");
        }
    }
    if let (true, Some(spec)) = (args.draft.stats, &gen.spec) {
        eprintln!("{}", spec.summary(gen.decode_tokens_per_second()));
    }
    if gen.ids.is_empty() {
        eprintln!("load {load_secs:.2}s | prompt {} tokens | nothing generated", gen.prompt_tokens);
    } else {
        eprintln!(
            "load {:.2}s | prompt {} tokens in {:.3}s ({:.1} tok/s) | generated {} tokens, decode {:.1} tok/s",
            load_secs,
            gen.prompt_tokens,
            gen.prefill_seconds,
            gen.prompt_tokens as f64 / gen.prefill_seconds.max(1e-9),
            gen.ids.len(),
            gen.decode_tokens_per_second()
        );
    }
    Ok(())
}

pub fn rayon_threads(n: usize) -> Result<()> {
    if n == 0 {
        bail!("--threads must be at least 1");
    }
    rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("cannot set the thread count")
}

/// `--model` as a path: as given, a known name (pulled if missing) or a Hugging Face repo id
/// found in the local HF cache.
pub use megagemma_engine::resolve::resolve_model;
