//! GGUF Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, Q4_K, Q5_K and Q6_K matrices as integer dot products over 16 rows at once
//! (AVX-512 VNNI).
//!
//! These weights are small integers times a float per 16 or 32 values: `d·q` (Q8_0, `q` a signed byte),
//! `d·(u − 16)` (Q5_0), `d·(u − 8)` (Q4_0), `d·u + m` (Q4_1, Q5_1), `d·sc·q − dmin·m` (Q4_K, Q5_K, per 32 values of
//! a 256-value super-block), `d·sc·(u − 32)` (Q6_K, per 16 values). The f32 kernels spend one fused multiply-add
//! per weight and vector, so a verify pass (Gemma 3 270M: four tokens, the 262,144 × 640 Q8_0 LM head 72% of the
//! bytes) ran at the FMA units' limit. Here each matrix is re-laid once (when a CPU backend opens,
//! [`crate::matrix::RowDot::prepare_cpu_layout`], or on first use) in *tiles* of 16 rows: per tile and 32-value
//! block, 512 unsigned codes `u = q + offset` in the order `vpdpbusd` reads them against one broadcast activation
//! word — step `i` (values `4i .. 4i + 4`), row `r`, byte `e` at `64·i + 4·r + e` — then the 16 rows' scales: f16
//! `d` for Q8_0, Q5_0 and Q4_0, f32 `d·sc` per 16-value half for Q6_K, f32 scales and minimums for the others. Q8_0
//! codes are stored as bytes (`offset` 128: 544 bytes a block, as the 16 Q8_0 blocks); the others packed
//! (`pack_codes`: nibbles, plus a bit mask per step for each bit above the fourth) and unpacked a step at a time
//! (an and or a shift, one masked add per higher bit): Q5_0 and Q4_0 take the bytes of the blocks they come from,
//! Q4_K 1.33×, Q6_K 1.21×. One `vpdpbusd` adds four products to each of the 16 rows: no byte permutes, no
//! horizontal sums. (An earlier lane layout, one row at a time with its bytes permuted into 16 lanes and the lanes
//! summed at the end, measured 3–4× slower a token for Q5_0, Q4_K and Q6_K; codes as bytes, 1.2–1.5× more bytes
//! than packed, made one token's pass 10–20% slower.)
//!
//! Activations, per token and 32-value block: `x ≈ s·x_q`, `s = amax / Q`, with `Q = 2^19 − 1` against Q8_0 codes,
//! `2^21 − 1` against 5-bit unsigned ones and `2^22 − 1` against the others' (error at most `s/2`: ≈9.5e-7, ≈2.4e-7
//! and ≈1.2e-7 of the block's largest value), `x_q` as three signed bytes (balanced base-256 digits
//! `x_q = 65536·h + 256·m + l`, `l, m ∈ [−128, 127]`, `|h| ≤ 64`), and `Σ x_q` per 16 values. Per block (Q6_K: per
//! half) and row, three `vpdpbusd` chains give `S_p = Σ u·digit_p`, and
//! `Σ q·x_q = 65536·S_h + 256·S_m + S_l − offset·Σ x_q` in wrapping 32-bit arithmetic (exact: the true value fits
//! in i32 — `q_max`); then `acc = fma(f32(Σ q·x_q), d·s, acc)`, and with a minimum `acc −= (dmin·m·s)·f32(Σ x_q)`
//! (fused). Every step is per token, so a column of a multi-token call is bit-identical to a one-token call. With
//! two tokens or more, on CPUs with AMX (and `MEGAGEMMA_AMX` not `0`), one `tdpbsud` per tile and block computes
//! the same `S_p` of Q8_0 tiles for up to five tokens at once (the digit rows of the tokens' three planes against
//! the tile's codes, exactly the layout above): integer sums are exact in any order, so the results are the same
//! bits; the `tests` check the kernel against a scalar transcription of the same arithmetic, bit for bit, and against
//! an f64 dot product.

#![allow(clippy::missing_safety_doc)]
// Indexed loops over fixed-size register arrays unroll into straight-line code.
#![allow(clippy::needless_range_loop)]

use super::blocks::GgmlType;
use rayon::prelude::*;
use std::sync::OnceLock;

/// Rows per tile: the 16 i32 lanes of one `vpdpbusd`.
pub const TILE_ROWS: usize = 16;
/// Values per tile block (and per activation scale).
pub const BLOCK: usize = 32;
/// One tile block's codes as bytes: 16 rows × 32 values.
const CODE_BYTES: usize = TILE_ROWS * BLOCK;

/// How a tile block's 16 rows are scaled (`u8` constants: the kernels are generic over them).
/// [`F16`]: one f16 `d` per row (Q8_0, Q5_0, Q4_0: `w = d·q`), 16 × 2 bytes after the codes.
const F16: u8 = 0;
/// [`HALVES`]: one f32 `d·sc` per row and 16-value half (Q6_K: `w = (d·sc)·q`), the first
/// halves' 16 then the second halves'.
const HALVES: u8 = 1;
/// [`MIN`]: one f32 `d·sc` and one f32 `dmin·m` per row (Q4_K, Q5_K: `w = (d·sc)·q − dmin·m`;
/// Q4_1, Q5_1: `w = d·q + m`, so `dmin·m` is `−m`), the 16 scales then the 16 minimums.
const MIN: u8 = 2;

/// How `ty`'s codes are tiled: its scale kind, the bits a code keeps (8: bytes `q + 128`; 4 to
/// 6: packed, see `pack_codes`) and the unsigned offset of a stored code (`u = q + offset`).
fn layout(ty: GgmlType) -> Option<(u8, u8, i32)> {
    Some(match ty {
        GgmlType::Q8_0 => (F16, 8, 128),
        GgmlType::Q5_0 => (F16, 5, 16),
        GgmlType::Q4_0 => (F16, 4, 8),
        GgmlType::Q6_K => (HALVES, 6, 32),
        GgmlType::Q4_K | GgmlType::Q4_1 => (MIN, 4, 0),
        GgmlType::Q5_K | GgmlType::Q5_1 => (MIN, 5, 0),
        _ => return None,
    })
}

/// Bytes of one tile block's codes: 512 bytes, or packed 256 bytes of nibbles plus a 64-byte
/// mask per bit above the fourth.
fn code_bytes(bits: u8) -> usize {
    if bits == 8 {
        CODE_BYTES
    } else {
        CODE_BYTES / 2 + 64 * (bits as usize - 4)
    }
}

/// Bytes of one tile block: its codes, then 16 f16 scales or 2 × 16 f32.
fn block_bytes(kind: u8, bits: u8) -> usize {
    code_bytes(bits) + if kind == F16 { 2 * TILE_ROWS } else { 8 * TILE_ROWS }
}

