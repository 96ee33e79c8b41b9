//! Errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}` with the
//! HTTP status that says whose fault it is.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use megagemma_model::error::{Error as ModelError, ErrorKind};

#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    pub message: String,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, kind, code: None, param: None, message: message.into() }
    }

    fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// A parameter with a wrong value.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::bad_request(message).with_code("invalid_value");
        e.param = Some(param.to_string());
        e
    }

    /// The prompt (`param`: `messages` or `prompt`) and the token budget do not fit the context.
    pub fn context_exceeded(param: Option<&str>, message: impl Into<String>) -> Self {
        let mut e = Self::bad_request(message).with_code("context_length_exceeded");
        e.param = param.map(str::to_string);
        e
    }

    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", "invalid or missing API key")
            .with_code("invalid_api_key")
    }

    pub fn model_not_found(name: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("the model `{name}` does not exist (this server serves `{served}`)"),
        )
        .with_code("model_not_found");
        e.param = Some("model".into());
        e
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("no such endpoint: {path}"))
            .with_code("not_found")
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_overloaded", message).with_code("queue_full")
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// A status from a rejected request body (413 when too large, 400 otherwise).
    pub fn from_status(status: StatusCode, message: impl Into<String>) -> Self {
        let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
        Self::new(status, kind, message)
    }

    /// A backend failure: the client's fault (400) or ours (500).
    pub fn from_model(e: &ModelError) -> Self {
        match e.kind() {
            ErrorKind::InvalidInput => Self::bad_request(e.to_string()),
            ErrorKind::Capacity => Self::context_exceeded(None, e.to_string()),
            ErrorKind::Other => Self::internal(e.to_string()),
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
