//! Dense weight matrices: f32 held in memory, bf16/f16 read straight from the memory-mapped
//! checkpoint and converted exactly, element by element, inside the dot product.

use crate::checkpoint::{DType, MappedBytes, TensorRef};
use crate::matrix::{RowDot, WeightLayout};
use crate::simd;
use crate::{bail, Result};

enum Storage {
    F32(Vec<f32>),
    Bf16(Halves),
    F16(Halves),
}

/// 16-bit elements: viewed in place in the mapped file when 2-byte aligned (always, for files
/// written by safetensors), otherwise copied out once.
enum Halves {
    Mapped(MappedBytes),
    Owned(Vec<u16>),
}

impl Halves {
    fn new(bytes: MappedBytes) -> Halves {
        if bytes.bytes().as_ptr().align_offset(2) == 0 {
            Halves::Mapped(bytes)
        } else {
            Halves::Owned(bytes.bytes().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
        }
    }
    fn as_slice(&self) -> &[u16] {
        match self {
            Halves::Mapped(b) => {
                let bytes = b.bytes();
                // SAFETY: alignment checked in `new`; u16 has no invalid bit patterns; the
                // mapping outlives the borrow. (Little-endian hosts only, like the file format.)
                unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const u16, bytes.len() / 2) }
            }
            Halves::Owned(v) => v,
        }
    }
    fn byte_len(&self) -> usize {
        self.as_slice().len() * 2
    }
}

pub struct DenseMatrix {
    rows: usize,
    cols: usize,
    storage: Storage,
}

impl DenseMatrix {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> DenseMatrix {
        assert_eq!(data.len(), rows * cols);
        DenseMatrix { rows, cols, storage: Storage::F32(data) }
    }

    /// Rows `[row0, row0 + rows)` of a tensor viewed as `[total_rows, cols]` (expert slices of a
    /// 3-D tensor use this).
    pub fn from_tensor_rows(t: &TensorRef, row0: usize, rows: usize, cols: usize) -> Result<DenseMatrix> {
        let es = t.dtype.size();
        let bytes = t.data.slice(row0 * cols * es, rows * cols * es);
        let storage = match t.dtype {
            DType::BF16 => Storage::Bf16(Halves::new(bytes)),
            DType::F16 => Storage::F16(Halves::new(bytes)),
            DType::F32 => Storage::F32(
                bytes.bytes().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            other => bail!("tensor `{}` has dtype {}; dense weights must be F32, F16 or BF16", t.name, other.name()),
        };
        Ok(DenseMatrix { rows, cols, storage })
    }

    pub fn from_tensor(t: &TensorRef, rows: usize, cols: usize) -> Result<DenseMatrix> {
        t.expect_shape(&[rows, cols])?;
        Self::from_tensor_rows(t, 0, rows, cols)
    }
}

impl RowDot for DenseMatrix {
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn dot_rows(&self, start: usize, x: &[f32], out: &mut [f32]) {
        let c = self.cols;
        match &self.storage {
            Storage::F32(w) => {
                for (i, o) in out.iter_mut().enumerate() {
                    let r = start + i;
                    *o = simd::dot_f32(&w[r * c..(r + 1) * c], x);
                }
            }
            Storage::Bf16(b) => {
                let w = b.as_slice();
                for (i, o) in out.iter_mut().enumerate() {
                    let r = start + i;
                    *o = simd::dot_bf16(&w[r * c..(r + 1) * c], x);
                }
            }
            Storage::F16(b) => {
                let w = b.as_slice();
                for (i, o) in out.iter_mut().enumerate() {
                    let r = start + i;
                    *o = simd::dot_f16(&w[r * c..(r + 1) * c], x);
                }
            }
        }
    }
    fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.storage {
            Storage::F32(w) => out.copy_from_slice(&w[row * c..(row + 1) * c]),
            Storage::Bf16(b) => {
                for (o, &p) in out.iter_mut().zip(&b.as_slice()[row * c..(row + 1) * c]) {
                    *o = simd::bf16_to_f32(p);
                }
            }
            Storage::F16(b) => {
                for (o, &p) in out.iter_mut().zip(&b.as_slice()[row * c..(row + 1) * c]) {
                    *o = half::f16::from_bits(p).to_f32();
                }
            }
        }
    }
    fn stored_bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(w) => w.len() * 4,
            Storage::Bf16(b) | Storage::F16(b) => b.byte_len(),
        }
    }
    fn layout(&self) -> WeightLayout<'_> {
        match &self.storage {
            Storage::F32(w) => WeightLayout::F32(w),
            Storage::Bf16(b) => WeightLayout::Bf16(b.as_slice()),
            Storage::F16(b) => WeightLayout::F16(b.as_slice()),
        }
    }
}
