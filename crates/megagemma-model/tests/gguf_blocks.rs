//! ggml block formats: `dequantize_row` must be bit-exact and `dot_row` close, against a slow
//! reference written here from the ggml formulas.
//!
//! Each reference block is built from *logical* values (scales, mins, integer quants), packed
//! into bytes by a straightforward per-value encoder, and the expected floats are computed from
//! the logical values, never from the bytes. A wrong bit position or nibble order on either
//! side makes the comparison fail.

// The encoders index by value position on purpose: each line states where value `i` lives.
#![allow(clippy::needless_range_loop)]

use half::f16;
use megagemma_model::gguf::{
    dequantize_row, dot_row, dot_row_avx2, dot_row_multi, dot_row_portable, dot_rows2_multi, f16_to_f32, GgmlType,
    MULTI,
};

/// splitmix64: small deterministic generator (the crate has no rand dependency).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u32) -> u32 {
        (self.next() % n as u64) as u32
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// A random finite f16 scale with magnitude in [2^-8, 2), either sign.
    fn scale(&mut self) -> f16 {
        let mag = 2f32.powf(-8.0 + 9.0 * (self.unit() + 1.0) / 2.0);
        f16::from_f32(if self.below(2) == 0 { mag } else { -mag })
    }
    fn pos_scale(&mut self) -> f16 {
        f16::from_f32(self.scale().to_f32().abs())
    }
}

fn put_f16(b: &mut [u8], at: usize, v: f16) {
    b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
}

/// A block type's reference: `encode` packs logical values into bytes, `values` states ggml's
/// dequantization formula per value from the same logical values.
struct RefBlock {
    bytes: Vec<u8>,
    values: Vec<f32>,
}

fn ref_q8_0(rng: &mut Rng) -> RefBlock {
    let d = rng.scale();
    let q: Vec<i8> = (0..32).map(|_| rng.next() as i8).collect();
    let mut b = vec![0u8; 34];
    put_f16(&mut b, 0, d);
    for i in 0..32 {
        b[2 + i] = q[i] as u8;
    }
    let values = q.iter().map(|&q| q as f32 * d.to_f32()).collect();
    RefBlock { bytes: b, values }
}

/// Value `i` of a 32-value 4-bit block: low nibble of byte `i` for i < 16, else high nibble of byte i-16.
fn put_nibble32(qs: &mut [u8], i: usize, q: u8) {
    if i < 16 {
        qs[i] |= q;
    } else {
        qs[i - 16] |= q << 4;
    }
}

fn ref_q4_0(rng: &mut Rng) -> RefBlock {
    let d = rng.scale();
    let q: Vec<u8> = (0..32).map(|_| rng.below(16) as u8).collect();
    let mut b = vec![0u8; 18];
    put_f16(&mut b, 0, d);
    for i in 0..32 {
        put_nibble32(&mut b[2..], i, q[i]);
    }
    let values = q.iter().map(|&q| (q as i32 - 8) as f32 * d.to_f32()).collect();
    RefBlock { bytes: b, values }
}

fn ref_q4_1(rng: &mut Rng) -> RefBlock {
    let (d, m) = (rng.scale(), rng.scale());
    let q: Vec<u8> = (0..32).map(|_| rng.below(16) as u8).collect();
    let mut b = vec![0u8; 20];
    put_f16(&mut b, 0, d);
    put_f16(&mut b, 2, m);
    for i in 0..32 {
        put_nibble32(&mut b[4..], i, q[i]);
    }
    let values = q.iter().map(|&q| q as f32 * d.to_f32() + m.to_f32()).collect();
    RefBlock { bytes: b, values }
}

/// 5-bit block: low 4 bits as in 4-bit blocks, 5th bit of value i = bit i of the u32 `qh`.
fn put_q5(b: &mut [u8], qh_at: usize, qs_at: usize, q: &[u8]) {
    let mut qh = 0u32;
    for i in 0..32 {
        put_nibble32(&mut b[qs_at..], i, q[i] & 0xf);
        qh |= ((q[i] >> 4) as u32) << i;
    }
    b[qh_at..qh_at + 4].copy_from_slice(&qh.to_le_bytes());
}

