//! Loading 4-bit weights: MLX affine checkpoints as stored, and bf16/f16/f32 checkpoints quantized
//! on load (`megagemma run --quant q4|q4_0`). Both end in [`QuantMatrix`]; `docs/quantization.md`
//! is the user-facing description.
//!
//! # MLX checkpoints
//!
//! A quantized `Linear`/`Embedding` `X` is stored as `X.weight` (U32 `[rows, cols/8]`), `X.scales`
//! and `X.biases` (bf16/f16/f32 `[rows, cols/group_size]`); MoE experts in mlx-lm's `switch_glu`
//! layout add a leading expert dimension (`layers.i.experts.switch_glu.{gate,up,down}_proj`).
//! `config.json` carries (as mlx-lm's `quantize_model` writes it, also copied to
//! `quantization_config`):
//!
//! ```json
//! "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
//!                  "language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4},
//!                  "model.layers.3.router.proj": false}
//! ```
//!
//! Keys other than `group_size`/`bits`/`mode` are per-module overrides keyed by the MLX module path
//! (the tensor name without `.weight`); `false` marks a module left dense. As in mlx-lm's loader, a
//! matrix is quantized exactly when its `X.scales` tensor exists; the override (else the global
//! entry) gives its group size and bits. Override keys are matched after removing the text-decoder
//! prefix (`model.`, `language_model.model.`, `model.language_model.`, `language_model.`), so both
//! mlx-lm names and Hugging Face names work.
//!
//! Tensor prefixes: Hugging Face checkpoints use `model.` / `model.language_model.`; mlx-lm and
//! mlx-vlm write multimodal Gemma as `language_model.model.` (and an untied head as
//! `language_model.lm_head`). The prefix is found by probing for `embed_tokens.weight`.
//!
//! # Quantize on load
//!
//! [`QuantMode::Q4`] is MLX affine with group 64 ([`quantize_affine`], MLX's exact GPU formula),
//! [`QuantMode::Q4_0`] symmetric group 32 ([`quantize_q4_0`]). Which matrices are quantized is the
//! default policy of [`MatrixRole::quantized_by_default`]; a matrix whose input dimension is not a
//! multiple of the group size stays dense. The result depends only on the stored weights (never on
//! thread count or load order), and `megagemma quantize` writes exactly these matrices, so loading
//! its output gives bit-identical weights.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use rayon::prelude::*;
use serde_json::Value;

use super::{quantize_affine, quantize_q4_0, round_bf16, QuantMatrix, GROUP_SIZES};
use crate::checkpoint::{Checkpoint, DType, SafetensorsSource};
use crate::config::ModelConfig;
use crate::dense::DenseMatrix;
use crate::matrix::RowDot;
use crate::plan::ModelPlan;
use crate::weights::{load_weights, Matrix, ModelWeights, TensorSource};
use crate::{bail, Error, Result};

/// How weights are held after loading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum QuantMode {
    /// As stored: dense bf16/f16/f32, or the checkpoint's own MLX 4-bit quantization (`none`).
    #[default]
    Stored,
    /// MLX affine 4-bit, group 64, scales and biases rounded to bf16 (`q4`).
    Q4,
    /// Symmetric 4-bit, group 32 (ggml `Q4_0`, Google's QAT scheme) as affine (`q4_0`).
    Q4_0,
}

impl QuantMode {
    /// Group size of the scheme; `None` for [`QuantMode::Stored`].
    pub fn group_size(self) -> Option<usize> {
        match self {
            QuantMode::Stored => None,
            QuantMode::Q4 => Some(64),
            QuantMode::Q4_0 => Some(32),
        }
    }
    /// The command-line spelling: `none`, `q4`, `q4_0`.
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Stored => "none",
            QuantMode::Q4 => "q4",
            QuantMode::Q4_0 => "q4_0",
        }
    }
    /// Quantizes a row-major `[rows, cols]` f32 matrix with this scheme (panics for `Stored`, or if
    /// the group size does not divide `cols`).
    pub fn quantize(self, w: &[f32], rows: usize, cols: usize) -> QuantMatrix {
        match self {
            QuantMode::Stored => panic!("QuantMode::Stored does not quantize"),
            QuantMode::Q4 => quantize_affine(w, rows, cols, 64),
            QuantMode::Q4_0 => quantize_q4_0(w, rows, cols),
        }
    }
}

impl fmt::Display for QuantMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for QuantMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" => Ok(QuantMode::Stored),
            "q4" => Ok(QuantMode::Q4),
            "q4_0" => Ok(QuantMode::Q4_0),
            _ => bail!("unknown quantization `{s}` (expected none, q4 or q4_0)"),
        }
    }
}

