//! The tokenizer built from GGUF metadata (`gguf_tokenizer`) against the official Gemma 3
//! `tokenizer.json`.
//!
//! Real-file tests use the Gemma 3 270M GGUF (`megagemma pull gemma3-270m`, pulled on first use
//! into the repository's ignored `.cache/megagemma`, see `tests/support/pulled_gguf.rs`); the
//! official tokenizer is fetched by `tools/fetch_gemma_tokenizer.sh` (pinned, sha256-checked).
//! Both fail loudly without network. Synthetic tests (tiny GGUF files written here) always run.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use megagemma_engine::gguf_tokenizer::{tokenizer_from_gguf, tokenizer_from_gguf_path};
use megagemma_engine::tokenizer::Tokenizer;
use megagemma_model::gguf::GgufFile;

mod common;
use common::{official_gemma_tokenizer, repo_root};

#[path = "../../../tests/support/pulled_gguf.rs"]
mod pulled_gguf;

/// Both tokenizers (the GGUF-built one and the official one).
fn tokenizers() -> &'static (Tokenizer, Tokenizer) {
    static PAIR: OnceLock<(Tokenizer, Tokenizer)> = OnceLock::new();
    PAIR.get_or_init(|| {
        let file = GgufFile::open(pulled_gguf::gemma3_270m_gguf()).unwrap();
        (tokenizer_from_gguf(&file).unwrap(), official_gemma_tokenizer())
    })
}

/// Lines beyond the shared multilingual sample: more whitespace, markup and mixed-script cases.
const EXTRA: &[&str] = &[
    // Whitespace runs around the user-defined "\n"/"\t"/"▁▁" pieces (up to 31 long and beyond).
    "a\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\nb",
    "x                                    y\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\t\tz",
    " \t \n \r\n\u{a0}\u{3000}mixed\u{2009}whitespace \u{2581}marker▁▁in text",
    "def f(x):\n    if x:\n        return [i ** 2 for i in range(10)]\n    return None\n",
    "<table><tr><td>cell</td></tr></table> <h1>Title</h1> <b>bold</b> [multimodal] <mask>",
    "Literal specials mid-text: foo<start_of_turn>bar<end_of_turn>baz <bos><eos><pad><unk>",
    "https://example.com/path?query=1&x=%20y#frag user@example.org C:\\Windows\\System32",
    "ÀÉÎÕÜ àéîõü ñ ç ß ø å æ œ ſ ﬁ ﬂ Å Ω µ K",
    "Tiếng Việt có dấu. Türkçe çok güzel. Polski: zażółć gęślą jaźń.",
    "עברית: שלום עולם. ไทย: สวัสดีชาวโลก. ქართული ენა.",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^n i = n(n+1)/2; α→β ⇒ γ",
    "",
    " ",
    "\n",
];

/// The shared multilingual sample followed by [`EXTRA`].
fn sample() -> Vec<&'static str> {
    common::MULTILINGUAL.iter().chain(EXTRA).copied().collect()
}

const CHAT_PROMPT: &str = "<bos><start_of_turn>user\nYou are concise.\n\nBonjour ! Écris un haïku sur la mer, \
    puis traduis-le en 日本語.<end_of_turn>\n<start_of_turn>model\nLa mer scintille,<end_of_turn>\n\
    <start_of_turn>user\nMerci ! Now in English:\n\n  - keep the indent\n\t- and tabs<end_of_turn>\n\
    <start_of_turn>model\n";

fn lines() -> Vec<String> {
    let mut lines: Vec<String> = sample().iter().map(|s| s.to_string()).collect();
    lines.push(sample().join("\n"));
    lines.push(CHAT_PROMPT.to_string());
    lines
}

#[derive(Default)]
struct Agreement {
    lines: usize,
    lines_same: usize,
    tokens: usize,
    tokens_same: usize,
    first_diffs: Vec<String>,
}

impl Agreement {
    fn compare(&mut self, gguf: &Tokenizer, official: &Tokenizer, text: &str, add_special: bool) {
        let got = gguf.encode(text, add_special).unwrap();
        let want = official.encode(text, add_special).unwrap();
        self.lines += 1;
        self.tokens += want.len();
        self.tokens_same += got.iter().zip(&want).filter(|(a, b)| a == b).count();
        if got == want {
            self.lines_same += 1;
        } else if self.first_diffs.len() < 5 {
            let at = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let window = |ids: &[u32]| {
                let ids = &ids[at.saturating_sub(3)..(at + 4).min(ids.len())];
                format!("{ids:?} {:?}", official.decode(ids, false).unwrap_or_default())
            };
            self.first_diffs.push(format!(
                "{:?}...: first difference at token {at}: gguf {} vs official {}",
                text.chars().take(40).collect::<String>(),
                window(&got),
                window(&want)
            ));
        }
    }