/// Pack a tile block's 512 unsigned codes (`u < 2^bits`, in `vpdpbusd` order: 8 steps of 64)
/// into `out`: byte `b` of nibble vector `j` (0..4) holds step `j`'s code `b` in its low half
/// and step `j + 4`'s in its high half; then, per bit `4 + p` above the nibble, 8 little-endian
/// u64 masks, one per step (bit `b`: that bit of the step's code `b`).
fn pack_codes(codes: &[u8; CODE_BYTES], bits: u8, out: &mut [u8]) {
    for j in 0..4 {
        for b in 0..64 {
            out[64 * j + b] = (codes[64 * j + b] & 0xf) | (codes[64 * (j + 4) + b] & 0xf) << 4;
        }
    }
    for p in 0..(bits as usize - 4) {
        for i in 0..8 {
            let mask = (0..64).fold(0u64, |m, b| m | (((codes[64 * i + b] >> (4 + p)) & 1) as u64) << b);
            out[CODE_BYTES / 2 + 64 * p + 8 * i..][..8].copy_from_slice(&mask.to_le_bytes());
        }
    }
}

/// The largest quantized activation magnitude against codes of `ty`: the largest power of two
/// less one that keeps the integer sum between two scales within i32 (Q8_0: 32 values of
/// `|q| ≤ 128`; Q5_1, Q5_K: 32 of `q ≤ 31`; Q4_0, Q4_1, Q5_0, Q4_K: 32 of `|q| ≤ 16`; Q6_K:
/// 16 of `|q| ≤ 32`).
fn q_max(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q8_0 => 524_287.0,
        GgmlType::Q5_1 | GgmlType::Q5_K => 2_097_151.0,
        _ => 4_194_303.0,
    }
}
/// Tokens whose digits stay in L2 while a call's tiles are multiplied with them.
const TOKEN_BLOCK: usize = 128;
/// Vectors quantized per parallel task.
const QUANT_TASK: usize = 8;

/// Bytes ahead of the block being multiplied that a tile walk prefetches (about 7.5 tile
/// blocks; 1 to 16 KiB and the T1/T2 hints measured alike on the 2-core Xeon VM).
const PREFETCH_AHEAD: usize = 4096;

/// Whether the tile kernels run on this machine: AVX-512 with VNNI (and the byte/word forms and
/// F16C), unless `MEGAGEMMA_INT_DOT=0` turns them off.
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
                && is_x86_feature_detected!("f16c")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Adding and subtracting 1.5·2^23 rounds an f32 below 2^22 to an integer, half to even.
const ROUNDER: f32 = 12_582_912.0;

/// A GGUF matrix re-laid in tiles of 16 rows (see the module documentation). Rows past the
/// matrix in the last tile are zero (codes 128, scales 0).
pub struct ByteTiles {
    /// The format the codes came from (it bounds them, and so the inputs' width).
    ty: GgmlType,
    /// [`F16`], [`HALVES`] or [`MIN`].
    kind: u8,
    /// Bits a stored code keeps (8, or 4 to 6 packed) and the offset added to make it unsigned.
    bits: u8,
    offset: i32,
    rows: usize,
    blocks: usize,
    /// Bytes of one tile block: the codes, then the scales.
    block_bytes: usize,
    /// `[tile][block]` of `block_bytes`.
    data: TileBytes,
}

impl ByteTiles {
    /// Re-lay `rows` rows of `ty` (see [`supports`]) of `row_bytes` bytes each: per 32-value
    /// block and row the signed codes (`decode_block`) and the scales of its kind (`bytes`: the
    /// rows, contiguous).
    pub fn from_rows(ty: GgmlType, bytes: &[u8], rows: usize, row_bytes: usize) -> ByteTiles {
        assert!(row_bytes.is_multiple_of(ty.type_size()), "{ty} rows of {row_bytes} bytes are not whole blocks");
        assert_eq!(bytes.len(), rows * row_bytes, "{ty} matrix: {} bytes for {rows} rows", bytes.len());
        let blocks = row_bytes / ty.type_size() * ty.block_size() / BLOCK;
        Self::from_blocks(ty, rows, blocks, |row, b| decode_block(ty, &bytes[row * row_bytes..][..row_bytes], b))
    }

    /// Re-lay a 4-bit affine matrix (`w = scale·q + bias`, q in 0..16, MLX nibble order: weight
    /// `j` of a row is nibble `j % 8` of word `j / 8`; see [`crate::quant::QuantMatrix`]) as the
    /// tiles of `Q4_1`, whose blocks are the same arithmetic (`w = d·q + m`) with `[d, m]` per 32
    /// values: here the scale and bias of the group the block lies in, f32 as they are.
    pub fn from_affine(
        packed: &[u32],
        scales: &[f32],
        biases: &[f32],
        rows: usize,
        cols: usize,
        group: usize,
    ) -> ByteTiles {
        assert!(cols.is_multiple_of(BLOCK) && group.is_multiple_of(BLOCK), "affine tiles: cols {cols}, group {group}");
        assert_eq!(packed.len(), rows * cols / 8, "affine tiles: {} words for [{rows}, {cols}]", packed.len());
        assert_eq!(scales.len(), rows * cols / group, "affine tiles: {} scales", scales.len());
        assert_eq!(biases.len(), scales.len(), "affine tiles: {} biases", biases.len());
        let (words, groups, blocks) = (cols / 8, cols / group, cols / BLOCK);
        // Straight from the words, no per-value decode: in a packed tile block, row `r`'s four
        // bytes at `64·j + 4·r` hold values `4j .. 4j + 4` in their low nibbles and `16 + 4j ..`
        // in their high ones (`pack_codes`), and a block's four MLX words hold values 0..8,
        // 8..16, 16..24 and 24..32 as nibbles, least significant first. Q4_1's offset is 0.
        let (kind, bits, _) = layout(GgmlType::Q4_1).unwrap();
        let (block_bytes, code_bytes) = (block_bytes(kind, bits), code_bytes(bits));
        let tile_bytes = blocks * block_bytes;
        let mut data = TileBytes::zeroed(rows.div_ceil(TILE_ROWS) * tile_bytes);
        /// Four nibbles (the low 16 bits) into the low halves of four bytes.
        fn spread(x: u32) -> u32 {
            let x = x & 0xffff;
            let x = (x | x << 8) & 0x00ff_00ff;
            (x | x << 4) & 0x0f0f_0f0f
        }
        fill_tiles(&mut data, tile_bytes, |tile, out| {
            for r in 0..TILE_ROWS.min(rows - tile * TILE_ROWS) {
                let row = tile * TILE_ROWS + r;
                for (b, tb) in out.chunks_exact_mut(block_bytes).enumerate() {
                    let w = &packed[row * words + b * BLOCK / 8..][..BLOCK / 8];
                    let (codes, scale_bytes) = tb.split_at_mut(code_bytes);
                    for j in 0..4 {
                        let shift = 16 * (j % 2);
                        let byte4 = spread(w[j / 2] >> shift) | spread(w[2 + j / 2] >> shift) << 4;
                        codes[64 * j + 4 * r..][..4].copy_from_slice(&byte4.to_le_bytes());
                    }
                    let g = row * groups + b * BLOCK / group;
                    scale_bytes[4 * r..][..4].copy_from_slice(&scales[g].to_le_bytes());
                    scale_bytes[64 + 4 * r..][..4].copy_from_slice(&(-biases[g]).to_le_bytes());
                }
            }
        });
        ByteTiles { ty: GgmlType::Q4_1, kind, bits, offset: 0, rows, blocks, block_bytes, data }
    }

