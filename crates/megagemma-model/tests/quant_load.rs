//! 4-bit weights at load time: quantize-on-load (`q4`, `q4_0`) and MLX 4-bit checkpoints.
//!
//! * On every fixture, the quantized model's forward equals the dense forward on its own
//!   dequantized weights (greedy ids equal, logits within 1e-5 relative L2): the fused 4-bit
//!   kernels, the exact gathers and the tied head compute what the weights say.
//! * Quantize-on-load is deterministic (two loads, any thread count: identical bits).
//! * An MLX checkpoint written here, independently of `megagemma quantize`, loads to exactly the
//!   weights `--quant q4` gives; broken ones fail with one clear line.

use megagemma_model::checkpoint::{Checkpoint, DType};
use megagemma_model::cpu::CpuBackend;
use megagemma_model::dense::DenseMatrix;
use megagemma_model::matrix::{RowDot, WeightLayout};
use megagemma_model::quant::load::{quantize_matrix, MlxQuantConfig, QuantMode};
use megagemma_model::quant::{quantize_affine, QuantMatrix};
use megagemma_model::weights::*;
use megagemma_model::{Backend, Model, Want};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// Every dense fixture (all with a config.json that declares no quantization).
fn dense_fixtures() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let Ok(text) = std::fs::read_to_string(p.join("config.json")) else { return false };
            let cfg: Value = serde_json::from_str(&text).unwrap();
            cfg.get("quantization").is_none() && cfg.get("quantization_config").is_none()
        })
        .collect();
    v.sort();
    assert!(v.len() >= 6, "expected at least 6 dense fixtures, found {}", v.len());
    v
}

fn name(dir: &Path) -> String {
    dir.file_name().unwrap().to_string_lossy().into_owned()
}

/// A prompt for the fixture: its expected.json's first case, else a fixed one.
fn prompt(dir: &Path) -> Vec<u32> {
    match std::fs::read_to_string(dir.join("expected.json")) {
        Ok(t) => {
            let v: Value = serde_json::from_str(&t).unwrap();
            v["cases"][0]["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
        }
        Err(_) => vec![2, 7, 8, 9, 10, 11],
    }
}

/// Every matrix of the model, with a label.
fn all_matrices(w: &ModelWeights) -> Vec<(String, &dyn RowDot)> {
    fn push<'a>(v: &mut Vec<(String, &'a dyn RowDot)>, i: usize, n: &str, m: &'a Matrix) {
        v.push((format!("layers.{i}.{n}"), m.as_ref()));
    }
    let mut v: Vec<(String, &dyn RowDot)> = vec![("embed".into(), w.embed.as_ref())];
    if let Some(h) = &w.lm_head {
        v.push(("lm_head".into(), h.as_ref()));
    }
    if let Some(p) = &w.ple {
        v.push(("ple.embed".into(), p.embed.as_ref()));
        v.push(("ple.proj".into(), p.proj.as_ref()));
    }
    for (i, l) in w.layers.iter().enumerate() {
        push(&mut v, i, "q", &l.attn.q);
        push(&mut v, i, "o", &l.attn.o);
        if let Some(k) = &l.attn.k {
            push(&mut v, i, "k", k);
        }
        if let Some(x) = &l.attn.v {
            push(&mut v, i, "v", x);
        }
        push(&mut v, i, "gate", &l.mlp.gate);
        push(&mut v, i, "up", &l.mlp.up);
        push(&mut v, i, "down", &l.mlp.down);
        if let Some(p) = &l.ple {
            push(&mut v, i, "ple.gate", &p.gate);
            push(&mut v, i, "ple.proj", &p.proj);
        }
        if let Some(m) = &l.moe {
            push(&mut v, i, "router", &m.router_proj);
            for (e, x) in m.experts.iter().enumerate() {
                push(&mut v, i, &format!("expert{e}.gate"), &x.gate);
                push(&mut v, i, &format!("expert{e}.up"), &x.up);
                push(&mut v, i, &format!("expert{e}.down"), &x.down);
            }
        }
    }
    v
}

fn to_f32(m: &dyn RowDot) -> Vec<f32> {
    let c = m.cols();
    let mut out = vec![0f32; m.rows() * c];
    for (r, row) in out.chunks_exact_mut(c).enumerate() {
        m.row_to_f32(r, row);
    }
    out
}

