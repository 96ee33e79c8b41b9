//! How the tensor-core matvec (`kernels/matvec_mma.cu`) divides a launch: warps per 16-row tile,
//! tiles per virtual block and column parts ([`MmaSplit`], chosen from the shapes alone by
//! [`mma_split`], so every token of a multi-token pass runs the split of a single-token one), and
//! the shared memory and scratch the host sizes for it.

use crate::device::MmaFill;

/// Shared memory the tensor-core matvec's input fragments may take per block (`MMA_SLICE_BYTES` in
/// `kernels/matvec_mma.cu`; its blocks per SM are `Q4Stream::mma_blocks_per_sm`).
pub(crate) const MMA_SLICE_BYTES: usize = 48 * 1024;
/// Shared memory of one 64-column chunk of a slice for `h` groups of four tokens and `upc` scale
/// units per chunk (`MMA_CHUNK_BYTES` in `kernels/matvec_mma.cu`): B fragments of 2·h token pairs,
/// then upc + 1 rows of 8·h floats.
pub(crate) fn mma_chunk_bytes(h: usize, upc: usize) -> usize {
    1024 * h + 32 * h * (upc + 1)
}
/// Floats of partial sums a split tensor-core matvec may write (column parts × tokens × rows).
pub(crate) const MMA_PARTIAL_FLOATS: usize = 1 << 21;
pub(crate) const MMA_COUNTERS: usize = 1 << 16;

/// Warps of a tensor-core matvec block (`MMA_WARPS` in kernels/matvec_mma.cu).
pub(crate) const MMA_WARPS: usize = 8;

/// How the tensor-core matvec splits a launch (`Split` in kernels/matvec_mma.cu): `ks` warps per
/// tile, `tpb` tiles per virtual block (at most MMA_WARPS / ks; fewer leave warps idle), `parts` column parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MmaSplit {
    pub(crate) ks: usize,
    pub(crate) tpb: usize,
    pub(crate) parts: usize,
}

impl MmaSplit {
    /// Every warp of a virtual block busy.
    fn full(ks: usize, parts: usize) -> MmaSplit {
        MmaSplit { ks, tpb: MMA_WARPS / ks, parts }
    }

    /// Virtual blocks of one matrix of `tiles` tiles.
    pub(crate) fn matrix_blocks(&self, tiles: usize) -> usize {
        tiles.div_ceil(self.tpb) * self.parts
    }

    /// Virtual blocks of a launch of matrices with `tiles` tiles.
    pub(crate) fn blocks(&self, tiles: &[usize]) -> usize {
        tiles.iter().map(|&t| self.matrix_blocks(t)).sum()
    }

    /// The kernels' `split` argument.
    pub(crate) fn arg(&self) -> i32 {
        (self.ks | self.tpb << 4) as i32
    }
}

/// How the tensor-core kernel splits a launch of matrices with `tiles` 16-row tiles and `cols`
/// columns: warps per tile and column parts (`warps_and_parts`), then, for the launches `fill`
/// names, as few tiles per virtual block as keep the launch in one `round` — the slots of blocks
/// that would stream two or more virtual blocks' tiles go to idle ones. Depends only on the shapes,
/// never on the number of tokens.
pub(crate) fn mma_split(
    tiles: &[usize],
    cols: usize,
    gated: bool,
    round: usize,
    part_chunks: usize,
    fill: MmaFill,
) -> MmaSplit {
    let (ks, parts) = warps_and_parts(tiles, cols, gated, round, part_chunks);
    let full = MmaSplit::full(ks, parts);
    let spread = match fill {
        MmaFill::Off => false,
        MmaFill::OneWarpTiles => ks == 1,
        MmaFill::All => true,
    };
    if !spread || full.blocks(tiles) > round {
        return full;
    }
    // The fewest tiles per virtual block that keep the launch in one round.
    (1..=full.tpb).map(|tpb| MmaSplit { tpb, ..full }).find(|s| s.blocks(tiles) <= round).unwrap_or(full)
}

