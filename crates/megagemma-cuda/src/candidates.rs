//! The highest logits of a pass's rows, selected on the device (`kernels/sample.cu`): what top-k
//! sampling needs (`Want::Candidates`) without copying a 262,144-float row to the host and
//! selecting there.

use crate::device::{Arg, DevBuf, Gpu};
use crate::seq::CudaSeq;
use megagemma_model::draw::DrawParams;
use megagemma_model::Result;
use std::sync::Mutex;

/// The most candidates the device selection returns per row.
pub const MAX_CANDIDATES: usize = 64;
/// Logits one block of `top_candidates_blocks` takes (`CAND_BLOCK` in kernels/sample.cu); each
/// block hands its k best on to the merge.
pub(crate) const CAND_BLOCK: usize = 4096;
/// Threads of the selection's blocks (and of `sample_draw`'s one block).
pub(crate) const CAND_THREADS: u32 = 1024;

/// `(token, logit)` pairs, highest first.
pub type Candidates = Vec<(u32, f32)>;

/// Whether `CudaSeq::candidates` serves `k` candidates of a `vocab`-wide row.
pub(crate) fn candidates_on_device(vocab: usize, k: usize) -> bool {
    (1..=MAX_CANDIDATES).contains(&k) && vocab <= i32::MAX as usize
}

/// Keys the blocks of `top_candidates_blocks` hand on to the merge for one `vocab`-wide row: k each.
pub(crate) fn survivors(vocab: usize, k: usize) -> usize {
    vocab.div_ceil(CAND_BLOCK) * k
}

/// The blocks' survivors and the merged keys of a pass's rows: one buffer per model, grown to the
/// most rows asked for, used by one call at a time (its sequences run one at a time on the model's
/// stream).
#[derive(Default)]
pub(crate) struct CandidateKeys {
    buf: Mutex<Option<DevBuf>>,
}

impl CudaSeq {
    /// The `k` highest logits of each of the last pass's first `rows` output rows, exactly as
    /// `megagemma_model::backend::top_candidates` lists them from the downloaded row; `None` when
    /// the device selection cannot serve `k` (0 or above [`MAX_CANDIDATES`]).
    pub fn candidates(&self, rows: usize, k: usize) -> Result<Option<Vec<Candidates>>> {
        let vocab = self.model.plan.vocab_size;
        if !candidates_on_device(vocab, k) {
            return Ok(None);
        }
        let mut buf = self.model.cand_keys.buf.lock().unwrap_or_else(|e| e.into_inner());
        select_candidates(&self.model.gpu, &mut buf, self.s.logits.ptr, rows, vocab, k).map(Some)
    }
}

/// The `k` highest logits of each of `rows` rows of `n` floats at `logits` on the device, as
/// `megagemma_model::backend::top_candidates` lists them; `keys` is scratch, grown as needed.
/// `k` is one the device serves (`candidates_on_device`).
pub(crate) fn select_candidates(
    gpu: &Gpu,
    keys: &mut Option<DevBuf>,
    logits: u64,
    rows: usize,
    n: usize,
    k: usize,
) -> Result<Vec<Candidates>> {
    let (blocks, survivors) = (n.div_ceil(CAND_BLOCK), survivors(n, k));
    let merged_at = rows * survivors * 8;
    let bytes = merged_at + rows * MAX_CANDIDATES * 8;
    if keys.as_ref().is_none_or(|b| b.bytes < bytes) {
        *keys = Some(gpu.alloc(bytes)?);
    }
    let at = keys.as_ref().map_or(0, |b| b.ptr);
    let merged = at + merged_at as u64;
    let (n32, k32, rows32) = (n as i32, k as i32, rows as u32);
    let args = [Arg::Ptr(logits), Arg::I32(n32), Arg::I32(k32), Arg::Ptr(at)];
    gpu.launch_2d("top_candidates_blocks", (blocks as u32, rows32), CAND_THREADS, 0, &args)?;
    let args = [Arg::Ptr(at), Arg::I32(survivors as i32), Arg::I32(k32), Arg::Ptr(merged)];
    gpu.launch_2d("top_candidates_merge", (1, rows32), CAND_THREADS, 0, &args)?;
    let mut host = vec![0u64; rows * k];
    gpu.download(&mut host, merged)?;
    // Key 0 is a NaN or −∞ (or padding): the listed ones come first.
    Ok(host
        .chunks(k)
        .map(|row| row.iter().take_while(|&&key| key != 0).map(|&key| token_logit(key)).collect())
        .collect())
}

