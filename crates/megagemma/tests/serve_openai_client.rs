//! The official `openai` Python client (pinned, installed from PyPI into the ignored
//! `.cache/openai-client` by `tools/fetch_openai_client.sh`) against `serve` on a fixture: models,
//! chat (whole, streamed, logprobs, n > 1), completions, and errors as the client's exceptions.

mod common;
mod http;

use common::*;
use http::*;
use std::process::Command;

#[test]
fn the_official_openai_client_parses_every_response() {
    let root = repo_root();
    let fetch = Command::new("bash").arg(root.join("tools/fetch_openai_client.sh")).status().expect("cannot run bash");
    assert!(fetch.success(), "tools/fetch_openai_client.sh failed: the openai client is needed for this test");
    let server = TestServer::with_defaults("gemma3");
    let out = Command::new("python3")
        .arg(root.join("crates/megagemma/tests/openai_client_check.py"))
        .arg(format!("http://{}", server.addr))
        .arg("gemma3")
        .env("PYTHONPATH", root.join(".cache/openai-client"))
        .output()
        .expect("cannot run python3");
    let text = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("all checks passed"), "{text}");
    // Every check ran: one `ok` line each.
    assert_eq!(text.lines().filter(|l| l.starts_with("ok ")).count(), 14, "{text}");
}
