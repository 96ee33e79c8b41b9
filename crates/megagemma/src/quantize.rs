//! `megagemma quantize`: a bf16/f16/f32 checkpoint in, an MLX-layout 4-bit checkpoint out.
//!
//! Every matrix that `megagemma run --quant MODE` would quantize on load (the policy of
//! `megagemma_model::quant::load`) is quantized with the same function and written as MLX's
//! triplet — `X.weight` U32 `[rows, cols/8]`, `X.scales` and `X.biases` bf16 `[rows, cols/group]`
//! (MoE experts as mlx-lm's `experts.switch_glu.{gate,up,down}_proj`, `[E, rows, …]`). Every
//! other tensor is copied byte for byte. So loading the output gives bit-identical weights to
//! `--quant MODE` on the input. `config.json` gains the MLX `quantization` entry (and its copy
//! `quantization_config`); tokenizer and generation files are copied.

use anyhow::{bail, Context, Result};
use clap::Args;
use megagemma_engine::progress;
use megagemma_model::checkpoint::{Checkpoint, DType, TensorRef};
use megagemma_model::config::load_config;
use megagemma_model::dense::DenseMatrix;
use megagemma_model::plan::ModelPlan;
use megagemma_model::quant::load::{
    check_quantizable, exact_bf16_bits, load_safetensors_weights, mlx_quantization_entry, quant_group, quantize_matrix,
    text_prefix, QuantMode,
};
use megagemma_model::quant::QuantMatrix;
use std::collections::HashMap;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// Input: a Hugging Face checkpoint directory with bf16/f16/f32 safetensors (single or sharded).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// q4 (MLX affine 4-bit, group 64) or q4_0 (symmetric 4-bit, group 32).
    #[arg(short, long, value_name = "q4|q4_0")]
    pub quant: Option<String>,
    /// Output directory (created; must be empty unless --force).
    #[arg(short, long)]
    pub out: Option<PathBuf>,
    /// Write into a non-empty output directory, replacing its checkpoint files.
    #[arg(long)]
    pub force: bool,
    /// Largest safetensors file to write (e.g. 5G, 500M, 64K); larger outputs are sharded.
    #[arg(long, default_value = "5G", value_name = "SIZE")]
    pub max_shard_size: String,
}

/// Files copied from the input directory when present.
const AUX_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
];

