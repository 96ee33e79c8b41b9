//! Integer dot products for GGUF Q4_K and Q6_K rows on CPUs with AVX-512 VNNI (Q8_0 and Q5_0
//! rows run as [`super::byte_tiles`]).
//!
//! These weights are small integers `q` times a float per 16 or 32 values (`d·sc·q − dmin·m`
//! for Q4_K, `d·sc·(u − 32)` for Q6_K). The f32 kernels spend one fused
//! multiply-add per weight and vector, which keeps a multi-token pass (prefill, verify) at the
//! FMA units' limit. Here each activation vector is quantized once per matmul to
//! 22-bit integers per 16 values (`x ≈ s·x_q`, `s = amax / (2^21 − 1)`, so the error is at most
//! `s/2`, ≈2.4e-7 of the 16 values' largest), split into three bytes; `vpdpbusd` (64 byte
//! products per instruction) computes `Σ q·x_q` exactly in integers, and one f32 multiply-add
//! per 16 values applies `d·s` (Q4_K adds `−dmin·m·s·Σx_q`, with `Σx_q` kept per 16 values
//! when the vector is quantized). (16-bit activations were measured first: logits of the real
//! Gemma 3 270M moved by up to 8e-5 relative L2 from transformers', too close to the 1e-4
//! contract; with 22 bits they stay within a few 1e-7, as the f32 kernels'.)
//!
//! Layout. A group of 256 values (one K-quant super-block) fills 16 lanes of 16
//! values, 4 steps of 4 bytes: lane `j` holds values `16·j + 4·i .. + 4` in step `i`, one
//! activation scale and one weight scale. The activations are stored in that order when
//! quantized; each format's decoder permutes a row's bytes into it (`vpermt2b`), once per row for
//! every vector of the call.
//! Per lane and group: `acc += f32(Σ q·x_q) · (d·s)` (fused), then the 16 lanes are summed
//! pairwise (8, 4, 2, 1). Every step is per vector, so a column of a multi-vector call is
//! bit-identical to a one-vector call; [`tests`] check the kernel against a scalar transcription
//! of the same arithmetic, bit for bit, and the result against an f64 dot product.

#![allow(clippy::missing_safety_doc)]
// Indexed loops over fixed-size register arrays unroll into straight-line code (as dot512.rs).
#![allow(clippy::needless_range_loop)]

use super::blocks::{k4_scales_mins, GgmlType};
use rayon::prelude::*;
use std::sync::OnceLock;

/// Values per Q5_0 weight block.
const BLOCK: usize = 32;
/// Values per lane (and per activation scale): half a block.
const LANE_VALUES: usize = 16;
/// Blocks per 16-lane group.
const GROUP_BLOCKS: usize = 8;
/// Bytes of one group's high (middle, low) activation bytes: 4 steps × 16 lanes × 4.
const GROUP_BYTES: usize = 4 * 64;
/// Vectors quantized per parallel task.
const QUANT_TASK: usize = 8;
/// Vectors a row pair is multiplied with per decode: their inputs (~2.3 KB per vector at a width of
/// 640, ~7 KB at 2048) stay in a core's L2 while the rows stream past.
const TOKEN_BLOCK: usize = 128;

