//! Batch-1 matvec throughput of 4-bit `QuantMatrix` (and dense f32 for comparison) through
//! `matrix::matmul` on all rayon threads, against the machine's measured memory read bandwidth.
//!
//! `cargo bench -p megagemma-model --bench quant_matvec`
//!
//! First prints a summary (median of several runs): memory read bandwidth (multi-threaded sum over
//! a 1 GiB f32 buffer), then for each case the weight bytes streamed per second (`stored_bytes` /
//! time: 0.5 B/weight + bf16 scale and bias per group for q4) and the ratio to that bandwidth.
//! Cases: a single 4096×4096 matrix (9 MiB, may sit in L3) and a set of 16384×4096 matrices cycled
//! so that ≥ 1 GiB is touched between reuses (an honest DRAM figure). Then criterion runs the
//! 4096×4096 cases. `QUANT_BENCH_SET_MIB` overrides the size of the cycled set (default 1024);
//! `QUANT_BENCH_SUMMARY_ONLY=1` skips the criterion part.

#![allow(clippy::needless_range_loop)]

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput};
use megagemma_model::dense::DenseMatrix;
use megagemma_model::matrix::{matmul, RowDot};
use megagemma_model::quant::{quantize_affine, Kernel, QuantMatrix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

fn random(rng: &mut StdRng, n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    // Parallel fill from per-chunk seeds (fast on big buffers, still deterministic).
    let seed: u64 = rng.random();
    v.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        let mut r = StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        c.iter_mut().for_each(|x| *x = r.random_range(-0.05f32..0.05));
    });
    v
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Median seconds of `reps` runs of `f` after one warm-up.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Multi-threaded read bandwidth: sum of a 1 GiB f32 buffer on all rayon threads, GB/s.
fn memory_read_bandwidth() -> f64 {
    let n = (1usize << 30) / 4;
    let buf: Vec<f32> = (0..n).into_par_iter().map(|i| (i % 7) as f32).collect();
    let secs = time(7, || {
        let s: f32 = buf
            .par_chunks(1 << 18)
            .map(|c| {
                let mut acc = [0f32; 16];
                for c16 in c.chunks_exact(16) {
                    for k in 0..16 {
                        acc[k] += c16[k];
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        black_box(s);
    });
    (n * 4) as f64 / secs / 1e9
}

/// GB/s of `stored_bytes` for one matvec per matrix over `ms`, cycled.
fn matvec_rate(ms: &[&dyn RowDot], reps: usize) -> (f64, f64) {
    let cols = ms[0].cols();
    let mut rng = StdRng::seed_from_u64(7);
    let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut ys: Vec<Vec<f32>> = ms.iter().map(|m| vec![0f32; m.rows()]).collect();
    let bytes: usize = ms.iter().map(|m| m.stored_bytes()).sum();
    let secs = time(reps, || {
        for (m, y) in ms.iter().zip(ys.iter_mut()) {
            matmul(*m, &x, y);
        }
        black_box(&ys);
    });
    (bytes as f64 / secs / 1e9, secs / ms.len() as f64)
}

/// Like `matmul` for one token, with an explicit kernel, cycled over `ms`.
fn kernel_rate(ms: &[QuantMatrix], kernel: Kernel, reps: usize) -> (f64, f64) {
    let mut rng = StdRng::seed_from_u64(8);
    let x: Vec<f32> = (0..ms[0].cols()).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut ys: Vec<Vec<f32>> = ms.iter().map(|m| vec![0f32; m.rows()]).collect();
    let bytes: usize = ms.iter().map(|m| m.stored_bytes()).sum();
    let secs = time(reps, || {
        for (q, y) in ms.iter().zip(ys.iter_mut()) {
            y.par_chunks_mut(64).enumerate().for_each(|(b, o)| q.dot_rows_with(kernel, b * 64, &x, o));
        }
        black_box(&ys);
    });
    (bytes as f64 / secs / 1e9, secs / ms.len() as f64)
}

fn report() {
    let set_mib: usize = std::env::var("QUANT_BENCH_SET_MIB").ok().and_then(|s| s.parse().ok()).unwrap_or(1024);
    println!("== quant_matvec summary ==");
    println!("threads: {}, q4 kernel: {}", rayon::current_num_threads(), Kernel::detect().name());
    let bw = memory_read_bandwidth();
    println!("memory read bandwidth (1 GiB f32 sum, all threads): {bw:.1} GB/s");
    let line = |name: &str, (gbs, secs): (f64, f64), bytes: usize| {
        println!(
            "{name:<48} {:>8.2} MiB/matrix {:>9.1} µs {:>7.1} GB/s  {:>5.1}% of mem bw",
            bytes as f64 / (1 << 20) as f64,
            secs * 1e6,
            gbs,
            100.0 * gbs / bw
        );
    };

    let mut rng = StdRng::seed_from_u64(1);
    let w = random(&mut rng, 4096 * 4096);
    let q = quantize_affine(&w, 4096, 4096, 64);
    line("q4 g64 4096x4096 (single, may be cache-resident)", matvec_rate(&[&q], 50), q.stored_bytes());
    let d = DenseMatrix::from_f32(4096, 4096, w);
    line("f32 4096x4096 (single)", matvec_rate(&[&d], 20), d.stored_bytes());
    drop(d);
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let small = [quantize_affine(&random(&mut rng, 256 * 4096), 256, 4096, 64)];
    let q = [q];
    for kernel in Kernel::available() {
        let k = kernel.name();
        line(&format!("  q4 4096x4096 {k}, all threads"), kernel_rate(&q, kernel, 50), q[0].stored_bytes());
        line(
            &format!("  q4 4096x4096 {k}, 1 thread"),
            one.install(|| kernel_rate(&q, kernel, 20)),
            q[0].stored_bytes(),
        );
        line(
            &format!("  q4 256x4096 {k}, 1 thread (L2-resident)"),
            one.install(|| kernel_rate(&small, kernel, 200)),
            small[0].stored_bytes(),
        );
    }

    let w = random(&mut rng, 16384 * 4096);
    let big = quantize_affine(&w, 16384, 4096, 64);
    drop(w);
    let n = (set_mib << 20).div_ceil(big.memory_bytes()).max(2);
    let set: Vec<QuantMatrix> = (0..n).map(|_| big.clone()).collect();
    let refs: Vec<&dyn RowDot> = set.iter().map(|m| m as &dyn RowDot).collect();
    line(
        &format!("q4 g64 16384x4096 x{n} cycled ({} MiB in RAM)", (n * big.memory_bytes()) >> 20),
        matvec_rate(&refs, 5),
        big.stored_bytes(),
    );
    drop(refs);
    for kernel in Kernel::available() {
        line(&format!("  same, kernel {}", kernel.name()), kernel_rate(&set, kernel, 3), big.stored_bytes());
    }
    drop(set);

    let n = (set_mib << 20).div_ceil(4096 * 4096 * 4).max(2);
    let dense: Vec<DenseMatrix> =
        (0..n).map(|_| DenseMatrix::from_f32(4096, 4096, random(&mut rng, 4096 * 4096))).collect();
    let refs: Vec<&dyn RowDot> = dense.iter().map(|m| m as &dyn RowDot).collect();
    line(&format!("f32 4096x4096 x{n} cycled ({} MiB)", n * 64), matvec_rate(&refs, 5), 4096 * 4096 * 4);
    println!();
}

fn criterion_benches(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(2);
    let w = random(&mut rng, 4096 * 4096);
    let q = quantize_affine(&w, 4096, 4096, 64);
    let d = DenseMatrix::from_f32(4096, 4096, w);
    let x: Vec<f32> = (0..4096).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let mut y = vec![0f32; 4096];
    let mut g = c.benchmark_group("matvec_4096x4096");
    g.sample_size(30);
    g.throughput(Throughput::Bytes(q.stored_bytes() as u64));
    g.bench_function("q4_g64", |b| b.iter(|| matmul(&q, black_box(&x), &mut y)));
    g.throughput(Throughput::Bytes(d.stored_bytes() as u64));
    g.bench_function("f32", |b| b.iter(|| matmul(&d, black_box(&x), &mut y)));
    g.finish();
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let mut c = Criterion::default().configure_from_args();
    if benching {
        report();
    }
    if std::env::var_os("QUANT_BENCH_SUMMARY_ONLY").is_some() {
        return;
    }
    criterion_benches(&mut c);
    c.final_summary();
}