/// A dense f32 copy of a matrix: its exact dequantized (or widened) values.
fn densify(m: &Matrix) -> Matrix {
    Box::new(DenseMatrix::from_f32(m.rows(), m.cols(), to_f32(m.as_ref())))
}

fn densify_mlp(m: &MlpWeights) -> MlpWeights {
    MlpWeights { gate: densify(&m.gate), up: densify(&m.up), down: densify(&m.down) }
}

/// The same model with every matrix replaced by a dense f32 copy of its values.
fn dense_model(m: &Model) -> Model {
    let w = &m.weights;
    let layers = w
        .layers
        .iter()
        .map(|l| LayerWeights {
            input_norm: l.input_norm.clone(),
            attn: AttentionWeights {
                q: densify(&l.attn.q),
                q_norm: l.attn.q_norm.clone(),
                k: l.attn.k.as_ref().map(densify),
                v: l.attn.v.as_ref().map(densify),
                k_norm: l.attn.k_norm.clone(),
                o: densify(&l.attn.o),
            },
            post_attn_norm: l.post_attn_norm.clone(),
            pre_ffn_norm: l.pre_ffn_norm.clone(),
            mlp: densify_mlp(&l.mlp),
            post_ffn_norm: l.post_ffn_norm.clone(),
            ple: l.ple.as_ref().map(|p| PleWeights {
                gate: densify(&p.gate),
                proj: densify(&p.proj),
                post_norm: p.post_norm.clone(),
            }),
            moe: l.moe.as_ref().map(|x| MoeWeights {
                router_proj: densify(&x.router_proj),
                router_scale: x.router_scale.clone(),
                per_expert_scale: x.per_expert_scale.clone(),
                experts: x.experts.iter().map(densify_mlp).collect(),
                pre_norm_2: x.pre_norm_2.clone(),
                post_norm_1: x.post_norm_1.clone(),
                post_norm_2: x.post_norm_2.clone(),
            }),
            layer_scalar: l.layer_scalar,
        })
        .collect();
    let weights = ModelWeights {
        embed: densify(&w.embed),
        ple: w.ple.as_ref().map(|p| PleInputWeights {
            embed: densify(&p.embed),
            proj: densify(&p.proj),
            norm: p.norm.clone(),
        }),
        layers,
        final_norm: w.final_norm.clone(),
        lm_head: w.lm_head.as_ref().map(densify),
    };
    Model { config: m.config.clone(), plan: ModelPlan::new(&m.config).unwrap(), weights }
}

use megagemma_model::plan::ModelPlan;

