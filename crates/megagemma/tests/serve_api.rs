//! `serve` over real loopback sockets: outputs equal `megagemma run`, streaming framing,
//! batch invariance of concurrent requests, `n` by fork, stop strings, logprobs, cancellation.

mod common;
mod http;

use common::{megagemma, stderr, stdout};
use http::*;
use megagemma_server::ServerConfig;
use serde_json::{json, Value};

const MODEL: &str = "gemma3";

fn run_json(args: &[&str]) -> Value {
    let dir = fixture(MODEL);
    let mut a = vec!["run", "--model", dir.to_str().unwrap(), "--greedy", "--output", "json"];
    a.extend_from_slice(args);
    let out = megagemma(&a);
    assert!(out.status.success(), "{}", stderr(&out));
    serde_json::from_str(stdout(&out).trim()).unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn greedy_chat_and_completion_equal_megagemma_run() {
    let server = TestServer::with_defaults(MODEL);

    let expected = run_json(&["--prompt", "the cat sat", "-n", "24"]);
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "the cat sat"}],
                "temperature": 0, "max_tokens": 24, "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(ids(&choice["token_ids"]), ids(&expected["ids"]));
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], expected["text"]);
    assert_eq!(choice["finish_reason"], expected["finish_reason"]);
    assert_eq!(v["usage"]["prompt_tokens"], expected["prompt_tokens"]);
    assert_eq!(v["usage"]["completion_tokens"].as_u64().unwrap(), ids(&expected["ids"]).len() as u64);
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        v["usage"]["prompt_tokens"].as_u64().unwrap() + v["usage"]["completion_tokens"].as_u64().unwrap()
    );

    let expected = run_json(&["--prompt", "once upon a time", "--raw", "--ignore-eos", "-n", "20"]);
    let r = server.post(
        "/v1/completions",
        &json!({"prompt": "once upon a time", "temperature": 0, "max_tokens": 20, "ignore_eos": true,
                "return_token_ids": true}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(ids(&v["choices"][0]["token_ids"]), ids(&expected["ids"]));
    assert_eq!(v["choices"][0]["text"], expected["text"]);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 20);
}

#[test]
fn sse_stream_is_framed_and_adds_up_to_the_whole_reply() {
    let server = TestServer::with_defaults(MODEL);
    let body = json!({"messages": [{"role": "user", "content": "hello"}], "temperature": 0, "max_tokens": 16,
                      "ignore_eos": true});
    let whole = server.post("/v1/chat/completions", &body).json();

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let s = server.stream("/v1/chat/completions", &streamed);
    assert_eq!(s.status, 200);
    assert!(s
        .headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("content-type") && v.starts_with("text/event-stream")));
    let chunks = s.read_all();
    assert!(chunks.len() >= 3, "role chunk, content chunks, finish chunk: {chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"], "one id for the whole stream");
    }
    let finishes: Vec<&Value> = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().unwrap())
        .filter(|ch| !ch["finish_reason"].is_null())
        .map(|ch| &ch["finish_reason"])
        .collect();
    assert_eq!(finishes, vec![&json!("length")]);
    assert_eq!(stream_text(&chunks, 1, "delta")[0], whole["choices"][0]["message"]["content"].as_str().unwrap());
    // include_usage: a last chunk with no choices carries the usage; the others carry null.
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], whole["usage"]);
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["usage"].is_null()));

    // Completions stream too, without usage when not asked.
    let s = server
        .stream("/v1/completions", &json!({"prompt": "hello", "max_tokens": 5, "stream": true, "ignore_eos": true}));
    let chunks = s.read_all();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion" && c.get("usage").is_none()));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
}

