//! GGUF container: a small writer here emits valid files (metadata of every value type, an F32
//! and a Q8_0 tensor); they must read back exactly, work as `RowDot` matrices, and every
//! corrupted variant must fail with one clear error line.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use megagemma_model::gguf::{GgmlType, GgufArray, GgufFile, GgufMatrix, GgufValue};
use megagemma_model::matrix::{matmul, RowDot};

#[path = "../../../tests/support/pulled_gguf.rs"]
mod pulled_gguf;

// ---------------------------------------------------------------- writer

/// Little-endian GGUF byte builder; counts the metadata keys it writes.
#[derive(Default)]
struct W(Vec<u8>, u64);

impl W {
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend(v.to_le_bytes());
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend(b);
        self
    }
    fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64).raw(s.as_bytes())
    }
    fn pos(&self) -> usize {
        self.0.len()
    }
    /// Key, value type, and returns the position where the value payload starts.
    fn key(&mut self, k: &str, ty: u32) -> usize {
        self.1 += 1;
        self.str(k).u32(ty);
        self.pos()
    }
}

/// Where the interesting fields of the written file are, for targeted corruption.
struct Layout {
    bytes: Vec<u8>,
    name_len_at: usize,
    bool_at: usize,
    f32_type_at: usize,
    u16_key_at: usize,
    alignment_at: Option<usize>,
    n_dims_at: [usize; 2],
    dims_at: [usize; 2],
    type_at: [usize; 2],
    offset_at: [usize; 2],
    data_start: usize,
    f32_values: Vec<f32>,
    q8_bytes: Vec<u8>,
}

const F32_ROWS: usize = 3;
const F32_COLS: usize = 8;
const Q8_ROWS: usize = 2;
const Q8_COLS: usize = 64;

/// Q8_0 block with scale `d` and quants `q`.
fn q8_block(d: f32, q: impl Fn(usize) -> i8) -> Vec<u8> {
    let mut b = half::f16::from_f32(d).to_bits().to_le_bytes().to_vec();
    b.extend((0..32).map(|j| q(j) as u8));
    b
}