/// Whether the integer kernels run on this machine: AVX-512 with VNNI (and the byte/word forms,
/// VBMI and F16C), unless `MEGAGEMMA_INT_DOT=0` turns them off.
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        if std::env::var("MEGAGEMMA_INT_DOT").is_ok_and(|v| v == "0") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        {
            crate::simd::level() == crate::simd::Level::Avx512
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vbmi")
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// `T` activation vectors of `cols` values, quantized to 22-bit integers per 16 values and laid
/// out for the integer kernel (see the module documentation).
pub struct LaneInputs {
    t: usize,
    groups: usize,
    /// `[t][group][step][lane][4]`: `(x_q >> 16) + 128` (as unsigned bytes).
    hi: Vec<u8>,
    /// Same layout: `(x_q >> 8) & 255`.
    mid: Vec<u8>,
    /// Same layout: `x_q & 255`.
    lo: Vec<u8>,
    /// `[t][group][lane]`: the lane's scale `s` (0 on padding lanes).
    scale: Vec<f32>,
    /// `[t][group][lane]`: `Σ x_q` over the lane, as f32 (for the Q4_K minimums).
    sums: Vec<f32>,
}

impl LaneInputs {
    /// Quantize `xs` (`[T, cols]`, `cols` a multiple of 32).
    pub fn quantize(xs: &[f32], cols: usize) -> LaneInputs {
        assert!(
            cols > 0 && cols.is_multiple_of(BLOCK),
            "integer dot: {cols} values per vector is not whole 32-value blocks"
        );
        assert_eq!(xs.len() % cols, 0, "integer dot: input is not [T, {cols}]");
        assert!(enabled(), "integer dot inputs prepared on a CPU without AVX-512 VNNI");
        let t = xs.len() / cols;
        let groups = cols.div_ceil(BLOCK * GROUP_BLOCKS);
        // Padding (past the last block) is x_q = 0: high byte 128, the others 0, scale 0.
        let mut hi = vec![128u8; t * groups * GROUP_BYTES];
        let mut mid = vec![0u8; t * groups * GROUP_BYTES];
        let mut lo = vec![0u8; t * groups * GROUP_BYTES];
        let mut scale = vec![0f32; t * groups * 16];
        let mut sums = vec![0f32; t * groups * 16];
        let (vb, sb) = (groups * GROUP_BYTES, groups * 16);
        #[allow(clippy::type_complexity)]
        let work =
            |(((hi, mid), lo), (scale, sums)): (((&mut [u8], &mut [u8]), &mut [u8]), (&mut [f32], &mut [f32])),
             xs: &[f32]| {
                for (k, x) in xs.chunks_exact(cols).enumerate() {
                    let bytes = k * vb..(k + 1) * vb;
                    let parts = [&mut hi[bytes.clone()], &mut mid[bytes.clone()], &mut lo[bytes]];
                    let lanes = k * sb..(k + 1) * sb;
                    // SAFETY: `enabled()` (checked above) includes the kernel's CPU features.
                    unsafe { avx512::quantize_one(x, parts, &mut scale[lanes.clone()], &mut sums[lanes]) };
                }
            };
        if t <= QUANT_TASK {
            // A decode step or a verify pass: not worth a parallel task.
            work((((&mut hi[..], &mut mid[..]), &mut lo[..]), (&mut scale[..], &mut sums[..])), xs);
        } else {
            hi.par_chunks_mut(vb * QUANT_TASK)
                .zip(mid.par_chunks_mut(vb * QUANT_TASK))
                .zip(lo.par_chunks_mut(vb * QUANT_TASK))
                .zip(scale.par_chunks_mut(sb * QUANT_TASK).zip(sums.par_chunks_mut(sb * QUANT_TASK)))
                .zip(xs.par_chunks(cols * QUANT_TASK))
                .for_each(|(bufs, xs)| work(bufs, xs));
        }
        LaneInputs { t, groups, hi, mid, lo, scale, sums }
    }

    /// Number of vectors.
    pub fn len(&self) -> usize {
        self.t
    }

    pub fn is_empty(&self) -> bool {
        self.t == 0
    }
}

/// Adding and subtracting 1.5·2^23 rounds an f32 below 2^22 to an integer, half to even.
pub(super) const ROUNDER: f32 = 12_582_912.0;
/// The largest quantized magnitude: 22-bit integers, so a lane's `Σ q·x_q` (16 values,
/// `|q| ≤ 32`) stays within `i32`.
const Q_MAX: f32 = 2_097_151.0;

/// Whether rows of `ty` have an integer kernel (and [`enabled`] says it runs here).
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K) && enabled()
}