/// Requests that run together (one batched step per token) get exactly what they get alone.
#[test]
fn concurrent_streams_each_get_what_they_get_alone() {
    let server = TestServer::with_defaults(MODEL);
    let bodies = [
        json!({"prompt": "the cat", "temperature": 0, "max_tokens": 400, "ignore_eos": true, "stream": true}),
        json!({"prompt": "a dog ran", "temperature": 0.9, "top_k": 40, "seed": 7, "max_tokens": 300,
               "ignore_eos": true, "stream": true}),
        json!({"prompt": "one two three four", "temperature": 0, "max_tokens": 200, "ignore_eos": true,
               "stream": true}),
    ];
    let alone: Vec<String> = bodies
        .iter()
        .map(|b| stream_text(&server.stream("/v1/completions", b).read_all(), 1, "text").remove(0))
        .collect();
    let steps_before = server.metric("megagemma_decode_tokens_total") - server.metric("megagemma_decode_steps_total");

    // Each stream is running (its first token arrived) before the next one starts.
    let mut streams = Vec::new();
    for b in &bodies {
        let mut s = server.stream("/v1/completions", b);
        assert!(s.next_event().is_some());
        streams.push(s);
    }
    let together: Vec<String> = streams
        .into_iter()
        .map(|s| std::thread::spawn(move || stream_text(&s.read_all(), 1, "text").remove(0)))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "request {i} changed when run beside others");
    }
    let batched = server.metric("megagemma_decode_tokens_total") - server.metric("megagemma_decode_steps_total");
    assert!(batched > steps_before, "the requests never shared a decode step");
}

#[test]
fn n_choices_fork_one_prefill() {
    let server = TestServer::with_defaults(MODEL);
    let one = server
        .post(
            "/v1/completions",
            &json!({"prompt": "the cat", "temperature": 0, "max_tokens": 12,
                                                        "ignore_eos": true}),
        )
        .json();
    let prompt_before = server.metric("megagemma_prompt_tokens_total");
    let three = server
        .post(
            "/v1/completions",
            &json!({"prompt": "the cat", "temperature": 0, "max_tokens": 12,
                                                          "ignore_eos": true, "n": 3}),
        )
        .json();
    let choices = three["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], one["choices"][0]["text"], "greedy choices of forked sequences equal the lone run");
    }
    assert_eq!(three["usage"]["completion_tokens"], 36);
    let prefilled = server.metric("megagemma_prompt_tokens_total") - prompt_before;
    assert_eq!(prefilled, three["usage"]["prompt_tokens"].as_f64().unwrap(), "the prompt is prefilled once");

    // Seeded sampling: reproducible, and the choices draw differently.
    let body =
        json!({"prompt": "the cat", "temperature": 1.0, "seed": 3, "max_tokens": 24, "ignore_eos": true, "n": 2});
    let a = server.post("/v1/completions", &body).json();
    let b = server.post("/v1/completions", &body).json();
    assert_eq!(a["choices"], b["choices"]);
    assert_ne!(a["choices"][0]["text"], a["choices"][1]["text"]);
}

#[test]
fn stop_strings_cut_the_text_and_are_not_streamed() {
    let server = TestServer::with_defaults(MODEL);
    let base = json!({"prompt": "the cat", "temperature": 0, "max_tokens": 40, "ignore_eos": true});
    let full = server.post("/v1/completions", &base).json()["choices"][0]["text"].as_str().unwrap().to_string();
    // A stop string taken from the middle of the output: the reply is what comes before it.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 12, "the fixture should produce some text: {full:?}");
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
    let cut = &full[..full.find(&stop).unwrap()];
    let mut body = base.clone();
    body["stop"] = json!(["never-there", stop]);
    let v = server.post("/v1/completions", &body).json();
    assert_eq!(v["choices"][0]["text"], cut);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    body["stream"] = json!(true);
    let chunks = server.stream("/v1/completions", &body).read_all();
    assert_eq!(stream_text(&chunks, 1, "text")[0], cut);
}

#[test]
fn logprobs_describe_the_chosen_tokens() {
    let server = TestServer::with_defaults(MODEL);
    let v = server
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 6,
                    "ignore_eos": true, "logprobs": true, "top_logprobs": 3}),
        )
        .json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6);
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(entry["token"], top[0]["token"]);
        assert_eq!(entry["logprob"], top[0]["logprob"]);
        let lps: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(lps.windows(2).all(|w| w[0] >= w[1]) && lps[0] <= 0.0, "{lps:?}");
    }
    let v = server
        .post(
            "/v1/completions",
            &json!({"prompt": "hi", "temperature": 0, "max_tokens": 4, "logprobs": 2, "ignore_eos": true}),
        )
        .json();
    let lp = &v["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["token_logprobs"].as_array().unwrap().len(), 4);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
}