fn ref_q5_0(rng: &mut Rng) -> RefBlock {
    let d = rng.scale();
    let q: Vec<u8> = (0..32).map(|_| rng.below(32) as u8).collect();
    let mut b = vec![0u8; 22];
    put_f16(&mut b, 0, d);
    put_q5(&mut b, 2, 6, &q);
    let values = q.iter().map(|&q| (q as i32 - 16) as f32 * d.to_f32()).collect();
    RefBlock { bytes: b, values }
}

fn ref_q5_1(rng: &mut Rng) -> RefBlock {
    let (d, m) = (rng.scale(), rng.scale());
    let q: Vec<u8> = (0..32).map(|_| rng.below(32) as u8).collect();
    let mut b = vec![0u8; 24];
    put_f16(&mut b, 0, d);
    put_f16(&mut b, 2, m);
    put_q5(&mut b, 4, 8, &q);
    let values = q.iter().map(|&q| q as f32 * d.to_f32() + m.to_f32()).collect();
    RefBlock { bytes: b, values }
}

/// Pack 8 six-bit scales and mins into ggml's 12-byte K-quant layout: for j < 4, scale j in
/// the low 6 bits of byte j and min j in byte j+4; for j >= 4, the low 4 bits go to byte j+4
/// (scale: low nibble, min: high nibble) and the top 2 bits to the top of byte j-4 (scale) / j (min).
fn pack_k4_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] |= sc[j];
            s[j + 4] |= mn[j];
        } else {
            s[j + 4] |= (sc[j] & 0xf) | ((mn[j] & 0xf) << 4);
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (mn[j] >> 4) << 6;
        }
    }
    s
}

/// Q4_K (bits = 4) or Q5_K (bits = 5): value i is in sub-block s = i/32 with scale sc[s] and
/// min mn[s]; its low 4 bits are in qs byte 32*(i/64) + i%32 (low nibble for even s, high for
/// odd s); for Q5_K the 5th bit is bit s of qh[i % 32].
fn ref_k4(rng: &mut Rng, bits: u32) -> RefBlock {
    let (d, dmin) = (rng.pos_scale(), rng.pos_scale());
    let sc: [u8; 8] = std::array::from_fn(|_| rng.below(64) as u8);
    let mn: [u8; 8] = std::array::from_fn(|_| rng.below(64) as u8);
    let q: Vec<u8> = (0..256).map(|_| rng.below(1 << bits) as u8).collect();
    let (size, qs_at) = if bits == 4 { (144, 16) } else { (176, 48) };
    let mut b = vec![0u8; size];
    put_f16(&mut b, 0, d);
    put_f16(&mut b, 2, dmin);
    b[4..16].copy_from_slice(&pack_k4_scales(&sc, &mn));
    for i in 0..256 {
        let s = i / 32;
        let byte = qs_at + 32 * (i / 64) + i % 32;
        b[byte] |= if s % 2 == 0 { q[i] & 0xf } else { (q[i] & 0xf) << 4 };
        if bits == 5 {
            b[16 + i % 32] |= (q[i] >> 4) << s;
        }
    }
    let values = (0..256)
        .map(|i| {
            let s = i / 32;
            (d.to_f32() * sc[s] as f32) * q[i] as f32 - dmin.to_f32() * mn[s] as f32
        })
        .collect();
    RefBlock { bytes: b, values }
}

/// Q6_K: value i = 128h + 32k + l (h: half, k: quarter, l < 32) has quant q in 0..64 stored as
/// low 4 bits in ql[64h + 32(k%2) + l] (low nibble for k < 2, high otherwise) and top 2 bits at
/// bits 2k..2k+2 of qh[32h + l]; scale i8 scales[i/16]; value = d*scale*(q-32).
fn ref_q6_k(rng: &mut Rng) -> RefBlock {
    let d = rng.scale();
    let sc: [i8; 16] = std::array::from_fn(|_| rng.next() as i8);
    let q: Vec<u8> = (0..256).map(|_| rng.below(64) as u8).collect();
    let mut b = vec![0u8; 210];
    for i in 0..256 {
        let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
        let ql = 64 * h + 32 * (k % 2) + l;
        b[ql] |= if k < 2 { q[i] & 0xf } else { (q[i] & 0xf) << 4 };
        b[128 + 32 * h + l] |= (q[i] >> 4) << (2 * k);
    }
    for (j, &s) in sc.iter().enumerate() {
        b[192 + j] = s as u8;
    }
    put_f16(&mut b, 208, d);
    let values = (0..256).map(|i| (d.to_f32() * sc[i / 16] as f32) * (q[i] as i32 - 32) as f32).collect();
    RefBlock { bytes: b, values }
}

