//! The scheduler thread: it owns the backend (which is `Send`, not `Sync`) and runs every
//! request on it. Each tick admits waiting requests (a sequence each, its prompt queued for
//! prefill), prefills up to a budget of prompt tokens, oldest prompt first (a completed prompt:
//! `fork` for `n > 1` and the first tokens), drops sequences whose client went away, then advances all
//! active sequences by one token in a single `Backend::step` — whose columns are computed exactly
//! as lone sequences would be, so a request's output does not depend on what else runs beside it.
//! Prefilling in chunks keeps a long prompt from pausing the running streams for its whole length.

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::prefix_cache::PrefixCache;
use crate::request::GenSpec;
use crate::stop_text::StopText;
use megagemma_engine::generate::decode::{uniforms_for, want_for};
use megagemma_engine::generate::speculate::{Drafter, LookupDrafter, MtpDrafter};
use megagemma_engine::sampling::{Sampler, SamplingParams};
use megagemma_engine::thoughts::{Part, ThoughtSplitter};
use megagemma_engine::tokenizer::{StreamDecoder, Tokenizer};
use megagemma_model::backend::{top_logprobs, Backend, PosOut, SeqId, Want};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

/// Longest n-gram prompt lookup matches.
const LOOKUP_NGRAM: usize = 3;

/// What a request's handler hears from the scheduler, per choice `index`.
#[derive(Debug)]
pub enum Event {
    /// New output: text released (may be empty while held back), thought-channel text (chat),
    /// and the token's log-probabilities.
    Token {
        index: usize,
        text: String,
        reasoning: String,
        id: u32,
        logprob: Option<TokenLogprob>,
    },
    Finished {
        index: usize,
        reason: FinishReason,
        completion_tokens: usize,
    },
    Failed(ApiError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// One accepted request.
pub struct Job {
    pub prompt: Vec<u32>,
    pub spec: GenSpec,
    /// Resolved token budget (the handler checked it against the context).
    pub max_tokens: usize,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

/// The handlers' side: submit jobs, read limits.
#[derive(Clone)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Job>,
    queued: Arc<AtomicUsize>,
    draining: Arc<AtomicBool>,
    max_queue: usize,
    pub max_context: usize,
    pub vocab_size: usize,
}

impl SchedulerHandle {
    /// Queues a job; 503 when the queue is full or the server is shutting down.
    pub fn submit(&self, job: Job, metrics: &Metrics) -> Result<(), ApiError> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(ApiError::unavailable("the server is shutting down"));
        }
        let reserved = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| (q < self.max_queue).then_some(q + 1))
            .is_ok();
        if !reserved {
            return Err(ApiError::overloaded(format!(
                "the request queue is full ({} waiting); retry later",
                self.max_queue
            )));
        }
        metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        self.tx.send(job).map_err(|_| ApiError::unavailable("the scheduler has stopped"))
    }

    /// Stop taking requests and end the running ones at their next token.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }
}

pub struct SchedulerConfig {
    /// Requests that may wait for a sequence.
    pub max_queue: usize,
    /// Sequences decoded together at most (a request with `n` choices takes `n`).
    pub max_batch: usize,
    /// Finished sequences kept for prompt-prefix reuse (0 = off).
    pub prefix_cache: usize,
    /// Tokens drafted per round while a single greedy sequence runs (0 = off).
    pub draft_k: usize,
    /// Who drafts: the backend's MTP assistant (`Backend::draft`), else prompt lookup.
    pub draft_mtp: bool,
    /// Prompt tokens prefilled per tick, between decode steps, over as many admitted prompts as
    /// that covers (0 = every admitted prompt whole).
    pub prefill_chunk: usize,
}

