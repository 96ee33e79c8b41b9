//! The tokenizer built from a `gemma4` GGUF file's metadata (`tokenizer.ggml.model = "gemma4"`:
//! stored BPE merges, pieces spelled with "▁", byte fallback) against the tokenizer.json it was
//! converted from (tests/fixtures-gguf/gemma4/, written by tools/make_gguf4_fixture.py following
//! llama.cpp's converter). Encodings, special tokens and decodings must agree.

use megagemma_engine::gguf_tokenizer::{tokenizer_from_gguf, tokenizer_from_gguf_path};
use megagemma_engine::tokenizer::Tokenizer;
use megagemma_model::gguf::GgufFile;
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures-gguf/gemma4")
}

fn tokenizers() -> (Tokenizer, Tokenizer) {
    let gguf = tokenizer_from_gguf_path(dir().join("ple_shared_dw.gguf")).unwrap();
    let json = Tokenizer::from_model_dir(dir()).unwrap();
    (gguf, json)
}

const TEXTS: &[&str] = &[
    "The keeper climbed the stairs of the lighthouse every evening.",
    "She counted the ships: 10, 20, 24 -- and then again!",
    "  leading spaces,   inner runs\tand tabs\nand new lines\n\n",
    "Ünïcödé falls back to bytes: café, 日本語, ☃ and 🚀.",
    "<|turn>user\nWhat is the light for?<turn|>\n<|turn>model\n",
    "<bos>text after a literal bos<eos>",
    "",
    " ",
    "notebook notebooks Notebook NOTEBOOK",
];

#[test]
fn encodes_like_the_source_tokenizer_json() {
    let (gguf, json) = tokenizers();
    assert_eq!(gguf.vocab_size(), json.vocab_size());
    for text in TEXTS {
        for add_special in [false, true] {
            let got = gguf.encode(text, add_special).unwrap();
            let want = json.encode(text, add_special).unwrap();
            assert_eq!(got, want, "{text:?} (add_special {add_special})");
        }
    }
    // Merges really ran (not a byte-by-byte fallback): a whole word is one piece.
    let ids = gguf.encode(" lighthouse", false).unwrap();
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(gguf.id_to_token(ids[0]).as_deref(), Some("▁lighthouse"));
    assert_eq!(gguf.encode("hi", true).unwrap()[0], 2, "add_bos_token prepends <bos>");
}

#[test]
fn specials_and_decoding_agree() {
    let (gguf, json) = tokenizers();
    for (name, id) in [("<pad>", 0), ("<eos>", 1), ("<bos>", 2), ("<|turn>", 5), ("<turn|>", 6)] {
        assert_eq!(gguf.token_to_id(name), Some(id), "{name}");
        assert!(gguf.is_special(id), "{name} must be special");
        assert_eq!(gguf.encode(name, false).unwrap(), [id], "{name} is one token");
    }
    for text in TEXTS {
        let ids = json.encode(text, true).unwrap();
        for skip in [false, true] {
            assert_eq!(gguf.decode(&ids, skip).unwrap(), json.decode(&ids, skip).unwrap(), "{text:?}");
        }
    }
}

#[test]
fn reads_the_gemma4_vocabulary_metadata() {
    let file = GgufFile::open(dir().join("ple_shared_dw.gguf")).unwrap();
    assert!(tokenizer_from_gguf(&file).is_ok());
    assert!(file.get_str_array("tokenizer.ggml.merges").is_some_and(|m| m.len() == 249));
    assert_eq!(file.get_str("tokenizer.ggml.model"), Some("gemma4"));
}
