#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| megagemma_fuzz::harness::safetensors(data));
