//! GGUF Q8_0 and Q5_0 matrices as integer dot products over 16 rows at once (AVX-512 VNNI).
//!
//! Q8_0 weights are `d·q` per 32 values (`q` a signed byte, `d` an f16); Q5_0 weights are
//! `d·(u − 16)`, the same form with `q = u − 16` in `[−16, 15]`. The f32 kernel spends one fused
//! multiply-add per weight and vector, so a verify pass's LM head (Gemma 3 270M: 262,144 × 640 in
//! Q8_0, 72% of the bytes a token reads) ran at the FMA units' limit; and [`super::idot`]'s lane
//! layout (one row at a time, its bytes permuted into lanes, lanes summed across at the end)
//! measured no faster than f32 for Q8_0, and 3–4× slower than tiles for Q5_0. Here the matrix is
//! re-laid once, on first use, in *tiles* of 16 rows: per tile and 32-value block, the 512 codes
//! as `q + 128` (unsigned) in the order `vpdpbusd` reads them against one broadcast activation
//! word — step `i` (values `4i .. 4i + 4`), row `r`, byte `e` at `64·i + 4·r + e` — then the 16
//! rows' f16 scales: 544 bytes (as many as 16 Q8_0 blocks; 1.55× the 16 Q5_0 blocks they come
//! from). One `vpdpbusd` adds four products to each of the 16 rows: no byte permutes, no
//! horizontal sums.
//!
//! Activations, per token and 32-value block: `x ≈ s·x_q`, `s = amax / Q`, with `Q = 2^19 − 1`
//! against Q8_0 codes and `2^22 − 1` against Q5_0's (error at most `s/2`: ≈9.5e-7 and ≈1.2e-7
//! of the block's largest value), `x_q` as three signed bytes (balanced base-256 digits
//! `x_q = 65536·h + 256·m + l`, `l, m ∈ [−128, 127]`, `|h| ≤ 64`). Per block and row, three
//! `vpdpbusd` chains give `S_p = Σ (q + 128)·digit_p`, and
//! `Σ q·x_q = 65536·S_h + 256·S_m + S_l − 128·Σ x_q` in wrapping 32-bit arithmetic (exact: the
//! true value fits, `128·(2^19 − 1)·32 < 2^31` and `16·(2^22 − 1)·32 < 2^31`); then
//! `acc = fma(f32(Σ q·x_q), d·s, acc)` block after block. Every step is per token, so a column
//! of a multi-token call is bit-identical to a one-token call. With two tokens or more, on CPUs
//! with AMX (and `MEGAGEMMA_AMX` not `0`), one `tdpbsud` per tile and block computes the same
//! `S_p` for up to five tokens at once (the digit rows of the tokens' three planes against the
//! tile's codes, exactly the layout above): integer sums are exact in any order, so the results
//! are the same bits; [`tests`] check the kernel against a scalar transcription of the same
//! arithmetic, bit for bit, and against an f64 dot product.

#![allow(clippy::missing_safety_doc)]
// Indexed loops over fixed-size register arrays unroll into straight-line code (as idot.rs).
#![allow(clippy::needless_range_loop)]

use super::blocks::GgmlType;
use rayon::prelude::*;

/// Rows per tile: the 16 i32 lanes of one `vpdpbusd`.
pub const TILE_ROWS: usize = 16;
/// Values per Q8_0 block (and per activation scale).
const BLOCK: usize = 32;
/// Q8_0 block bytes: f16 `d`, 32 signed codes.
const Q8_0_BYTES: usize = 34;
/// Q5_0 block bytes: f16 `d`, 32 fifth bits `qh`, 16 bytes of nibbles.
const Q5_0_BYTES: usize = 22;
/// One tile's block: 16 rows × 32 codes, then 16 f16 scales.
const TILE_BLOCK_BYTES: usize = TILE_ROWS * BLOCK + 2 * TILE_ROWS;
/// The largest quantized activation magnitude against codes of `ty`: the largest that keeps a
/// block's `Σ q·x_q` within i32 (`|q| ≤ 128` for Q8_0, `≤ 16` for Q5_0).
fn q_max(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q5_0 => 4_194_303.0,
        _ => 524_287.0,
    }
}
/// Tokens whose digits stay in L2 while a call's tiles are multiplied with them.
const TOKEN_BLOCK: usize = 128;
/// Vectors quantized per parallel task.
const QUANT_TASK: usize = 8;

