//! The tiled 4-bit layout of the tensor-core matvec (`kernels/matvec_mma.cu`), built on the host
//! at upload: each 16-row × 64-column block of codes is stored in the A-fragment order of two
//! byte `mma.m16n8k32` steps (one `uint4` per lane; a nibble per code, q XOR 8 — q − 8 as a 4-bit
//! two's complement, which the kernel reads as the high nibble of an s8 byte — the low nibbles of
//! a word for the first 32 columns, the high nibbles for the next 32), and each group's (scale,
//! bias) pairs of a tile's rows gid and gid + 8 side by side. Rows are padded to 16 and columns to
//! 64 with zero nibbles (q = 8, centred zero) and zero scales.

/// Rows per tile and columns per chunk.
pub const TILE_ROWS: usize = 16;
pub const CHUNK_COLS: usize = 64;

/// Whether a `[rows, cols]` 4-bit matrix with groups of `gs` columns can take the tiled layout.
pub fn tileable(cols: usize, gs: usize) -> bool {
    matches!(gs, 32 | 64 | 128) && cols.is_multiple_of(gs)
}

/// Shape of the tiled arrays: (tiles, chunks, groups per padded row).
pub fn tiled_shape(rows: usize, cols: usize, gs: usize) -> (usize, usize, usize) {
    let chunks = cols.div_ceil(CHUNK_COLS);
    (rows.div_ceil(TILE_ROWS), chunks, chunks * CHUNK_COLS / gs)
}

/// `(u32 words of codes, f32 scale/bias values)` the tiled matrix takes.
pub fn tiled_sizes(rows: usize, cols: usize, gs: usize) -> (usize, usize) {
    let (tiles, chunks, groups) = tiled_shape(rows, cols, gs);
    (tiles * chunks * 32 * 4, tiles * groups * 8 * 4)
}

/// Where element (row `r`, column `k`) of a tile's chunk sits: (lane, word, bit shift). Lane
/// (gid, tig) holds in word w, at bits 8i + 4s, the code (XOR 8) of row gid + 8·(w % 2), column
/// 32s + 16·(w / 2) + 4·tig + i: `(word << 4(1 − s)) & 0xF0F0F0F0` is register w of its A fragment
/// for k-step s, 16·(q − 8) as s8 bytes.
pub fn fragment_slot(r: usize, k: usize) -> (usize, usize, u32) {
    let (s, kk) = (k / 32, k % 32);
    let (upper_col, tig, i) = (kk / 16, (kk % 16) / 4, kk % 4);
    let (gid, upper_row) = (r % 8, usize::from(r >= 8));
    (gid * 4 + tig, upper_row + 2 * upper_col, (8 * i + 4 * s) as u32)
}

/// Nibble `k` of row `r` of row-major packed codes (nibble k of word j is weight 8j + k).
fn code_at(packed: &[u32], cols: usize, r: usize, k: usize) -> u32 {
    (packed[(r * cols + k) / 8] >> (4 * (k % 8))) & 15
}

