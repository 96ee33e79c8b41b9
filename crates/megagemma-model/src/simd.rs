//! Dot-product kernels for the CPU forward.
//!
//! Each kernel exists once as portable code written so LLVM vectorises it (eight independent
//! accumulators over fixed-size chunks), compiled twice: plainly and with AVX2 enabled (no FMA contraction: plain mul then add),
//! chosen at run time. The choice depends only on the machine, so a given row and vector always
//! give the same bits — the batch-invariance contract of [`crate::matrix`].

use std::sync::OnceLock;

const LANES: usize = 16;

#[inline(always)]
fn dot_f32_generic(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        let (x, y) = (&a[c * LANES..c * LANES + LANES], &b[c * LANES..c * LANES + LANES]);
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..a.len() {
        tail += a[i] * b[i];
    }
    reduce(&acc) + tail
}

/// bf16 weights (bit patterns), converted exactly on the fly: bf16 is the top half of an f32.
#[inline(always)]
fn dot_bf16_generic(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0f32; LANES];
    let chunks = x.len() / LANES;
    for c in 0..chunks {
        let ws = &w[c * LANES..(c + 1) * LANES];
        let xs = &x[c * LANES..(c + 1) * LANES];
        for l in 0..LANES {
            acc[l] += bf16_to_f32(ws[l]) * xs[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..x.len() {
        tail += bf16_to_f32(w[i]) * x[i];
    }
    reduce(&acc) + tail
}

#[inline(always)]
fn dot_f16_generic(w: &[u16], x: &[f32]) -> f32 {
    debug_assert_eq!(w.len(), x.len());
    let mut acc = [0f32; LANES];
    let chunks = x.len() / LANES;
    for c in 0..chunks {
        let ws = &w[c * LANES..(c + 1) * LANES];
        let xs = &x[c * LANES..(c + 1) * LANES];
        for l in 0..LANES {
            acc[l] += half::f16::from_bits(ws[l]).to_f32() * xs[l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..x.len() {
        tail += half::f16::from_bits(w[i]).to_f32() * x[i];
    }
    reduce(&acc) + tail
}

#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    // Pairwise, in a fixed order.
    let mut v = *acc;
    let mut n = LANES;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            v[i] += v[i + n];
        }
    }
    v[0]
}

#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

macro_rules! dispatch {
    ($name:ident, $generic:ident, $avx:ident, $wt:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx(a: $wt, b: &[f32]) -> f32 {
            $generic(a, b)
        }

        pub fn $name(a: $wt, b: &[f32]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time).
                return unsafe { $avx(a, b) };
            }
            $generic(a, b)
        }
    };
}

dispatch!(dot_f32, dot_f32_generic, dot_f32_avx2, &[f32]);
dispatch!(dot_bf16, dot_bf16_generic, dot_bf16_avx2, &[u16]);
dispatch!(dot_f16, dot_f16_generic, dot_f16_avx2, &[u16]);

/// True when AVX2 and FMA are available (cached). `MEGAGEMMA_NO_AVX2=1` forces the portable path.
pub fn has_avx2_fma() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::env::var_os("MEGAGEMMA_NO_AVX2").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_agree_with_f64_reference() {
        let n = 1000;
        let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0).collect();
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot_f32(&a, &b) as f64 - exact).abs() < 1e-3 * exact.abs().max(1.0));
        // bf16 / f16 encodings of `a` (values chosen to be exactly representable).
        let a16: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0).collect();
        let bf: Vec<u16> = a16.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        let hf: Vec<u16> = a16.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
        let exact16: f64 = a16.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot_bf16(&bf, &b) as f64 - exact16).abs() < 1e-3 * exact16.abs().max(1.0));
        assert!((dot_f16(&hf, &b) as f64 - exact16).abs() < 1e-3 * exact16.abs().max(1.0));
    }
}