/// Bytes ahead of the block being multiplied that a tile walk prefetches (about 7.5 tile
/// blocks; 1 to 16 KiB and the T1/T2 hints measured alike on the 2-core Xeon VM).
const PREFETCH_AHEAD: usize = 4096;

/// Whether this CPU runs the tiled kernel: the integer kernels' switch ([`super::idot::enabled`]).
pub fn enabled() -> bool {
    super::idot::enabled()
}

/// A Q8_0 or Q5_0 matrix re-laid in tiles of 16 rows (see the module documentation). Rows past
/// the matrix in the last tile are zero (codes 128, scales 0).
pub struct ByteTiles {
    /// The format the codes came from (it bounds them, and so the inputs' width).
    ty: GgmlType,
    rows: usize,
    blocks: usize,
    /// `[tile][block]` of [`TILE_BLOCK_BYTES`].
    data: Vec<u8>,
}

impl ByteTiles {
    /// Re-lay `rows` Q8_0 rows of `row_bytes` bytes each (`bytes`, rows contiguous).
    pub fn from_q8_0(bytes: &[u8], rows: usize, row_bytes: usize) -> ByteTiles {
        ByteTiles::from_rows(GgmlType::Q8_0, bytes, rows, row_bytes)
    }

    /// Re-lay `rows` rows of `ty` (Q8_0 or Q5_0; see [`supports`]) of `row_bytes` bytes each.
    /// A Q5_0 weight `d·(u − 16)` is the Q8_0 weight `d·q` with `q = u − 16`, so both formats
    /// share one tile layout and one kernel, exactly.
    pub fn from_rows(ty: GgmlType, bytes: &[u8], rows: usize, row_bytes: usize) -> ByteTiles {
        let block_bytes = match ty {
            GgmlType::Q8_0 => Q8_0_BYTES,
            GgmlType::Q5_0 => Q5_0_BYTES,
            _ => panic!("Q8_0 tiles: no tile layout for {ty}"),
        };
        assert!(row_bytes.is_multiple_of(block_bytes), "{ty} rows of {row_bytes} bytes are not whole blocks");
        assert_eq!(bytes.len(), rows * row_bytes, "{ty} matrix: {} bytes for {rows} rows", bytes.len());
        let blocks = row_bytes / block_bytes;
        let tiles = rows.div_ceil(TILE_ROWS);
        let tile_bytes = blocks * TILE_BLOCK_BYTES;
        let mut data = vec![0u8; tiles * tile_bytes];
        data.par_chunks_mut(tile_bytes).enumerate().for_each(|(tile, out)| {
            for (b, tb) in out.chunks_exact_mut(TILE_BLOCK_BYTES).enumerate() {
                let (codes, scales) = tb.split_at_mut(TILE_ROWS * BLOCK);
                codes.fill(128);
                for r in 0..TILE_ROWS {
                    let row = tile * TILE_ROWS + r;
                    if row >= rows {
                        break;
                    }
                    let blk = &bytes[row * row_bytes + b * block_bytes..][..block_bytes];
                    scales[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                    for (v, q) in block_codes(ty, blk).into_iter().enumerate() {
                        codes[64 * (v / 4) + 4 * r + v % 4] = (q as i32 + 128) as u8;
                    }
                }
            }
        });
        ByteTiles { ty, rows, blocks, data }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    fn tile(&self, t: usize) -> &[u8] {
        let tb = self.blocks * TILE_BLOCK_BYTES;
        &self.data[t * tb..(t + 1) * tb]
    }
}

/// The 32 signed codes of one Q8_0 or Q5_0 block (whose f16 scale is its first two bytes).
fn block_codes(ty: GgmlType, blk: &[u8]) -> [i8; BLOCK] {
    match ty {
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            std::array::from_fn(|v| {
                let nibble = if v < 16 { blk[6 + v] & 0xf } else { blk[6 + v - 16] >> 4 };
                ((nibble as u32 | ((qh >> v) & 1) << 4) as i32 - 16) as i8
            })
        }
        _ => std::array::from_fn(|v| blk[2 + v] as i8),
    }
}

/// `T` activation vectors quantized for [`ByteTiles`] (see the module documentation).
pub struct TileInputs {
    /// The format of the tiles these inputs are for ([`q_max`]).
    ty: GgmlType,
    t: usize,
    cols: usize,
    /// `[t][plane][cols]`: the high, middle and low signed digits of `x_q`.
    digits: Vec<i8>,
    /// `[t][block]`: the block's scale `s` (NaN when the block holds a non-finite value).
    scale: Vec<f32>,
    /// `[t][block]`: `128·Σ x_q` over the block (wrapping).
    corr: Vec<i32>,
}

impl TileInputs {
    /// Quantize `xs` (`[T, cols]`, `cols` a multiple of 32) for tiles of `ty`.
    pub fn quantize(xs: &[f32], cols: usize, ty: GgmlType) -> TileInputs {
        assert!(matches!(ty, GgmlType::Q8_0 | GgmlType::Q5_0), "no byte tiles for {ty}");
        assert!(cols > 0 && cols.is_multiple_of(BLOCK), "Q8_0 tiles: {cols} values per vector is not whole blocks");
        assert_eq!(xs.len() % cols, 0, "Q8_0 tiles: input is not [T, {cols}]");
        assert!(enabled(), "Q8_0 tile inputs prepared on a CPU without AVX-512 VNNI");
        let (t, blocks) = (xs.len() / cols, cols / BLOCK);
        let mut digits = vec![0i8; t * 3 * cols];
        let mut scale = vec![0f32; t * blocks];
        let mut corr = vec![0i32; t * blocks];
        let work = |((d, s), c): ((&mut [i8], &mut [f32]), &mut [i32]), xs: &[f32]| {
            for (k, x) in xs.chunks_exact(cols).enumerate() {
                let (d, s, c) = (
                    &mut d[k * 3 * cols..][..3 * cols],
                    &mut s[k * blocks..][..blocks],
                    &mut c[k * blocks..][..blocks],
                );
                // SAFETY: `enabled()` (checked above) includes the kernel's CPU features.
                unsafe { avx512::quantize_one(x, q_max(ty), d, s, c) };
            }
        };
        if t <= QUANT_TASK {
            work(((&mut digits[..], &mut scale[..]), &mut corr[..]), xs);
        } else {
            digits
                .par_chunks_mut(3 * cols * QUANT_TASK)
                .zip(scale.par_chunks_mut(blocks * QUANT_TASK))
                .zip(corr.par_chunks_mut(blocks * QUANT_TASK))
                .zip(xs.par_chunks(cols * QUANT_TASK))
                .for_each(|(bufs, xs)| work(bufs, xs));
        }
        TileInputs { ty, t, cols, digits, scale, corr }
    }

