//! The decoding flags of `run` and `chat`: greedy, or sampling with the checkpoint's
//! generation_config as the default for whatever is not given.

use anyhow::{bail, Result};
use clap::Args;
use megagemma_engine::sampling::{GenerationDefaults, SamplingParams};

#[derive(Args, Debug)]
pub struct SamplingArgs {
    /// Greedy decoding (same as --temperature 0).
    #[arg(long)]
    pub greedy: bool,
    /// Sampling temperature (0 = greedy). Default: the checkpoint's generation_config, else greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sample from the K most likely tokens (0 = all). Default: generation_config.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probabilities add up to P. Default: generation_config.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one. Default: generation_config.
    #[arg(long, value_name = "P")]
    pub min_p: Option<f32>,
    /// Random seed for sampling (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// What these flags ask for, the rest from `defaults`; a bad value is one error line.
    pub fn params(&self, defaults: &GenerationDefaults) -> Result<SamplingParams> {
        let explicit =
            self.temperature.is_some() || self.top_k.is_some() || self.top_p.is_some() || self.min_p.is_some();
        if self.greedy {
            if explicit {
                bail!("--greedy cannot be combined with --temperature/--top-k/--top-p/--min-p");
            }
            return Ok(SamplingParams::greedy());
        }
        let base = defaults.sampling_params(self.seed);
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k: self.top_k.unwrap_or(base.top_k),
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            seed: self.seed,
        };
        p.validate()?;
        Ok(p)
    }
}
