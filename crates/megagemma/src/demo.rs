//! The bundled demo model (a tiny Gemma 4 with random weights, `models/demo`), embedded in the
//! binary so that an installed or copied `megagemma` runs it from anywhere. On first use its
//! files are written to the cache (`$MEGAGEMMA_CACHE/demo-HASH`, see `pull::cache_dir`), named
//! by the content hash so that a different build never reads another build's copy.

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

const FILES: [(&str, &[u8]); 6] = [
    ("config.json", include_bytes!("../../../models/demo/config.json")),
    ("generation_config.json", include_bytes!("../../../models/demo/generation_config.json")),
    ("tokenizer.json", include_bytes!("../../../models/demo/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../../../models/demo/tokenizer_config.json")),
    ("chat_template.jinja", include_bytes!("../../../models/demo/chat_template.jinja")),
    ("model.safetensors", include_bytes!("../../../models/demo/model.safetensors")),
];

/// The demo model's directory, written to the cache when missing.
pub fn demo_model_dir() -> Result<PathBuf> {
    let mut hasher = Sha256::new();
    for (name, bytes) in FILES {
        hasher.update(name.as_bytes());
        hasher.update(bytes);
    }
    let hash = format!("{:x}", hasher.finalize());
    let dir = megagemma_engine::pull::cache_dir()?.join(format!("demo-{}", &hash[..16]));
    let complete = |d: &PathBuf| {
        FILES.iter().all(|(name, bytes)| std::fs::metadata(d.join(name)).is_ok_and(|m| m.len() == bytes.len() as u64))
    };
    if complete(&dir) {
        return Ok(dir);
    }
    // Written next to the target and renamed into place, so a concurrent or interrupted run never
    // leaves a directory with missing or partial files.
    let parent = dir.parent().context("the cache directory has no parent")?;
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let tmp = parent.join(format!("demo-{}.partial-{}", &hash[..16], std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    for (name, bytes) in FILES {
        std::fs::write(tmp.join(name), bytes)
            .with_context(|| format!("cannot write the demo model to {}", tmp.display()))?;
    }
    // Another run may have put a complete copy in place meanwhile; an incomplete one is replaced.
    if std::fs::rename(&tmp, &dir).is_err() && !complete(&dir) {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).with_context(|| format!("cannot move the demo model into {}", dir.display()))?;
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(dir)
}
