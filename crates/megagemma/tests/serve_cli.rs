//! `megagemma serve` as a process: it says where it listens, answers, and stops cleanly on
//! SIGTERM; bad arguments get one `error:` line. Also graceful shutdown of an in-process server.

mod common;
mod http;

use common::*;
use http::*;
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// Starts `serve` on the gemma3 fixture with `extra` arguments, asks one greedy chat completion,
/// stops the process with SIGTERM and returns the answer.
fn serve_answer_then_sigterm(extra: &[&str]) -> String {
    let d = fixtures_dir().join("gemma3");
    let mut child = Command::new(env!("CARGO_BIN_EXE_megagemma"))
        .args(["serve", "--model", d.to_str().unwrap(), "--port", "0", "--backend", "cpu"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.starts_with("serving `gemma3` on http://127.0.0.1:"), "{line}");
    // The default context: the fixture's max_position_embeddings, below the CPU's 32,768.
    assert!(line.contains("(context 4096 tokens;"), "{line}");
    let addr = line.split("http://").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();

    let r = request(addr, "GET", "/v1/models", &[], None);
    assert_eq!(r.json()["data"][0]["id"], "gemma3");
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true})
    .to_string();
    let r =
        request(addr, "POST", "/v1/chat/completions", &[("Content-Type", "application/json")], Some(body.as_bytes()));
    assert_eq!(r.status, 200, "{}", r.body);
    let answer = r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string();

    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "serve should exit 0 on SIGTERM, got {status}");
    answer
}

#[test]
fn serve_process_answers_and_stops_on_sigterm() {
    let warmed = serve_answer_then_sigterm(&[]);
    assert!(!warmed.is_empty());
    // The warm-up pass before listening changes no answer.
    assert_eq!(serve_answer_then_sigterm(&["--no-warmup"]), warmed);
}

/// Drafting flags that do not go together are refused with one line, before anything loads.
#[test]
fn serve_draft_flags_that_do_not_fit_are_one_error_line() {
    let d = fixtures_dir().join("ple_shared_dw");
    let a = fixtures_dir().join("assistants/dense");
    let (d, a) = (d.to_str().unwrap(), a.to_str().unwrap());
    for (extra, needle) in [
        (vec!["--draft", "mtp"], "--assistant"),
        (vec!["--assistant", a], "--draft mtp"),
        (vec!["--draft", "mtp", "--assistant", a, "--k", "0"], "--k"),
        (vec!["--draft", "oracle"], "unknown --draft"),
    ] {
        let mut args = vec!["serve", "--model", d, "--port", "0", "--backend", "cpu"];
        args.extend(&extra);
        let out = megagemma(&args);
        assert!(!out.status.success(), "{extra:?} should fail");
        let err = stderr(&out);
        assert!(err.starts_with("error: ") && err.trim_end().lines().count() == 1, "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
}

#[test]
fn serve_with_a_missing_model_is_one_error_line() {
    let out = megagemma(&["serve", "--model", "/nonexistent/model", "--port", "0"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.starts_with("error: ") && err.trim_end().lines().count() == 1, "{err}");
}

/// `--decode` as `run` and `bench` take it: a mode CUDA does not have is one error line, before
/// any model is loaded (`serve` and `chat` alike).
#[test]
fn an_unknown_decode_mode_is_one_error_line() {
    let d = fixtures_dir().join("gemma3");
    let d = d.to_str().unwrap();
    let serve = ["serve", "--model", d, "--port", "0", "--decode", "warp"];
    let chat = ["chat", "--model", d, "--decode", "warp"];
    for (cmd, args) in [("serve", &serve[..]), ("chat", &chat[..])] {
        let out = megagemma(args);
        assert!(!out.status.success(), "{cmd}");
        let err = stderr(&out);
        assert!(err.starts_with("error: ") && err.trim_end().lines().count() == 1, "{cmd}: {err}");
        assert!(err.contains("unknown decode mode `warp`"), "{cmd}: {err}");
    }
}

#[test]
fn shutdown_ends_running_streams_and_stops_listening() {
    // On 127.0.0.2: after shutdown nothing else can answer on its address (`with_long_context_on`).
    let server = TestServer::with_long_context_on("gemma3", "127.0.0.2");
    let addr = server.addr;
    let mut s = server.stream(
        "/v1/completions",
        &json!({"prompt": "the cat", "max_tokens": 30000, "ignore_eos": true, "stream": true}),
    );
    assert!(s.next_event().is_some());
    // Dropping the server asks it to shut down and waits for it.
    let stopper = std::thread::spawn(move || drop(server));
    let chunks = s.read_all();
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "length");
    stopper.join().unwrap();
    // The addresses say which socket answered if this ever fails.
    if let Ok(c) = std::net::TcpStream::connect(addr) {
        panic!("still listening after shutdown: local {:?}, peer {:?}", c.local_addr(), c.peer_addr());
    }
}