    /// The tiles of `rows` rows of `blocks` 32-value blocks, block `b` of row `row` given by
    /// `block(row, b)` as `decode_block` gives it for `ty`.
    fn from_blocks(
        ty: GgmlType,
        rows: usize,
        blocks: usize,
        block: impl Fn(usize, usize) -> ([i8; BLOCK], [f32; 2]) + Sync,
    ) -> ByteTiles {
        let Some((kind, bits, offset)) = layout(ty) else { panic!("byte tiles: no tile layout for {ty}") };
        let (block_bytes, code_bytes) = (block_bytes(kind, bits), code_bytes(bits));
        let tiles = rows.div_ceil(TILE_ROWS);
        let tile_bytes = blocks * block_bytes;
        let mut data = TileBytes::zeroed(tiles * tile_bytes);
        fill_tiles(&mut data, tile_bytes, |tile, out| {
            for (b, tb) in out.chunks_exact_mut(block_bytes).enumerate() {
                let (packed, scales) = tb.split_at_mut(code_bytes);
                // Rows past the matrix: code 0 (q = −offset) with scale 0.
                let mut codes = [0u8; CODE_BYTES];
                for r in 0..TILE_ROWS {
                    let row = tile * TILE_ROWS + r;
                    if row >= rows {
                        break;
                    }
                    let (q, [a, b2]) = block(row, b);
                    for (v, q) in q.into_iter().enumerate() {
                        codes[64 * (v / 4) + 4 * r + v % 4] = (q as i32 + offset) as u8;
                    }
                    if kind == F16 {
                        // The f16 `d` came through f32 exactly and goes back exactly.
                        scales[2 * r..2 * r + 2].copy_from_slice(&half::f16::from_f32(a).to_le_bytes());
                    } else {
                        scales[4 * r..4 * r + 4].copy_from_slice(&a.to_le_bytes());
                        scales[64 + 4 * r..64 + 4 * r + 4].copy_from_slice(&b2.to_le_bytes());
                    }
                }
                if bits == 8 {
                    packed.copy_from_slice(&codes);
                } else {
                    pack_codes(&codes, bits, packed);
                }
            }
        });
        ByteTiles { ty, kind, bits, offset, rows, blocks, block_bytes, data }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Block `b` of row `row` as the builder was given it: the signed codes and the two scales
    /// (`decode_block`'s, or [`ByteTiles::from_affine`]'s `[scale, −bias]`), read back from the
    /// tiles exactly. Lets a matrix kept only as tiles still give its rows and its other layouts.
    pub fn block_of_row(&self, row: usize, b: usize) -> ([i8; BLOCK], [f32; 2]) {
        assert!(row < self.rows && b < self.blocks, "byte tiles: block {b} of row {row} out of range");
        let (tile, r) = (row / TILE_ROWS, row % TILE_ROWS);
        let (codes, scales) =
            self.tile(tile)[b * self.block_bytes..][..self.block_bytes].split_at(code_bytes(self.bits));
        let q = std::array::from_fn(|v| {
            // Step `i` holds values 4i .. 4i + 4; the row's byte in it is `at`.
            let (i, at) = (v / 4, 4 * r + v % 4);
            let u = if self.bits == 8 {
                codes[64 * i + at] as i32
            } else {
                let mut u = ((codes[64 * (i % 4) + at] >> (4 * (i / 4))) & 0xf) as i32;
                for p in 0..self.bits as usize - 4 {
                    let mask = u64::from_le_bytes(codes[CODE_BYTES / 2 + 64 * p + 8 * i..][..8].try_into().unwrap());
                    u |= (((mask >> at) & 1) as i32) << (4 + p);
                }
                u
            };
            (u - self.offset) as i8
        });
        let f32_at = |k: usize| f32::from_le_bytes(scales[4 * k..4 * k + 4].try_into().unwrap());
        let s = match self.kind {
            F16 => [half::f16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]).to_f32(), 0.0],
            _ => [f32_at(r), f32_at(TILE_ROWS + r)],
        };
        (q, s)
    }

    /// Bytes the tiles occupy.
    pub fn memory_bytes(&self) -> usize {
        self.data.len()
    }

    fn tile(&self, t: usize) -> &[u8] {
        let tb = self.blocks * self.block_bytes;
        &self.data[t * tb..(t + 1) * tb]
    }
}

/// `fill(tile, bytes)` for every tile of `data`: in parallel, or one after another when this
/// thread is already one of rayon's workers. Layouts are built on first use under a `OnceLock`,
/// possibly inside a parallel product over the same matrix; a worker that waited there for a
/// parallel build would take up other tasks meanwhile, one of them that product's next, which
/// waits on the same `OnceLock` on the same thread: a deadlock (seen on a 16-core machine).
fn fill_tiles(data: &mut [u8], tile_bytes: usize, fill: impl Fn(usize, &mut [u8]) + Sync + Send) {
    if rayon::current_thread_index().is_some() {
        data.chunks_mut(tile_bytes).enumerate().for_each(|(t, out)| fill(t, out));
    } else {
        data.par_chunks_mut(tile_bytes).enumerate().for_each(|(t, out)| fill(t, out));
    }
}

/// The tiles' bytes: zeroed anonymous memory asked to live on transparent huge pages (Linux
/// `MADV_HUGEPAGE`; `MEGAGEMMA_HUGE_PAGES=0` does not ask), so that streaming a large matrix every
/// token (Gemma 3 270M's 262,144-row head is 178 MB) walks 2 MiB pages instead of 4 KiB ones:
/// that head's product took 5% less time for one token and 9% less for four on the Zen 4 VM
/// (thirty-seventh session). Where huge pages are not offered it is ordinary zeroed memory.
struct TileBytes {
    map: memmap2::MmapMut,
    len: usize,
}