/// What a weight matrix is, from its Hugging Face name relative to the text decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatrixRole {
    /// `embed_tokens` (also the LM head when embeddings are tied).
    Embedding,
    /// `embed_tokens_per_layer`, the `[ple_vocab, L·P]` PLE table (only gathered).
    PleTable,
    /// `per_layer_model_projection` `[L·P, H]`.
    PleModelProjection,
    /// An untied `lm_head`.
    LmHead,
    /// MoE `router.proj`.
    Router,
    /// Attention, MLP and per-layer PLE projections (`layers.i.*.weight`).
    Projection,
    /// MoE expert tensors (`experts.gate_up_proj`, `experts.down_proj`).
    Expert,
    /// Anything else.
    Other,
}

impl MatrixRole {
    pub fn of(rel: &str) -> MatrixRole {
        match rel {
            "embed_tokens.weight" => MatrixRole::Embedding,
            "embed_tokens_per_layer.weight" => MatrixRole::PleTable,
            "per_layer_model_projection.weight" => MatrixRole::PleModelProjection,
            "lm_head.weight" => MatrixRole::LmHead,
            _ if !rel.starts_with("layers.") => MatrixRole::Other,
            _ if rel.ends_with(".router.proj.weight") => MatrixRole::Router,
            _ if rel.ends_with(".experts.gate_up_proj") || rel.ends_with(".experts.down_proj") => MatrixRole::Expert,
            _ if rel.ends_with("_proj.weight")
                || rel.ends_with(".per_layer_input_gate.weight")
                || rel.ends_with(".per_layer_projection.weight") =>
            {
                MatrixRole::Projection
            }
            _ => MatrixRole::Other,
        }
    }

    /// The default policy of `--quant` (the same as `mlx_lm.convert -q`, except that the MoE
    /// router, 8-bit in mlx-lm, stays dense): every `Linear` and `Embedding` is quantized —
    /// projections, experts, the embedding (and with it the tied LM head), an untied LM head and
    /// the PLE table — while `per_layer_model_projection` (a `ScaledLinear` that mlx-lm leaves
    /// dense) and the router stay in their stored dtype. Norms and other vectors are never
    /// quantized.
    pub fn quantized_by_default(self) -> bool {
        matches!(
            self,
            MatrixRole::Embedding
                | MatrixRole::PleTable
                | MatrixRole::LmHead
                | MatrixRole::Projection
                | MatrixRole::Expert
        )
    }
}

/// The group size `mode` quantizes matrix `rel` (input dimension `cols`) with, or `None` when it
/// stays dense (mode `Stored`, a role the policy leaves dense, or `cols` not a multiple of the group).
pub fn quant_group(rel: &str, cols: usize, mode: QuantMode) -> Option<usize> {
    let g = mode.group_size()?;
    (MatrixRole::of(rel).quantized_by_default() && cols.is_multiple_of(g)).then_some(g)
}

/// f32 values converted per block while quantizing (bounds the temporary buffer to 16 MB).
const BLOCK_ELEMS: usize = 1 << 22;

/// Quantizes any matrix (its rows converted exactly to f32) with `mode`, block of rows by block of
/// rows so that huge tables (the PLE table) never exist in f32 at once. `name` is used in errors.
/// Deterministic: each row's codes, scales and biases depend on that row only.
pub fn quantize_matrix(name: &str, m: &dyn RowDot, mode: QuantMode) -> Result<QuantMatrix> {
    let (rows, cols) = (m.rows(), m.cols());
    let Some(g) = mode.group_size() else { bail!("quantize_matrix({name}): mode `none` does not quantize") };
    if !cols.is_multiple_of(g) {
        bail!("tensor `{name}`: group size {g} does not divide the row length {cols}");
    }
    let block_rows = (BLOCK_ELEMS / cols).max(1).min(rows.max(1));
    let mut packed = Vec::with_capacity(rows * cols / 8);
    let mut scales = Vec::with_capacity(rows * cols / g);
    let mut biases = Vec::with_capacity(rows * cols / g);
    let mut buf = vec![0f32; block_rows * cols];
    for start in (0..rows).step_by(block_rows) {
        let n = block_rows.min(rows - start);
        let b = &mut buf[..n * cols];
        b.par_chunks_mut(cols).enumerate().for_each(|(i, row)| m.row_to_f32(start + i, row));
        if let Some(i) = b.iter().position(|v| !v.is_finite()) {
            bail!(
                "tensor `{name}`: weight [{}, {}] = {} is not finite; cannot quantize",
                start + i / cols,
                i % cols,
                b[i]
            );
        }
        let q = mode.quantize(b, n, cols);
        packed.extend_from_slice(q.packed());
        scales.extend_from_slice(q.scales());
        biases.extend_from_slice(q.biases());
    }
    Ok(QuantMatrix::from_parts_unchecked(rows, cols, g, packed, scales, biases))
}

