//! Thinking mode over the API: `chat_template_kwargs` reaches the chat template, and a chat
//! answer's thought channel (`<|channel>…<channel|>`) comes back as `reasoning_content`, apart
//! from `content` (whole and streamed); `megagemma chat` hides it. The fixtures' tokenizers have
//! no channel tokens, so one test renames two vocabulary entries that the fixture's greedy answer
//! contains to `<|channel>` / `<channel|>`: the ids the model emits are unchanged, and the text
//! must split where they fall.

mod common;
mod http;
mod thoughts;

use common::*;
use http::*;
use serde_json::json;
use thoughts::*;

#[test]
fn chat_template_kwargs_reach_the_template() {
    // A Gemma 4 fixture without a template of its own: the built-in one, whose
    // enable_thinking adds a system turn with `<|think|>`.
    let d = scratch_copy("ple_shared_dw", "kwargs", &["config.json", "model.safetensors", "tokenizer.json"]);
    let s = server(&d);
    let plain = s.post("/v1/chat/completions", &chat_request(json!({})));
    assert_eq!(plain.status, 200, "{}", plain.body);
    let think =
        s.post("/v1/chat/completions", &chat_request(json!({"chat_template_kwargs": {"enable_thinking": true}})));
    assert_eq!(think.status, 200, "{}", think.body);
    let tokens = |r: &Resp| r.json()["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        tokens(&think) > tokens(&plain),
        "enable_thinking should lengthen the prompt: {} vs {}",
        tokens(&think),
        tokens(&plain)
    );
    let off =
        s.post("/v1/chat/completions", &chat_request(json!({"chat_template_kwargs": {"enable_thinking": false}})));
    assert_eq!(tokens(&off), tokens(&plain));
    for bad in [json!("yes"), json!([1]), json!(3)] {
        let r = s.post("/v1/chat/completions", &chat_request(json!({"chat_template_kwargs": bad})));
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.json()["error"]["param"], "chat_template_kwargs", "{}", r.body);
    }
    // The server keeps serving.
    assert_eq!(s.post("/v1/chat/completions", &chat_request(json!({}))).status, 200);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_thought_channel_comes_back_as_reasoning_content() {
    let ThoughtFixture { dir: d, before, want_content, want_reasoning } =
        thought_fixture("gemma3", "channel", &[], &json!({}));
    let s = server(&d);
    let r = s.post("/v1/chat/completions", &chat_request(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["choices"][0]["token_ids"], before["choices"][0]["token_ids"], "same prompt, same greedy ids");
    assert_eq!(v["usage"]["prompt_tokens"], before["usage"]["prompt_tokens"]);
    let msg = &v["choices"][0]["message"];
    assert_eq!(msg["content"], want_content.as_str(), "{v}");
    assert_eq!(msg["reasoning_content"], want_reasoning.as_str(), "{v}");

    // Streamed: the deltas add up to the same two texts.
    let chunks = s.stream("/v1/chat/completions", &chat_request(json!({"stream": true}))).read_all();
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
    let args = ["chat", "--model", d.to_str().unwrap(), "--greedy", "-n", "24", "--ignore-eos"];
    let out = megagemma_with_input(&args, b"the cat sat\n");
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
    let v = s.post("/v1/chat/completions", &chat_request(think.clone())).json();
    assert_eq!(v["choices"][0]["token_ids"], f.before["choices"][0]["token_ids"]);
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], f.want_reasoning.as_str());
    drop(s);
    let chat = |extra: &[&str]| {
        let mut args =
            vec!["chat", "--model", f.dir.to_str().unwrap(), "--greedy", "-n", "24", "--ignore-eos", "--think"];
        args.extend(extra);
        let out = megagemma_with_input(&args, b"the cat sat\n");
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