fn build(version: u32, alignment: Option<u32>) -> Layout {
    let mut w = W::default();
    w.raw(b"GGUF").u32(version);
    w.u64(2).u64(0); // metadata count patched below

    w.key("general.architecture", 8);
    w.str("gemma3");
    let name_len_at = w.key("general.name", 8);
    w.str("tiny test");
    w.key("test.u8", 0);
    w.raw(&[200]);
    w.key("test.i8", 1);
    w.raw(&[(-5i8) as u8]);
    let u16_key_at = w.pos() + 8;
    w.key("test.u16", 2);
    w.raw(&65000u16.to_le_bytes());
    w.key("test.i16", 3);
    w.raw(&(-1234i16).to_le_bytes());
    w.key("test.u32", 4);
    w.u32(4_000_000_000);
    w.key("test.i32", 5);
    w.raw(&(-2_000_000_000i32).to_le_bytes());
    let f32_type_at = w.key("test.f32", 6) - 4;
    w.raw(&1.5f32.to_le_bytes());
    let bool_at = w.key("test.bool", 7);
    w.raw(&[1]);
    w.key("test.u64", 10);
    w.u64(1 << 40);
    w.key("test.i64", 11);
    w.raw(&(-(1i64 << 40)).to_le_bytes());
    w.key("test.f64", 12);
    w.raw(&0.1f64.to_le_bytes());
    w.key("test.small_u64", 10);
    w.u64(7);
    w.key("tokenizer.ggml.tokens", 9);
    w.u32(8).u64(4).str("<pad>").str("hello").str("wörld").str("");
    w.key("tokenizer.ggml.scores", 9);
    w.u32(6).u64(3).raw(&0.5f32.to_le_bytes()).raw(&(-1.25f32).to_le_bytes()).raw(&3.0f32.to_le_bytes());
    w.key("tokenizer.ggml.token_type", 9);
    w.u32(5).u64(3).raw(&1i32.to_le_bytes()).raw(&(-2i32).to_le_bytes()).raw(&3i32.to_le_bytes());
    w.key("test.flags", 9);
    w.u32(7).u64(3).raw(&[1, 0, 1]);
    // Array of arrays: [[1, 2], [3]] as u16.
    w.key("test.nested", 9);
    w.u32(9).u64(2);
    w.u32(2).u64(2).raw(&1u16.to_le_bytes()).raw(&2u16.to_le_bytes());
    w.u32(2).u64(1).raw(&3u16.to_le_bytes());
    let alignment_at = alignment.map(|a| {
        let at = w.key("general.alignment", 4);
        w.u32(a);
        at
    });
    let align = alignment.unwrap_or(32) as usize;
    let n_kv = w.1;
    w.0[16..24].copy_from_slice(&n_kv.to_le_bytes());

    // Tensor 0: F32 [rows=3, cols=8]; tensor 1: Q8_0 [rows=2, cols=64], at the next aligned offset.
    let f32_values: Vec<f32> = (0..F32_ROWS * F32_COLS).map(|k| k as f32 * 0.25 - 1.0).collect();
    let f32_bytes: Vec<u8> = f32_values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut q8_bytes = vec![];
    for r in 0..Q8_ROWS {
        for b in 0..Q8_COLS / 32 {
            q8_bytes.extend(q8_block(0.5 + r as f32 + b as f32 * 0.25, |j| (j as i32 * 7 - 100 + r as i32) as i8));
        }
    }
    let q8_offset = f32_bytes.len().next_multiple_of(align);

    let mut n_dims_at = [0; 2];
    let mut dims_at = [0; 2];
    let mut type_at = [0; 2];
    let mut offset_at = [0; 2];
    for (i, (name, dims, ty, off)) in
        [("norm.weight", [F32_COLS, F32_ROWS], 0u32, 0usize), ("blk.0.w", [Q8_COLS, Q8_ROWS], 8, q8_offset)]
            .into_iter()
            .enumerate()
    {
        w.str(name);
        n_dims_at[i] = w.pos();
        w.u32(2);
        dims_at[i] = w.pos();
        w.u64(dims[0] as u64).u64(dims[1] as u64);
        type_at[i] = w.pos();
        w.u32(ty);
        offset_at[i] = w.pos();
        w.u64(off as u64);
    }
    let data_start = w.pos().next_multiple_of(align);
    w.0.resize(data_start, 0);
    w.raw(&f32_bytes);
    w.0.resize(data_start + q8_offset, 0);
    w.raw(&q8_bytes);
    Layout {
        bytes: w.0,
        name_len_at,
        bool_at,
        f32_type_at,
        u16_key_at,
        alignment_at,
        n_dims_at,
        dims_at,
        type_at,
        offset_at,
        data_start,
        f32_values,
        q8_bytes,
    }
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Write `bytes` to a fresh temp file and open it; the file is removed right away (the open
/// mapping stays valid on Unix).
fn open_bytes(bytes: &[u8]) -> megagemma_model::Result<GgufFile> {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let path: PathBuf = std::env::temp_dir().join(format!("megagemma_gguf_{}_{n}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let r = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    r
}

/// The error of opening `bytes`, which must fail.
fn open_err(bytes: &[u8]) -> String {
    match open_bytes(bytes) {
        Ok(_) => panic!("corrupt file opened without error"),
        Err(e) => e.to_string(),
    }
}

fn with<T: AsRef<[u8]>>(mut bytes: Vec<u8>, at: usize, patch: T) -> Vec<u8> {
    let p = patch.as_ref();
    bytes[at..at + p.len()].copy_from_slice(p);
    bytes
}

fn assert_has(msg: &str, keywords: &[&str]) {
    for k in keywords {
        assert!(msg.contains(k), "error {msg:?} lacks {k:?}");
    }
    assert!(!msg.contains('\n'), "error is not one line: {msg:?}");
}

// ---------------------------------------------------------------- valid files

fn dequant_q8(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(34)
        .flat_map(|b| {
            let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            b[2..].iter().map(move |&q| q as i8 as f32 * d)
        })
        .collect()
}

#[test]
fn reads_back_everything_written() {
    for (version, alignment) in [(3, None), (3, Some(64)), (2, Some(32)), (2, None)] {
        let l = build(version, alignment);
        let f = open_bytes(&l.bytes).unwrap();
        let align = alignment.unwrap_or(32) as usize;
        assert_eq!(f.version(), version);
        assert_eq!(f.alignment(), align);
        assert_eq!(f.data_offset(), l.data_start);
        assert_eq!(f.data_offset() % align, 0);
        assert_eq!(f.architecture(), Some("gemma3"));
        assert_eq!(f.get_str("general.name"), Some("tiny test"));

        assert_eq!(f.metadata("test.u8"), Some(&GgufValue::U8(200)));
        assert_eq!(f.metadata("test.i8"), Some(&GgufValue::I8(-5)));
        assert_eq!(f.metadata("test.u16"), Some(&GgufValue::U16(65000)));
        assert_eq!(f.metadata("test.i16"), Some(&GgufValue::I16(-1234)));
        assert_eq!(f.metadata("test.u32"), Some(&GgufValue::U32(4_000_000_000)));
        assert_eq!(f.metadata("test.i32"), Some(&GgufValue::I32(-2_000_000_000)));
        assert_eq!(f.metadata("test.f32"), Some(&GgufValue::F32(1.5)));
        assert_eq!(f.metadata("test.bool"), Some(&GgufValue::Bool(true)));
        assert_eq!(f.metadata("test.u64"), Some(&GgufValue::U64(1 << 40)));
        assert_eq!(f.metadata("test.i64"), Some(&GgufValue::I64(-(1 << 40))));
        assert_eq!(f.metadata("test.f64"), Some(&GgufValue::F64(0.1)));
        assert_eq!(f.metadata("missing"), None);

        // Typed helpers convert between integer widths only when lossless.
        assert_eq!(f.get_u32("test.u8"), Some(200));
        assert_eq!(f.get_u32("test.small_u64"), Some(7));
        assert_eq!(f.get_u32("test.u64"), None, "2^40 does not fit u32");
        assert_eq!(f.get_u64("test.u64"), Some(1 << 40));
        assert_eq!(f.get_u32("test.i8"), None, "negative");
        assert_eq!(f.get_i32("test.i16"), Some(-1234));
        assert_eq!(f.get_i64("test.i64"), Some(-(1 << 40)));
        assert_eq!(f.get_f32("test.f32"), Some(1.5));
        assert_eq!(f.get_f64("test.f64"), Some(0.1));
        assert_eq!(f.get_bool("test.bool"), Some(true));
        assert_eq!(f.get_str("test.u8"), None, "wrong type");
        assert_eq!(f.get_u32("general.name"), None, "wrong type");

        let tokens: Vec<&str> = f.get_str_array("tokenizer.ggml.tokens").unwrap().iter().map(|s| s.as_str()).collect();
        assert_eq!(tokens, ["<pad>", "hello", "wörld", ""]);
        assert_eq!(f.get_f32_array("tokenizer.ggml.scores"), Some(&[0.5, -1.25, 3.0][..]));
        assert_eq!(f.get_i32_array("tokenizer.ggml.token_type"), Some(&[1, -2, 3][..]));
        assert_eq!(f.get_bool_array("test.flags"), Some(&[true, false, true][..]));
        assert_eq!(f.get_f32_array("tokenizer.ggml.token_type"), None, "wrong element type");
        assert_eq!(
            f.get_array("test.nested"),
            Some(&GgufArray::Array(vec![GgufArray::U16(vec![1, 2]), GgufArray::U16(vec![3])]))
        );
        let keys: Vec<&str> = f.metadata_entries().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys[..3], ["general.architecture", "general.name", "test.u8"], "file order kept");

        assert_eq!(f.tensors().len(), 2);
        let t0 = f.tensor("norm.weight").unwrap();
        assert_eq!((t0.dims.clone(), t0.ggml_type, t0.offset), (vec![8, 3], GgmlType::F32, 0));
        assert_eq!((t0.n_elements, t0.n_bytes, t0.shape()), (24, 96, vec![3, 8]));
        let t1 = f.tensor("blk.0.w").unwrap();
        assert_eq!((t1.dims.clone(), t1.ggml_type), (vec![64, 2], GgmlType::Q8_0));
        assert_eq!((t1.n_elements, t1.n_bytes), (128, 136));
        assert_eq!(t1.offset as usize, 96usize.next_multiple_of(align));
        assert!(f.tensor("nope").is_none());

        assert_eq!(f.tensor_bytes(t1), &l.q8_bytes[..]);
        assert_eq!(f.tensor_to_f32(t0).unwrap(), l.f32_values);
        assert_eq!(f.tensor_to_f32(t1).unwrap(), dequant_q8(&l.q8_bytes));
    }
}

#[test]
fn tensors_work_as_rowdot_matrices() {
    let l = build(3, Some(64));
    let f = open_bytes(&l.bytes).unwrap();
    let q8 = f.matrix("blk.0.w").unwrap();
    let norm = f.matrix("norm.weight").unwrap();
    drop(f); // matrices keep the mapping alive on their own

    let cases: [(&GgufMatrix, Vec<f32>, usize); 2] =
        [(&q8, dequant_q8(&l.q8_bytes), 136), (&norm, l.f32_values.clone(), 96)];
    for (m, dense, bytes) in cases {
        let (rows, cols) = (dense.len() / m.cols(), m.cols());
        assert_eq!(m.rows(), rows);
        assert_eq!(m.stored_bytes(), bytes);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.row_to_f32(r, &mut row);
            assert_eq!(row, dense[r * cols..(r + 1) * cols]);
        }
        // Two tokens through the shared matmul path (exercises dot_rows with a start offset).
        let xs: Vec<f32> = (0..2 * cols).map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0).collect();
        let mut ys = vec![0f32; 2 * rows];
        matmul(m, &xs, &mut ys);
        for t in 0..2 {
            for r in 0..rows {
                let want: f64 = (0..cols).map(|c| dense[r * cols + c] as f64 * xs[t * cols + c] as f64).sum();
                let mag: f64 = (0..cols).map(|c| (dense[r * cols + c] as f64 * xs[t * cols + c] as f64).abs()).sum();
                let got = ys[t * rows + r] as f64;
                assert!((got - want).abs() <= 1e-5 * mag, "{} row {r} token {t}: {got} vs {want}", m.ggml_type());
            }
        }
        let mut one = [0f32; 1];
        m.dot_rows(rows - 1, &xs[..cols], &mut one);
        assert_eq!(one[0], ys[rows - 1]);
        // Verify-sized passes (whole and partial groups of vectors, row pairs and single rows):
        // every column bit-identical to the single-vector product.
        for t in [4, 5, 9] {
            let xs: Vec<f32> = (0..t * cols).map(|i| ((i * 53 % 29) as f32 - 14.0) / 3.0).collect();
            let mut ys = vec![0f32; t * rows];
            matmul(m, &xs, &mut ys);
            for ti in 0..t {
                let mut want = vec![0f32; rows];
                m.dot_rows(0, &xs[ti * cols..(ti + 1) * cols], &mut want);
                let got = &ys[ti * rows..(ti + 1) * rows];
                assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "t {t} token {ti}");
            }
        }
    }
}