/// The MLX `quantization` entry of a checkpoint quantized with `mode` (what `megagemma quantize`
/// writes to `config.json` as `quantization` and `quantization_config`).
pub fn mlx_quantization_entry(mode: QuantMode) -> Value {
    serde_json::json!({ "group_size": mode.group_size().unwrap_or(64), "bits": 4, "mode": "affine" })
}

/// Text-decoder prefixes, longest first, stripped from override keys.
const PREFIXES: [&str; 4] = ["model.language_model.", "language_model.model.", "language_model.", "model."];

fn strip_prefix(path: &str) -> &str {
    PREFIXES.iter().find_map(|p| path.strip_prefix(p)).unwrap_or(path)
}

/// One quantization setting: `(group_size, bits)`, or `None` for a module marked dense.
type QuantParams = Option<(usize, usize)>;

/// A checkpoint's MLX `quantization` entry (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct MlxQuantConfig {
    pub group_size: usize,
    pub bits: usize,
    /// Per-module overrides keyed by module path relative to the text decoder (`layers.0.mlp.down_proj`).
    pub overrides: HashMap<String, QuantParams>,
}

impl MlxQuantConfig {
    pub fn from_json(v: &Value) -> Result<Self> {
        let what = "config.json `quantization`";
        let obj = v.as_object().ok_or_else(|| Error::msg(format!("{what} must be an object, got {v}")))?;
        if let Some(m) = obj.get("quant_method") {
            bail!(
                "{what}: quant_method {m} is not supported (only MLX affine 4-bit checkpoints, or bf16/f16/f32 ones)"
            );
        }
        let (group_size, bits) = params(what, obj, 64, 4)?;
        let mut overrides = HashMap::new();
        for (k, val) in obj {
            if matches!(k.as_str(), "group_size" | "bits" | "mode") {
                continue;
            }
            let p = match val {
                Value::Bool(false) => None,
                Value::Bool(true) => Some((group_size, bits)),
                Value::Object(o) => Some(params(&format!("{what}[\"{k}\"]"), o, group_size, bits)?),
                _ => continue, // not a module entry
            };
            overrides.insert(strip_prefix(k).to_string(), p);
        }
        Ok(MlxQuantConfig { group_size, bits, overrides })
    }

    /// Settings for the module at `path` (any prefix): its override, else the global entry.
    pub fn params_for(&self, path: &str) -> QuantParams {
        match self.overrides.get(strip_prefix(path)) {
            Some(p) => *p,
            None => Some((self.group_size, self.bits)),
        }
    }
}

fn params(what: &str, o: &serde_json::Map<String, Value>, group_size: usize, bits: usize) -> Result<(usize, usize)> {
    if let Some(m) = o.get("mode") {
        if m.as_str() != Some("affine") {
            bail!("{what}: mode {m} is not supported (only affine)");
        }
    }
    let int = |k: &str, d: usize| -> Result<usize> {
        match o.get(k) {
            None => Ok(d),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| Error::msg(format!("{what}: `{k}` must be a positive integer, got {v}"))),
        }
    };
    Ok((int("group_size", group_size)?, int("bits", bits)?))
}

/// The text decoder's tensor prefix actually used by the checkpoint (see the module docs).
pub fn text_prefix(ck: &Checkpoint, cfg: &ModelConfig) -> String {
    std::iter::once(cfg.tensor_prefix.as_str())
        .chain(PREFIXES)
        .find(|p| ck.get(&format!("{p}embed_tokens.weight")).is_some())
        .unwrap_or(&cfg.tensor_prefix)
        .to_string()
}

/// Whether the checkpoint holds MLX-quantized tensors or declares a `quantization` entry.
pub fn is_quantized(ck: &Checkpoint, cfg: &ModelConfig) -> bool {
    cfg.quantization.is_some() || ck.names().any(|n| n.ends_with(".scales"))
}

