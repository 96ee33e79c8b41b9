//! The HTTP endpoints: request parsing, prompt building, and the replies (whole or streamed).

use crate::error::ApiError;
use crate::request::{completion_prompt, message_text, ChatRequest, CompletionRequest, Endpoint, GenSpec, PromptIn};
use crate::response::{Collected, Reply};
use crate::scheduler::{Event, Job};
use crate::AppState;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use megagemma_engine::chat_template::{encode_chat_with, ChatMessage};
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub async fn chat_completions(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match chat(&app, body) {
        Ok(g) => g.respond().await,
        Err(e) => e.into_response(),
    }
}

pub async fn completions(State(app): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match completion(&app, body) {
        Ok(g) => g.respond().await,
        Err(e) => e.into_response(),
    }
}

fn chat(app: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Generation, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    app.check_model(req.model.as_deref())?;
    let spec = req.gen.validate(Endpoint::Chat, &app.chat.defaults)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "messages must not be empty"));
    }
    let messages = req
        .messages
        .iter()
        .map(|m| {
            Ok(ChatMessage::new(
                if m.role == "developer" { "system" } else { m.role.as_str() },
                message_text(&m.content)?,
            ))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let vars = req.template_vars()?;
    let prompt = encode_chat_with(&app.chat.tokenizer, &app.chat.template, &messages, &vars)
        .map_err(|e| ApiError::invalid_param("messages", format!("{e:#}")))?;
    app.submit(Endpoint::Chat, prompt, spec)
}

fn completion(app: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Generation, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    app.check_model(req.model.as_deref())?;
    let spec = req.gen.validate(Endpoint::Completions, &app.chat.defaults)?;
    let prompt = match completion_prompt(&req.prompt)? {
        PromptIn::Text(t) => {
            if t.is_empty() {
                return Err(ApiError::invalid_param("prompt", "prompt must not be empty"));
            }
            app.chat.tokenizer.encode(&t, true).map_err(|e| ApiError::invalid_param("prompt", format!("{e:#}")))?
        }
        PromptIn::Ids(ids) => ids,
    };
    app.submit(Endpoint::Completions, prompt, spec)
}

/// The body as JSON of type `T`: 413 when too large, 400 when it does not parse.
fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| ApiError::from_status(r.status(), r.body_text()))?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

impl AppState {
    fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            Some(name) if name != self.model_name => Err(ApiError::model_not_found(name, &self.model_name)),
            _ => Ok(()),
        }
    }

    /// Checks the prompt against the vocabulary and the context, and queues it.
    fn submit(&self, endpoint: Endpoint, prompt: Vec<u32>, spec: GenSpec) -> Result<Generation, ApiError> {
        let param = if endpoint == Endpoint::Chat { "messages" } else { "prompt" };
        if prompt.is_empty() {
            return Err(ApiError::invalid_param(param, "the prompt is empty"));
        }
        let vocab = self.scheduler.vocab_size;
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid_param(
                param,
                format!("token id {bad} is out of range (vocab size is {vocab})"),
            ));
        }
        let ctx = self.scheduler.max_context;
        let max_tokens = match spec.max_tokens {
            Some(m) => m,
            None => ctx.saturating_sub(prompt.len()),
        };
        if prompt.len() + max_tokens.max(1) > ctx {
            return Err(ApiError::context_exceeded(
                Some(param),
                format!(
                    "this model's context is {ctx} tokens; the prompt has {} and max_tokens asks for {}: \
                 shorten the prompt or lower max_tokens",
                    prompt.len(),
                    max_tokens.max(1)
                ),
            ));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let prompt_tokens = prompt.len();
        let job = Job { prompt, spec: spec.clone(), max_tokens, events: tx, arrived: Instant::now() };
        self.scheduler.submit(job, &self.metrics)?;
        Ok(Generation { reply: Reply::new(endpoint, &self.model_name, spec, prompt_tokens), events: rx })
    }
}

/// An accepted request: the events of its choices, turned into a reply.
struct Generation {
    reply: Reply,
    events: mpsc::UnboundedReceiver<Event>,
}

impl Generation {
    /// The whole reply, or a stream of events. If the client leaves, the handler (or the
    /// stream) is dropped with the receiver, which the scheduler sees as a cancellation.
    async fn respond(mut self) -> Response {
        if self.reply.spec.stream {
            return stream_response(self);
        }
        let mut c = Collected::new(self.reply.spec.n);
        while let Some(ev) = self.events.recv().await {
            if let Event::Failed(e) = ev {
                return e.into_response();
            }
            if c.add(ev) {
                break;
            }
        }
        Json(self.reply.whole(&c)).into_response()
    }
}

/// Server-sent events: one `data: {chunk}` per event, then `data: [DONE]`.
fn stream_response(g: Generation) -> Response {
    struct St {
        g: Generation,
        pending: std::collections::VecDeque<String>,
        c: Collected,
        done: bool,
    }
    let n = g.reply.spec.n;
    let mut pending = std::collections::VecDeque::new();
    for index in 0..n {
        if let Some(first) = g.reply.opening_chunk(index) {
            pending.push_back(first.to_string());
        }
    }
    let st = St { g, pending, c: Collected::new(n), done: false };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(data) = st.pending.pop_front() {
                return Some((Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {data}\n\n"))), st));
            }
            if st.done {
                return None;
            }
            match st.g.events.recv().await {
                None => {
                    st.done = true;
                    st.pending.push_back("[DONE]".into());
                }
                Some(Event::Failed(e)) => {
                    st.done = true;
                    st.pending.push_back(e.body().to_string());
                    st.pending.push_back("[DONE]".into());
                }
                Some(ev) => {
                    if let Some(chunk) = st.g.reply.chunk(&ev) {
                        st.pending.push_back(chunk.to_string());
                    }
                    if st.c.add(ev) {
                        st.done = true;
                        if let Some(usage) = st.g.reply.usage_chunk(&st.c) {
                            st.pending.push_back(usage.to_string());
                        }
                        st.pending.push_back("[DONE]".into());
                    }
                }
            }
        }
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")],
        Body::from_stream(stream),
    )
        .into_response()
}

pub async fn models(State(app): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "object": "list",
        "data": [{
            "id": app.model_name,
            "object": "model",
            "created": app.started_unix,
            "owned_by": "megagemma",
            "max_model_len": app.scheduler.max_context,
        }],
    }))
}

/// The chat page: one self-contained HTML file that talks to the API above.
pub async fn chat_page() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("chat.html")).into_response()
}

pub async fn health() -> Json<serde_json::Value> {
    Json(serde_json::json!({"status": "ok"}))
}

pub async fn metrics(State(app): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.metrics.render()).into_response()
}

pub async fn not_found(uri: Uri) -> ApiError {
    ApiError::not_found(uri.path())
}

/// `Authorization: Bearer KEY` must match when the server has a key.
pub fn authorized(app: &AppState, headers: &HeaderMap) -> bool {
    let Some(key) = &app.api_key else { return true };
    let given =
        headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    given.is_some_and(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
