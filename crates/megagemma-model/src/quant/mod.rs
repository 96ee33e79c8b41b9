//! 4-bit affine quantized weight matrices: one in-memory representation, [`QuantMatrix`], onto which
//! both MLX affine checkpoints and GGUF `Q4_0` (Google's QAT checkpoints) map losslessly.
//!
//! # Representation
//!
//! A `[rows, cols]` matrix (PyTorch `Linear` convention, one output per row) cut along `cols` into
//! groups of `group_size` ∈ {32, 64, 128} consecutive inputs. Each group of each row has one f32
//! `scale` and one f32 `bias`; each weight is a 4-bit code `q ∈ 0..=15` and stands for
//!
//! ```text
//!     w = scale · q + bias          (evaluated in f32: one rounded multiply, then one rounded add)
//! ```
//!
//! * `packed: Vec<u32>`, `rows · cols/8` words, rows contiguous. Weight `j` of a row is nibble
//!   `j % 8` of word `j / 8`, at bits `4·(j % 8)`, least-significant nibble first — exactly the MLX
//!   `weight` tensor (U32, shape `[rows, cols/8]`), so MLX words are copied as they are.
//! * `scales`, `biases: Vec<f32>`, `rows · cols/group_size` each, row-major `[rows, n_groups]`.
//!   f32 in memory so that every source dtype is held exactly (MLX writes bf16, GGUF `Q4_0` f16).
//!
//! # Sources that map onto it
//!
//! * **MLX affine** (`bits = 4`, any of the three group sizes): `weight`/`scales`/`biases` as stored,
//!   scales and biases widened from bf16 (see [`QuantMatrix::from_mlx`]). Note that MLX scales may be
//!   negative (see [`quantize_affine`]); nothing here assumes otherwise.
//! * **GGUF `Q4_0`** (group 32, symmetric): `w = d·(q − 8)` is the affine form with `scale = d`,
//!   `bias = −8·d`; multiplying an f16/bf16 `d` by 8 is exact in f32, so nothing is lost
//!   (see [`QuantMatrix::from_ggml_q4_0`] for the raw block layout and [`quantize_q4_0`]).
//!
//! # Products
//!
//! [`QuantMatrix`] implements [`RowDot`]: the dot kernel never materialises a weight matrix but
//! dequantizes each weight in registers with exactly the formula above (the one
//! [`QuantMatrix::dequantize`] uses) and accumulates `w·x` in f32, so its result differs from a
//! dense f32 dot over the dequantized row only in summation order. The result for a row depends
//! only on that row and `x` (never on which other rows or tokens share the call), so
//! [`crate::matrix::matmul`] stays batch-invariant. The kernel (AVX-512F, AVX2+FMA or portable) is
//! picked once per process from the CPU's features ([`Kernel::detect`]); different kernels agree to
//! rounding, not bitwise. Memory: 0.5 byte per weight plus 8 bytes (f32 scale and bias) per group;
//! [`RowDot::stored_bytes`] reports the on-disk size (bf16 scale and bias).
//!
//! On CPUs with AVX-512 VNNI the products run instead on integer byte tiles
//! ([`crate::gguf::byte_tiles`]): the codes re-laid as `Q4_1` tiles, whose arithmetic is this one
//! (`w = d·q + m` per 32 values, here the group's scale and bias), against inputs rounded to
//! 22-bit integers per 32 values — within ~1e-7 of the f32 kernels per product, and still
//! batch-invariant. Measured on a random 528 M-parameter Gemma 4 (Zen 4, two threads): decode 1.45×
//! and prefill 2× the f32 kernels. The tiles are built when a CPU backend opens (or on the first
//! product); a model that only a CPU backend runs keeps the tiles alone
//! ([`RowDot::keep_cpu_layout_only`]: 0.75 byte a weight), and the arrays are rebuilt from them,
//! exactly, if anything asks for them again.

mod kernel;
pub mod load;
mod quantize;

pub use kernel::Kernel;
pub use quantize::{quantize_affine, quantize_q4_0};

use std::sync::OnceLock;

use rayon::prelude::*;

use crate::bail;
use crate::error::Result;
use crate::gguf::byte_tiles::{self, ByteTiles, TileInputs, BLOCK as TILE_BLOCK};
use crate::gguf::{GgmlType, IntInputs};
use crate::matrix::{RowDot, WeightLayout};