    /// Number of vectors.
    pub fn len(&self) -> usize {
        self.t
    }

    pub fn is_empty(&self) -> bool {
        self.t == 0
    }
}

/// Whether rows of `ty` go through [`ByteTiles`] here.
pub fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q5_0) && enabled()
}

/// `outs[t·n + i] = dot(row(start + i), x[t])` for `n = outs.len() / T` consecutive rows.
pub fn dot_rows(w: &ByteTiles, start: usize, x: &TileInputs, outs: &mut [f32]) {
    dot_rows_on(w, start, x, outs, amx::available())
}

/// [`dot_rows`], with several tokens on AMX when `use_amx` (and it is [`amx::available`]).
fn dot_rows_on(w: &ByteTiles, start: usize, x: &TileInputs, outs: &mut [f32], use_amx: bool) {
    assert!(enabled(), "Q8_0 tiles on a CPU without AVX-512 VNNI");
    assert_eq!(x.ty, w.ty, "byte tiles: inputs for {} tiles against {} tiles", x.ty, w.ty);
    assert!(x.t > 0 && outs.len().is_multiple_of(x.t), "Q8_0 tiles: {} outputs for {} vectors", outs.len(), x.t);
    assert_eq!(x.cols, w.blocks * BLOCK, "Q8_0 tiles: vectors of {} values, rows of {}", x.cols, w.blocks * BLOCK);
    let n = outs.len() / x.t;
    assert!(start + n <= w.rows, "Q8_0 tiles: rows {start}..{} out of range", start + n);
    if n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `enabled()` checked the CPU features; the shapes were checked just above.
    unsafe {
        avx512::rows(w, start, n, x, outs, use_amx && amx::available())
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// One tile × vectors `t0 .. t0 + N`: per vector, the 16 rows' dots.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_dots<const N: usize>(tile: &[u8], x: &TileInputs, t0: usize) -> [__m512; N] {
        let cols = x.cols;
        let blocks = cols / BLOCK;
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            prefetch_block(tile, b);
            let z = _mm512_setzero_si512();
            let mut s = [[z; 3]; N];
            for i in 0..BLOCK / 4 {
                let w = _mm512_loadu_si512(tile.as_ptr().add(b * TILE_BLOCK_BYTES + 64 * i) as *const _);
                for n in 0..N {
                    let at = x.digits.as_ptr().add((t0 + n) * 3 * cols + BLOCK * b + 4 * i);
                    let word = |p: usize| _mm512_set1_epi32((at.add(p * cols) as *const i32).read_unaligned());
                    s[n][0] = _mm512_dpbusd_epi32(s[n][0], w, word(0));
                    s[n][1] = _mm512_dpbusd_epi32(s[n][1], w, word(1));
                    s[n][2] = _mm512_dpbusd_epi32(s[n][2], w, word(2));
                }
            }
            let d = block_scales(tile, b);
            for n in 0..N {
                acc[n] = combine(acc[n], s[n], d, x, (t0 + n) * blocks + b);
            }
        }
        acc
    }

    /// Write tile `tile`'s 16 dots of vector `ti` into `outs` (`[vector][n]`, rows `start ..`),
    /// keeping only the rows in range.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn store(dots: __m512, tile: usize, ti: usize, start: usize, n: usize, outs: &mut [f32]) {
        let row0 = tile * TILE_ROWS;
        let out = &mut outs[ti * n..(ti + 1) * n];
        if row0 >= start && row0 + TILE_ROWS <= start + n {
            _mm512_storeu_ps(out.as_mut_ptr().add(row0 - start), dots);
        } else {
            let lanes: [f32; TILE_ROWS] = std::mem::transmute(dots);
            for (r, v) in lanes.into_iter().enumerate() {
                let row = row0 + r;
                if row >= start && row < start + n {
                    out[row - start] = v;
                }
            }
        }
    }

    /// `acc = fma(f32(65536·S_h + 256·S_m + S_l − corr), d·s, acc)` for vector `v` (`[t][block]`
    /// index) of one tile and block: the three planes' sums to the block's dot, accumulated.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn combine(
        acc: __m512,
        [sh, sm, sl]: [__m512i; 3],
        d: __m512,
        x: &TileInputs,
        v: usize,
    ) -> __m512 {
        let upper = _mm512_add_epi32(_mm512_slli_epi32::<8>(sh), sm);
        let sum = _mm512_add_epi32(_mm512_slli_epi32::<8>(upper), sl);
        let sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(*x.corr.get_unchecked(v)));
        let ds = _mm512_mul_ps(d, _mm512_set1_ps(*x.scale.get_unchecked(v)));
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, acc)
    }

    /// The prefetches of one tile's block `b`: the stream ahead (the tile's later blocks, then the
    /// next tiles), so that loads and dot products overlap instead of taking turns.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn prefetch_block(tile: &[u8], b: usize) {
        let p = tile.as_ptr().wrapping_add(b * TILE_BLOCK_BYTES + PREFETCH_AHEAD);
        for line in (0..TILE_BLOCK_BYTES).step_by(64) {
            _mm_prefetch(p.wrapping_add(line) as *const i8, _MM_HINT_T0);
        }
    }

    /// The 16 rows' scales of one tile's block `b`, as f32.
    #[target_feature(enable = "avx512f,f16c")]
    #[inline]
    pub(super) unsafe fn block_scales(tile: &[u8], b: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(tile.as_ptr().add(b * TILE_BLOCK_BYTES + TILE_ROWS * BLOCK) as *const _))
    }

    /// Every tile of `tiles` × vectors `t0 .. t0 + N`, one tile at a time: a single stream of
    /// weights (on the AVX-512 VNNI AMD EPYC VM one token's LM head took 13 ms with four tiles
    /// at a time, 8–10 ms with one).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tiles_times<const N: usize>(
        w: &ByteTiles,
        tiles: std::ops::Range<usize>,
        x: &TileInputs,
        t0: usize,
        (start, n): (usize, usize),
        outs: &mut [f32],
    ) {
        for tile in tiles {
            let dots = tile_dots::<N>(w.tile(tile), x, t0);
            for j in 0..N {
                store(dots[j], tile, t0 + j, start, n, outs);
            }
        }
    }

    /// Rows `start .. start + n` × every vector: per block of at most [`TOKEN_BLOCK`] vectors,
    /// vectors four at a time over each tile, then the rest together (each (row, vector) dot is
    /// the same arithmetic whatever the grouping).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows(w: &ByteTiles, start: usize, n: usize, x: &TileInputs, outs: &mut [f32], use_amx: bool) {
        let tiles = start / TILE_ROWS..(start + n).div_ceil(TILE_ROWS);
        let span = (start, n);
        if x.t >= 2 && use_amx {
            let mut ti = 0;
            while ti < x.t {
                let nt = amx::MAX_TOKENS.min(x.t - ti);
                amx::tiles_times(w, tiles.clone(), x, ti, nt, span, outs);
                ti += nt;
            }
            return;
        }
        for tb in (0..x.t).step_by(TOKEN_BLOCK) {
            let end = x.t.min(tb + TOKEN_BLOCK);
            let mut ti = tb;
            while ti + 4 <= end {
                tiles_times::<4>(w, tiles.clone(), x, ti, span, outs);
                ti += 4;
            }
            match end - ti {
                3 => tiles_times::<3>(w, tiles.clone(), x, ti, span, outs),
                2 => tiles_times::<2>(w, tiles.clone(), x, ti, span, outs),
                1 => tiles_times::<1>(w, tiles.clone(), x, ti, span, outs),
                _ => {}
            }
        }
    }

    /// Quantize one vector: per 32 values `s = amax / q_max` and `x_q = round(x / s)` (half to
    /// even: `x·(q_max/amax)` plus and minus 1.5·2^23), split into balanced digits, with
    /// `128·Σ x_q`. A non-finite value makes its block's scale NaN, so it reaches the result as
    /// the f32 kernel's would (the integers cannot carry it).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn quantize_one(x: &[f32], q_max: f32, digits: &mut [i8], scale: &mut [f32], corr: &mut [i32]) {
        let cols = x.len();
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let (rounder, limit) = (_mm512_set1_ps(super::super::idot::ROUNDER), _mm512_set1_ps(q_max));
        for (b, blk) in x.chunks_exact(BLOCK).enumerate() {
            let v = [_mm512_loadu_ps(blk.as_ptr()), _mm512_loadu_ps(blk.as_ptr().add(16))];
            let a = v.map(|v| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs)));
            let inf = _mm512_set1_ps(f32::INFINITY);
            let finite = a.iter().all(|a| _mm512_cmp_ps_mask::<_CMP_LT_OQ>(*a, inf) == 0xffff);
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a[0], a[1]));
            let s = if finite { amax / q_max } else { f32::NAN };
            let inv = if finite && amax > 0.0 { q_max / amax } else { 0.0 };
            let mut sum = _mm512_setzero_si512();
            for (h, v) in v.into_iter().enumerate() {
                let qf = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)), rounder), rounder);
                let qf = _mm512_min_ps(_mm512_max_ps(qf, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
                let q = _mm512_cvttps_epi32(qf);
                sum = _mm512_add_epi32(sum, q);
                // Balanced digits: l = q's low byte as signed, then the same for (q − l) / 256.
                let low = |v: __m512i| _mm512_srai_epi32::<24>(_mm512_slli_epi32::<24>(v));
                let l = low(q);
                let rest = _mm512_srai_epi32::<8>(_mm512_sub_epi32(q, l));
                let m = low(rest);
                let hi = _mm512_srai_epi32::<8>(_mm512_sub_epi32(rest, m));
                for (p, d) in [hi, m, l].into_iter().enumerate() {
                    let at = digits.as_mut_ptr().add(p * cols + BLOCK * b + 16 * h);
                    _mm_storeu_si128(at as *mut _, _mm512_cvtepi32_epi8(d));
                }
            }
            scale[b] = s;
            corr[b] = _mm512_reduce_add_epi32(sum).wrapping_mul(128);
        }
    }
}