/// Starts the scheduler thread. It ends when every handle is dropped and its work is done.
pub fn spawn(
    backend: Box<dyn Backend>,
    tokenizer: Tokenizer,
    stop_ids: Vec<u32>,
    config: SchedulerConfig,
    metrics: Arc<Metrics>,
) -> std::io::Result<(SchedulerHandle, std::thread::JoinHandle<()>)> {
    let (tx, rx) = mpsc::channel();
    let handle = SchedulerHandle {
        tx,
        queued: Arc::new(AtomicUsize::new(0)),
        draining: Arc::new(AtomicBool::new(false)),
        max_queue: config.max_queue,
        max_context: backend.max_context(),
        vocab_size: backend.vocab_size(),
    };
    let scheduler = Scheduler {
        backend,
        tokenizer,
        stop_ids,
        max_batch: config.max_batch.max(1),
        draft_k: config.draft_k,
        drafter: match (config.draft_k, config.draft_mtp) {
            (0, _) => None,
            (_, true) => Some(Box::new(MtpDrafter)),
            (_, false) => Some(Box::new(LookupDrafter { max_ngram: LOOKUP_NGRAM })),
        },
        prefill_chunk: config.prefill_chunk,
        rx,
        queued: handle.queued.clone(),
        draining: handle.draining.clone(),
        metrics,
        waiting: VecDeque::new(),
        prefilling: VecDeque::new(),
        active: Vec::new(),
        cache: PrefixCache::new(config.prefix_cache),
    };
    let thread = std::thread::Builder::new().name("scheduler".into()).spawn(move || scheduler.run())?;
    Ok((handle, thread))
}

struct Scheduler {
    backend: Box<dyn Backend>,
    tokenizer: Tokenizer,
    stop_ids: Vec<u32>,
    max_batch: usize,
    draft_k: usize,
    /// Who drafts while one greedy sequence runs alone (`None`: nobody).
    drafter: Option<Box<dyn Drafter>>,
    prefill_chunk: usize,
    rx: mpsc::Receiver<Job>,
    queued: Arc<AtomicUsize>,
    draining: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Job>,
    /// Admitted requests whose prompt is being prefilled, oldest first.
    prefilling: VecDeque<Prefill>,
    active: Vec<Choice>,
    cache: PrefixCache,
}

/// An admitted request on its sequence, `done` prompt tokens of it in the cache so far.
struct Prefill {
    job: Job,
    seq: SeqId,
    done: usize,
    samplers: Vec<Sampler>,
}

/// One choice of one request, on its own backend sequence.
struct Choice {
    seq: SeqId,
    index: usize,
    /// The token to feed at the next step.
    next: u32,
    generated: usize,
    max_tokens: usize,
    ignore_eos: bool,
    sampler: Sampler,
    logprobs: Option<usize>,
    detok: StreamDecoder,
    stop_text: StopText,
    /// Chat: routes ids between the thought channel and the answer.
    thoughts: Option<ThoughtSplitter>,
    thought_detok: StreamDecoder,
    events: UnboundedSender<Event>,
    /// Set for the first choice until its first token (time to first token).
    arrived: Option<Instant>,
    finished: bool,
    /// Why it finished, told to the client once its sequence is freed.
    reason: Option<FinishReason>,
    /// The tokens the sequence's committed positions hold (prompt, then fed tokens).
    tokens: Vec<u32>,
}

