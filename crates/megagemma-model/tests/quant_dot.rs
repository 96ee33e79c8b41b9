//! QuantMatrix dot kernels: agreement with dequantize-then-dot, and batch invariance through
//! `matmul` (T = 1 vs T = 5 columns bit-identical; a row's result independent of its block).

#![allow(clippy::needless_range_loop)]

use megagemma_model::matrix::{matmul, RowDot};
use megagemma_model::quant::{quantize_affine, quantize_q4_0, Kernel, QuantMatrix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn random(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

fn matrices(rng: &mut StdRng) -> Vec<(String, QuantMatrix)> {
    let mut v = Vec::new();
    for &(rows, cols, gs) in &[(203, 512, 64), (37, 256, 32), (21, 384, 128), (5, 64, 64)] {
        let w = random(rng, rows * cols, 0.1);
        v.push((format!("affine {rows}x{cols} g{gs}"), quantize_affine(&w, rows, cols, gs)));
    }
    let w = random(rng, 70 * 320, 0.1);
    v.push(("q4_0 70x320".to_string(), quantize_q4_0(&w, 70, 320)));
    v
}

#[test]
fn dot_rows_matches_dequantized_dot_for_every_kernel() {
    let mut rng = StdRng::seed_from_u64(10);
    println!("kernels available: {:?}, detected {:?}", Kernel::available(), Kernel::detect());
    for (name, m) in matrices(&mut rng) {
        let (rows, cols) = (m.rows(), m.cols());
        let deq = m.dequantize();
        // Activations with a non-zero mean, so the bias term matters.
        let x: Vec<f32> = random(&mut rng, cols, 2.0).iter().map(|v| v + 0.5).collect();
        for kernel in Kernel::available() {
            let mut out = vec![0f32; rows];
            m.dot_rows_with(kernel, 0, &x, &mut out);
            for r in 0..rows {
                let row = &deq[r * cols..(r + 1) * cols];
                let exact: f64 = row.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
                let norm: f64 = row.iter().zip(&x).map(|(&w, &x)| (w as f64 * x as f64).abs()).sum();
                let err = (out[r] as f64 - exact).abs();
                assert!(
                    err <= 1e-5 * norm.max(f64::MIN_POSITIVE),
                    "{name} {kernel:?} row {r}: {} vs {exact} (|err| {err:e}, Σ|w·x| {norm:e})",
                    out[r]
                );
            }
        }
    }
}

#[test]
fn row_result_is_independent_of_block() {
    let mut rng = StdRng::seed_from_u64(11);
    for (name, m) in matrices(&mut rng) {
        let x = random(&mut rng, m.cols(), 1.0);
        for kernel in Kernel::available() {
            let mut all = vec![0f32; m.rows()];
            m.dot_rows_with(kernel, 0, &x, &mut all);
            // Every (start, len) split must reproduce the same bits.
            for &(start, len) in
                &[(0, 1), (1, 3), (2, 4), (3, 7), (m.rows() - 1, 1), (m.rows() / 2, m.rows() - m.rows() / 2)]
            {
                if start + len > m.rows() {
                    continue;
                }
                let mut part = vec![0f32; len];
                m.dot_rows_with(kernel, start, &x, &mut part);
                for i in 0..len {
                    assert_eq!(part[i].to_bits(), all[start + i].to_bits(), "{name} {kernel:?} row {}", start + i);
                }
            }
        }
    }
}

#[test]
fn matmul_t1_and_t5_are_bit_identical() {
    let mut rng = StdRng::seed_from_u64(12);
    for (name, m) in matrices(&mut rng) {
        let (rows, cols) = (m.rows(), m.cols());
        let t = 5;
        let xs = random(&mut rng, t * cols, 1.0);
        let mut ys = vec![0f32; t * rows];
        matmul(&m, &xs, &mut ys);
        for ti in 0..t {
            let mut y1 = vec![0f32; rows];
            matmul(&m, &xs[ti * cols..(ti + 1) * cols], &mut y1);
            for r in 0..rows {
                assert_eq!(y1[r].to_bits(), ys[ti * rows + r].to_bits(), "{name} token {ti} row {r}");
            }
        }
    }
}

#[test]
fn row_to_f32_matches_dequantize() {
    let mut rng = StdRng::seed_from_u64(13);
    for (_, m) in matrices(&mut rng) {
        let deq = m.dequantize();
        let mut row = vec![0f32; m.cols()];
        for r in 0..m.rows() {
            m.row_to_f32(r, &mut row);
            assert_eq!(row, deq[r * m.cols()..(r + 1) * m.cols()]);
        }
    }
}

#[test]
fn multi_vector_kernels_are_bit_identical_to_single_vector_calls() {
    // Verify and prefill decode each row once for several tokens: every (row, vector) result
    // must equal the single-vector call exactly, for every kernel, group size and T.
    let mut rng = StdRng::seed_from_u64(12);
    for (name, m) in matrices(&mut rng) {
        for t in [1, 2, 4, 5, 9] {
            let xs = random(&mut rng, t * m.cols(), 3.0);
            for kernel in Kernel::available() {
                // Rows from an odd start, so single-row tails follow the 4-row blocks.
                let (start, n) = (1, m.rows() - 1);
                let mut multi = vec![f32::NAN; t * n];
                m.dot_rows_multi_with(kernel, start, &xs, &mut multi.chunks_mut(n).collect::<Vec<_>>());
                for ti in 0..t {
                    let mut single = vec![0f32; n];
                    m.dot_rows_with(kernel, start, &xs[ti * m.cols()..(ti + 1) * m.cols()], &mut single);
                    for r in 0..n {
                        assert_eq!(
                            multi[ti * n + r].to_bits(),
                            single[r].to_bits(),
                            "{name} {kernel:?} T={t} vector {ti} row {r}"
                        );
                    }
                }
            }
        }
    }
}
