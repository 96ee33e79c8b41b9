//! What each fuzz target does with one input, shared by the cargo-fuzz targets (nightly,
//! coverage-guided) and the stable mutation test in `cargo test`. Every function feeds the bytes
//! to megagemma's loaders the way a user's files reach them and returns normally whatever the
//! bytes are; a panic, abort, huge allocation or hang is the bug being looked for.
//!
//! Multi-part inputs join their parts with a NUL byte (see `fuzz/make_seeds.py`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use megagemma_engine::chat_template::ChatTemplate;
use megagemma_engine::gguf_tokenizer::{gguf_has_tokenizer, tokenizer_from_gguf};
use megagemma_engine::sampling::read_generation_config;
use megagemma_model::checkpoint::Checkpoint;
use megagemma_model::config::ModelConfig;
use megagemma_model::cpu::CpuBackend;
use megagemma_model::gguf::GgufFile;
use megagemma_model::plan::ModelPlan;
use megagemma_model::quant::load::MlxQuantConfig;
use megagemma_model::{Backend, Model, Want};

/// Zero-filled tensor data is capped here: a header asking for more gets a truncated file.
const MAX_DATA_BYTES: u64 = 4 << 20;

/// A scratch directory private to this process and thread, emptied for each input.
pub fn scratch() -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!("megagemma-fuzz-{}-{:?}", std::process::id(), std::thread::current().id()))
        .join("model");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("cannot create the scratch directory");
    dir
}

/// The NUL-separated parts of an input (at most `n`; the last keeps any further NULs).
pub fn parts(data: &[u8], n: usize) -> Vec<&[u8]> {
    data.splitn(n, |&b| b == 0).collect()
}

/// A safetensors file: `header` behind its length, then zeros up to the largest end offset the
/// header names (capped), so that parsing gets past the bounds checks.
pub fn safetensors_file(header: &[u8]) -> Vec<u8> {
    let end = serde_json::from_slice::<serde_json::Value>(header)
        .ok()
        .and_then(|v| {
            v.as_object().map(|o| o.values().filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64()).max().unwrap_or(0))
        })
        .unwrap_or(0)
        .min(MAX_DATA_BYTES) as usize;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.resize(file.len() + end, 0);
    file
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).expect("cannot write to the scratch directory");
}

/// Runs two tokens through a loaded model (a forward pass touches every size the config gave).
fn forward(model: Model) {
    let vocab = model.plan.vocab_size as u32;
    let mut backend = CpuBackend::new(Arc::new(model));
    let Ok(seq) = backend.new_sequence() else { return };
    if backend.prefill(seq, &[0, 1 % vocab], Want::Argmax).is_ok() {
        let _ = backend.decode(seq, 2 % vocab, Want::Argmax);
    }
}

/// `config.json NUL generation_config.json NUL tokenizer_config.json`: the typed config, its
/// layer plan and MLX `quantization` entry, the generation defaults and the chat template.
pub fn config(data: &[u8]) {
    let p = parts(data, 3);
    if let Ok(json) = serde_json::from_slice::<serde_json::Value>(p[0]) {
        if let Ok(cfg) = ModelConfig::from_json(&json) {
            let _ = ModelPlan::new(&cfg);
            if let Some(q) = &cfg.quantization {
                let _ = MlxQuantConfig::from_json(q);
            }
        }
    }
    let dir = scratch();
    for (part, name) in p.iter().zip(["config.json", "generation_config.json", "tokenizer_config.json"]) {
        write(&dir.join(name), part);
    }
    let _ = read_generation_config(&dir);
    let _ = ChatTemplate::from_model_dir(&dir);
}

/// `safetensors header [NUL model.safetensors.index.json]`: one shard (or the index naming it)
/// opened as a checkpoint, every tensor converted.
pub fn safetensors(data: &[u8]) {
    let p = parts(data, 2);
    let dir = scratch();
    let shard = if p.len() == 2 { "model-00001-of-00001.safetensors" } else { "model.safetensors" };
    write(&dir.join(shard), &safetensors_file(p[0]));
    if let Some(index) = p.get(1) {
        write(&dir.join("model.safetensors.index.json"), index);
    }
    let Ok(ck) = Checkpoint::open(&dir) else { return };
    let names: Vec<String> = ck.names().map(String::from).collect();
    for name in names {
        if let Some(t) = ck.get(&name) {
            let _ = t.to_f32_vec();
            let _ = t.to_u32_vec();
        }
    }
}

/// `config.json NUL safetensors header`: the whole directory loaded as a model, then run.
pub fn load_dir(data: &[u8]) {
    let p = parts(data, 2);
    let dir = scratch();
    write(&dir.join("config.json"), p[0]);
    write(&dir.join("model.safetensors"), &safetensors_file(p.get(1).copied().unwrap_or_default()));
    if let Ok(model) = Model::load(&dir) {
        forward(model);
    }
}

/// A GGUF file: container, config, weights and tokenizer from its metadata, then run.
pub fn gguf(data: &[u8]) {
    let path = scratch().join("model.gguf");
    write(&path, data);
    if let Ok(file) = GgufFile::open(&path) {
        if gguf_has_tokenizer(&file) {
            let _ = tokenizer_from_gguf(&file);
        }
    }
    if let Ok(model) = Model::load_gguf(&path) {
        forward(model);
    }
}