impl TileBytes {
    fn zeroed(len: usize) -> TileBytes {
        // A zero-length anonymous map is an error; one page costs nothing.
        let map = memmap2::MmapMut::map_anon(len.max(1))
            .unwrap_or_else(|e| panic!("cannot map {len} bytes for a weight layout: {e}"));
        #[cfg(target_os = "linux")]
        if std::env::var("MEGAGEMMA_HUGE_PAGES").map_or(true, |v| v != "0") {
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        TileBytes { map, len }
    }
}

impl std::ops::Deref for TileBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl std::ops::DerefMut for TileBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

/// Value `v` (0..32) of a block's 16 nibble bytes: the low nibbles hold values 0..16, the high
/// ones 16..32.
fn nibble(qs: &[u8], v: usize) -> u8 {
    if v < 16 {
        qs[v] & 0xf
    } else {
        qs[v - 16] >> 4
    }
}

/// 32-value block `b` of a row of `ty`, from the format's description (ggml's `block_*`
/// structs): its signed codes `q` and two scales — Q8_0 / Q5_0 / Q4_0 `[d, 0]` (`w = d·q`), Q6_K
/// the two 16-value halves' `[d·sc₀, d·sc₁]`, Q4_K / Q5_K `[d·sc, dmin·m]` (`w = d·sc·q −
/// dmin·m`), Q4_1 / Q5_1 `[d, −m]`. The products are exact in f32 (an f16 times a 6- or 8-bit
/// integer).
fn decode_block(ty: GgmlType, row: &[u8], b: usize) -> ([i8; BLOCK], [f32; 2]) {
    let f16 = |p: &[u8]| half::f16::from_le_bytes([p[0], p[1]]).to_f32();
    match ty {
        GgmlType::Q8_0 => {
            let blk = &row[34 * b..34 * (b + 1)];
            (std::array::from_fn(|v| blk[2 + v] as i8), [f16(blk), 0.0])
        }
        GgmlType::Q5_0 => {
            let blk = &row[22 * b..22 * (b + 1)];
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            let q = std::array::from_fn(|v| ((nibble(&blk[6..], v) as u32 | ((qh >> v) & 1) << 4) as i32 - 16) as i8);
            (q, [f16(blk), 0.0])
        }
        GgmlType::Q4_0 => {
            let blk = &row[18 * b..18 * (b + 1)];
            let q = std::array::from_fn(|v| (nibble(&blk[2..], v) as i32 - 8) as i8);
            (q, [f16(blk), 0.0])
        }
        GgmlType::Q4_1 | GgmlType::Q5_1 => {
            // d, m, (Q5_1: 32 fifth bits), 16 bytes of nibbles; `w = d·u + m`.
            let five = ty == GgmlType::Q5_1;
            let size = if five { 24 } else { 20 };
            let blk = &row[size * b..size * (b + 1)];
            let qh = if five { u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]) } else { 0 };
            let q = std::array::from_fn(|v| (nibble(&blk[size - 16..], v) as u32 | ((qh >> v) & 1) << 4) as i8);
            (q, [f16(blk), -f16(&blk[2..])])
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            // 256-value super-blocks: d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32
            // bytes whose bit j is the fifth bit of sub-block j's values,) then 4 × 32 bytes of
            // nibbles (low nibbles: values 64c .. 64c + 32, high: the next 32).
            let five = ty == GgmlType::Q5_K;
            let size = if five { 176 } else { 144 };
            let (sb, j) = (&row[size * (b / 8)..size * (b / 8 + 1)], b % 8);
            let (sc, mn) = super::blocks::k4_scales_mins(sb[4..16].try_into().unwrap());
            let (qs, c, high) = (&sb[size - 128..], j / 2, j % 2 == 1);
            let q = std::array::from_fn(|v| {
                let byte = qs[32 * c + v];
                let fifth = if five { ((sb[16 + v] >> j) & 1) << 4 } else { 0 };
                ((if high { byte >> 4 } else { byte & 0xf }) | fifth) as i8
            });
            (q, [f16(sb) * sc[j] as f32, f16(&sb[2..]) * mn[j] as f32])
        }
        GgmlType::Q6_K => {
            // 256-value super-blocks: 128 bytes of low nibbles, 64 of high 2-bit pairs (two
            // 128-value halves, decoded by the dequantizer's `q6k_half`), 16 signed scales (one
            // per 16 values), d.
            let (sb, j) = (&row[210 * (b / 8)..210 * (b / 8 + 1)], b % 8);
            let h = j / 4;
            let half = super::blocks::q6k_half(
                sb[64 * h..64 * h + 64].try_into().unwrap(),
                sb[128 + 32 * h..128 + 32 * h + 32].try_into().unwrap(),
            );
            let q = std::array::from_fn(|l| half[32 * (j % 4) + l]);
            let d = f16(&sb[208..]);
            (q, [d * (sb[192 + 2 * j] as i8) as f32, d * (sb[193 + 2 * j] as i8) as f32])
        }
        _ => panic!("byte tiles: no tile layout for {ty}"),
    }
}

/// `T` activation vectors quantized for [`ByteTiles`] (see the module documentation).
pub struct TileInputs {
    /// The format of the tiles these inputs are for (`q_max`).
    ty: GgmlType,
    t: usize,
    cols: usize,
    /// `[t][plane][cols]`: the high, middle and low signed digits of `x_q`.
    digits: Vec<i8>,
    /// `[t][block]`: the block's scale `s` (NaN when the block holds a non-finite value).
    scale: Vec<f32>,
    /// `[t][2·block]`: `Σ x_q` over each 16-value half of a block.
    sums: Vec<i32>,
}

