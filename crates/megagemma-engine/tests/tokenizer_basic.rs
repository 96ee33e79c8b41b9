//! Tokenizer wrapper and StreamDecoder on a tiny Gemma-shaped tokenizer (no download needed).

use megagemma_engine::chat_template::{encode_chat, ChatMessage, ChatTemplate};
use megagemma_engine::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};

const SPECIALS: [&str; 6] = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>"];

/// Same pipeline as Gemma's tokenizer.json: spaces → "▁", BPE with byte fallback, BOS post-processor.
fn tiny_tokenizer() -> Tokenizer {
    let mut vocab = Map::new();
    let mut add = |token: String| {
        let id = vocab.len();
        vocab.entry(token).or_insert(Value::from(id));
    };
    SPECIALS.iter().for_each(|s| add(s.to_string()));
    (0..=255u32).for_each(|b| add(format!("<0x{b:02X}>")));
    "abcdefghijklmnopqrstuvwxyz▁é\n".chars().for_each(|c| add(c.to_string()));
    let merges = ["h e", "l l", "he ll", "hell o", "▁ w", "o r", "▁w or", "▁wor l", "▁worl d"];
    merges.iter().for_each(|m| add(m.replace(' ', "")));

    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<bos>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<bos>": {"id": "<bos>", "ids": [2], "tokens": ["<bos>"]}}
        },
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    });
    Tokenizer::from_json_bytes(spec.to_string().as_bytes()).unwrap()
}

#[test]
fn encode_decode_round_trip_with_bos() {
    let tok = tiny_tokenizer();
    let ids = tok.encode("hello world", true).unwrap();
    assert_eq!(ids[0], 2, "post-processor adds <bos>");
    assert_eq!(tok.id_to_token(ids[1]).as_deref(), Some("hello"));
    assert_eq!(tok.decode(&ids, true).unwrap(), "hello world");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<bos>hello world");
    assert_eq!(tok.encode("hello world", false).unwrap(), ids[1..]);
    assert_eq!(tok.token_to_id("<turn|>"), Some(5));
    assert!(tok.is_special(5) && !tok.is_special(ids[1]));
}

#[test]
fn unknown_characters_fall_back_to_bytes() {
    let tok = tiny_tokenizer();
    let ids = tok.encode("€", false).unwrap();
    let tokens: Vec<String> = ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect();
    assert_eq!(tokens, ["<0xE2>", "<0x82>", "<0xAC>"]);
    assert_eq!(tok.decode(&ids, false).unwrap(), "€");
}

#[test]
fn stream_decoder_holds_back_partial_utf8() {
    let tok = tiny_tokenizer();
    let ids = tok.encode("€", false).unwrap();
    let mut stream = tok.stream_decoder(false);
    assert_eq!(stream.step(ids[0]).unwrap(), None);
    assert_eq!(stream.step(ids[1]).unwrap(), None);
    assert_eq!(stream.step(ids[2]).unwrap().as_deref(), Some("€"));
    assert_eq!(stream.flush().unwrap(), None);
}

#[test]
fn stream_decoder_concatenation_equals_full_decode() {
    let tok = tiny_tokenizer();
    let text = "hello wörld 😀 héllo\n\n  world €€ zz";
    let ids = tok.encode(text, true).unwrap();
    for skip_special in [false, true] {
        let mut stream = tok.stream_decoder(skip_special);
        let mut pieces = Vec::new();
        for &id in &ids {
            if let Some(piece) = stream.step(id).unwrap() {
                assert!(!piece.contains('\u{FFFD}'), "replacement char in piece {piece:?}");
                pieces.push(piece);
            }
        }
        pieces.extend(stream.flush().unwrap());
        assert_eq!(pieces.concat(), tok.decode(&ids, skip_special).unwrap());
    }
}

#[test]
fn stream_decoder_flush_returns_unfinished_bytes() {
    let tok = tiny_tokenizer();
    let ids = tok.encode("€", false).unwrap();
    let mut stream = tok.stream_decoder(false);
    assert_eq!(stream.step(ids[0]).unwrap(), None);
    let rest = stream.flush().unwrap().unwrap();
    assert!(rest.contains('\u{FFFD}'), "{rest:?}");
}

#[test]
fn encode_chat_never_doubles_bos() {
    let tok = tiny_tokenizer();
    let messages = [ChatMessage::user("hello")];

    // Template emits "<bos>" itself: the tokenizer must not add another.
    let gemma = ChatTemplate::gemma4();
    let rendered = gemma.render(&messages, true).unwrap();
    assert_eq!(&tok.encode(&rendered, true).unwrap()[..2], [2, 2], "naive encoding doubles BOS");
    let ids = encode_chat(&tok, &gemma, &messages).unwrap();
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
    assert_eq!(ids[..2], [2, 4], "<bos><|turn>");

    // Template without BOS: the tokenizer's post-processor supplies it.
    let plain =
        ChatTemplate::from_template("{% for m in messages %}{{ m.content }}{% endfor %}", "<bos>", "<eos>").unwrap();
    let ids = encode_chat(&tok, &plain, &messages).unwrap();
    assert_eq!(ids[0], 2);
    assert_eq!(ids.iter().filter(|&&id| id == 2).count(), 1);
}

#[test]
fn errors_are_one_clear_line() {
    let dir = std::env::temp_dir().join(format!("megagemma-tok-missing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = Tokenizer::from_model_dir(&dir).unwrap_err().to_string();
    assert_eq!(err, format!("tokenizer.json not found in {}", dir.display()));

    std::fs::write(dir.join("tokenizer.json"), "{broken").unwrap();
    let err = Tokenizer::from_model_dir(&dir).unwrap_err().to_string();
    assert!(err.starts_with("failed to load tokenizer") && !err.contains('\n'), "{err}");

    let tok = tiny_tokenizer();
    let err = tok.decode(&[1, 999_999], false).unwrap_err().to_string();
    assert!(err.contains("999999") && err.contains("out of range"), "{err}");
}