#[test]
fn unsupported_tensor_type_is_a_clear_error_at_use() {
    // I32 has the same byte size as F32, so the file stays valid; only using it fails.
    let l = build(3, None);
    let f = open_bytes(&with(l.bytes.clone(), l.type_at[0], 26u32.to_le_bytes())).unwrap();
    let t = f.tensor("norm.weight").unwrap();
    assert_eq!(t.ggml_type, GgmlType::I32);
    assert_has(&f.matrix("norm.weight").err().unwrap().to_string(), &["norm.weight", "I32"]);
    assert_has(&f.tensor_to_f32(t).unwrap_err().to_string(), &["norm.weight", "I32"]);
    assert_has(&f.matrix("absent").err().unwrap().to_string(), &["absent"]);
}

// ---------------------------------------------------------------- corrupt files

#[test]
fn every_truncation_is_rejected() {
    // The last tensor ends exactly at EOF, so every proper prefix is invalid.
    let l = build(3, Some(64));
    for cut in 0..l.bytes.len() {
        let e = open_err(&l.bytes[..cut]);
        assert_has(&e, &["truncated", "megagemma_gguf_"]);
    }
}

#[test]
fn bad_magic_and_versions() {
    let l = build(3, None);
    assert_has(&open_err(&with(l.bytes.clone(), 0, b"GGML")), &["not a GGUF file", "magic"]);
    assert_has(&open_err(&with(l.bytes.clone(), 4, 1u32.to_le_bytes())), &["version 1"]);
    assert_has(&open_err(&with(l.bytes.clone(), 4, 4u32.to_le_bytes())), &["version 4"]);
    assert_has(&open_err(&with(l.bytes.clone(), 4, 3u32.to_be_bytes())), &["big-endian"]);
}

