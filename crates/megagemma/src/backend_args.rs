//! The flags that choose and size the compute backend, the same on `run`, `chat`, `serve` and
//! `bench`.

use anyhow::Result;
use clap::Args;
use megagemma_engine::backends::{BackendKind, BackendOptions};

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
