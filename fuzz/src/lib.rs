//! Fuzzing megagemma's loaders; the targets are in `fuzz_targets/`, the work in [`harness`].
pub mod harness;
