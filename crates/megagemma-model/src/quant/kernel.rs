//! Fused dequantize-dot kernels for [`QuantMatrix`].
//!
//! Every kernel dequantizes each weight in registers with exactly the formula of
//! [`QuantMatrix::dequantize`] — `w = q·scale + bias` in f32, one rounded multiply, then one
//! rounded add (never fused) — and accumulates `w·x` in f32 lanes. So a kernel's result differs
//! from a dense f32 dot over the dequantized row only in summation order. (The AVX-512 kernel
//! evaluates the formula once per group for all 16 codes and looks the weights up with `vpermps`.)
//! Rows are processed four at a time to share the loads of `x` and to keep independent accumulation
//! chains in flight, but each row's result goes through exactly the same operation sequence whether
//! it is processed in a block of four or alone, so it depends only on the row, `x` and the kernel —
//! and the kernel is fixed per process ([`Kernel::detect`]). While a block of rows is computed, the
//! next block's weights are prefetched (the rows of a block are only `cols/2` bytes long each, too
//! short for the hardware prefetchers to ramp up on their own).

#![allow(clippy::needless_range_loop)] // lane/row-indexed SIMD code reads best with indices

use std::cell::RefCell;

use super::QuantMatrix;

/// The dot kernel implementations. Results of different kernels agree to rounding, not bitwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable Rust (8-lane arrays LLVM vectorises with whatever the build target allows; nibbles
    /// are masked in place and scaled back by `2^-4k`, exactly, so no per-lane shifts are needed).
    Portable,
    /// x86-64 AVX2 + FMA: 8 nibbles of one word → 8 lanes by variable shifts.
    Avx2,
    /// x86-64 AVX-512F: 2 words → 16 lanes, nibbles → dequantized weights by a 16-entry `vpermps`
    /// lookup in a per-group table of `q·scale + bias`.
    Avx512,
}

impl Kernel {
    /// The fastest kernel this CPU supports (capped like every CPU kernel by `MEGAGEMMA_SIMD`,
    /// see [`crate::simd::level`]).
    pub fn detect() -> Kernel {
        match crate::simd::level() {
            crate::simd::Level::Avx512 => Kernel::Avx512,
            crate::simd::Level::Avx2 => Kernel::Avx2,
            crate::simd::Level::Portable => Kernel::Portable,
        }
    }

    /// All kernels that can run on this CPU, slowest first.
    pub fn available() -> Vec<Kernel> {
        #[allow(unused_mut)]
        let mut v = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Kernel::Avx2);
            }
            if is_x86_feature_detected!("avx512f") {
                v.push(Kernel::Avx512);
            }
        }
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Portable => "portable",
            Kernel::Avx2 => "avx2+fma",
            Kernel::Avx512 => "avx512f",
        }
    }
}