/// A 4-bit affine quantized `[rows, cols]` matrix; see the [module docs](self) for the layout.
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    group_size: usize,
    /// The MLX arrays. Empty after [`RowDot::keep_cpu_layout_only`] until something reads them
    /// again (a device upload, an explicitly chosen f32 kernel): then rebuilt from the tiles,
    /// exactly.
    arrays: OnceLock<Affine>,
    /// The rows as `Q4_1` byte tiles ([`crate::gguf::byte_tiles`]), made when a CPU backend opens
    /// on a CPU with AVX-512 VNNI (or on the first product there).
    tiles: OnceLock<ByteTiles>,
}

/// What the f32 kernels and device uploads read.
pub(crate) struct Affine {
    /// `[rows, cols/8]`, MLX nibble order.
    pub(crate) packed: Vec<u32>,
    /// `[rows, cols/group_size]`.
    pub(crate) scales: Vec<f32>,
    /// `[rows, cols/group_size]`.
    pub(crate) biases: Vec<f32>,
}

impl Clone for QuantMatrix {
    /// The same matrix, its arrays copied (the copy builds its own tiles when it needs them).
    fn clone(&self) -> Self {
        let a = self.arrays();
        Self::from_parts_unchecked(
            self.rows,
            self.cols,
            self.group_size,
            a.packed.clone(),
            a.scales.clone(),
            a.biases.clone(),
        )
    }
}

impl PartialEq for QuantMatrix {
    /// The same shape, group size, codes, scales and biases (whichever layouts each holds).
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (self.arrays(), other.arrays());
        (self.rows, self.cols, self.group_size) == (other.rows, other.cols, other.group_size)
            && a.packed == b.packed
            && a.scales == b.scales
            && a.biases == b.biases
    }
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("group_size", &self.group_size)
            .field("arrays", &self.arrays.get().is_some())
            .field("tiles", &self.tiles.get().is_some())
            .finish()
    }
}

/// Group sizes the kernels handle (MLX's three; `Q4_0` uses 32).
pub const GROUP_SIZES: [usize; 3] = [32, 64, 128];

impl QuantMatrix {
    /// Builds a matrix from MLX affine parts: `weight` is `[rows, cols/8]` u32 words (8 nibbles per
    /// word, least-significant first), `scales`/`biases` are `[rows, cols/group_size]` (the bf16
    /// checkpoint values widened to f32). Only `bits == 4` is supported.
    pub fn from_mlx(
        weight: &[u32],
        scales: &[f32],
        biases: &[f32],
        rows: usize,
        cols: usize,
        group_size: usize,
        bits: usize,
    ) -> Result<Self> {
        let what = format!("MLX quantized matrix [{rows}, {cols}] (group_size {group_size}, bits {bits})");
        if bits != 4 {
            bail!("{what}: bits = {bits} is not supported (only 4-bit affine)");
        }
        check_shape(&what, rows, cols, group_size)?;
        let words = rows * (cols / 8);
        if weight.len() != words {
            bail!("{what}: weight has {} u32 words, expected [{rows}, {}] = {words}", weight.len(), cols / 8);
        }
        let groups = rows * (cols / group_size);
        for (name, v) in [("scales", scales), ("biases", biases)] {
            if v.len() != groups {
                bail!("{what}: {name} has {} values, expected [{rows}, {}] = {groups}", v.len(), cols / group_size);
            }
            if let Some(i) = v.iter().position(|s| !s.is_finite()) {
                bail!(
                    "{what}: {name}[{}, {}] = {} is not finite",
                    i / (cols / group_size),
                    i % (cols / group_size),
                    v[i]
                );
            }
        }
        Ok(Self::from_parts_unchecked(rows, cols, group_size, weight.to_vec(), scales.to_vec(), biases.to_vec()))
    }

