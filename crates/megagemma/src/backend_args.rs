//! The flags that choose and size the compute backend, the same on `run`, `chat`, `serve` and
//! `bench`, and how `run`, `chat` and `serve` load the weights (`--quant`).

use anyhow::Result;
use clap::Args;
use megagemma_engine::backends::{BackendKind, BackendOptions};
use megagemma_model::quant::load::QuantMode;
use megagemma_model::Model;
use std::path::Path;

#[derive(Args, Debug)]
pub struct BackendArgs {
    /// Compute backend: cpu, cuda, or auto (CUDA when a device is present).
    #[arg(long, default_value = "auto", value_name = "cpu|cuda|auto")]
    pub backend: String,
    /// CUDA decode steps: a replayed CUDA graph, or one persistent kernel (experimental, slower so far).
    #[arg(long, value_name = "graph|megakernel")]
    pub decode: Option<String>,
    /// Context length: the longest prompt + generation a sequence may hold (default: the model's
    /// maximum, at most 32,768 on the CPU; on CUDA, whose caches are allocated whole when a sequence
    /// starts, as far as free GPU memory holds it, with a note when it does not).
    #[arg(short = 'c', long)]
    pub ctx: Option<usize>,
}

impl BackendArgs {
    /// The backend these flags ask for; an unknown name is one error line.
    pub fn options(&self) -> Result<BackendOptions> {
        let kind: BackendKind = self.backend.parse()?;
        let decode = self.decode.as_deref().map(str::parse).transpose()?;
        Ok(BackendOptions { kind, max_context: self.ctx, decode, sequences: 1 })
    }
}

/// How `run`, `chat` and `serve` load a checkpoint's weights.
#[derive(Args, Debug)]
pub struct QuantArgs {
    /// Weights: none (as stored: dense, or an MLX checkpoint's 4-bit), q4 (quantize on load, MLX
    /// affine group 64) or q4_0 (symmetric group 32). See docs/quantization.md.
    #[arg(long, default_value = "none", value_name = "none|q4|q4_0")]
    pub quant: String,
}

impl QuantArgs {
    /// The mode `--quant` names; an unknown one is one error line.
    pub fn mode(&self) -> Result<QuantMode> {
        Ok(self.quant.parse()?)
    }

    /// The model in `dir` with these weights, for the backend `opts` opens (the CPU keeps only
    /// its own layouts).
    pub fn load(&self, dir: &Path, opts: &BackendOptions) -> Result<Model> {
        megagemma_engine::model_files::load_model(dir, self.mode()?, opts.kind.runs_on_cpu())
    }
}
