//! Checkpoint tensors → typed per-layer weights, every shape checked against the layer plan.
//!
//! Norm weights are returned as the factor the forward multiplies by: Gemma 4 stores `w`,
//! Gemma 3's HF checkpoints store `w − 1` (the model computes `x̂·(1 + w)`), so 1 is added here
//! once and the forward never needs to know.

use crate::config::{Family, ModelConfig};
use crate::matrix::RowDot;
use crate::plan::{LayerPlan, ModelPlan};
use crate::Result;

pub type Matrix = Box<dyn RowDot>;

pub struct AttentionWeights {
    pub q: Matrix,
    pub q_norm: Vec<f32>,
    /// `None` on KV-shared layers (they read their donor's cache).
    pub k: Option<Matrix>,
    /// `None` on KV-shared layers and on k_eq_v layers.
    pub v: Option<Matrix>,
    pub k_norm: Option<Vec<f32>>,
    pub o: Matrix,
}

pub struct MlpWeights {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

pub struct PleWeights {
    pub gate: Matrix,
    pub proj: Matrix,
    pub post_norm: Vec<f32>,
}

pub struct MoeWeights {
    pub router_proj: Matrix,
    pub router_scale: Vec<f32>,
    pub per_expert_scale: Vec<f32>,
    /// Per expert: gate and up halves of `gate_up_proj`, and `down_proj`.
    pub experts: Vec<MlpWeights>,
    pub pre_norm_2: Vec<f32>,
    pub post_norm_1: Vec<f32>,
    pub post_norm_2: Vec<f32>,
}

pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub attn: AttentionWeights,
    pub post_attn_norm: Vec<f32>,
    pub pre_ffn_norm: Vec<f32>,
    pub mlp: MlpWeights,
    pub post_ffn_norm: Vec<f32>,
    pub ple: Option<PleWeights>,
    pub moe: Option<MoeWeights>,
    pub layer_scalar: f32,
}

pub struct PleInputWeights {
    /// `[ple_vocab, L·P]` token-identity table.
    pub embed: Matrix,
    /// `[L·P, H]` context projection.
    pub proj: Matrix,
    pub norm: Vec<f32>,
}

pub struct ModelWeights {
    pub embed: Matrix,
    pub ple: Option<PleInputWeights>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when the LM head is tied to `embed`.
    pub lm_head: Option<Matrix>,
}

/// Every matrix a forward pass multiplies with, borrowed shared (`as_ref`, `iter`) or
/// mutably (`as_mut`, `iter_mut`, `mut`): one list for [`ModelWeights::matrices`] and
/// [`ModelWeights::matrices_mut`].
macro_rules! dotted_matrices {
    ($w:expr, $as:ident, $iter:ident $(, $mut:tt)?) => {{
        let w = $w;
        let mut m: Vec<&$($mut)? (dyn RowDot + 'static)> = vec![match w.lm_head.$as() {
            Some(head) => head.$as(),
            None => w.embed.$as(),
        }];
        m.extend(w.ple.$iter().map(|p| p.proj.$as()));
        for l in w.layers.$iter() {
            let a = &$($mut)? l.attn;
            m.extend([a.q.$as(), a.o.$as()]);
            m.extend(a.k.$iter().chain(a.v.$iter()).map(|x| x.$as()));
            m.extend([l.mlp.gate.$as(), l.mlp.up.$as(), l.mlp.down.$as()]);
            if let Some(moe) = &$($mut)? l.moe {
                m.push(moe.router_proj.$as());
                for e in moe.experts.$iter() {
                    m.extend([e.gate.$as(), e.up.$as(), e.down.$as()]);
                }
            }
            m.extend(l.ple.$iter().flat_map(|p| [p.gate.$as(), p.proj.$as()]));
        }
        m
    }};
}

impl ModelWeights {
    /// Every matrix a forward pass multiplies with (the LM head, the PLE projection, each
    /// layer's; not the embedding tables it only gathers rows from, unless the head is tied).
    pub fn matrices(&self) -> Vec<&dyn RowDot> {
        dotted_matrices!(self, as_ref, iter)
    }

    /// [`ModelWeights::matrices`], mutably.
    pub fn matrices_mut(&mut self) -> Vec<&mut (dyn RowDot + 'static)> {
        dotted_matrices!(self, as_mut, iter_mut, mut)
    }

