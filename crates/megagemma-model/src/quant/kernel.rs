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
//!
//! Every kernel also takes `C` activation vectors at once ([`dot_rows_multi`], for verify and
//! prefill): each weight is decoded once and multiplied into C accumulator sets, and column `c`
//! goes through exactly the operations of a single-vector call on `xs[c]`, so it is bit-identical.

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
    run::<1>(m, kernel, start, [x], &mut [out]);
}

/// Columns the multi-vector kernels take at once.
pub(super) const MULTI: usize = 4;

/// `outs[t][i] = dot(row(start + i), xs[t])` for `T = xs.len() / cols` vectors, [`MULTI`] at a
/// time (each row decoded once per group of vectors), the rest one by one.
pub(super) fn dot_rows_multi(m: &QuantMatrix, kernel: Kernel, start: usize, xs: &[f32], outs: &mut [&mut [f32]]) {
    let mut xcols = xs.chunks_exact(m.cols);
    let mut ocols = outs.iter_mut();
    while xcols.len() >= MULTI {
        let x: [&[f32]; MULTI] = std::array::from_fn(|_| xcols.next().unwrap());
        let mut o: [&mut [f32]; MULTI] = std::array::from_fn(|_| &mut **ocols.next().unwrap());
        run::<MULTI>(m, kernel, start, x, &mut o);
    }
    for (x, o) in xcols.zip(ocols) {
        run::<1>(m, kernel, start, [x], &mut [&mut **o]);
    }
}

