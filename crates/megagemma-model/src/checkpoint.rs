//! Hugging Face safetensors checkpoints, single-file or sharded, memory-mapped.
//!
//! The safetensors header is parsed here (rather than through a library) so that every way a
//! file can be broken — truncated, bad header length, offsets past the end, a size that does
//! not match the shape — becomes one error line naming the file and the tensor.

use crate::{bail, Error, Result};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    BF16,
    F64,
    U32,
    I32,
    I64,
    U8,
    I8,
    U16,
    I16,
    Bool,
}

impl DType {
    fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "F64" => DType::F64,
            "U32" => DType::U32,
            "I32" => DType::I32,
            "I64" => DType::I64,
            "U8" => DType::U8,
            "I8" => DType::I8,
            "U16" => DType::U16,
            "I16" => DType::I16,
            "BOOL" => DType::Bool,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::U32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::U16 | DType::I16 => 2,
            DType::U8 | DType::I8 | DType::Bool => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::F64 => "F64",
            DType::U32 => "U32",
            DType::I32 => "I32",
            DType::I64 => "I64",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::U16 => "U16",
            DType::I16 => "I16",
            DType::Bool => "BOOL",
        }
    }
}

/// A byte range inside a memory-mapped file, kept alive by the `Arc`.
#[derive(Clone)]
pub struct MappedBytes {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
}

impl MappedBytes {
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
    /// A sub-range (relative to this one).
    pub fn slice(&self, start: usize, len: usize) -> MappedBytes {
        assert!(start + len <= self.len);
        MappedBytes { map: self.map.clone(), start: self.start + start, len }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[derive(Clone)]
pub struct TensorRef {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: MappedBytes,
    pub file: PathBuf,
}

impl TensorRef {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// All elements converted exactly to f32 (F32, F16, BF16; F64 rounded).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let b = self.data.bytes();
        Ok(match self.dtype {
            DType::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            DType::BF16 => {
                b.chunks_exact(2).map(|c| crate::simd::bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect()
            }
            DType::F16 => {
                b.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect()
            }
            DType::F64 => b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap()) as f32).collect(),
            other => bail!("tensor `{}` has dtype {} where a float tensor is expected", self.name, other.name()),
        })
    }

    pub fn to_u32_vec(&self) -> Result<Vec<u32>> {
        match self.dtype {
            DType::U32 | DType::I32 => {
                Ok(self.data.bytes().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            other => bail!("tensor `{}` has dtype {} where U32 is expected", self.name, other.name()),
        }
    }

    /// Require an exact shape; the error names the tensor and both shapes.
    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            bail!("tensor `{}` has shape {:?}, expected {:?}", self.name, self.shape, shape);
        }
        Ok(())
    }
}

/// Every tensor of a checkpoint directory, by name.
pub struct Checkpoint {
    pub dir: PathBuf,
    tensors: HashMap<String, TensorRef>,
}

impl Checkpoint {
    /// Open `DIR/model.safetensors`, or the shards listed by `DIR/model.safetensors.index.json`,
    /// or every `*.safetensors` file in `DIR` when neither exists.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|e| Error::msg(format!("cannot read {}: {e}", index.display())))?;
            let json: Value = serde_json::from_str(&text)
                .map_err(|e| Error::msg(format!("{} is not valid JSON: {e}", index.display())))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::msg(format!("{} has no `weight_map` object", index.display())))?;
            let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
            names.sort();
            names.dedup();
            for n in &names {
                if n.contains('/') || n.contains("..") {
                    bail!("{}: shard name `{n}` must be a file in the checkpoint directory", index.display());
                }
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| Error::msg(format!("cannot read directory {}: {e}", dir.display())))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                bail!("no model.safetensors, model.safetensors.index.json or *.safetensors in {}", dir.display());
            }
            found
        };
        let mut tensors = HashMap::new();
        for f in files {
            for t in read_safetensors(&f)? {
                tensors.insert(t.name.clone(), t);
            }
        }
        Ok(Checkpoint { dir: dir.to_path_buf(), tensors })
    }

    pub fn get(&self, name: &str) -> Option<&TensorRef> {
        self.tensors.get(name)
    }

    /// The tensor, or an error naming it and the shape that was expected.
    pub fn require(&self, name: &str, shape: &[usize]) -> Result<&TensorRef> {
        let t = self.tensors.get(name).ok_or_else(|| {
            Error::msg(format!("missing tensor `{name}` (expected shape {shape:?}) in {}", self.dir.display()))
        })?;
        t.expect_shape(shape)?;
        Ok(t)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }
}