    fn report(&self, what: &str) {
        println!(
            "{what}: {}/{} lines identical, {}/{} tokens identical (position-wise)",
            self.lines_same, self.lines, self.tokens_same, self.tokens
        );
        for d in &self.first_diffs {
            println!("  differs: {d}");
        }
    }

    fn assert_all_same(&self, what: &str) {
        self.report(what);
        assert_eq!(
            (self.lines_same, self.tokens_same),
            (self.lines, self.tokens),
            "{what}: GGUF tokenizer disagrees with the official tokenizer.json"
        );
    }
}

#[test]
fn agreement_on_multilingual_sample_and_chat_prompt() {
    let (gguf, official) = tokenizers();
    let mut agreement = Agreement::default();
    for line in lines() {
        for add_special in [false, true] {
            agreement.compare(gguf, official, &line, add_special);
        }
    }
    agreement.assert_all_same("multilingual sample + chat prompt");

    let ids = gguf.encode(CHAT_PROMPT, false).unwrap();
    assert_eq!(ids[..3], [2, 105, 2364], "<bos><start_of_turn>user");
    assert_eq!(ids.iter().filter(|&&id| id == 105).count(), 4);
    assert_eq!(ids.iter().filter(|&&id| id == 106).count(), 3);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
}

/// Broader coverage: the repository's own sources and docs (code, markdown, indentation), and
/// a sweep over every 7th vocabulary piece as text on its own and glued to its neighbours.
#[test]
fn agreement_on_repo_sources_and_vocab_sweep() {
    let (gguf, official) = tokenizers();
    let mut files = Vec::new();
    collect_files(&repo_root().join("crates"), &mut files);
    collect_files(&repo_root().join("docs"), &mut files);
    files.sort();
    // The official file has one added token the GGUF lacks: <image_soft_token> (id 262 144, past
    // the model's 262 144 embedding rows). Texts spelling it out are compared without it.
    const IMAGE_SOFT: &str = "<image_soft_token>";
    let mut sources = Agreement::default();
    let mut with_image_soft = 0;
    for file in &files {
        if let Ok(text) = std::fs::read_to_string(file) {
            if text.contains(IMAGE_SOFT) {
                with_image_soft += 1;
                assert!(official.encode(&text, false).unwrap().contains(&262_144));
                assert!(!gguf.encode(&text, false).unwrap().contains(&262_144));
            }
            sources.compare(gguf, official, &text.replace(IMAGE_SOFT, ""), false);
        }
    }
    assert!(sources.lines >= 10, "found only {} source files", sources.lines);
    println!("({with_image_soft} files compared without their literal {IMAGE_SOFT})");
    sources.assert_all_same("repository sources (whole files)");

    let mut sweep = Agreement::default();
    let n = official.vocab_size() as u32;
    let text_of = |id: u32| official.decode(&[id], false).unwrap();
    for id in (0..n).step_by(7) {
        let piece = text_of(id);
        sweep.compare(gguf, official, &piece, false);
        let glued = format!("{piece}{}{}", text_of((id + 1) % n), text_of((id * 31 + 5) % n));
        sweep.compare(gguf, official, &glued, false);
    }
    sweep.assert_all_same("vocabulary sweep");
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_files(&path, out);
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("rs" | "md" | "toml")) {
            out.push(path);
        }
    }
}

