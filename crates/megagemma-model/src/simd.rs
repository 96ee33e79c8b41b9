//! Dot-product kernels for the CPU forward.
//!
//! Each kernel exists once as portable code written so LLVM vectorises it (sixteen independent
//! accumulators over fixed-size chunks), compiled twice — plainly and with AVX2 enabled (no FMA
//! contraction: multiply, then add) — and once more by hand for AVX-512 (fused multiply-add);
//! the widest the CPU supports is chosen at run time. The choice depends only on the machine, so a given row and vector always
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
    ($name:ident, $generic:ident, $avx:ident, $avx512:ident, $wt:ty) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn $avx(a: $wt, b: &[f32]) -> f32 {
            $generic(a, b)
        }

        pub fn $name(a: $wt, b: &[f32]) -> f32 {
            #[cfg(target_arch = "x86_64")]
            match level() {
                // SAFETY: the CPU supports the features of the chosen level (checked at run time).
                Level::Avx512 => return unsafe { avx512::$avx512(a, b) },
                Level::Avx2 => return unsafe { $avx(a, b) },
                Level::Portable => {}
            }
            $generic(a, b)
        }
    };
}

dispatch!(dot_f32, dot_f32_generic, dot_f32_avx2, dot_f32, &[f32]);
dispatch!(dot_bf16, dot_bf16_generic, dot_bf16_avx2, dot_bf16, &[u16]);
dispatch!(dot_f16, dot_f16_generic, dot_f16_avx2, dot_f16, &[u16]);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Level {
    Portable,
    Avx2,
    Avx512,
}

/// The widest kernel set this CPU runs (cached). `MEGAGEMMA_SIMD=portable|avx2` caps it.
pub fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let cap = std::env::var("MEGAGEMMA_SIMD").unwrap_or_default();
            if cap != "portable"
                && cap != "avx2"
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("fma")
            {
                return Level::Avx512;
            }
            if cap != "portable" && is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Portable
    })
}

/// Hand-written AVX-512 kernels: 32 elements per step into two 16-lane accumulators (fused
/// multiply-add), reduced in a fixed order.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,fma")]
    unsafe fn finish(acc0: __m512, acc1: __m512, tail: f32) -> f32 {
        _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + tail
    }

    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let steps = n / 32;
        for i in 0..steps {
            let (pa, pb) = (a.as_ptr().add(32 * i), b.as_ptr().add(32 * i));
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa), _mm512_loadu_ps(pb), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(16)), _mm512_loadu_ps(pb.add(16)), acc1);
        }
        let tail: f32 = (32 * steps..n).map(|i| a[i] * b[i]).sum();
        finish(acc0, acc1, tail)
    }

    /// 16 bf16 bit patterns → 16 f32 (exact: bf16 is the top half of an f32).
    #[target_feature(enable = "avx512f")]
    unsafe fn widen_bf16(p: *const u16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    }

    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let steps = n / 32;
        for i in 0..steps {
            let (pw, px) = (w.as_ptr().add(32 * i), x.as_ptr().add(32 * i));
            acc0 = _mm512_fmadd_ps(widen_bf16(pw), _mm512_loadu_ps(px), acc0);
            acc1 = _mm512_fmadd_ps(widen_bf16(pw.add(16)), _mm512_loadu_ps(px.add(16)), acc1);
        }
        let tail: f32 = (32 * steps..n).map(|i| super::bf16_to_f32(w[i]) * x[i]).sum();
        finish(acc0, acc1, tail)
    }

    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
        let n = w.len().min(x.len());
        let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let steps = n / 32;
        for i in 0..steps {
            let (pw, px) = (w.as_ptr().add(32 * i), x.as_ptr().add(32 * i));
            let lo = _mm512_cvtph_ps(_mm256_loadu_si256(pw as *const __m256i));
            let hi = _mm512_cvtph_ps(_mm256_loadu_si256(pw.add(16) as *const __m256i));
            acc0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(px), acc0);
            acc1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(px.add(16)), acc1);
        }
        let tail: f32 = (32 * steps..n).map(|i| half::f16::from_bits(w[i]).to_f32() * x[i]).sum();
        finish(acc0, acc1, tail)
    }
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