    /// Builds a matrix from raw GGUF `Q4_0` data: `rows · cols/32` blocks of 18 bytes, row-major,
    /// each `d` (f16, little-endian) followed by 16 bytes `qs`, where weight `j < 16` of the block is
    /// `qs[j] & 0xF` and weight `j + 16` is `qs[j] >> 4`; `w = d·(q − 8)`. Mapped losslessly to
    /// `scale = d`, `bias = −8·d`, nibbles re-packed into the MLX order.
    pub fn from_ggml_q4_0(blocks: &[u8], rows: usize, cols: usize) -> Result<Self> {
        const BLOCK: usize = 18;
        let what = format!("Q4_0 matrix [{rows}, {cols}]");
        check_shape(&what, rows, cols, 32)?;
        let n_blocks = rows * (cols / 32);
        if blocks.len() != n_blocks * BLOCK {
            bail!(
                "{what}: data has {} bytes, expected {n_blocks} blocks of {BLOCK} bytes = {}",
                blocks.len(),
                n_blocks * BLOCK
            );
        }
        let mut packed = vec![0u32; n_blocks * 4];
        let mut scales = vec![0f32; n_blocks];
        let mut biases = vec![0f32; n_blocks];
        for (b, block) in blocks.chunks_exact(BLOCK).enumerate() {
            let d = half::f16::from_bits(u16::from_le_bytes([block[0], block[1]])).to_f32();
            if !d.is_finite() {
                bail!("{what}: block {b} (row {}) has a non-finite scale {d}", b / (cols / 32));
            }
            scales[b] = d;
            biases[b] = -8.0 * d;
            let qs = &block[2..BLOCK];
            let mut q = [0u8; 32];
            for j in 0..16 {
                q[j] = qs[j] & 0xF;
                q[j + 16] = qs[j] >> 4;
            }
            for (w, nib) in packed[b * 4..b * 4 + 4].iter_mut().zip(q.chunks_exact(8)) {
                *w = pack8(nib);
            }
        }
        Ok(Self::from_parts_unchecked(rows, cols, 32, packed, scales, biases))
    }

    pub(crate) fn from_parts_unchecked(
        rows: usize,
        cols: usize,
        group_size: usize,
        packed: Vec<u32>,
        scales: Vec<f32>,
        biases: Vec<f32>,
    ) -> Self {
        debug_assert_eq!(packed.len(), rows * cols / 8);
        debug_assert_eq!(scales.len(), rows * cols / group_size);
        debug_assert_eq!(biases.len(), scales.len());
        let arrays = OnceLock::from(Affine { packed, scales, biases });
        QuantMatrix { rows, cols, group_size, arrays, tiles: OnceLock::new() }
    }

    /// The MLX arrays, rebuilt from the tiles if [`RowDot::keep_cpu_layout_only`] dropped them.
    pub(crate) fn arrays(&self) -> &Affine {
        self.arrays.get_or_init(|| {
            let tiles = self.tiles.get().expect("a QuantMatrix holds its arrays, its tiles or both");
            let (ng, wpr) = (self.groups_per_row(), self.cols / 8);
            let mut a = Affine {
                packed: vec![0; self.rows * wpr],
                scales: vec![0.0; self.rows * ng],
                biases: vec![0.0; self.rows * ng],
            };
            for r in 0..self.rows {
                for b in 0..self.cols / TILE_BLOCK {
                    let (q, [d, m]) = tiles.block_of_row(r, b);
                    let words = &mut a.packed[r * wpr + b * TILE_BLOCK / 8..][..TILE_BLOCK / 8];
                    for (w, q8) in words.iter_mut().zip(q.map(|q| q as u8).chunks_exact(8)) {
                        *w = pack8(q8);
                    }
                    let g = r * ng + b * TILE_BLOCK / self.group_size;
                    (a.scales[g], a.biases[g]) = (d, -m);
                }
            }
            a
        })
    }

    /// The byte tiles, built on the first call.
    fn byte_tiles(&self) -> &ByteTiles {
        self.tiles.get_or_init(|| {
            let a = self.arrays();
            ByteTiles::from_affine(&a.packed, &a.scales, &a.biases, self.rows, self.cols, self.group_size)
        })
    }

    /// Whether this CPU multiplies the matrix on byte tiles.
    fn int_dot(&self) -> bool {
        byte_tiles::supports(GgmlType::Q4_1)
    }

