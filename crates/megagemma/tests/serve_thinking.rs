//! Thinking mode over the API: `chat_template_kwargs` reaches the chat template, and a chat
//! answer's thought channel (`<|channel>…<channel|>`) comes back as `reasoning_content`, apart
//! from `content` (whole and streamed); `megagemma chat` hides it. The fixtures' tokenizers have
//! no channel tokens, so one test renames two vocabulary entries that the fixture's greedy answer
//! contains to `<|channel>` / `<channel|>`: the ids the model emits are unchanged, and the text
//! must split where they fall.

mod common;
mod http;

use common::*;
use http::*;
use megagemma_engine::tokenizer::Tokenizer;
use megagemma_server::ServerConfig;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn scratch_copy(fixture: &str, tag: &str, files: &[&str]) -> PathBuf {
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

fn server(dir: &Path) -> TestServer {
    TestServer::start_dir(dir, ServerConfig { model_name: "m".into(), ..Default::default() }, None)
}

const MESSAGES: &str = r#"[{"role": "user", "content": "the cat sat"}]"#;

fn request(extra: Value) -> Value {
    let mut body = json!({"model": "m", "messages": serde_json::from_str::<Value>(MESSAGES).unwrap(),
        "max_tokens": 24, "temperature": 0, "ignore_eos": true, "return_token_ids": true});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn chat_template_kwargs_reach_the_template() {
    // A Gemma 4 fixture without a template of its own: the built-in one, whose
    // enable_thinking adds a system turn with `<|think|>`.
    let d = scratch_copy("ple_shared_dw", "kwargs", &["config.json", "model.safetensors", "tokenizer.json"]);
    let s = server(&d);
    let plain = s.post("/v1/chat/completions", &request(json!({})));
    assert_eq!(plain.status, 200, "{}", plain.body);
    let think = s.post("/v1/chat/completions", &request(json!({"chat_template_kwargs": {"enable_thinking": true}})));
    assert_eq!(think.status, 200, "{}", think.body);
    let tokens = |r: &Resp| r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        tokens(&think) > tokens(&plain),
        "enable_thinking should lengthen the prompt: {} vs {}",
        tokens(&think),
        tokens(&plain)
    );
    let off = s.post("/v1/chat/completions", &request(json!({"chat_template_kwargs": {"enable_thinking": false}})));
    assert_eq!(tokens(&off), tokens(&plain));
    for bad in [json!("yes"), json!([1]), json!(3)] {
        let r = s.post("/v1/chat/completions", &request(json!({"chat_template_kwargs": bad})));
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], "chat_template_kwargs", "{}", r.body);
    }
    // The server keeps serving.
    assert_eq!(s.post("/v1/chat/completions", &request(json!({}))).status, 200);
    std::fs::remove_dir_all(&d).unwrap();
}

/// Vocabulary strings that take part in no merge (renaming them leaves the BPE valid).
fn unmerged(tokenizer_json: &Value) -> HashSet<String> {
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
fn rename_token(tok: &mut Value, id: u64, content: &str) {
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
struct ThoughtFixture {
    dir: PathBuf,
    before: Value,
    want_content: String,
    want_reasoning: String,
}

fn thought_fixture(fixture: &str, tag: &str, files: &[&str], extra: &Value) -> ThoughtFixture {
    let d = scratch_copy(fixture, tag, files);
    // The greedy answer's ids with the fixture's own tokenizer.
    let before = {
        let s = server(&d);
        let r = s.post("/v1/chat/completions", &request(extra.clone()));
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

#[test]
fn the_thought_channel_comes_back_as_reasoning_content() {
    let ThoughtFixture { dir: d, before, want_content, want_reasoning } =
        thought_fixture("gemma3", "channel", &[], &json!({}));
    let s = server(&d);
    let r = s.post("/v1/chat/completions", &request(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["token_ids"], before["choices"][0]["token_ids"], "same prompt, same greedy ids");
    assert_eq!(v["usage"]["prompt_tokens"], before["usage"]["prompt_tokens"]);
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["content"], want_content.as_str(), "{v}");
    assert_eq!(msg["reasoning_content"], want_reasoning.as_str(), "{v}");

    // Streamed: the deltas add up to the same two texts.
    let chunks = s.stream("/v1/chat/completions", &request(json!({"stream": true}))).read_all();
    let mut content = String::new();
    let mut reasoning = String::new();
    for c in &chunks {
        for ch in c["choices"].as_array().unwrap() {
            content.push_str(ch["delta"]["content"].as_str().unwrap_or(""));
            reasoning.push_str(ch["delta"]["reasoning_content"].as_str().unwrap_or(""));
        }
    }
    assert_eq!(content, want_content);
    assert_eq!(reasoning, want_reasoning);
    // /v1/completions is plain text: no split there.
    let r = s.post("/v1/completions", &json!({"model": "m", "prompt": "the cat sat", "max_tokens": 4}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.json()["choices"][0].get("reasoning_content").is_none());
    drop(s);

    // `megagemma chat` prints only the answer on stdout and notes the hidden thinking.
    let mut child = Command::new(env!("CARGO_BIN_EXE_megagemma"))
        .args(["chat", "--model", d.to_str().unwrap(), "--greedy", "-n", "24", "--ignore-eos"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"the cat sat\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{want_content}\n"));
    assert!(stderr(&out).contains("(thinking...)"), "{}", stderr(&out));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn chat_think_shows_thoughts_on_request() {
    // A Gemma 4 fixture on the built-in template, thinking on: the prompt `chat --think` builds
    // is the one `enable_thinking` gives over the API.
    let files = ["config.json", "model.safetensors", "tokenizer.json"];
    let think = json!({"chat_template_kwargs": {"enable_thinking": true}});
    let f = thought_fixture("ple_shared_dw", "show", &files, &think);
    let s = server(&f.dir);
    let v = s.post("/v1/chat/completions", &request(think.clone())).json();
    assert_eq!(v["choices"][0]["token_ids"], f.before["choices"][0]["token_ids"]);
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], f.want_reasoning.as_str());
    drop(s);
    let chat = |extra: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_megagemma"))
            .args(["chat", "--model", f.dir.to_str().unwrap(), "--greedy", "-n", "24", "--ignore-eos", "--think"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(b"the cat sat\n").unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        (stdout(&out), stderr(&out))
    };
    let (out, err) = chat(&[]);
    assert_eq!(out, format!("{}\n", f.want_content));
    assert!(err.contains("(thinking...)") && !err.contains("[thinking]"), "thoughts hidden: {err}");
    let (out, err) = chat(&["--show-thoughts"]);
    assert_eq!(out, format!("{}\n", f.want_content), "thoughts never reach stdout");
    assert!(err.contains(&format!("[thinking] {}", f.want_reasoning)), "thoughts shown on stderr: {err}");
    std::fs::remove_dir_all(&f.dir).unwrap();
}
