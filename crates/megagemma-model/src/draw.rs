//! The draw of one sampled token from a row's candidates, given a uniform number: the arithmetic
//! the engine's sampler uses on the host and the CUDA backend's pipelined sampled decoding runs on
//! the device (`sample_draw` in crates/megagemma-cuda/kernels/sample.cu mirrors it operation for
//! operation), so the same candidates and uniform give the same token on both.
//!
//! Order (the Hugging Face one): temperature, top-k, top-p, min-p, then the draw. Every step is an
//! IEEE operation that rounds the same way on any processor (f64 add, multiply, divide, fused
//! multiply-add, comparisons, in a fixed order); the exponential is [`exp_det`], built from those
//! alone, where a library `exp` may differ in its last bit from one machine to another.

/// What a sampled draw keeps and how it weighs it (the engine's `SamplingParams` less its seed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DrawParams {
    /// > 0: weights are e^((logit − max) / temperature).
    pub temperature: f32,
    /// Candidates kept (the row's highest logits); the caller lists at most this many.
    pub top_k: usize,
    /// The smallest prefix whose weight reaches this share of the total; 1 keeps all.
    pub top_p: f32,
    /// Weights below this share of the top one are dropped; 0 keeps all.
    pub min_p: f32,
}

/// ln 2 in two parts (Cody and Waite): `LN2_HI` has 32 significant bits, so k·LN2_HI is exact for
/// the |k| < 2^21 a finite double's exponent needs.
const LN2_HI: f64 = 0.6931471803691238;
const LN2_LO: f64 = 1.9082149292705877e-10;
/// 1/n! for n = 13 down to 2 (Taylor terms of e^r for |r| ≤ ln2 / 2: the first left out is
/// below 2^-60 of the sum). kernels/sample.cu spells every constant the same way.
const INV_FACT: [f64; 12] = [
    1.6059043836821613e-10,
    2.08767569878681e-9,
    2.505210838544172e-8,
    2.755731922398589e-7,
    2.7557319223985893e-6,
    2.48015873015873e-5,
    1.984126984126984e-4,
    1.388888888888889e-3,
    8.333333333333333e-3,
    4.1666666666666664e-2,
    1.6666666666666666e-1,
    0.5,
];

