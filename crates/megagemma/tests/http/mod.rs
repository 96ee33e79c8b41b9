//! An in-process `serve` on an ephemeral loopback port, and a small HTTP/1.1 client over
//! plain sockets (whole responses, and server-sent events read one at a time).
#![allow(dead_code)]

use megagemma_engine::backends::{open_backend_with, BackendKind, BackendOptions};
use megagemma_engine::model_files::ChatModel;
use megagemma_model::assistant::AssistantModel;
use megagemma_model::quant::load::QuantMode;
use megagemma_model::Model;
use megagemma_server::{Server, ServerConfig, ShutdownHandle};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name).canonicalize().unwrap()
}

/// A context long enough for a request of 30,000 tokens that a test ends before it is done.
pub const LONG_CONTEXT: usize = 32_768;

/// Where test servers listen, as `megagemma serve` does by default.
const LOOPBACK: &str = "127.0.0.1";

pub struct TestServer {
    pub addr: SocketAddr,
    handle: ShutdownHandle,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl TestServer {
    /// Serves fixture `name` with `config`, on a CPU backend of context `ctx` (default if None).
    pub fn start(name: &str, config: ServerConfig, ctx: Option<usize>) -> TestServer {
        Self::start_dir(&fixture(name), config, ctx)
    }

    /// Serves the model in `dir` (a fixture copy a test changed) on a CPU backend.
    pub fn start_dir(dir: &std::path::Path, config: ServerConfig, ctx: Option<usize>) -> TestServer {
        Self::start_full(dir, config, ctx, None, LOOPBACK)
    }

    /// Serves fixture `name` with the MTP assistant in `assistant` loaded beside it.
    pub fn start_with_assistant(name: &str, config: ServerConfig, assistant: &std::path::Path) -> TestServer {
        Self::start_full(&fixture(name), config, None, Some(assistant), LOOPBACK)
    }

    fn start_full(
        dir: &std::path::Path,
        config: ServerConfig,
        ctx: Option<usize>,
        assistant: Option<&std::path::Path>,
        host: &str,
    ) -> TestServer {
        let dir = dir.to_path_buf();
        let model = Arc::new(Model::load(&dir).unwrap());
        let chat = ChatModel::open(&dir, &model).unwrap();
        let assistant = assistant.map(|a| Arc::new(AssistantModel::load(a, &model, QuantMode::Stored).unwrap()));
        let opts = BackendOptions { kind: BackendKind::Cpu, max_context: ctx, decode: None, sequences: 1 };
        let backend = open_backend_with(model, assistant, &opts).unwrap();
        let server = Server::new(config, backend, chat).unwrap();
        let handle = server.shutdown_handle();
        let listener = std::net::TcpListener::bind((host, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let thread = std::thread::spawn(move || server.serve_blocking(listener, false));
        TestServer { addr, handle, thread: Some(thread) }
    }

    pub fn with_defaults(name: &str) -> TestServer {
        Self::start(name, ServerConfig { model_name: name.into(), ..Default::default() }, None)
    }

    /// The defaults with a context of `LONG_CONTEXT` (past the fixtures' 4,096): room for requests
    /// that run until the test stops them.
    pub fn with_long_context(name: &str) -> TestServer {
        Self::with_long_context_on(name, LOOPBACK)
    }

    /// `with_long_context` listening on loopback address `host` (any of 127.0.0.0/8 on Linux): no
    /// other test's server, all on `LOOPBACK`, can take its port once it is freed, and a client
    /// connecting to it gets source address 127.0.0.1, so it never connects to itself.
    pub fn with_long_context_on(name: &str, host: &str) -> TestServer {
        let config = ServerConfig { model_name: name.into(), ..Default::default() };
        Self::start_full(&fixture(name), config, Some(LONG_CONTEXT), None, host)
    }

    pub fn get(&self, path: &str) -> Resp {
        request(self.addr, "GET", path, &[], None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Resp {
        request(self.addr, "POST", path, &[("Content-Type", "application/json")], Some(body.to_string().as_bytes()))
    }

    pub fn post_raw(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Resp {
        request(self.addr, "POST", path, headers, Some(body))
    }

    /// Opens a streaming POST and returns once the response head has arrived.
    pub fn stream(&self, path: &str, body: &Value) -> SseStream {
        SseStream::open(self.addr, path, body)
    }

    /// A gauge or counter from `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics").body;
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).map(|v| v.trim().parse().unwrap())
            })
            .unwrap_or_else(|| panic!("metric {name} missing from:\n{text}"))
    }

    /// Polls `/metrics` until `name` equals `value` (at most `tries` polls, 10 ms apart).
    pub fn wait_for_metric(&self, name: &str, value: f64, tries: usize) -> bool {
        for _ in 0..tries {
            if self.metric(name) == value {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        false
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(t) = self.thread.take() {
            let r = t.join().expect("server thread panicked");
            if !std::thread::panicking() {
                r.expect("server ended with an error");
            }
        }
    }
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("body is not JSON ({e}): {}", self.body))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

fn write_request(s: &mut TcpStream, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    if let Some(b) = body {
        // The server may answer (413) and close before reading everything.
        let _ = s.write_all(b);
    }
}

fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status = line.split_whitespace().nth(1).unwrap_or_else(|| panic!("bad status line `{line}`")).parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"))
}

fn content_length(headers: &[(String, String)]) -> Option<usize> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case("content-length")).and_then(|(_, v)| v.parse().ok())
}

/// One chunk of a chunked body; `None` at the end.
fn read_chunk(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let size = usize::from_str_radix(line.trim(), 16).unwrap_or_else(|_| panic!("bad chunk size `{line}`"));
    let mut buf = vec![0; size + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(size);
    (size > 0).then_some(buf)
}

pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: Option<&[u8]>) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    write_request(&mut s, method, path, headers, body);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let mut bytes = Vec::new();
    if is_chunked(&headers) {
        while let Some(c) = read_chunk(&mut r) {
            bytes.extend(c);
        }
    } else if let Some(len) = content_length(&headers) {
        // Servers that keep the connection open (ChromeDriver) end the body by its length.
        bytes.resize(len, 0);
        r.read_exact(&mut bytes).unwrap();
    } else {
        r.read_to_end(&mut bytes).unwrap();
    }
    Resp { status, headers, body: String::from_utf8(bytes).unwrap() }
}