    /// Lay every multiplied matrix out for the CPU kernels now and drop the layouts they no
    /// longer read ([`RowDot::keep_cpu_layout_only`]), one matrix at a time, so that memory
    /// never holds both layouts of the whole model. For a model only a CPU backend will run.
    pub fn keep_cpu_layouts_only(&mut self) {
        for m in self.matrices_mut() {
            m.keep_cpu_layout_only();
        }
        // The dropped layouts below the allocator's mmap threshold went back to its free lists,
        // not to the system: hand their pages back (a random 528 M-parameter Gemma 4 at q4 held
        // ~120 MB of them).
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only releases free heap memory; it has no preconditions.
        unsafe {
            libc::malloc_trim(0);
        }
    }

    /// Bytes of weights one decode step streams (everything but the embedding gathers); MoE
    /// layers count the `moe_top_k` routed experts a token reads.
    pub fn decode_bytes(&self, moe_top_k: usize) -> usize {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed).stored_bytes();
        let mut b = head;
        if let Some(p) = &self.ple {
            b += p.proj.stored_bytes();
        }
        for l in &self.layers {
            b += l.attn.q.stored_bytes() + l.attn.o.stored_bytes();
            b += l.attn.k.as_ref().map_or(0, |m| m.stored_bytes()) + l.attn.v.as_ref().map_or(0, |m| m.stored_bytes());
            b += l.mlp.gate.stored_bytes() + l.mlp.up.stored_bytes() + l.mlp.down.stored_bytes();
            if let Some(p) = &l.ple {
                b += p.gate.stored_bytes() + p.proj.stored_bytes();
            }
            if let Some(m) = &l.moe {
                b += m.router_proj.stored_bytes();
                let per_expert = m
                    .experts
                    .first()
                    .map_or(0, |e| e.gate.stored_bytes() + e.up.stored_bytes() + e.down.stored_bytes());
                b += per_expert * moe_top_k;
            }
        }
        b
    }
}

/// Where weights come from, addressed by their Hugging Face names relative to the text
/// decoder (`layers.3.mlp.up_proj.weight`). Safetensors checkpoints and GGUF files implement it;
/// each checks shapes and reports a missing or mis-shaped tensor by its own name.
pub trait TensorSource {
    /// A `[rows, cols]` matrix.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix>;
    /// A 3-D `[n, rows, cols]` tensor as `n` matrices (MoE experts).
    fn matrices(&self, name: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>>;
    /// A 1-D tensor of `len` floats.
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    fn contains(&self, name: &str) -> bool;
    /// Whether stored norm weights already include Gemma 3's `+1` (GGUF does; HF does not).
    fn norms_include_one(&self) -> bool {
        false
    }
}

/// Loads tensors with the family's norm convention.
struct Loader<'a> {
    src: &'a dyn TensorSource,
    norm_offset: f32,
}

