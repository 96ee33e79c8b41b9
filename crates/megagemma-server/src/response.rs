//! Reply bodies in the OpenAI schema: whole responses, stream chunks, usage.

use crate::request::{Endpoint, GenSpec};
use crate::scheduler::{Event, FinishReason, TokenLogprob};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Everything a reply needs besides the events.
pub struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    pub spec: GenSpec,
    prompt_tokens: usize,
}

/// One choice's output so far.
#[derive(Default)]
struct ChoiceOut {
    text: String,
    reasoning: String,
    ids: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    finish: Option<FinishReason>,
    completion_tokens: usize,
}

/// The events of all choices, gathered.
pub struct Collected {
    choices: Vec<ChoiceOut>,
}

impl Collected {
    pub fn new(n: usize) -> Self {
        Collected { choices: (0..n).map(|_| ChoiceOut::default()).collect() }
    }

    /// Adds one event; true once every choice has finished.
    pub fn add(&mut self, ev: Event) -> bool {
        match ev {
            Event::Token { index, text, reasoning, id, logprob } => {
                if let Some(c) = self.choices.get_mut(index) {
                    c.text.push_str(&text);
                    c.reasoning.push_str(&reasoning);
                    c.ids.push(id);
                    c.logprobs.extend(logprob);
                }
            }
            Event::Finished { index, reason, completion_tokens } => {
                if let Some(c) = self.choices.get_mut(index) {
                    c.finish = Some(reason);
                    c.completion_tokens = completion_tokens;
                }
            }
            Event::Failed(_) => {}
        }
        self.choices.iter().all(|c| c.finish.is_some())
    }

    fn completion_tokens(&self) -> usize {
        self.choices.iter().map(|c| c.completion_tokens).sum()
    }
}

impl Reply {
    pub fn new(endpoint: Endpoint, model: &str, spec: GenSpec, prompt_tokens: usize) -> Self {
        let prefix = if endpoint == Endpoint::Chat { "chatcmpl" } else { "cmpl" };
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let id = format!("{prefix}-{created:x}{:06x}", NEXT_ID.fetch_add(1, Ordering::Relaxed));
        Reply { endpoint, id, created, model: model.to_string(), spec, prompt_tokens }
    }

    fn usage(&self, completion_tokens: usize) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Vec<Value>) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        })
    }

    /// The non-streamed response.
    pub fn whole(&self, c: &Collected) -> Value {
        let choices = c
            .choices
            .iter()
            .enumerate()
            .map(|(index, ch)| {
                let finish = ch.finish.map(FinishReason::as_str);
                let logprobs = self.logprobs_value(&ch.logprobs, 0);
                let mut v = match self.endpoint {
                    Endpoint::Chat => {
                        let mut message = json!({"role": "assistant", "content": ch.text});
                        if !ch.reasoning.is_empty() {
                            message["reasoning_content"] = json!(ch.reasoning);
                        }
                        json!({
                            "index": index,
                            "message": message,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                        })
                    }
                    Endpoint::Completions => json!({
                        "index": index,
                        "text": ch.text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    }),
                };
                if self.spec.return_token_ids {
                    v["token_ids"] = json!(ch.ids);
                }
                v
            })
            .collect();
        let mut v = self.envelope(false, choices);
        v["usage"] = self.usage(c.completion_tokens());
        v
    }

    /// The first chunk of a streamed chat choice: the assistant role.
    pub fn opening_chunk(&self, index: usize) -> Option<Value> {
        (self.endpoint == Endpoint::Chat).then(|| {
            let choice = json!({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            self.with_null_usage(self.envelope(true, vec![choice]))
        })
    }

    /// The stream chunk for one event (none for a token whose text is still held back).
    pub fn chunk(&self, ev: &Event) -> Option<Value> {
        let choice = match ev {
            Event::Token { index, text, reasoning, id, logprob } => {
                if text.is_empty() && reasoning.is_empty() && logprob.is_none() && !self.spec.return_token_ids {
                    return None;
                }
                let logprobs =
                    logprob.as_ref().map_or(Value::Null, |lp| self.logprobs_value(std::slice::from_ref(lp), 0));
                let mut c = match self.endpoint {
                    Endpoint::Chat => {
                        // A thought token's chunk carries `reasoning_content` and no `content`.
                        let delta = if reasoning.is_empty() {
                            json!({"content": text})
                        } else if text.is_empty() {
                            json!({"reasoning_content": reasoning})
                        } else {
                            json!({"content": text, "reasoning_content": reasoning})
                        };
                        json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": null})
                    }
                    Endpoint::Completions => {
                        json!({"index": index, "text": text, "logprobs": logprobs, "finish_reason": null})
                    }
                };
                if self.spec.return_token_ids {
                    c["token_ids"] = json!([id]);
                }
                c
            }
            Event::Finished { index, reason, .. } => match self.endpoint {
                Endpoint::Chat => {
                    json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": reason.as_str()})
                }
                Endpoint::Completions => {
                    json!({"index": index, "text": "", "logprobs": null, "finish_reason": reason.as_str()})
                }
            },
            Event::Failed(_) => return None,
        };
        Some(self.with_null_usage(self.envelope(true, vec![choice])))
    }

    /// With `stream_options.include_usage`: a last chunk with no choices and the usage.
    pub fn usage_chunk(&self, c: &Collected) -> Option<Value> {
        self.spec.include_usage.then(|| {
            let mut v = self.envelope(true, Vec::new());
            v["usage"] = self.usage(c.completion_tokens());
            v
        })
    }

    fn with_null_usage(&self, mut v: Value) -> Value {
        if self.spec.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// Log-probabilities of a run of tokens; `offset` is the text offset of the first one.
    fn logprobs_value(&self, lps: &[TokenLogprob], offset: usize) -> Value {
        if self.spec.logprobs.is_none() {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Chat => {
                let entry =
                    |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
                let content: Vec<Value> = lps
                    .iter()
                    .map(|lp| {
                        let mut e = entry(&lp.token, lp.logprob);
                        e["top_logprobs"] = lp.top.iter().map(|(t, l)| entry(t, *l)).collect();
                        e
                    })
                    .collect();
                json!({"content": content})
            }
            Endpoint::Completions => {
                let mut text_offset = Vec::with_capacity(lps.len());
                let mut at = offset;
                for lp in lps {
                    text_offset.push(at);
                    at += lp.token.len();
                }
                let top: Vec<Value> = lps
                    .iter()
                    .map(|lp| Value::Object(lp.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect()))
                    .collect();
                json!({
                    "tokens": lps.iter().map(|lp| lp.token.as_str()).collect::<Vec<_>>(),
                    "token_logprobs": lps.iter().map(|lp| lp.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": text_offset,
                })
            }
        }
    }
}