/// `mma_split`'s warps per tile and column parts. The launch should end in one `round` of virtual
/// blocks (the grid's slots times `mma_waves`): a block that runs a second one doubles the launch's
/// critical path while most of the grid idles. So: parts of at most `part_chunks` chunks; warps per
/// tile doubled while the launch still fits in the round and each warp keeps two chunks or more; and
/// a gated input (the GeGLU product, built per part by every block) wide enough to be cut into parts
/// is cut into as many as fill the round, one warp per tile, so each block builds the least.
/// Seventeenth session (H200, q4, graph): gate+up 2 warps per tile → 1 (320 → 160 virtual blocks),
/// E4B's down projection 4 warps and 4 parts → 1 warp and 13 parts (320 → 260): E4B −12.5%, E2B
/// −11%; the PLE projection (4 chunks) as 2 warps a tile (2 chunks a warp) was 0.7–1.5% faster than
/// as 4 parts of one chunk (docs/perf-notes.md).
fn warps_and_parts(tiles: &[usize], cols: usize, gated: bool, round: usize, part_chunks: usize) -> (usize, usize) {
    let chunks = cols.div_ceil(64);
    let groups = |tpb: usize| tiles.iter().map(|t| t.div_ceil(tpb)).sum::<usize>();
    let mut parts = chunks.div_ceil(part_chunks);
    if !splittable(tiles, parts) {
        parts = 1;
    }
    if gated && parts > 1 && groups(MMA_WARPS) * parts <= round {
        let most = chunks.div_ceil(chunks.div_ceil((round / groups(MMA_WARPS)).min(chunks)));
        if most > parts && splittable(tiles, most) {
            return (1, most);
        }
    }
    let per_part = chunks.div_ceil(parts);
    let mut ks = 1;
    while ks < MMA_WARPS && 4 * ks <= per_part && groups(MMA_WARPS / (2 * ks)) * parts <= round {
        ks *= 2;
    }
    (ks, parts)
}

/// Whether the kernel runs a launch of matrices with `tiles` tiles and `cols` columns split as `ks`
/// warps per tile (a power of two up to the block's MMA_WARPS), `tpb` tiles per virtual block (1 to MMA_WARPS / ks)
/// and `parts` column parts (at most one a chunk).
pub(crate) fn split_runs(tiles: &[usize], cols: usize, s: MmaSplit) -> bool {
    s.ks.is_power_of_two()
        && s.ks <= MMA_WARPS
        && (1..=MMA_WARPS / s.ks).contains(&s.tpb)
        && (1..=cols.div_ceil(64)).contains(&s.parts)
        && splittable(tiles, s.parts)
}

/// Whether a launch of matrices with `tiles` tiles can be split into `parts` column parts: split
/// launches take one matrix (the caller launches each alone when it can), within the partial sums'
/// and the counters' space.
fn splittable(tiles: &[usize], parts: usize) -> bool {
    let groups: usize = tiles.iter().sum();
    parts == 1 || (tiles.len() == 1 && groups <= MMA_COUNTERS && tiles[0] * 16 * 8 * parts <= MMA_PARTIAL_FLOATS)
}

