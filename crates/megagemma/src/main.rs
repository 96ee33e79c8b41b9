//! `megagemma`: run Gemma models from the command line.

mod backend_args;
mod bench;
mod chat;
mod demo;
mod info;
mod pull;
mod quantize;
mod run;
mod sampling_args;
mod serve;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "megagemma", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("MEGAGEMMA_COMMIT"), ")"), about = "Gemma 4 inference engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Run(Box<run::RunArgs>),
    /// Download a known model into the local cache and print its path.
    Pull(pull::PullArgs),
    /// Describe a model: architecture, layer plan, bytes streamed per decode step.
    Info(info::InfoArgs),
    /// Measure decode speed against the memory bandwidth ceiling.
    Bench(Box<bench::BenchArgs>),
    /// Write a 4-bit (MLX-layout) copy of a bf16/f16/f32 checkpoint.
    Quantize(quantize::QuantizeArgs),
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(Box<serve::ServeArgs>),
    /// Talk to a model in the terminal (streaming; /reset, /system TEXT, /quit).
    Chat(Box<chat::ChatArgs>),
}

/// A prefill chunk's activations (megabytes per layer) are freed and allocated again every layer
/// and pass. By default glibc returns such blocks to the kernel and faults them in again (~5% of a
/// 512-token prefill on the 2-core dev VM); keep them in the heap instead (blocks up to 32 MiB,
/// glibc's largest threshold).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory() {
    // SAFETY: mallopt only changes allocator tuning; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

fn main() -> ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    keep_freed_memory();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(*args),
        Command::Pull(args) => pull::pull(args),
        Command::Bench(args) => bench::bench(*args),
        Command::Info(args) => info::info(args),
        Command::Quantize(args) => quantize::quantize(args),
        Command::Serve(args) => serve::serve(*args),
        Command::Chat(args) => chat::chat(*args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line: the error and its causes, outermost first.
            let msg = e.chain().map(|c| c.to_string()).collect::<Vec<_>>().join(": ");
            eprintln!("error: {}", msg.replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