fn run<const C: usize>(m: &QuantMatrix, kernel: Kernel, start: usize, xs: [&[f32]; C], out: &mut [&mut [f32]; C]) {
    if out[0].is_empty() {
        return;
    }
    match kernel {
        Kernel::Portable => portable::dot_rows::<C>(m, start, xs, out),
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => {
            assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"), "AVX2+FMA not available");
            // SAFETY: the features were just checked.
            unsafe { avx2::dot_rows::<C>(m, start, xs, out) }
        }
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => {
            assert!(is_x86_feature_detected!("avx512f"), "AVX-512F not available");
            let need = C * m.cols;
            let mut go = |buf: &mut [f32]| {
                let mut parts = buf.chunks_exact_mut(m.cols);
                let xi: [&[f32]; C] = std::array::from_fn(|c| {
                    let dst = parts.next().unwrap();
                    avx512::interleave_x(xs[c], dst);
                    &*dst
                });
                // SAFETY: the feature was just checked.
                unsafe { avx512::dot_rows::<C>(m, start, xi, out) }
            };
            SCRATCH.with(|cell| match cell.try_borrow_mut() {
                Ok(mut buf) => {
                    if buf.len() < need {
                        buf.resize(need, 0.0);
                    }
                    go(&mut buf[..need])
                }
                // Re-entered on this thread (cannot happen through matmul): use a fresh buffer.
                Err(_) => go(&mut vec![0.0; need]),
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

/// Calls `f(row0, i0, true, prefetch_next)` for blocks of `R` rows (`i0`: index of `row0` in
/// the output), then `f(row, i, false, false)` for the remaining single rows.
#[inline(always)]
fn for_blocks(m: &QuantMatrix, start: usize, n: usize, mut f: impl FnMut(usize, usize, bool, bool)) {
    let full = n / R * R;
    for i in (0..full).step_by(R) {
        let row = start + i;
        f(row, i, true, row + 2 * R <= m.rows);
    }
    for i in full..n {
        f(start + i, i, false, false);
    }
}

mod portable {
    use super::*;

    pub(super) fn dot_rows<const C: usize>(m: &QuantMatrix, start: usize, xs: [&[f32]; C], out: &mut [&mut [f32]; C]) {
        let n = out[0].len();
        for_blocks(m, start, n, |r, i, block, _| match block {
            true => rows::<R, C>(m, r, xs, out, i),
            false => rows::<1, C>(m, r, xs, out, i),
        });
    }

    /// `acc += w·x` for the 8 weights of word `w`, each `w = q·s + b` (two roundings). Nibbles are
    /// masked in place (`q·16^k`, exact in f32) and scaled back by `2^-4k` (exact), so no per-lane
    /// shifts are needed.
    #[inline(always)]
    fn decode8(w: u32, s: f32, b: f32) -> [f32; 8] {
        const MASK: [u32; 8] = [0xF, 0xF0, 0xF00, 0xF000, 0xF, 0xF0, 0xF00, 0xF000];
        const UNSHIFT: [f32; 8] =
            [1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0, 1.0, 1.0 / 16.0, 1.0 / 256.0, 1.0 / 4096.0];
        let lanes = [w, w, w, w, w >> 16, w >> 16, w >> 16, w >> 16];
        std::array::from_fn(|k| ((lanes[k] & MASK[k]) as i32 as f32 * UNSHIFT[k]) * s + b)
    }

    /// `N` consecutive rows from `row0` against `C` vectors, results at `out[c][i0 + r]`; per
    /// row and vector the same operations whatever `N` and `C`.
    #[inline(always)]
    fn rows<const N: usize, const C: usize>(
        m: &QuantMatrix,
        row0: usize,
        xs: [&[f32]; C],
        out: &mut [&mut [f32]; C],
        i0: usize,
    ) {
        let wpr = m.cols / 8;
        let wpg = m.group_size / 8;
        let ng = m.groups_per_row();
        let a = m.arrays();
        let w: [&[u32]; N] = std::array::from_fn(|r| &a.packed[(row0 + r) * wpr..(row0 + r + 1) * wpr]);
        let sc: [&[f32]; N] = std::array::from_fn(|r| &a.scales[(row0 + r) * ng..(row0 + r + 1) * ng]);
        let bi: [&[f32]; N] = std::array::from_fn(|r| &a.biases[(row0 + r) * ng..(row0 + r + 1) * ng]);
        let mut acc = [[[0f32; 8]; C]; N];
        for g in 0..ng {
            for i in g * wpg..(g + 1) * wpg {
                for r in 0..N {
                    let wv = decode8(w[r][i], sc[r][g], bi[r][g]);
                    for c in 0..C {
                        let xv = &xs[c][i * 8..i * 8 + 8];
                        for k in 0..8 {
                            acc[r][c][k] += wv[k] * xv[k];
                        }
                    }
                }
            }
        }
        for r in 0..N {
            for c in 0..C {
                out[c][i0 + r] = hsum8(&acc[r][c]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_rows<const C: usize>(
        m: &QuantMatrix,
        start: usize,
        xs: [&[f32]; C],
        out: &mut [&mut [f32]; C],
    ) {
        let n = out[0].len();
        macro_rules! go {
            ($wpg:literal) => {
                for_blocks(m, start, n, |r, i, block, p| match block {
                    true => rows::<R, C, $wpg>(m, r, xs, out, i, p),
                    false => rows::<1, C, $wpg>(m, r, xs, out, i, false),
                })
            };
        }
        match m.group_size {
            32 => go!(4),
            64 => go!(8),
            _ => go!(16),
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

    /// `N` rows from `row0` against `C` vectors, group size `8·WPG`, results at
    /// `out[c][i0 + r]`; per row and vector the same operations whatever `N` and `C`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn rows<const N: usize, const C: usize, const WPG: usize>(
        m: &QuantMatrix,
        row0: usize,
        xs: [&[f32]; C],
        out: &mut [&mut [f32]; C],
        i0: usize,
        prefetch: bool,
    ) {
        let wpr = m.cols / 8;
        let ng = m.groups_per_row();
        let a = m.arrays();
        debug_assert!((row0 + N) * wpr <= a.packed.len() && xs.iter().all(|x| x.len() == m.cols));
        let wbase = a.packed.as_ptr().add(row0 * wpr);
        let sbase = a.scales.as_ptr().add(row0 * ng);
        let bbase = a.biases.as_ptr().add(row0 * ng);
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let mask = _mm256_set1_epi32(0xF);
        let mut acc = [[_mm256_setzero_ps(); C]; N];
        for g in 0..ng {
            let wg = wbase.add(g * WPG);
            let s: [__m256; N] = std::array::from_fn(|r| _mm256_set1_ps(*sbase.add(r * ng + g)));
            let b: [__m256; N] = std::array::from_fn(|r| _mm256_set1_ps(*bbase.add(r * ng + g)));
            for i in 0..WPG {
                let xv: [__m256; C] = std::array::from_fn(|c| _mm256_loadu_ps(xs[c].as_ptr().add((g * WPG + i) * 8)));
                for r in 0..N {
                    let w = _mm256_set1_epi32(*wg.add(r * wpr + i) as i32);
                    let q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shifts), mask));
                    // Exactly `q·scale + bias` as `QuantMatrix::dequantize` (two roundings).
                    let wv = _mm256_add_ps(_mm256_mul_ps(q, s[r]), b[r]);
                    for c in 0..C {
                        acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
                    }
                }
            }
            if prefetch {
                prefetch_next::<N, WPG>(m, wg, sbase, g, wpr, ng);
            }
        }
        for r in 0..N {
            for c in 0..C {
                out[c][i0 + r] = hsum(acc[r][c]);
            }
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
            let a = m.arrays();
            let bbase = a.biases.as_ptr().offset(sbase.offset_from(a.scales.as_ptr()));
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
    pub(super) unsafe fn dot_rows<const C: usize>(
        m: &QuantMatrix,
        start: usize,
        xi: [&[f32]; C],
        out: &mut [&mut [f32]; C],
    ) {
        let n = out[0].len();
        macro_rules! go {
            ($wpg:literal) => {
                for_blocks(m, start, n, |r, i, block, p| match block {
                    true => rows::<R, C, $wpg>(m, r, xi, out, i, p),
                    false => rows::<1, C, $wpg>(m, r, xi, out, i, false),
                })
            };
        }
        match m.group_size {
            32 => go!(4),
            64 => go!(8),
            _ => go!(16),
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

    /// `N` rows from `row0` against `C` interleaved vectors, group size `8·WPG`, results at
    /// `out[c][i0 + r]`; per row and vector the same operations whatever `N` and `C`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn rows<const N: usize, const C: usize, const WPG: usize>(
        m: &QuantMatrix,
        row0: usize,
        xi: [&[f32]; C],
        out: &mut [&mut [f32]; C],
        i0: usize,
        prefetch: bool,
    ) {
        let wpr = m.cols / 8;
        let ng = m.groups_per_row();
        let a = m.arrays();
        debug_assert!((row0 + N) * wpr <= a.packed.len() && xi.iter().all(|x| x.len() == m.cols));
        let wbase = a.packed.as_ptr().add(row0 * wpr);
        let sbase = a.scales.as_ptr().add(row0 * ng);
        let bbase = a.biases.as_ptr().add(row0 * ng);
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let codes = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let mut acc = [[_mm512_setzero_ps(); C]; N];
        for g in 0..ng {
            let wg = wbase.add(g * WPG);
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
                let xv: [__m512; C] =
                    std::array::from_fn(|c| _mm512_loadu_ps(xi[c].as_ptr().add(g * WPG * 8 + i * 16)));
                for r in 0..N {
                    let p = _mm512_set1_epi64((wg.add(r * wpr + 2 * i) as *const i64).read_unaligned());
                    let w = _mm512_permutexvar_ps(_mm512_srlv_epi32(p, shifts), table[r]);
                    for c in 0..C {
                        acc[r][c] = _mm512_fmadd_ps(w, xv[c], acc[r][c]);
                    }
                }
            }
            if prefetch {
                super::avx2::prefetch_next::<N, WPG>(m, wg, sbase, g, wpr, ng);
            }
        }
        for r in 0..N {
            for c in 0..C {
                out[c][i0 + r] = hsum(acc[r][c]);
            }
        }
    }
}
