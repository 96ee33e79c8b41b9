//! The chat page at `GET /`, driven in headless Chromium through ChromeDriver (the WebDriver
//! HTTP API): typed messages stream back the same text as the greedy chat API, turn after turn.
//! Needs Debian's `chromium` and `chromium-driver`; fails when they are missing.

mod common;
mod http;
mod thoughts;

use http::*;
use megagemma_server::ServerConfig;
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "ple_shared_dw";
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// The key WebDriver gives an element reference under.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A ChromeDriver process and one headless Chromium session; both end on drop.
struct Browser {
    driver: Child,
    addr: SocketAddr,
    session: String,
    _profile: tempdir::Dir,
}

mod tempdir {
    /// A fresh directory under the system temp dir, removed on drop.
    pub struct Dir(pub std::path::PathBuf);

    impl Dir {
        pub fn new(prefix: &str) -> Dir {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
            let path = std::env::temp_dir().join(format!("{prefix}-{}-{nanos}", std::process::id()));
            std::fs::create_dir_all(&path).unwrap();
            Dir(path)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Browser {
    fn start() -> Browser {
        for tool in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(tool).exists(),
                "{tool} is missing: this test needs Debian's Chromium (apt-get install chromium chromium-driver)"
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start chromedriver");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let profile = tempdir::Dir::new("megagemma-chromium");
        let mut browser = Browser { driver, addr, session: String::new(), _profile: profile };
        browser.wait_until_ready();

        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--user-data-dir={}", browser._profile.0.display())])
        .collect::<Vec<_>>();
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
        }}});
        let v = browser.call("POST", "/session", Some(&caps));
        browser.session = v["sessionId"].as_str().unwrap_or_else(|| panic!("no session id in {v}")).to_string();
        browser
    }

    fn wait_until_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if std::net::TcpStream::connect(self.addr).is_ok() {
                let r = request(self.addr, "GET", "/status", &[], None);
                if r.status == 200 && r.json()["value"]["ready"] == true {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "chromedriver did not become ready in 30 s");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// One WebDriver command; its `value`, panicking on a WebDriver error.
    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        let body = body.map(|b| b.to_string());
        let headers: &[(&str, &str)] = if body.is_some() { &[("Content-Type", "application/json")] } else { &[] };
        let r = request(self.addr, method, path, headers, body.as_deref().map(str::as_bytes));
        let v = r.json();
        assert_eq!(r.status, 200, "WebDriver {method} {path} failed: {v}");
        v["value"].clone()
    }

    fn cmd(&self, method: &str, path: &str, body: Value) -> Value {
        self.call(method, &format!("/session/{}{path}", self.session), Some(&body))
    }

    fn find(&self, css: &str) -> String {
        let v = self.cmd("POST", "/element", json!({"using": "css selector", "value": css}));
        v[ELEMENT].as_str().unwrap_or_else(|| panic!("no element `{css}`: {v}")).to_string()
    }

    /// Replaces the text of an input field, as a user typing would.
    fn type_into(&self, css: &str, text: &str) {
        let el = self.find(css);
        self.cmd("POST", &format!("/element/{el}/clear"), json!({}));
        self.cmd("POST", &format!("/element/{el}/value"), json!({"text": text}));
    }

    fn click(&self, css: &str) {
        let el = self.find(css);
        self.cmd("POST", &format!("/element/{el}/click"), json!({}));
    }

    fn script(&self, js: &str) -> Value {
        self.cmd("POST", "/execute/sync", json!({"script": js, "args": []}))
    }

    /// Runs `js` until it returns something other than null (at most 60 s).
    fn wait_for(&self, what: &str, js: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let v = self.script(js);
            if !v.is_null() {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = std::panic::catch_unwind(|| {
                request(self.addr, "DELETE", &format!("/session/{}", self.session), &[], None)
            });
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// The page's error messages, if any.
const ERRORS_JS: &str = "return [...document.querySelectorAll('.msg.error')].map(e => e.textContent);";

/// Sends `text` from the page and returns the finished reply of assistant bubble `turn`.
fn send_from_page(browser: &Browser, turn: usize, text: &str) -> String {
    browser.type_into("#input", text);
    browser.click("#send");
    let js = format!(
        "const b = document.querySelectorAll('.msg.assistant')[{turn}];
         return b && b.dataset.done === 'true' ? b.textContent : null;"
    );
    let reply = browser.wait_for("the streamed reply", &js);
    assert_eq!(browser.script(ERRORS_JS), json!([]), "the page shows an error");
    reply.as_str().unwrap().to_string()
}

fn greedy_reply(server: &TestServer, key: &str, messages: &Value) -> String {
    let body = json!({"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12});
    let auth = format!("Bearer {key}");
    let headers = [("Content-Type", "application/json"), ("Authorization", auth.as_str())];
    let r = server.post_raw("/v1/chat/completions", &headers, body.to_string().as_bytes());
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

#[test]
fn chat_page_streams_the_greedy_reply_and_keeps_the_conversation() {
    // A key on the API: the page itself loads without it, and sends the one typed into it.
    let key = "page-secret";
    let config = ServerConfig { model_name: MODEL.into(), api_key: Some(key.into()), ..Default::default() };
    let server = TestServer::start(MODEL, config, None);
    let page = server.get("/");
    assert_eq!(page.status, 200);
    assert!(page.header("content-type").unwrap().starts_with("text/html"));
    assert!(!page.body.contains("http://") && !page.body.contains("https://"), "the page must be self-contained");

    let system = "You are terse.";
    let first = "hello there";
    let second = "and again";
    let expected_first =
        greedy_reply(&server, key, &json!([{"role": "system", "content": system}, {"role": "user", "content": first}]));

    let browser = Browser::start();
    browser.cmd("POST", "/url", json!({"url": format!("http://{}/", server.addr)}));
    browser.type_into("#api-key", key);
    // The model list loads once the key is entered (its change event fires on blur).
    browser.click("#temperature");
    let model = browser
        .wait_for("the model list", "const o = document.querySelector('#model option'); return o ? o.value : null;");
    assert_eq!(model, MODEL);
    browser.type_into("#temperature", "0");
    browser.type_into("#max-tokens", "12");
    browser.type_into("#system", system);

    let reply = send_from_page(&browser, 0, first);
    assert!(!reply.is_empty(), "the greedy reply is empty");
    assert_eq!(reply, expected_first);

    // The second turn carries the first one.
    let expected_second = greedy_reply(
        &server,
        key,
        &json!([
            {"role": "system", "content": system},
            {"role": "user", "content": first},
            {"role": "assistant", "content": expected_first},
            {"role": "user", "content": second},
        ]),
    );
    assert_eq!(send_from_page(&browser, 1, second), expected_second);
    let users = browser.script("return [...document.querySelectorAll('.msg.user')].map(e => e.textContent);");
    assert_eq!(users, json!([first, second]));
}

#[test]
fn chat_page_thinking_box_and_thoughts() {
    // A Gemma 4 fixture on the built-in template whose tokenizer names two tokens of the
    // thinking-mode greedy answer as the thought-channel markers (tests/thoughts).
    let think = json!({"chat_template_kwargs": {"enable_thinking": true}, "ignore_eos": false, "max_tokens": 24});
    let f = thoughts::thought_fixture(
        "ple_shared_dw",
        "page",
        &["config.json", "model.safetensors", "tokenizer.json"],
        &think,
    );
    let config = ServerConfig { model_name: "m".into(), ..Default::default() };
    let server = TestServer::start_dir(&f.dir, config, None);

    let browser = Browser::start();
    browser.cmd("POST", "/url", json!({"url": format!("http://{}/", server.addr)}));
    browser.wait_for("the model list", "const o = document.querySelector('#model option'); return o ? o.value : null;");
    browser.type_into("#temperature", "0");
    browser.type_into("#max-tokens", "24");
    browser.click("#think");
    // The answer is the thinking-mode one (the box reached the template), without the thoughts,
    // which sit in their own collapsed block before it.
    assert_eq!(send_from_page(&browser, 0, "the cat sat"), f.want_content);
    let shown = browser.script(
        "const t = document.querySelector('.msg.thoughts');
         return t ? [t.open, t.querySelector('summary').textContent, t.lastChild.textContent] : null;",
    );
    assert_eq!(shown, json!([false, "Thoughts", f.want_reasoning]));
    drop(browser);
    drop(server);
    std::fs::remove_dir_all(&f.dir).unwrap();
}