fn ref_f32(rng: &mut Rng) -> RefBlock {
    let v = rng.unit() * 100.0;
    RefBlock { bytes: v.to_le_bytes().to_vec(), values: vec![v] }
}

fn ref_f16(rng: &mut Rng) -> RefBlock {
    let h = f16::from_f32(rng.unit() * 1000.0);
    RefBlock { bytes: h.to_bits().to_le_bytes().to_vec(), values: vec![h.to_f32()] }
}

fn ref_bf16(rng: &mut Rng) -> RefBlock {
    let h = half::bf16::from_f32(rng.unit() * 1000.0);
    RefBlock { bytes: h.to_bits().to_le_bytes().to_vec(), values: vec![h.to_f32()] }
}

type MakeBlock = fn(&mut Rng) -> RefBlock;

fn all_types() -> Vec<(GgmlType, MakeBlock)> {
    vec![
        (GgmlType::F32, ref_f32 as MakeBlock),
        (GgmlType::F16, ref_f16),
        (GgmlType::BF16, ref_bf16),
        (GgmlType::Q8_0, ref_q8_0),
        (GgmlType::Q4_0, ref_q4_0),
        (GgmlType::Q4_1, ref_q4_1),
        (GgmlType::Q5_0, ref_q5_0),
        (GgmlType::Q5_1, ref_q5_1),
        (GgmlType::Q4_K, |r| ref_k4(r, 4)),
        (GgmlType::Q5_K, |r| ref_k4(r, 5)),
        (GgmlType::Q6_K, ref_q6_k),
    ]
}

/// A row of `n_blocks` random reference blocks.
fn ref_row(rng: &mut Rng, make: MakeBlock, n_blocks: usize) -> RefBlock {
    let mut row = RefBlock { bytes: vec![], values: vec![] };
    for _ in 0..n_blocks {
        let b = make(rng);
        row.bytes.extend(b.bytes);
        row.values.extend(b.values);
    }
    row
}

#[test]
fn block_geometry_matches_ggml() {
    for (ty, make) in all_types() {
        let b = make(&mut Rng(1));
        assert_eq!(b.bytes.len(), ty.type_size(), "{ty} block bytes");
        assert_eq!(b.values.len(), ty.block_size(), "{ty} block values");
        assert_eq!(GgmlType::from_id(ty.id()), Some(ty));
        assert!(ty.is_supported());
    }
    assert_eq!(GgmlType::from_id(12), Some(GgmlType::Q4_K));
    assert_eq!(GgmlType::from_id(14), Some(GgmlType::Q6_K));
    assert_eq!(GgmlType::from_id(8), Some(GgmlType::Q8_0));
    assert_eq!(GgmlType::from_id(30), Some(GgmlType::BF16));
    assert_eq!(GgmlType::from_id(4), None, "Q4_2 was removed from ggml");
    assert_eq!(GgmlType::Q4_K.row_bytes(4096).unwrap(), 16 * 144);
    assert!(GgmlType::Q4_K.row_bytes(100).unwrap_err().to_string().contains("Q4_K"));
}

#[test]
fn dequantize_is_bit_exact_for_every_type() {
    let mut rng = Rng(42);
    for (ty, make) in all_types() {
        // Several rows, several blocks each, so block-to-block stepping is exercised too.
        for _ in 0..20 {
            let n_blocks = if ty.block_size() == 1 { 67 } else { 5 };
            let row = ref_row(&mut rng, make, n_blocks);
            let mut out = vec![f32::NAN; row.values.len()];
            dequantize_row(ty, &row.bytes, &mut out).unwrap();
            for (i, (&got, &want)) in out.iter().zip(&row.values).enumerate() {
                assert_eq!(got.to_bits(), want.to_bits(), "{ty} value {i}: got {got}, want {want}");
            }
        }
    }
}

/// Tolerance for a dot of `n` terms: f32 accumulation error relative to `Σ|w·x|` (the only
/// meaningful scale when terms cancel).
fn check_dot(ty: GgmlType, what: &str, got: f32, values: &[f32], x: &[f32]) {
    let exact: f64 = values.iter().zip(x).map(|(&w, &x)| w as f64 * x as f64).sum();
    let magnitude: f64 = values.iter().zip(x).map(|(&w, &x)| (w as f64 * x as f64).abs()).sum();
    let err = (got as f64 - exact).abs();
    assert!(
        err <= 1e-5 * magnitude + 1e-30,
        "{ty} {what}: got {got}, exact {exact}, error {err:e} vs Σ|w·x| {magnitude:e}"
    );
}

