//! `serve` error replies: OpenAI error JSON with the right status, and the server keeps
//! answering after each of them.

mod http;

use http::*;
use megagemma_server::ServerConfig;
use serde_json::json;

const MODEL: &str = "gemma3";

fn assert_error(r: &Resp, status: u16, param: Option<&str>) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
}

fn still_serves(server: &TestServer) {
    let r = server.post("/v1/completions", &json!({"prompt": "the cat", "max_tokens": 2}));
    assert_eq!(r.status, 200, "the server stopped answering: {}", r.body);
}

#[test]
fn bad_requests_get_400_and_the_server_keeps_serving() {
    let server = TestServer::start(MODEL, ServerConfig { model_name: MODEL.into(), ..Default::default() }, Some(64));
    let json_headers = [("Content-Type", "application/json")];
    assert_error(&server.post_raw("/v1/chat/completions", &json_headers, b"{\"messages\": [}"), 400, None);
    assert_error(&server.post_raw("/v1/completions", &json_headers, b""), 400, None);
    assert_error(&server.post("/v1/chat/completions", &json!({"messages": "hi"})), 400, None);
    assert_error(&server.post("/v1/chat/completions", &json!({"messages": []})), 400, Some("messages"));
    still_serves(&server);

    let chat = |extra: serde_json::Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        server.post("/v1/chat/completions", &body)
    };
    assert_error(&chat(json!({"temperature": -1})), 400, Some("temperature"));
    assert_error(&chat(json!({"top_p": 0})), 400, Some("top_p"));
    assert_error(&chat(json!({"min_p": 2})), 400, Some("min_p"));
    assert_error(&chat(json!({"top_k": -5})), 400, Some("top_k"));
    assert_error(&chat(json!({"n": 0})), 400, Some("n"));
    assert_error(&chat(json!({"max_tokens": 0})), 400, Some("max_tokens"));
    assert_error(&chat(json!({"stop": [1, 2]})), 400, Some("stop"));
    assert_error(&chat(json!({"logprobs": true, "top_logprobs": 50})), 400, Some("top_logprobs"));
    assert_error(&chat(json!({"temperature": "hot"})), 400, None);
    assert_error(&server.post("/v1/completions", &json!({"prompt": [1, 99999]})), 400, Some("prompt"));
    assert_error(&server.post("/v1/completions", &json!({"prompt": ""})), 400, Some("prompt"));
    still_serves(&server);

    // Prompt + max_tokens beyond the 64-token context: a clear 400 before any work.
    let r = chat(json!({"max_tokens": 100}));
    assert_error(&r, 400, Some("messages"));
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("64"), "{}", r.body);
    let long_prompt = vec![5u32; 70];
    let r = server.post("/v1/completions", &json!({"prompt": long_prompt}));
    assert_error(&r, 400, Some("prompt"));
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");

    // Unknown model and unknown path: 404.
    let r = server.post("/v1/completions", &json!({"model": "gpt-5", "prompt": "hi"}));
    assert_error(&r, 404, Some("model"));
    assert_eq!(r.json()["error"]["code"], "model_not_found");
    assert_error(&server.get("/v1/nothing"), 404, None);
    still_serves(&server);
}

#[test]
fn api_key_is_required_when_set() {
    let server = TestServer::start(
        MODEL,
        ServerConfig { model_name: MODEL.into(), api_key: Some("sesame".into()), ..Default::default() },
        None,
    );
    let body = br#"{"prompt": "hi", "max_tokens": 2}"#;
    assert_error(&server.post_raw("/v1/completions", &[], body), 401, None);
    assert_error(&server.post_raw("/v1/completions", &[("Authorization", "Bearer wrong")], body), 401, None);
    assert_error(&request(server.addr, "GET", "/v1/models", &[], None), 401, None);
    let ok = server.post_raw("/v1/completions", &[("Authorization", "Bearer sesame")], body);
    assert_eq!(ok.status, 200, "{}", ok.body);
    // Health and metrics stay open for probes.
    assert_eq!(server.get("/health").status, 200);
    assert_eq!(server.get("/metrics").status, 200);
}

#[test]
fn oversized_body_gets_413() {
    let server = TestServer::start(
        MODEL,
        ServerConfig { model_name: MODEL.into(), max_body_bytes: 2048, ..Default::default() },
        None,
    );
    let big = json!({"prompt": "x".repeat(4096), "max_tokens": 1}).to_string();
    assert_error(
        &server.post_raw("/v1/completions", &[("Content-Type", "application/json")], big.as_bytes()),
        413,
        None,
    );
    still_serves(&server);
}

#[test]
fn a_full_queue_gets_503() {
    // One sequence at a time and one waiting place: a third request finds the queue full.
    let server = TestServer::start(
        MODEL,
        ServerConfig { model_name: MODEL.into(), max_batch: 1, max_queue: 1, ..Default::default() },
        Some(LONG_CONTEXT),
    );
    let long = json!({"prompt": "the cat", "max_tokens": 30000, "ignore_eos": true, "stream": true});
    let mut running = server.stream("/v1/completions", &long);
    assert!(running.next_event().is_some());
    let waiting = server.stream("/v1/completions", &json!({"prompt": "a", "max_tokens": 2, "stream": true}));
    assert_eq!(waiting.status, 200);
    assert!(server.wait_for_metric("megagemma_queue_depth", 1.0, 1000));
    let r = server.post("/v1/completions", &json!({"prompt": "b", "max_tokens": 2}));
    assert_error(&r, 503, None);
    assert_eq!(r.json()["error"]["code"], "queue_full");
    // When the running request goes away, the waiting one runs to its end.
    drop(running);
    let chunks = waiting.read_all();
    assert!(!chunks.is_empty());
    still_serves(&server);
}
