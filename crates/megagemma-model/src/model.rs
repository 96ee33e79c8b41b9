//! A loaded model: config, layer plan and weights, shared read-only by backends.

use crate::checkpoint::{Checkpoint, SafetensorsSource};
use crate::config::{load_config, ModelConfig};
use crate::plan::ModelPlan;
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
        if !dir.exists() {
            bail!("model directory {} does not exist", dir.display());
        }
        if dir.is_file() && dir.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            return Self::load_gguf(dir);
        }
        if !dir.is_dir() {
            bail!("{} is not a model directory or a .gguf file", dir.display());
        }
        let config = load_config(dir)?;
        let plan = ModelPlan::new(&config)?;
        let ck = Checkpoint::open(dir)?;
        let weights = load_weights(&SafetensorsSource { ck: &ck, prefix: &config.tensor_prefix }, &config, &plan)?;
        Ok(Model { config, plan, weights })
    }
}

impl Model {
    /// Load a llama.cpp GGUF file; quantized tensors are used in place.
    pub fn load_gguf(path: &Path) -> Result<Model> {
        let file = crate::gguf::GgufFile::open(path)?;
        let config = crate::gguf_model::gguf_config(&file).map_err(|e| crate::Error::msg(format!("{}: {e}", path.display())))?;
        let plan = ModelPlan::new(&config)?;
        let weights = load_weights(&crate::gguf_model::GgufSource { file: &file }, &config, &plan)?;
        Ok(Model { config, plan, weights })
    }
}
