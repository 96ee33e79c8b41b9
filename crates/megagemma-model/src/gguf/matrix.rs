//! A GGUF tensor used directly as a CPU weight matrix: rows are dotted straight out of the
//! memory map with the fused kernels, so quantized weights are never expanded in memory.

use std::sync::{Arc, OnceLock};

use memmap2::Mmap;

use super::blocks::{dequant_fn, DequantFn, GgmlType};
use super::byte_tiles::{ByteTiles, TileInputs};
use super::dot::{dot_kernel, dot_kernel_2rows, DotFn, DotMulti2Fn, DotMultiFn, MULTI};
use super::reader::{GgufFile, GgufTensorInfo};
use super::IntInputs;
use crate::bail;
use crate::error::Result;
use crate::matrix::{rows_per_output, RowDot, WeightLayout};

/// `[rows, cols]` view of a GGUF tensor with `dims = [cols, rows, ...]` (higher dims fold into
/// rows). Holds the mmap alive, so it outlives the [`GgufFile`] it came from.
pub struct GgufMatrix {
    mmap: Arc<Mmap>,
    /// Absolute file offset of row 0.
    start: usize,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    ggml_type: GgmlType,
    dot: DotFn,
    dot_multi: DotMultiFn,
    /// Two rows × [`MULTI`] vectors, where this CPU has such a kernel for the type.
    dot_multi2: Option<DotMulti2Fn>,
    dequant: DequantFn,
    /// Rows go through the integer kernel on this CPU ([`super::byte_tiles`]: the formats it
    /// lays out, on AVX-512 VNNI).
    int_dot: bool,
    /// Rows re-laid in 16-row tiles, made when a CPU backend opens or on the first product (a
    /// device backend that only uploads [`RowDot::layout`] never pays for it).
    tiles: OnceLock<ByteTiles>,
}

impl GgufMatrix {
    pub fn from_tensor(file: &GgufFile, info: &GgufTensorInfo) -> Result<GgufMatrix> {
        let ty = info.ggml_type;
        let (Some((dot, dot_multi)), Some(dequant)) = (dot_kernel(ty), dequant_fn(ty)) else {
            bail!(
                "tensor '{}' has ggml type {ty}, which has no CPU kernel (supported: {})",
                info.name,
                super::blocks::supported_list()
            );
        };
        if info.dims.is_empty() {
            bail!("tensor '{}' is a scalar, not a matrix", info.name);
        }
        let cols = info.dims[0] as usize;
        let rows = info.dims[1..].iter().product::<u64>() as usize;
        let row_bytes = ty.row_bytes(cols)?;
        let start = file.data_offset() + info.offset as usize;
        Ok(GgufMatrix {
            mmap: file.mmap().clone(),
            start,
            rows,
            cols,
            row_bytes,
            ggml_type: ty,
            dot,
            dot_multi,
            dot_multi2: dot_kernel_2rows(ty),
            dequant,
            int_dot: super::byte_tiles::supports(ty),
            tiles: OnceLock::new(),
        })
    }

    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// Rows `first .. first + n` as a matrix of their own (one expert of a 3-D expert tensor).
    pub fn row_range(&self, first: usize, n: usize) -> Result<GgufMatrix> {
        if first.checked_add(n).is_none_or(|end| end > self.rows) {
            bail!("rows {first}..{} are outside a {}-row GGUF tensor", first.saturating_add(n), self.rows);
        }
        Ok(GgufMatrix {
            mmap: self.mmap.clone(),
            start: self.start + first * self.row_bytes,
            rows: n,
            cols: self.cols,
            row_bytes: self.row_bytes,
            ggml_type: self.ggml_type,
            dot: self.dot,
            dot_multi: self.dot_multi,
            dot_multi2: self.dot_multi2,
            dequant: self.dequant,
            int_dot: self.int_dot,
            tiles: OnceLock::new(),
        })
    }

    /// The rows as byte tiles, re-laid on the first call. The file's pages of these rows then
    /// leave the process's memory ([`drop_file_pages`]): the CPU kernels read only the tiles, so
    /// a GGUF model is not held twice. A later read of the rows (an embedding gather from a tied
    /// head, an upload to a device) faults them back in from the file.
    fn byte_tiles(&self) -> &ByteTiles {
        self.tiles.get_or_init(|| {
            let len = self.rows * self.row_bytes;
            let data = &self.mmap[self.start..self.start + len];
            let tiles = ByteTiles::from_rows(self.ggml_type, data, self.rows, self.row_bytes);
            drop_file_pages(&self.mmap, self.start, len);
            tiles
        })
    }

    /// The encoded bytes of row `r`.
    pub fn row_bytes(&self, r: usize) -> &[u8] {
        assert!(r < self.rows, "row {r} out of range for a {}-row matrix", self.rows);
        let s = self.start + r * self.row_bytes;
        &self.mmap[s..s + self.row_bytes]
    }
}