#[test]
fn absurd_counts_and_lengths() {
    let l = build(3, None);
    let b = &l.bytes;
    // Counts far beyond what the file could hold must fail before any allocation.
    assert_has(&open_err(&with(b.clone(), 8, (1u64 << 40).to_le_bytes())), &["tensor count"]);
    assert_has(&open_err(&with(b.clone(), 8, u64::MAX.to_le_bytes())), &["tensor count"]);
    assert_has(&open_err(&with(b.clone(), 16, (1u64 << 40).to_le_bytes())), &["metadata count"]);
    // A string length running past EOF, huge or just one byte too many.
    assert_has(&open_err(&with(b.clone(), l.name_len_at, u64::MAX.to_le_bytes())), &["string length", "general.name"]);
    let just_past = (b.len() - l.name_len_at - 8 + 1) as u64;
    assert_has(&open_err(&with(b.clone(), l.name_len_at, just_past.to_le_bytes())), &["string length"]);
    // An array count beyond the file: patch the tokens array length (after its u32 type).
    let tokens_at = find(b, b"tokenizer.ggml.tokens") + 21 + 4 + 4;
    assert_has(&open_err(&with(b.clone(), tokens_at, (1u64 << 50).to_le_bytes())), &["array", "tokenizer.ggml.tokens"]);
}