/// The same products on Intel AMX: per tile and block, one `tdpbsud` of the digit rows of up to
/// [`MAX_TOKENS`] tokens (A: row `3n + p` is token `n`'s plane `p`, 32 signed bytes) against the
/// tile's codes (B: 8 rows of 64 bytes, the layout [`ByteTiles`] keeps), giving `S_p` for every
/// token, plane and row in C. AMX instructions are written as inline assembly (their intrinsics
/// are not in stable Rust); nothing else in the process touches the tile registers.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod amx {
    use super::avx512::{block_scales, combine, prefetch_block, store};
    use super::*;
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Tokens per `tdpbsud`: three digit rows each, at most 16 rows in a tile.
    pub const MAX_TOKENS: usize = 5;

    /// Whether AMX-INT8 runs here: the CPU has it, Linux grants the process the tile state
    /// (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), the integer kernels are on and
    /// `MEGAGEMMA_AMX` is not `0`.
    pub fn available() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            if std::env::var("MEGAGEMMA_AMX").is_ok_and(|v| v == "0") || !enabled() {
                return false;
            }
            // CPUID.(EAX=7, ECX=0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
            let edx = __cpuid_count(7, 0).edx;
            if edx & (3 << 24) != 3 << 24 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // SAFETY: a plain system call; it only changes which register state the process may use.
            unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
        })
    }

    /// `ldtilecfg`'s 64-byte operand (palette 1).
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    /// Two sets: C in tmm0 / tmm3 (3·nt rows × 16 i32), A in tmm1 / tmm4 (3·nt rows × 32 bytes),
    /// B in tmm2 / tmm5 (8 × 64 bytes).
    unsafe fn configure(nt: usize) {
        let m = (3 * nt) as u8;
        let mut cfg = TileConfig { palette: 1, start_row: 0, reserved: [0; 14], colsb: [0; 16], rows: [0; 16] };
        for set in [0, 3] {
            (cfg.colsb[set], cfg.rows[set]) = (64, m);
            (cfg.colsb[set + 1], cfg.rows[set + 1]) = (BLOCK as u16, m);
            (cfg.colsb[set + 2], cfg.rows[set + 2]) = (64, (BLOCK / 4) as u8);
        }
        asm!("ldtilecfg [{0}]", in(reg) &cfg as *const TileConfig, options(nostack, readonly));
    }

    /// Every tile of `tiles` × vectors `t0 .. t0 + nt` (`nt ≤ MAX_TOKENS`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn tiles_times(
        w: &ByteTiles,
        tiles: std::ops::Range<usize>,
        x: &TileInputs,
        t0: usize,
        nt: usize,
        (start, n): (usize, usize),
        outs: &mut [f32],
    ) {
        #[repr(C, align(64))]
        struct Sums([[i32; 16]; 16]);
        let (cols, blocks) = (x.cols, x.cols / BLOCK);
        let mut c = [Sums([[0; 16]; 16]), Sums([[0; 16]; 16])];
        configure(nt);
        for tile in tiles {
            let tb = w.tile(tile);
            let mut acc = [_mm512_setzero_ps(); MAX_TOKENS];
            let a = |b: usize| x.digits.as_ptr().add(t0 * 3 * cols + BLOCK * b);
            let bp = |b: usize| tb.as_ptr().add(b * TILE_BLOCK_BYTES);
            // Two blocks per round (C in tmm0 and tmm3), so one block's products overlap the
            // other's store and reload; an odd last block runs alone.
            let mut b = 0;
            while b < blocks {
                prefetch_block(tb, b);
                if b + 1 < blocks {
                    prefetch_block(tb, b + 1);
                    asm!(
                        "tilezero tmm0",
                        "tilezero tmm3",
                        "tileloadd tmm1, [{a0} + {sa}*1]",
                        "tileloadd tmm2, [{b0} + {sb}*1]",
                        "tileloadd tmm4, [{a1} + {sa}*1]",
                        "tileloadd tmm5, [{b1} + {sb}*1]",
                        "tdpbsud tmm0, tmm1, tmm2",
                        "tdpbsud tmm3, tmm4, tmm5",
                        "tilestored [{c0} + {sb}*1], tmm0",
                        "tilestored [{c1} + {sb}*1], tmm3",
                        a0 = in(reg) a(b),
                        a1 = in(reg) a(b + 1),
                        sa = in(reg) cols,
                        b0 = in(reg) bp(b),
                        b1 = in(reg) bp(b + 1),
                        sb = in(reg) 64usize,
                        c0 = in(reg) c[0].0.as_mut_ptr(),
                        c1 = in(reg) c[1].0.as_mut_ptr(),
                        options(nostack),
                    );
                } else {
                    asm!(
                        "tilezero tmm0",
                        "tileloadd tmm1, [{a0} + {sa}*1]",
                        "tileloadd tmm2, [{b0} + {sb}*1]",
                        "tdpbsud tmm0, tmm1, tmm2",
                        "tilestored [{c0} + {sb}*1], tmm0",
                        a0 = in(reg) a(b),
                        sa = in(reg) cols,
                        b0 = in(reg) bp(b),
                        sb = in(reg) 64usize,
                        c0 = in(reg) c[0].0.as_mut_ptr(),
                        options(nostack),
                    );
                }
                for (i, c) in c.iter().enumerate().take((blocks - b).min(2)) {
                    let d = block_scales(tb, b + i);
                    for k in 0..nt {
                        let row = |p: usize| _mm512_load_si512(c.0[3 * k + p].as_ptr() as *const _);
                        acc[k] = combine(acc[k], [row(0), row(1), row(2)], d, x, (t0 + k) * blocks + b + i);
                    }
                }
                b += 2;
            }
            for k in 0..nt {
                store(acc[k], tile, t0 + k, start, n, outs);
            }
        }
        asm!("tilerelease", options(nostack, nomem));
    }
}

