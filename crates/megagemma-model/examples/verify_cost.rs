//! Decode steps against verify passes of COLS tokens on the CPU backend, interleaved in rounds so
//! both see the same machine load (medians of ROUNDS rounds of 4 each), or the single-thread CPU
//! time of each distinct matrix shape of layer 0 and the head with 1 vs COLS vectors.
//!
//! `cargo run --release -p megagemma-model --example verify_cost -- MODEL [ROUNDS] [COLS] [MODE]`
//! MODE: `both` (default), `decode` or `verify` (only that pass, for `perf record`), `kernels`.
//! `QUANT=q4|q4_0` quantizes a safetensors checkpoint on load.
use megagemma_model::backend::{Backend, Want};
use megagemma_model::cpu::CpuBackend;
use megagemma_model::model::Model;
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Instant;

static START: LazyLock<Instant> = LazyLock::new(Instant::now);

fn main() {
    // As the `megagemma` binary: blocks up to 32 MiB stay in the heap (no page faults per pass).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    // SAFETY: mallopt only changes allocator tuning; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
    let a: Vec<String> = std::env::args().collect();
    let quant = std::env::var("QUANT").map_or(Default::default(), |q| q.parse().unwrap());
    let mut model = Model::load_with(std::path::Path::new(&a[1]), quant).unwrap();
    model.weights.keep_cpu_layouts_only();
    let model = Arc::new(model);
    let rounds: usize = a.get(2).map_or(20, |s| s.parse().unwrap());
    let cols: usize = a.get(3).map_or(4, |s| s.parse().unwrap());
    let mode = a.get(4).cloned().unwrap_or_else(|| "both".into());
    if mode == "kernels" || mode == "matmul" {
        kernels(&model, cols, mode == "matmul");
        return;
    }
    let mut b = CpuBackend::new(model);
    let prompt: Vec<u32> = (0..64u32).map(|i| 1000 + (i * 7919 + 13) % 200000).collect();
    let seq = b.new_sequence().unwrap();
    let mut tok = b.prefill(seq, &prompt, Want::Argmax).unwrap().argmax;
    let block: Vec<u32> = prompt[..cols].to_vec();
    let (mut dec, mut ver) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        if mode != "verify" {
            let t = Instant::now();
            for _ in 0..4 {
                tok = b.decode(seq, tok, Want::Argmax).unwrap().argmax;
            }
            dec.push(t.elapsed().as_secs_f64() * 1e3 / 4.0);
            b.truncate(seq, 64).unwrap();
        }
        if mode != "decode" {
            let t = Instant::now();
            for _ in 0..4 {
                b.verify(seq, &block, Want::Argmax).unwrap();
                b.commit(seq, 0).unwrap();
            }
            ver.push(t.elapsed().as_secs_f64() * 1e3 / 4.0);
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        if v.is_empty() {
            0.0
        } else {
            v[v.len() / 2]
        }
    };
    let (d, v) = (med(&mut dec), med(&mut ver));
    let (dmin, vmin) = (dec.first().copied().unwrap_or(0.0), ver.first().copied().unwrap_or(0.0));
    println!(
        "median: decode {d:.3} ms  verify({cols}) {v:.3} ms  ratio {:.3}   best: decode {dmin:.3} verify {vmin:.3} ratio {:.3}",
        v / d,
        vmin / dmin
    );
}

#[path = "../benches/support/cpu_time.rs"]
mod cpu_time;
use cpu_time::thread_cpu_seconds as cpu_s;

/// Single-thread CPU time (or with `wall`, the wall time of the threaded `matmul`, best of 5) of
/// one full pass over each distinct matrix shape, 1 vs `cols` columns.
fn kernels(model: &Model, cols: usize, wall: bool) {
    use megagemma_model::matrix::{RowDot, WeightLayout};
    let w = &model.weights;
    let l = &w.layers[0];
    let head = w.lm_head.as_deref().unwrap_or(w.embed.as_ref());
    let mats: Vec<(&str, &dyn RowDot)> = vec![
        ("head", head),
        ("q", l.attn.q.as_ref()),
        ("k", l.attn.k.as_deref().unwrap()),
        ("v", l.attn.v.as_deref().unwrap()),
        ("o", l.attn.o.as_ref()),
        ("gate", l.mlp.gate.as_ref()),
        ("up", l.mlp.up.as_ref()),
        ("down", l.mlp.down.as_ref()),
    ];
    for (name, m) in mats {
        let kind = match m.layout() {
            WeightLayout::Gguf { kind, .. } => format!("{kind}"),
            WeightLayout::Affine4 { group_size, .. } => format!("q4 g{group_size}"),
            _ => "dense".into(),
        };
        let (r, c) = (m.rows(), m.cols());
        let xs: Vec<f32> = (0..cols * c).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let mut out1 = vec![0f32; r];
        let mut outn = vec![0f32; r * cols];
        let reps = if r > 100_000 { 3 } else { 200 };
        let (mut b1, mut bn) = (f64::MAX, f64::MAX);
        let clock = || if wall { START.elapsed().as_secs_f64() } else { cpu_s() };
        for _ in 0..5 {
            let t = clock();
            for _ in 0..reps {
                if wall {
                    megagemma_model::matrix::matmul(m, &xs[..c], &mut out1);
                } else {
                    m.dot_rows(0, &xs[..c], &mut out1);
                }
            }
            b1 = b1.min((clock() - t) / reps as f64);
            let t = clock();
            for _ in 0..reps {
                if wall {
                    megagemma_model::matrix::matmul(m, &xs, &mut outn);
                } else {
                    m.dot_rows_multi(0, &xs, &mut outn.chunks_mut(r).collect::<Vec<_>>());
                }
            }
            bn = bn.min((clock() - t) / reps as f64);
        }
        if !wall {
            assert_eq!(out1[..], outn[..r]);
        }
        println!(
            "{name:5} {kind:6} {r:6}x{c:5}  1 col {:8.3} ms ({:5.2} GB/s)  {cols} cols {:8.3} ms  ratio {:.2}",
            b1 * 1e3,
            m.stored_bytes() as f64 / b1 / 1e9,
            bn * 1e3,
            bn / b1
        );
    }
}
