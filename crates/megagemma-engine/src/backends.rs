//! Backend selection: which compute backend runs a loaded model.

use anyhow::{bail, Result};
/// How CUDA decode steps launch (`--decode graph|megakernel`).
pub use megagemma_cuda::Decode;
use megagemma_cuda::{CudaBackend, CudaModel, DefaultContext};
use megagemma_model::assistant::AssistantModel;
use megagemma_model::backend::{Backend, Want};
use megagemma_model::cpu::CpuBackend;
use megagemma_model::Model;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CUDA when a device is present, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

impl FromStr for BackendKind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "auto" => BackendKind::Auto,
            "cpu" => BackendKind::Cpu,
            "cuda" => BackendKind::Cuda,
            other => bail!("unknown backend `{other}` (expected cpu, cuda or auto)"),
        })
    }
}

impl BackendKind {
    /// Whether this choice opens the CPU backend: `cpu`, or `auto` without a CUDA device (`auto`
    /// also falls back to the CPU when CUDA fails to open, which this cannot know beforehand).
    pub fn runs_on_cpu(self) -> bool {
        match self {
            BackendKind::Cuda => false,
            BackendKind::Auto => !cuda_device_present(),
            BackendKind::Cpu => true,
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Auto => "auto",
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        })
    }
}

#[derive(Clone, Debug, Default)]
pub struct BackendOptions {
    pub kind: BackendKind,
    /// Longest sequence (prompt + generated); `None` = the backend's default.
    pub max_context: Option<usize>,
    /// CUDA decode steps: a CUDA graph or the persistent megakernel (`None`: the backend's
    /// default, or `MEGAGEMMA_CUDA_DECODE`).
    pub decode: Option<Decode>,
    /// Sequences the caller holds at once (0 counts as 1): CUDA allocates each one's caches whole,
    /// so the default context is what that many fit in free memory, up to the model's maximum.
    pub sequences: usize,
}

impl BackendOptions {
    /// A note when `--ctx` asks for more positions than the model was trained for (positions past
    /// it still run, as with other engines, but their outputs are not what the model learned).
    fn note_past_trained_maximum(&self, max_positions: usize) {
        if let Some(n) = self.max_context.filter(|&n| n > max_positions) {
            eprintln!(
                "note: --ctx {n} is past the model's trained maximum of {max_positions} positions \
                 (max_position_embeddings)"
            );
        }
    }

    fn cuda(&self, cm: Arc<CudaModel>) -> megagemma_model::Result<CudaBackend> {
        let ctx = match self.max_context {
            Some(n) => n,
            None => {
                let d = DefaultContext::measure(&cm, self.sequences)?;
                if let Some(note) = d.note() {
                    eprintln!("note: {note}");
                }
                d.tokens
            }
        };
        let b = CudaBackend::new(cm, ctx);
        Ok(match self.decode {
            Some(d) => b.with_decode(d),
            None => b,
        })
    }
}

/// Open the backend `opts` asks for over `model`.
pub fn open_backend(model: Arc<Model>, opts: &BackendOptions) -> Result<Box<dyn Backend>> {
    open_backend_with(model, None, opts)
}

/// [`open_backend`] with an MTP assistant loaded beside the target (for `--draft mtp`).
pub fn open_backend_with(
    model: Arc<Model>,
    assistant: Option<Arc<AssistantModel>>,
    opts: &BackendOptions,
) -> Result<Box<dyn Backend>> {
    opts.note_past_trained_maximum(model.plan.max_positions);
    if !opts.kind.runs_on_cpu() {
        let spinner = crate::progress::spinner("uploading the weights to the GPU");
        let loaded = CudaModel::load(&model).and_then(|cm| match &assistant {
            Some(a) => opts.cuda(cm)?.with_assistant(a),
            None => opts.cuda(cm),
        });
        crate::progress::finish(spinner);
        match loaded {
            Ok(b) => return Ok(Box::new(b)),
            Err(e) if opts.kind == BackendKind::Auto => eprintln!("note: CUDA is not usable ({e}); running on the CPU"),
            Err(e) => return Err(e.into()),
        }
    }
    let mut b = CpuBackend::new(model);
    if let Some(n) = opts.max_context {
        b = b.with_max_context(n);
    }
    if let Some(a) = assistant {
        b = b.with_assistant(a);
    }
    Ok(Box::new(b))
}

/// Prompt passes the warm-up runs, in tokens: each size class a backend may run its own way (on
/// CUDA: up to 8 tokens as verify passes, 9 to 19 on the matvecs, 20 and more on cuBLAS).
const WARM_UP_PASSES: [usize; 3] = [8, 12, 24];

/// Runs a few prompt passes and two greedy steps on a throwaway sequence, then frees it, so that
/// the first request does not pay for what a backend does once: the GPU's kernels loaded (CUDA
/// loads each on first use), cuBLAS started, the step graphs captured (kept with the freed
/// sequence, which the CUDA backend reuses), a memory-mapped checkpoint's pages read in. Nothing it
/// computes is kept; a context too short for it all gets fewer tokens.
pub fn warm_up(b: &mut dyn Backend) -> Result<()> {
    let seq = b.new_sequence()?;
    let ctx = b.max_context();
    let ran = (|| -> megagemma_model::Result<()> {
        // Two positions are kept for the steps, but a one-position context still takes a prompt.
        let mut room = ctx.saturating_sub(2).max(1);
        let mut tok = 0;
        for pass in WARM_UP_PASSES {
            let n = pass.min(room);
            if n == 0 {
                break;
            }
            tok = b.prefill(seq, &vec![0; n], Want::Argmax)?.argmax;
            room -= n;
        }
        let steps = ctx.saturating_sub(b.seq_len(seq)?).min(2);
        b.decode_greedy(seq, tok, steps, &mut |_| true)?;
        Ok(())
    })();
    b.free(seq)?;
    Ok(ran?)
}

/// A model of a real shape with random weights, built on the device without a checkpoint
/// (`bench --synthetic`); with `assistant`, a random MTP assistant of the real assistants' shapes
/// beside it (E2B, E4B).
pub fn open_synthetic(name: &str, quant: &str, assistant: bool, opts: &BackendOptions) -> Result<Box<dyn Backend>> {
    if opts.kind == BackendKind::Cpu || !cuda_device_present() {
        bail!("--synthetic {name}: synthetic models are built on a GPU, and no CUDA device is available here");
    }
    let cm = CudaModel::synthetic(name, quant)?;
    opts.note_past_trained_maximum(cm.plan().max_positions);
    let b = opts.cuda(cm)?;
    Ok(Box::new(if assistant { b.with_synthetic_assistant()? } else { b }))
}

/// Whether a CUDA driver and at least one device are present (never panics without CUDA).
pub fn cuda_device_present() -> bool {
    megagemma_cuda::libs::driver_present()
}