/// Greedy decode: (argmax, logits) of the prefill and of `n − 1` decode steps.
fn greedy(model: Arc<Model>, prompt: &[u32], n: usize) -> Vec<(u32, Vec<f32>)> {
    let mut b = CpuBackend::new(model);
    let seq = b.new_sequence().unwrap();
    let mut s = b.prefill(seq, prompt, Want::Logits).unwrap();
    let mut out = vec![];
    for i in 0..n {
        out.push((s.argmax, s.logits.clone()));
        if i + 1 < n {
            s = b.decode(seq, s.argmax, Want::Logits).unwrap();
        }
    }
    out
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Quantized vs dense forward on the same (dequantized) weights. The kernels dequantize each weight
/// exactly as `QuantMatrix::dequantize` does, so the only difference is summation order (per
/// matrix: ≤ 1.7e-7 relative to the f64 dot, checked below at 1e-5). Measured maximum over 8 steps,
/// both schemes and the avx512f / avx2+fma / portable kernels: ≤ 7e-6 on every fixture except
/// `ple_shared_dw` with `q4` (1.9–2.6e-5). That fixture amplifies any change of summation order,
/// not anything specific to the quantized kernels: the same dense forward with every dot
/// accumulated in f64 instead (weights and everything else unchanged) differs from the f32 dense
/// forward by up to 2.2e-5 there (and from the quantized one by up to 2.7e-5); the dense CPU path is
/// also up to 4e-5 from transformers on it. Hence 1e-5 everywhere but there, and 4e-5 there.
/// On CPUs with AVX-512 VNNI the products run on byte tiles (`gguf::byte_tiles`), whose inputs are
/// rounded to 22-bit integers per 32 values (≤ 1.2e-7 of the block's largest value): measured
/// there ≤ 1.32e-5 (`sliding_wrap` q4; the f32 kernels 5.7e-6 on it) and 3.0e-5 on
/// `ple_shared_dw`, hence [`FORWARD_TOLERANCE_TILES`] beside the same 4e-5 there.
/// A wrong nibble, scale, bias or gather gives > 1e-2.
const FORWARD_TOLERANCE: f64 = 1e-5;
/// [`FORWARD_TOLERANCE`] where the products run on byte tiles.
const FORWARD_TOLERANCE_TILES: f64 = 2e-5;
/// [`FORWARD_TOLERANCE`] for the summation-order-sensitive `ple_shared_dw` fixture.
const FORWARD_TOLERANCE_PLE_SHARED_DW: f64 = 4e-5;

fn bytes_of_quant(rows: usize, cols: usize, g: usize) -> usize {
    rows * cols / 2 + rows * (cols / g) * 4
}

#[test]
fn quantized_forward_equals_dense_forward_on_dequantized_weights() {
    for dir in dense_fixtures() {
        let original = Model::load(&dir).unwrap();
        for mode in [QuantMode::Q4, QuantMode::Q4_0] {
            let tag = format!("{}/{mode}", name(&dir));
            let q = Model::load_with(&dir, mode).unwrap_or_else(|e| panic!("{tag}: {e}"));
            let g = mode.group_size().unwrap();
            // It really is quantized: the embedding (every fixture's hidden size is a multiple of
            // 64) and the decode bytes.
            let (v, h) = (q.weights.embed.rows(), q.weights.embed.cols());
            assert_eq!(q.weights.embed.stored_bytes(), bytes_of_quant(v, h, g), "{tag}: embedding not quantized");
            assert!(
                q.weights.decode_bytes(q.plan.moe_top_k) * 2 < original.weights.decode_bytes(original.plan.moe_top_k),
                "{tag}: decode bytes {} vs dense {}",
                q.weights.decode_bytes(q.plan.moe_top_k),
                original.weights.decode_bytes(original.plan.moe_top_k)
            );
            // Norms and the per-layer model projection stay as stored.
            assert_eq!(q.weights.final_norm, original.weights.final_norm, "{tag}");
            if let (Some(a), Some(b)) = (&q.weights.ple, &original.weights.ple) {
                assert_eq!(
                    a.proj.stored_bytes(),
                    b.proj.stored_bytes(),
                    "{tag}: per_layer_model_projection must stay dense"
                );
            }
            for l in q.weights.layers.iter().filter_map(|l| l.moe.as_ref()) {
                assert_eq!(
                    l.router_proj.stored_bytes(),
                    l.router_proj.rows() * l.router_proj.cols() * 2,
                    "{tag}: router must stay bf16"
                );
            }

            // Every product: the fused kernel against the f64 dot of the dequantized row.
            for (n, m) in all_matrices(&q.weights) {
                let x: Vec<f32> = (0..m.cols()).map(|j| ((j * 7919 % 113) as f32 / 113.0 - 0.5) * 3.0).collect();
                let mut y = vec![0f32; m.rows()];
                m.dot_rows(0, &x, &mut y);
                let w = to_f32(m);
                let exact: Vec<f32> = w
                    .chunks_exact(m.cols())
                    .map(|row| row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() as f32)
                    .collect();
                let e = rel_l2(&y, &exact);
                assert!(e < 1e-5, "{tag}: {n}: dot_rows differs from the dequantized row's dot by {e:.3e} relative L2");
            }

            let q = Arc::new(q);
            let d = Arc::new(dense_model(&q));
            let p = prompt(&dir);
            let got = greedy(q.clone(), &p, 8);
            let want = greedy(d, &p, 8);
            let tol = match (name(&dir) == "ple_shared_dw", megagemma_model::gguf::byte_tiles::enabled()) {
                (true, _) => FORWARD_TOLERANCE_PLE_SHARED_DW,
                (false, true) => FORWARD_TOLERANCE_TILES,
                (false, false) => FORWARD_TOLERANCE,
            };
            for (step, ((gi, gl), (wi, wl))) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    gi, wi,
                    "{tag}: step {step}: greedy id differs from the dense forward on dequantized weights"
                );
                let e = rel_l2(gl, wl);
                assert!(e < tol, "{tag}: step {step}: logits differ by {e:.3e} relative L2 (tolerance {tol:.0e})");
            }
            // And quantization did change the model.
            let orig = greedy(Arc::new(Model::load(&dir).unwrap()), &p, 1);
            assert!(rel_l2(&got[0].1, &orig[0].1) > 1e-6, "{tag}: quantized logits equal the bf16 ones");
        }
    }
}