#[test]
fn dot_matches_dequantize_then_dot() {
    let mut rng = Rng(7);
    for (ty, make) in all_types() {
        for n_blocks in [1, 3, 16] {
            // Float types: odd lengths exercise the scalar tail after 32-lane chunks.
            let n_blocks = if ty.block_size() == 1 { n_blocks * 97 } else { n_blocks };
            let row = ref_row(&mut rng, make, n_blocks);
            let x: Vec<f32> = (0..row.values.len()).map(|_| rng.unit()).collect();
            let mut deq = vec![0f32; x.len()];
            dequantize_row(ty, &row.bytes, &mut deq).unwrap();
            check_dot(ty, "dot_row", dot_row(ty, &row.bytes, &x).unwrap(), &deq, &x);
            check_dot(ty, "dot_row_portable", dot_row_portable(ty, &row.bytes, &x).unwrap(), &deq, &x);
        }
    }
}

#[test]
fn multi_column_dots_are_bit_identical_to_single_dots() {
    // Verify and prefill decode each row once for several tokens: every column must be exactly
    // the single-vector result, or speculative decoding would stop being lossless.
    let mut rng = Rng(11);
    for (ty, make) in all_types() {
        for n_blocks in [1, 3, 9] {
            let n_blocks = if ty.block_size() == 1 { n_blocks * 97 } else { n_blocks };
            let row = ref_row(&mut rng, make, n_blocks);
            let xs: Vec<Vec<f32>> =
                (0..MULTI).map(|_| (0..row.values.len()).map(|_| rng.unit() * 100.0).collect()).collect();
            let multi = dot_row_multi(ty, &row.bytes, std::array::from_fn(|n| xs[n].as_slice())).unwrap();
            // Two rows at once (the two-row kernels of some CPUs): each (row, column) as well.
            let other = ref_row(&mut rng, make, n_blocks);
            let pair =
                dot_rows2_multi(ty, [&row.bytes, &other.bytes], std::array::from_fn(|n| xs[n].as_slice())).unwrap();
            for (n, x) in xs.iter().enumerate() {
                let single = dot_row(ty, &row.bytes, x).unwrap();
                assert_eq!(multi[n].to_bits(), single.to_bits(), "{ty} column {n}: {} vs {single}", multi[n]);
                assert_eq!(pair[0][n].to_bits(), single.to_bits(), "{ty} row 0 of a pair, column {n}");
                let single = dot_row(ty, &other.bytes, x).unwrap();
                assert_eq!(pair[1][n].to_bits(), single.to_bits(), "{ty} row 1 of a pair, column {n}");
            }
        }
    }
}

#[test]
fn dispatched_dots_are_bit_identical_to_the_avx2_build() {
    // The hand-written AVX-512 kernels promise the AVX2 build's bits (same decoded weights, same
    // fused lanes, same reduction order), so a model's output does not depend on which of the
    // two a machine picks. Where the CPU has no AVX-512 both sides are the AVX2 build.
    let mut rng = Rng(23);
    for (ty, make) in all_types() {
        for n_blocks in [1, 2, 5, 20] {
            let n_blocks = if ty.block_size() == 1 { n_blocks * 97 } else { n_blocks };
            let row = ref_row(&mut rng, make, n_blocks);
            for scale in [1.0, 1e-3, 1e4] {
                let x: Vec<f32> = (0..row.values.len()).map(|_| rng.unit() * scale).collect();
                let Some(avx2) = dot_row_avx2(ty, &row.bytes, &x).unwrap() else { return };
                let got = dot_row(ty, &row.bytes, &x).unwrap();
                assert_eq!(got.to_bits(), avx2.to_bits(), "{ty} {n_blocks} blocks: {got} vs AVX2 {avx2}");
            }
        }
    }
}