/// No AMX off Linux x86-64: the VNNI kernel runs every width.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod amx {
    pub const MAX_TOKENS: usize = 1;
    pub fn available() -> bool {
        false
    }
    pub(super) unsafe fn tiles_times(
        _: &super::ByteTiles,
        _: std::ops::Range<usize>,
        _: &super::TileInputs,
        _: usize,
        _: usize,
        _: (usize, usize),
        _: &mut [f32],
    ) {
        unreachable!()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formats with a tile layout.
    const TYPES: [GgmlType; 2] = [GgmlType::Q8_0, GgmlType::Q5_0];

    /// The kernel's arithmetic transcribed for one row and vector `ti`, block by block.
    fn reference(ty: GgmlType, row: &[u8], x: &TileInputs, ti: usize) -> f32 {
        let (blocks, block_bytes) = (x.cols / BLOCK, ty.type_size());
        let mut acc = 0f32;
        for b in 0..blocks {
            let blk = &row[b * block_bytes..(b + 1) * block_bytes];
            let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let codes = block_codes(ty, blk);
            let mut sum = 0i64;
            for v in 0..BLOCK {
                let digit = |p: usize| x.digits[(ti * 3 + p) * x.cols + BLOCK * b + v] as i64;
                let xq = 65536 * digit(0) + 256 * digit(1) + digit(2);
                sum += codes[v] as i64 * xq;
            }
            let sum = i32::try_from(sum).expect("a block's integer dot fits in i32");
            let s = x.scale[ti * blocks + b];
            acc = (sum as f32).mul_add(d * s, acc);
        }
        acc
    }

    /// Random rows of `ty` with sane f16 scales; the extreme codes appear (Q8_0's −128, Q5_0's
    /// −16 and 15).
    fn random_rows(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut bytes = super::super::idot::tests::random_rows(ty, rows, cols, seed);
        for (i, blk) in bytes.chunks_exact_mut(ty.type_size()).enumerate() {
            match ty {
                GgmlType::Q8_0 if i % 5 == 0 => blk[2 + i % 32] = 0x80,
                GgmlType::Q5_0 if i % 3 == 0 => {
                    blk[2..6].copy_from_slice(&0xffff_0000u32.to_le_bytes()); // values 16..32: u ≥ 16
                    blk[6] = 0x0f; // value 0: u = 15 → q = −1; value 16: u = 16 → q = 0
                    blk[7] = 0xf0; // value 1: u = 0 → q = −16; value 17: u = 31 → q = 15
                }
                _ => {}
            }
        }
        bytes
    }

    #[test]
    fn tiles_equal_their_scalar_transcription_and_the_exact_dot() {
        if !enabled() {
            assert!(TYPES.iter().all(|&ty| !supports(ty)));
            eprintln!(
                "integer kernels off (no AVX-512 VNNI, or MEGAGEMMA_INT_DOT=0): Q8_0 and Q5_0 keep the f32 kernel"
            );
            return;
        }
        eprintln!("byte tiles: several tokens on {}", if amx::available() { "AMX" } else { "VNNI" });
        for ty in TYPES {
            // 37 rows (two whole tiles and a partial third), 11 vectors (tiles of 4, then 3; and
            // each alone), 640 values; one vector has an outlier at both extremes of its block,
            // one a zero block.
            let (rows, cols, t) = (37, 640, 11);
            let rb = ty.row_bytes(cols).unwrap();
            let data = random_rows(ty, rows, cols, 5);
            let w = ByteTiles::from_rows(ty, &data, rows, rb);
            let mut xs: Vec<f32> = (0..t * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            xs[cols + 5] = 900.0;
            xs[cols + 6] = -900.0;
            xs[2 * cols..2 * cols + 32].fill(0.0);
            let x = TileInputs::quantize(&xs, cols, ty);
            let mut outs = vec![0f32; t * rows];
            dot_rows(&w, 0, &x, &mut outs);
            // Several tokens on AMX (where it runs) and on VNNI give the same bits.
            let mut vnni = vec![0f32; t * rows];
            dot_rows_on(&w, 0, &x, &mut vnni, false);
            assert!(outs.iter().zip(&vnni).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty}: AMX and VNNI differ");
            for ti in 0..t {
                let one = TileInputs::quantize(&xs[ti * cols..(ti + 1) * cols], cols, ty);
                let mut single = vec![0f32; rows];
                dot_rows(&w, 0, &one, &mut single);
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
                    let mut wr = vec![0f32; cols];
                    crate::gguf::dequantize_row(ty, row, &mut wr).unwrap();
                    let exact: f64 = wr.iter().zip(xv).map(|(w, x)| *w as f64 * *x as f64).sum();
                    let scale: f64 = wr.iter().zip(xv).map(|(w, x)| (*w as f64 * *x as f64).abs()).sum();
                    assert!(
                        (got as f64 - exact).abs() <= 4e-6 * scale,
                        "{ty} row {r} vector {ti}: {got} vs exact {exact}"
                    );
                }
            }
            // Rows from the middle, across a tile boundary (a partial tile on each side).
            let mut part = vec![0f32; t * 9];
            dot_rows(&w, 12, &x, &mut part);
            for ti in 0..t {
                for r in 0..9 {
                    let (got, want) = (part[ti * 9 + r], outs[ti * rows + 12 + r]);
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} row {} vector {ti}", 12 + r);
                }
            }
        }
    }

    /// The widest inputs against the largest codes: the block sums that bound `q_max` stay exact.
    #[test]
    fn extreme_codes_against_full_scale_inputs_stay_exact() {
        if !enabled() {
            return;
        }
        for ty in TYPES {
            let cols = 64;
            let mut data = random_rows(ty, 1, cols, 11);
            // Every code at the format's most negative value (Q8_0 −128, Q5_0 −16).
            for blk in data.chunks_exact_mut(ty.type_size()) {
                match ty {
                    GgmlType::Q8_0 => blk[2..].fill(0x80),
                    _ => blk[2..].fill(0),
                }
            }
            let w = ByteTiles::from_rows(ty, &data, 1, data.len());
            for sign in [1.0f32, -1.0] {
                let xs = vec![sign * 3.5; cols];
                let x = TileInputs::quantize(&xs, cols, ty);
                let mut out = [0f32; 1];
                dot_rows(&w, 0, &x, &mut out);
                let mut wr = vec![0f32; cols];
                crate::gguf::dequantize_row(ty, &data, &mut wr).unwrap();
                let exact: f64 = wr.iter().zip(&xs).map(|(w, x)| *w as f64 * *x as f64).sum();
                assert!((out[0] as f64 - exact).abs() <= 1e-6 * exact.abs(), "{ty} sign {sign}: {} vs {exact}", out[0]);
            }
        }
    }

    #[test]
    fn vectors_across_token_blocks_equal_lone_vectors() {
        if !enabled() {
            return; // the kernel cannot run here (checked by the test above)
        }
        for ty in TYPES {
            let (rows, cols, t) = (20, 64, TOKEN_BLOCK + 6);
            let rb = ty.row_bytes(cols).unwrap();
            let data = random_rows(ty, rows, cols, 9);
            let w = ByteTiles::from_rows(ty, &data, rows, rb);
            let xs: Vec<f32> = (0..t * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0).collect();
            let x = TileInputs::quantize(&xs, cols, ty);
            let mut outs = vec![0f32; t * rows];
            dot_rows(&w, 0, &x, &mut outs);
            for ti in [0, 3, TOKEN_BLOCK - 1, TOKEN_BLOCK, t - 2, t - 1] {
                let one = TileInputs::quantize(&xs[ti * cols..(ti + 1) * cols], cols, ty);
                let mut single = vec![0f32; rows];
                dot_rows(&w, 0, &one, &mut single);
                for r in 0..rows {
                    assert_eq!(outs[ti * rows + r].to_bits(), single[r].to_bits(), "{ty} row {r} vector {ti} of {t}");
                }
            }
        }
    }

    #[test]
    fn non_finite_inputs_reach_the_result() {
        if !enabled() {
            return;
        }
        for ty in TYPES {
            let data = random_rows(ty, 1, 64, 3);
            let w = ByteTiles::from_rows(ty, &data, 1, data.len());
            let mut xs = vec![0.5f32; 64];
            xs[40] = f32::INFINITY;
            let x = TileInputs::quantize(&xs, 64, ty);
            let mut out = [0f32; 1];
            dot_rows(&w, 0, &x, &mut out);
            assert!(out[0].is_nan(), "{ty}");
        }
    }
}