#[test]
fn quantize_on_load_is_deterministic() {
    for dir in dense_fixtures() {
        for mode in [QuantMode::Q4, QuantMode::Q4_0] {
            let tag = format!("{}/{mode}", name(&dir));
            let a = Model::load_with(&dir, mode).unwrap();
            let b = Model::load_with(&dir, mode).unwrap();
            let (ma, mb) = (all_matrices(&a.weights), all_matrices(&b.weights));
            assert_eq!(ma.len(), mb.len());
            for ((n, x), (_, y)) in ma.iter().zip(&mb) {
                assert_eq!(x.stored_bytes(), y.stored_bytes(), "{tag}: {n}");
                let (fx, fy) = (to_f32(*x), to_f32(*y));
                assert!(
                    fx.iter().zip(&fy).all(|(p, q)| p.to_bits() == q.to_bits()),
                    "{tag}: {n} differs between two loads"
                );
            }
        }
    }
    // Packed bits, scales and biases do not depend on the thread count.
    let ck = Checkpoint::open(&fixtures_dir().join("ple_shared_dw")).unwrap();
    let t = ck.get("model.embed_tokens.weight").unwrap();
    let m = DenseMatrix::from_tensor(t, t.shape[0], t.shape[1]).unwrap();
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let three = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    for mode in [QuantMode::Q4, QuantMode::Q4_0] {
        let a = one.install(|| quantize_matrix("embed", &m, mode).unwrap());
        let b = three.install(|| quantize_matrix("embed", &m, mode).unwrap());
        assert_eq!(a, b, "{mode}: quantization depends on the thread count");
        // Block-wise quantization equals quantizing the whole matrix at once.
        let whole = mode.quantize(&t.to_f32_vec().unwrap(), t.shape[0], t.shape[1]);
        assert_eq!(a, whole, "{mode}");
    }
}

#[test]
fn quant_mode_parses_cli_spellings() {
    assert_eq!("none".parse::<QuantMode>().unwrap(), QuantMode::Stored);
    assert_eq!("q4".parse::<QuantMode>().unwrap(), QuantMode::Q4);
    assert_eq!("Q4_0".parse::<QuantMode>().unwrap(), QuantMode::Q4_0);
    let e = "q8".parse::<QuantMode>().unwrap_err().to_string();
    assert!(e.contains("expected none, q4 or q4_0"), "{e}");
}

#[test]
fn mlx_override_format_is_parsed() {
    let c = MlxQuantConfig::from_json(&json!({
        "group_size": 64, "bits": 4, "mode": "affine",
        "language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4},
        "model.layers.1.router.proj": {"group_size": 64, "bits": 8},
        "model.layers.2.self_attn.q_proj": false,
    }))
    .unwrap();
    assert_eq!(c.params_for("model.language_model.layers.0.mlp.down_proj"), Some((32, 4)));
    assert_eq!(c.params_for("model.layers.0.mlp.down_proj"), Some((32, 4)));
    assert_eq!(c.params_for("language_model.model.layers.1.router.proj"), Some((64, 8)));
    assert_eq!(c.params_for("model.layers.2.self_attn.q_proj"), None);
    assert_eq!(c.params_for("model.layers.5.mlp.up_proj"), Some((64, 4)));
    let e = MlxQuantConfig::from_json(&json!({"group_size": 32, "bits": 4, "mode": "mxfp4"})).unwrap_err().to_string();
    assert!(e.contains("only affine"), "{e}");
    let e = MlxQuantConfig::from_json(&json!({"quant_method": "gptq", "bits": 4})).unwrap_err().to_string();
    assert!(e.contains("quant_method"), "{e}");
}

// ---- MLX checkpoints written here ------------------------------------------------------------

/// One tensor of a checkpoint being written.
struct T {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::F32 => safetensors::Dtype::F32,
        DType::U32 => safetensors::Dtype::U32,
        other => panic!("unexpected dtype {other:?}"),
    }
}