/// An experiment: `MEGAGEMMA_CUDA_MMA_SPLITS=ROWSxCOLS=KS:PARTS[:TPB];...` sets the tensor-core
/// matvec's split (warps per tile, column parts, tiles per virtual block: MMA_WARPS / KS when left out) of
/// launches whose first matrix has those rows and columns (e.g. `2560x10240=4:3`: E4B's down
/// projection), so splits can be timed without a rebuild.
/// Splits that the kernel cannot run are ignored — column parts only for launches of one matrix, so
/// Q's shape with parts > 1 changes Q alone (KV-shared layers), not the Q/K/V launch; malformed
/// entries are ignored with a warning.
pub(crate) fn split_override(rows: usize, cols: usize) -> Option<MmaSplit> {
    type Entry = ((usize, usize), MmaSplit); // (rows, cols) → split
    static SPLITS: std::sync::OnceLock<Vec<Entry>> = std::sync::OnceLock::new();
    let splits = SPLITS.get_or_init(|| {
        let Ok(v) = std::env::var("MEGAGEMMA_CUDA_MMA_SPLITS") else { return vec![] };
        let parse = |e: &str| -> Option<Entry> {
            let (shape, split) = e.split_once('=')?;
            let (r, c) = shape.split_once('x')?;
            let mut n = split.split(':').map(|n| n.parse::<usize>().ok());
            let (ks, parts) = (n.next()??, n.next()??);
            let tpb = n.next().unwrap_or(Some(MMA_WARPS / ks.clamp(1, MMA_WARPS)))?;
            n.next().is_none().then_some(((r.parse().ok()?, c.parse().ok()?), MmaSplit { ks, tpb, parts }))
        };
        let entries = v.split([',', ';']).filter(|e| !e.trim().is_empty());
        entries
            .filter_map(|e| {
                let split = parse(e.trim());
                if split.is_none() {
                    eprintln!(
                        "warning: MEGAGEMMA_CUDA_MMA_SPLITS: ignoring '{e}' (expected ROWSxCOLS=KS:PARTS or KS:PARTS:TPB)"
                    );
                }
                split
            })
            .collect()
    });
    splits.iter().find(|(shape, _)| *shape == (rows, cols)).map(|(_, split)| *split)
}

#[cfg(test)]
mod mma_smem_tests {
    /// The host sizes each launch's shared memory as the kernel lays it out.
    #[test]
    fn chunk_bytes_match_the_kernel() {
        let define = |name: &str| crate::compile::kernel_define("matvec_mma.cu", name);
        assert_eq!(define("MMA_CHUNK_BYTES(H, UPC)"), "(1024 * (H) + 32 * (H) * ((UPC) + 1))");
        assert_eq!(define("MMA_SLICE_BYTES"), "(48 * 1024)");
        assert_eq!(super::MMA_SLICE_BYTES, 48 * 1024);
        for (h, upc, bytes) in [(1, 1, 1088), (1, 2, 1120), (2, 1, 2176), (2, 2, 2240)] {
            assert_eq!(super::mma_chunk_bytes(h, upc), bytes);
        }
    }

    /// The host's split argument is what the kernel decodes: the kernel's warps a block, warps per
    /// tile in bits 0–3 and tiles per virtual block above them.
    #[test]
    fn split_argument_matches_the_kernel() {
        assert_eq!(crate::compile::kernel_define("matvec_mma.cu", "MMA_WARPS"), super::MMA_WARPS.to_string());
        let src = crate::compile::KERNEL_FILES.iter().find(|(f, _)| *f == "matvec_mma.cu").unwrap().1;
        assert!(src.contains("Split decode_split(int split) { return Split{split & 15, split >> 4}; }"));
        for (ks, tpb) in [(1, 8), (1, 5), (2, 3), (8, 1)] {
            let arg = super::MmaSplit { ks, tpb, parts: 1 }.arg();
            assert_eq!(((arg & 15) as usize, (arg >> 4) as usize), (ks, tpb));
        }
    }
}

#[cfg(test)]
mod mma_split_tests {
    use super::mma_split;
    use crate::device::{MmaFill, MMA_PART_CHUNKS};

    const ROUND: usize = 264; // the H200's 132 SMs × 2 blocks

    fn split(rows: &[usize], cols: usize, gated: bool) -> ((usize, usize), usize) {
        let tiles: Vec<usize> = rows.iter().map(|r| r.div_ceil(16)).collect();
        let s = mma_split(&tiles, cols, gated, ROUND, MMA_PART_CHUNKS, MmaFill::Off);
        ((s.ks, s.parts), s.blocks(&tiles))
    }

