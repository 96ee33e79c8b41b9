//! Request bodies of the OpenAI endpoints and their validation into one [`GenSpec`].

use crate::error::ApiError;
use megagemma_engine::sampling::{GenerationDefaults, SamplingParams};
use serde::Deserialize;
use serde_json::Value;

/// Most choices one request may ask for (`n`).
pub const MAX_CHOICES: usize = 16;
/// Most alternatives per position (`top_logprobs`), as OpenAI allows.
pub const MAX_TOP_LOGPROBS: usize = 20;

#[derive(Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    /// Extra chat-template variables, as vLLM accepts, e.g. `{"enable_thinking": true}` for
    /// Gemma 4's thinking mode.
    pub chat_template_kwargs: Option<Value>,
    #[serde(flatten)]
    pub gen: GenFields,
}

#[derive(Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, or an array of `{"type": "text", "text": ...}` parts.
    #[serde(default)]
    pub content: Value,
}

#[derive(Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// A string, a one-element array of strings, or an array of token ids.
    pub prompt: Value,
    #[serde(flatten)]
    pub gen: GenFields,
}

/// The generation fields both endpoints share.
#[derive(Deserialize, Default)]
pub struct GenFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub stop: Option<Value>,
    pub seed: Option<u64>,
    /// Chat: a boolean; completions: how many alternatives per position.
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<i64>,
    pub n: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Generate until max_tokens even past end-of-sequence ids (as vLLM accepts).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Add each choice's generated token ids to the response (as vLLM accepts).
    #[serde(default)]
    pub return_token_ids: bool,
}

#[derive(Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// A validated generation request, prompt aside.
#[derive(Clone, Debug)]
pub struct GenSpec {
    pub sampling: SamplingParams,
    /// `None`: up to the context limit.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    /// Log-probabilities of the chosen tokens, with this many alternatives each.
    pub logprobs: Option<usize>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
    pub return_token_ids: bool,
    /// Chat: the thought channel (`<|channel>…<channel|>`) goes to `reasoning_content`, apart
    /// from the answer.
    pub split_thoughts: bool,
}

impl ChatRequest {
    /// `chat_template_kwargs` as template variables: an object, or nothing.
    pub fn template_vars(&self) -> Result<Value, ApiError> {
        match &self.chat_template_kwargs {
            None | Some(Value::Null) => Ok(Value::Object(Default::default())),
            Some(v @ Value::Object(_)) => Ok(v.clone()),
            Some(_) => Err(ApiError::invalid_param("chat_template_kwargs", "chat_template_kwargs must be an object")),
        }
    }
}

impl GenFields {
    pub fn validate(&self, endpoint: Endpoint, defaults: &GenerationDefaults) -> Result<GenSpec, ApiError> {
        let base = defaults.sampling_params(self.seed);
        let top_k = match self.top_k {
            None => base.top_k,
            Some(k) if k == -1 || k == 0 => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid_param("top_k", format!("top_k {k} must be >= 0 (0 or -1 = disabled)")))
            }
        };
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(base.temperature),
            top_k,
            top_p: self.top_p.unwrap_or(base.top_p),
            min_p: self.min_p.unwrap_or(base.min_p),
            seed: self.seed,
        };
        if let Err(e) = sampling.validate() {
            let param = match e {
                megagemma_engine::sampling::SamplingError::InvalidTopP(_) => "top_p",
                megagemma_engine::sampling::SamplingError::InvalidMinP(_) => "min_p",
                _ => "temperature",
            };
            return Err(ApiError::invalid_param(param, e.to_string()));
        }
        let max_tokens = match self.max_completion_tokens.or(self.max_tokens) {
            None => None,
            Some(m) if m >= 1 => Some(m as usize),
            Some(m) => return Err(ApiError::invalid_param("max_tokens", format!("max_tokens {m} must be at least 1"))),
        };
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_CHOICES as i64).contains(&n) => n as usize,
            Some(n) => return Err(ApiError::invalid_param("n", format!("n {n} must be between 1 and {MAX_CHOICES}"))),
        };
        Ok(GenSpec {
            sampling,
            max_tokens,
            stop: parse_stop(self.stop.as_ref())?,
            logprobs: self.parse_logprobs(endpoint)?,
            n,
            stream: self.stream,
            include_usage: self.stream_options.as_ref().is_some_and(|o| o.include_usage),
            ignore_eos: self.ignore_eos,
            return_token_ids: self.return_token_ids,
            split_thoughts: endpoint == Endpoint::Chat,
        })
    }

    fn parse_logprobs(&self, endpoint: Endpoint) -> Result<Option<usize>, ApiError> {
        let top = match self.top_logprobs {
            None => None,
            Some(t) if (0..=MAX_TOP_LOGPROBS as i64).contains(&t) => Some(t as usize),
            Some(t) => {
                return Err(ApiError::invalid_param(
                    "top_logprobs",
                    format!("top_logprobs {t} must be between 0 and {MAX_TOP_LOGPROBS}"),
                ))
            }
        };
        match (endpoint, &self.logprobs) {
            (_, None | Some(Value::Null)) | (Endpoint::Chat, Some(Value::Bool(false))) => {
                if top.is_some_and(|t| t > 0) {
                    return Err(ApiError::invalid_param("top_logprobs", "top_logprobs needs logprobs: true"));
                }
                Ok(None)
            }
            (Endpoint::Chat, Some(Value::Bool(true))) => Ok(Some(top.unwrap_or(0))),
            (Endpoint::Completions, Some(v)) if v.as_u64().is_some_and(|t| t <= MAX_TOP_LOGPROBS as u64) => {
                Ok(Some(v.as_u64().unwrap_or(0) as usize))
            }
            (Endpoint::Chat, Some(_)) => Err(ApiError::invalid_param("logprobs", "logprobs must be a boolean")),
            (Endpoint::Completions, Some(_)) => Err(ApiError::invalid_param(
                "logprobs",
                format!("logprobs must be an integer between 0 and {MAX_TOP_LOGPROBS}"),
            )),
        }
    }
}

/// `stop`: a string or up to four strings.
fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid_param("stop", "stop must be a string or an array of up to 4 non-empty strings");
    let stops: Vec<String> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) if items.len() <= 4 => {
            items.iter().map(|i| i.as_str().map(str::to_string).ok_or_else(bad)).collect::<Result<_, _>>()?
        }
        Some(_) => return Err(bad()),
    };
    if stops.iter().any(String::is_empty) {
        return Err(bad());
    }
    Ok(stops)
}

/// A message's text: a string, or the text parts of an array.
pub fn message_text(content: &Value) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    _ => {
                        return Err(ApiError::invalid_param(
                            "messages",
                            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid_param("messages", "message content must be a string or an array of parts")),
    }
}

/// What `/v1/completions` got as its prompt.
pub enum PromptIn {
    Text(String),
    Ids(Vec<u32>),
}

pub fn completion_prompt(v: &Value) -> Result<PromptIn, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "prompt",
            "prompt must be a string, a one-element array of strings, or an array of token ids",
        )
    };
    match v {
        Value::String(s) => Ok(PromptIn::Text(s.clone())),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            Ok(PromptIn::Text(items[0].as_str().unwrap_or_default().to_string()))
        }
        Value::Array(items) if items.iter().all(Value::is_u64) => items
            .iter()
            .map(|i| i.as_u64().and_then(|x| u32::try_from(x).ok()).ok_or_else(bad))
            .collect::<Result<_, _>>()
            .map(PromptIn::Ids),
        _ => Err(bad()),
    }
}