/// The MLX triplet of a quantized matrix (scales and biases as bf16).
fn triplet(base: &str, q: &QuantMatrix, rows: usize, cols: usize) -> Vec<T> {
    let g = q.group_size();
    let bf16 = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect() };
    vec![
        T {
            name: format!("{base}.weight"),
            dtype: safetensors::Dtype::U32,
            shape: vec![rows, cols / 8],
            data: q.packed().iter().flat_map(|w| w.to_le_bytes()).collect(),
        },
        T {
            name: format!("{base}.scales"),
            dtype: safetensors::Dtype::BF16,
            shape: vec![rows, cols / g],
            data: bf16(q.scales()),
        },
        T {
            name: format!("{base}.biases"),
            dtype: safetensors::Dtype::BF16,
            shape: vec![rows, cols / g],
            data: bf16(q.biases()),
        },
    ]
}

/// Writes `dst` as mlx-lm would quantize fixture `src` with group 64: every 2-D `*_proj`,
/// `per_layer_input_gate`/`per_layer_projection` and embedding table whose rows divide into
/// groups of 64 (MLX's affine formula, scales/biases in bf16), `quantization` in config.json.
/// `group_of` may give a matrix another group size (listed as a per-module override).
fn write_mlx(src: &Path, dst: &Path, group_of: impl Fn(&str) -> usize) -> Value {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    let ck = Checkpoint::open(src).unwrap();
    let mut names: Vec<&str> = ck.names().collect();
    names.sort();
    let mut out = vec![];
    let mut quantization = json!({"group_size": 64, "bits": 4, "mode": "affine"});
    for n in names {
        let t = ck.get(n).unwrap();
        let quantizable = n == "lm_head.weight"
            || n.ends_with("_proj.weight")
            || n.ends_with("embed_tokens.weight")
            || n.ends_with("embed_tokens_per_layer.weight")
            || n.ends_with("per_layer_input_gate.weight")
            || n.ends_with("per_layer_projection.weight");
        let mlx_dense = n.contains("per_layer_model_projection") || n.contains("router");
        let base = n.strip_suffix(".weight").unwrap_or(n);
        let g = group_of(base);
        if t.shape.len() == 2 && quantizable && !mlx_dense && t.shape[1].is_multiple_of(g) {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let q = quantize_affine(&t.to_f32_vec().unwrap(), rows, cols, g);
            if g != 64 {
                quantization[base] = json!({"group_size": g, "bits": 4});
            }
            out.extend(triplet(base, &q, rows, cols));
        } else {
            out.push(T {
                name: n.to_string(),
                dtype: st_dtype(t.dtype),
                shape: t.shape.clone(),
                data: t.data.bytes().to_vec(),
            });
        }
    }
    save(dst, &out);
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["quantization"] = quantization.clone();
    cfg["quantization_config"] = quantization;
    std::fs::write(dst.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    cfg
}

fn save(dst: &Path, tensors: &[T]) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|t| (t.name.clone(), safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}

/// Rewrites tensors of a written checkpoint.
fn edit_tensors(dir: &Path, f: impl Fn(&mut Vec<T>)) {
    let ck = Checkpoint::open(dir).unwrap();
    let mut v: Vec<T> = ck
        .names()
        .map(|n| {
            let t = ck.get(n).unwrap();
            T { name: n.to_string(), dtype: st_dtype(t.dtype), shape: t.shape.clone(), data: t.data.bytes().to_vec() }
        })
        .collect();
    drop(ck);
    f(&mut v);
    save(dir, &v);
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) {
    let p = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn scratch(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("megagemma-quant-load-{tag}-{}", std::process::id()))
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded, expected an error", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn assert_same_weights(a: &Model, b: &Model, tag: &str) {
    let (ma, mb) = (all_matrices(&a.weights), all_matrices(&b.weights));
    assert_eq!(ma.len(), mb.len());
    for ((n, x), (_, y)) in ma.iter().zip(&mb) {
        assert_eq!(x.stored_bytes(), y.stored_bytes(), "{tag}: {n}: stored bytes");
        let (fx, fy) = (to_f32(*x), to_f32(*y));
        assert!(fx.iter().zip(&fy).all(|(p, q)| p.to_bits() == q.to_bits()), "{tag}: {n}: values differ");
    }
}

#[test]
fn mlx_checkpoint_loads_to_the_weights_of_quantize_on_load() {
    for fixture in ["ple_shared_dw", "conditional", "keqv_global"] {
        let src = fixtures_dir().join(fixture);
        let dst = scratch(&format!("ok-{fixture}"));
        write_mlx(&src, &dst, |_| 64);
        let mlx = Model::load(&dst).unwrap_or_else(|e| panic!("{fixture}: {e}"));
        let q4 = Model::load_with(&src, QuantMode::Q4).unwrap();
        assert_same_weights(&mlx, &q4, fixture);
        let p = prompt(&src);
        let (a, b) = (greedy(Arc::new(mlx), &p, 4), greedy(Arc::new(q4), &p, 4));
        for ((ia, la), (ib, lb)) in a.iter().zip(&b) {
            assert_eq!(ia, ib, "{fixture}");
            assert!(la.iter().zip(lb).all(|(x, y)| x.to_bits() == y.to_bits()), "{fixture}: logits differ");
        }
        // --quant on an already-quantized checkpoint is refused.
        let e = Model::load_with(&dst, QuantMode::Q4_0).err().expect("refused").to_string();
        assert!(e.contains("already quantized"), "{e}");
        std::fs::remove_dir_all(&dst).unwrap();
    }
}

#[test]
fn mlx_per_module_group_size_override() {
    let src = fixtures_dir().join("ple_shared_dw");
    let dst = scratch("override");
    let q_proj = "model.layers.0.self_attn.q_proj";
    write_mlx(&src, &dst, |b| if b == q_proj { 32 } else { 64 });
    let m = Model::load(&dst).unwrap();
    let q = &m.weights.layers[0].attn.q;
    assert_eq!(
        q.stored_bytes(),
        q.rows() * q.cols() / 2 + q.rows() * (q.cols() / 32) * 4,
        "layer 0 q_proj must use group 32"
    );
    // The values are those of a group-32 quantization of the bf16 weights.
    let ck = Checkpoint::open(&src).unwrap();
    let t = ck.get(&format!("{q_proj}.weight")).unwrap();
    let want = quantize_affine(&t.to_f32_vec().unwrap(), t.shape[0], t.shape[1], 32);
    assert_eq!(to_f32(q.as_ref()), want.dequantize());
    // `false` (left dense) while scales are present is an error naming the module.
    edit_config(&dst, |v| v["quantization"][q_proj] = json!(false));
    let e = load_err(&dst);
    assert!(e.contains("layers.0.self_attn.q_proj") && e.contains("not quantized"), "{e}");
    std::fs::remove_dir_all(&dst).unwrap();
}

#[test]
fn broken_mlx_checkpoints_fail_with_one_clear_line() {
    let src = fixtures_dir().join("ple_shared_dw");
    let q_proj = "model.layers.0.self_attn.q_proj";
    let check = |tag: &str, edit: &dyn Fn(&Path), needles: &[&str]| {
        let dst = scratch(tag);
        write_mlx(&src, &dst, |_| 64);
        edit(&dst);
        let e = load_err(&dst);
        assert_eq!(e.lines().count(), 1, "{tag}: one line: {e}");
        for n in needles {
            assert!(e.contains(n), "{tag}: error {e:?} should mention {n:?}");
        }
        std::fs::remove_dir_all(&dst).unwrap();
    };

    // Scales of the wrong shape (group 32 data under a group-64 config).
    check(
        "scales",
        &|d| {
            edit_tensors(d, |v| {
                let s = v.iter_mut().find(|t| t.name == format!("{q_proj}.scales")).unwrap();
                let (rows, n) = (s.shape[0], s.shape[1]);
                s.shape = vec![rows, 2 * n];
                s.data = [s.data.clone(), s.data.clone()].concat();
            })
        },
        &[&format!("`{q_proj}.scales`"), "[64, 2]", "expected [64, 1]"],
    );
    // 8-bit in config.json.
    check("bits", &|d| edit_config(d, |v| v["quantization"]["bits"] = json!(8)), &["only 4-bit supported", ".weight`"]);
    // A group size that does not divide the row (per-module override).
    check(
        "group",
        &|d| edit_config(d, |v| v["quantization"][q_proj] = json!({"group_size": 128, "bits": 4})),
        &[&format!("`{q_proj}.weight`"), "group size 128 does not divide the row length 64"],
    );
    // The packed weight stored as F32.
    check(
        "dtype",
        &|d| {
            edit_tensors(d, |v| {
                let w = v.iter_mut().find(|t| t.name == format!("{q_proj}.weight")).unwrap();
                w.dtype = safetensors::Dtype::F32;
            })
        },
        &[&format!("`{q_proj}.weight`"), "dtype F32", "expected U32 [64, 8]"],
    );
    // Quantized tensors but no `quantization` entry.
    check(
        "noconfig",
        &|d| {
            edit_config(d, |v| {
                let o = v.as_object_mut().unwrap();
                o.remove("quantization");
                o.remove("quantization_config");
            })
        },
        &[".scales`", "no `quantization` entry"],
    );
    // Missing biases.
    check(
        "biases",
        &|d| edit_tensors(d, |v| v.retain(|t| t.name != format!("{q_proj}.biases"))),
        &[&format!("missing tensor `{q_proj}.biases`"), "[64, 1]"],
    );
}

/// A 4-bit model laid out for the CPU alone (`keep_cpu_layouts_only`: on AVX-512 VNNI the
/// arrays go, the byte tiles stay) decodes bit for bit as the same model holding both, gathers
/// the same embedding rows, and gives back the same arrays when something asks for them again.
#[test]
fn models_kept_as_cpu_tiles_alone_decode_and_give_back_the_same_bits() {
    for dir in dense_fixtures().into_iter().filter(|d| ["sliding_wrap", "ple_shared_dw", "moe"].contains(&&*name(d))) {
        let tag = name(&dir);
        let both = Arc::new(Model::load_with(&dir, QuantMode::Q4).unwrap());
        let mut alone = Model::load_with(&dir, QuantMode::Q4).unwrap();
        alone.weights.keep_cpu_layouts_only();
        let alone = Arc::new(alone);
        let p = prompt(&dir);
        for (step, ((gi, gl), (wi, wl))) in
            greedy(alone.clone(), &p, 8).iter().zip(&greedy(both.clone(), &p, 8)).enumerate()
        {
            assert_eq!(gi, wi, "{tag}: step {step}: id");
            assert!(gl.iter().zip(wl).all(|(a, b)| a.to_bits() == b.to_bits()), "{tag}: step {step}: logits differ");
        }
        // Rows first (from the tiles where the arrays went), then the arrays rebuilt from them.
        for ((n, a), (_, b)) in all_matrices(&alone.weights).into_iter().zip(all_matrices(&both.weights)) {
            assert_eq!(
                to_f32(a).iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                to_f32(b).iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{tag}: {n}: rows"
            );
            match (a.layout(), b.layout()) {
                (
                    WeightLayout::Affine4 { group_size: ga, packed: pa, scales: sa, biases: ba },
                    WeightLayout::Affine4 { group_size: gb, packed: pb, scales: sb, biases: bb },
                ) => {
                    assert_eq!((ga, pa), (gb, pb), "{tag}: {n}: codes");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!((bits(sa), bits(ba)), (bits(sb), bits(bb)), "{tag}: {n}: scales and biases");
                }
                (WeightLayout::Affine4 { .. }, _) | (_, WeightLayout::Affine4 { .. }) => {
                    panic!("{tag}: {n}: layouts differ")
                }
                _ => {}
            }
        }
    }
}

/// Tiles built on first use inside parallel products (the forward pass without a CPU backend
/// to build them first, as the GPU checks' CPU reference runs it), on more workers than cores:
/// every product finishes, with the ids of a backend that built them up front.
#[test]
fn layouts_built_inside_parallel_products_finish() {
    use megagemma_model::cpu::{forward::forward_chunk, kv::KvCache, ops::argmax};
    let dir = dense_fixtures().into_iter().find(|d| name(d) == "sliding_wrap").unwrap();
    let p = prompt(&dir);
    let want: Vec<u32> =
        greedy(Arc::new(Model::load_with(&dir, QuantMode::Q4).unwrap()), &p, 4).into_iter().map(|(id, _)| id).collect();
    // On its own thread, so that a deadlock fails the test instead of hanging it.
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(16).build().unwrap();
        for round in 0..4 {
            let model = Model::load_with(&dir, QuantMode::Q4).unwrap();
            let got = pool.install(|| {
                let (mut kv, mut input, mut ids) = (KvCache::new(&model.plan), p.clone(), vec![]);
                for _ in 0..4 {
                    let out = forward_chunk(&model.plan, &model.weights, &mut kv, &input, 1);
                    kv.commit(input.len()).unwrap();
                    ids.push(argmax(&out.logits));
                    input = vec![*ids.last().unwrap()];
                }
                ids
            });
            done.send((round, got)).unwrap();
        }
    });
    for round in 0..4 {
        let got = finished.recv_timeout(std::time::Duration::from_secs(60));
        assert_eq!(got, Ok((round, want.clone())), "round {round} (a timeout: the products deadlocked)");
    }
}