#[test]
fn vocab_size_special_ids_and_decode() {
    let (gguf, official) = tokenizers();
    assert_eq!(gguf.vocab_size(), 262_144);
    for (id, name) in
        [(0, "<pad>"), (1, "<eos>"), (2, "<bos>"), (3, "<unk>"), (105, "<start_of_turn>"), (106, "<end_of_turn>")]
    {
        assert_eq!(gguf.token_to_id(name), Some(id), "{name}");
        assert_eq!(gguf.id_to_token(id).as_deref(), Some(name));
        assert!(gguf.is_special(id), "{name} must be special");
        assert_eq!(gguf.encode(name, false).unwrap(), [id], "{name} is one token");
    }
    assert!(!gguf.is_special(gguf.token_to_id("▁the").unwrap()));
    // The GGUF cannot say which added tokens the official file flags special; control tokens
    // (type 3) are special here, as in llama.cpp. Documented differences from the official file:
    // <mask> (4) and the 6242 <unusedN> (6..=104, 256001..) are special here only; <start_of_image> (255999)
    // and <end_of_image> (256000) are user-defined in the GGUF, so special there only.
    for (id, here, there) in [(4, true, false), (6, true, false), (255_999, false, true), (256_000, false, true)] {
        assert_eq!((gguf.is_special(id), official.is_special(id)), (here, there), "id {id}");
    }
    // Either way every added token is matched whole when encoding.
    for id in [4, 6, 168, 255_968, 255_999, 256_000, 262_143] {
        let piece = official.id_to_token(id).unwrap();
        assert_eq!(gguf.encode(&piece, false).unwrap(), [id], "{piece:?}");
    }
    assert_eq!(gguf.encode("hi", true).unwrap()[0], 2, "add_bos_token prepends <bos>");
    // Pieces the GGUF spells with real spaces are "▁" runs, as in the official vocabulary.
    assert_eq!(gguf.token_to_id("▁▁"), Some(138));
    assert_eq!(gguf.token_to_id("  "), None);
    // Every id maps to the same piece as in the official file.
    for id in 0..262_144u32 {
        assert_eq!(gguf.id_to_token(id), official.id_to_token(id), "id {id}");
    }

    for line in lines() {
        let ids = official.encode(&line, true).unwrap();
        assert_eq!(gguf.decode(&ids, false).unwrap(), official.decode(&ids, false).unwrap(), "decode of {line:?}");
        // Special flags differ for <mask> (see below), which decode(.., true) drops here.
        if !line.contains("<mask>") {
            assert_eq!(
                gguf.decode(&ids, true).unwrap(),
                official.decode(&ids, true).unwrap(),
                "decode (skip special) of {line:?}"
            );
        }
        // A literal "▁" in the input decodes as a space (the official tokenizer does the same).
        let own = gguf.encode(&line, false).unwrap();
        assert_eq!(gguf.decode(&own, false).unwrap(), line.replace('▁', " "), "round trip of {line:?}");
    }

    // Streaming detokenization (byte-fallback pieces held back) agrees with a full decode.
    let ids = gguf.encode(&sample().join("\n"), true).unwrap();
    for skip_special in [false, true] {
        let mut stream = gguf.stream_decoder(skip_special);
        let mut text = String::new();
        for &id in &ids {
            text.extend(stream.step(id).unwrap());
        }
        text.extend(stream.flush().unwrap());
        assert_eq!(text, gguf.decode(&ids, skip_special).unwrap());
    }
    assert_eq!(gguf.decode(&ids, false).unwrap(), official.decode(&ids, false).unwrap());
}

#[test]
fn one_megabyte_sample_encodes_identically() {
    let (gguf, official) = tokenizers();
    let sample = sample().join("\n") + "\n";
    let text = sample.repeat((1 << 20) / sample.len() + 1);
    let ids = gguf.encode(&text, false).unwrap();
    assert!(ids == official.encode(&text, false).unwrap(), "1 MB sample encodes differently");
}

// ------------------------------------------------------------------ synthetic GGUF files

/// Little-endian GGUF builder (metadata only, no tensors).
#[derive(Default)]
struct W(Vec<u8>, u64);

