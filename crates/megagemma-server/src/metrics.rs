//! Counters behind `GET /metrics`, in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

#[derive(Default)]
pub struct Metrics {
    /// Finished HTTP requests by (path, status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Requests accepted and waiting for a sequence.
    pub queue_depth: AtomicUsize,
    /// Backend sequences alive.
    pub active_sequences: AtomicUsize,
    /// Finished sequences kept for prefix reuse.
    pub cached_sequences: AtomicUsize,
    /// Prompt tokens taken from cached sequences instead of being prefilled.
    pub prefix_cache_hit_tokens: AtomicU64,
    /// Speculative rounds: tokens drafted and accepted.
    pub drafted_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    /// Requests whose client went away before the end.
    pub cancelled: AtomicU64,
    /// Prefill calls (a prompt longer than the chunk size takes several, between decode steps).
    pub prefill_chunks: AtomicU64,
    timings: Mutex<Timings>,
}

#[derive(Default)]
struct Timings {
    ttft_sum: f64,
    ttft_count: u64,
    decode_seconds: f64,
    decode_tokens: u64,
    decode_steps: u64,
    /// Tokens per second of the latest batched decode step (all sequences together).
    last_decode_rate: f64,
}

impl Metrics {
    pub fn record_request(&self, path: &str, status: u16) {
        let mut r = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        *r.entry((path.to_string(), status)).or_default() += 1;
    }

    pub fn record_ttft(&self, seconds: f64) {
        let mut t = self.timings.lock().unwrap_or_else(|e| e.into_inner());
        t.ttft_sum += seconds;
        t.ttft_count += 1;
    }

    /// One batched decode step: `tokens` columns in `seconds`.
    pub fn record_decode_step(&self, tokens: usize, seconds: f64) {
        let mut t = self.timings.lock().unwrap_or_else(|e| e.into_inner());
        t.decode_seconds += seconds;
        t.decode_tokens += tokens as u64;
        t.decode_steps += 1;
        t.last_decode_rate = if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 };
    }

    pub fn record_drafts(&self, drafted: usize, accepted: usize) {
        self.drafted_tokens.fetch_add(drafted as u64, Ordering::Relaxed);
        self.accepted_tokens.fetch_add(accepted as u64, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let mut s = String::new();
        s.push_str("# HELP megagemma_requests_total HTTP requests answered, by path and status.\n");
        s.push_str("# TYPE megagemma_requests_total counter\n");
        for ((path, status), n) in self.requests.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(s, "megagemma_requests_total{{path=\"{path}\",status=\"{status}\"}} {n}");
        }
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let gauge = |a: &AtomicUsize| a.load(Ordering::Relaxed);
        metric(
            &mut s,
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            load(&self.prompt_tokens),
        );
        metric(&mut s, "generation_tokens_total", "counter", "Tokens generated.", load(&self.generated_tokens));
        metric(
            &mut s,
            "requests_cancelled_total",
            "counter",
            "Requests whose client left early.",
            load(&self.cancelled),
        );
        let chunks = load(&self.prefill_chunks);
        metric(&mut s, "prefill_chunks_total", "counter", "Prefill passes (prompts are prefilled in chunks).", chunks);
        let hits = load(&self.prefix_cache_hit_tokens);
        metric(&mut s, "prefix_cache_hit_tokens_total", "counter", "Prompt tokens reused from cached sequences.", hits);
        metric(&mut s, "draft_tokens_total", "counter", "Tokens drafted by prompt lookup.", load(&self.drafted_tokens));
        let accepted = load(&self.accepted_tokens);
        metric(&mut s, "draft_accepted_tokens_total", "counter", "Drafted tokens the target accepted.", accepted);
        let cached = gauge(&self.cached_sequences);
        metric(&mut s, "cached_sequences", "gauge", "Finished sequences kept for prefix reuse.", cached);
        metric(&mut s, "queue_depth", "gauge", "Requests waiting for a sequence.", gauge(&self.queue_depth));
        metric(&mut s, "active_sequences", "gauge", "Sequences held by the backend.", gauge(&self.active_sequences));
        let t = self.timings.lock().unwrap_or_else(|e| e.into_inner());
        s.push_str("# HELP megagemma_time_to_first_token_seconds From request arrival to its first token.\n");
        s.push_str("# TYPE megagemma_time_to_first_token_seconds summary\n");
        let _ = writeln!(s, "megagemma_time_to_first_token_seconds_sum {}", t.ttft_sum);
        let _ = writeln!(s, "megagemma_time_to_first_token_seconds_count {}", t.ttft_count);
        metric(&mut s, "decode_seconds_total", "counter", "Time spent in batched decode steps.", t.decode_seconds);
        metric(&mut s, "decode_tokens_total", "counter", "Tokens produced by batched decode steps.", t.decode_tokens);
        metric(&mut s, "decode_steps_total", "counter", "Batched decode steps (one weight pass each).", t.decode_steps);
        let avg = if t.decode_seconds > 0.0 { t.decode_tokens as f64 / t.decode_seconds } else { 0.0 };
        metric(&mut s, "decode_tokens_per_second", "gauge", "Aggregate decode rate over all steps so far.", avg);
        metric(
            &mut s,
            "last_step_tokens_per_second",
            "gauge",
            "Aggregate rate of the latest decode step.",
            t.last_decode_rate,
        );
        s
    }
}

fn metric(s: &mut String, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
    let _ = writeln!(s, "# HELP megagemma_{name} {help}\n# TYPE megagemma_{name} {kind}\nmegagemma_{name} {value}");
}