/// Errors unless `--quant mode` can apply: quantizing an already-quantized checkpoint again would
/// only lose precision.
pub fn check_quantizable(ck: &Checkpoint, cfg: &ModelConfig, mode: QuantMode) -> Result<()> {
    mlx_config(ck, cfg)?; // an unsupported `quantization_config` says so first
    if mode != QuantMode::Stored && is_quantized(ck, cfg) {
        bail!(
            "{} is already quantized (MLX 4-bit checkpoint); --quant {mode} applies to bf16/f16/f32 checkpoints (use --quant none)",
            ck.dir.display()
        );
    }
    Ok(())
}

fn mlx_config(ck: &Checkpoint, cfg: &ModelConfig) -> Result<Option<MlxQuantConfig>> {
    match &cfg.quantization {
        Some(v) => {
            Ok(Some(MlxQuantConfig::from_json(v).map_err(|e| Error::msg(format!("{}: {e}", ck.dir.display())))?))
        }
        None => Ok(None),
    }
}

/// Loads the weights of a safetensors checkpoint: MLX-quantized tensors as stored, dense ones as
/// stored or quantized with `mode`.
pub fn load_safetensors_weights(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    plan: &ModelPlan,
    mode: QuantMode,
) -> Result<ModelWeights> {
    with_tensor_source(ck, cfg, &text_prefix(ck, cfg), mode, |src| load_weights(src, cfg, plan))
}

/// Runs `load` over the checkpoint's tensors named `prefix` + relative name, read the way
/// [`load_safetensors_weights`] reads them: MLX-quantized tensors as stored, dense ones as stored or
/// quantized with `mode`. (An MTP assistant reads its `model.*` decoder and its top-level
/// projections through two such views.)
pub fn with_tensor_source<T>(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    prefix: &str,
    mode: QuantMode,
    load: impl FnOnce(&dyn TensorSource) -> Result<T>,
) -> Result<T> {
    check_quantizable(ck, cfg, mode)?;
    let mlx = mlx_config(ck, cfg)?;
    load(&QuantSource { inner: SafetensorsSource { ck, prefix }, mlx, mode })
}

/// A safetensors checkpoint that understands MLX-quantized tensors and quantizes dense matrices
/// on load; dense tensors and vectors go through [`SafetensorsSource`].
struct QuantSource<'a> {
    inner: SafetensorsSource<'a>,
    mlx: Option<MlxQuantConfig>,
    mode: QuantMode,
}

impl QuantSource<'_> {
    fn full_name(&self, rel: &str) -> String {
        self.inner.full_name(rel)
    }

    fn has(&self, name: &str) -> bool {
        self.inner.ck.get(name).is_some()
    }

    /// Quantizes a dense matrix when `mode` and the policy say so.
    fn maybe_quantize(&self, rel: &str, full: &str, m: Matrix) -> Result<Matrix> {
        match quant_group(rel, m.cols(), self.mode) {
            Some(_) => Ok(Box::new(quantize_matrix(full, &*m, self.mode)?)),
            None => Ok(m),
        }
    }

    /// The MLX triplet `base.{weight,scales,biases}` as `[rows, cols]` matrices: one for a 2-D
    /// weight (`experts = None`), or `experts` of them for a `[E, rows, cols/8]` switch_glu tensor.
    fn mlx_matrices(&self, base: &str, experts: Option<usize>, rows: usize, cols: usize) -> Result<Vec<QuantMatrix>> {
        let wname = format!("{base}.weight");
        let Some(mlx) = &self.mlx else {
            bail!("tensor `{base}.scales` is present but config.json has no `quantization` entry (group_size, bits)");
        };
        let Some((g, bits)) = mlx.params_for(base) else {
            bail!(
                "config.json `quantization` marks `{}` as not quantized, but `{base}.scales` is present",
                strip_prefix(base)
            );
        };
        if bits != 4 {
            bail!("tensor `{wname}`: {bits}-bit MLX quantization is not supported (only 4-bit supported)");
        }
        if !GROUP_SIZES.contains(&g) {
            bail!("tensor `{wname}`: group size {g} is not supported (expected 32, 64 or 128)");
        }
        if !cols.is_multiple_of(g) {
            bail!("tensor `{wname}`: group size {g} does not divide the row length {cols}");
        }
        let lead: Vec<usize> = experts.into_iter().collect();
        let shape = |last: usize| -> Vec<usize> { lead.iter().copied().chain([rows, last]).collect() };
        let w = self.inner.ck.get(&wname).ok_or_else(|| {
            Error::msg(format!(
                "missing tensor `{wname}` (expected U32 {:?}) in {}",
                shape(cols / 8),
                self.inner.ck.dir.display()
            ))
        })?;
        if w.dtype != DType::U32 {
            bail!(
                "tensor `{wname}` has dtype {}, expected U32 {:?} (MLX 4-bit: 8 weights per word)",
                w.dtype.name(),
                shape(cols / 8)
            );
        }
        w.expect_shape(&shape(cols / 8))?;
        let s = self.inner.ck.require(&format!("{base}.scales"), &shape(cols / g))?;
        let b = self.inner.ck.require(&format!("{base}.biases"), &shape(cols / g))?;
        let (words, scales, biases) = (w.to_u32_vec()?, s.to_f32_vec()?, b.to_f32_vec()?);
        let n = experts.unwrap_or(1);
        let (wn, gn) = (rows * cols / 8, rows * cols / g);
        (0..n)
            .map(|e| {
                QuantMatrix::from_mlx(
                    &words[e * wn..(e + 1) * wn],
                    &scales[e * gn..(e + 1) * gn],
                    &biases[e * gn..(e + 1) * gn],
                    rows,
                    cols,
                    g,
                    bits,
                )
                .map_err(|err| Error::msg(format!("tensor `{wname}`: {err}")))
            })
            .collect()
    }

    /// `experts` matrices of a switch_glu tensor `layers.i.experts.switch_glu.X` (quantized or dense).
    fn switch_glu(&self, rel: &str, module: &str, experts: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>> {
        if self.has(&format!("{module}.scales")) {
            return Ok(self
                .mlx_matrices(module, Some(experts), rows, cols)?
                .into_iter()
                .map(|m| Box::new(m) as Matrix)
                .collect());
        }
        let t = self.inner.ck.require(&format!("{module}.weight"), &[experts, rows, cols])?;
        (0..experts)
            .map(|e| {
                self.maybe_quantize(rel, module, Box::new(DenseMatrix::from_tensor_rows(t, e * rows, rows, cols)?))
            })
            .collect()
    }
}

