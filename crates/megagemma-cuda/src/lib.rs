//! megagemma-cuda: the Gemma 4 (and Gemma 3) text decoder on an NVIDIA GPU.
//!
//! Kernels are header-free `.cu` files compiled by NVRTC at start-up ([`compile`]); weights are
//! uploaded into arenas ([`weights`]); [`CudaModel`] holds them and the device, [`CudaSeq`] one
//! sequence's KV cache and scratch, and runs the forward pass stage by stage on one stream.

pub mod backend;
pub mod check;
pub mod compile;
pub mod device;
pub mod libs;
pub mod model;
pub mod seq;
pub mod synthetic;
pub mod weights;

pub use backend::CudaBackend;
pub use model::CudaModel;
pub use seq::{CudaSeq, PosOut, Want, MAX_CHUNK};