/// Tiles a row-major 4-bit matrix: `packed` holds `rows·cols/8` words, `scales`/`biases` one value
/// per (row, group).
pub fn tile_q4(
    rows: usize,
    cols: usize,
    gs: usize,
    packed: &[u32],
    scales: &[f32],
    biases: &[f32],
) -> (Vec<u32>, Vec<f32>) {
    let (tiles, chunks, groups) = tiled_shape(rows, cols, gs);
    let (nw, ns) = tiled_sizes(rows, cols, gs);
    let (mut codes, mut sb) = (vec![0u32; nw], vec![0f32; ns]);
    let row_groups = cols / gs;
    for t in 0..tiles {
        for r16 in 0..TILE_ROWS {
            let r = t * TILE_ROWS + r16;
            if r >= rows {
                break;
            }
            for k in 0..cols {
                let (c, kc) = (k / CHUNK_COLS, k % CHUNK_COLS);
                let (lane, word, shift) = fragment_slot(r16, kc);
                codes[((t * chunks + c) * 32 + lane) * 4 + word] |= (code_at(packed, cols, r, k) ^ 8) << shift;
            }
            for g in 0..row_groups {
                // [tile][group][gid] float4 = (s, b) of row gid, then of row gid + 8.
                let i = ((t * groups + g) * 8 + r16 % 8) * 4 + if r16 >= 8 { 2 } else { 0 };
                sb[i] = scales[r * row_groups + g];
                sb[i + 1] = biases[r * row_groups + g];
            }
        }
    }
    (codes, sb)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inverse of the layout, written from the fragment description of the PTX ISA (m16n8k32,
    /// .s8 A operand): lane l = 4·gid + tig holds four registers of four bytes, register j's byte
    /// i at row gid (j = 0, 2) or gid + 8 (j = 1, 3), column 4·tig + i (j < 2) or 16 + 4·tig + i;
    /// k-step s of the chunk (columns 32s ..) takes register j as `(word << 4(1 − s)) & 0xF0F0F0F0`
    /// and each s8 byte is 16·(q − 8). Returns q.
    fn untile(codes: &[u32], chunks: usize, t: usize, r16: usize, k: usize) -> u32 {
        let (c, kc) = (k / 64, k % 64);
        let (step, kk) = (kc / 32, kc % 32);
        for lane in 0..32 {
            let (gid, tig) = (lane / 4, lane % 4);
            for reg in 0..4 {
                let a = (codes[((t * chunks + c) * 32 + lane) * 4 + reg] << (4 * (1 - step))) & 0xF0F0_F0F0;
                let row = gid + if reg % 2 == 1 { 8 } else { 0 };
                for byte in 0..4 {
                    let col = 4 * tig + byte + if reg >= 2 { 16 } else { 0 };
                    if row == r16 && col == kk {
                        return (((a >> (8 * byte)) & 0xff) as u8 as i8 / 16 + 8) as u32;
                    }
                }
            }
        }
        unreachable!("every element of a 16x32 step has a slot")
    }

    fn lcg(seed: &mut u64) -> u32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*seed >> 33) as u32
    }

    #[test]
    fn every_code_and_scale_lands_in_its_fragment_slot() {
        for (rows, cols, gs) in [(16, 64, 64), (40, 96, 32), (33, 256, 128), (7, 32, 32), (64, 192, 64)] {
            let mut seed = (rows * 1000 + cols) as u64;
            let packed: Vec<u32> = (0..rows * cols / 8).map(|_| lcg(&mut seed)).collect();
            let groups = rows * cols / gs;
            let scales: Vec<f32> = (0..groups).map(|i| 1.0 + i as f32).collect();
            let biases: Vec<f32> = (0..groups).map(|i| -(i as f32) - 0.5).collect();
            let (codes, sb) = tile_q4(rows, cols, gs, &packed, &scales, &biases);
            let (tiles, chunks, pgroups) = tiled_shape(rows, cols, gs);
            assert_eq!((codes.len(), sb.len()), tiled_sizes(rows, cols, gs));
            for t in 0..tiles {
                for r16 in 0..16 {
                    let r = t * 16 + r16;
                    for k in 0..chunks * 64 {
                        let want = if r < rows && k < cols { code_at(&packed, cols, r, k) } else { 8 };
                        assert_eq!(untile(&codes, chunks, t, r16, k), want, "[{rows},{cols}] row {r} col {k}");
                    }
                    for g in 0..pgroups {
                        let i = ((t * pgroups + g) * 8 + r16 % 8) * 4 + 2 * (r16 / 8);
                        let want = if r < rows && g < cols / gs {
                            (scales[r * (cols / gs) + g], biases[r * (cols / gs) + g])
                        } else {
                            (0.0, 0.0)
                        };
                        assert_eq!((sb[i], sb[i + 1]), want, "[{rows},{cols}] row {r} group {g}");
                    }
                }
            }
        }
    }

    #[test]
    fn only_whole_groups_of_32_to_128_columns_tile() {
        assert!(tileable(2560, 64) && tileable(64, 32) && tileable(256, 128));
        assert!(!tileable(48, 16) && !tileable(96, 64) && !tileable(64, 128));
    }
}