impl TensorSource for QuantSource<'_> {
    fn matrix(&self, rel: &str, rows: usize, cols: usize) -> Result<Matrix> {
        let full = self.full_name(rel);
        if let Some(base) = full.strip_suffix(".weight") {
            if self.has(&format!("{base}.scales")) {
                let m = self.mlx_matrices(base, None, rows, cols)?.pop().expect("one matrix");
                return Ok(Box::new(m));
            }
        }
        let m = self.inner.matrix(rel, rows, cols)?;
        self.maybe_quantize(rel, &full, m)
    }

    fn matrices(&self, rel: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<Matrix>> {
        let full = self.full_name(rel);
        // mlx-lm / mlx-vlm store experts as switch_glu gate/up/down tensors of [E, rows, cols].
        let layer = rel.strip_suffix("experts.gate_up_proj").or_else(|| rel.strip_suffix("experts.down_proj"));
        if let (false, Some(layer)) = (self.has(&full), layer) {
            let glu = |x: &str| format!("{}{layer}experts.switch_glu.{x}_proj", self.inner.prefix);
            let present = |x: &str| self.has(&format!("{}.weight", glu(x)));
            if rel.ends_with("gate_up_proj") && present("gate") && present("up") && n.is_multiple_of(2) {
                let gates = self.switch_glu(rel, &glu("gate"), n / 2, rows, cols)?;
                let ups = self.switch_glu(rel, &glu("up"), n / 2, rows, cols)?;
                // gate_up_proj order: expert e's gate half, then its up half.
                return Ok(gates.into_iter().zip(ups).flat_map(|(g, u)| [g, u]).collect());
            }
            if rel.ends_with("down_proj") && present("down") {
                return self.switch_glu(rel, &glu("down"), n, rows, cols);
            }
        }
        self.inner.matrices(rel, n, rows, cols)?.into_iter().map(|m| self.maybe_quantize(rel, &full, m)).collect()
    }

    fn vector(&self, rel: &str, len: usize) -> Result<Vec<f32>> {
        self.inner.vector(rel, len)
    }

    fn contains(&self, rel: &str) -> bool {
        self.inner.contains(rel)
    }

    fn norms_include_one(&self) -> bool {
        self.inner.norms_include_one()
    }
}

/// An f32 that is a bf16 value, as its bf16 bits (the scales and biases [`quantize_affine`] and
/// [`quantize_q4_0`] produce always are); `None` otherwise.
pub fn exact_bf16_bits(x: f32) -> Option<u16> {
    (round_bf16(x).to_bits() == x.to_bits()).then_some((x.to_bits() >> 16) as u16)
}