/// A server-sent event stream, read one `data:` event at a time.
pub struct SseStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    buf: String,
    /// Every event read so far, raw (without the `data: ` prefix).
    pub events: Vec<String>,
}

impl SseStream {
    fn open(addr: SocketAddr, path: &str, body: &Value) -> SseStream {
        let mut s = TcpStream::connect(addr).unwrap();
        write_request(&mut s, "POST", path, &[("Content-Type", "application/json")], Some(body.to_string().as_bytes()));
        let mut reader = BufReader::new(s);
        let (status, headers) = read_head(&mut reader);
        SseStream { status, headers, reader, buf: String::new(), events: Vec::new() }
    }

    /// The next event's data; `None` when the stream ends. Panics on a line that is not
    /// `data: ...` followed by a blank line.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let frame: String = self.buf.drain(..end + 2).collect();
                let data = frame
                    .strip_prefix("data: ")
                    .and_then(|d| d.strip_suffix("\n\n"))
                    .unwrap_or_else(|| panic!("bad SSE frame {frame:?}"));
                assert!(!data.contains('\n'), "one line per event: {frame:?}");
                self.events.push(data.to_string());
                return Some(data.to_string());
            }
            let chunk = read_chunk(&mut self.reader)?;
            self.buf.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Reads to the end; asserts `[DONE]` comes last and nothing after it.
    pub fn read_all(mut self) -> Vec<Value> {
        while self.next_event().is_some() {}
        assert!(self.buf.is_empty(), "trailing bytes after the last event: {:?}", self.buf);
        assert_eq!(self.events.last().map(String::as_str), Some("[DONE]"), "the stream must end with [DONE]");
        let n = self.events.len();
        self.events[..n - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect()
    }
}

/// The text a chat stream's chunks add up to, per choice.
pub fn stream_text(chunks: &[Value], n: usize, field: &str) -> Vec<String> {
    let mut out = vec![String::new(); n];
    for c in chunks {
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            let piece = if field == "delta" { &ch["delta"]["content"] } else { &ch["text"] };
            if let Some(t) = piece.as_str() {
                out[i].push_str(t);
            }
        }
    }
    out
}
