//! GGUF container parsing (versions 2 and 3, little-endian): header, metadata key/values, tensor
//! directory, data section.
//!
//! Layout: `"GGUF" | version:u32 | n_tensors:u64 | n_kv:u64 | kv* | tensor_info* | pad | data`.
//! Strings are `len:u64` + UTF-8 bytes; a tensor info is `name | n_dims:u32 | ne:u64[n_dims] |
//! ggml_type:u32 | offset:u64`, the offset relative to the data section, which starts at the
//! next multiple of `general.alignment` (default 32) after the last tensor info.
//!
//! Every count and length read from the file is checked against the bytes that remain before
//! anything is allocated, so a truncated or hostile file yields one error line, never a panic
//! or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::blocks::{dequant_fn, GgmlType};
use crate::bail;
use crate::error::{Error, Result};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const GGUF_DEFAULT_ALIGNMENT: usize = 32;
/// ggml tensors have at most 4 dimensions.
const MAX_DIMS: u32 = 4;
/// Nested metadata arrays are legal but never deep in practice; bound recursion.
const MAX_ARRAY_DEPTH: usize = 8;
/// Upper bound on up-front `Vec` capacity for string/array lists: beyond it, growth is paid
/// for by bytes actually parsed, so a forged count cannot trigger a huge allocation.
const MAX_PREALLOC: usize = 1 << 16;

/// One metadata value. Type ids: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool,
/// 8 string, 9 array, 10 u64, 11 i64, 12 f64.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(GgufArray),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A metadata array, stored typed (a 262k-entry vocabulary is one `Vec<String>`).
#[derive(Clone, Debug, PartialEq)]
pub enum GgufArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<GgufArray>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
}

fn type_name(id: u32) -> &'static str {
    const NAMES: [&str; 13] =
        ["u8", "i8", "u16", "i16", "u32", "i32", "f32", "bool", "string", "array", "u64", "i64", "f64"];
    NAMES.get(id as usize).copied().unwrap_or("unknown")
}