/// `outs[t·n + i] = dot(row(start + i), x[t])` for `n = outs.len() / T` consecutive rows of a
/// `ty` matrix whose rows are `row_bytes` bytes from `data`. Requires [`supports`]`(ty)`.
pub fn dot_rows(ty: GgmlType, data: &[u8], row_bytes: usize, start: usize, x: &LaneInputs, outs: &mut [f32]) {
    assert!(supports(ty), "no integer dot kernel for {ty} on this CPU");
    assert!(x.t > 0 && outs.len().is_multiple_of(x.t), "integer dot: {} outputs for {} vectors", outs.len(), x.t);
    let n = outs.len() / x.t;
    assert!((start + n) * row_bytes <= data.len(), "integer dot: rows out of range");
    let values = row_bytes / ty.type_size() * ty.block_size();
    assert_eq!(values.div_ceil(256), x.groups, "integer dot: row and vector sizes differ");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `supports()` checked the CPU features; the shapes were checked just above.
    unsafe {
        use avx512::*;
        match ty {
            GgmlType::Q4_K => rows::<Q4K>(data, row_bytes, start, x, outs, n),
            _ => rows::<Q6K>(data, row_bytes, start, x, outs, n),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::dot512::hsum16;
    use super::*;
    use std::arch::x86_64::*;

    /// One row's group, decoded: the signed weights in the lane layout (4 steps), each lane's
    /// weight scale `d` and minimum `m` (`w = d·q + m`; 0 but for Q4_K), and `−128·Σq` per lane
    /// (the high activation bytes carry a +128 offset).
    #[derive(Clone, Copy)]
    pub(super) struct DecGroup {
        q: [__m512i; 4],
        d: __m512,
        m: __m512,
        init: __m512i,
    }

    /// A weight format's decoder into [`DecGroup`]s.
    pub(super) trait Format {
        /// Whether weights have a per-lane minimum (`w = d·q + m`).
        const MIN: bool;
        /// Decode 256-value group `g` (a super-block) of a row.
        unsafe fn decode(row: *const u8, g: usize) -> DecGroup;
    }

    /// `vpermt2b` over two 64-byte registers.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn permute2(idx: &[u8; 64], a: __m512i, b: __m512i) -> __m512i {
        _mm512_permutex2var_epi8(a, _mm512_loadu_si512(idx.as_ptr() as *const _), b)
    }

    /// `−128·Σq` per lane over the four steps.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn init_of(q: &[__m512i; 4]) -> __m512i {
        let c128 = _mm512_set1_epi8(-128);
        let s = q.iter().fold(_mm512_setzero_si512(), |s, qi| _mm512_dpbusd_epi32(s, c128, *qi));
        _mm512_sub_epi32(_mm512_setzero_si512(), s)
    }

    /// Byte indices for lane `j`, step `i` of a K-quant super-block: `base(j) + 4·i + e`, with
    /// `base` [`q4k_base`] (`Q4K_QS`), [`q6k_ql_base`] (`Q6K_QL`) or [`q6k_qh_base`].
    const fn k_bytes(i: usize, base: usize) -> [u8; 64] {
        let mut t = [0u8; 64];
        let mut p = 0;
        while p < 64 {
            let j = p / 4;
            let b = match base {
                Q4K_QS => q4k_base(j),
                Q6K_QL => q6k_ql_base(j),
                _ => q6k_qh_base(j),
            };
            t[p] = (b + 4 * i + p % 4) as u8;
            p += 1;
        }
        t
    }
    const Q4K_QS: usize = 0;
    const Q6K_QL: usize = 1;
    const Q6K_QH: usize = 2;
    /// Q4_K: lane `j` (values `16j ..`) is in 64-value chunk `j / 4`: low nibbles of
    /// `qs[32·(j/4) + 16·(j % 2) ..]` for `j % 4 < 2`, high nibbles otherwise.
    const fn q4k_base(j: usize) -> usize {
        32 * (j / 4) + 16 * (j % 2)
    }
    /// Q6_K: lane `j` is in half `h = j / 8`, part `p = (j % 8) / 2` (32 values each), values
    /// `l = 16·(j % 2) ..` of the part: low bits from `ql[64h + 32·(p % 2) + l]` (low nibble for
    /// p < 2), high bits `2p, 2p + 1` of `qh[32h + l]`.
    const fn q6k_ql_base(j: usize) -> usize {
        64 * (j / 8) + 32 * ((j % 8) / 2 % 2) + 16 * (j % 2)
    }
    const fn q6k_qh_base(j: usize) -> usize {
        32 * (j / 8) + 16 * (j % 2)
    }

    pub(super) struct Q4K;
    impl Q4K {
        const QS_IDX: [[u8; 64]; 4] = [k_bytes(0, Q4K_QS), k_bytes(1, Q4K_QS), k_bytes(2, Q4K_QS), k_bytes(3, Q4K_QS)];
    }

    /// Q4_K (144 bytes: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins, 128 bytes of
    /// nibbles): `w = (d·sc)·q − dmin·mn` per 32 values (lanes `2s`, `2s + 1`), as the f32
    /// kernels compute the factors.
    impl Format for Q4K {
        const MIN: bool = true;
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
        unsafe fn decode(row: *const u8, g: usize) -> DecGroup {
            let p = row.add(g * 144);
            let (d, dmin) = (f16_at(p), f16_at(p.add(2)));
            let (sc, mn) = k4_scales_mins(&*(p.add(4) as *const [u8; 12]));
            let ds: [f32; 16] = std::array::from_fn(|j| d * sc[j / 2] as f32);
            let ms: [f32; 16] = std::array::from_fn(|j| -(dmin * mn[j / 2] as f32));
            let (a0, a1) = (_mm512_loadu_si512(p.add(16) as *const _), _mm512_loadu_si512(p.add(80) as *const _));
            let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            // 0 for lanes j % 4 < 2 (low nibbles), 4 otherwise.
            let shift = _mm512_slli_epi32::<1>(_mm512_and_si512(lane, _mm512_set1_epi32(2)));
            let low4 = _mm512_set1_epi8(0x0f);
            let q: [__m512i; 4] = std::array::from_fn(|i| {
                _mm512_and_si512(_mm512_srlv_epi32(permute2(&Self::QS_IDX[i], a0, a1), shift), low4)
            });
            DecGroup { q, d: _mm512_loadu_ps(ds.as_ptr()), m: _mm512_loadu_ps(ms.as_ptr()), init: init_of(&q) }
        }
    }

    pub(super) struct Q6K;
    impl Q6K {
        const QL_IDX: [[u8; 64]; 4] = [k_bytes(0, Q6K_QL), k_bytes(1, Q6K_QL), k_bytes(2, Q6K_QL), k_bytes(3, Q6K_QL)];
        const QH_IDX: [[u8; 64]; 4] = [k_bytes(0, Q6K_QH), k_bytes(1, Q6K_QH), k_bytes(2, Q6K_QH), k_bytes(3, Q6K_QH)];
    }

    /// Q6_K (210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales, f16
    /// `d`): `w = (d·sc)·(u − 32)`, one scale per lane.
    impl Format for Q6K {
        const MIN: bool = false;
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
        unsafe fn decode(row: *const u8, g: usize) -> DecGroup {
            let p = row.add(g * 210);
            let d = f16_at(p.add(208));
            let ds: [f32; 16] = std::array::from_fn(|j| d * (*p.add(192 + j) as i8) as f32);
            let (l0, l1) = (_mm512_loadu_si512(p as *const _), _mm512_loadu_si512(p.add(64) as *const _));
            let qh = _mm512_loadu_si512(p.add(128) as *const _);
            let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let part = _mm512_srli_epi32::<1>(_mm512_and_si512(lane, _mm512_set1_epi32(7)));
            // Nibble: low for parts 0, 1, high for 2, 3; high bits 2p, 2p + 1.
            let nib_shift = _mm512_slli_epi32::<1>(_mm512_and_si512(part, _mm512_set1_epi32(2)));
            let qh_shift = _mm512_slli_epi32::<1>(part);
            let (low4, two, bias) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(3), _mm512_set1_epi8(32));
            let q: [__m512i; 4] = std::array::from_fn(|i| {
                let lo = _mm512_and_si512(_mm512_srlv_epi32(permute2(&Self::QL_IDX[i], l0, l1), nib_shift), low4);
                let hb = _mm512_permutexvar_epi8(_mm512_loadu_si512(Self::QH_IDX[i].as_ptr() as *const _), qh);
                let hi = _mm512_and_si512(_mm512_srlv_epi32(hb, qh_shift), two);
                _mm512_sub_epi8(_mm512_or_si512(lo, _mm512_slli_epi32::<4>(hi)), bias)
            });
            DecGroup { q, d: _mm512_loadu_ps(ds.as_ptr()), m: _mm512_setzero_ps(), init: init_of(&q) }
        }
    }

    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        crate::gguf::f16_to_f32(u16::from_le_bytes([*p, *p.add(1)]))
    }

    /// Quantize one vector: per 16 values `s = amax / Q_MAX` and `x_q = round(x / s)` (half to
    /// even: `x·(Q_MAX/amax)` plus and minus 1.5·2^23), written as three bytes in the lane
    /// layout, with the lane's scale and `Σ x_q`. A non-finite value makes its lane's scale NaN,
    /// so it reaches the result as the f32 kernels' would (the integers cannot carry it).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub(super) unsafe fn quantize_one(x: &[f32], [hi, mid, lo]: [&mut [u8]; 3], scale: &mut [f32], sums: &mut [f32]) {
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let (rounder, limit) = (_mm512_set1_ps(ROUNDER), _mm512_set1_ps(Q_MAX));
        for (h, part) in x.chunks_exact(LANE_VALUES).enumerate() {
            let (g, lane) = (h / 16, h % 16);
            let v = _mm512_loadu_ps(part.as_ptr());
            let a = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs));
            let finite = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, _mm512_set1_ps(f32::INFINITY)) == 0xffff;
            let amax = _mm512_reduce_max_ps(a);
            let s = if finite { amax / Q_MAX } else { f32::NAN };
            let inv = if finite && amax > 0.0 { Q_MAX / amax } else { 0.0 };
            let qf = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)), rounder), rounder);
            let qf = _mm512_min_ps(_mm512_max_ps(qf, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
            let q = _mm512_cvttps_epi32(qf);
            let bytes = [
                _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_srai_epi32::<16>(q), _mm512_set1_epi32(128))),
                _mm512_cvtepi32_epi8(_mm512_srai_epi32::<8>(q)),
                _mm512_cvtepi32_epi8(q),
            ];
            for (dst, b) in [&mut *hi, &mut *mid, &mut *lo].into_iter().zip(bytes) {
                let words: [u32; 4] = std::mem::transmute(b);
                for (step, w) in words.iter().enumerate() {
                    let at = (g * 4 + step) * 64 + lane * 4;
                    dst[at..at + 4].copy_from_slice(&w.to_le_bytes());
                }
            }
            scale[g * 16 + lane] = s;
            sums[g * 16 + lane] = _mm512_reduce_add_epi32(q) as f32;
        }
    }

    /// `R` decoded rows × vectors `t0 .. t0 + N`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn tile<F: Format, const R: usize, const N: usize>(
        rows: [&[DecGroup]; R],
        x: &LaneInputs,
        t0: usize,
    ) -> [[f32; N]; R] {
        let mut acc = [[_mm512_setzero_ps(); N]; R];
        for g in 0..x.groups {
            for n in 0..N {
                let v = (t0 + n) * x.groups + g;
                let load4 = |bytes: &[u8]| -> [__m512i; 4] {
                    let p = bytes.as_ptr().add(v * GROUP_BYTES);
                    std::array::from_fn(|i| _mm512_loadu_si512(p.add(64 * i) as *const _))
                };
                let (hs, ms, ls) = (load4(&x.hi), load4(&x.mid), load4(&x.lo));
                let s = _mm512_loadu_ps(x.scale.as_ptr().add(v * 16));
                let sums = if F::MIN { _mm512_loadu_ps(x.sums.as_ptr().add(v * 16)) } else { _mm512_setzero_ps() };
                for r in 0..R {
                    let dg = &rows[r][g];
                    let (mut ah, mut am, mut al) = (dg.init, _mm512_setzero_si512(), _mm512_setzero_si512());
                    for i in 0..4 {
                        ah = _mm512_dpbusd_epi32(ah, hs[i], dg.q[i]);
                        am = _mm512_dpbusd_epi32(am, ms[i], dg.q[i]);
                        al = _mm512_dpbusd_epi32(al, ls[i], dg.q[i]);
                    }
                    let upper = _mm512_add_epi32(_mm512_slli_epi32::<8>(ah), am);
                    let sum = _mm512_add_epi32(_mm512_slli_epi32::<8>(upper), al);
                    let ds = _mm512_mul_ps(dg.d, s);
                    acc[r][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, acc[r][n]);
                    if F::MIN {
                        acc[r][n] = _mm512_fmadd_ps(sums, _mm512_mul_ps(dg.m, s), acc[r][n]);
                    }
                }
            }
        }
        let mut out = [[0f32; N]; R];
        for r in 0..R {
            for n in 0..N {
                out[r][n] = hsum16(acc[r][n]);
            }
        }
        out
    }

    /// Rows `start .. start + n`, two at a time, times every vector: for each block of at most
    /// `TOKEN_BLOCK` vectors (whose inputs stay in L2 while every row streams past them), each
    /// row is decoded once. Every (row, vector) product is the same arithmetic whatever the
    /// blocking and the tile width, so results do not depend on the number of vectors.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub(super) unsafe fn rows<F: Format>(
        data: &[u8],
        row_bytes: usize,
        start: usize,
        x: &LaneInputs,
        outs: &mut [f32],
        n: usize,
    ) {
        let (groups, t) = (x.groups, x.t);
        let (z, zf) = (_mm512_setzero_si512(), _mm512_setzero_ps());
        let mut dec = vec![DecGroup { q: [z; 4], d: zf, m: zf, init: z }; 2 * groups];
        let decode_row = |r: usize, into: &mut [DecGroup]| {
            let p = data.as_ptr().add((start + r) * row_bytes);
            for (g, slot) in into.iter_mut().enumerate() {
                *slot = F::decode(p, g);
            }
        };
        for t0 in (0..t).step_by(TOKEN_BLOCK) {
            let t1 = t.min(t0 + TOKEN_BLOCK);
            let mut r = 0;
            while r + 2 <= n {
                let (a, b) = dec.split_at_mut(groups);
                decode_row(r, a);
                decode_row(r + 1, b);
                times_vectors::<F, 2>([&a[..], &b[..]], x, t0..t1, outs, n, r);
                r += 2;
            }
            if r < n {
                let a = &mut dec[..groups];
                decode_row(r, a);
                times_vectors::<F, 1>([&a[..]], x, t0..t1, outs, n, r);
            }
        }
    }

    /// `R` decoded rows (`r ..`) times vectors `ts`, in tiles of four and then one at a time, into
    /// `outs` (`[vector][n]`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn times_vectors<F: Format, const R: usize>(
        rows: [&[DecGroup]; R],
        x: &LaneInputs,
        ts: std::ops::Range<usize>,
        outs: &mut [f32],
        n: usize,
        r: usize,
    ) {
        let mut ti = ts.start;
        while ti + 4 <= ts.end {
            let ys = tile::<F, R, 4>(rows, x, ti);
            for (dr, yr) in ys.iter().enumerate() {
                for (j, y) in yr.iter().enumerate() {
                    outs[(ti + j) * n + r + dr] = *y;
                }
            }
            ti += 4;
        }
        for ti in ti..ts.end {
            let ys = tile::<F, R, 1>(rows, x, ti);
            for (dr, y) in ys.iter().enumerate() {
                outs[ti * n + r + dr] = y[0];
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// One lane of one group, decoded from the format's description: the 16 integer weights,
    /// the weight scale and the minimum (`w = d·q + m`).
    fn lane_weights(ty: GgmlType, row: &[u8], g: usize, j: usize) -> ([i32; 16], f32, f32) {
        let f16 = |p: &[u8]| half::f16::from_le_bytes([p[0], p[1]]).to_f32();
        let mut q = [0i32; 16];
        match ty {
            GgmlType::Q4_K => {
                let sb = &row[g * 144..(g + 1) * 144];
                let (sc, mn) = k4_scales_mins(sb[4..16].try_into().unwrap());
                for (k, q) in q.iter_mut().enumerate() {
                    let v = 16 * j + k;
                    let (c, w) = (v / 64, v % 64);
                    *q = if w < 32 { sb[16 + 32 * c + w] & 0xf } else { sb[16 + 32 * c + w - 32] >> 4 } as i32;
                }
                (q, f16(sb) * sc[j / 2] as f32, -(f16(&sb[2..]) * mn[j / 2] as f32))
            }
            _ => {
                let sb = &row[g * 210..(g + 1) * 210];
                for (k, q) in q.iter_mut().enumerate() {
                    let v = 16 * j + k;
                    let (h, part, l) = (v / 128, (v % 128) / 32, v % 32);
                    let ql = sb[64 * h + 32 * (part % 2) + l];
                    let nib = if part < 2 { ql & 0xf } else { ql >> 4 };
                    let hb = (sb[128 + 32 * h + l] >> (2 * part)) & 3;
                    *q = (nib | (hb << 4)) as i32 - 32;
                }
                (q, f16(&sb[208..]) * (sb[192 + j] as i8) as f32, 0.0)
            }
        }
    }

    /// The kernel's arithmetic transcribed for one row and vector `ti`, lane by lane.
    fn reference(ty: GgmlType, row: &[u8], x: &LaneInputs, ti: usize) -> f32 {
        let mut acc = [0f32; 16];
        for g in 0..x.groups {
            for (j, a) in acc.iter_mut().enumerate() {
                let (q, d, m) = lane_weights(ty, row, g, j);
                let v0 = (ti * x.groups + g) * 16;
                let mut sum = 0i32;
                for (k, q) in q.iter().enumerate() {
                    let at = ((ti * x.groups + g) * 4 + k / 4) * 64 + j * 4 + k % 4;
                    let xq = 65536 * (x.hi[at] as i32 - 128) + 256 * x.mid[at] as i32 + x.lo[at] as i32;
                    sum += q * xq;
                }
                let s = x.scale[v0 + j];
                *a = (sum as f32).mul_add(d * s, *a);
                if ty == GgmlType::Q4_K {
                    *a = x.sums[v0 + j].mul_add(m * s, *a);
                }
            }
        }
        let mut s = acc;
        for n in [8, 4, 2, 1] {
            for i in 0..n {
                s[i] += s[i + n];
            }
        }
        s[0]
    }

    /// Random rows of `ty` with sane f16 scales (also used by the byte tile tests).
    pub(in crate::gguf) fn random_rows(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut bytes: Vec<u8> = (0..rows * ty.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        let scale_at: &[usize] = match ty {
            GgmlType::Q5_0 | GgmlType::Q8_0 => &[0], // for the byte tile tests
            GgmlType::Q4_K => &[0, 2],
            _ => &[208],
        };
        for blk in bytes.chunks_exact_mut(ty.type_size()) {
            for &at in scale_at {
                let d = half::f16::from_f32(0.001 + (next() % 1000) as f32 * 1e-5);
                blk[at..at + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        bytes
    }

    #[test]
    fn kernels_equal_their_scalar_transcription_and_the_exact_dot() {
        if !enabled() {
            // No matrix may take the integer path here; the kernels themselves cannot run.
            assert!([GgmlType::Q4_K, GgmlType::Q6_K].iter().all(|&t| !supports(t)));
            eprintln!("integer kernels off (no AVX-512 VNNI, or MEGAGEMMA_INT_DOT=0): only the fallback is checked");
            return;
        }
        // 512 values; 7 rows (pairs and a single), 6 vectors (a tile of 4 and single columns);
        // one vector has an outlier and one a zero lane.
        for (ty, cols) in [(GgmlType::Q4_K, 512), (GgmlType::Q6_K, 512)] {
            let (rows, t) = (7, 6);
            let data = random_rows(ty, rows, cols, 7);
            let rb = ty.row_bytes(cols).unwrap();
            let mut xs: Vec<f32> = (0..t * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            xs[cols + 5] = 900.0;
            xs[2 * cols..2 * cols + 16].fill(0.0);
            let x = LaneInputs::quantize(&xs, cols);
            let mut outs = vec![0f32; t * rows];
            dot_rows(ty, &data, rb, 0, &x, &mut outs);
            for ti in 0..t {
                // One vector alone gives the same bits as in the group.
                let one = LaneInputs::quantize(&xs[ti * cols..(ti + 1) * cols], cols);
                let mut single = vec![0f32; rows];
                dot_rows(ty, &data, rb, 0, &one, &mut single);
                let xv = &xs[ti * cols..(ti + 1) * cols];
                for r in 0..rows {
                    let row = &data[r * rb..(r + 1) * rb];
                    let got = outs[ti * rows + r];
                    let want = reference(ty, row, &x, ti);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty} row {r} vector {ti}: kernel {got} vs reference {want}"
                    );
                    assert_eq!(got.to_bits(), single[r].to_bits(), "{ty} row {r} vector {ti}: in a group vs alone");
                    let mut w = vec![0f32; cols];
                    crate::gguf::dequantize_row(ty, row, &mut w).unwrap();
                    let exact: f64 = w.iter().zip(xv).map(|(w, x)| *w as f64 * *x as f64).sum();
                    let scale: f64 = w.iter().zip(xv).map(|(w, x)| (*w as f64 * *x as f64).abs()).sum();
                    assert!(
                        (got as f64 - exact).abs() <= 1e-5 * scale,
                        "{ty} row {r} vector {ti}: {got} vs exact {exact}"
                    );
                }
            }
            // Rows taken from the middle of the matrix.
            let mut part = vec![0f32; t * 3];
            dot_rows(ty, &data, rb, 3, &x, &mut part);
            for ti in 0..t {
                for r in 0..3 {
                    assert_eq!(part[ti * 3 + r].to_bits(), outs[ti * rows + 3 + r].to_bits(), "{ty}");
                }
            }
        }
    }

    #[test]
    fn vectors_across_token_blocks_equal_lone_vectors() {
        if !enabled() {
            return; // the integer kernels cannot run here (checked by the test above)
        }
        // Two whole blocks of vectors and a partial third (a tile of 4 and single columns).
        let (ty, cols, rows, t) = (GgmlType::Q4_K, 256, 3, 2 * TOKEN_BLOCK + 6);
        let data = random_rows(ty, rows, cols, 11);
        let rb = ty.row_bytes(cols).unwrap();
        let xs: Vec<f32> = (0..t * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0).collect();
        let x = LaneInputs::quantize(&xs, cols);
        let mut outs = vec![0f32; t * rows];
        dot_rows(ty, &data, rb, 0, &x, &mut outs);
        for ti in [0, 1, TOKEN_BLOCK - 1, TOKEN_BLOCK, 2 * TOKEN_BLOCK + 3, t - 1] {
            let one = LaneInputs::quantize(&xs[ti * cols..(ti + 1) * cols], cols);
            let mut single = vec![0f32; rows];
            dot_rows(ty, &data, rb, 0, &one, &mut single);
            for r in 0..rows {
                assert_eq!(outs[ti * rows + r].to_bits(), single[r].to_bits(), "row {r} vector {ti} of {t}");
            }
        }
    }

    #[test]
    fn non_finite_inputs_reach_the_result() {
        if !enabled() {
            return; // covered by the fallback check above
        }
        let ty = GgmlType::Q6_K;
        let data = random_rows(ty, 1, 256, 3);
        let mut xs = vec![0.5f32; 256];
        xs[40] = f32::NAN;
        let x = LaneInputs::quantize(&xs, 256);
        let mut out = [0f32; 1];
        dot_rows(ty, &data, ty.row_bytes(256).unwrap(), 0, &x, &mut out);
        assert!(out[0].is_nan());
    }
}
