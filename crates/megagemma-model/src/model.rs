//! A loaded model: config, layer plan and weights, shared read-only by backends.

use crate::checkpoint::Checkpoint;
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
    /// Load a Hugging Face checkpoint directory (config.json + safetensors).
    pub fn load(dir: &Path) -> Result<Model> {
        if !dir.exists() {
            bail!("model directory {} does not exist", dir.display());
        }
        if !dir.is_dir() {
            bail!("{} is not a model directory", dir.display());
        }
        let config = load_config(dir)?;
        let plan = ModelPlan::new(&config)?;
        let ck = Checkpoint::open(dir)?;
        let weights = load_weights(&ck, &config, &plan)?;
        Ok(Model { config, plan, weights })
    }
}