    /// The MLX parts `(weight, scales, biases)`; inverse of [`QuantMatrix::from_mlx`] (exact). Scales
    /// and biases are f32; they are bf16 values whenever the matrix came from MLX or
    /// [`quantize_affine`].
    pub fn to_mlx_parts(&self) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
        let a = self.arrays();
        (a.packed.clone(), a.scales.clone(), a.biases.clone())
    }

    pub fn group_size(&self) -> usize {
        self.group_size
    }
    /// Groups per row (`cols / group_size`).
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group_size
    }
    /// `[rows, cols/8]` packed words, MLX nibble order.
    pub fn packed(&self) -> &[u32] {
        &self.arrays().packed
    }
    /// `[rows, cols/group_size]`.
    pub fn scales(&self) -> &[f32] {
        &self.arrays().scales
    }
    /// `[rows, cols/group_size]`.
    pub fn biases(&self) -> &[f32] {
        &self.arrays().biases
    }
    /// The 4-bit code of weight `(row, col)`.
    pub fn code(&self, row: usize, col: usize) -> u8 {
        let w = self.packed()[row * (self.cols / 8) + col / 8];
        ((w >> (4 * (col % 8))) & 0xF) as u8
    }
    /// Bytes this matrix occupies in memory: the arrays (packed words, f32 scales and biases)
    /// and the byte tiles, those it holds.
    pub fn memory_bytes(&self) -> usize {
        let arrays = self.arrays.get().map_or(0, |a| a.packed.len() * 4 + (a.scales.len() + a.biases.len()) * 4);
        arrays + self.tiles.get().map_or(0, ByteTiles::memory_bytes)
    }

    /// The whole matrix in f32, row-major: `w = q·scale + bias` (f32 multiply, then f32 add) — the
    /// same values the dot kernels use.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        out.par_chunks_mut(self.cols).enumerate().for_each(|(r, row)| self.row_to_f32(r, row));
        out
    }

    /// `out[i] = dot(row(start + i), x)` with an explicitly chosen kernel (for tests and benches;
    /// [`RowDot::dot_rows`] uses [`Kernel::detect`]). Panics if the kernel is not available here.
    pub fn dot_rows_with(&self, kernel: Kernel, start: usize, x: &[f32], out: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "QuantMatrix::dot_rows: x has {} values, expected {}", x.len(), self.cols);
        assert!(
            start + out.len() <= self.rows,
            "QuantMatrix::dot_rows: rows {start}..{} out of range (matrix has {})",
            start + out.len(),
            self.rows
        );
        kernel::dot_rows(self, kernel, start, x, out);
    }

    /// [`RowDot::dot_rows_multi`] with an explicitly chosen kernel: each row decoded once for
    /// every group of vectors; every result bit-identical to [`QuantMatrix::dot_rows_with`].
    pub fn dot_rows_multi_with(&self, kernel: Kernel, start: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        let t = xs.len() / self.cols;
        assert!(t > 0 && xs.len() == t * self.cols, "QuantMatrix::dot_rows_multi: xs is not [T, {}]", self.cols);
        crate::matrix::rows_per_output(outs, t, start, self.rows, "QuantMatrix::dot_rows_multi");
        kernel::dot_rows_multi(self, kernel, start, xs, outs);
    }
}

