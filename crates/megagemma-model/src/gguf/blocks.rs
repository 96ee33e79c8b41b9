//! ggml tensor types: ids, block geometry, and exact dequantization of one row.
//!
//! Byte layouts follow ggml's `ggml-common.h` block structs (all little-endian, packed):
//!
//! | type | values/block | bytes | layout                                                    |
//! |------|--------------|-------|-----------------------------------------------------------|
//! | Q4_0 | 32  | 18  | d:f16, qs[16] (low nibbles = values 0..16, high = 16..32)          |
//! | Q4_1 | 32  | 20  | d:f16, m:f16, qs[16]                                               |
//! | Q5_0 | 32  | 22  | d:f16, qh:u32 (bit i = 5th bit of value i), qs[16]                 |
//! | Q5_1 | 32  | 24  | d:f16, m:f16, qh:u32, qs[16]                                       |
//! | Q8_0 | 32  | 34  | d:f16, qs:i8[32]                                                   |
//! | Q4_K | 256 | 144 | d:f16, dmin:f16, scales[12] (8×6-bit scale + 8×6-bit min), qs[128] |
//! | Q5_K | 256 | 176 | d:f16, dmin:f16, scales[12], qh[32], qs[128]                       |
//! | Q6_K | 256 | 210 | ql[128], qh[64], scales:i8[16], d:f16                              |
//!
//! The arithmetic of every `dequantize_*` mirrors ggml's `dequantize_row_*` operation by
//! operation (multiply then add, never fused), so results are bit-identical to ggml's reference.

use std::fmt;

use crate::bail;
use crate::error::Result;

/// A ggml tensor element type, as stored in a GGUF tensor info (`ggml_type`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// `(type, ggml id, name, values per block, bytes per block)`. Every type a GGUF file may carry is
/// listed (so files mixing in exotic types still open and their other tensors stay usable);
/// only those with [`GgmlType::is_supported`] can be dequantized.
const TYPES: [(GgmlType, u32, &str, usize, usize); 32] = {
    use GgmlType::*;
    [
        (F32, 0, "F32", 1, 4),
        (F16, 1, "F16", 1, 2),
        (Q4_0, 2, "Q4_0", 32, 18),
        (Q4_1, 3, "Q4_1", 32, 20),
        (Q5_0, 6, "Q5_0", 32, 22),
        (Q5_1, 7, "Q5_1", 32, 24),
        (Q8_0, 8, "Q8_0", 32, 34),
        (Q8_1, 9, "Q8_1", 32, 36),
        (Q2_K, 10, "Q2_K", 256, 84),
        (Q3_K, 11, "Q3_K", 256, 110),
        (Q4_K, 12, "Q4_K", 256, 144),
        (Q5_K, 13, "Q5_K", 256, 176),
        (Q6_K, 14, "Q6_K", 256, 210),
        (Q8_K, 15, "Q8_K", 256, 292),
        (IQ2_XXS, 16, "IQ2_XXS", 256, 66),
        (IQ2_XS, 17, "IQ2_XS", 256, 74),
        (IQ3_XXS, 18, "IQ3_XXS", 256, 98),
        (IQ1_S, 19, "IQ1_S", 256, 50),
        (IQ4_NL, 20, "IQ4_NL", 32, 18),
        (IQ3_S, 21, "IQ3_S", 256, 110),
        (IQ2_S, 22, "IQ2_S", 256, 82),
        (IQ4_XS, 23, "IQ4_XS", 256, 136),
        (I8, 24, "I8", 1, 1),
        (I16, 25, "I16", 1, 2),
        (I32, 26, "I32", 1, 4),
        (I64, 27, "I64", 1, 8),
        (F64, 28, "F64", 1, 8),
        (IQ1_M, 29, "IQ1_M", 256, 56),
        (BF16, 30, "BF16", 1, 2),
        (TQ1_0, 34, "TQ1_0", 256, 54),
        (TQ2_0, 35, "TQ2_0", 256, 66),
        (MXFP4, 39, "MXFP4", 32, 17),
    ]
};

