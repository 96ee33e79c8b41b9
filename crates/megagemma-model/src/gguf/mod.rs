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
mod matrix;
mod reader;

pub use blocks::{dequantize_row, f16_to_f32, GgmlType, SUPPORTED_TYPES};
pub use dot::{dot_row, dot_row_avx2, dot_row_multi, dot_row_portable, dot_rows2_multi, MULTI};
pub use matrix::GgufMatrix;
pub use reader::{GgufArray, GgufFile, GgufTensorInfo, GgufValue, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC};

/// Activation vectors prepared once per product for the integer kernel
/// ([`crate::matrix::RowDot::prepare_inputs`]): digits per 32 values ([`byte_tiles`]).
pub type IntInputs = byte_tiles::TileInputs;
