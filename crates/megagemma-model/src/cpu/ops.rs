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

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
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

/// Index of the largest value; the first one wins ties (as torch.argmax).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
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

    #[test]
    fn argmax_first_index_wins() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }
}