#[test]
fn a_client_that_leaves_mid_stream_frees_its_sequence() {
    let server = TestServer::with_long_context(MODEL);
    let mut s = server.stream(
        "/v1/completions",
        &json!({"prompt": "the cat", "max_tokens": 30000, "ignore_eos": true, "stream": true}),
    );
    assert!(s.next_event().is_some());
    assert_eq!(server.metric("megagemma_active_sequences"), 1.0);
    drop(s);
    assert!(server.wait_for_metric("megagemma_active_sequences", 0.0, 1000), "the sequence was not freed");
    assert_eq!(server.metric("megagemma_requests_cancelled_total"), 1.0);
    // And the server goes on answering.
    let r = server.post("/v1/completions", &json!({"prompt": "the cat", "max_tokens": 3}));
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(server.metric("megagemma_active_sequences"), 0.0);
}

#[test]
fn models_health_and_metrics_answer() {
    let server = TestServer::with_defaults(MODEL);
    let models = server.get("/v1/models").json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(server.get("/health").json()["status"], "ok");
    server.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 2}));
    let m = server.get("/metrics");
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    for name in [
        "megagemma_requests_total{path=\"/v1/completions\",status=\"200\"} 1",
        "megagemma_queue_depth 0",
        "megagemma_active_sequences 0",
        "megagemma_time_to_first_token_seconds_count 1",
        "megagemma_generation_tokens_total",
        "megagemma_decode_tokens_per_second",
    ] {
        assert!(m.body.contains(name), "missing `{name}` in:\n{}", m.body);
    }
}