pub fn quantize(args: QuantizeArgs) -> Result<()> {
    let Some(input) = args.model.as_deref() else {
        bail!("no input: give --model DIR (a bf16/f16/f32 safetensors checkpoint)")
    };
    let Some(out) = args.out.as_deref() else { bail!("no output: give --out DIR") };
    let mode: QuantMode = match args.quant.as_deref() {
        None => bail!("no scheme: give --quant q4 or --quant q4_0"),
        Some(q) => q.parse()?,
    };
    if mode == QuantMode::Stored {
        bail!("--quant none does not quantize: give --quant q4 or --quant q4_0");
    }
    let max_shard = parse_size(&args.max_shard_size)?;
    let resolved = megagemma_engine::resolve::resolve_model(input)?;
    let input = resolved.as_path();
    if !input.exists() {
        bail!("model directory {} does not exist", input.display());
    }
    if !input.is_dir() {
        bail!("{} is not a checkpoint directory (megagemma quantize reads safetensors checkpoints)", input.display());
    }

    let t0 = Instant::now();
    let config = load_config(input)?;
    let plan = ModelPlan::new(&config)?;
    let ck = Checkpoint::open(input)?;
    check_quantizable(&ck, &config, mode)?;
    // Validate every shape against the layer plan before writing anything (memory-mapped, cheap).
    load_safetensors_weights(&ck, &config, &plan, QuantMode::Stored)?;
    prepare_out_dir(input, out, args.force)?;
    let prefix = text_prefix(&ck, &config);

    let (tensors, jobs) = plan_tensors(&ck, &prefix, mode)?;
    let shards = split_shards(&tensors, max_shard);
    let n_shards = shards.len();
    let mut stash: HashMap<usize, (Vec<u16>, Vec<u16>)> = HashMap::new();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    let all_bytes: usize = tensors.iter().map(OutTensor::bytes).sum();
    let bar = progress::bytes(all_bytes as u64, format!("quantizing to {mode}"));
    for (i, shard) in shards.iter().enumerate() {
        let file = if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n_shards)
        };
        let path = out.join(&file);
        total += write_shard(&path, shard, &jobs, mode, &mut stash, bar.as_ref())
            .with_context(|| format!("cannot write {}", path.display()))?;
        for t in shard.iter() {
            weight_map.insert(t.name.clone(), file.clone().into());
        }
    }
    progress::finish(bar);
    if n_shards > 1 {
        let index =
            serde_json::json!({ "metadata": { "total_size": total, "format": "mlx" }, "weight_map": weight_map });
        write_json(&out.join("model.safetensors.index.json"), &index)?;
    }

    // config.json: the input's, plus the MLX quantization entry.
    let cfg_path = input.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path)?)
        .with_context(|| format!("{} is not valid JSON", cfg_path.display()))?;
    let entry = mlx_quantization_entry(mode);
    let obj = cfg.as_object_mut().context("config.json is not a JSON object")?;
    obj.insert("quantization".into(), entry.clone());
    obj.insert("quantization_config".into(), entry);
    write_json(&out.join("config.json"), &cfg)?;
    for f in AUX_FILES {
        let src = input.join(f);
        if src.is_file() {
            std::fs::copy(&src, out.join(f)).with_context(|| format!("cannot copy {}", src.display()))?;
        }
    }
    let quantized = jobs.len();
    eprintln!(
        "wrote {} ({mode}: {quantized} matrices quantized, {} tensors, {:.1} MB in {n_shards} file{}) in {:.1}s",
        out.display(),
        tensors.len(),
        total as f64 / 1e6,
        if n_shards == 1 { "" } else { "s" },
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Creates `out`, refusing a non-empty directory unless `force` (then stale checkpoint files go).
fn prepare_out_dir(input: &Path, out: &Path, force: bool) -> Result<()> {
    if out.exists() {
        if !out.is_dir() {
            bail!("--out {} exists and is not a directory", out.display());
        }
        if out.canonicalize()? == input.canonicalize()? {
            bail!("--out {} is the input directory; choose another", out.display());
        }
        let entries: Vec<PathBuf> = std::fs::read_dir(out)?.filter_map(|e| e.ok().map(|e| e.path())).collect();
        if !entries.is_empty() && !force {
            bail!("output directory {} is not empty (use --force to overwrite)", out.display());
        }
        for p in entries {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            if p.is_file() && (name.ends_with(".safetensors") || name == "model.safetensors.index.json") {
                std::fs::remove_file(&p).with_context(|| format!("cannot remove {}", p.display()))?;
            }
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))
}

/// `5G`, `500M`, `64K`, `1000` → bytes.
fn parse_size(s: &str) -> Result<usize> {
    let t = s.trim().to_ascii_uppercase();
    let t = t.strip_suffix('B').unwrap_or(&t);
    let (num, mult) = match t.chars().last() {
        Some('K') => (&t[..t.len() - 1], 1usize << 10),
        Some('M') => (&t[..t.len() - 1], 1 << 20),
        Some('G') => (&t[..t.len() - 1], 1 << 30),
        _ => (t, 1),
    };
    match num.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n * mult),
        _ => bail!("invalid --max-shard-size `{s}` (expected e.g. 5G, 500M or 64K)"),
    }
}

/// Where an output tensor's bytes come from.
enum Data {
    /// Copied from the input.
    Raw(TensorRef),
    /// Packed words of quantization job `i`.
    Weight(usize),
    /// bf16 scales / biases of job `i`.
    Scales(usize),
    Biases(usize),
}