impl Scheduler {
    fn run(mut self) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() && self.prefilling.is_empty() {
                match self.rx.recv() {
                    Ok(job) => self.waiting.push_back(job),
                    Err(_) => break, // every handle dropped and nothing left to do
                }
            }
            while let Ok(job) = self.rx.try_recv() {
                self.waiting.push_back(job);
            }
            self.admit();
            self.drop_abandoned();
            if self.draining.load(Ordering::Relaxed) {
                self.finish_all();
            }
            // Up to `prefill_chunk` prompt tokens per tick, over as many admitted prompts as that
            // covers (short prompts start together; a long one takes several ticks).
            let mut budget = if self.prefill_chunk == 0 { usize::MAX } else { self.prefill_chunk };
            while budget > 0 && !self.prefilling.is_empty() {
                budget -= self.prefill_chunk(budget);
            }
            if !self.active.is_empty() {
                self.step();
            }
        }
    }

    /// Sequences running or being prefilled (a prefilling request will take `n`).
    fn busy(&self) -> usize {
        self.active.len() + self.prefilling.iter().map(|p| p.job.spec.n).sum::<usize>()
    }

    fn admit(&mut self) {
        while let Some(job) = self.waiting.front() {
            let fits = self.busy() + job.spec.n <= self.max_batch;
            if !fits && self.busy() > 0 {
                break;
            }
            let job = self.waiting.pop_front().expect("front exists");
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Err(e) = self.start(job) {
                log_server_error(&e);
            }
            self.publish_active();
        }
    }

    /// Takes a job's sequence (from the prefix cache when a finished one shares the prompt's
    /// start) and queues its prompt for prefill.
    fn start(&mut self, job: Job) -> Result<(), ApiError> {
        let fail = |e: ApiError, events: &UnboundedSender<Event>| {
            let _ = events.send(Event::Failed(e.clone()));
            e
        };
        // Choice i of a seeded request draws from seed + i: reproducible, yet distinct.
        let samplers = (0..job.spec.n)
            .map(|i| {
                let seed = job.spec.sampling.seed.map(|s| s.wrapping_add(i as u64));
                Sampler::new(SamplingParams { seed, ..job.spec.sampling.clone() })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| fail(ApiError::bad_request(e.to_string()), &job.events))?;
        let (seq, reused) = match self.cache.lookup(self.backend.as_mut(), &job.prompt) {
            Some(hit) => hit,
            None => (self.new_sequence().map_err(|e| fail(no_room(&e), &job.events))?, 0),
        };
        self.metrics.prefix_cache_hit_tokens.fetch_add(reused as u64, Ordering::Relaxed);
        self.metrics.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        self.prefilling.push_back(Prefill { job, seq, done: reused, samplers });
        Ok(())
    }

    /// Prefills up to `budget` more tokens of the oldest admitted prompt; after its last chunk the
    /// request's choices start. Returns the tokens prefilled (at least one).
    fn prefill_chunk(&mut self, budget: usize) -> usize {
        let Some(mut p) = self.prefilling.pop_front() else { return budget };
        let rest = p.job.prompt.len() - p.done;
        let n = rest.min(budget).max(1);
        let last = n == rest;
        // Only the last chunk's output is used: earlier ones ask for no logits.
        let want = if last { want_for_spec(&p.job.spec) } else { Want::Argmax };
        self.metrics.prefill_chunks.fetch_add(1, Ordering::Relaxed);
        match self.backend.prefill(p.seq, &p.job.prompt[p.done..p.done + n], want) {
            Ok(out) if last => {
                if let Err(e) = self.launch(p, &out) {
                    log_server_error(&e);
                }
            }
            Ok(_) => {
                p.done += n;
                self.prefilling.push_front(p);
            }
            Err(e) => {
                let _ = self.backend.free(p.seq);
                let err = ApiError::from_model(&e);
                let _ = p.job.events.send(Event::Failed(err.clone()));
                log_server_error(&err);
            }
        }
        self.publish_active();
        n
    }

    /// A prefilled request: forks its sequence for each further choice and emits every choice's
    /// first token.
    fn launch(&mut self, p: Prefill, out: &PosOut) -> Result<(), ApiError> {
        let Prefill { job, seq, samplers, .. } = p;
        let mut seqs = vec![seq];
        for _ in 1..job.spec.n {
            match self.backend.fork(seq) {
                Ok(s) => seqs.push(s),
                Err(e) => {
                    for s in seqs {
                        let _ = self.backend.free(s);
                    }
                    let err = no_room(&e);
                    let _ = job.events.send(Event::Failed(err.clone()));
                    return Err(err);
                }
            }
        }
        // Counted before the first tokens go out, so a client never sees its sequence missing.
        self.metrics.active_sequences.store(self.active.len() + seqs.len(), Ordering::Relaxed);
        for (index, (seq, sampler)) in seqs.into_iter().zip(samplers).enumerate() {
            let mut choice = Choice {
                seq,
                index,
                next: 0,
                generated: 0,
                max_tokens: job.max_tokens,
                ignore_eos: job.spec.ignore_eos,
                sampler,
                logprobs: job.spec.logprobs,
                detok: self.tokenizer.stream_decoder(true),
                stop_text: StopText::new(job.spec.stop.clone()),
                thoughts: job.spec.split_thoughts.then(|| ThoughtSplitter::new(&self.tokenizer)),
                thought_detok: self.tokenizer.stream_decoder(true),
                events: job.events.clone(),
                arrived: (index == 0).then_some(job.arrived),
                finished: false,
                reason: None,
                tokens: job.prompt.clone(),
            };
            self.accept(&mut choice, out);
            self.active.push(choice);
        }
        self.release_finished();
        Ok(())
    }

    /// One token for every active sequence, in one weight pass (several for a lone greedy
    /// sequence whose drafts are accepted).
    fn step(&mut self) {
        if self.drafter.is_some() && self.active.len() == 1 && self.active[0].greedy() && self.speculate() {
            return;
        }
        if self.decode_alone() {
            return;
        }
        let want = want_of_all(&self.active);
        let batch: Vec<(SeqId, u32)> = self.active.iter().map(|c| (c.seq, c.next)).collect();
        for c in &mut self.active {
            c.tokens.push(c.next);
        }
        let t0 = Instant::now();
        match self.backend.step(&batch, want) {
            Ok(outs) => {
                self.metrics.record_decode_step(batch.len(), t0.elapsed().as_secs_f64());
                let mut active = std::mem::take(&mut self.active);
                for (choice, out) in active.iter_mut().zip(&outs) {
                    self.accept(choice, out);
                }
                self.active = active;
            }
            Err(e) => {
                let err = ApiError::from_model(&e);
                for c in &mut self.active {
                    let _ = c.events.send(Event::Failed(err.clone()));
                    c.finished = true;
                }
            }
        }
        self.release_finished();
    }

    /// A lone greedy sequence without drafting decodes through `Backend::decode_greedy` (the CUDA
    /// graph path queues each step before the previous token is read) until it finishes, another
    /// request arrives, its client goes away or the server drains; then stepping goes on as
    /// before. A lone top-k sampled sequence (no log-probabilities) does the same through
    /// `Backend::decode_sampled` (the CUDA graph path draws on the device), with the uniforms its
    /// sampler would take step by step, so its tokens do not depend on when it runs alone. False
    /// when the scheduler should step normally.
    fn decode_alone(&mut self) -> bool {
        let alone = self.active.len() == 1 && self.waiting.is_empty() && self.prefilling.is_empty();
        if !alone || self.drafter.is_some() {
            return false;
        }
        let want = self.active[0].want();
        if !matches!(want, Want::Argmax | Want::Candidates(_)) {
            return false;
        }
        let mut c = self.active.pop().expect("one active sequence");
        let left = c.max_tokens.saturating_sub(c.generated);
        let Scheduler { backend, tokenizer, stop_ids, metrics, rx, waiting, draining, .. } = self;
        let (seq, next) = (c.seq, c.next);
        let sampled = match want {
            Want::Candidates(_) => match uniforms_for(backend.as_ref(), seq, &c.sampler, left) {
                Ok(u) => Some((c.sampler.params().draw_params(), u)),
                Err(_) => {
                    self.active.push(c);
                    return false; // the sequence is gone: stepping reports it
                }
            },
            _ => None,
        };
        let mut last = Instant::now();
        let mut on_token = |tok: u32| {
            c.tokens.push(c.next);
            metrics.record_decode_step(1, last.elapsed().as_secs_f64());
            last = Instant::now();
            take_token(tokenizer, stop_ids, metrics, &mut c, tok, &PosOut::default());
            while let Ok(job) = rx.try_recv() {
                waiting.push_back(job);
            }
            !c.finished && waiting.is_empty() && !c.events.is_closed() && !draining.load(Ordering::Relaxed)
        };
        let ran = match &sampled {
            Some((params, uniforms)) => backend.decode_sampled(seq, next, params, uniforms, &mut on_token),
            None => backend.decode_greedy(seq, next, left, &mut on_token),
        };
        if let (Ok(steps), Some(_)) = (&ran, &sampled) {
            c.sampler.skip(*steps);
        }
        if let Err(e) = ran {
            let _ = c.events.send(Event::Failed(ApiError::from_model(&e)));
            c.finished = true;
        }
        self.active.push(c);
        self.release_finished();
        true
    }

    /// Lossless speculation for the only running sequence: draft (the MTP assistant from the
    /// sequence's cache and hidden state, or prompt lookup in its own tokens), verify [next,
    /// drafts] in one pass, keep the longest prefix the target agrees with. Each verify column
    /// equals a decode step's, so the output is plain greedy's. False when there is nothing to
    /// draft (the caller steps normally).
    fn speculate(&mut self) -> bool {
        let c = &self.active[0];
        let k = self.draft_k.min((c.max_tokens - c.generated).saturating_sub(1));
        let Some(drafter) = self.drafter.as_mut() else { return false };
        if k == 0 {
            return false;
        }
        let mut history = c.tokens.clone();
        history.push(c.next);
        let drafts = match drafter.propose(self.backend.as_mut(), c.seq, &history, k) {
            Ok(d) => d,
            Err(_) => return false, // e.g. the context is full: decode plainly
        };
        if drafts.is_empty() {
            return false;
        }
        let mut block = Vec::with_capacity(drafts.len() + 1);
        block.push(c.next);
        block.extend_from_slice(&drafts);
        let seq = c.seq;
        let t0 = Instant::now();
        let outs = match self.backend.verify(seq, &block, Want::Argmax) {
            Ok(outs) => outs,
            Err(_) => return false, // e.g. no room for the drafts near the context end
        };
        let accepted = drafts.iter().zip(&outs).take_while(|(d, o)| **d == o.argmax).count();
        self.metrics.record_drafts(drafts.len(), accepted);
        let mut c = self.active.pop().expect("one active sequence");
        // Emit d1..d_accepted and the target's token after them; commit the rows of the fed
        // tokens that an emitted token follows.
        let mut fed = 0;
        for out in &outs[..=accepted] {
            self.accept(&mut c, out);
            fed += 1;
            if c.finished {
                break;
            }
        }
        if let Err(e) = self.backend.commit(seq, fed) {
            let _ = c.events.send(Event::Failed(ApiError::from_model(&e)));
            c.finished = true;
            c.reason = None;
        }
        c.tokens.extend_from_slice(&block[..fed]);
        self.metrics.record_decode_step(fed, t0.elapsed().as_secs_f64());
        self.active.push(c);
        self.release_finished();
        true
    }

    /// Takes the token a position's output gives, streams its text, and decides whether the
    /// choice is done (`accept_token`).
    fn accept(&mut self, c: &mut Choice, out: &PosOut) {
        accept_token(&self.tokenizer, &self.stop_ids, &self.metrics, c, out);
    }

    /// Frees the sequences of clients that went away.
    fn drop_abandoned(&mut self) {
        let (gone, keep): (Vec<Prefill>, Vec<Prefill>) =
            std::mem::take(&mut self.prefilling).into_iter().partition(|p| p.job.events.is_closed());
        self.prefilling = keep.into();
        for p in gone {
            let _ = self.backend.free(p.seq);
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        let mut any = false;
        for c in &mut self.active {
            if c.events.is_closed() && !c.finished {
                c.finished = true;
                any = true;
                if c.index == 0 {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if any {
            self.release_finished();
        }
    }

    /// Shutdown: every running choice ends now, as if its budget ran out.
    fn finish_all(&mut self) {
        for c in &mut self.active {
            c.reason.get_or_insert(FinishReason::Length);
            c.finished = true;
        }
        for job in self.waiting.drain(..) {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            let _ = job.events.send(Event::Failed(ApiError::unavailable("the server is shutting down")));
        }
        for p in std::mem::take(&mut self.prefilling) {
            let _ = self.backend.free(p.seq);
            let _ = p.job.events.send(Event::Failed(ApiError::unavailable("the server is shutting down")));
        }
        self.release_finished();
    }

    /// Frees the sequences of finished choices, then tells their clients: when a reply ends,
    /// its sequence is already gone.
    fn release_finished(&mut self) {
        let (mut done, running): (Vec<Choice>, Vec<Choice>) =
            std::mem::take(&mut self.active).into_iter().partition(|c| c.finished);
        self.active = running;
        for c in &mut done {
            if c.reason.is_some() {
                // Finished normally: its rows may serve the next prompt that starts alike.
                self.cache.insert(self.backend.as_mut(), c.seq, std::mem::take(&mut c.tokens));
            } else {
                let _ = self.backend.free(c.seq);
            }
        }
        self.publish_active();
        for c in done {
            if let Some(reason) = c.reason {
                let _ = c.events.send(Event::Finished { index: c.index, reason, completion_tokens: c.generated });
            }
        }
    }

    fn publish_active(&self) {
        self.metrics.active_sequences.store(self.active.len() + self.prefilling.len(), Ordering::Relaxed);
        self.metrics.cached_sequences.store(self.cache.len(), Ordering::Relaxed);
    }

    /// A fresh sequence; when the backend has no room, cached sequences make way.
    fn new_sequence(&mut self) -> megagemma_model::Result<SeqId> {
        match self.backend.new_sequence() {
            Err(e) if e.kind() == megagemma_model::error::ErrorKind::Capacity && self.cache.len() > 0 => {
                self.cache.clear(self.backend.as_mut());
                self.backend.new_sequence()
            }
            r => r,
        }
    }
}

impl Choice {
    /// Greedy without log-probabilities: the argmax is all a step must return.
    fn greedy(&self) -> bool {
        self.want() == Want::Argmax
    }

    fn want(&self) -> Want {
        want_for(self.sampler.params(), self.logprobs.is_some())
    }
}

/// One pass's want for all its choices: the row if any needs it, else the most candidates any
/// needs, else the argmax.
fn want_of_all(active: &[Choice]) -> Want {
    active.iter().map(Choice::want).fold(Want::Argmax, |a, w| match (a, w) {
        (Want::Logits, _) | (_, Want::Logits) => Want::Logits,
        (Want::Candidates(x), Want::Candidates(y)) => Want::Candidates(x.max(y)),
        (Want::Candidates(x), _) | (_, Want::Candidates(x)) => Want::Candidates(x),
        _ => Want::Argmax,
    })
}

/// A sequence that cannot be created: with the context checked beforehand, a capacity error
/// here means every slot is taken (503), not that the request is too long.
fn no_room(e: &megagemma_model::error::Error) -> ApiError {
    match e.kind() {
        megagemma_model::error::ErrorKind::Capacity => ApiError::overloaded(e.to_string()),
        _ => ApiError::from_model(e),
    }
}

fn want_for_spec(spec: &GenSpec) -> Want {
    want_for(&spec.sampling, spec.logprobs.is_some())
}

/// A failed start is already reported to its client; note it on stderr for the operator.
fn log_server_error(e: &ApiError) {
    if e.status.is_server_error() {
        eprintln!("error: request failed: {}", e.message);
    }
}

/// Takes the token a position's output gives (`take_token`).
fn accept_token(tokenizer: &Tokenizer, stop_ids: &[u32], metrics: &Metrics, c: &mut Choice, out: &PosOut) {
    let tok = if c.sampler.params().is_greedy() {
        out.argmax
    } else {
        // The whole row when the pass copied it (another choice's want), else the candidates.
        let drawn = if out.logits.is_empty() {
            c.sampler.sample_candidates(&out.candidates)
        } else {
            c.sampler.sample(&out.logits)
        };
        match drawn {
            Ok(t) => t,
            Err(e) => {
                let _ = c.events.send(Event::Failed(ApiError::internal(e.to_string())));
                c.finished = true;
                return;
            }
        }
    };
    take_token(tokenizer, stop_ids, metrics, c, tok, out);
}

/// Takes `tok`, chosen from the position's output `out` (whose logits give its log-probability
/// when the choice asks for one), streams its text, and decides whether the choice is done.
fn take_token(tokenizer: &Tokenizer, stop_ids: &[u32], metrics: &Metrics, c: &mut Choice, tok: u32, out: &PosOut) {
    c.generated += 1;
    c.next = tok;
    metrics.generated_tokens.fetch_add(1, Ordering::Relaxed);
    if let Some(arrived) = c.arrived.take() {
        metrics.record_ttft(arrived.elapsed().as_secs_f64());
    }
    let logprob = c.logprobs.map(|n| token_logprob(tokenizer, &out.logits, tok, n));
    let eos = !c.ignore_eos && stop_ids.contains(&tok);
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut stopped = false;
    if !eos {
        match c.thoughts.as_mut().map_or(Part::Answer, |t| t.route(tok)) {
            Part::Answer => {
                if let Ok(Some(piece)) = c.detok.step(tok) {
                    let r = c.stop_text.push(&piece);
                    text = r.text;
                    stopped = r.stopped;
                }
            }
            Part::Thought => {
                if let Ok(Some(piece)) = c.thought_detok.step(tok) {
                    reasoning = piece;
                }
            }
            Part::Marker => {
                // Opening or closing the channel: what the thought decoder holds is done.
                if let Ok(Some(rest)) = c.thought_detok.flush() {
                    reasoning = rest;
                }
                c.thought_detok = tokenizer.stream_decoder(true);
            }
        }
    }
    let reason = if eos || stopped {
        Some(FinishReason::Stop)
    } else if c.generated >= c.max_tokens {
        Some(FinishReason::Length)
    } else {
        None
    };
    if reason == Some(FinishReason::Length) || (eos && !stopped) {
        // Flush what the detokenizer and the stop matcher still hold.
        if let Ok(Some(rest)) = c.detok.flush() {
            let r = c.stop_text.push(&rest);
            text.push_str(&r.text);
        }
        text.push_str(&c.stop_text.finish());
        if let Ok(Some(rest)) = c.thought_detok.flush() {
            reasoning.push_str(&rest);
        }
    }
    let _ = c.events.send(Event::Token { index: c.index, text, reasoning, id: tok, logprob });
    if reason.is_some() {
        c.reason = reason;
        c.finished = true;
    }
}

/// The chosen token's log-probability and the `n` most likely, with their text.
fn token_logprob(tokenizer: &Tokenizer, logits: &[f32], tok: u32, n: usize) -> TokenLogprob {
    let text = |id: u32| tokenizer.decode(&[id], false).unwrap_or_default();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_z = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    let logprob = logits.get(tok as usize).map_or(f32::NEG_INFINITY, |&l| (l as f64 - log_z) as f32);
    let top = top_logprobs(logits, n).into_iter().map(|(id, lp)| (text(id), lp)).collect();
    TokenLogprob { token: text(tok), logprob, top }
}