/// Types this module can dequantize and dot (see [`dequantize_row`], [`super::dot_row`]).
pub const SUPPORTED_TYPES: [GgmlType; 11] = {
    use GgmlType::*;
    [F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K]
};

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        // The table is tiny; a linear scan keeps it the single source of truth.
        TYPES.iter().find(|e| e.0 == self).expect("every GgmlType is in TYPES")
    }

    /// The type with ggml id `id`, or `None` for ids this reader does not know.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// ggml's name for the type ("Q4_K", "F32", ...).
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Values per block (1 for plain float/int types).
    pub fn block_size(self) -> usize {
        self.entry().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.entry().4
    }

    /// Whether [`dequantize_row`] / [`super::dot_row`] handle this type.
    pub fn is_supported(self) -> bool {
        SUPPORTED_TYPES.contains(&self)
    }

    /// Bytes taken by `n` consecutive values; `n` must be a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            bail!("{n} values are not a whole number of {self} blocks ({bs} values each)");
        }
        match (n / bs).checked_mul(self.type_size()) {
            Some(b) => Ok(b),
            None => bail!("{n} values of {self} overflow the addressable size"),
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Exact IEEE half → single conversion, branch-free so it vectorizes inside the dot kernels.
/// Exponent+mantissa are reinterpreted as an f32 whose exponent is 112 too small and rescaled by
/// 2^112, which is exact for normals and subnormals; Inf/NaN are patched (NaN made quiet, as
/// F16C hardware does). Assumes denormals are not flushed (Rust never enables FTZ/DAZ).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    let scaled = f32::from_bits(em << 13) * f32::from_bits((127 + 112) << 23);
    let bits = if em > 0x7c00 {
        0x7fc0_0000 | ((em & 0x3ff) << 13) // NaN
    } else if em == 0x7c00 {
        0x7f80_0000 // Inf
    } else {
        scaled.to_bits()
    };
    f32::from_bits(sign | bits)
}

#[inline(always)]
pub(super) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// The 8 six-bit scales and 8 six-bit mins of a Q4_K/Q5_K block, unpacked from 12 bytes
/// (ggml's `get_scale_min_k4`): entries 0..4 sit in the low 6 bits of bytes 0..4 / 4..8;
/// entries 4..8 take their low 4 bits from bytes 8..12 and their top 2 bits from the spare
/// top bits of bytes 0..4 (scales) / 4..8 (mins).
#[inline(always)]
pub(super) fn k4_scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0xf) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// A row dequantizer: `bytes` holds exactly `out.len() / block_size` blocks.
pub(super) type DequantFn = fn(&[u8], &mut [f32]);

pub(super) fn dequant_fn(ty: GgmlType) -> Option<DequantFn> {
    use GgmlType::*;
    Some(match ty {
        F32 => dequantize_f32,
        F16 => dequantize_f16,
        BF16 => dequantize_bf16,
        Q8_0 => dequantize_q8_0,
        Q4_0 => dequantize_q4_0,
        Q4_1 => dequantize_q4_1,
        Q5_0 => dequantize_q5_0,
        Q5_1 => dequantize_q5_1,
        Q4_K => dequantize_q4_k,
        Q5_K => dequantize_q5_k,
        Q6_K => dequantize_q6_k,
        _ => return None,
    })
}

/// Dequantize one row of `ty` values from `bytes` into `out` (all of it), exactly as ggml does.
/// Errors name the type when it is unsupported or when the lengths disagree.
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let Some(f) = dequant_fn(ty) else {
        bail!("cannot dequantize ggml type {ty}: only {} are supported", supported_list());
    };
    check_row(ty, bytes, out.len())?;
    f(bytes, out);
    Ok(())
}

pub(super) fn supported_list() -> String {
    SUPPORTED_TYPES.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

/// `bytes` must be exactly the encoding of `n` values of `ty`.
pub(super) fn check_row(ty: GgmlType, bytes: &[u8], n: usize) -> Result<()> {
    let want = ty.row_bytes(n)?;
    if bytes.len() != want {
        bail!("{ty} row of {n} values needs {want} bytes, got {}", bytes.len());
    }
    Ok(())
}

fn dequantize_f32(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

fn dequantize_f16(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
}

fn dequantize_bf16(b: &[u8], out: &mut [f32]) {
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
    }
}

fn dequantize_q8_0(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        for (y, &q) in y.iter_mut().zip(&blk[2..34]) {
            *y = (q as i8) as f32 * d;
        }
    }
}

