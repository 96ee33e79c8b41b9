//! An OpenAI-compatible HTTP server over one loaded model.
//!
//! Handlers parse and validate requests, build prompts and stream replies; one scheduler
//! thread ([`scheduler`]) owns the backend and batches every running request into one decode
//! step per token. `GET /` serves a chat page (`chat.html`) that streams from the chat API.

mod error;
mod metrics;
mod prefix_cache;
mod request;
mod response;
mod routes;
mod scheduler;
mod stop_text;

pub use error::ApiError;
pub use scheduler::SchedulerConfig;

use anyhow::{Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use megagemma_engine::model_files::ChatModel;
use megagemma_model::backend::Backend;
use metrics::Metrics;
use scheduler::SchedulerHandle;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

pub struct ServerConfig {
    /// The name clients give as `model` (`GET /v1/models` lists it).
    pub model_name: String,
    /// Clients must send `Authorization: Bearer KEY` when set.
    pub api_key: Option<String>,
    /// Requests that may wait for a sequence; more get 503.
    pub max_queue: usize,
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Finished sequences kept so that prompts sharing their prefix skip its prefill (0 = off).
    pub prefix_cache: usize,
    /// Tokens drafted per round while one greedy request runs alone (0 = off).
    pub draft_k: usize,
    /// Draft with the backend's MTP assistant (loaded beside the target) instead of prompt lookup.
    pub draft_mtp: bool,
    /// Prompt tokens prefilled per scheduler tick (over as many prompts as that covers), between
    /// decode steps (0 = every waiting prompt whole).
    pub prefill_chunk: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_name: "model".into(),
            api_key: None,
            max_queue: 64,
            max_batch: 16,
            max_body_bytes: 4 << 20,
            prefix_cache: 4,
            draft_k: 0,
            draft_mtp: false,
            prefill_chunk: 256,
        }
    }
}

pub(crate) struct AppState {
    model_name: String,
    api_key: Option<String>,
    chat: ChatModel,
    scheduler: SchedulerHandle,
    metrics: Arc<Metrics>,
    started_unix: u64,
}

/// A loaded server: the scheduler runs; [`Server::serve`] answers HTTP until shut down.
pub struct Server {
    state: Arc<AppState>,
    scheduler_thread: std::thread::JoinHandle<()>,
    max_body_bytes: usize,
    shutdown: watch::Sender<bool>,
}

/// Asks a running server to stop (graceful: running requests end at their next token).
#[derive(Clone)]
pub struct ShutdownHandle(watch::Sender<bool>);

impl ShutdownHandle {
    pub fn shutdown(&self) {
        let _ = self.0.send(true);
    }
}

impl Server {
    pub fn new(config: ServerConfig, backend: Box<dyn Backend>, chat: ChatModel) -> Result<Server> {
        let metrics = Arc::new(Metrics::default());
        let sched_config = SchedulerConfig {
            max_queue: config.max_queue,
            max_batch: config.max_batch,
            prefix_cache: config.prefix_cache,
            draft_k: config.draft_k,
            draft_mtp: config.draft_mtp,
            prefill_chunk: config.prefill_chunk,
        };
        let (scheduler, scheduler_thread) =
            scheduler::spawn(backend, chat.tokenizer.clone(), chat.stop_ids.clone(), sched_config, metrics.clone())
                .context("cannot start the scheduler thread")?;
        let started_unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let state = Arc::new(AppState {
            model_name: config.model_name,
            api_key: config.api_key,
            chat,
            scheduler,
            metrics,
            started_unix,
        });
        let (shutdown, _) = watch::channel(false);
        Ok(Server { state, scheduler_thread, max_body_bytes: config.max_body_bytes, shutdown })
    }

    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(self.shutdown.clone())
    }

    fn router(&self) -> Router {
        let state = self.state.clone();
        let api = Router::new()
            .route("/v1/chat/completions", post(routes::chat_completions))
            .route("/v1/completions", post(routes::completions))
            .route("/v1/models", get(routes::models))
            .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
        Router::new()
            .merge(api)
            // Outside the key check: the page itself sends the key its user types.
            .route("/", get(routes::chat_page))
            .route("/health", get(routes::health))
            .route("/metrics", get(routes::metrics))
            .fallback(routes::not_found)
            .layer(DefaultBodyLimit::max(self.max_body_bytes))
            .layer(middleware::from_fn_with_state(state.clone(), count_requests))
            .with_state(state)
    }

    /// Answers on `listener` until SIGINT/SIGTERM (when `signals`) or the shutdown handle,
    /// then ends the running requests, waits for the scheduler and returns.
    pub async fn serve(self, listener: tokio::net::TcpListener, signals: bool) -> Result<()> {
        let app = self.router();
        let mut stop = self.shutdown.subscribe();
        let state = self.state.clone();
        let shutdown = async move {
            let handle = async move {
                while !*stop.borrow_and_update() {
                    if stop.changed().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                }
            };
            if signals {
                tokio::select! { _ = handle => {}, _ = termination_signal() => {} }
            } else {
                handle.await;
            }
            state.scheduler.drain();
        };
        axum::serve(listener, app).with_graceful_shutdown(shutdown).await.context("the HTTP server failed")?;
        let Server { state, scheduler_thread, .. } = self;
        drop(state); // the last handle: the scheduler thread ends when its work is done
        tokio::task::spawn_blocking(move || scheduler_thread.join())
            .await
            .ok()
            .and_then(|r| r.ok())
            .context("the scheduler thread panicked")?;
        Ok(())
    }

    /// [`serve`](Self::serve) on a runtime of its own, blocking the calling thread.
    pub fn serve_blocking(self, listener: std::net::TcpListener, signals: bool) -> Result<()> {
        let rt =
            tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the runtime")?;
        rt.block_on(async move {
            listener.set_nonblocking(true)?;
            let listener = tokio::net::TcpListener::from_std(listener)?;
            self.serve(listener, signals).await
        })
    }
}

async fn termination_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
}

async fn require_key(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if routes::authorized(&app, req.headers()) {
        next.run(req).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

async fn count_requests(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = match req.uri().path() {
        p @ ("/v1/chat/completions" | "/v1/completions" | "/v1/models" | "/health" | "/metrics") => p.to_string(),
        _ => "other".to_string(),
    };
    let resp = next.run(req).await;
    app.metrics.record_request(&path, resp.status().as_u16());
    resp
}
