//! QuantMatrix layout, MLX / Q4_0 mapping and quantization, against obviously-correct references
//! written here from the documented formats.

#![allow(clippy::needless_range_loop)]

use megagemma_model::matrix::RowDot;
use megagemma_model::quant::{quantize_affine, quantize_q4_0, QuantMatrix};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

/// Reference MLX dequantizer: nibble `c % 8` of word `c / 8` (bits `4·(c%8)`), w = s·q + b.
fn ref_dequant_mlx(weight: &[u32], scales: &[f32], biases: &[f32], rows: usize, cols: usize, gs: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let word = weight[r * (cols / 8) + c / 8];
            let q = (word >> (4 * (c % 8))) & 0xF;
            let g = r * (cols / gs) + c / gs;
            out.push(scales[g] * q as f32 + biases[g]);
        }
    }
    out
}

fn random_mlx(rng: &mut StdRng, rows: usize, cols: usize, gs: usize) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let w = (0..rows * cols / 8).map(|_| rng.random::<u32>()).collect();
    let s = (0..rows * cols / gs).map(|_| bf16(rng.random_range(-0.05f32..0.05))).collect();
    let b = (0..rows * cols / gs).map(|_| bf16(rng.random_range(-0.5f32..0.5))).collect();
    (w, s, b)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn mlx_roundtrip_and_dequant_match_reference() {
    let mut rng = StdRng::seed_from_u64(1);
    for &(rows, cols, gs) in &[(3, 64, 64), (17, 256, 64), (5, 96, 32), (9, 384, 128), (1, 32, 32)] {
        let (w, s, b) = random_mlx(&mut rng, rows, cols, gs);
        let m = QuantMatrix::from_mlx(&w, &s, &b, rows, cols, gs, 4).unwrap();
        assert_eq!((m.rows(), m.cols(), m.group_size()), (rows, cols, gs));
        let (w2, s2, b2) = m.to_mlx_parts();
        assert_eq!(w2, w);
        assert_eq!(bits(&s2), bits(&s));
        assert_eq!(bits(&b2), bits(&b));
        let reference = ref_dequant_mlx(&w, &s, &b, rows, cols, gs);
        assert_eq!(bits(&m.dequantize()), bits(&reference), "dequantize {rows}x{cols} g{gs}");
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.row_to_f32(r, &mut row);
            assert_eq!(bits(&row), bits(&reference[r * cols..(r + 1) * cols]));
            for c in 0..cols {
                let q = (w[r * (cols / 8) + c / 8] >> (4 * (c % 8))) & 0xF;
                assert_eq!(u32::from(m.code(r, c)), q);
            }
        }
        assert_eq!(m.stored_bytes(), rows * cols / 2 + 4 * rows * cols / gs);
    }
}

#[test]
fn nibble_order_is_least_significant_first() {
    // Row of 8 weights with codes 0..8 must pack into 0x7654_3210.
    let m = QuantMatrix::from_mlx(&[0x7654_3210, 0, 0, 0], &[1.0], &[0.0], 1, 32, 32, 4).unwrap();
    let mut row = vec![0f32; 32];
    m.row_to_f32(0, &mut row);
    assert_eq!(&row[..8], &[0., 1., 2., 3., 4., 5., 6., 7.]);
}

/// MLX affine quantization restated (mlx/backend/metal/kernels/quantized.h, affine_quantize).
fn ref_mlx_group(w: &[f32]) -> (Vec<u8>, f32, f32) {
    let w_min = w.iter().fold(f32::MAX, |a, &v| a.min(v));
    let w_max = w.iter().fold(0.0f32, |a, &v| a.max(v)); // max reduction starts at 0
    let range_scale = ((w_max - w_min) / 15.0).max(1e-7);
    let min_side = w_min.abs() > w_max.abs();
    let signed_scale = if min_side { range_scale } else { -range_scale };
    let edge = if min_side { w_min } else { w_max };
    let q0 = (edge / signed_scale).round();
    let scale = if q0 != 0.0 { edge / q0 } else { signed_scale };
    let bias = if q0 != 0.0 { edge } else { 0.0 };
    let q = w.iter().map(|&v| ((v - bias) / scale).round().clamp(0.0, 15.0) as u8).collect();
    (q, bf16(scale), bf16(bias))
}

fn ref_q4_0_group(w: &[f32]) -> (Vec<u8>, f32, f32) {
    let mut m = 0.0f32;
    for &v in w {
        if v.abs() > m.abs() {
            m = v;
        }
    }
    let d = bf16(m / -8.0);
    let q = w.iter().map(|&v| if d == 0.0 { 8 } else { ((v / d).round() + 8.0).clamp(0.0, 15.0) as u8 }).collect();
    (q, d, -8.0 * d)
}

