//! `megagemma serve`: the OpenAI-compatible HTTP server.

use crate::backend_args::{BackendArgs, QuantArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use megagemma_engine::backends::{open_backend_with, warm_up};
use megagemma_engine::model_files::{concurrently, ChatModel};
use megagemma_model::assistant::AssistantModel;
use megagemma_server::{Server, ServerConfig};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Model: a Hugging Face checkpoint directory, a .gguf file, or a name `megagemma pull` knows.
    #[arg(short, long)]
    pub model: PathBuf,
    /// The name clients give as `model` (default: the model directory's or file's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Address to listen on; loopback unless you say otherwise.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0 = any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the /v1 endpoints.
    #[arg(long)]
    pub api_key: Option<String>,
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Requests that may wait for a sequence; more are answered 503.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Sequences decoded together in one step at most.
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Largest request body in bytes; larger ones are answered 413.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
    /// Finished sequences kept so that prompts sharing their prefix skip its prefill (0 = off).
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub prefix_cache: usize,
    /// Speculative decoding while one greedy request runs alone: none, lookup (n-gram match
    /// in prompt + output) or mtp (the MTP assistant, --assistant DIR); the output stays
    /// exactly greedy's.
    #[arg(long, default_value = "none", value_name = "none|lookup|mtp")]
    pub draft: String,
    /// The MTP assistant checkpoint (Gemma4AssistantForCausalLM) for --draft mtp.
    #[arg(long, value_name = "DIR")]
    pub assistant: Option<PathBuf>,
    /// Tokens drafted per round.
    #[arg(long = "k", default_value_t = 4, value_name = "N")]
    pub k: usize,
    /// Prompt tokens prefilled per step (over as many waiting prompts as that covers), between
    /// the running sequences' decode steps, so a long prompt does not pause them for its whole
    /// length (0 = every waiting prompt whole).
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub prefill_chunk: usize,
    #[command(flatten)]
    pub weights: QuantArgs,
    /// Worker threads (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Start serving without the warm-up pass (by default one short pass runs first, so the
    /// first request does not pay for loading kernels and capturing GPU graphs).
    #[arg(long)]
    pub no_warmup: bool,
}

pub fn serve(args: ServeArgs) -> Result<()> {
    if let Some(n) = args.threads {
        crate::run::rayon_threads(n)?;
    }
    if args.max_queue == 0 || args.max_batch == 0 {
        bail!("--max-queue and --max-batch must be at least 1");
    }
    let draft_k = match args.draft.as_str() {
        "none" => 0,
        "lookup" | "mtp" if args.k > 0 => args.k,
        "lookup" | "mtp" => bail!("--k must be at least 1 with --draft {}", args.draft),
        other => bail!("unknown --draft `{other}` for serve (expected none, lookup or mtp)"),
    };
    let draft_mtp = args.draft == "mtp";
    if draft_mtp != args.assistant.is_some() {
        bail!("--draft mtp and --assistant DIR go together (the assistant is the MTP drafter)");
    }
    let path = crate::run::resolve_model(&args.model)?;
    let mut opts = args.backend.options()?;
    // Running requests (forks for n > 1 included) and the prefix cache's kept sequences.
    opts.sequences = args.max_batch + args.prefix_cache;
    let quant = args.weights.mode()?;
    let model = Arc::new(args.weights.load(&path, &opts)?);
    let (chat, mut backend) = concurrently(
        || ChatModel::open(&path, &model),
        || {
            let assistant = match &args.assistant {
                Some(dir) => Some(Arc::new(AssistantModel::load(dir, &model, quant)?)),
                None => None,
            };
            open_backend_with(model.clone(), assistant, &opts)
        },
    )?;
    // The host's weights live on only in a CPU backend: on CUDA their copy is given back here,
    // not held for the server's lifetime.
    drop(model);
    if !args.no_warmup {
        warm_up(&mut *backend).context("warm-up pass")?;
    }
    let model_name = args.name.clone().unwrap_or_else(|| default_name(&args.model));
    let config = ServerConfig {
        model_name: model_name.clone(),
        api_key: args.api_key.clone(),
        max_queue: args.max_queue,
        max_batch: args.max_batch,
        max_body_bytes: args.max_body,
        prefix_cache: args.prefix_cache,
        draft_k,
        draft_mtp,
        prefill_chunk: args.prefill_chunk,
    };
    let addr = SocketAddr::new(args.host, args.port);
    let listener = TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    if !args.host.is_loopback() && args.api_key.is_none() {
        eprintln!("warning: listening on {bound} without --api-key: anyone who can reach it may use it");
    }
    let ctx = backend.max_context();
    let server = Server::new(config, backend, chat)?;
    eprintln!("serving `{model_name}` on http://{bound} (context {ctx} tokens; OpenAI API under /v1; Ctrl-C stops)");
    server.serve_blocking(listener, true)?;
    eprintln!("stopped");
    Ok(())
}

/// `--model` as typed for a known name, else the directory's or file's name.
fn default_name(arg: &Path) -> String {
    if !arg.exists() {
        return arg.display().to_string();
    }
    let stem = if arg.is_file() { arg.file_stem() } else { arg.file_name() };
    stem.map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
}
