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

/// `y += a · x` (attention's weighted sum of value rows): fused on AVX-512, multiply-then-add
/// otherwise (as the dot kernels, the bits depend only on the machine).
pub fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: {} values into {}", x.len(), y.len());
    #[cfg(target_arch = "x86_64")]
    match level() {
        // SAFETY: the CPU supports the features of the chosen level (checked at run time).
        Level::Avx512 => return unsafe { avx512::axpy(a, x, y) },
        Level::Avx2 => return unsafe { axpy_avx2(a, x, y) },
        Level::Portable => {}
    }
    axpy_generic(a, x, y)
}

#[inline(always)]
fn axpy_generic(a: f32, x: &[f32], y: &mut [f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn axpy_avx2(a: f32, x: &[f32], y: &mut [f32]) {
    axpy_generic(a, x, y)
}

/// `out[j] = dot_f32(a, bs[j])` for every row, bit for bit: on AVX-512 four rows at a time
/// share the loads of `a` (attention's query against its keys).
pub fn dot_f32_rows(a: &[f32], bs: &[&[f32]], out: &mut [f32]) {
    assert_eq!(bs.len(), out.len(), "dot_f32_rows: {} rows, {} outputs", bs.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512 {
        // SAFETY: the CPU supports AVX-512F and FMA (checked at run time).
        return unsafe { avx512::dot_f32_rows(a, bs, out) };
    }
    for (o, b) in out.iter_mut().zip(bs) {
        *o = dot_f32(a, b);
    }
}

/// `out = Σ_j ps[j] · rows[j]`, accumulated in `j` order exactly as `out.fill(0)` followed by
/// [`axpy`] per row (attention's weighted sum of values); on AVX-512 `out` stays in registers.
pub fn weighted_sum(ps: &[f32], rows: &[&[f32]], out: &mut [f32]) {
    assert_eq!(ps.len(), rows.len(), "weighted_sum: {} weights, {} rows", ps.len(), rows.len());
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512 {
        // SAFETY: the CPU supports AVX-512F and FMA (checked at run time).
        return unsafe { avx512::weighted_sum(ps, rows, out) };
    }
    out.fill(0.0);
    for (&p, r) in ps.iter().zip(rows) {
        axpy(p, r, out);
    }
}

/// [`dot_f32_rows`] of several vectors against the same rows (the query heads that share a key
/// head): `outs[h][j] = dot_f32(qs[h], bs[j])`, bit for bit; on AVX-512 each row's loads serve
/// up to four vectors.
pub fn dot_f32_rows_shared(qs: &[&[f32]], bs: &[&[f32]], outs: &mut [&mut [f32]]) {
    assert_eq!(qs.len(), outs.len(), "dot_f32_rows_shared: {} vectors, {} outputs", qs.len(), outs.len());
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512 {
        for (q, o) in qs.chunks(4).zip(outs.chunks_mut(4)) {
            assert!(o.iter().all(|o| o.len() == bs.len()), "dot_f32_rows_shared: outputs of the wrong length");
            // SAFETY: the CPU supports AVX-512F and FMA (checked at run time); lengths checked above.
            unsafe {
                match q.len() {
                    4 => avx512::dot_rows_shared::<4>(q, bs, o),
                    3 => avx512::dot_rows_shared::<3>(q, bs, o),
                    2 => avx512::dot_rows_shared::<2>(q, bs, o),
                    _ => avx512::dot_f32_rows(q[0], bs, o[0]),
                }
            }
        }
        return;
    }
    for (q, o) in qs.iter().zip(outs.iter_mut()) {
        dot_f32_rows(q, bs, o);
    }
}

/// [`weighted_sum`] for several weight vectors over the same rows (attention's heads that share a
/// value head): `outs[h] = Σ_j ps[h][j] · rows[j]`, bit for bit; on AVX-512 each row's loads serve
/// up to four heads.
pub fn weighted_sum_shared(ps: &[&[f32]], rows: &[&[f32]], outs: &mut [&mut [f32]]) {
    assert_eq!(ps.len(), outs.len(), "weighted_sum_shared: {} weight vectors, {} outputs", ps.len(), outs.len());
    #[cfg(target_arch = "x86_64")]
    if level() == Level::Avx512 {
        for (p, o) in ps.chunks(4).zip(outs.chunks_mut(4)) {
            assert!(p.iter().all(|p| p.len() == rows.len()), "weighted_sum_shared: weights of the wrong length");
            let width = o[0].len();
            assert!(o.iter().all(|o| o.len() == width), "weighted_sum_shared: outputs of different widths");
            assert!(rows.iter().all(|r| r.len() >= width), "weighted_sum_shared: row shorter than the output");
            // SAFETY: the CPU supports AVX-512F and FMA (checked at run time); lengths checked above.
            unsafe {
                match p.len() {
                    4 => avx512::weighted_sum_shared::<4>(p, rows, o),
                    3 => avx512::weighted_sum_shared::<3>(p, rows, o),
                    2 => avx512::weighted_sum_shared::<2>(p, rows, o),
                    _ => avx512::weighted_sum(p[0], rows, o[0]),
                }
            }
        }
        return;
    }
    for (p, o) in ps.iter().zip(outs.iter_mut()) {
        weighted_sum(p, rows, o);
    }
}

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

    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
        let n = x.len().min(y.len());
        let av = _mm512_set1_ps(a);
        let steps = n / 16;
        for i in 0..steps {
            let (px, py) = (x.as_ptr().add(16 * i), y.as_mut_ptr().add(16 * i));
            _mm512_storeu_ps(py, _mm512_fmadd_ps(av, _mm512_loadu_ps(px), _mm512_loadu_ps(py)));
        }
        for i in 16 * steps..n {
            y[i] = a.mul_add(x[i], y[i]);
        }
    }

    /// [`dot_f32`] of `a` with each row, four rows per pass over `a` (each row's accumulators
    /// and reduction exactly as `dot_f32`'s).
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn dot_f32_rows(a: &[f32], bs: &[&[f32]], out: &mut [f32]) {
        let mut j = 0;
        while j + 4 <= bs.len() {
            let n = bs[j..j + 4].iter().fold(a.len(), |n, b| n.min(b.len()));
            let z = _mm512_setzero_ps();
            let (mut acc0, mut acc1) = ([z; 4], [z; 4]);
            let steps = n / 32;
            for i in 0..steps {
                let pa = a.as_ptr().add(32 * i);
                let (a0, a1) = (_mm512_loadu_ps(pa), _mm512_loadu_ps(pa.add(16)));
                for r in 0..4 {
                    let pb = bs[j + r].as_ptr().add(32 * i);
                    acc0[r] = _mm512_fmadd_ps(a0, _mm512_loadu_ps(pb), acc0[r]);
                    acc1[r] = _mm512_fmadd_ps(a1, _mm512_loadu_ps(pb.add(16)), acc1[r]);
                }
            }
            for r in 0..4 {
                let b = bs[j + r];
                let tail: f32 = (32 * steps..n).map(|i| a[i] * b[i]).sum();
                out[j + r] = finish(acc0[r], acc1[r], tail);
            }
            j += 4;
        }
        for j in j..bs.len() {
            out[j] = dot_f32(a, bs[j]);
        }
    }

    /// [`super::dot_f32_rows_shared`] for `H` vectors: rows two at a time, each row's two loads a
    /// step used by every vector; each (vector, row) keeps `dot_f32`'s accumulators and reduction.
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn dot_rows_shared<const H: usize>(qs: &[&[f32]], bs: &[&[f32]], outs: &mut [&mut [f32]]) {
        let mut j = 0;
        while j + 2 <= bs.len() {
            let n = bs[j..j + 2].iter().chain(qs).fold(usize::MAX, |n, b| n.min(b.len()));
            let z = _mm512_setzero_ps();
            let (mut acc0, mut acc1) = ([[z; 2]; H], [[z; 2]; H]);
            let steps = n / 32;
            for i in 0..steps {
                let (pb0, pb1) = (bs[j].as_ptr().add(32 * i), bs[j + 1].as_ptr().add(32 * i));
                let b0 = [_mm512_loadu_ps(pb0), _mm512_loadu_ps(pb1)];
                let b1 = [_mm512_loadu_ps(pb0.add(16)), _mm512_loadu_ps(pb1.add(16))];
                for h in 0..H {
                    let pa = qs[h].as_ptr().add(32 * i);
                    let (a0, a1) = (_mm512_loadu_ps(pa), _mm512_loadu_ps(pa.add(16)));
                    for r in 0..2 {
                        acc0[h][r] = _mm512_fmadd_ps(a0, b0[r], acc0[h][r]);
                        acc1[h][r] = _mm512_fmadd_ps(a1, b1[r], acc1[h][r]);
                    }
                }
            }
            for h in 0..H {
                for r in 0..2 {
                    let (a, b) = (qs[h], bs[j + r]);
                    let tail: f32 = (32 * steps..n).map(|i| a[i] * b[i]).sum();
                    outs[h][j + r] = finish(acc0[h][r], acc1[h][r], tail);
                }
            }
            j += 2;
        }
        for j in j..bs.len() {
            for h in 0..H {
                outs[h][j] = dot_f32(qs[h], bs[j]);
            }
        }
    }

    /// [`super::weighted_sum_shared`] for `H` weight vectors: 64 outputs at a time (four
    /// registers a vector), each row's four loads used by every vector. Every output is
    /// `fma(p_j, row_j, ·)` over `j` in order from zero, as in `weighted_sum` and `axpy`.
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn weighted_sum_shared<const H: usize>(ps: &[&[f32]], rows: &[&[f32]], outs: &mut [&mut [f32]]) {
        const W: usize = 64;
        let width = outs[0].len();
        let mut c0 = 0;
        while c0 + W <= width {
            let mut acc = [[_mm512_setzero_ps(); W / 16]; H];
            for (j, r) in rows.iter().enumerate() {
                let pr = r.as_ptr().add(c0);
                let v: [__m512; W / 16] = std::array::from_fn(|l| _mm512_loadu_ps(pr.add(16 * l)));
                for h in 0..H {
                    let pv = _mm512_set1_ps(*ps[h].get_unchecked(j));
                    for (a, v) in acc[h].iter_mut().zip(&v) {
                        *a = _mm512_fmadd_ps(pv, *v, *a);
                    }
                }
            }
            for (out, acc) in outs.iter_mut().zip(&acc) {
                for (l, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(out.as_mut_ptr().add(c0 + 16 * l), *a);
                }
            }
            c0 += W;
        }
        for h in 0..H {
            let rest = &mut outs[h][c0..];
            rest.fill(0.0);
            for (&p, r) in ps[h].iter().zip(rows) {
                axpy(p, &r[c0..c0 + rest.len()], rest);
            }
        }
    }

    /// [`super::weighted_sum`]: 256 outputs at a time held in 16 registers across all rows.
    #[target_feature(enable = "avx512f,fma")]
    pub unsafe fn weighted_sum(ps: &[f32], rows: &[&[f32]], out: &mut [f32]) {
        const W: usize = 256;
        let mut c0 = 0;
        while c0 + W <= out.len() {
            let mut acc = [_mm512_setzero_ps(); W / 16];
            for (&p, r) in ps.iter().zip(rows) {
                assert!(r.len() >= c0 + W, "weighted_sum: row shorter than the output");
                let (pv, pr) = (_mm512_set1_ps(p), r.as_ptr().add(c0));
                for (l, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(pv, _mm512_loadu_ps(pr.add(16 * l)), *a);
                }
            }
            for (l, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(c0 + 16 * l), *a);
            }
            c0 += W;
        }
        let rest = &mut out[c0..];
        rest.fill(0.0);
        for (&p, r) in ps.iter().zip(rows) {
            axpy(p, &r[c0..c0 + rest.len()], rest);
        }
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

    /// The shared forms (several query heads against the same key and value rows) give each head
    /// exactly what the one-head forms give: 1 to 9 heads (groups of four and every tail), 0 to 9
    /// rows, widths with and without 32- and 64-wide tails.
    #[test]
    fn shared_row_kernels_equal_the_one_head_forms_bit_for_bit() {
        let val = |i: usize, k: usize| (((i * 53 + k * 29) % 97) as f32 / 13.0 - 3.7) * (1.0 + (k % 3) as f32 * 0.3);
        for width in [256, 80, 512] {
            for heads in 1..=9 {
                for n in [0, 1, 2, 3, 9] {
                    let qs: Vec<Vec<f32>> = (0..heads).map(|h| (0..width).map(|i| val(i, h + 7)).collect()).collect();
                    let rows: Vec<Vec<f32>> = (0..n).map(|r| (0..width).map(|i| val(i, r + 100)).collect()).collect();
                    let (qr, rr): (Vec<&[f32]>, Vec<&[f32]>) =
                        (qs.iter().map(|v| v.as_slice()).collect(), rows.iter().map(|v| v.as_slice()).collect());
                    let mut got = vec![vec![f32::NAN; n]; heads];
                    dot_f32_rows_shared(&qr, &rr, &mut got.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>());
                    let ps: Vec<Vec<f32>> = (0..heads).map(|h| (0..n).map(|j| val(j, h) * 0.01).collect()).collect();
                    let pr: Vec<&[f32]> = ps.iter().map(|v| v.as_slice()).collect();
                    let mut sums = vec![vec![f32::NAN; width]; heads];
                    weighted_sum_shared(&pr, &rr, &mut sums.iter_mut().map(|v| v.as_mut_slice()).collect::<Vec<_>>());
                    for h in 0..heads {
                        let mut want = vec![0f32; n];
                        dot_f32_rows(&qs[h], &rr, &mut want);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got[h]), bits(&want), "dots: width {width}, head {h} of {heads}, {n} rows");
                        let mut want = vec![0f32; width];
                        weighted_sum(&ps[h], &rr, &mut want);
                        assert_eq!(bits(&sums[h]), bits(&want), "sums: width {width}, head {h} of {heads}, {n} rows");
                    }
                }
            }
        }
    }

    #[test]
    fn row_kernels_equal_their_one_row_forms_bit_for_bit() {
        // 7 rows (a group of four and a tail), 300 values (whole 256-wide blocks, 32-wide steps
        // and tails): `dot_f32_rows` equals `dot_f32` per row and `weighted_sum` equals the
        // zero-fill + `axpy` sequence.
        let a: Vec<f32> = (0..300).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
        let rows: Vec<Vec<f32>> =
            (0..7).map(|r| (0..300).map(|i| ((i * 53 + r * 11) % 97) as f32 / 13.0 - 3.7).collect()).collect();
        let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let mut dots = vec![0f32; 7];
        dot_f32_rows(&a, &refs, &mut dots);
        for r in 0..7 {
            assert_eq!(dots[r].to_bits(), dot_f32(&a, &rows[r]).to_bits(), "row {r}");
        }
        let ps: Vec<f32> = (0..7).map(|r| 0.1 + r as f32 * 0.07).collect();
        let mut sum = vec![f32::NAN; 300];
        weighted_sum(&ps, &refs, &mut sum);
        let mut want = vec![0f32; 300];
        for r in 0..7 {
            axpy(ps[r], &rows[r], &mut want);
        }
        for i in 0..300 {
            assert_eq!(sum[i].to_bits(), want[i].to_bits(), "value {i}");
        }
    }

    #[test]
    fn axpy_adds_a_scaled_vector() {
        // 37 values: whole 16-lane steps and a tail.
        let x: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut y: Vec<f32> = (0..37).map(|i| 100.0 - i as f32).collect();
        axpy(0.25, &x, &mut y);
        for (i, y) in y.iter().enumerate() {
            // Every product and sum here is exact in f32, so fused or not the result is the same.
            assert_eq!(*y, 100.0 - i as f32 + 0.25 * (i as f32 * 0.5 - 3.0), "element {i}");
        }
    }
}