#[test]
fn bad_tensor_infos() {
    let l = build(3, None);
    let b = &l.bytes;
    // Data past the end of the file (offset aligned but far away).
    assert_has(
        &open_err(&with(b.clone(), l.offset_at[1], (1u64 << 20).to_le_bytes())),
        &["blk.0.w", "past end of file"],
    );
    assert_has(
        &open_err(&with(b.clone(), l.offset_at[1], (u64::MAX - 31).to_le_bytes())),
        &["blk.0.w", "past end of file"],
    );
    // Dimensions making the tensor larger than the file.
    assert_has(
        &open_err(&with(b.clone(), l.dims_at[0] + 8, (1u64 << 30).to_le_bytes())),
        &["norm.weight", "past end of file"],
    );
    // Dimensions whose product overflows.
    let huge =
        with(with(b.clone(), l.dims_at[0], (1u64 << 40).to_le_bytes()), l.dims_at[0] + 8, (1u64 << 40).to_le_bytes());
    assert_has(&open_err(&huge), &["norm.weight", "overflow"]);
    assert_has(&open_err(&with(b.clone(), l.type_at[1], 99u32.to_le_bytes())), &["blk.0.w", "unknown ggml type id 99"]);
    assert_has(&open_err(&with(b.clone(), l.offset_at[1], 8u64.to_le_bytes())), &["blk.0.w", "aligned"]);
    assert_has(
        &open_err(&with(b.clone(), l.dims_at[1], 48u64.to_le_bytes())),
        &["blk.0.w", "multiple of the Q8_0 block size 32"],
    );
    assert_has(&open_err(&with(b.clone(), l.n_dims_at[0], 5u32.to_le_bytes())), &["norm.weight", "dimensions"]);
}

