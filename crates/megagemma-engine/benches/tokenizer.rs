//! Tokenizer speed on 1 MB of multilingual text: `cargo bench -p megagemma-engine --bench tokenizer`.
//! Uses the official Gemma tokenizer (fetched like the tests do) and, when `MEGAGEMMA_TEST_GGUF`
//! names a GGUF file, the tokenizer rebuilt from its metadata. Prints timings; asserts nothing.

use std::time::Instant;

use megagemma_engine::gguf_tokenizer::tokenizer_from_gguf_path;
use megagemma_engine::tokenizer::Tokenizer;

#[path = "../tests/common/mod.rs"]
mod common;

fn measure(name: &str, tok: &Tokenizer, text: &str) {
    let start = Instant::now();
    let ids = tok.encode(text, false).unwrap();
    let encode_s = start.elapsed().as_secs_f64();
    let start = Instant::now();
    let decoded = tok.decode(&ids, false).unwrap();
    let decode_s = start.elapsed().as_secs_f64();
    assert_eq!(decoded.len(), text.len());
    println!(
        "{name}: encoded {:.2} MB into {} tokens in {encode_s:.3}s = {:.0} tokens/s ({:.2} MB/s); decode {:.0} tokens/s",
        text.len() as f64 / 1e6,
        ids.len(),
        ids.len() as f64 / encode_s,
        text.len() as f64 / 1e6 / encode_s,
        ids.len() as f64 / decode_s,
    );
}

fn main() {
    let sample = common::MULTILINGUAL.join("\n") + "\n";
    let text = sample.repeat((1 << 20) / sample.len() + 1);
    measure("official tokenizer.json", &common::official_gemma_tokenizer(), &text);
    if let Some(path) = std::env::var_os("MEGAGEMMA_TEST_GGUF") {
        let start = Instant::now();
        let tok = tokenizer_from_gguf_path(&path).unwrap();
        println!("built the GGUF tokenizer in {:.2}s", start.elapsed().as_secs_f64());
        measure("GGUF tokenizer", &tok, &text);
    }
}