impl W {
    fn new() -> Self {
        let mut w = W::default();
        w.0.extend(b"GGUF");
        w.u32(3).u64(0).u64(0); // version, tensor count, metadata count (patched in finish)
        w
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend(s.as_bytes());
        self
    }
    fn key(&mut self, k: &str, ty: u32) -> &mut Self {
        self.1 += 1;
        self.str(k).u32(ty)
    }
    fn kv_str(&mut self, k: &str, v: &str) -> &mut Self {
        self.key(k, 8).str(v)
    }
    fn kv_u32(&mut self, k: &str, v: u32) -> &mut Self {
        self.key(k, 4).u32(v)
    }
    fn kv_bool(&mut self, k: &str, v: bool) -> &mut Self {
        self.key(k, 7);
        self.0.push(v as u8);
        self
    }
    fn kv_strs(&mut self, k: &str, v: &[String]) -> &mut Self {
        self.key(k, 9).u32(8).u64(v.len() as u64);
        for s in v {
            self.str(s);
        }
        self
    }
    fn kv_f32s(&mut self, k: &str, v: &[f32]) -> &mut Self {
        self.key(k, 9).u32(6).u64(v.len() as u64);
        for x in v {
            self.0.extend(x.to_le_bytes());
        }
        self
    }
    fn kv_i32s(&mut self, k: &str, v: &[i32]) -> &mut Self {
        self.key(k, 9).u32(5).u64(v.len() as u64);
        for x in v {
            self.0.extend(x.to_le_bytes());
        }
        self
    }
    fn finish(&mut self) -> Vec<u8> {
        let n = self.1;
        self.0[16..24].copy_from_slice(&n.to_le_bytes());
        let len = self.0.len().next_multiple_of(32);
        self.0.resize(len, 0);
        self.0.clone()
    }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Writes `bytes` to a temp file and opens it (the file is removed right away).
fn open_bytes(bytes: &[u8]) -> GgufFile {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("megagemma_tok_gguf_{}_{n}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let file = GgufFile::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    file
}

/// A tiny SentencePiece-style vocabulary: 4 control tokens, `<start_of_turn>`, 256 byte pieces,
/// a few normal pieces, and a user-defined run of two spaces written with real spaces.
fn tiny_vocab() -> (Vec<String>, Vec<f32>, Vec<i32>) {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"].map(String::from).to_vec();
    let mut types = vec![3; 5];
    let mut scores = vec![-1000.0; 5];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (k, piece) in ["▁", "h", "e", "l", "o", "he", "ll", "hell", "hello", "▁hello"].into_iter().enumerate() {
        tokens.push(piece.to_string());
        types.push(1);
        scores.push(-(k as f32));
    }
    tokens.push("  ".to_string());
    types.push(4);
    scores.push(-1000.0);
    (tokens, scores, types)
}

fn tiny_gguf(model: Option<&str>, with_scores: bool) -> Vec<u8> {
    let (tokens, scores, types) = tiny_vocab();
    let mut w = W::new();
    w.kv_str("general.architecture", "gemma3");
    if let Some(model) = model {
        w.kv_str("tokenizer.ggml.model", model);
    }
    w.kv_strs("tokenizer.ggml.tokens", &tokens);
    if with_scores {
        w.kv_f32s("tokenizer.ggml.scores", &scores);
    }
    w.kv_i32s("tokenizer.ggml.token_type", &types)
        .kv_u32("tokenizer.ggml.bos_token_id", 2)
        .kv_u32("tokenizer.ggml.eos_token_id", 1)
        .kv_u32("tokenizer.ggml.unknown_token_id", 3)
        .kv_u32("tokenizer.ggml.padding_token_id", 0)
        .kv_bool("tokenizer.ggml.add_bos_token", true)
        .kv_bool("tokenizer.ggml.add_space_prefix", false);
    w.finish()
}

#[test]
fn tiny_gguf_vocabulary_tokenizes() {
    let tok = tokenizer_from_gguf(&open_bytes(&tiny_gguf(Some("llama"), true))).unwrap();
    let id = |piece: &str| tok.token_to_id(piece).unwrap();
    let byte = |b: u8| 5 + b as u32;
    assert_eq!(tok.vocab_size(), 5 + 256 + 10 + 1);
    assert_eq!(tok.encode("hello hello", false).unwrap(), [id("hello"), id("▁hello")]);
    assert_eq!(tok.encode("hello", true).unwrap(), [2, id("hello")], "add_bos_token");
    // Byte fallback for pieces missing from the vocabulary; <start_of_turn> matched whole.
    assert_eq!(tok.encode("<start_of_turn>hé", false).unwrap(), [4, id("h"), byte(0xC3), byte(0xA9)]);
    assert!(tok.is_special(4) && tok.is_special(2) && !tok.is_special(id("hello")));
    // The user-defined "  " is the piece "▁▁", reached by the merge ▁ + ▁.
    assert_eq!(tok.id_to_token(271).as_deref(), Some("▁▁"));
    assert_eq!(tok.encode("  ", false).unwrap(), [271]);
    for text in ["hello hello", "<start_of_turn>hé  lo\n", "  x  "] {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), format!("<bos>{text}"));
        assert_eq!(tok.decode(&ids, true).unwrap(), text.replace("<start_of_turn>", ""));
    }
}

fn build_err(bytes: &[u8]) -> String {
    match tokenizer_from_gguf(&open_bytes(bytes)) {
        Ok(_) => panic!("tokenizer built from GGUF that should be rejected"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn gguf_without_tokenizer_metadata_is_a_clear_error() {
    let mut w = W::new();
    w.kv_str("general.architecture", "gemma3");
    let bytes = w.finish();
    let msg = build_err(&bytes);
    assert!(msg.contains("no tokenizer metadata") && msg.contains("tokenizer.json"), "{msg}");

    // Through the path-based entry point the message names the file.
    let path = std::env::temp_dir().join(format!("megagemma_tok_gguf_{}_bare.gguf", std::process::id()));
    std::fs::write(&path, &bytes).unwrap();
    let msg = tokenizer_from_gguf_path(&path).unwrap_err().to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(msg.contains("_bare.gguf") && msg.contains("no tokenizer metadata"), "{msg}");

    let msg = build_err(&tiny_gguf(Some("gpt2"), true));
    assert!(msg.contains("unsupported") && msg.contains("gpt2"), "{msg}");
    let msg = build_err(&tiny_gguf(None, true));
    assert!(msg.contains("tokenizer.ggml.model"), "{msg}");
    let msg = build_err(&tiny_gguf(Some("llama"), false));
    assert!(msg.contains("tokenizer.ggml.scores"), "{msg}");
}
