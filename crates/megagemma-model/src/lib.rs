//! megagemma-model: Gemma 4 (and Gemma 3) text decoders from config to logits.
//!
//! Owns the typed config, the layer plan, checkpoint loading and the CPU reference forward.
//! Builds with no tokenizer, HTTP, CLI or CUDA dependency.

pub mod assistant;
pub mod backend;
pub mod checkpoint;
pub mod config;
pub mod conformance;
pub mod cpu;
pub mod dense;
pub mod draw;
pub mod error;
pub mod gguf;
pub mod gguf_model;
pub mod matrix;
pub mod model;
pub mod plan;
pub mod quant;
pub mod simd;
pub mod weights;

pub use backend::{Backend, PosOut, SeqId, Want};
pub use error::{Error, Result};
pub use model::Model;