/// A bounded load: 96 requests from 16 clients at once, streamed and not, greedy and seeded;
/// every one succeeds with its lone output, and no sequence or queue slot is left behind.
#[test]
fn many_concurrent_clients_get_their_lone_outputs_and_leak_nothing() {
    let server = std::sync::Arc::new(TestServer::with_defaults(MODEL));
    let bodies: Vec<Value> = (0..8)
        .map(|i| {
            let mut b = json!({"prompt": format!("request {i} says"), "max_tokens": 20 + 5 * i, "ignore_eos": true});
            if i % 2 == 1 {
                b["temperature"] = json!(0.8);
                b["seed"] = json!(i);
            } else {
                b["temperature"] = json!(0);
            }
            b
        })
        .collect();
    let alone: Vec<Value> =
        bodies.iter().map(|b| server.post("/v1/completions", b).json()["choices"][0]["text"].clone()).collect();
    let clients: Vec<_> = (0..16)
        .map(|c| {
            let (server, bodies, alone) = (server.clone(), bodies.clone(), alone.clone());
            std::thread::spawn(move || {
                for r in 0..6 {
                    let i = (c + r) % bodies.len();
                    let text = if (c + r) % 2 == 0 {
                        let resp = server.post("/v1/completions", &bodies[i]);
                        assert_eq!(resp.status, 200, "{}", resp.body);
                        resp.json()["choices"][0]["text"].clone()
                    } else {
                        let mut b = bodies[i].clone();
                        b["stream"] = json!(true);
                        json!(stream_text(&server.stream("/v1/completions", &b).read_all(), 1, "text")[0])
                    };
                    assert_eq!(text, alone[i], "request {i} from client {c}");
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    assert!(server.wait_for_metric("megagemma_active_sequences", 0.0, 1000), "sequences leaked");
    assert_eq!(server.metric("megagemma_queue_depth"), 0.0);
    assert_eq!(server.metric("megagemma_requests_cancelled_total"), 0.0);
}

#[test]
fn a_client_that_leaves_before_a_whole_reply_frees_its_sequence() {
    use std::io::Write;
    let server = TestServer::with_long_context(MODEL);
    let body = json!({"prompt": "the cat", "max_tokens": 30000, "ignore_eos": true}).to_string();
    let mut s = std::net::TcpStream::connect(server.addr).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    assert!(server.wait_for_metric("megagemma_active_sequences", 1.0, 1000), "the request never started");
    drop(s);
    assert!(server.wait_for_metric("megagemma_active_sequences", 0.0, 1000), "the sequence was not freed");
    assert_eq!(server.metric("megagemma_requests_cancelled_total"), 1.0);
}

/// Prompts that start like an earlier request reuse its sequence (fork, roll back, prefill the
/// rest) and still get exactly what a server without the cache gives.
#[test]
fn prefix_cache_reuse_changes_no_output() {
    for model in ["gemma3", "ple_shared_dw"] {
        let cached = TestServer::start(model, ServerConfig { model_name: model.into(), ..Default::default() }, None);
        let plain = TestServer::start(
            model,
            ServerConfig { model_name: model.into(), prefix_cache: 0, ..Default::default() },
            None,
        );
        let ask = |server: &TestServer, prompt: &[u64]| {
            let r = server.post(
                "/v1/completions",
                &json!({"prompt": prompt, "temperature": 0, "max_tokens": 6, "ignore_eos": true, "return_token_ids": true}),
            );
            assert_eq!(r.status, 200, "{}", r.body);
            ids(&r.json()["choices"][0]["token_ids"])
        };
        let p1: Vec<u64> = vec![2, 10, 11, 12, 13, 14, 15, 16, 17, 18];
        let o1 = ask(&plain, &p1);
        assert_eq!(ask(&cached, &p1), o1, "{model}: first request");
        // The next turn: the whole earlier sequence, then more (no rollback needed).
        let p2: Vec<u64> = p1.iter().chain(&o1).chain(&[20, 21, 22]).copied().collect();
        let hits = cached.metric("megagemma_prefix_cache_hit_tokens_total");
        assert_eq!(ask(&cached, &p2), ask(&plain, &p2), "{model}: extension");
        // Every position the first request committed is reused (its last token was never fed).
        let reused = cached.metric("megagemma_prefix_cache_hit_tokens_total") - hits;
        assert_eq!(reused as usize, p1.len() + o1.len() - 1, "{model}");
        // A shared head and a different tail (rollback, or a fresh prefill when the window forbids it).
        let p3: Vec<u64> = p1[..7].iter().chain(&[30, 31]).copied().collect();
        assert_eq!(ask(&cached, &p3), ask(&plain, &p3), "{model}: shared head");
        let p4: Vec<u64> = p1[..9].iter().chain(&[40]).copied().collect();
        assert_eq!(ask(&cached, &p4), ask(&plain, &p4), "{model}: short rollback");
        // A chat's second turn.
        let chat = |server: &TestServer, messages: &Value| {
            let r = server.post(
                "/v1/chat/completions",
                &json!({"messages": messages, "temperature": 0, "max_tokens": 8, "return_token_ids": true}),
            );
            r.json()["choices"][0].clone()
        };
        let turn1 = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]);
        let a1 = chat(&plain, &turn1);
        assert_eq!(chat(&cached, &turn1), a1);
        let mut turn2 = turn1.as_array().unwrap().clone();
        turn2.push(json!({"role": "assistant", "content": a1["message"]["content"]}));
        turn2.push(json!({"role": "user", "content": "and then?"}));
        let turn2 = Value::Array(turn2);
        assert_eq!(chat(&cached, &turn2), chat(&plain, &turn2), "{model}: second chat turn");

        assert!(cached.metric("megagemma_prefix_cache_hit_tokens_total") > 0.0, "{model}: the cache was never used");
        assert_eq!(plain.metric("megagemma_prefix_cache_hit_tokens_total"), 0.0);
        assert!(cached.metric("megagemma_cached_sequences") <= 4.0);
    }
}

/// Prompt-lookup drafting while one greedy request runs alone: the same ids as plain decoding,
/// with drafts accepted along the way.
#[test]
fn lookup_drafting_changes_no_output() {
    for model in ["gemma3", "ple_shared_dw"] {
        let config =
            |draft_k| ServerConfig { model_name: model.into(), draft_k, prefix_cache: 0, ..Default::default() };
        let drafting = TestServer::start(model, config(4), None);
        let plain = TestServer::start(model, config(0), None);
        for (prompt, max_tokens, stop) in [
            (json!("the cat the cat the cat the cat"), 64, json!(null)),
            (json!([2, 5, 6, 7, 5, 6, 7, 5, 6]), 50, json!(null)),
            (json!("once upon a time"), 37, json!(null)),
            (json!("the cat the cat"), 40, json!(["never", "ca"])),
        ] {
            let body = json!({"prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": true,
                              "stop": stop, "return_token_ids": true});
            let a = drafting.post("/v1/completions", &body).json();
            let b = plain.post("/v1/completions", &body).json();
            assert_eq!(a["choices"], b["choices"], "{model}: {prompt}");
            assert_eq!(a["usage"], b["usage"], "{model}: {prompt}");
            let mut streamed = body.clone();
            streamed["stream"] = json!(true);
            let text = stream_text(&drafting.stream("/v1/completions", &streamed).read_all(), 1, "text");
            assert_eq!(json!(text[0]), b["choices"][0]["text"], "{model}: streamed {prompt}");
        }
        assert!(drafting.metric("megagemma_draft_accepted_tokens_total") > 0.0, "{model}: no draft was accepted");
        assert_eq!(plain.metric("megagemma_draft_tokens_total"), 0.0);
        assert_eq!(drafting.metric("megagemma_active_sequences"), 0.0);
    }
}

/// Prompts prefilled in chunks between decode steps (here 3 tokens at a time, while another
/// request streams) give the same outputs as whole-prompt prefill.
#[test]
fn chunked_prefill_changes_no_output() {
    let config =
        |prefill_chunk| ServerConfig { model_name: MODEL.into(), prefill_chunk, prefix_cache: 0, ..Default::default() };
    let chunked = TestServer::start(MODEL, config(3), None);
    let whole = TestServer::start(MODEL, config(0), None);
    let long = json!({"prompt": "one two three four five six seven eight nine ten eleven twelve thirteen", "temperature": 0,
                      "max_tokens": 24, "ignore_eos": true, "return_token_ids": true});
    let short = json!({"prompt": "the cat", "temperature": 0, "max_tokens": 200, "ignore_eos": true, "stream": true});
    let want_long = whole.post("/v1/completions", &long).json();
    let want_short = stream_text(&whole.stream("/v1/completions", &short).read_all(), 1, "text").remove(0);

    let chunks_before = chunked.metric("megagemma_prefill_chunks_total");
    // The short request is streaming when the long prompt arrives: its prefill is interleaved.
    let mut running = chunked.stream("/v1/completions", &short);
    assert!(running.next_event().is_some());
    let got_long = chunked.post("/v1/completions", &long).json();
    let got_short = stream_text(&running.read_all(), 1, "text").remove(0);
    assert_eq!(got_long["choices"], want_long["choices"]);
    assert_eq!(got_long["usage"], want_long["usage"]);
    assert_eq!(got_short, want_short);
    let prompt_tokens = want_long["usage"]["prompt_tokens"].as_f64().unwrap();
    let chunks = chunked.metric("megagemma_prefill_chunks_total") - chunks_before;
    assert!(chunks >= 1.0 + (prompt_tokens / 3.0).ceil(), "{chunks} prefill chunks for a {prompt_tokens}-token prompt");
    assert_eq!(whole.metric("megagemma_prefill_chunks_total"), 2.0, "one prefill per request without chunking");
    assert_eq!(chunked.metric("megagemma_active_sequences"), 0.0);
}

/// MTP drafting (the committed assistants, dense and centroid heads) while one greedy request
/// runs alone: the same ids as plain decoding.
#[test]
fn mtp_drafting_changes_no_output() {
    let model = "ple_shared_dw";
    let config = |draft_k, draft_mtp| ServerConfig {
        model_name: model.into(),
        draft_k,
        draft_mtp,
        prefix_cache: 0,
        ..Default::default()
    };
    let plain = TestServer::start(model, config(0, false), None);
    for head in ["dense", "centroid"] {
        let assistant = http::fixture("assistants").join(head);
        let drafting = TestServer::start_with_assistant(model, config(3, true), &assistant);
        for (prompt, max_tokens) in [(json!([2, 7, 8, 9]), 30), (json!("once upon a time"), 25), (json!([2, 5]), 40)] {
            let body = json!({"prompt": prompt, "temperature": 0, "max_tokens": max_tokens, "ignore_eos": true,
                              "return_token_ids": true});
            let a = drafting.post("/v1/completions", &body).json();
            let b = plain.post("/v1/completions", &body).json();
            assert_eq!(a["choices"], b["choices"], "{head}: {prompt}");
            assert_eq!(a["usage"], b["usage"], "{head}: {prompt}");
        }
        assert!(drafting.metric("megagemma_draft_tokens_total") > 0.0, "{head}: nothing was drafted");
        assert_eq!(drafting.metric("megagemma_active_sequences"), 0.0);
    }
}