thread_local! {
    /// Per-thread scratch for the AVX-512 kernel: `x` reordered to the lanes of a word pair.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn dot_rows(m: &QuantMatrix, kernel: Kernel, start: usize, x: &[f32], out: &mut [f32]) {
    if out.is_empty() {
        return;
    }
    match kernel {
        Kernel::Portable => portable::dot_rows(m, start, x, out),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"), "AVX2+FMA not available");
            // SAFETY: the features were just checked.
            unsafe { avx2::dot_rows(m, start, x, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => {
            assert!(is_x86_feature_detected!("avx512f"), "AVX-512F not available");
            let need = m.cols;
            let mut run = |xi: &mut [f32]| {
                avx512::interleave_x(x, xi);
                // SAFETY: the feature was just checked.
                unsafe { avx512::dot_rows(m, start, xi, out) }
            };
            SCRATCH.with(|cell| match cell.try_borrow_mut() {
                Ok(mut buf) => {
                    if buf.len() < need {
                        buf.resize(need, 0.0);
                    }
                    run(&mut buf[..need])
                }
                // Re-entered on this thread (cannot happen through matmul): use a fresh buffer.
                Err(_) => run(&mut vec![0.0; need]),
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => panic!("kernel {kernel:?} is not available on this architecture"),
    }
}

#[inline(always)]
fn hsum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Rows per block in the kernels.
const R: usize = 4;

/// Calls `f(row0, out_block, prefetch_next)` for blocks of `R` rows, then single rows.
#[inline(always)]
fn for_blocks(
    m: &QuantMatrix,
    start: usize,
    out: &mut [f32],
    mut f4: impl FnMut(usize, &mut [f32], bool),
    mut f1: impl FnMut(usize, &mut [f32]),
) {
    let mut blocks = out.chunks_exact_mut(R);
    let mut row = start;
    for o in &mut blocks {
        f4(row, o, row + 2 * R <= m.rows);
        row += R;
    }
    for o in blocks.into_remainder().chunks_mut(1) {
        f1(row, o);
        row += 1;
    }
}

mod portable {
    use super::*;

    pub(super) fn dot_rows(m: &QuantMatrix, start: usize, x: &[f32], out: &mut [f32]) {
        for_blocks(m, start, out, |r, o, _| rows::<R>(m, r, x, o), |r, o| rows::<1>(m, r, x, o));
    }

    /// `acc += w·x` for the 8 weights of word `w`, each `w = q·s + b` (two roundings). Nibbles are
    /// masked in place (`q·16^k`, exact in f32) and scaled back by `2^-4k` (exact), so no per-lane
    /// shifts are needed.
    #[inline(always)]
    fn mac8(acc: &mut [f32; 8], w: u32, s: f32, b: f32, x: &[f32]) {
        const MASK: [u32; 8] = [0xF, 0xF0, 0xF00, 0xF000, 0xF, 0xF0, 0xF00, 0xF000];
        const UNSHIFT: [f32; 8] =
            [1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0, 1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0];
        let lanes = [w, w, w, w, w >> 16, w >> 16, w >> 16, w >> 16];
        for k in 0..8 {
            let q = (lanes[k] & MASK[k]) as i32 as f32 * UNSHIFT[k];
            acc[k] += (q * s + b) * x[k];
        }
    }

    /// `N` consecutive rows from `row0`; per row the same operations whatever `N`.
    #[inline(always)]
    fn rows<const N: usize>(m: &QuantMatrix, row0: usize, x: &[f32], out: &mut [f32]) {
        let wpr = m.cols / 8;
        let wpg = m.group_size / 8;
        let ng = m.groups_per_row();
        let w: [&[u32]; N] = std::array::from_fn(|r| &m.packed[(row0 + r) * wpr..(row0 + r + 1) * wpr]);
        let sc: [&[f32]; N] = std::array::from_fn(|r| &m.scales[(row0 + r) * ng..(row0 + r + 1) * ng]);
        let bi: [&[f32]; N] = std::array::from_fn(|r| &m.biases[(row0 + r) * ng..(row0 + r + 1) * ng]);
        let mut acc = [[0f32; 8]; N];
        for g in 0..ng {
            for i in g * wpg..(g + 1) * wpg {
                let xv = &x[i * 8..i * 8 + 8];
                for r in 0..N {
                    mac8(&mut acc[r], w[r][i], sc[r][g], bi[r][g], xv);
                }
            }
        }
        for r in 0..N {
            out[r] = hsum8(&acc[r]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows(m: &QuantMatrix, start: usize, x: &[f32], out: &mut [f32]) {
        match m.group_size {
            32 => {
                for_blocks(m, start, out, |r, o, p| rows::<R, 4>(m, r, x, o, p), |r, o| rows::<1, 4>(m, r, x, o, false))
            }
            64 => {
                for_blocks(m, start, out, |r, o, p| rows::<R, 8>(m, r, x, o, p), |r, o| rows::<1, 8>(m, r, x, o, false))
            }
            _ => for_blocks(
                m,
                start,
                out,
                |r, o, p| rows::<R, 16>(m, r, x, o, p),
                |r, o| rows::<1, 16>(m, r, x, o, false),
            ),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `N` rows from `row0`, group size `8·WPG`; per row the same operations whatever `N`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn rows<const N: usize, const WPG: usize>(
        m: &QuantMatrix,
        row0: usize,
        x: &[f32],
        out: &mut [f32],
        prefetch: bool,
    ) {
        let wpr = m.cols / 8;
        let ng = m.groups_per_row();
        debug_assert!((row0 + N) * wpr <= m.packed.len() && x.len() == m.cols && out.len() >= N);
        let wbase = m.packed.as_ptr().add(row0 * wpr);
        let sbase = m.scales.as_ptr().add(row0 * ng);
        let bbase = m.biases.as_ptr().add(row0 * ng);
        let xp = x.as_ptr();
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(0xF);
        let mut acc = [_mm256_setzero_ps(); N];
        for g in 0..ng {
            let wg = wbase.add(g * WPG);
            let xg = xp.add(g * WPG * 8);
            let s: [__m256; N] = std::array::from_fn(|r| _mm256_set1_ps(*sbase.add(r * ng + g)));
            let b: [__m256; N] = std::array::from_fn(|r| _mm256_set1_ps(*bbase.add(r * ng + g)));
            for i in 0..WPG {
                let xv = _mm256_loadu_ps(xg.add(i * 8));
                for r in 0..N {
                    let w = _mm256_set1_epi32(*wg.add(r * wpr + i) as i32);
                    let q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), mask));
                    // Exactly `q·scale + bias` as `QuantMatrix::dequantize` (two roundings).
                    let wv = _mm256_add_ps(_mm256_mul_ps(q, s[r]), b[r]);
                    acc[r] = _mm256_fmadd_ps(wv, xv, acc[r]);
                }
            }
            if prefetch {
                prefetch_next::<N, WPG>(m, wg, sbase, g, wpr, ng);
            }
        }
        for r in 0..N {
            out[r] = hsum(acc[r]);
        }
    }

    /// Prefetches group `g` of the next block's rows (one cache line of weights per 64 bytes of
    /// group data, scales and biases every 16 groups).
    #[inline(always)]
    pub(super) unsafe fn prefetch_next<const N: usize, const WPG: usize>(
        m: &QuantMatrix,
        wg: *const u32,
        sbase: *const f32,
        g: usize,
        wpr: usize,
        ng: usize,
    ) {
        if (g * WPG * 4).is_multiple_of(64) {
            for r in 0..N {
                _mm_prefetch::<_MM_HINT_T0>(wg.add((N + r) * wpr) as *const i8);
            }
        }
        if g.is_multiple_of(16) {
            let bbase = m.biases.as_ptr().offset(sbase.offset_from(m.scales.as_ptr()));
            for r in 0..N {
                _mm_prefetch::<_MM_HINT_T0>(sbase.add((N + r) * ng + g) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(bbase.add((N + r) * ng + g) as *const i8);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Reorders `x` per 16-element block to match the lanes of a broadcast word pair:
    /// lane `2k` holds element `k` (word 0), lane `2k+1` element `8+k` (word 1).
    pub(super) fn interleave_x(x: &[f32], xi: &mut [f32]) {
        for (src, dst) in x.chunks_exact(16).zip(xi.chunks_exact_mut(16)) {
            for k in 0..8 {
                dst[2 * k] = src[k];
                dst[2 * k + 1] = src[8 + k];
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_rows(m: &QuantMatrix, start: usize, xi: &[f32], out: &mut [f32]) {
        match m.group_size {
            32 => for_blocks(
                m,
                start,
                out,
                |r, o, p| rows::<R, 4>(m, r, xi, o, p),
                |r, o| rows::<1, 4>(m, r, xi, o, false),
            ),
            64 => for_blocks(
                m,
                start,
                out,
                |r, o, p| rows::<R, 8>(m, r, xi, o, p),
                |r, o| rows::<1, 8>(m, r, xi, o, false),
            ),
            _ => for_blocks(
                m,
                start,
                out,
                |r, o, p| rows::<R, 16>(m, r, xi, o, p),
                |r, o| rows::<1, 16>(m, r, xi, o, false),
            ),
        }
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn hsum(v: __m512) -> f32 {
        // Fixed tree: 512 → 256 → 128 → 64 → 32.
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let s = _mm256_add_ps(lo, hi);
        let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `N` rows from `row0`, group size `8·WPG`; per row the same operations whatever `N`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn rows<const N: usize, const WPG: usize>(
        m: &QuantMatrix,
        row0: usize,
        xi: &[f32],
        out: &mut [f32],
        prefetch: bool,
    ) {
        let wpr = m.cols / 8;
        let ng = m.groups_per_row();
        debug_assert!((row0 + N) * wpr <= m.packed.len() && xi.len() == m.cols && out.len() >= N);
        let wbase = m.packed.as_ptr().add(row0 * wpr);
        let sbase = m.scales.as_ptr().add(row0 * ng);
        let bbase = m.biases.as_ptr().add(row0 * ng);
        let xp = xi.as_ptr();
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let codes = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let mut acc = [_mm512_setzero_ps(); N];
        for g in 0..ng {
            let wg = wbase.add(g * WPG);
            let xg = xp.add(g * WPG * 8);
            // Per row, the group's 16 possible weights `q·scale + bias` (two roundings, exactly as
            // `QuantMatrix::dequantize`); vpermps reads only the low 4 bits of each index lane.
            let table: [__m512; N] = std::array::from_fn(|r| {
                _mm512_add_ps(
                    _mm512_mul_ps(codes, _mm512_set1_ps(*sbase.add(r * ng + g))),
                    _mm512_set1_ps(*bbase.add(r * ng + g)),
                )
            });
            // Two words (16 weights) per step.
            for i in 0..WPG / 2 {
                let xv = _mm512_loadu_ps(xg.add(i * 16));
                for r in 0..N {
                    let p = _mm512_set1_epi64((wg.add(r * wpr + 2 * i) as *const i64).read_unaligned());
                    let w = _mm512_permutexvar_ps(_mm512_srlv_epi32(p, shifts), table[r]);
                    acc[r] = _mm512_fmadd_ps(w, xv, acc[r]);
                }
            }
            if prefetch {
                super::avx2::prefetch_next::<N, WPG>(m, wg, sbase, g, wpr, ng);
            }
        }
        for r in 0..N {
            out[r] = hsum(acc[r]);
        }
    }
}
