//! Checks every [`Backend`] must pass, run by each backend's tests: the CPU backend's in `cargo test`,
//! the CUDA backend's on the GPU machine (`tests/gpu_forward.rs` of megagemma-cuda).

use crate::backend::{Backend, Want};
use crate::draw::{draw_candidates, DrawParams};
use crate::error::ErrorKind;

/// `decode_greedy` is `decode` in a loop: the same ids, also when `on_token` stops it early and a
/// second call continues from the last id; as many steps committed as were accepted; and once the
/// context is full, the steps that fit and then a capacity error. `prompt` plus 11 tokens must fit
/// `b`'s context, which a few dozen positions keep short.
pub fn greedy_in_one_call(b: &mut dyn Backend, prompt: &[u32]) -> Result<(), String> {
    let err = |e: crate::Error| e.to_string();
    let ctx = b.max_context();
    let looped = b.new_sequence().map_err(err)?;
    let mut tok = b.prefill(looped, prompt, Want::Argmax).map_err(err)?.argmax;
    let mut want = vec![];
    for _ in 0..11 {
        tok = b.decode(looped, tok, Want::Argmax).map_err(err)?.argmax;
        want.push(tok);
    }
    b.free(looped).map_err(err)?;

    let seq = b.new_sequence().map_err(err)?;
    let first = b.prefill(seq, prompt, Want::Argmax).map_err(err)?.argmax;
    let mut ids = vec![];
    let steps = b
        .decode_greedy(seq, first, 20, &mut |t| {
            ids.push(t);
            ids.len() < 4
        })
        .map_err(err)?;
    let len = b.seq_len(seq).map_err(err)?;
    if (steps, len) != (4, prompt.len() + 4) {
        return Err(format!("stopped after 4 ids: {steps} steps reported, {len} positions committed"));
    }
    let last = ids[3];
    let steps = b.decode_greedy(seq, last, 7, &mut |t| {
        ids.push(t);
        true
    });
    if steps.map_err(err)? != 7 || ids != want {
        return Err(format!("ids of two calls {ids:?}, of decode in a loop {want:?}"));
    }

    let len = b.seq_len(seq).map_err(err)?;
    let mut more = 0;
    let last = ids[10];
    match b.decode_greedy(seq, last, ctx + 1, &mut |_| {
        more += 1;
        true
    }) {
        Err(e) if e.kind() == ErrorKind::Capacity => {}
        other => return Err(format!("past the context of {ctx}: {other:?}, not a capacity error")),
    }
    let now = b.seq_len(seq).map_err(err)?;
    if len + more != ctx || now != ctx {
        return Err(format!("past the context of {ctx}: {more} more ids from {len}, {now} positions committed"));
    }
    b.free(seq).map_err(err)
}

/// Uniforms in [0, 1) from a fixed 64-bit LCG (the tests' stand-in for a sampler's stream).
pub fn test_uniforms(n: usize, seed: u64) -> Vec<f64> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 11) as f64 / (1u64 << 53) as f64
        })
        .collect()
}

/// `decode_sampled` is `decode` with `Want::Candidates` and `draw_candidates` in a loop: the same
/// tokens for the same uniforms, also when `on_token` stops it early and a second call continues
/// from the last token; as many steps committed as were accepted; and once the context is full, the
/// steps that fit and then a capacity error. `prompt` plus 11 tokens must fit `b`'s context.
pub fn sampled_in_one_call(b: &mut dyn Backend, prompt: &[u32], params: &DrawParams) -> Result<(), String> {
    let err = |e: crate::Error| e.to_string();
    let ctx = b.max_context();
    let u = test_uniforms(11, 7);
    let looped = b.new_sequence().map_err(err)?;
    let mut tok = b.prefill(looped, prompt, Want::Argmax).map_err(err)?.argmax;
    let first = tok;
    let mut want = vec![];
    for &ui in &u {
        let out = b.decode(looped, tok, Want::Candidates(params.top_k)).map_err(err)?;
        tok = draw_candidates(&out.candidates, params, ui).ok_or("no candidate")?;
        want.push(tok);
    }
    b.free(looped).map_err(err)?;
    if want.iter().all(|&t| t == want[0]) {
        return Err(format!("every draw gave token {}: the check would not see a wrong uniform", want[0]));
    }

    let seq = b.new_sequence().map_err(err)?;
    b.prefill(seq, prompt, Want::Argmax).map_err(err)?;
    let mut ids = vec![];
    let mut more = u.clone();
    more.extend(test_uniforms(9, 99));
    let steps = b
        .decode_sampled(seq, first, params, &more, &mut |t| {
            ids.push(t);
            ids.len() < 4
        })
        .map_err(err)?;
    let len = b.seq_len(seq).map_err(err)?;
    if (steps, len) != (4, prompt.len() + 4) {
        return Err(format!("stopped after 4 tokens: {steps} steps reported, {len} positions committed"));
    }
    let last = ids[3];
    let steps = b.decode_sampled(seq, last, params, &u[4..], &mut |t| {
        ids.push(t);
        true
    });
    if steps.map_err(err)? != 7 || ids != want {
        return Err(format!("tokens of two calls {ids:?}, of decode and draw in a loop {want:?}"));
    }

    let len = b.seq_len(seq).map_err(err)?;
    let mut steps_more = 0;
    let last = ids[10];
    match b.decode_sampled(seq, last, params, &test_uniforms(ctx + 1, 3), &mut |_| {
        steps_more += 1;
        true
    }) {
        Err(e) if e.kind() == ErrorKind::Capacity => {}
        other => return Err(format!("past the context of {ctx}: {other:?}, not a capacity error")),
    }
    let now = b.seq_len(seq).map_err(err)?;
    if len + steps_more != ctx || now != ctx {
        return Err(format!(
            "past the context of {ctx}: {steps_more} more tokens from {len}, {now} positions committed"
        ));
    }
    b.free(seq).map_err(err)
}