impl TileInputs {
    /// Quantize `xs` (`[T, cols]`, `cols` a multiple of 32) for tiles of `ty`.
    pub fn quantize(xs: &[f32], cols: usize, ty: GgmlType) -> TileInputs {
        assert!(layout(ty).is_some(), "no byte tiles for {ty}");
        assert!(cols > 0 && cols.is_multiple_of(BLOCK), "byte tiles: {cols} values per vector is not whole blocks");
        assert_eq!(xs.len() % cols, 0, "byte tiles: input is not [T, {cols}]");
        assert!(enabled(), "byte tile inputs prepared on a CPU without AVX-512 VNNI");
        let (t, blocks) = (xs.len() / cols, cols / BLOCK);
        let mut digits = vec![0i8; t * 3 * cols];
        let mut scale = vec![0f32; t * blocks];
        let mut sums = vec![0i32; t * 2 * blocks];
        let work = |((d, s), c): ((&mut [i8], &mut [f32]), &mut [i32]), xs: &[f32]| {
            for (k, x) in xs.chunks_exact(cols).enumerate() {
                let (d, s, c) = (
                    &mut d[k * 3 * cols..][..3 * cols],
                    &mut s[k * blocks..][..blocks],
                    &mut c[k * 2 * blocks..][..2 * blocks],
                );
                // SAFETY: `enabled()` (checked above) includes the kernel's CPU features.
                unsafe { avx512::quantize_one(x, q_max(ty), d, s, c) };
            }
        };
        if t <= QUANT_TASK {
            work(((&mut digits[..], &mut scale[..]), &mut sums[..]), xs);
        } else {
            digits
                .par_chunks_mut(3 * cols * QUANT_TASK)
                .zip(scale.par_chunks_mut(blocks * QUANT_TASK))
                .zip(sums.par_chunks_mut(2 * blocks * QUANT_TASK))
                .zip(xs.par_chunks(cols * QUANT_TASK))
                .for_each(|(bufs, xs)| work(bufs, xs));
        }
        TileInputs { ty, t, cols, digits, scale, sums }
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
    layout(ty).is_some() && enabled()
}

/// `outs[t][i] = dot(row(start + i), x[t])` for `n = outs[t].len()` consecutive rows (the same
/// `n` for every vector).
pub fn dot_rows(w: &ByteTiles, start: usize, x: &TileInputs, outs: &mut [&mut [f32]]) {
    dot_rows_on(w, start, x, outs, amx::available())
}

/// [`dot_rows`], with several tokens on AMX when `use_amx` (and it is [`amx::available`]).
fn dot_rows_on(w: &ByteTiles, start: usize, x: &TileInputs, outs: &mut [&mut [f32]], use_amx: bool) {
    assert!(enabled(), "byte tiles on a CPU without AVX-512 VNNI");
    assert_eq!(x.ty, w.ty, "byte tiles: inputs for {} tiles against {} tiles", x.ty, w.ty);
    assert!(x.t > 0, "byte tiles: no vectors");
    assert_eq!(x.cols, w.blocks * BLOCK, "byte tiles: vectors of {} values, rows of {}", x.cols, w.blocks * BLOCK);
    let n = crate::matrix::rows_per_output(outs, x.t, start, w.rows, "byte tiles");
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

    /// One tile × vectors `t0 .. t0 + N`: per vector, the 16 rows' dots. `K` is the tile's
    /// scale kind; a [`HALVES`] block is two 16-value halves (steps 0–3 and 4–7), each summed and
    /// scaled alone.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_dots<const N: usize, const K: u8, const BITS: u8>(
        tile: &[u8],
        (block_bytes, offset): (usize, i32),
        x: &TileInputs,
        t0: usize,
    ) -> [__m512; N] {
        let cols = x.cols;
        let blocks = cols / BLOCK;
        let halves = if K == HALVES { 2 } else { 1 };
        let steps = BLOCK / 4 / halves;
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..blocks {
            let blk = tile.as_ptr().add(b * block_bytes);
            prefetch_block(blk, block_bytes);
            for h in 0..halves {
                let z = _mm512_setzero_si512();
                let mut s = [[z; 3]; N];
                for i in h * steps..(h + 1) * steps {
                    let w = step_codes::<BITS>(blk, i);
                    for n in 0..N {
                        let at = x.digits.as_ptr().add((t0 + n) * 3 * cols + BLOCK * b + 4 * i);
                        let word = |p: usize| _mm512_set1_epi32((at.add(p * cols) as *const i32).read_unaligned());
                        s[n][0] = _mm512_dpbusd_epi32(s[n][0], w, word(0));
                        s[n][1] = _mm512_dpbusd_epi32(s[n][1], w, word(1));
                        s[n][2] = _mm512_dpbusd_epi32(s[n][2], w, word(2));
                    }
                }
                let scales = blk.add(code_bytes(BITS));
                let d = if K == F16 {
                    _mm512_cvtph_ps(_mm256_loadu_si256(scales as *const _))
                } else {
                    _mm512_loadu_ps(scales.add(64 * h) as *const f32)
                };
                for n in 0..N {
                    let v = (t0 + n) * blocks + b;
                    let scale = *x.scale.get_unchecked(v);
                    let xsum = if K == HALVES {
                        *x.sums.get_unchecked(2 * v + h)
                    } else {
                        x.sums.get_unchecked(2 * v).wrapping_add(*x.sums.get_unchecked(2 * v + 1))
                    };
                    acc[n] = combine(acc[n], s[n], d, scale, xsum.wrapping_mul(offset));
                    if K == MIN {
                        // − (dmin·m)·s·Σx_q
                        let m = _mm512_mul_ps(_mm512_loadu_ps(scales.add(64) as *const f32), _mm512_set1_ps(scale));
                        acc[n] = _mm512_fnmadd_ps(m, _mm512_set1_ps(xsum as f32), acc[n]);
                    }
                }
            }
        }
        acc
    }