#[test]
fn bad_metadata_values() {
    let l = build(3, Some(64));
    let b = &l.bytes;
    assert_has(&open_err(&with(b.clone(), l.bool_at, [2u8])), &["test.bool", "bool"]);
    assert_has(&open_err(&with(b.clone(), l.f32_type_at, 13u32.to_le_bytes())), &["test.f32", "value type 13"]);
    assert_has(&open_err(&with(b.clone(), l.u16_key_at, b"test.u32")), &["duplicate", "test.u32"]);
    assert_has(&open_err(&with(b.clone(), l.alignment_at.unwrap(), 48u32.to_le_bytes())), &["alignment"]);
    assert_has(&open_err(&with(b.clone(), l.alignment_at.unwrap(), 0u32.to_le_bytes())), &["alignment"]);
    // Invalid UTF-8 in a string value.
    assert_has(&open_err(&with(b.clone(), l.name_len_at + 8, [0xff])), &["general.name", "UTF-8"]);
}

#[test]
fn missing_file() {
    let e = GgufFile::open("/nonexistent/megagemma/model.gguf").unwrap_err().to_string();
    assert_has(&e, &["/nonexistent/megagemma/model.gguf", "cannot open"]);
}

fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).position(|w| w == needle).unwrap()
}

// ---------------------------------------------------------------- a real model, when present

/// The Gemma 3 270M Q4_K_M file `megagemma pull` fetches (pulled on first use). Its
/// dequantization was cross-checked bit-for-bit against llama.cpp's gguf-py for all 236 tensors;
/// here: structure, and fused dots against dequantize-then-dot for every quant type it uses.
#[test]
fn real_gemma3_file() {
    let path = pulled_gguf::gemma3_270m_gguf();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!((f.version(), f.architecture()), (3, Some("gemma3")));
    assert_eq!(f.get_u32("gemma3.block_count"), Some(18));
    assert_eq!(f.get_u32("gemma3.embedding_length"), Some(640));
    let vocab = f.get_str_array("tokenizer.ggml.tokens").unwrap().len();
    assert_eq!(f.tensor("token_embd.weight").unwrap().dims, vec![640, vocab as u64]);
    assert_eq!(f.tensors().len(), 236);
    assert!(f.tensors().iter().all(|t| t.ggml_type.is_supported()));

    // One matrix per quant type: Q8_0 (embedding / tied head), Q5_0, Q4_K, Q6_K.
    for name in ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight"] {
        let info = f.tensor(name).unwrap();
        let m = f.matrix(name).unwrap();
        assert_eq!((m.cols(), m.rows()), (info.dims[0] as usize, info.dims[1] as usize));
        assert_eq!(m.stored_bytes(), info.n_bytes);
        let x: Vec<f32> = (0..m.cols()).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 1000.0).collect();
        let mut w = vec![0f32; m.cols()];
        let mut out = [0f32; 8];
        for start in [0, m.rows() / 2, m.rows() - 8] {
            m.dot_rows(start, &x, &mut out);
            for (i, &got) in out.iter().enumerate() {
                m.row_to_f32(start + i, &mut w);
                let exact: f64 = w.iter().zip(&x).map(|(&w, &x)| w as f64 * x as f64).sum();
                let mag: f64 = w.iter().zip(&x).map(|(&w, &x)| (w as f64 * x as f64).abs()).sum();
                assert!(w.iter().all(|v| v.is_finite()), "{name} row {}", start + i);
                assert!((got as f64 - exact).abs() <= 1e-5 * mag, "{name} row {}: {got} vs {exact}", start + i);
            }
        }
    }
}