/// Where a device draw (`launch_draw`) reads and writes: scratch for the blocks' survivors
/// ([`survivors`] keys), the uniforms, the meta word whose first u32 indexes them, the drawn id,
/// and the no-finite-logit flag.
pub(crate) struct DrawBuffers {
    pub keys: u64,
    pub uniforms: u64,
    pub meta: u64,
    pub ids: u64,
    pub flag: u64,
}

/// Queues the draw of one `vocab`-wide row of logits: `top_candidates_blocks`, then `sample_draw`
/// (their k best merged, drawn with `uniforms[meta[0]]` as `draw_candidates` draws, into `ids[0]`).
pub(crate) fn launch_draw(gpu: &Gpu, logits: u64, vocab: usize, params: &DrawParams, at: &DrawBuffers) -> Result<()> {
    let k = params.top_k;
    let args = [Arg::Ptr(logits), Arg::I32(vocab as i32), Arg::I32(k as i32), Arg::Ptr(at.keys)];
    gpu.launch_2d("top_candidates_blocks", (vocab.div_ceil(CAND_BLOCK) as u32, 1), CAND_THREADS, 0, &args)?;
    let args = [
        Arg::Ptr(at.keys),
        Arg::I32(survivors(vocab, k) as i32),
        Arg::I32(k as i32),
        Arg::F32(params.temperature),
        Arg::F32(params.top_p),
        Arg::F32(params.min_p),
        Arg::Ptr(at.uniforms),
        Arg::Ptr(at.meta),
        Arg::Ptr(at.ids),
        Arg::Ptr(at.flag),
    ];
    gpu.launch("sample_draw", 1, CAND_THREADS, 0, &args)
}

/// A sort key back to (token, logit): the logit's total-order bits above, !token below.
fn token_logit(key: u64) -> (u32, f32) {
    let order = (key >> 32) as u32;
    let bits = if order & 0x8000_0000 != 0 { order & 0x7fff_ffff } else { !order };
    (!(key as u32), f32::from_bits(bits))
}

#[cfg(test)]
mod tests {
    use super::token_logit;

    /// The key `candidate_key` in kernels/sample.cu builds, replayed on the host.
    fn key(v: f32, token: u32) -> u64 {
        let u = v.to_bits();
        let order = if u & 0x8000_0000 != 0 { !u } else { u | 0x8000_0000 };
        ((order as u64) << 32) | (!token) as u64
    }

    #[test]
    fn keys_order_as_the_host_selection_and_decode_back() {
        let vals = [f32::INFINITY, 3.5, 1.0, 0.0, -0.0, -1e-30, -2.0, f32::MIN, -f32::MIN_POSITIVE];
        for (i, &a) in vals.iter().enumerate() {
            assert_eq!(token_logit(key(a, i as u32)), (i as u32, a));
            assert_eq!(token_logit(key(a, i as u32)).1.to_bits(), a.to_bits(), "{a} keeps its sign");
            for (j, &b) in vals.iter().enumerate() {
                // Descending keys = descending total_cmp, then the lower token.
                let host = b.total_cmp(&a).then((i as u32).cmp(&(j as u32)));
                assert_eq!(key(b, j as u32).cmp(&key(a, i as u32)), host, "{a}@{i} vs {b}@{j}");
            }
            assert_ne!(key(a, i as u32), 0);
        }
        // Equal logits: the lower token's key is larger (it is listed first).
        assert!(key(1.0, 3) > key(1.0, 4));
    }
}
