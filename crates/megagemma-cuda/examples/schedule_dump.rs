//! Writes the megakernel schedule of a synthetic model as a flat table for
//! `tools/probes/schedule_dry_run.cu` (which runs it on the GPU with empty jobs, to measure what
//! the waits alone cost per token), and prints its summary.
//!
//! `cargo run --release -p megagemma-cuda --example schedule_dump -- e4b 264 OUT.bin`
//!
//! Format (little-endian u32): grid, jobs, items; per item its producer count; per job its number
//! of signalled items, those items, its number of waits, the waited items; per block its number
//! of jobs, then the job indices.
use megagemma_cuda::schedule::Schedule;
use megagemma_cuda::synthetic::synthetic_config;
use megagemma_model::plan::ModelPlan;

fn main() -> megagemma_model::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    let (name, grid, out) = match a.as_slice() {
        [_, n, g, o] => (n.as_str(), g.parse().map_err(|_| megagemma_model::Error::msg("grid: a number"))?, o),
        _ => megagemma_model::bail!("usage: schedule_dump MODEL GRID OUT.bin"),
    };
    let s = Schedule::build(&ModelPlan::new(&synthetic_config(name)?)?, grid)?;
    println!("{name}: {s}");
    let mut w: Vec<u32> = vec![grid as u32, s.jobs.len() as u32, s.items.len() as u32];
    w.extend(s.items.iter().map(|i| i.producers));
    for j in &s.jobs {
        w.push(j.signals.len() as u32);
        w.extend(j.signals.iter().map(|&i| i as u32));
        w.push(j.waits.len() as u32);
        w.extend(j.waits.iter().map(|&i| i as u32));
    }
    for b in &s.blocks {
        w.push(b.len() as u32);
        w.extend(b.iter().map(|&j| j as u32));
    }
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(out, bytes).map_err(|e| megagemma_model::Error::msg(format!("{out}: {e}")))?;
    Ok(())
}
