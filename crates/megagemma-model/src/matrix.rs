//! Weight matrices as the CPU forward sees them: `[rows, cols]` in PyTorch `Linear` convention
//! (`y = W·x`, one output per row), stored in whatever format the checkpoint brought.
//!
//! Every product — single-token decode, multi-token prefill, speculative verify — goes through
//! [`RowDot::dot_rows`], one row at a time against one activation vector. Using the same dot kernel
//! whatever the number of tokens makes column `t` of a multi-token pass bit-identical to a
//! single-token pass on the same input (batch invariance by construction), which lossless
//! speculative decoding relies on.

use rayon::prelude::*;

/// A `[rows, cols]` weight matrix whose rows can be dotted with f32 vectors.
pub trait RowDot: Send + Sync {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    /// `out[i] = dot(row(start + i), x)` for every `i < out.len()`; `x.len() == cols()`.
    fn dot_rows(&self, start: usize, x: &[f32], out: &mut [f32]);
    /// `outs[t][i] = dot(row(start + i), xs[t])` for `T = xs.len() / cols()` vectors, each with
    /// its own output slice of the same `n` rows (the rows' place in each token's output row, so
    /// nothing is copied afterwards): a kernel may decode each row once for every vector. Every
    /// result must be bit-identical to [`RowDot::dot_rows`] on the same row and vector.
    fn dot_rows_multi(&self, start: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        for (ti, out) in outs.iter_mut().enumerate() {
            self.dot_rows(start, &xs[ti * self.cols()..(ti + 1) * self.cols()], out);
        }
    }
    /// The vectors `xs` (`[T, cols]`) prepared once per product for
    /// [`RowDot::dot_rows_prepared`], when this matrix's kernel reads its input in another form
    /// (GGUF quantized rows on AVX-512 VNNI: integer digits as bytes); `None` when it reads
    /// f32 directly.
    fn prepare_inputs(&self, _xs: &[f32]) -> Option<crate::gguf::IntInputs> {
        None
    }
    /// [`RowDot::dot_rows_multi`] on inputs from [`RowDot::prepare_inputs`]; the same bits as
    /// `dot_rows_multi` on the vectors they were prepared from.
    fn dot_rows_prepared(&self, _start: usize, _xs: &crate::gguf::IntInputs, _outs: &mut [&mut [f32]]) {
        unreachable!("dot_rows_prepared on a matrix that prepares no inputs")
    }
    /// Build now any layout this matrix's CPU kernel re-lays its weights into on first use (GGUF
    /// byte tiles), so that a CPU backend pays for it while loading instead of in its first
    /// product. A no-op for the others.
    fn prepare_cpu_layout(&self) {}
    /// [`RowDot::prepare_cpu_layout`], then drop any other layout the CPU kernels no longer read
    /// (a 4-bit affine matrix's arrays, once it is tiled), so that a CPU-only run does not hold
    /// the weights twice. Whatever was dropped is rebuilt exactly if read again. A no-op for
    /// the others.
    fn keep_cpu_layout_only(&mut self) {}
    /// Dequantize / convert one row into `out` (`out.len() == cols()`), exactly.
    fn row_to_f32(&self, row: usize, out: &mut [f32]);
    /// Bytes of weight data streamed by one full matvec (for bandwidth figures).
    fn stored_bytes(&self) -> usize;
    /// The storage, borrowed as it is held (device backends upload from it).
    fn layout(&self) -> WeightLayout<'_>;
}

/// A matrix's storage, rows contiguous, borrowed.
pub enum WeightLayout<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
    /// 4-bit affine codes (`w = scale·q + bias`), laid out as [`crate::quant::QuantMatrix`] documents.
    Affine4 {
        group_size: usize,
        packed: &'a [u32],
        scales: &'a [f32],
        biases: &'a [f32],
    },
    /// GGUF blocks of `kind`, `rows · row_bytes` bytes.
    Gguf {
        kind: crate::gguf::GgmlType,
        bytes: &'a [u8],
    },
}