/// Parse one safetensors file: `u64 header length | JSON header | data`.
pub fn read_safetensors(path: &Path) -> Result<Vec<TensorRef>> {
    let name = path.display();
    let file = std::fs::File::open(path).map_err(|e| Error::msg(format!("cannot open {name}: {e}")))?;
    // SAFETY: the file is opened read-only; like every mmap-based loader we assume it is not
    // modified while the model is loaded.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::msg(format!("cannot map {name}: {e}")))?;
    let map = Arc::new(map);
    if map.len() < 8 {
        bail!("{name}: not a safetensors file (only {} bytes)", map.len());
    }
    let header_len = u64::from_le_bytes(map[..8].try_into().unwrap());
    if header_len > (map.len() as u64 - 8) || header_len > 100 << 20 {
        bail!("{name}: corrupt safetensors header (header length {header_len} but file has {} bytes)", map.len());
    }
    let header_end = 8 + header_len as usize;
    let header: Value = serde_json::from_slice(&map[8..header_end])
        .map_err(|e| Error::msg(format!("{name}: corrupt safetensors header ({e})")))?;
    let obj =
        header.as_object().ok_or_else(|| Error::msg(format!("{name}: corrupt safetensors header (not an object)")))?;
    let data_len = map.len() - header_end;
    let mut out = Vec::with_capacity(obj.len());
    for (tname, info) in obj {
        if tname == "__metadata__" {
            continue;
        }
        let bad = |what: &str| Error::msg(format!("{name}: tensor `{tname}`: {what}"));
        let dtype_s = info.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad("no dtype"))?;
        let dtype = DType::parse(dtype_s).ok_or_else(|| bad(&format!("unsupported dtype {dtype_s}")))?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no shape"))?
            .iter()
            .map(|d| d.as_u64().map(|x| x as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape is not a list of integers"))?;
        let offs = info.get("data_offsets").and_then(|s| s.as_array()).ok_or_else(|| bad("no data_offsets"))?;
        let (start, end) = match (offs.first().and_then(|v| v.as_u64()), offs.get(1).and_then(|v| v.as_u64())) {
            (Some(s), Some(e)) if offs.len() == 2 => (s as usize, e as usize),
            _ => return Err(bad("data_offsets must be two integers")),
        };
        if start > end || end > data_len {
            return Err(bad(&format!(
                "data [{start}, {end}) lies outside the file's {data_len} data bytes (truncated?)"
            )));
        }
        let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad("shape overflows"))?;
        match numel.checked_mul(dtype.size()) {
            Some(need) if need == end - start => {}
            Some(need) => {
                return Err(bad(&format!(
                    "{} bytes of data but shape {shape:?} of {dtype_s} needs {need}",
                    end - start
                )))
            }
            None => return Err(bad(&format!("shape {shape:?} of {dtype_s} overflows the byte size"))),
        }
        out.push(TensorRef {
            name: tname.clone(),
            dtype,
            shape,
            data: MappedBytes { map: map.clone(), start: header_end + start, len: end - start },
            file: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// A safetensors checkpoint seen through the text decoder's tensor prefix.
pub struct SafetensorsSource<'a> {
    pub ck: &'a Checkpoint,
    /// `model.` or `model.language_model.`; `lm_head.weight` is always top-level.
    pub prefix: &'a str,
}

impl SafetensorsSource<'_> {
    /// The checkpoint's name for a decoder-relative tensor name. An untied head is top-level
    /// `lm_head.*` in Hugging Face checkpoints and `language_model.lm_head.*` in mlx-vlm ones.
    pub fn full_name(&self, rel: &str) -> String {
        if let Some(leaf) = rel.strip_prefix("lm_head.") {
            let nested = format!("language_model.lm_head.{leaf}");
            let top_level = ["lm_head.weight", "lm_head.scales"].iter().any(|n| self.ck.get(n).is_some());
            if !top_level && self.ck.get(&nested).is_some() {
                return nested;
            }
            return rel.to_string();
        }
        format!("{}{rel}", self.prefix)
    }
}

impl crate::weights::TensorSource for SafetensorsSource<'_> {
    fn matrix(&self, rel: &str, rows: usize, cols: usize) -> Result<crate::weights::Matrix> {
        let t = self.ck.require(&self.full_name(rel), &[rows, cols])?;
        Ok(Box::new(crate::dense::DenseMatrix::from_tensor(t, rows, cols)?))
    }
    fn matrices(&self, rel: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<crate::weights::Matrix>> {
        // Stored as [n', rows', cols] with n'·rows' = n·rows (gate_up halves fold into n).
        let t = self.ck.get(&self.full_name(rel)).ok_or_else(|| {
            Error::msg(format!("missing tensor `{}` in {}", self.full_name(rel), self.ck.dir.display()))
        })?;
        if t.shape.len() != 3 || t.shape[0] * t.shape[1] != n * rows || t.shape[2] != cols {
            bail!("tensor `{}` has shape {:?}, expected {n}×{rows} rows of {cols}", t.name, t.shape);
        }
        (0..n)
            .map(|i| {
                Ok(Box::new(crate::dense::DenseMatrix::from_tensor_rows(t, i * rows, rows, cols)?)
                    as crate::weights::Matrix)
            })
            .collect()
    }
    fn vector(&self, rel: &str, len: usize) -> Result<Vec<f32>> {
        self.ck.require(&self.full_name(rel), &[len])?.to_f32_vec()
    }
    fn contains(&self, rel: &str) -> bool {
        self.ck.get(&self.full_name(rel)).is_some()
    }
}