/// Random rows with special groups mixed in: constant (positive, negative, zero), all-negative,
/// all-positive, tiny values near zero, and bf16-valued data.
fn test_matrix(rng: &mut StdRng, rows: usize, cols: usize, gs: usize) -> Vec<f32> {
    let mut w: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-1.0f32..1.0) * 0.08).collect();
    let ng = cols / gs;
    for (gi, g) in w.chunks_exact_mut(gs).enumerate() {
        match gi % 11 {
            0 => g.fill(0.031),
            1 => g.fill(-0.0173),
            2 => g.fill(0.0),
            3 => g.iter_mut().for_each(|v| *v = -v.abs() - 0.01),
            4 => g.iter_mut().for_each(|v| *v = v.abs() + 0.02),
            5 => g.iter_mut().for_each(|v| *v *= 1e-6),
            6 => g.iter_mut().for_each(|v| *v = bf16(*v)),
            7 => g.iter_mut().for_each(|v| *v *= 1e-9),
            _ => {}
        }
    }
    let _ = ng;
    w
}

/// A reference group quantizer: `(codes, scale, bias)`.
type RefGroup = fn(&[f32]) -> (Vec<u8>, f32, f32);

fn check_against_reference(m: &QuantMatrix, w: &[f32], rows: usize, cols: usize, gs: usize, f: RefGroup) {
    let (_, scales, biases) = m.to_mlx_parts();
    let ng = cols / gs;
    for r in 0..rows {
        for g in 0..ng {
            let (q, s, b) = f(&w[r * cols + g * gs..r * cols + (g + 1) * gs]);
            assert_eq!(scales[r * ng + g].to_bits(), s.to_bits(), "scale row {r} group {g}");
            assert_eq!(biases[r * ng + g].to_bits(), b.to_bits(), "bias row {r} group {g}");
            for j in 0..gs {
                assert_eq!(m.code(r, g * gs + j), q[j], "code row {r} col {}", g * gs + j);
            }
        }
    }
}

#[test]
fn quantize_affine_matches_mlx_formula() {
    let mut rng = StdRng::seed_from_u64(2);
    for &(rows, cols, gs) in &[(13, 256, 64), (7, 384, 128), (11, 160, 32)] {
        let w = test_matrix(&mut rng, rows, cols, gs);
        let m = quantize_affine(&w, rows, cols, gs);
        check_against_reference(&m, &w, rows, cols, gs, ref_mlx_group);
        // Scales and biases are bf16 values; error is within about one step of the group's grid.
        let deq = m.dequantize();
        let (_, scales, biases) = m.to_mlx_parts();
        for (i, (&a, &b)) in w.iter().zip(&deq).enumerate() {
            let g = (i / cols) * (cols / gs) + (i % cols) / gs;
            let (s, bi) = (scales[g], biases[g]);
            assert_eq!(bf16(s), s);
            assert_eq!(bf16(bi), bi);
            let tol = 1.5 * s.abs() + (15.0 * s.abs() + bi.abs()) / 256.0 + 1e-6;
            assert!((a - b).abs() <= tol, "w[{i}] = {a} dequantized to {b} (scale {s}, bias {bi})");
        }
    }
}

#[test]
fn quantize_affine_special_groups() {
    // Constant groups reconstruct exactly (through bf16 bias), zero stays zero, an all-negative
    // group uses w_max = 0 (so 0.0 is code 15 with bias = w_min).
    let gs = 32;
    let mut w = vec![0.0f32; 4 * gs];
    w[..gs].fill(0.25);
    w[gs..2 * gs].fill(-0.375);
    for j in 0..gs {
        w[3 * gs + j] = -(j as f32 + 1.0) / 32.0; // all negative, min -1
    }
    let m = quantize_affine(&w, 1, 4 * gs, gs);
    let d = m.dequantize();
    assert!(d[..gs].iter().all(|&v| v == 0.25));
    assert!(d[gs..2 * gs].iter().all(|&v| v == -0.375));
    assert!(d[2 * gs..3 * gs].iter().all(|&v| v == 0.0));
    let (_, s, b) = m.to_mlx_parts();
    assert_eq!(b[3], -1.0);
    assert_eq!(s[3], bf16(1.0 / 15.0));
}

#[test]
fn quantize_q4_0_matches_reference_and_is_lossless_on_grid() {
    let mut rng = StdRng::seed_from_u64(3);
    let (rows, cols) = (9, 320);
    let w = test_matrix(&mut rng, rows, cols, 32);
    let m = quantize_q4_0(&w, rows, cols);
    assert_eq!(m.group_size(), 32);
    check_against_reference(&m, &w, rows, cols, 32, ref_q4_0_group);

    // Weights already on a Q4_0 grid (bf16 d, the largest magnitude at code 0) come back exactly.
    let mut on_grid = vec![0f32; rows * cols];
    for g in on_grid.chunks_exact_mut(32) {
        let d = bf16(rng.random_range(0.001f32..0.02));
        for v in g.iter_mut() {
            *v = d * (rng.random_range(0..16) as f32 - 8.0);
        }
        g[rng.random_range(0..32)] = -8.0 * d;
    }
    let m = quantize_q4_0(&on_grid, rows, cols);
    assert_eq!(bits(&m.dequantize()), bits(&on_grid));
}