/// The rows every output slice of a several-vector product covers: `outs` must hold one slice per
/// vector (`t` of them), all of the same length `n`, and rows `start .. start + n` must exist in a
/// matrix of `rows` rows. Panics naming `what` otherwise (a caller's bug, not bad input).
pub(crate) fn rows_per_output(outs: &[&mut [f32]], t: usize, start: usize, rows: usize, what: &str) -> usize {
    let n = outs.first().map_or(0, |o| o.len());
    assert!(outs.len() == t && outs.iter().all(|o| o.len() == n), "{what}: not {t} outputs of {n} rows");
    assert!(start + n <= rows, "{what}: rows {start}..{} out of range (matrix has {rows})", start + n);
    n
}

/// Rows handled per parallel task: large enough to amortise scheduling, small enough to balance.
const ROW_BLOCK: usize = 64;
/// Tasks a product is cut into at most: a 262,144-row LM head in 64-row tasks was 4,096 tasks
/// (and, for several tokens, as many output buffers) per product.
const MAX_TASKS: usize = 256;

/// Rows per task for a matrix of `rows` rows: [`ROW_BLOCK`], or a multiple of it that keeps the
/// product within [`MAX_TASKS`] tasks. (Which rows a task computes changes no result.)
fn row_block(rows: usize) -> usize {
    rows.div_ceil(MAX_TASKS).div_ceil(ROW_BLOCK).max(1) * ROW_BLOCK
}

/// `ys[t] = W · xs[t]` for every token `t`. `xs` is `[T, cols]`, `ys` is `[T, rows]`, row-major.
/// Work is split over row blocks (each block's weights are read once, then reused across tokens).
pub fn matmul(w: &dyn RowDot, xs: &[f32], ys: &mut [f32]) {
    matmul_then(w, xs, ys, &|_, _| {});
}

/// [`matmul`], then `finish(start, outs)` in each parallel task on the rows it just wrote
/// (`outs[t]` = token t's rows `start ..`), while they are still in cache: the LM head applies
/// its softcap and finds each task's best logit there instead of reading the logits back.
pub fn matmul_then(w: &dyn RowDot, xs: &[f32], ys: &mut [f32], finish: &(dyn Fn(usize, &mut [&mut [f32]]) + Sync)) {
    let (rows, cols) = (w.rows(), w.cols());
    let t = xs.len() / cols;
    assert_eq!(xs.len(), t * cols, "matmul: input is not [T, {cols}]");
    assert_eq!(ys.len(), t * rows, "matmul: output is not [T, {rows}]");
    if t == 0 {
        return; // e.g. the LM head on a prefill chunk that keeps no position
    }
    let prepared = w.prepare_inputs(xs);
    let block = row_block(rows);
    if t == 1 {
        ys.par_chunks_mut(block).enumerate().for_each(|(b, out)| {
            match &prepared {
                Some(p) => w.dot_rows_prepared(b * block, p, &mut [&mut *out]),
                None => w.dot_rows(b * block, xs, out),
            }
            finish(b * block, &mut [out]);
        });
        return;
    }
    // Row-block-major so each block of weights is read once for all T tokens; each task writes
    // its block's rows of every token's output in place (disjoint slices).
    let blocks = rows.div_ceil(block);
    let mut per_block: Vec<Vec<&mut [f32]>> = (0..blocks).map(|_| Vec::with_capacity(t)).collect();
    for y in ys.chunks_exact_mut(rows) {
        for (b, part) in y.chunks_mut(block).enumerate() {
            per_block[b].push(part);
        }
    }
    per_block.into_par_iter().enumerate().for_each(|(b, mut parts)| {
        match &prepared {
            Some(p) => w.dot_rows_prepared(b * block, p, &mut parts),
            None => w.dot_rows_multi(b * block, xs, &mut parts),
        }
        finish(b * block, &mut parts);
    });
}