    /// Every matvec launch of E4B and E2B but the LM head ends in one round of virtual blocks.
    #[test]
    fn decode_launches_fit_one_round() {
        #[rustfmt::skip]
        let launches: [(&[usize], usize, bool); 19] = [
            (&[2048, 512, 512], 2560, false), (&[4096, 1024, 1024], 2560, false), (&[2048], 2560, false),
            (&[2560], 2048, false), (&[2560], 4096, false), (&[10240, 10240], 2560, false), (&[2560], 10240, true),
            (&[256], 2560, false), (&[2560], 256, true),
            (&[2048, 256, 256], 1536, false), (&[4096, 512, 512], 1536, false), (&[1536], 2048, false),
            (&[1536], 4096, false), (&[6144, 6144], 1536, false), (&[12288, 12288], 1536, false),
            (&[1536], 6144, true), (&[1536], 12288, true), (&[256], 1536, false), (&[1536], 256, true),
        ];
        for (rows, cols, gated) in launches {
            let (s, vbs) = split(rows, cols, gated);
            assert!(vbs <= ROUND, "{rows:?} x {cols}: split {s:?} runs {vbs} virtual blocks on {ROUND} slots");
        }
        let (_, vbs) = split(&[262144], 2560, false); // the LM head: many rounds whatever the split
        assert!(vbs > ROUND);
    }

    /// Any shape gets a split the kernel runs (`split_runs`: what an override must also pass), with at
    /// least one chunk for every warp.
    #[test]
    fn every_split_is_runnable() {
        for rows in [16, 48, 256, 1536, 2560, 4096, 10240, 21504, 262144] {
            for cols in [64, 256, 640, 1536, 2048, 2560, 5376, 10240, 12288, 21504] {
                for mats in 1..=3 {
                    for gated in [false, true] {
                        let tiles = vec![rows / 16; mats];
                        for fill in [MmaFill::Off, MmaFill::OneWarpTiles, MmaFill::All] {
                            let s = mma_split(&tiles, cols, gated, ROUND, MMA_PART_CHUNKS, fill);
                            let chunks = cols.div_ceil(64);
                            let shape = format!("{mats} x {rows} x {cols}, gated {gated}: {s:?}");
                            assert!(super::split_runs(&tiles, cols, s), "{shape}");
                            assert!(s.ks <= chunks.div_ceil(s.parts), "{shape}: a warp without chunks");
                            let full = mma_split(&tiles, cols, gated, ROUND, MMA_PART_CHUNKS, MmaFill::Off);
                            let fits = s.blocks(&tiles) <= ROUND || s == full;
                            assert!(fits && s.blocks(&tiles) >= full.blocks(&tiles), "{shape}: filled past the round");
                        }
                    }
                }
            }
        }
    }

    /// The splits measured fastest on the H200 (docs/perf-notes.md, seventeenth session).
    #[test]
    fn measured_splits() {
        assert_eq!(split(&[10240, 10240], 2560, false).0, (1, 1)); // E4B gate+up: 160 virtual blocks
        assert_eq!(split(&[2560], 10240, true).0, (1, 13)); // E4B down: 260
        assert_eq!(split(&[2048, 512, 512], 2560, false).0, (8, 1)); // E4B Q/K/V: 192
        assert_eq!(split(&[262144], 2560, false).0, (1, 1)); // LM head
        assert_eq!(split(&[2560], 256, true).0, (2, 1)); // E4B PLE projection: 40, not 4 parts of a chunk

        // The default fill (nineteenth session) spreads E4B's gate+up alone: 5 tiles a virtual block.
        let filled = |rows: &[usize], cols, gated| {
            let tiles: Vec<usize> = rows.iter().map(|r| r.div_ceil(16)).collect();
            let s = mma_split(&tiles, cols, gated, ROUND, MMA_PART_CHUNKS, MmaFill::OneWarpTiles);
            (s.tpb, s.blocks(&tiles))
        };
        assert_eq!(filled(&[10240, 10240], 2560, false), (5, 256));
        assert_eq!(filled(&[2560], 10240, true), (8, 260)); // E4B down: already a full round
        assert_eq!(filled(&[2560], 256, true), (4, 40)); // two warps a tile: not spread
        assert_eq!(filled(&[262144], 2560, false), (8, 2048)); // the LM head: many rounds
    }
}
