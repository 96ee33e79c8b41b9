//! Single-thread `dot_row` throughput on a 4096×4096 matrix (GB/s of weight bytes streamed).
//! `cargo bench -p megagemma-model --bench gguf_dot`.
//!
//! Timed with the thread's CPU clock, not wall time, so other processes competing for the
//! (2-core) machine do not distort the figure; best of 7 full matvecs.

use megagemma_model::gguf::{dot_row, dot_row_portable, GgmlType};

const ROWS: usize = 4096;
const COLS: usize = 4096;

/// Random block bytes with sane f16 scales (random bits could be NaN/Inf or subnormal, which
/// would not measure the normal path).
fn random_matrix(ty: GgmlType, seed: u64) -> Vec<u8> {
    let mut s = seed;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut bytes: Vec<u8> = (0..ROWS * ty.row_bytes(COLS).unwrap()).map(|_| next() as u8).collect();
    let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    let scale_at: &[usize] = match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q5_0 => &[0],
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::F16 => &[],
        _ => unreachable!(),
    };
    if ty == GgmlType::F16 {
        for c in bytes.chunks_exact_mut(2) {
            c.copy_from_slice(&half::f16::from_f32((c[0] as f32 - 128.0) / 64.0).to_bits().to_le_bytes());
        }
    }
    for blk in bytes.chunks_exact_mut(ty.type_size()) {
        for &at in scale_at {
            blk[at..at + 2].copy_from_slice(&scale);
        }
    }
    bytes
}

#[path = "support/cpu_time.rs"]
mod cpu_time;
use cpu_time::thread_cpu_seconds;

type Dot = fn(GgmlType, &[u8], &[f32]) -> megagemma_model::Result<f32>;

/// Best of several full matvecs, in GB/s of weight bytes.
fn gbps(ty: GgmlType, w: &[u8], x: &[f32], dot: Dot) -> (f64, f32) {
    let rb = ty.row_bytes(COLS).unwrap();
    let mut best = f64::MAX;
    let mut sink = 0f32;
    for _ in 0..7 {
        let t = thread_cpu_seconds();
        for r in 0..ROWS {
            sink += dot(ty, &w[r * rb..(r + 1) * rb], x).unwrap();
        }
        best = best.min(thread_cpu_seconds() - t);
    }
    (w.len() as f64 / best / 1e9, sink)
}

fn main() {
    let x: Vec<f32> = (0..COLS).map(|i| ((i * 7919 % 2000) as f32 - 1000.0) / 1000.0).collect();
    for ty in
        [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q5_K, GgmlType::Q4_0, GgmlType::F16]
    {
        let w = random_matrix(ty, 0x9e37_79b9_7f4a_7c15);
        let (fast, a) = gbps(ty, &w, &x, dot_row);
        let (portable, b) = gbps(ty, &w, &x, dot_row_portable);
        println!(
            "{ty:>5}: {:6.1} MB  dispatched {fast:5.2} GB/s ({:5.2} Gvalues/s)  portable {portable:5.2} GB/s  [{a:.3e} {b:.3e}]",
            w.len() as f64 / 1e6,
            fast * ty.block_size() as f64 / ty.type_size() as f64,
        );
    }
}