#[test]
fn dot_of_one_hot_vectors_recovers_each_weight() {
    // x = e_i makes the dot equal weight i exactly (every other term is an exact zero), which
    // pins each value's position independently of the dequantizer.
    let mut rng = Rng(99);
    for (ty, make) in all_types() {
        let row = ref_row(&mut rng, make, if ty.block_size() == 1 { 40 } else { 2 });
        let mut x = vec![0f32; row.values.len()];
        for i in 0..x.len() {
            x[i] = 1.0;
            let got = dot_row(ty, &row.bytes, &x).unwrap();
            assert_eq!(got, row.values[i], "{ty} one-hot {i}");
            x[i] = 0.0;
        }
    }
}

#[test]
fn q4_0_known_block() {
    // d = 0.5; byte j = j | (15 - j) << 4, so value j = (j - 8)·0.5 and value 16 + j = (7 - j)·0.5.
    let mut b = vec![0x00, 0x38]; // f16 0.5
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let mut out = [0f32; 32];
    dequantize_row(GgmlType::Q4_0, &b, &mut out).unwrap();
    assert_eq!(out[0], -4.0);
    assert_eq!(out[8], 0.0);
    assert_eq!(out[15], 3.5);
    assert_eq!(out[16], 3.5);
    assert_eq!(out[31], -4.0);
    // Σ(j-8) + Σ(7-j) over j < 16 = -8 + -8, times 0.5.
    assert_eq!(dot_row(GgmlType::Q4_0, &b, &[1.0; 32]).unwrap(), -8.0);
    let mut x = [0f32; 32];
    x[1] = 2.0; // value 1 = -3.5
    x[30] = 1.0; // value 30 = (7-14)·0.5 = -3.5
    assert_eq!(dot_row(GgmlType::Q4_0, &b, &x).unwrap(), -10.5);
}

#[test]
fn q8_0_known_block() {
    // d = 0.25; q_j = j - 16, so value j = (j - 16)/4.
    let mut b = vec![0x00, 0x34]; // f16 0.25
    b.extend((0..32i32).map(|j| (j - 16) as i8 as u8));
    let mut out = [0f32; 32];
    dequantize_row(GgmlType::Q8_0, &b, &mut out).unwrap();
    assert_eq!(out[0], -4.0);
    assert_eq!(out[16], 0.0);
    assert_eq!(out[31], 3.75);
    // Σ(j - 16) for j < 32 = -16, times 0.25.
    assert_eq!(dot_row(GgmlType::Q8_0, &b, &[1.0; 32]).unwrap(), -4.0);
}

#[test]
fn q4_k_known_block() {
    // d = 1, dmin = 0.5, all quants 3; scales 1..7 and 40, mins 2 except 33 for sub-block 5.
    // 40 and 33 need their top two bits, stored in the spare bits of bytes 3 and 5.
    let mut b = vec![0x00, 0x3c, 0x00, 0x38]; // f16 1.0, 0.5
    b.extend([1, 2, 3, 4 | 0x80, 2, 2 | 0x80, 2, 2, 0x25, 0x16, 0x27, 0x28]);
    b.extend([0x33; 128]);
    let mut out = [0f32; 256];
    dequantize_row(GgmlType::Q4_K, &b, &mut out).unwrap();
    // value = scale·3 − 0.5·min per 32-value sub-block.
    let want = [2.0, 5.0, 8.0, 11.0, 14.0, 1.5, 20.0, 119.0];
    for (i, &v) in out.iter().enumerate() {
        assert_eq!(v, want[i / 32], "value {i}");
    }
    assert_eq!(dot_row(GgmlType::Q4_K, &b, &[1.0; 256]).unwrap(), 32.0 * want.iter().sum::<f32>());
}

#[test]
fn f16_conversion_is_exact_for_all_bit_patterns() {
    for bits in 0..=u16::MAX {
        let want = f16::from_bits(bits).to_f32();
        let got = f16_to_f32(bits);
        if want.is_nan() {
            assert!(got.is_nan(), "{bits:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{bits:#06x}");
        }
    }
}

#[test]
fn unsupported_types_and_bad_lengths_are_clear_errors() {
    let e = dequantize_row(GgmlType::Q2_K, &[0; 84], &mut [0.0; 256]).unwrap_err().to_string();
    assert!(e.contains("Q2_K"), "{e}");
    let e = dot_row(GgmlType::IQ4_XS, &[0; 136], &[0.0; 256]).unwrap_err().to_string();
    assert!(e.contains("IQ4_XS"), "{e}");
    // 33 values are not a whole number of Q8_0 blocks.
    let e = dot_row(GgmlType::Q8_0, &[0; 34], &[0.0; 33]).unwrap_err().to_string();
    assert!(e.contains("Q8_0") && e.contains("blocks"), "{e}");
    // Byte count disagrees with the value count.
    let e = dequantize_row(GgmlType::Q6_K, &[0; 200], &mut [0.0; 256]).unwrap_err().to_string();
    assert!(e.contains("Q6_K") && e.contains("210"), "{e}");
}

