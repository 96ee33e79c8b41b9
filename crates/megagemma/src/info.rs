//! `megagemma info`: what a checkpoint is — architecture, the layer plan, weight formats and the
//! bytes one decode step streams (the number every speed figure is measured against).

use anyhow::Result;
use clap::Args;
use megagemma_model::config::AttnKind;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Model: checkpoint directory, .gguf file or a name `megagemma pull` knows.
    #[arg(short, long)]
    pub model: PathBuf,
    /// Quantize while loading, as `run --quant` would (none, q4, q4_0).
    #[arg(long, default_value = "none")]
    pub quant: String,
}

pub fn info(args: InfoArgs) -> Result<()> {
    let path = crate::run::resolve_model(&args.model)?;
    let quant: megagemma_model::quant::load::QuantMode = args.quant.parse()?;
    let model = megagemma_engine::model_files::load_model(&path, quant, false)?;
    let (c, p) = (&model.config, &model.plan);
    println!("model        {}", path.display());
    println!("architecture {} ({:?})", c.architecture, c.family);
    println!(
        "vocab {}  hidden {}  layers {}  heads {}  sliding window {}  context {}",
        c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.sliding_window, c.max_position_embeddings
    );
    if c.ple_dim > 0 {
        println!("per-layer embeddings: {} per layer", c.ple_dim);
    }
    if let Some(m) = &c.moe {
        println!("MoE: {} experts, top {}, width {}", m.num_experts, m.top_k, m.intermediate_size);
    }
    println!("final logit softcap {:?}  tied embeddings {}", c.final_logit_softcapping, c.tie_word_embeddings);
    println!("layer  attn     head_dim  kv_heads  kv_source  mlp    extras");
    for l in &p.layers {
        let kind = match l.kind {
            AttnKind::Sliding => "sliding",
            AttnKind::Full => "full",
        };
        let mut extras = vec![];
        if l.has_ple {
            extras.push("ple");
        }
        if l.has_moe {
            extras.push("moe");
        }
        if l.k_eq_v {
            extras.push("k_eq_v");
        }
        let src = if l.is_kv_shared() { format!("{} (shared)", l.kv_source) } else { "own".to_string() };
        println!(
            "{:<6} {:<8} {:<9} {:<9} {:<10} {:<6} {}",
            l.index,
            kind,
            l.head_dim,
            l.num_kv_heads,
            src,
            l.mlp_width,
            extras.join(",")
        );
    }
    let bytes = model.weights.decode_bytes(p.moe_top_k);
    println!("weights streamed per decode step: {:.1} MB", bytes as f64 / 1e6);
    Ok(())
}