struct OutTensor {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    data: Data,
}

impl OutTensor {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// One quantized output tensor: `count` matrices of `[rows, cols]`, matrix `e` taken from rows
/// `row0 + e·stride …` of the source viewed as `[total_rows, cols]`.
struct Job {
    src: TensorRef,
    /// The Hugging Face name relative to the text decoder (what the loader's policy sees).
    rel: String,
    count: usize,
    row0: usize,
    stride: usize,
    rows: usize,
    cols: usize,
}

impl Job {
    /// Packed words and bf16 scales/biases, exactly as `--quant` computes them on load.
    fn run(&self, mode: QuantMode) -> Result<(Vec<u32>, Vec<u16>, Vec<u16>)> {
        let (mut packed, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
        for e in 0..self.count {
            let m = DenseMatrix::from_tensor_rows(&self.src, self.row0 + e * self.stride, self.rows, self.cols)?;
            let q: QuantMatrix = quantize_matrix(&self.src.name, &m, mode)?;
            packed.extend_from_slice(q.packed());
            for (dst, src) in [(&mut scales, q.scales()), (&mut biases, q.biases())] {
                for &v in src {
                    match exact_bf16_bits(v) {
                        Some(b) => dst.push(b),
                        None => bail!("tensor `{}`: scale/bias {v} is not a bf16 value", self.src.name),
                    }
                }
            }
        }
        Ok((packed, scales, biases))
    }
}

/// Lists the output tensors (sorted: 4-byte dtypes first, then 2-byte, then 1-byte, each by name, so
/// every tensor starts aligned to its element size) and the quantization jobs.
fn plan_tensors(ck: &Checkpoint, prefix: &str, mode: QuantMode) -> Result<(Vec<OutTensor>, Vec<Job>)> {
    let mut names: Vec<&str> = ck.names().collect();
    names.sort();
    let mut out = Vec::new();
    let mut jobs: Vec<Job> = Vec::new();
    for name in names {
        let t = ck.get(name).expect("listed tensor").clone();
        let rel = if name == "lm_head.weight" || name == "language_model.lm_head.weight" {
            Some("lm_head.weight")
        } else {
            name.strip_prefix(prefix)
        };
        let float = matches!(t.dtype, DType::BF16 | DType::F16 | DType::F32);
        let mut add_job = |base: &str, job: Job, out: &mut Vec<OutTensor>| {
            let lead: Vec<usize> = if job.count > 1 || t.shape.len() == 3 { vec![job.count] } else { vec![] };
            let shape = |last: usize| -> Vec<usize> { lead.iter().copied().chain([job.rows, last]).collect() };
            let g = mode.group_size().expect("a quantizing mode");
            let i = jobs.len();
            out.push(OutTensor {
                name: format!("{base}.weight"),
                dtype: DType::U32,
                shape: shape(job.cols / 8),
                data: Data::Weight(i),
            });
            out.push(OutTensor {
                name: format!("{base}.scales"),
                dtype: DType::BF16,
                shape: shape(job.cols / g),
                data: Data::Scales(i),
            });
            out.push(OutTensor {
                name: format!("{base}.biases"),
                dtype: DType::BF16,
                shape: shape(job.cols / g),
                data: Data::Biases(i),
            });
            jobs.push(job);
        };
        match (rel, t.shape.as_slice()) {
            (Some(rel), &[rows, cols])
                if float && rel.ends_with(".weight") && quant_group(rel, cols, mode).is_some() =>
            {
                let base = name.strip_suffix(".weight").expect("ends with .weight").to_string();
                let job = Job { src: t.clone(), rel: rel.to_string(), count: 1, row0: 0, stride: 0, rows, cols };
                add_job(&base, job, &mut out);
            }
            // MoE experts: gate_up_proj [E, 2I, H] → switch_glu gate/up [E, I, H]; down_proj [E, H, I].
            (Some(rel), &[e, r, cols])
                if float
                    && quant_group(rel, cols, mode).is_some()
                    && (name.ends_with("down_proj") || r.is_multiple_of(2)) =>
            {
                let layer = name
                    .strip_suffix("experts.gate_up_proj")
                    .or_else(|| name.strip_suffix("experts.down_proj"))
                    .expect("expert tensor");
                if name.ends_with("gate_up_proj") {
                    let i = r / 2;
                    for (half, which) in ["gate", "up"].iter().enumerate() {
                        let job = Job {
                            src: t.clone(),
                            rel: rel.to_string(),
                            count: e,
                            row0: half * i,
                            stride: r,
                            rows: i,
                            cols,
                        };
                        add_job(&format!("{layer}experts.switch_glu.{which}_proj"), job, &mut out);
                    }
                } else {
                    let job = Job { src: t.clone(), rel: rel.to_string(), count: e, row0: 0, stride: r, rows: r, cols };
                    add_job(&format!("{layer}experts.switch_glu.down_proj"), job, &mut out);
                }
            }
            _ => out.push(OutTensor {
                name: name.to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: Data::Raw(t),
            }),
        }
    }
    out.sort_by(|a, b| b.dtype.size().cmp(&a.dtype.size()).then_with(|| a.name.cmp(&b.name)));
    debug_assert!(jobs.iter().all(|j| quant_group(&j.rel, j.cols, mode).is_some()));
    Ok((out, jobs))
}

/// Greedy split into files of at most `max` bytes (a bigger tensor gets a file of its own).
fn split_shards(tensors: &[OutTensor], max: usize) -> Vec<Vec<&OutTensor>> {
    let mut shards: Vec<Vec<&OutTensor>> = vec![vec![]];
    let mut size = 0;
    for t in tensors {
        let cur = shards.last_mut().expect("one shard");
        if !cur.is_empty() && size + t.bytes() > max {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().expect("one shard").push(t);
        size += t.bytes();
    }
    shards
}

/// Writes one safetensors file; returns its data size. Quantization jobs run when their weight is
/// written (weights come first); their scales and biases wait in `stash`.
fn write_shard(
    path: &Path,
    tensors: &[&OutTensor],
    jobs: &[Job],
    mode: QuantMode,
    stash: &mut HashMap<usize, (Vec<u16>, Vec<u16>)>,
    bar: Option<&progress::ProgressBar>,
) -> Result<usize> {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "mlx" }));
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.bytes();
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut w = BufWriter::new(std::fs::File::create(path)?);
    w.write_all(&(h.len() as u64).to_le_bytes())?;
    w.write_all(&h)?;
    for t in tensors {
        if let Some(b) = bar {
            b.inc(t.bytes() as u64);
        }
        match &t.data {
            Data::Raw(src) => w.write_all(src.data.bytes())?,
            Data::Weight(i) => {
                let (packed, scales, biases) = jobs[*i].run(mode)?;
                check_len(t, packed.len() * 4)?;
                for word in packed {
                    w.write_all(&word.to_le_bytes())?;
                }
                stash.insert(*i, (scales, biases));
            }
            Data::Scales(i) | Data::Biases(i) => {
                let entry = stash.get_mut(i).context("internal error: scales written before their weight")?;
                let v = std::mem::take(if matches!(t.data, Data::Scales(_)) { &mut entry.0 } else { &mut entry.1 });
                check_len(t, v.len() * 2)?;
                for x in v {
                    w.write_all(&x.to_le_bytes())?;
                }
                if entry.0.is_empty() && entry.1.is_empty() {
                    stash.remove(i);
                }
            }
        }
    }
    w.flush()?;
    Ok(offset)
}

fn check_len(t: &OutTensor, got: usize) -> Result<()> {
    if got != t.bytes() {
        bail!("internal error: tensor `{}` has {got} bytes, its header says {}", t.name, t.bytes());
    }
    Ok(())
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)? + "\n")
        .with_context(|| format!("cannot write {}", path.display()))
}
