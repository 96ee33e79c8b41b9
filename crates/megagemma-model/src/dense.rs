//! Dense weight matrices: f32 held in memory, bf16/f16 read straight from the memory-mapped
//! checkpoint and converted exactly, element by element, inside the dot product.

use crate::checkpoint::{DType, MappedBytes, TensorRef};
use crate::matrix::RowDot;
use crate::simd;
use crate::{bail, Result};

enum Storage {
    F32(Vec<f32>),
    Bf16(MappedBytes),
    F16(MappedBytes),
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
            DType::BF16 => Storage::Bf16(bytes),
            DType::F16 => Storage::F16(bytes),
            DType::F32 => Storage::F32(bytes.bytes().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
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
                let w = b.bytes();
                for (i, o) in out.iter_mut().enumerate() {
                    let r = start + i;
                    *o = simd::dot_bf16(&w[2 * r * c..2 * (r + 1) * c], x);
                }
            }
            Storage::F16(b) => {
                let w = b.bytes();
                for (i, o) in out.iter_mut().enumerate() {
                    let r = start + i;
                    *o = simd::dot_f16(&w[2 * r * c..2 * (r + 1) * c], x);
                }
            }
        }
    }
    fn row_to_f32(&self, row: usize, out: &mut [f32]) {
        let c = self.cols;
        match &self.storage {
            Storage::F32(w) => out.copy_from_slice(&w[row * c..(row + 1) * c]),
            Storage::Bf16(b) => {
                for (o, p) in out.iter_mut().zip(b.bytes()[2 * row * c..2 * (row + 1) * c].chunks_exact(2)) {
                    *o = simd::bf16_to_f32(u16::from_le_bytes([p[0], p[1]]));
                }
            }
            Storage::F16(b) => {
                for (o, p) in out.iter_mut().zip(b.bytes()[2 * row * c..2 * (row + 1) * c].chunks_exact(2)) {
                    *o = half::f16::from_bits(u16::from_le_bytes([p[0], p[1]])).to_f32();
                }
            }
        }
    }
    fn stored_bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(w) => w.len() * 4,
            Storage::Bf16(b) | Storage::F16(b) => b.len(),
        }
    }
}