impl RowDot for QuantMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn dot_rows(&self, start: usize, x: &[f32], out: &mut [f32]) {
        match self.prepare_inputs(x) {
            Some(p) => self.dot_rows_prepared(start, &p, &mut [out]),
            None => self.dot_rows_with(Kernel::detect(), start, x, out),
        }
    }
    fn dot_rows_multi(&self, start: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        match self.prepare_inputs(xs) {
            Some(p) => self.dot_rows_prepared(start, &p, outs),
            None => self.dot_rows_multi_with(Kernel::detect(), start, xs, outs),
        }
    }
    fn prepare_inputs(&self, xs: &[f32]) -> Option<IntInputs> {
        self.int_dot().then(|| TileInputs::quantize(xs, self.cols, GgmlType::Q4_1))
    }
    fn dot_rows_prepared(&self, start: usize, xs: &IntInputs, outs: &mut [&mut [f32]]) {
        // `byte_tiles::dot_rows` checks the outputs' shapes against the tiles' rows.
        byte_tiles::dot_rows(self.byte_tiles(), start, xs, outs)
    }
    fn prepare_cpu_layout(&self) {
        if self.int_dot() {
            self.byte_tiles();
        }
    }
    /// Where this CPU multiplies on byte tiles, builds them and drops the arrays: a CPU-only run
    /// then holds the matrix once (0.75 byte a weight: nibbles and an f32 scale and bias per 32
    /// values).
    fn keep_cpu_layout_only(&mut self) {
        if self.int_dot() {
            self.byte_tiles();
            self.arrays.take();
        }
    }
    fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            self.cols,
            "QuantMatrix::row_to_f32: out has {} values, expected {}",
            out.len(),
            self.cols
        );
        assert!(row < self.rows, "QuantMatrix::row_to_f32: row {row} of {}", self.rows);
        // The kernels evaluate exactly `q·scale + bias` (see `kernel`): keep them in sync.
        let Some(a) = self.arrays.get() else {
            // Kept only as tiles (`keep_cpu_layout_only`): the same values, read from there.
            let tiles = self.tiles.get().expect("a QuantMatrix holds its arrays, its tiles or both");
            for (b, out_b) in out.chunks_exact_mut(TILE_BLOCK).enumerate() {
                let (q, [s, m]) = tiles.block_of_row(row, b);
                let bias = -m;
                for (o, q) in out_b.iter_mut().zip(q) {
                    *o = q as f32 * s + bias;
                }
            }
            return;
        };
        let ng = self.groups_per_row();
        let words = &a.packed[row * (self.cols / 8)..(row + 1) * (self.cols / 8)];
        for (g, out_g) in out.chunks_exact_mut(self.group_size).enumerate() {
            let (s, b) = (a.scales[row * ng + g], a.biases[row * ng + g]);
            let gw = &words[g * self.group_size / 8..(g + 1) * self.group_size / 8];
            for (o8, &w) in out_g.chunks_exact_mut(8).zip(gw) {
                for (k, o) in o8.iter_mut().enumerate() {
                    *o = ((w >> (4 * k)) & 0xF) as f32 * s + b;
                }
            }
        }
    }
    /// On-disk size: 0.5 byte per weight plus a bf16 scale and a bf16 bias per group.
    fn stored_bytes(&self) -> usize {
        self.rows * self.cols / 2 + self.rows * self.groups_per_row() * 4
    }
    fn layout(&self) -> WeightLayout<'_> {
        let a = self.arrays();
        WeightLayout::Affine4 { group_size: self.group_size, packed: &a.packed, scales: &a.scales, biases: &a.biases }
    }
}

fn check_shape(what: &str, rows: usize, cols: usize, group_size: usize) -> Result<()> {
    if !GROUP_SIZES.contains(&group_size) {
        bail!("{what}: group_size {group_size} is not supported (expected 32, 64 or 128)");
    }
    if rows == 0 || cols == 0 {
        bail!("{what}: empty matrix");
    }
    if !cols.is_multiple_of(group_size) {
        bail!("{what}: group_size {group_size} does not divide cols {cols}");
    }
    Ok(())
}

/// Packs 8 codes (each < 16) into one word, code `k` at bits `4k`.
#[inline]
pub(crate) fn pack8(q: &[u8]) -> u32 {
    q.iter().take(8).enumerate().fold(0u32, |w, (k, &v)| w | (u32::from(v & 0xF) << (4 * k)))
}

/// Rounds an f32 to the nearest bf16 (ties to even) and back, as MLX casts scales and biases.
#[inline]
pub(crate) fn round_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the CPU multiplies on byte tiles, `keep_cpu_layout_only` leaves the tiles alone in
    /// memory; rows are then read from them, and the arrays come back exactly when asked for.
    #[test]
    fn a_matrix_kept_as_tiles_alone_holds_no_arrays_until_asked() {
        let (rows, cols) = (40, 256);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 257) as f32 - 128.0) / 97.0).collect();
        let mut m = quantize_affine(&w, rows, cols, 64);
        let (parts, rows_before) = (m.to_mlx_parts(), m.dequantize());
        m.keep_cpu_layout_only();
        if !byte_tiles::supports(GgmlType::Q4_1) {
            assert!(m.arrays.get().is_some() && m.tiles.get().is_none(), "no tiles without AVX-512 VNNI");
            return;
        }
        assert!(m.arrays.get().is_none(), "the arrays stay beside the tiles");
        assert_eq!(m.memory_bytes(), rows.div_ceil(16) * (cols / 32) * (256 + 128), "tiles: nibbles, scales, minimums");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&m.dequantize()), bits(&rows_before), "rows read from the tiles");
        assert!(m.arrays.get().is_none(), "reading rows rebuilt the arrays");
        let again = m.to_mlx_parts();
        assert_eq!((&again.0, bits(&again.1), bits(&again.2)), (&parts.0, bits(&parts.1), bits(&parts.2)));
    }
}