    /// Step `i`'s 64 unsigned codes of the tile block at `blk`, unpacked when `BITS < 8`
    /// (`pack_codes`: a nibble, then a masked add per higher bit).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    unsafe fn step_codes<const BITS: u8>(blk: *const u8, i: usize) -> __m512i {
        if BITS == 8 {
            return _mm512_loadu_si512(blk.add(64 * i) as *const _);
        }
        let v = _mm512_loadu_si512(blk.add(64 * (i % 4)) as *const _);
        let v = if i < 4 { v } else { _mm512_srli_epi16::<4>(v) };
        let mut c = _mm512_and_si512(v, _mm512_set1_epi8(0x0f));
        for p in 0..(BITS as usize).saturating_sub(4) {
            let mask = (blk.add(CODE_BYTES / 2 + 64 * p + 8 * i) as *const u64).read_unaligned();
            c = _mm512_mask_add_epi8(c, mask, c, _mm512_set1_epi8(16 << p));
        }
        c
    }

    /// Write tile `tile`'s 16 dots of vector `ti` into `outs[ti]` (rows `start .. start + n`),
    /// keeping only the rows in range.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn store(dots: __m512, tile: usize, ti: usize, start: usize, n: usize, outs: &mut [&mut [f32]]) {
        let row0 = tile * TILE_ROWS;
        let out = &mut *outs[ti];
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

    /// `acc = fma(f32(65536·S_h + 256·S_m + S_l − offset·Σx_q), d·s, acc)` for one tile, block
    /// (or half) and vector with scale `s` there (`corr` = `offset·Σx_q`, wrapping): the three
    /// planes' sums of the unsigned codes to the dot of the signed ones, scaled and accumulated.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    pub(super) unsafe fn combine(acc: __m512, [sh, sm, sl]: [__m512i; 3], d: __m512, s: f32, corr: i32) -> __m512 {
        let upper = _mm512_add_epi32(_mm512_slli_epi32::<8>(sh), sm);
        let sum = _mm512_add_epi32(_mm512_slli_epi32::<8>(upper), sl);
        let sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(corr));
        let ds = _mm512_mul_ps(d, _mm512_set1_ps(s));
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), ds, acc)
    }

    /// The prefetches for the tile block at `blk`: the stream ahead (the tile's later blocks,
    /// then the next tiles), so that loads and dot products overlap instead of taking turns.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(super) unsafe fn prefetch_block(blk: *const u8, block_bytes: usize) {
        let p = blk.wrapping_add(PREFETCH_AHEAD);
        for line in (0..block_bytes).step_by(64) {
            _mm_prefetch(p.wrapping_add(line) as *const i8, _MM_HINT_T0);
        }
    }

    /// The 16 rows' f16 scales of a Q8_0 tile block at `blk`, as f32.
    #[target_feature(enable = "avx512f,f16c")]
    #[inline]
    pub(super) unsafe fn block_scales(blk: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(CODE_BYTES) as *const _))
    }

    /// Every tile of `tiles` × vectors `t0 .. t0 + N`, one tile at a time: a single stream of
    /// weights (on the AVX-512 VNNI AMD EPYC VM one token's LM head took 13 ms with four tiles
    /// at a time, 8–10 ms with one).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tiles_times<const N: usize, const K: u8, const BITS: u8>(
        w: &ByteTiles,
        tiles: std::ops::Range<usize>,
        x: &TileInputs,
        t0: usize,
        (start, n): (usize, usize),
        outs: &mut [&mut [f32]],
    ) {
        for tile in tiles {
            let dots = tile_dots::<N, K, BITS>(w.tile(tile), (w.block_bytes, w.offset), x, t0);
            for j in 0..N {
                store(dots[j], tile, t0 + j, start, n, outs);
            }
        }
    }

    /// [`tiles_times`] for the tiles' scale kind.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn by_kind<const N: usize>(
        w: &ByteTiles,
        tiles: std::ops::Range<usize>,
        x: &TileInputs,
        t0: usize,
        span: (usize, usize),
        outs: &mut [&mut [f32]],
    ) {
        match (w.kind, w.bits) {
            (F16, 8) => tiles_times::<N, F16, 8>(w, tiles, x, t0, span, outs),
            (F16, 5) => tiles_times::<N, F16, 5>(w, tiles, x, t0, span, outs),
            (F16, 4) => tiles_times::<N, F16, 4>(w, tiles, x, t0, span, outs),
            (HALVES, 6) => tiles_times::<N, HALVES, 6>(w, tiles, x, t0, span, outs),
            (MIN, 5) => tiles_times::<N, MIN, 5>(w, tiles, x, t0, span, outs),
            (MIN, 4) => tiles_times::<N, MIN, 4>(w, tiles, x, t0, span, outs),
            (kind, bits) => unreachable!("byte tiles: no kernel for kind {kind} with {bits}-bit codes"),
        }
    }

    /// Rows `start .. start + n` × every vector: per block of at most [`TOKEN_BLOCK`] vectors,
    /// vectors four at a time over each tile, then the rest together — five when five are left
    /// (a verify of four drafts: one pass over the weights instead of two, the Q8_0 head of
    /// Gemma 3 270M 14.3 against 17.2 ms single-threaded on Zen 4) — each (row, vector) dot the
    /// same arithmetic whatever the grouping.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn rows(
        w: &ByteTiles,
        start: usize,
        n: usize,
        x: &TileInputs,
        outs: &mut [&mut [f32]],
        use_amx: bool,
    ) {
        let tiles = start / TILE_ROWS..(start + n).div_ceil(TILE_ROWS);
        let span = (start, n);
        if x.t >= 2 && use_amx && w.kind == F16 && w.bits == 8 {
            let mut ti = 0;
            while ti < x.t {
                let nt = amx::MAX_TOKENS.min(x.t - ti);
                amx::tiles_times(w, tiles.clone(), x, ti, nt, span, outs);
                ti += nt;
            }
            return;
        }
        if w.bits > 4 && w.bits < 8 && x.t > 5 {
            return rows_unpacked(w, tiles, x, span, outs);
        }
        for tb in (0..x.t).step_by(TOKEN_BLOCK) {
            let end = x.t.min(tb + TOKEN_BLOCK);
            let mut ti = tb;
            while ti + 4 <= end && end - ti != 5 {
                by_kind::<4>(w, tiles.clone(), x, ti, span, outs);
                ti += 4;
            }
            match end - ti {
                5 => by_kind::<5>(w, tiles.clone(), x, ti, span, outs),
                3 => by_kind::<3>(w, tiles.clone(), x, ti, span, outs),
                2 => by_kind::<2>(w, tiles.clone(), x, ti, span, outs),
                1 => by_kind::<1>(w, tiles.clone(), x, ti, span, outs),
                _ => {}
            }
        }
    }

    /// [`rows`] for 5- and 6-bit codes and more than five vectors (prefill): per block of at most
    /// [`TOKEN_BLOCK`] vectors and tile, the tile's codes unpacked once into bytes (the same
    /// codes, so the same bits) and multiplied with every group of four vectors from there.
    /// Nibbles unpack in an and or a shift a step, cheaper than reading bytes back: 4-bit codes
    /// stay packed at every count (single-thread, Zen 4: Q4_K 640 × 1024 at five vectors 0.054
    /// against 0.069 ms, a 4-bit affine 262,144 × 1536 head at 64 vectors 412 against 431 ms;
    /// Q5_0 and Q6_K gain from unpacking at eight vectors and more).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn rows_unpacked(
        w: &ByteTiles,
        tiles: std::ops::Range<usize>,
        x: &TileInputs,
        span: (usize, usize),
        outs: &mut [&mut [f32]],
    ) {
        let (scale_bytes, packed_code_bytes) = (w.block_bytes - code_bytes(w.bits), code_bytes(w.bits));
        let unpacked_bytes = CODE_BYTES + scale_bytes;
        let mut buf = vec![0u8; w.blocks * unpacked_bytes];
        for tb in (0..x.t).step_by(TOKEN_BLOCK) {
            let end = x.t.min(tb + TOKEN_BLOCK);
            for tile in tiles.clone() {
                let packed = w.tile(tile);
                for b in 0..w.blocks {
                    let (src, dst) = (packed.as_ptr().add(b * w.block_bytes), buf.as_mut_ptr().add(b * unpacked_bytes));
                    for i in 0..BLOCK / 4 {
                        let c = match w.bits {
                            4 => step_codes::<4>(src, i),
                            5 => step_codes::<5>(src, i),
                            _ => step_codes::<6>(src, i),
                        };
                        _mm512_storeu_si512(dst.add(64 * i) as *mut _, c);
                    }
                    std::ptr::copy_nonoverlapping(src.add(packed_code_bytes), dst.add(CODE_BYTES), scale_bytes);
                }
                let geometry = (unpacked_bytes, w.offset);
                match w.kind {
                    F16 => unpacked_times::<F16>(&buf, geometry, x, tb..end, tile, span, outs),
                    HALVES => unpacked_times::<HALVES>(&buf, geometry, x, tb..end, tile, span, outs),
                    _ => unpacked_times::<MIN>(&buf, geometry, x, tb..end, tile, span, outs),
                }
            }
        }
    }

    /// One unpacked tile (`buf`, blocks of `geometry.0` bytes) × vectors `vectors`: four at a
    /// time, then one at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn unpacked_times<const K: u8>(
        buf: &[u8],
        geometry: (usize, i32),
        x: &TileInputs,
        vectors: std::ops::Range<usize>,
        tile: usize,
        span: (usize, usize),
        outs: &mut [&mut [f32]],
    ) {
        let mut ti = vectors.start;
        while ti + 4 <= vectors.end {
            store_all(tile_dots::<4, K, 8>(buf, geometry, x, ti), tile, ti, span, outs);
            ti += 4;
        }
        for t in ti..vectors.end {
            store_all(tile_dots::<1, K, 8>(buf, geometry, x, t), tile, t, span, outs);
        }
    }

    /// [`store`] of vectors `t0 .. t0 + N`'s dots of one tile.
    #[target_feature(enable = "avx512f")]
    unsafe fn store_all<const N: usize>(
        dots: [__m512; N],
        tile: usize,
        t0: usize,
        (start, n): (usize, usize),
        outs: &mut [&mut [f32]],
    ) {
        for (j, d) in dots.into_iter().enumerate() {
            store(d, tile, t0 + j, start, n, outs);
        }
    }

    /// Quantize one vector: per 32 values `s = amax / q_max` and `x_q = round(x / s)` (half to
    /// even: `x·(q_max/amax)` plus and minus 1.5·2^23), split into balanced digits, with
    /// `Σ x_q` per 16 values. A non-finite value makes its block's scale NaN, so it reaches the result as
    /// the f32 kernel's would (the integers cannot carry it).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn quantize_one(x: &[f32], q_max: f32, digits: &mut [i8], scale: &mut [f32], sums: &mut [i32]) {
        let cols = x.len();
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let (rounder, limit) = (_mm512_set1_ps(ROUNDER), _mm512_set1_ps(q_max));
        for (b, blk) in x.chunks_exact(BLOCK).enumerate() {
            let v = [_mm512_loadu_ps(blk.as_ptr()), _mm512_loadu_ps(blk.as_ptr().add(16))];
            let a = v.map(|v| _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs)));
            let inf = _mm512_set1_ps(f32::INFINITY);
            let finite = a.iter().all(|a| _mm512_cmp_ps_mask::<_CMP_LT_OQ>(*a, inf) == 0xffff);
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(a[0], a[1]));
            let s = if finite { amax / q_max } else { f32::NAN };
            let inv = if finite && amax > 0.0 { q_max / amax } else { 0.0 };
            for (h, v) in v.into_iter().enumerate() {
                let qf = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)), rounder), rounder);
                let qf = _mm512_min_ps(_mm512_max_ps(qf, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
                let q = _mm512_cvttps_epi32(qf);
                sums[2 * b + h] = _mm512_reduce_add_epi32(q);
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
        static ON: OnceLock<bool> = OnceLock::new();
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
        outs: &mut [&mut [f32]],
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
            let bp = |b: usize| tb.as_ptr().add(b * w.block_bytes);
            // Two blocks per round (C in tmm0 and tmm3), so one block's products overlap the
            // other's store and reload; an odd last block runs alone.
            let mut b = 0;
            while b < blocks {
                prefetch_block(bp(b), w.block_bytes);
                if b + 1 < blocks {
                    prefetch_block(bp(b + 1), w.block_bytes);
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
                    let d = block_scales(bp(b + i));
                    for k in 0..nt {
                        let row = |p: usize| _mm512_load_si512(c.0[3 * k + p].as_ptr() as *const _);
                        let v = (t0 + k) * blocks + b + i;
                        let xsum = x.sums[2 * v].wrapping_add(x.sums[2 * v + 1]);
                        acc[k] = combine(acc[k], [row(0), row(1), row(2)], d, x.scale[v], xsum.wrapping_mul(128));
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

    /// [`dot_rows`] into one flat `[T, n]` buffer.
    fn dot_rows_flat(w: &ByteTiles, start: usize, x: &TileInputs, outs: &mut [f32]) {
        dot_rows_flat_on(w, start, x, outs, amx::available())
    }

    fn dot_rows_flat_on(w: &ByteTiles, start: usize, x: &TileInputs, outs: &mut [f32], use_amx: bool) {
        let n = outs.len() / x.t;
        dot_rows_on(w, start, x, &mut outs.chunks_mut(n).collect::<Vec<_>>(), use_amx)
    }

    /// The formats with a tile layout.
    const TYPES: [GgmlType; 8] = [
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];

    /// The kernel's arithmetic transcribed for one row and vector `ti`, block by block.
    fn reference(ty: GgmlType, row: &[u8], x: &TileInputs, ti: usize) -> f32 {
        let blocks = x.cols / BLOCK;
        let (kind, _, _) = layout(ty).unwrap();
        let mut acc = 0f32;
        for b in 0..blocks {
            let (codes, [a, m]) = decode_block(ty, row, b);
            let v0 = ti * blocks + b;
            let s = x.scale[v0];
            let halves = if kind == HALVES { 2 } else { 1 };
            for h in 0..halves {
                let mut sum = 0i64;
                for v in h * BLOCK / halves..(h + 1) * BLOCK / halves {
                    let digit = |p: usize| x.digits[(ti * 3 + p) * x.cols + BLOCK * b + v] as i64;
                    sum += codes[v] as i64 * (65536 * digit(0) + 256 * digit(1) + digit(2));
                }
                let sum = i32::try_from(sum).expect("a block's integer dot fits in i32");
                let d = if kind == HALVES && h == 1 { m } else { a };
                acc = (sum as f32).mul_add(d * s, acc);
                if kind == MIN {
                    let xsum = x.sums[2 * v0] + x.sums[2 * v0 + 1];
                    acc = -(m * s).mul_add(xsum as f32, -acc);
                }
            }
        }
        acc
    }

    /// Random rows of `ty` with sane f16 scales.
    fn random_rows_of(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut bytes: Vec<u8> = (0..rows * ty.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        let scale_at: &[usize] = match ty {
            GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q4_0 => &[0],
            GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
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

    /// Random rows of `ty` with sane f16 scales; the extreme codes appear (Q8_0's −128, Q5_0's
    /// −16 and 15).
    fn random_rows(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut bytes = random_rows_of(ty, rows, cols, seed);
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
                "integer kernels off (no AVX-512 VNNI, or MEGAGEMMA_INT_DOT=0): the GGUF formats keep the f32 kernels"
            );
            return;
        }
        eprintln!("byte tiles: several tokens on {}", if amx::available() { "AMX" } else { "VNNI" });
        for ty in TYPES {
            // 37 rows (two whole tiles and a partial third), 13 vectors (tiles of 4, 4 and 5;
            // and each alone), 640 values (the K-quants' 768); one vector has an outlier at both
            // extremes of its block, one a zero block.
            let cols = if ty.block_size() == 256 { 768 } else { 640 };
            let (rows, t) = (37, 13);
            let rb = ty.row_bytes(cols).unwrap();
            let data = random_rows(ty, rows, cols, 5);
            let w = ByteTiles::from_rows(ty, &data, rows, rb);
            let mut xs: Vec<f32> = (0..t * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            xs[cols + 5] = 900.0;
            xs[cols + 6] = -900.0;
            xs[2 * cols..2 * cols + 32].fill(0.0);
            let x = TileInputs::quantize(&xs, cols, ty);
            let mut outs = vec![0f32; t * rows];
            dot_rows_flat(&w, 0, &x, &mut outs);
            // Several tokens on AMX (where it runs) and on VNNI give the same bits.
            let mut vnni = vec![0f32; t * rows];
            dot_rows_flat_on(&w, 0, &x, &mut vnni, false);
            assert!(outs.iter().zip(&vnni).all(|(a, b)| a.to_bits() == b.to_bits()), "{ty}: AMX and VNNI differ");
            for ti in 0..t {
                let one = TileInputs::quantize(&xs[ti * cols..(ti + 1) * cols], cols, ty);
                let mut single = vec![0f32; rows];
                dot_rows_flat(&w, 0, &one, &mut single);
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
            dot_rows_flat(&w, 12, &x, &mut part);
            for ti in 0..t {
                for r in 0..9 {
                    let (got, want) = (part[ti * 9 + r], outs[ti * rows + 12 + r]);
                    assert_eq!(got.to_bits(), want.to_bits(), "{ty} row {} vector {ti}", 12 + r);
                }
            }
        }
    }

    /// The tiles give back every block they were built from, codes and scales bit for bit (the
    /// builder does not depend on the CPU, so this runs everywhere).
    #[test]
    fn tiles_give_back_the_blocks_they_were_built_from() {
        for ty in TYPES {
            let cols = if ty.block_size() == 256 { 512 } else { 96 };
            let (rows, rb) = (19, ty.row_bytes(cols).unwrap());
            let data = random_rows(ty, rows, cols, 7);
            let w = ByteTiles::from_rows(ty, &data, rows, rb);
            for r in 0..rows {
                for b in 0..cols / BLOCK {
                    let (want_q, want_s) = decode_block(ty, &data[r * rb..][..rb], b);
                    let (q, s) = w.block_of_row(r, b);
                    assert_eq!(q, want_q, "{ty} row {r} block {b}: codes");
                    assert_eq!(s.map(f32::to_bits), want_s.map(f32::to_bits), "{ty} row {r} block {b}: scales");
                }
            }
        }
    }

    /// A 4-bit affine matrix (MLX nibble order, groups of 64) tiled as Q4_1: every block's codes,
    /// and its group's scale and negated bias, come back.
    #[test]
    fn affine_tiles_hold_each_groups_scale_and_bias() {
        let (rows, cols, group) = (21, 128, 64);
        let packed: Vec<u32> = (0..rows * cols / 8).map(|i| (i as u32).wrapping_mul(0x9e37_79b9)).collect();
        let scales: Vec<f32> = (0..rows * cols / group).map(|i| 0.01 + i as f32 * 1e-3).collect();
        let biases: Vec<f32> = (0..rows * cols / group).map(|i| -0.5 + i as f32 * 7e-3).collect();
        let w = ByteTiles::from_affine(&packed, &scales, &biases, rows, cols, group);
        // The slow, obvious way: each block decoded value by value, laid out by the GGUF builder.
        let reference = ByteTiles::from_blocks(GgmlType::Q4_1, rows, cols / BLOCK, |row, b| {
            let w = &packed[row * cols / 8 + b * BLOCK / 8..][..BLOCK / 8];
            let q = std::array::from_fn(|v| ((w[v / 8] >> (4 * (v % 8))) & 0xf) as i8);
            let g = row * cols / group + b * BLOCK / group;
            (q, [scales[g], -biases[g]])
        });
        assert!(w.data[..] == reference.data[..], "the direct layout differs from the block-by-block one");
        for r in 0..rows {
            for b in 0..cols / BLOCK {
                let (q, [d, m]) = w.block_of_row(r, b);
                for (v, &q) in q.iter().enumerate() {
                    let j = BLOCK * b + v;
                    assert_eq!(q as u32, (packed[r * cols / 8 + j / 8] >> (4 * (j % 8))) & 0xf, "row {r} weight {j}");
                }
                let g = r * cols / group + BLOCK * b / group;
                assert_eq!(
                    (d.to_bits(), m.to_bits()),
                    (scales[g].to_bits(), (-biases[g]).to_bits()),
                    "row {r} block {b}"
                );
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
            let cols = ty.block_size().max(64);
            let mut data = random_rows(ty, 1, cols, 11);
            // Every code at the format's extreme: Q8_0 −128, Q5_0 −16, Q4_0 −8, Q4_1 / Q4_K 15,
            // Q5_1 / Q5_K 31, Q6_K −32.
            for blk in data.chunks_exact_mut(ty.type_size()) {
                match ty {
                    GgmlType::Q8_0 => blk[2..].fill(0x80),
                    GgmlType::Q5_0 | GgmlType::Q4_0 => blk[2..].fill(0),
                    GgmlType::Q4_1 | GgmlType::Q5_1 => blk[4..].fill(0xff),
                    GgmlType::Q4_K | GgmlType::Q5_K => blk[16..].fill(0xff),
                    _ => blk[..192].fill(0),
                }
            }
            let w = ByteTiles::from_rows(ty, &data, 1, data.len());
            for sign in [1.0f32, -1.0] {
                let xs = vec![sign * 3.5; cols];
                let x = TileInputs::quantize(&xs, cols, ty);
                let mut out = [0f32; 1];
                dot_rows_flat(&w, 0, &x, &mut out);
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
        // Every grouping: 5, 4 + 2, 4 + 3, 4 + 5 (5- and 6-bit codes: unpacked beyond five) and
        // across a token block.
        for (ty, t) in TYPES.into_iter().flat_map(|ty| [5, 6, 7, 9, TOKEN_BLOCK + 6].map(|t| (ty, t))) {
            let (rows, cols) = (20, ty.block_size().max(64));
            let rb = ty.row_bytes(cols).unwrap();
            let data = random_rows(ty, rows, cols, 9);
            let w = ByteTiles::from_rows(ty, &data, rows, rb);
            let xs: Vec<f32> = (0..t * cols).map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0).collect();
            let x = TileInputs::quantize(&xs, cols, ty);
            let mut outs = vec![0f32; t * rows];
            dot_rows_flat(&w, 0, &x, &mut outs);
            for ti in [0, 3, TOKEN_BLOCK - 1, TOKEN_BLOCK, t - 2, t - 1].into_iter().filter(|&ti| ti < t) {
                let one = TileInputs::quantize(&xs[ti * cols..(ti + 1) * cols], cols, ty);
                let mut single = vec![0f32; rows];
                dot_rows_flat(&w, 0, &one, &mut single);
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
            let cols = ty.block_size().max(64);
            let data = random_rows(ty, 1, cols, 3);
            let w = ByteTiles::from_rows(ty, &data, 1, data.len());
            let mut xs = vec![0.5f32; cols];
            xs[40] = f32::INFINITY;
            let x = TileInputs::quantize(&xs, cols, ty);
            let mut out = [0f32; 1];
            dot_rows_flat(&w, 0, &x, &mut out);
            assert!(out[0].is_nan(), "{ty}");
        }
    }
}
