//! [`CudaModel`]: the device, the layer plan and the uploaded weights, shared by sequences.

use crate::candidates::CandidateKeys;
use crate::device::{Arg, Gpu};
use crate::long_pass::Workspace;
use crate::synthetic::{place_synthetic, synthetic_config, synthetic_decode_bytes};
use crate::weights::{place_all, place_model, DevWeights, Uploaded};
use megagemma_model::plan::ModelPlan;
use megagemma_model::{bail, Model, Result};
use std::sync::Arc;

pub struct CudaModel {
    pub(crate) gpu: Gpu,
    pub(crate) plan: ModelPlan,
    pub(crate) up: Uploaded,
    decode_bytes: usize,
    label: String,
    /// Scratch of long passes (prefill chunks), shared by the sequences.
    pub(crate) work: Workspace,
    /// Scratch of the device's candidate selection (`CudaSeq::candidates`), shared likewise.
    pub(crate) cand_keys: CandidateKeys,
}

impl CudaModel {
    /// Uploads a loaded model's weights to device 0. Fails with one line ("no CUDA device found: …")
    /// when there is no usable GPU.
    pub fn load(model: &Model) -> Result<Arc<CudaModel>> {
        // The residual step reads rows as float4s (`add_norm_body`, `residual_stats`).
        if !model.plan.hidden.is_multiple_of(4) {
            bail!("the CUDA backend needs a hidden size divisible by 4 (this model's is {})", model.plan.hidden);
        }
        let gpu = Gpu::new()?;
        let up = place_all(&gpu, |p| place_model(p, &model.plan, &model.weights))?;
        let decode_bytes = model.weights.decode_bytes(model.plan.moe_top_k);
        Ok(Arc::new(CudaModel {
            gpu,
            plan: model.plan.clone(),
            up,
            decode_bytes,
            label: model.config.architecture.clone(),
            work: Workspace::default(),
            cand_keys: CandidateKeys::default(),
        }))
    }

    /// A model of `name`'s shapes (`e2b`, `e4b`, `tiny`) with random weights generated on the
    /// device; `quant` must be `q4` (4-bit affine, group 64).
    pub fn synthetic(name: &str, quant: &str) -> Result<Arc<CudaModel>> {
        if quant != "q4" {
            bail!("synthetic models are generated as q4 only (got '{quant}')");
        }
        let config = synthetic_config(name)?;
        let plan = ModelPlan::new(&config)?;
        let gpu = Gpu::new()?;
        let up = place_all(&gpu, |p| place_synthetic(p, &plan))?;
        let decode_bytes = synthetic_decode_bytes(&plan);
        let label = format!("synthetic {name} {quant}");
        let (work, cand_keys) = (Workspace::default(), CandidateKeys::default());
        Ok(Arc::new(CudaModel { gpu, plan, up, decode_bytes, label, work, cand_keys }))
    }

    pub fn plan(&self) -> &ModelPlan {
        &self.plan
    }

    pub(crate) fn weights(&self) -> &DevWeights {
        &self.up.w
    }

    /// The GPU's name.
    pub fn device_name(&self) -> &str {
        &self.gpu.name
    }

    /// What was loaded ("Gemma4ForCausalLM", "synthetic e4b q4").
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Weight bytes one decode step streams, from the plan (stored format: bf16 scales and biases).
    pub fn decode_weight_bytes(&self) -> usize {
        self.decode_bytes
    }

    /// Bytes of the weight arena on the device.
    pub fn device_weight_bytes(&self) -> usize {
        self.up.arena.bytes
    }

    /// Kernel launches issued so far (all sequences).
    pub fn launches(&self) -> u64 {
        self.gpu.launches()
    }

    /// Per-kernel launch counts and seconds since the last call, slowest first (only with
    /// `MEGAGEMMA_CUDA_PROFILE=1`, which synchronises around every launch).
    pub fn take_profile(&self) -> Vec<(String, u64, f64)> {
        self.gpu.take_profile()
    }

    /// Measured read bandwidth in GB/s: a read-only reduction over `bytes` of device memory, best of 5.
    pub fn read_bandwidth(&self, bytes: usize) -> Result<f64> {
        let bytes = bytes / 16 * 16;
        let buf = self.gpu.alloc_zeros(bytes)?;
        let out = self.gpu.alloc_zeros(4)?;
        let grid = self.gpu.sms * 8;
        let args = [Arg::Ptr(buf.ptr), Arg::U64((bytes / 16) as u64), Arg::Ptr(out.ptr)];
        self.gpu.launch("read_bandwidth", grid, 512, 0, &args)?;
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            self.gpu.sync()?;
            let t = std::time::Instant::now();
            self.gpu.launch("read_bandwidth", grid, 512, 0, &args)?;
            self.gpu.sync()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best / 1e9)
    }
}