/// Gives the whole pages inside `map[start .. start + len]` back to the kernel (`MADV_DONTNEED`):
/// they are clean pages of a read-only file mapping, so a later read re-reads the file — the bytes
/// seen never change. Pages shared with a neighbouring tensor stay. Best effort: a refusal only
/// leaves the pages resident.
fn drop_file_pages(map: &Mmap, start: usize, len: usize) {
    #[cfg(unix)]
    {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
        let base = map.as_ptr() as usize;
        let first = (base + start).next_multiple_of(page) - base;
        let end = (base + start + len) / page * page - base;
        if end > first {
            // SAFETY: the file is mapped read-only and never written, so dropping the pages loses no
            // data and changes nothing any live reference reads: the next access refills them from
            // the file (the page cache).
            let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, first, end - first) };
        }
    }
    #[cfg(not(unix))]
    let _ = (map, start, len);
}

impl GgufFile {
    /// The tensor `name` as a [`GgufMatrix`].
    pub fn matrix(&self, name: &str) -> Result<GgufMatrix> {
        match self.tensor(name) {
            Some(info) => GgufMatrix::from_tensor(self, info),
            None => bail!("{}: no tensor named '{name}'", self.path().display()),
        }
    }
}

impl RowDot for GgufMatrix {
    fn rows(&self) -> usize {
        self.rows
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn dot_rows(&self, start: usize, x: &[f32], out: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "dot_rows: x has {} values, matrix has {} cols", x.len(), self.cols);
        assert!(start + out.len() <= self.rows, "dot_rows: rows {start}..{} out of range", start + out.len());
        if let Some(p) = self.prepare_inputs(x) {
            return self.dot_rows_prepared(start, &p, &mut [out]);
        }
        for (i, o) in out.iter_mut().enumerate() {
            *o = (self.dot)(self.row_bytes(start + i), x);
        }
    }

    fn dot_rows_multi(&self, start: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
        let (cols, t) = (self.cols, xs.len() / self.cols);
        assert_eq!(xs.len(), t * cols, "dot_rows_multi: xs is not [T, {cols}]");
        let n = rows_per_output(outs, t, start, self.rows, "dot_rows_multi");
        if let Some(p) = self.prepare_inputs(xs) {
            return self.dot_rows_prepared(start, &p, outs);
        }
        let x = |ti: usize| &xs[ti * cols..(ti + 1) * cols];
        let mut r0 = 0;
        if let (Some(k2), true) = (self.dot_multi2, t >= MULTI) {
            // Row pairs through the two-row kernel for the first whole groups of MULTI vectors.
            while r0 + 2 <= n {
                let rows = [self.row_bytes(start + r0), self.row_bytes(start + r0 + 1)];
                let mut ti = 0;
                while ti + MULTI <= t {
                    let ys = k2(rows, std::array::from_fn(|j| x(ti + j)));
                    for (dr, yr) in ys.into_iter().enumerate() {
                        for (j, y) in yr.into_iter().enumerate() {
                            outs[ti + j][r0 + dr] = y;
                        }
                    }
                    ti += MULTI;
                }
                for (ti, out) in outs.iter_mut().enumerate().skip(ti) {
                    for (dr, bytes) in rows.into_iter().enumerate() {
                        out[r0 + dr] = (self.dot)(bytes, x(ti));
                    }
                }
                r0 += 2;
            }
        }
        for r in r0..n {
            let bytes = self.row_bytes(start + r);
            let mut ti = 0;
            while ti + MULTI <= t {
                let ys = (self.dot_multi)(bytes, std::array::from_fn(|j| x(ti + j)));
                for (j, y) in ys.into_iter().enumerate() {
                    outs[ti + j][r] = y;
                }
                ti += MULTI;
            }
            for (ti, out) in outs.iter_mut().enumerate().skip(ti) {
                out[r] = (self.dot)(bytes, x(ti));
            }
        }
    }

    fn prepare_inputs(&self, xs: &[f32]) -> Option<IntInputs> {
        if !self.int_dot {
            return None;
        }
        Some(TileInputs::quantize(xs, self.cols, self.ggml_type))
    }

    fn dot_rows_prepared(&self, start: usize, xs: &IntInputs, outs: &mut [&mut [f32]]) {
        assert!(self.int_dot, "dot_rows_prepared on a matrix without an integer kernel");
        // `byte_tiles::dot_rows` checks the outputs' shapes against the tiles' rows.
        super::byte_tiles::dot_rows(self.byte_tiles(), start, xs, outs)
    }

    fn prepare_cpu_layout(&self) {
        if self.int_dot {
            self.byte_tiles();
        }
    }

    fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        assert_eq!(out.len(), self.cols, "row_to_f32: out has {} values, matrix has {} cols", out.len(), self.cols);
        (self.dequant)(self.row_bytes(row), out);
    }

    fn stored_bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    fn layout(&self) -> WeightLayout<'_> {
        WeightLayout::Gguf {
            kind: self.ggml_type,
            bytes: &self.mmap[self.start..self.start + self.rows * self.row_bytes],
        }
    }
}