// ---- Whole models: every block type through the CPU forward ----------------------------------

/// GGUF string: u64 length, then the bytes.
fn gguf_str(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

/// A GGUF v3 file: metadata (key, GGUF value type, value bytes) and tensors (name, ggml dims
/// with the row length first, type, data), the data section aligned to GGUF's default 32 bytes.
fn gguf_file(kvs: &[(&str, u32, Vec<u8>)], tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)]) -> Vec<u8> {
    let mut f = b"GGUF".to_vec();
    f.extend(3u32.to_le_bytes());
    f.extend((tensors.len() as u64).to_le_bytes());
    f.extend((kvs.len() as u64).to_le_bytes());
    for (key, ty, value) in kvs {
        f.extend(gguf_str(key));
        f.extend(ty.to_le_bytes());
        f.extend(value);
    }
    let mut data = vec![];
    for (name, dims, ty, bytes) in tensors {
        f.extend(gguf_str(name));
        f.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| f.extend(d.to_le_bytes()));
        f.extend(ty.id().to_le_bytes());
        f.extend((data.len() as u64).to_le_bytes());
        data.extend(bytes);
        data.resize(data.len().next_multiple_of(32), 0);
    }
    f.resize(f.len().next_multiple_of(32), 0);
    f.extend(data);
    f
}

/// A small Gemma 3 in llama.cpp's GGUF layout whose matrices (the tied embedding included) are
/// random blocks of `ty`, and its twin with the same weights stored as F32 (the blocks' values
/// from ggml's formulas, as `ref_row` states them). Row lengths are multiples of 256, so every
/// type fits; two sliding layers of window 8; no final softcap (the random weights' logits are
/// in the thousands, where it would make every logit 30).
fn gemma3_and_f32_twin(ty: GgmlType, make: MakeBlock, seed: u64) -> (Vec<u8>, Vec<u8>) {
    let (h, heads, kv, hd, inter, layers, vocab) = (256u64, 2u64, 1u64, 128u64, 512u64, 2, 32u64);
    let u32v = |v: u64| (v as u32).to_le_bytes().to_vec();
    let kvs = [
        ("general.architecture", 8, gguf_str("gemma3")),
        ("gemma3.embedding_length", 4, u32v(h)),
        ("gemma3.block_count", 4, u32v(layers)),
        ("gemma3.feed_forward_length", 4, u32v(inter)),
        ("gemma3.attention.head_count", 4, u32v(heads)),
        ("gemma3.attention.head_count_kv", 4, u32v(kv)),
        ("gemma3.attention.key_length", 4, u32v(hd)),
        ("gemma3.attention.value_length", 4, u32v(hd)),
        ("gemma3.attention.sliding_window", 4, u32v(8)),
        ("tokenizer.ggml.bos_token_id", 4, u32v(2)),
        ("tokenizer.ggml.eos_token_id", 4, u32v(1)),
        ("tokenizer.ggml.padding_token_id", 4, u32v(0)),
    ];
    let mut shapes = vec![("token_embd.weight".to_string(), vec![h, vocab]), ("output_norm.weight".into(), vec![h])];
    for i in 0..layers {
        let b = format!("blk.{i}.");
        for (name, dims) in [
            ("attn_norm", vec![h]),
            ("attn_q", vec![h, heads * hd]),
            ("attn_k", vec![h, kv * hd]),
            ("attn_v", vec![h, kv * hd]),
            ("attn_output", vec![heads * hd, h]),
            ("attn_q_norm", vec![hd]),
            ("attn_k_norm", vec![hd]),
            ("post_attention_norm", vec![h]),
            ("ffn_norm", vec![h]),
            ("post_ffw_norm", vec![h]),
            ("ffn_gate", vec![h, inter]),
            ("ffn_up", vec![h, inter]),
            ("ffn_down", vec![inter, h]),
        ] {
            shapes.push((format!("{b}{name}.weight"), dims));
        }
    }
    let mut rng = Rng(seed);
    let (mut quant, mut twin) = (vec![], vec![]);
    for (name, dims) in shapes {
        let f32_bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        if dims.len() == 1 {
            // Norm weights stay F32 in both files, as llama.cpp writes them.
            let w: Vec<f32> = (0..dims[0]).map(|_| rng.unit() * 0.5).collect();
            quant.push((name.clone(), dims.clone(), GgmlType::F32, f32_bytes(&w)));
            twin.push((name, dims, GgmlType::F32, f32_bytes(&w)));
            continue;
        }
        let row = ref_row(&mut rng, make, (dims[0] * dims[1]) as usize / ty.block_size());
        quant.push((name.clone(), dims.clone(), ty, row.bytes));
        twin.push((name, dims, GgmlType::F32, f32_bytes(&row.values)));
    }
    (gguf_file(&kvs, &quant), gguf_file(&kvs, &twin))
}

