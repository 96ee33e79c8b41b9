//! Fixture copies for thinking-mode tests: the fixtures' tokenizers have no thought-channel
//! tokens, so [`thought_fixture`] renames two vocabulary entries that a fixture's greedy answer
//! contains to `<|channel>` / `<channel|>`: the ids the model emits are unchanged, and the text
//! must split where they fall.
#![allow(dead_code)]

use crate::common::fixtures_dir;
use crate::http::TestServer;
use megagemma_engine::tokenizer::Tokenizer;
use megagemma_server::ServerConfig;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub fn scratch_copy(fixture: &str, tag: &str, files: &[&str]) -> PathBuf {
    let src = fixtures_dir().join(fixture);
    let dst = std::env::temp_dir().join(format!("megagemma-thinking-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if files.is_empty() || files.contains(&name.as_str()) {
            std::fs::copy(&p, dst.join(&name)).unwrap();
        }
    }
    dst
}

pub fn server(dir: &Path) -> TestServer {
    TestServer::start_dir(dir, ServerConfig { model_name: "m".into(), ..Default::default() }, None)
}

pub const MESSAGES: &str = r#"[{"role": "user", "content": "the cat sat"}]"#;

pub fn chat_request(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": serde_json::from_str::<Value>(MESSAGES).unwrap(),
        "max_tokens": 24, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Vocabulary strings that take part in no merge (renaming them leaves the BPE valid).
pub fn unmerged(tokenizer_json: &Value) -> HashSet<String> {
    let mut merged = HashSet::new();
    for m in tokenizer_json["model"]["merges"].as_array().unwrap() {
        let (a, b) = match m {
            Value::String(s) => {
                let (a, b) = s.split_once(' ').unwrap();
                (a.to_string(), b.to_string())
            }
            Value::Array(p) => (p[0].as_str().unwrap().to_string(), p[1].as_str().unwrap().to_string()),
            _ => panic!("unexpected merge {m}"),
        };
        merged.insert(format!("{a}{b}"));
        merged.insert(a);
        merged.insert(b);
    }
    tokenizer_json["model"]["vocab"].as_object().unwrap().keys().filter(|k| !merged.contains(*k)).cloned().collect()
}

/// Renames vocabulary entry `id` to `content` and declares it a special added token.
pub fn rename_token(tok: &mut Value, id: u64, content: &str) {
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let old = vocab.iter().find(|(_, v)| v.as_u64() == Some(id)).map(|(k, _)| k.clone()).unwrap();
    vocab.remove(&old);
    vocab.insert(content.to_string(), json!(id));
    tok["added_tokens"].as_array_mut().unwrap().push(json!({"id": id, "content": content, "single_word": false,
        "lstrip": false, "rstrip": false, "normalized": false, "special": true}));
}

/// A copy of `fixture` (only `files`, or all) whose tokenizer calls two ids of the greedy answer
/// to the test prompt (with `extra` request fields) `<|channel>` and `<channel|>`; with the
/// answer before the rename and the content and reasoning texts the split must give.
pub struct ThoughtFixture {
    pub dir: PathBuf,
    pub before: Value,
    pub want_content: String,
    pub want_reasoning: String,
}

pub fn thought_fixture(fixture: &str, tag: &str, files: &[&str], extra: &Value) -> ThoughtFixture {
    let d = scratch_copy(fixture, tag, files);
    // The greedy answer's ids with the fixture's own tokenizer.
    let before = {
        let s = server(&d);
        let r = s.post("/v1/chat/completions", &chat_request(extra.clone()));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let ids: Vec<u64> =
        before["choices"][0]["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();

    let tok_path = d.join("tokenizer.json");
    let mut tok: Value = serde_json::from_str(&std::fs::read_to_string(&tok_path).unwrap()).unwrap();
    let added: HashSet<u64> =
        tok["added_tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).collect();
    let free = unmerged(&tok);
    let vocab = tok["model"]["vocab"].as_object().unwrap().clone();
    let usable =
        |id: u64| !added.contains(&id) && vocab.iter().any(|(k, v)| v.as_u64() == Some(id) && free.contains(k));
    let open_at = (1..ids.len()).find(|&i| usable(ids[i])).expect("an answer token to rename to <|channel>");
    let close_at = (open_at + 2..ids.len())
        .find(|&j| usable(ids[j]) && ids[j] != ids[open_at])
        .expect("a later answer token to rename to <channel|>");
    let (open, close) = (ids[open_at], ids[close_at]);
    rename_token(&mut tok, open, "<|channel>");
    rename_token(&mut tok, close, "<channel|>");
    std::fs::write(&tok_path, serde_json::to_string(&tok).unwrap()).unwrap();

    // What the split must be: ids between an opening and a closing marker are thoughts (each
    // stretch decoded on its own), the rest is the answer.
    let tokenizer = Tokenizer::from_model_dir(&d).unwrap();
    assert_eq!(tokenizer.token_to_id("<|channel>"), Some(open as u32));
    let (mut answer, mut thought, mut stretches) = (Vec::new(), Vec::new(), Vec::new());
    let mut inside = false;
    for &id in &ids {
        if id == open {
            inside = true;
        } else if id == close {
            inside = false;
            stretches.push(std::mem::take(&mut thought));
        } else if inside {
            thought.push(id as u32);
        } else {
            answer.push(id as u32);
        }
    }
    stretches.push(thought);
    let want_content = tokenizer.decode(&answer, true).unwrap();
    let want_reasoning: String = stretches.iter().map(|s| tokenizer.decode(s, true).unwrap()).collect();
    assert!(!want_reasoning.is_empty() && !want_content.is_empty(), "the test needs both parts");

    ThoughtFixture { dir: d, before, want_content, want_reasoning }
}