impl GgufValue {
    pub fn type_name(&self) -> &'static str {
        use GgufValue::*;
        type_name(match self {
            U8(_) => 0,
            I8(_) => 1,
            U16(_) => 2,
            I16(_) => 3,
            U32(_) => 4,
            I32(_) => 5,
            F32(_) => 6,
            Bool(_) => 7,
            String(_) => 8,
            Array(_) => 9,
            U64(_) => 10,
            I64(_) => 11,
            F64(_) => 12,
        })
    }

    /// Any integer type, as i128 so every GGUF integer converts losslessly.
    fn as_int(&self) -> Option<i128> {
        use GgufValue::*;
        Some(match *self {
            U8(v) => v as i128,
            I8(v) => v as i128,
            U16(v) => v as i128,
            I16(v) => v as i128,
            U32(v) => v as i128,
            I32(v) => v as i128,
            U64(v) => v as i128,
            I64(v) => v as i128,
            _ => return None,
        })
    }

    /// Integer value of any width/sign that fits in `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_int().and_then(|v| v.try_into().ok())
    }

    /// Integer value of any width/sign that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_int().and_then(|v| v.try_into().ok())
    }

    /// An `f32` or `f64` value.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&GgufArray> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl GgufArray {
    pub fn len(&self) -> usize {
        use GgufArray::*;
        match self {
            U8(v) => v.len(),
            I8(v) => v.len(),
            U16(v) => v.len(),
            I16(v) => v.len(),
            U32(v) => v.len(),
            I32(v) => v.len(),
            F32(v) => v.len(),
            Bool(v) => v.len(),
            String(v) => v.len(),
            Array(v) => v.len(),
            U64(v) => v.len(),
            I64(v) => v.len(),
            F64(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every element of an integer array of any width/sign, when all fit in `u64` (as
    /// [`GgufValue::as_u64`] for one value); `None` for other element types.
    pub fn as_u64s(&self) -> Option<Vec<u64>> {
        use GgufArray::*;
        fn all<T: Copy + TryInto<u64>>(v: &[T]) -> Option<Vec<u64>> {
            v.iter().map(|&x| x.try_into().ok()).collect()
        }
        match self {
            U8(v) => all(v),
            I8(v) => all(v),
            U16(v) => all(v),
            I16(v) => all(v),
            U32(v) => all(v),
            I32(v) => all(v),
            U64(v) => all(v),
            I64(v) => all(v),
            _ => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml `ne`: fastest-varying first. A matrix with `dims = [cols, rows]` is `rows`
    /// contiguous rows of `cols` values.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: usize,
}

impl GgufTensorInfo {
    /// Dimensions slowest-varying first (PyTorch / row-major order): `[rows, cols]` for a matrix.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A memory-mapped, fully validated GGUF file.
pub struct GgufFile {
    path: PathBuf,
    mmap: Arc<Mmap>,
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_start: usize,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_start", &self.data_start)
            .finish()
    }
}

impl GgufFile {
    /// Map and parse `path`. Errors are one line, prefixed with the path.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let with_path = |e: Error| Error::msg(format!("{}: {e}", path.display()));
        let file = File::open(path).map_err(|e| with_path(Error::msg(format!("cannot open: {e}"))))?;
        // SAFETY: the map is read-only; as with every mmap-based model loader, the file must not
        // be truncated or rewritten by another process while it is mapped.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| with_path(Error::msg(format!("cannot mmap: {e}"))))?;
        let Parsed { version, metadata, metadata_index, tensors, tensor_index, alignment, data_start } =
            parse(&mmap).map_err(with_path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap: Arc::new(mmap),
            version,
            metadata,
            metadata_index,
            tensors,
            tensor_index,
            alignment,
            data_start,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Absolute file offset of the data section (tensor offsets are relative to it).
    pub fn data_offset(&self) -> usize {
        self.data_start
    }

    /// Size of the whole file in bytes.
    pub fn file_len(&self) -> usize {
        self.mmap.len()
    }

    pub(super) fn mmap(&self) -> &Arc<Mmap> {
        &self.mmap
    }

    /// All metadata in file order.
    pub fn metadata_entries(&self) -> &[(String, GgufValue)] {
        &self.metadata
    }

    pub fn metadata(&self, key: &str) -> Option<&GgufValue> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Integer of any GGUF width that fits (writers use u32 or u64 for counts interchangeably).
    pub fn get_u32(&self, key: &str) -> Option<u32> {
        self.get_u64(key).and_then(|v| v.try_into().ok())
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.metadata(key)?.as_u64()
    }

    pub fn get_i32(&self, key: &str) -> Option<i32> {
        self.get_i64(key).and_then(|v| v.try_into().ok())
    }

    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.metadata(key)?.as_i64()
    }

    /// An `f32` value (or an `f64`, rounded).
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get_f64(key).map(|v| v as f32)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.metadata(key)?.as_f64()
    }

    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.metadata(key)?.as_bool()
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.metadata(key)?.as_str()
    }

    pub fn get_array(&self, key: &str) -> Option<&GgufArray> {
        self.metadata(key)?.as_array()
    }

    pub fn get_str_array(&self, key: &str) -> Option<&[String]> {
        match self.get_array(key)? {
            GgufArray::String(v) => Some(v),
            _ => None,
        }
    }

    pub fn get_f32_array(&self, key: &str) -> Option<&[f32]> {
        match self.get_array(key)? {
            GgufArray::F32(v) => Some(v),
            _ => None,
        }
    }

    pub fn get_i32_array(&self, key: &str) -> Option<&[i32]> {
        match self.get_array(key)? {
            GgufArray::I32(v) => Some(v),
            _ => None,
        }
    }

    pub fn get_u32_array(&self, key: &str) -> Option<&[u32]> {
        match self.get_array(key)? {
            GgufArray::U32(v) => Some(v),
            _ => None,
        }
    }

    pub fn get_bool_array(&self, key: &str) -> Option<&[bool]> {
        match self.get_array(key)? {
            GgufArray::Bool(v) => Some(v),
            _ => None,
        }
    }

    /// `general.architecture` ("gemma3", "llama", ...).
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw (still quantized) bytes of a tensor of this file; bounds were checked at open.
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        let start = self.data_start + info.offset as usize;
        self.mmap.get(start..start + info.n_bytes).expect("tensor info does not belong to this GGUF file")
    }

    /// The whole tensor dequantized to f32 (in storage order), e.g. for norm weights.
    pub fn tensor_to_f32(&self, info: &GgufTensorInfo) -> Result<Vec<f32>> {
        let Some(f) = dequant_fn(info.ggml_type) else {
            bail!("tensor '{}' has type {}, which cannot be dequantized", info.name, info.ggml_type);
        };
        let mut out = vec![0f32; info.n_elements as usize];
        f(self.tensor_bytes(info), &mut out);
        Ok(out)
    }
}

/// Everything `parse` extracts; the mmap is attached by `open`.
struct Parsed {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: usize,
    data_start: usize,
}

/// Bounds-checked little-endian reader over the mapped file.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            bail!("GGUF truncated: {what} needs {n} bytes at offset {} but only {} remain", self.pos, self.remaining());
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N, what)?.try_into().unwrap())
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        if len > self.remaining() as u64 {
            bail!(
                "GGUF truncated or corrupt: {what} has string length {len} at offset {at}, \
                 past the end of the file ({} bytes remain)",
                self.remaining()
            );
        }
        let bytes = self.take(len as usize, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => bail!("GGUF corrupt: {what} (string at offset {at}) is not valid UTF-8"),
        }
    }

    /// Smallest encoding of one value of type `ty` (for count-vs-remaining checks).
    fn min_size(ty: u32, what: &str) -> Result<usize> {
        Ok(match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            _ => bail!("GGUF corrupt: {what} has unknown metadata value type {ty}"),
        })
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<GgufValue> {
        Self::min_size(ty, what)?;
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(self.array::<1>(what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => GgufValue::Bool(Self::bool(self.array::<1>(what)?[0], what)?),
            8 => GgufValue::String(self.string(what)?),
            9 => GgufValue::Array(self.array_value(what, depth)?),
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            _ => unreachable!("min_size rejected the type"),
        })
    }

    fn bool(b: u8, what: &str) -> Result<bool> {
        match b {
            0 => Ok(false),
            1 => Ok(true),
            _ => bail!("GGUF corrupt: {what} has bool byte {b} (must be 0 or 1)"),
        }
    }

    /// `n` fixed-size elements decoded with `f` (the count was already checked to fit).
    fn fixed<T, const N: usize>(&mut self, n: usize, what: &str, f: impl Fn([u8; N]) -> T) -> Result<Vec<T>> {
        let bytes = self.take(n * N, what)?;
        Ok(bytes.chunks_exact(N).map(|c| f(c.try_into().unwrap())).collect())
    }

    fn array_value(&mut self, what: &str, depth: usize) -> Result<GgufArray> {
        if depth >= MAX_ARRAY_DEPTH {
            bail!("GGUF corrupt: {what} nests arrays deeper than {MAX_ARRAY_DEPTH} levels");
        }
        let at = self.pos;
        let ty = self.u32(what)?;
        let n = self.u64(what)?;
        let min = Self::min_size(ty, what)?;
        if n > (self.remaining() / min) as u64 {
            bail!(
                "GGUF truncated or corrupt: {what} is an array of {n} {} values at offset {at}, \
                 more than the {} remaining bytes can hold",
                type_name(ty),
                self.remaining()
            );
        }
        let n = n as usize;
        Ok(match ty {
            0 => GgufArray::U8(self.fixed(n, what, |[b]: [u8; 1]| b)?),
            1 => GgufArray::I8(self.fixed(n, what, |[b]: [u8; 1]| b as i8)?),
            2 => GgufArray::U16(self.fixed(n, what, u16::from_le_bytes)?),
            3 => GgufArray::I16(self.fixed(n, what, i16::from_le_bytes)?),
            4 => GgufArray::U32(self.fixed(n, what, u32::from_le_bytes)?),
            5 => GgufArray::I32(self.fixed(n, what, i32::from_le_bytes)?),
            6 => GgufArray::F32(self.fixed(n, what, f32::from_le_bytes)?),
            7 => GgufArray::Bool(self.take(n, what)?.iter().map(|&b| Self::bool(b, what)).collect::<Result<_>>()?),
            8 => {
                let mut v = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    v.push(self.string(what)?);
                }
                GgufArray::String(v)
            }
            9 => {
                let mut v = Vec::with_capacity(n.min(MAX_PREALLOC));
                for _ in 0..n {
                    v.push(self.array_value(what, depth + 1)?);
                }
                GgufArray::Array(v)
            }
            10 => GgufArray::U64(self.fixed(n, what, u64::from_le_bytes)?),
            11 => GgufArray::I64(self.fixed(n, what, i64::from_le_bytes)?),
            12 => GgufArray::F64(self.fixed(n, what, f64::from_le_bytes)?),
            _ => unreachable!("min_size rejected the type"),
        })
    }
}

