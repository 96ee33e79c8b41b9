//! Compiles every kernel file to a CUBIN, exactly as the backend would, into a folder that the GPU
//! machine reads through `MEGAGEMMA_CUDA_CUBINS=DIR` (`compile::prebuilt_path`): a fresh GPU machine
//! then skips the cold NVRTC compile (about a minute and a half, most of it the megakernel) on every
//! start. `MEGAGEMMA_CUDA_DEFINES` and `MEGAGEMMA_KERNELS` apply as they do on the GPU, so a variant
//! is prebuilt by running this under its defines; files already in DIR are kept.
//! `prebuild_cubins [--verify] DIR [ARCH, default 90a]` (NVRTC from `$MEGAGEMMA_CUDA_LIB_DIR`, e.g.
//! `.cache/nvrtc`). The CUBINs are those of this NVRTC, and the key holds only its major.minor: on the
//! GPU machine, `prebuild_cubins --verify DIR` compiles every file with that machine's NVRTC and says
//! whether each prebuilt CUBIN is byte-identical to it (exit status 1 if one differs or is missing).

use megagemma_cuda::compile::{compile_cubin, kernel_source, nvrtc_version, options, prebuilt_path, KERNEL_FILES};
use megagemma_cuda::libs::nvrtc_present;
use std::path::PathBuf;

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let verify = args.first().is_some_and(|a| a == "--verify");
    if verify {
        args.remove(0);
    }
    let Some(dir) = args.first().map(PathBuf::from) else {
        eprintln!("usage: prebuild_cubins [--verify] DIR [ARCH, default 90a]");
        std::process::exit(2);
    };
    let arch = args.get(1).map_or("90a", String::as_str);
    if !nvrtc_present() {
        eprintln!("error: libnvrtc not found (set MEGAGEMMA_CUDA_LIB_DIR, e.g. to .cache/nvrtc: tools/fetch_nvrtc.sh)");
        std::process::exit(1);
    }
    let run = || -> megagemma_model::Result<()> {
        std::fs::create_dir_all(&dir).map_err(|e| megagemma_model::Error::msg(format!("{}: {e}", dir.display())))?;
        let (opts, ver) = (options(arch)?, nvrtc_version()?);
        // One thread per file: NVRTC compiles are independent, and the megakernel alone takes longest.
        let results = std::thread::scope(|s| {
            let jobs: Vec<_> = KERNEL_FILES
                .iter()
                .map(|&(file, _)| {
                    let (dir, opts, ver) = (&dir, &opts, &ver);
                    s.spawn(move || -> megagemma_model::Result<String> {
                        let src = kernel_source(file)?;
                        let path = prebuilt_path(dir, file, &src, opts, ver);
                        if verify {
                            let own = compile_cubin(file, &src, opts)?.cubin;
                            return match std::fs::read(&path) {
                                Ok(b) if b == own => Ok(format!("{file}: {} identical", path.display())),
                                Ok(b) => Err(megagemma_model::Error::msg(format!(
                                    "{file}: {} differs ({} bytes prebuilt, {} compiled here)",
                                    path.display(),
                                    b.len(),
                                    own.len()
                                ))),
                                Err(_) => {
                                    Err(megagemma_model::Error::msg(format!("{file}: {} missing", path.display())))
                                }
                            };
                        }
                        if path.is_file() {
                            return Ok(format!("{file}: {} (kept)", path.display()));
                        }
                        let started = std::time::Instant::now();
                        let c = compile_cubin(file, &src, opts)?;
                        std::fs::write(&path, &c.cubin)
                            .map_err(|e| megagemma_model::Error::msg(format!("{}: {e}", path.display())))?;
                        let secs = started.elapsed().as_secs_f64();
                        Ok(format!("{file}: {} ({} bytes, {secs:.1} s)", path.display(), c.cubin.len()))
                    })
                })
                .collect();
            jobs.into_iter().map(|j| j.join().expect("a compile thread panicked")).collect::<Vec<_>>()
        });
        let mut failed = 0;
        for r in results {
            match r {
                Ok(line) => println!("{line}"),
                Err(e) => {
                    println!("{e}");
                    failed += 1;
                }
            }
        }
        if failed > 0 {
            megagemma_model::bail!("{failed} of {} files failed", KERNEL_FILES.len());
        }
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