fn dequantize_q4_0(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        for (j, &q) in blk[2..18].iter().enumerate() {
            y[j] = ((q & 0xf) as i32 - 8) as f32 * d;
            y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

fn dequantize_q4_1(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(20).zip(out.chunks_exact_mut(32)) {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        for (j, &q) in blk[4..20].iter().enumerate() {
            y[j] = (q & 0xf) as f32 * d + m;
            y[j + 16] = (q >> 4) as f32 * d + m;
        }
    }
}

fn dequantize_q5_0(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(22).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        for (j, &q) in blk[6..22].iter().enumerate() {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            y[j] = (((q & 0xf) as u32 | h0) as i32 - 16) as f32 * d;
            y[j + 16] = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
        }
    }
}

fn dequantize_q5_1(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(24).zip(out.chunks_exact_mut(32)) {
        let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
        let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
        for (j, &q) in blk[8..24].iter().enumerate() {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            y[j] = ((q & 0xf) as u32 | h0) as f32 * d + m;
            y[j + 16] = ((q >> 4) as u32 | h1) as f32 * d + m;
        }
    }
}

fn dequantize_q4_k(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(144).zip(out.chunks_exact_mut(256)) {
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let (sc, mn) = k4_scales_mins(blk[4..16].try_into().unwrap());
        // Four 64-value chunks; each 32-byte slice of qs feeds two sub-blocks of 32:
        // low nibbles → sub-block 2c, high nibbles → sub-block 2c+1.
        for c in 0..4 {
            let qs = &blk[16 + 32 * c..16 + 32 * (c + 1)];
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * mn[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * mn[2 * c + 1] as f32);
            for (l, &q) in qs.iter().enumerate() {
                y[64 * c + l] = d1 * (q & 0xf) as f32 - m1;
                y[64 * c + 32 + l] = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

fn dequantize_q5_k(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(176).zip(out.chunks_exact_mut(256)) {
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let (sc, mn) = k4_scales_mins(blk[4..16].try_into().unwrap());
        let qh = &blk[16..48];
        // As Q4_K, plus a 5th bit: bit s of qh[l] belongs to value l of sub-block s.
        for c in 0..4 {
            let qs = &blk[48 + 32 * c..48 + 32 * (c + 1)];
            let (d1, m1) = (d * sc[2 * c] as f32, dmin * mn[2 * c] as f32);
            let (d2, m2) = (d * sc[2 * c + 1] as f32, dmin * mn[2 * c + 1] as f32);
            for (l, &q) in qs.iter().enumerate() {
                let h1 = ((qh[l] >> (2 * c)) & 1) << 4;
                let h2 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
                y[64 * c + l] = d1 * ((q & 0xf) | h1) as f32 - m1;
                y[64 * c + 32 + l] = d2 * ((q >> 4) | h2) as f32 - m2;
            }
        }
    }
}

/// The 128 six-bit values (minus 32) of one half of a Q6_K block. Value `32k + l` (k = 0..4)
/// takes its low 4 bits from `ql[l + 32(k%2)]` (low nibble for k < 2, high nibble otherwise)
/// and its top 2 bits from bits `2k..2k+2` of `qh[l]`.
#[inline(always)]
pub(super) fn q6k_half(ql: &[u8; 64], qh: &[u8; 32]) -> [i8; 128] {
    let mut q = [0i8; 128];
    for l in 0..32 {
        q[l] = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32;
        q[l + 32] = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
        q[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
        q[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
    }
    q
}

fn dequantize_q6_k(b: &[u8], out: &mut [f32]) {
    for (blk, y) in b.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
        let d = f16_at(blk, 208);
        for h in 0..2 {
            let q = q6k_half(
                blk[64 * h..64 * h + 64].try_into().unwrap(),
                blk[128 + 32 * h..128 + 32 * h + 32].try_into().unwrap(),
            );
            // One signed 8-bit scale per 16 values.
            for (g, chunk) in q.chunks_exact(16).enumerate() {
                let ds = d * (blk[192 + 8 * h + g] as i8) as f32;
                for (j, &v) in chunk.iter().enumerate() {
                    y[128 * h + 16 * g + j] = ds * v as f32;
                }
            }
        }
    }
}