#[test]
fn ggml_q4_0_blocks_map_losslessly() {
    let mut rng = StdRng::seed_from_u64(4);
    let (rows, cols) = (3, 96);
    let n_blocks = rows * cols / 32;
    let mut blocks = Vec::new();
    let mut reference = Vec::new();
    for _ in 0..n_blocks {
        let d = half::f16::from_f32(rng.random_range(-0.03f32..0.03));
        let qs: Vec<u8> = (0..16).map(|_| rng.random::<u8>()).collect();
        blocks.extend_from_slice(&d.to_bits().to_le_bytes());
        blocks.extend_from_slice(&qs);
        let d = d.to_f32();
        let mut y = [0f32; 32];
        for j in 0..16 {
            y[j] = ((qs[j] & 0xF) as f32 - 8.0) * d;
            y[j + 16] = ((qs[j] >> 4) as f32 - 8.0) * d;
        }
        reference.extend_from_slice(&y);
    }
    let m = QuantMatrix::from_ggml_q4_0(&blocks, rows, cols).unwrap();
    // Equal values (d·q − 8d is exact); only the sign of zero may differ from (q − 8)·d.
    assert_eq!(m.dequantize(), reference);
    let err = QuantMatrix::from_ggml_q4_0(&blocks[..blocks.len() - 1], rows, cols).unwrap_err().to_string();
    assert!(err.contains("expected 9 blocks of 18 bytes = 162"), "{err}");
}

#[test]
fn bf16_checkpoint_reloads_bit_identically() {
    let mut rng = StdRng::seed_from_u64(5);
    let (rows, cols, gs) = (6, 256, 64);
    let w = test_matrix(&mut rng, rows, cols, gs);
    let m = quantize_affine(&w, rows, cols, gs);
    let (pw, s, b) = m.to_mlx_parts();
    let s16: Vec<u16> = s.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let b16: Vec<u16> = b.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
    let s2: Vec<f32> = s16.iter().map(|&v| half::bf16::from_bits(v).to_f32()).collect();
    let b2: Vec<f32> = b16.iter().map(|&v| half::bf16::from_bits(v).to_f32()).collect();
    let m2 = QuantMatrix::from_mlx(&pw, &s2, &b2, rows, cols, gs, 4).unwrap();
    assert_eq!(m, m2);
}

#[test]
fn quantization_is_deterministic_across_thread_counts() {
    let mut rng = StdRng::seed_from_u64(6);
    let (rows, cols) = (300, 512);
    let w = test_matrix(&mut rng, rows, cols, 64);
    let a = quantize_affine(&w, rows, cols, 64);
    let b = quantize_affine(&w, rows, cols, 64);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let c = pool.install(|| quantize_affine(&w, rows, cols, 64));
    assert_eq!(a, b);
    assert_eq!(a, c);
    let a = quantize_q4_0(&w, rows, cols);
    let c = pool.install(|| quantize_q4_0(&w, rows, cols));
    assert_eq!(a, c);
}

#[test]
fn bad_inputs_are_clear_errors() {
    let w = vec![0u32; 2 * 8];
    let s = vec![1.0f32; 4];
    let err = |r: megagemma_model::Result<QuantMatrix>| r.unwrap_err().to_string();

    let e = err(QuantMatrix::from_mlx(&w, &s, &s, 2, 64, 32, 8));
    assert!(e.contains("bits = 8 is not supported (only 4-bit affine)"), "{e}");
    let e = err(QuantMatrix::from_mlx(&w, &s, &s, 2, 96, 64, 4));
    assert!(e.contains("group_size 64 does not divide cols 96"), "{e}");
    let e = err(QuantMatrix::from_mlx(&w, &s, &s, 2, 64, 16, 4));
    assert!(e.contains("group_size 16 is not supported (expected 32, 64 or 128)"), "{e}");
    let e = err(QuantMatrix::from_mlx(&w, &s[..3], &s, 2, 64, 32, 4));
    assert!(e.contains("scales has 3 values, expected [2, 2] = 4"), "{e}");
    let e = err(QuantMatrix::from_mlx(&w, &s, &s[..1], 2, 64, 32, 4));
    assert!(e.contains("biases has 1 values, expected [2, 2] = 4"), "{e}");
    let e = err(QuantMatrix::from_mlx(&w[..15], &s, &s, 2, 64, 32, 4));
    assert!(e.contains("weight has 15 u32 words, expected [2, 8] = 16"), "{e}");
    let mut nan = s.clone();
    nan[3] = f32::NAN;
    let e = err(QuantMatrix::from_mlx(&w, &nan, &s, 2, 64, 32, 4));
    assert!(e.contains("scales[1, 1] = NaN is not finite"), "{e}");
    assert!(!e.contains('\n'));
}

#[test]
#[should_panic(expected = "group_size 64 does not divide cols 96")]
fn quantize_rejects_bad_group() {
    quantize_affine(&[0.0; 96], 1, 96, 64);
}