impl<'a> Loader<'a> {
    fn new(src: &'a dyn TensorSource, cfg: &ModelConfig) -> Loader<'a> {
        let gemma3_hf = cfg.family == Family::Gemma3 && !src.norms_include_one();
        Loader { src, norm_offset: if gemma3_hf { 1.0 } else { 0.0 } }
    }
    fn matrix(&self, rel: &str, rows: usize, cols: usize) -> Result<Matrix> {
        self.src.matrix(rel, rows, cols)
    }
    fn vector(&self, rel: &str, len: usize) -> Result<Vec<f32>> {
        self.src.vector(rel, len)
    }
    fn norm(&self, rel: &str, len: usize) -> Result<Vec<f32>> {
        let mut w = self.vector(rel, len)?;
        if self.norm_offset != 0.0 {
            w.iter_mut().for_each(|x| *x += self.norm_offset);
        }
        Ok(w)
    }
}

pub fn load_weights(src: &dyn TensorSource, cfg: &ModelConfig, plan: &ModelPlan) -> Result<ModelWeights> {
    let ld = Loader::new(src, cfg);
    let h = cfg.hidden_size;
    let embed = ld.matrix("embed_tokens.weight", cfg.vocab_size, h)?;

    let ple = if cfg.ple_dim > 0 {
        let lp = cfg.num_layers * cfg.ple_dim;
        Some(PleInputWeights {
            embed: ld.matrix("embed_tokens_per_layer.weight", cfg.ple_vocab_size, lp)?,
            proj: ld.matrix("per_layer_model_projection.weight", lp, h)?,
            norm: ld.norm("per_layer_projection_norm.weight", cfg.ple_dim)?,
        })
    } else {
        None
    };

    let layers = plan.layers.iter().map(|lp| load_layer(src, cfg, lp, !lp.is_kv_shared())).collect::<Result<_>>()?;

    let lm_head = if cfg.tie_word_embeddings { None } else { Some(ld.matrix("lm_head.weight", cfg.vocab_size, h)?) };

    Ok(ModelWeights { embed, ple, layers, final_norm: ld.norm("norm.weight", h)?, lm_head })
}

/// One decoder layer's weights. `owns_kv = false` loads a query-only layer (no `k_proj`, `v_proj`,
/// `k_norm`): a KV-shared layer, or a layer of an MTP assistant, which attends another model's cache.
pub fn load_layer(src: &dyn TensorSource, cfg: &ModelConfig, lp: &LayerPlan, owns_kv: bool) -> Result<LayerWeights> {
    let ld = Loader::new(src, cfg);
    let h = cfg.hidden_size;
    let p = |s: &str| format!("layers.{}.{s}", lp.index);
    let (qw, kvw) = (lp.q_width(), lp.kv_width());
    let attn = AttentionWeights {
        q: ld.matrix(&p("self_attn.q_proj.weight"), qw, h)?,
        q_norm: ld.norm(&p("self_attn.q_norm.weight"), lp.head_dim)?,
        k: if owns_kv { Some(ld.matrix(&p("self_attn.k_proj.weight"), kvw, h)?) } else { None },
        v: if owns_kv && !lp.k_eq_v { Some(ld.matrix(&p("self_attn.v_proj.weight"), kvw, h)?) } else { None },
        k_norm: if owns_kv { Some(ld.norm(&p("self_attn.k_norm.weight"), lp.head_dim)?) } else { None },
        o: ld.matrix(&p("self_attn.o_proj.weight"), h, qw)?,
    };
    let i = lp.mlp_width;
    let mlp = MlpWeights {
        gate: ld.matrix(&p("mlp.gate_proj.weight"), i, h)?,
        up: ld.matrix(&p("mlp.up_proj.weight"), i, h)?,
        down: ld.matrix(&p("mlp.down_proj.weight"), h, i)?,
    };
    let ple = if lp.has_ple {
        Some(PleWeights {
            gate: ld.matrix(&p("per_layer_input_gate.weight"), cfg.ple_dim, h)?,
            proj: ld.matrix(&p("per_layer_projection.weight"), h, cfg.ple_dim)?,
            post_norm: ld.norm(&p("post_per_layer_input_norm.weight"), h)?,
        })
    } else {
        None
    };
    let moe = match (&cfg.moe, lp.has_moe) {
        (Some(m), true) => Some(load_moe(&ld, &p, m.num_experts, m.intermediate_size, h)?),
        _ => None,
    };
    // Gemma 3 has no per-layer scalar.
    let layer_scalar = if cfg.family == Family::Gemma4 || src.contains(&p("layer_scalar")) {
        ld.vector(&p("layer_scalar"), 1)?[0]
    } else {
        1.0
    };
    Ok(LayerWeights {
        input_norm: ld.norm(&p("input_layernorm.weight"), h)?,
        attn,
        post_attn_norm: ld.norm(&p("post_attention_layernorm.weight"), h)?,
        pre_ffn_norm: ld.norm(&p("pre_feedforward_layernorm.weight"), h)?,
        mlp,
        post_ffn_norm: ld.norm(&p("post_feedforward_layernorm.weight"), h)?,
        ple,
        moe,
        layer_scalar,
    })
}

fn load_moe(ld: &Loader, p: &dyn Fn(&str) -> String, experts: usize, inter: usize, h: usize) -> Result<MoeWeights> {
    // gate_up_proj[e] is [2I, H]: the first I rows are the gate, the next I the up projection.
    let gate_up = ld.src.matrices(&p("experts.gate_up_proj"), 2 * experts, inter, h)?;
    let down = ld.src.matrices(&p("experts.down_proj"), experts, h, inter)?;
    let mut halves = gate_up.into_iter();
    let ex = down
        .into_iter()
        .map(|down| MlpWeights { gate: halves.next().unwrap(), up: halves.next().unwrap(), down })
        .collect();
    Ok(MoeWeights {
        router_proj: ld.matrix(&p("router.proj.weight"), experts, h)?,
        router_scale: ld.vector(&p("router.scale"), h)?,
        per_expert_scale: ld.vector(&p("router.per_expert_scale"), experts)?,
        experts: ex,
        pre_norm_2: ld.norm(&p("pre_feedforward_layernorm_2.weight"), h)?,
        post_norm_1: ld.norm(&p("post_feedforward_layernorm_1.weight"), h)?,
        post_norm_2: ld.norm(&p("post_feedforward_layernorm_2.weight"), h)?,
    })
}