/// Relative L2 distance of `a` from `b`.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let n: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (d / n).sqrt()
}

#[test]
fn models_of_every_block_type_decode_as_their_f32_twins() {
    // The block kernels (on AVX-512 VNNI machines the byte tiles with integer digit inputs,
    // elsewhere the float dots) through whole forward passes — prefill, decode past a sliding
    // window's wrap, a four-token verify — against the same weights stored as F32. Every
    // product of the quantized model is within ~2^-22 of exact, so the logits agree to within
    // 1e-5 (2e-6 at worst, measured), and a verify's columns are bit-identical to the decode steps.
    use megagemma_model::cpu::CpuBackend;
    use megagemma_model::{Backend, Model, Want};
    let dir = std::env::temp_dir().join(format!("megagemma-block-models-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (k, (ty, make)) in all_types().into_iter().filter(|(ty, _)| ty.block_size() > 1).enumerate() {
        let (quant, twin) = gemma3_and_f32_twin(ty, make, 100 + k as u64);
        let load = |name: &str, bytes: &[u8]| {
            let path = dir.join(format!("{ty}-{name}.gguf"));
            std::fs::write(&path, bytes).unwrap();
            Model::load(&path).unwrap_or_else(|e| panic!("{ty} {name}: {e}"))
        };
        let (mut q, mut f) = (
            CpuBackend::new(std::sync::Arc::new(load("quant", &quant))),
            CpuBackend::new(std::sync::Arc::new(load("twin", &twin))),
        );
        let prompt: Vec<u32> = (0..12).map(|i| 4 + (i * 7) % 28).collect();
        let (sq, sf) = (q.new_sequence().unwrap(), f.new_sequence().unwrap());
        let mut oq = q.prefill(sq, &prompt, Want::Logits).unwrap();
        let mut of = f.prefill(sf, &prompt, Want::Logits).unwrap();
        // Teacher-forced: both models are fed the quantized model's tokens.
        let (mut fed, mut steps, mut ids_compared, mut worst) = (vec![], vec![], 0, 0f64);
        for step in 0..14 {
            let d = rel_l2(&oq.logits, &of.logits);
            assert!(d < 1e-5, "{ty} step {step}: logits differ from the F32 twin's by {d:.2e} relative L2");
            worst = worst.max(d);
            let mut sorted = of.logits.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 1e-3 {
                assert_eq!(oq.argmax, of.argmax, "{ty} step {step}: argmax differs from the F32 twin's");
                ids_compared += 1;
            }
            steps.push(oq.clone());
            fed.push(oq.argmax);
            oq = q.decode(sq, oq.argmax, Want::Logits).unwrap();
            of = f.decode(sf, *fed.last().unwrap(), Want::Logits).unwrap();
        }
        assert!(ids_compared >= 10, "{ty}: only {ids_compared} steps without a near tie");

        // The same continuation through one verify of four tokens on a fresh sequence.
        let s = q.new_sequence().unwrap();
        q.prefill(s, &prompt, Want::Argmax).unwrap();
        for &t in &fed[..6] {
            q.decode(s, t, Want::Argmax).unwrap();
        }
        let outs = q.verify(s, &fed[6..10], Want::Logits).unwrap();
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.logits, steps[7 + i].logits, "{ty}: verify column {i} differs from its decode step");
        }
        eprintln!("{ty}: 14 steps, worst relative L2 {worst:.1e}, {ids_compared} ids compared, verify = steps");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