/// Bytes of the smallest possible metadata entry (empty key, type, 1-byte value) and tensor
/// info (empty name, n_dims, type, offset): used to reject counts the file cannot hold.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;

fn parse(buf: &[u8]) -> Result<Parsed> {
    let mut cur = Cursor { buf, pos: 0 };

    let magic = cur.array::<4>("magic")?;
    if magic != GGUF_MAGIC {
        bail!("not a GGUF file: bad magic {magic:02x?} (expected \"GGUF\")");
    }
    let version = cur.u32("version")?;
    match version {
        2 | 3 => {}
        _ if version.swap_bytes() == 2 || version.swap_bytes() == 3 => {
            bail!("big-endian GGUF (version {}) is not supported", version.swap_bytes())
        }
        1 => bail!("GGUF version 1 is not supported (32-bit counts); re-convert the model to version 3"),
        _ => bail!("unsupported GGUF version {version} (this reader handles versions 2 and 3)"),
    }
    let n_tensors = cur.u64("tensor count")?;
    let n_kv = cur.u64("metadata count")?;
    // Each entry needs some minimum number of bytes; reject counts the file cannot hold
    // before sizing anything by them.
    if n_tensors > (cur.remaining() / MIN_TENSOR_INFO_BYTES) as u64 {
        bail!(
            "GGUF truncated or corrupt: tensor count {n_tensors} is larger than the file can hold \
             ({} bytes after the header)",
            cur.remaining()
        );
    }
    if n_kv > (cur.remaining() / MIN_KV_BYTES) as u64 {
        bail!(
            "GGUF truncated or corrupt: metadata count {n_kv} is larger than the file can hold \
             ({} bytes after the header)",
            cur.remaining()
        );
    }
    let (n_tensors, n_kv) = (n_tensors as usize, n_kv as usize);

    // Counts are only bounded by the file size and an entry is far larger in memory than its
    // smallest encoding: cap the up-front capacity, let parsed bytes pay for the rest.
    let mut metadata = Vec::with_capacity(n_kv.min(MAX_PREALLOC));
    let mut metadata_index = HashMap::with_capacity(n_kv.min(MAX_PREALLOC));
    for i in 0..n_kv {
        let key = cur.string(&format!("metadata key #{i}"))?;
        let what = format!("metadata '{key}'");
        let ty = cur.u32(&what)?;
        let value = cur.value(ty, &what, 0)?;
        if metadata_index.insert(key.clone(), i).is_some() {
            bail!("GGUF corrupt: duplicate metadata key '{key}'");
        }
        metadata.push((key, value));
    }

    let alignment = match metadata_index.get("general.alignment").map(|&i| &metadata[i].1) {
        None => GGUF_DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 30 => a as usize,
            _ => bail!("GGUF corrupt: general.alignment {v:?} is not a power of two"),
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors.min(MAX_PREALLOC));
    let mut tensor_index = HashMap::with_capacity(n_tensors.min(MAX_PREALLOC));
    for i in 0..n_tensors {
        let name = cur.string(&format!("tensor #{i} name"))?;
        let what = format!("tensor '{name}'");
        let n_dims = cur.u32(&what)?;
        if n_dims > MAX_DIMS {
            bail!("GGUF corrupt: {what} has {n_dims} dimensions (at most {MAX_DIMS} allowed)");
        }
        let dims = (0..n_dims).map(|_| cur.u64(&what)).collect::<Result<Vec<u64>>>()?;
        let type_id = cur.u32(&what)?;
        let Some(ggml_type) = GgmlType::from_id(type_id) else {
            bail!("GGUF corrupt or too new: {what} has unknown ggml type id {type_id}");
        };
        let offset = cur.u64(&what)?;

        let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let Some(n_elements) = n_elements.filter(|&n| n <= i64::MAX as u64) else {
            bail!("GGUF corrupt: {what} dims {dims:?} overflow the element count");
        };
        let row = dims.first().copied().unwrap_or(1);
        let bs = ggml_type.block_size() as u64;
        if row % bs != 0 {
            bail!("GGUF corrupt: {what} first dimension {row} is not a multiple of the {ggml_type} block size {bs}");
        }
        let n_bytes = (n_elements / bs).checked_mul(ggml_type.type_size() as u64);
        let Some(n_bytes) = n_bytes.and_then(|b| usize::try_from(b).ok()) else {
            bail!("GGUF corrupt: {what} byte size overflows");
        };
        if offset % alignment as u64 != 0 {
            bail!("GGUF corrupt: {what} data offset {offset} is not aligned to {alignment} bytes");
        }
        if tensor_index.insert(name.clone(), i).is_some() {
            bail!("GGUF corrupt: duplicate tensor name '{name}'");
        }
        tensors.push(GgufTensorInfo { name, dims, ggml_type, offset, n_elements, n_bytes });
    }

    // The data section starts at the first aligned offset after the tensor directory.
    let data_start = cur.pos.next_multiple_of(alignment);
    for t in &tensors {
        let end = (data_start as u64).checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes as u64));
        match end {
            Some(end) if end <= buf.len() as u64 => {}
            _ => bail!(
                "GGUF truncated or corrupt: tensor '{}' data ({} bytes at data offset {}) extends past \
                 end of file ({} bytes, data section at {data_start})",
                t.name,
                t.n_bytes,
                t.offset,
                buf.len()
            ),
        }
    }

    Ok(Parsed { version, metadata, metadata_index, tensors, tensor_index, alignment, data_start })
}
