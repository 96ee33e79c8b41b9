//! Elementwise and per-vector operations of the reference forward, in f32.

/// `y = x · (mean(x²) + eps)^(-1/2) · w` in place; `w = None` for the weightless variant
/// (Gemma 4's v_norm and router norm). The mean is accumulated in f64.
pub fn rms_norm(x: &mut [f32], w: Option<&[f32]>, eps: f32) {
    let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    let r = (ms + eps as f64).powf(-0.5) as f32;
    match w {
        Some(w) => x.iter_mut().zip(w).for_each(|(v, w)| *v = *v * r * w),
        None => x.iter_mut().for_each(|v| *v *= r),
    }
}

/// RMSNorm applied to each `dim`-sized chunk of `x` (per head, or per PLE layer slice).
pub fn rms_norm_chunks(x: &mut [f32], dim: usize, w: Option<&[f32]>, eps: f32) {
    x.chunks_exact_mut(dim).for_each(|c| rms_norm(c, w, eps));
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`): `0.5·x·(1 + tanh(u))` with
/// `u = √(2/π)·(x + 0.044715·x³)`, computed as the equal `x / (1 + e^(−2u))` with [`exp_f32`],
/// so it is plain f32 arithmetic that LLVM vectorises (a libm `tanh` per element was 8% of a
/// 512-token prefill). Within 2e-7 relative of the exact function (tested).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    x / (1.0 + exp_f32(-2.0 * u))
}

/// `e^z` in f32 from multiplies and adds only: `z = n·ln 2 + r` (Cody–Waite, `|r| ≤ ln 2 / 2`),
/// `e^r` by its Taylor polynomial to `r⁷` (truncation < 1e-8 relative), times `2^n` built in the
/// exponent bits. `z` is clamped to [−87, 88] (`e^z` stays a normal f32); NaN stays NaN.
#[inline(always)]
pub fn exp_f32(z: f32) -> f32 {
    // Adding 1.5·2^23 rounds to the nearest integer (|z·log2 e| < 2^22).
    const SHIFTER: f32 = 12_582_912.0;
    // ln 2 split so that n·LN2_HI is exact for |n| < 2^15.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let z = z.clamp(-87.0, 88.0);
    let nf = (z * std::f32::consts::LOG2_E + SHIFTER) - SHIFTER;
    let r = (z - nf * LN2_HI) - nf * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    p * f32::from_bits(((nf as i32 + 127) as u32) << 23)
}

/// `g[i] = gelu_tanh(g[i]) · u[i]` (the gated GELU of an MLP), vectorised for the widest
/// instruction set the CPU has; the same bits at every width (no fused multiply-add).
pub fn gelu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "gelu_mul: {} gate values, {} up values", g.len(), u.len());
    #[cfg(target_arch = "x86_64")]
    match crate::simd::level() {
        // SAFETY: the CPU supports the features of the chosen level (checked at run time).
        crate::simd::Level::Avx512 => return unsafe { gelu_mul_avx512(g, u) },
        crate::simd::Level::Avx2 => return unsafe { gelu_mul_avx2(g, u) },
        crate::simd::Level::Portable => {}
    }
    gelu_mul_generic(g, u)
}

#[inline(always)]
fn gelu_mul_generic(g: &mut [f32], u: &[f32]) {
    g.iter_mut().zip(u).for_each(|(g, u)| *g = gelu_tanh(*g) * u);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn gelu_mul_avx512(g: &mut [f32], u: &[f32]) {
    gelu_mul_generic(g, u)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn gelu_mul_avx2(g: &mut [f32], u: &[f32]) {
    gelu_mul_generic(g, u)
}

/// Rotate one head vector in the "rotate half" layout: pair (i, i + d/2) turns by
/// `pos · inv_freq[i]`. Angles and cos/sin are computed in f32, like the reference.
/// A zero frequency leaves its pair bit-identical (cos 0 = 1, sin 0 = 0).
pub fn rope(head: &mut [f32], pos: usize, inv_freq: &[f32]) {
    rope_heads(head, head.len(), pos, inv_freq);
}

/// [`rope`] on every `hd`-sized head of `row`, all at position `pos`: each angle's sine and
/// cosine is computed once for the row (the same values `rope` computes per head).
pub fn rope_heads(row: &mut [f32], hd: usize, pos: usize, inv_freq: &[f32]) {
    let m = hd / 2;
    debug_assert_eq!(inv_freq.len(), m);
    let p = pos as f32;
    for i in 0..m {
        let f = inv_freq[i];
        if f == 0.0 {
            continue;
        }
        let (s, c) = (p * f).sin_cos();
        for head in row.chunks_exact_mut(hd) {
            let (a, b) = (head[i], head[i + m]);
            head[i] = a * c - b * s;
            head[i + m] = b * c + a * s;
        }
    }
}

/// Numerically stable softmax in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// `cap · tanh(x / cap)`.
#[inline]
pub fn softcap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

/// Index of the largest value; the first one wins ties (as torch.argmax). NaNs are passed over,
/// but a NaN at index 0 is returned (the scan `if v > x[best]` that this computes in two passes:
/// the largest value in 16 independent lanes, which vectorises, then its first index).
pub fn argmax(x: &[f32]) -> u32 {
    if x.is_empty() || x[0].is_nan() {
        return 0;
    }
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            lanes[j] = if c[j] > lanes[j] { c[j] } else { lanes[j] };
        }
    }
    let mut m = x[0];
    for &v in lanes.iter().chain(tail) {
        if v > m {
            m = v;
        }
    }
    x.iter().position(|&v| v == m).unwrap_or(0) as u32
}

/// [`argmax`] of a row computed in slices: `add(slice, offset)` for each slice in any order,
/// then [`ArgmaxParts::argmax`] gives the index `argmax` gives for the whole row.
#[derive(Clone, Copy, Debug, Default)]
pub struct ArgmaxParts {
    /// The row's first value is NaN (then `argmax` returns 0).
    first_nan: bool,
    /// The largest non-NaN value and its first index, across the slices seen so far.
    best: Option<(f32, usize)>,
}

impl ArgmaxParts {
    /// Adds the slice that starts at index `offset` of the row.
    pub fn add(&mut self, x: &[f32], offset: usize) {
        if offset == 0 && x.first().is_some_and(|v| v.is_nan()) {
            self.first_nan = true;
        }
        let Some(i0) = x.iter().position(|v| !v.is_nan()) else { return };
        let local = argmax(&x[i0..]) as usize + i0;
        self.merge((x[local], offset + local));
    }

    /// Adds a slice's best (value, index) (slices merge in any order: ties go to the lower index).
    fn merge(&mut self, (v, i): (f32, usize)) {
        self.best = match self.best {
            Some((bv, bi)) if bv > v || (bv == v && bi < i) => Some((bv, bi)),
            _ => Some((v, i)),
        };
    }

    /// Combines two partial results.
    pub fn join(mut self, other: ArgmaxParts) -> ArgmaxParts {
        self.first_nan |= other.first_nan;
        if let Some(b) = other.best {
            self.merge(b);
        }
        self
    }

    pub fn argmax(&self) -> u32 {
        match self.best {
            Some((_, i)) if !self.first_nan => i as u32,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rms() {
        let mut x = vec![3.0, -4.0, 0.0, 5.0];
        rms_norm(&mut x, None, 0.0);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_zero_frequency_passes_through_and_rotation_preserves_norm() {
        let mut h = vec![1.0, 2.0, 3.0, 4.0];
        rope(&mut h, 7, &[0.5, 0.0]);
        assert_eq!(h[1], 2.0);
        assert_eq!(h[3], 4.0);
        assert!(((h[0] * h[0] + h[2] * h[2]) - 10.0).abs() < 1e-5);
        assert!((h[0] - (3.5f32.cos() - 3.0 * 3.5f32.sin())).abs() < 1e-6);
    }

    #[test]
    fn gelu_matches_formula_points() {
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((gelu_tanh(-3.0) + 0.003_637_8).abs() < 1e-5);
    }

    /// The exact GELU (tanh form) in f64.
    fn gelu_f64(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    }

    #[test]
    fn gelu_matches_the_exact_function() {
        // Error measured against max(|gelu(x)|, 1): relative for large outputs, absolute near
        // zero, where the f32 argument of the exponential already carries ~1e-7·|u|.
        let (mut worst, mut worst_libm) = (0f64, 0f64);
        for i in -200_000..=200_000 {
            let x = i as f32 * 1e-4; // −20 .. 20
            let want = gelu_f64(x as f64);
            let libm = 0.5 * x * (1.0 + (0.797_884_6 * (x + 0.044715 * x * x * x)).tanh());
            worst = worst.max((gelu_tanh(x) as f64 - want).abs() / want.abs().max(1.0));
            worst_libm = worst_libm.max((libm as f64 - want).abs() / want.abs().max(1.0));
        }
        eprintln!("gelu: largest error {worst:e} (libm tanh form: {worst_libm:e})");
        assert!(worst < 3e-7, "largest error {worst:e}");
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert_eq!(gelu_tanh(1e6), 1e6);
        assert!(gelu_tanh(-1e6).abs() < 1e-30);
        assert!(gelu_tanh(f32::NAN).is_nan());
    }

    #[test]
    fn exp_matches_f64() {
        for i in -870..=879 {
            let z = i as f32 * 0.1 + 0.0123;
            let (got, want) = (exp_f32(z) as f64, (z as f64).exp());
            assert!(((got - want) / want).abs() < 3e-7, "exp({z}) = {got}, want {want}");
        }
    }

    #[test]
    fn gelu_mul_equals_the_scalar_function_bit_for_bit() {
        let g: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.013).collect();
        let u: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 * 0.001).collect();
        let mut v = g.clone();
        gelu_mul(&mut v, &u);
        for i in 0..g.len() {
            assert_eq!(v[i].to_bits(), (gelu_tanh(g[i]) * u[i]).to_bits(), "element {i}");
        }
    }

    #[test]
    fn argmax_in_parts_equals_the_whole_row() {
        // Rows with NaNs (also first), ties, ±0 and ±∞, cut into slices at every few places and
        // added in a shuffled order.
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        let pool = [f32::NAN, 0.0, -0.0, 1.0, 2.0, -3.0, f32::INFINITY, f32::NEG_INFINITY, 2.0, 0.5];
        for _ in 0..2000 {
            let n = 1 + next() % 40;
            let x: Vec<f32> = (0..n).map(|_| pool[next() % pool.len()]).collect();
            let mut cuts: Vec<usize> = (0..next() % 5).map(|_| next() % n).collect();
            cuts.extend([0, n]);
            cuts.sort();
            cuts.dedup();
            let mut slices: Vec<(usize, usize)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
            let k = slices.len();
            slices.rotate_left(next() % k);
            let parts = slices.iter().fold(ArgmaxParts::default(), |acc, &(a, b)| {
                let mut p = ArgmaxParts::default();
                p.add(&x[a..b], a);
                acc.join(p)
            });
            assert_eq!(parts.argmax(), argmax(&x), "{x:?} cut at {cuts:?}");
        }
    }

    #[test]
    fn argmax_first_index_wins() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn argmax_equals_the_scan_on_ties_nans_and_signed_zeros() {
        let scan = |x: &[f32]| {
            let mut best = 0;
            for (i, &v) in x.iter().enumerate() {
                if v > x[best] {
                    best = i;
                }
            }
            best as u32
        };
        let mut s = 7u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 5.0];
        for len in [0, 1, 2, 15, 16, 17, 33, 100, 1000] {
            for _ in 0..200 {
                let x: Vec<f32> = (0..len)
                    .map(|_| match next() % 8 {
                        0 => specials[(next() % 6) as usize],
                        _ => (next() % 11) as f32 - 5.0,
                    })
                    .collect();
                assert_eq!(argmax(&x), scan(&x), "{x:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN, 1.0]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 2.0]), 2);
    }
}