/// e^x for x ≤ 0 (the weights' exponents), within a few ulps of the true value and the same bits
/// on every processor: x = k·ln 2 + r by fused multiply-adds, a Horner polynomial of fused
/// multiply-adds for e^r, then 2^k as exact products of powers of two. Below −746 it is 0.
pub fn exp_det(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x < -746.0 {
        return 0.0;
    }
    if x > 0.0 {
        return f64::INFINITY; // never asked: every exponent is a logit minus the largest
    }
    let k = (x * std::f64::consts::LOG2_E).round_ties_even();
    let r = (-k).mul_add(LN2_HI, x);
    let r = (-k).mul_add(LN2_LO, r);
    let mut p = INV_FACT[0];
    for c in &INV_FACT[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // 2^k for −1075 ≤ k ≤ 0, in two exact factors so that subnormal results round once.
    let k = k as i64;
    let (a, b) = if k >= -1022 { (k, 0) } else { (k + 200, -200) };
    p * f64::from_bits(((a + 1023) as u64) << 52) * if b == 0 { 1.0 } else { f64::from_bits(((b + 1023) as u64) << 52) }
}

/// The unnormalised weights of `candidates` at `temperature`, their largest logit `best`:
/// e^((l − best) · (1 / temperature)).
pub fn weights(candidates: &[(u32, f32)], best: f32, temperature: f32) -> Vec<f64> {
    let inv_t = 1.0 / temperature as f64;
    candidates.iter().map(|&(_, l)| exp_det((l as f64 - best as f64) * inv_t)).collect()
}

/// How many of `weights` (in descending logit order) top-p keeps: the shortest prefix whose sum
/// reaches `top_p` of the whole (all of them when `top_p` ≥ 1).
pub fn top_p_keep(weights: &[f64], top_p: f32) -> usize {
    if top_p >= 1.0 {
        return weights.len();
    }
    let total: f64 = weights.iter().sum();
    let target = top_p as f64 * total;
    let mut cumulative = 0.0;
    for (i, w) in weights.iter().enumerate() {
        cumulative += w;
        if cumulative >= target {
            return i + 1;
        }
    }
    weights.len()
}

/// Whether min-p keeps a weight (the top candidate's weight is e^0 = 1, so the ratio to it is the
/// weight itself).
pub fn min_p_keeps(w: f64, min_p: f32) -> bool {
    min_p <= 0.0 || w >= min_p as f64
}

/// The index `u` (uniform in [0, 1)) lands on in `weights` (at least one > 0): the first i whose
/// weights up to it exceed u · total, walking in order; the last one if rounding runs past the end.
pub fn draw_index(weights: &[f64], u: f64) -> usize {
    let total: f64 = weights.iter().sum();
    let mut remaining = u * total;
    for (i, w) in weights.iter().enumerate() {
        if remaining < *w {
            return i;
        }
        remaining -= w;
    }
    weights.len() - 1
}

/// The token a sampled step draws with uniform `u` from `candidates`, the row's highest logits
/// highest first (`backend::top_candidates`, at least `params.top_k` of them unless the row has
/// fewer finite logits): top-k, then the weights, top-p, min-p and the draw. `None` when there is
/// no candidate (every logit NaN or −∞); an infinite top logit is chosen outright.
pub fn draw_candidates(candidates: &[(u32, f32)], params: &DrawParams, u: f64) -> Option<u32> {
    let &(best, best_logit) = candidates.first()?;
    if best_logit == f32::INFINITY {
        return Some(best);
    }
    let kept = &candidates[..params.top_k.clamp(1, candidates.len())];
    let mut w = weights(kept, best_logit, params.temperature);
    w.truncate(top_p_keep(&w, params.top_p));
    let (tokens, w): (Vec<u32>, Vec<f64>) =
        kept.iter().zip(w).filter(|(_, w)| min_p_keeps(*w, params.min_p)).map(|(c, w)| (c.0, w)).unzip();
    Some(tokens[draw_index(&w, u)])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_det_is_within_a_few_ulps_of_exp() {
        let mut worst = 0.0f64;
        for i in 0..200_000 {
            let x = -(i as f64) * 0.003_7 - (i % 7) as f64 * 1e-9;
            let (a, b) = (exp_det(x), x.exp());
            if b > 1e-300 {
                worst = worst.max(((a - b) / b).abs());
            }
        }
        assert!(worst < 4.0 * f64::EPSILON, "relative error {worst:e}");
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-800.0), 0.0);
        assert!(exp_det(-740.0) > 0.0 && exp_det(-740.0) < 1e-300, "subnormal results");
        assert!(exp_det(f64::NAN).is_nan());
    }

    #[test]
    fn draws_follow_the_weights_in_order() {
        let c = [(7, 2.0), (3, 1.0), (9, 1.0), (1, -1.0)];
        let p = DrawParams { temperature: 1.0, top_k: 4, top_p: 1.0, min_p: 0.0 };
        assert_eq!(draw_candidates(&c, &p, 0.0), Some(7));
        assert_eq!(draw_candidates(&c, &p, 0.999_999), Some(1));
        // top-k 2 keeps tokens 7 and 3 only.
        let k2 = DrawParams { top_k: 2, ..p };
        assert_eq!(draw_candidates(&c, &k2, 0.999_999), Some(3));
        // top-p 0.5: token 7 alone carries e^0 / (1 + 2e^-1 + e^-3) ≈ 0.56 of the mass.
        let p5 = DrawParams { top_p: 0.5, ..p };
        assert_eq!(draw_candidates(&c, &p5, 0.999_999), Some(7));
        // min-p 0.2 drops token 1 (e^-3 ≈ 0.05 of the top weight).
        let m = DrawParams { min_p: 0.2, ..p };
        assert_eq!(draw_candidates(&c, &m, 0.999_999), Some(9));
        assert_eq!(draw_candidates(&[], &p, 0.5), None);
        assert_eq!(draw_candidates(&[(4, f32::INFINITY), (5, 1.0)], &p, 0.9), Some(4));
    }
}
