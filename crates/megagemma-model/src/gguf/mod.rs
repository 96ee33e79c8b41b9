//! GGUF (llama.cpp's model container) support: a validating memory-mapped reader, ggml block
//! formats with exact dequantization and fused dot kernels, and [`GgufMatrix`], which lets the
//! CPU forward run directly on quantized GGUF weights.
//!
//! Written from the public format description (ggml `docs/gguf.md`, block structs in
//! `ggml-common.h`, `dequantize_row_*` in `ggml-quants.c`).

mod blocks;
pub mod byte_tiles;
mod dot;
#[cfg(target_arch = "x86_64")]
mod dot256;
#[cfg(target_arch = "x86_64")]
mod dot512;
pub mod idot;
mod matrix;
mod reader;

pub use blocks::{dequantize_row, f16_to_f32, GgmlType, SUPPORTED_TYPES};
pub use dot::{dot_row, dot_row_avx2, dot_row_multi, dot_row_portable, dot_rows2_multi, MULTI};
pub use matrix::GgufMatrix;
pub use reader::{GgufArray, GgufFile, GgufTensorInfo, GgufValue, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC};

/// Activation vectors prepared once per product for a GGUF integer kernel
/// ([`crate::matrix::RowDot::prepare_inputs`]): 22-bit lanes for Q4_K / Q6_K rows ([`idot`]),
/// or 20- / 23-bit digits per 32 values for Q8_0 / Q5_0 tiles ([`byte_tiles`]).
pub enum IntInputs {
    Lanes(idot::LaneInputs),
    Tiles(byte_tiles::TileInputs),
}

impl IntInputs {
    /// Number of vectors.
    pub fn len(&self) -> usize {
        match self {
            IntInputs::Lanes(x) => x.len(),
            IntInputs::Tiles(x) => x.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
