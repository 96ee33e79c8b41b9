//! A loaded model: config, layer plan and weights, shared read-only by backends.

use crate::checkpoint::Checkpoint;
use crate::config::{load_config, ModelConfig};
use crate::plan::ModelPlan;
use crate::quant::load::{load_safetensors_weights, QuantMode};
use crate::weights::{load_weights, ModelWeights};
use crate::{bail, Result};
use std::path::Path;

pub struct Model {
    pub config: ModelConfig,
    pub plan: ModelPlan,
    pub weights: ModelWeights,
}

impl Model {
    /// Load a Hugging Face checkpoint directory (config.json + safetensors) or a `.gguf` file.
    pub fn load(dir: &Path) -> Result<Model> {
        Self::load_with(dir, QuantMode::Stored)
    }

    /// [`Model::load`], quantizing dense weights on load with `quant` (`q4`/`q4_0`; see
    /// `crate::quant::load`). MLX 4-bit checkpoints load as stored with `QuantMode::Stored`.
    pub fn load_with(dir: &Path, quant: QuantMode) -> Result<Model> {
        if !dir.exists() {
            bail!("model directory {} does not exist", dir.display());
        }
        if dir.is_file() && dir.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            if quant != QuantMode::Stored {
                bail!("--quant {quant} applies to safetensors checkpoints; a GGUF file keeps its own quantization (use --quant none)");
            }
            return Self::load_gguf(dir);
        }
        if !dir.is_dir() {
            bail!("{} is not a model directory or a .gguf file", dir.display());
        }
        let config = load_config(dir)?;
        let plan = ModelPlan::new(&config)?;
        let ck = Checkpoint::open(dir)?;
        let weights = load_safetensors_weights(&ck, &config, &plan, quant)?;
        Ok(Model { config, plan, weights })
    }
}

impl Model {
    /// Load a llama.cpp GGUF file; quantized tensors are used in place.
    pub fn load_gguf(path: &Path) -> Result<Model> {
        let file = crate::gguf::GgufFile::open(path)?;
        let config =
            crate::gguf_model::gguf_config(&file).map_err(|e| crate::Error::msg(format!("{}: {e}", path.display())))?;
        let plan = ModelPlan::new(&config)?;
        let weights = load_weights(&crate::gguf_model::GgufSource { file: &file }, &config, &plan)?;
        Ok(Model { config, plan, weights })
    }
}
