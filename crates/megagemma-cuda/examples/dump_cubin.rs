//! Writes the CUBIN of one kernel file, compiled exactly as the backend compiles it, for reading
//! its SASS without a GPU (`cuobjdump -sass`, from PyPI's nvidia-cuda-cuobjdump):
//! `dump_cubin matvec_mma.cu out.cubin [arch]` (NVRTC from `$MEGAGEMMA_CUDA_LIB_DIR`, e.g. `.cache/nvrtc`).

use megagemma_cuda::compile::{compile_cubin, kernel_source, options};
use megagemma_cuda::libs::nvrtc_present;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(file), Some(out)) = (args.first(), args.get(1)) else {
        eprintln!("usage: dump_cubin KERNEL_FILE.cu OUT.cubin [ARCH, default 90a]");
        std::process::exit(2);
    };
    let arch = args.get(2).map_or("90a", String::as_str);
    if !nvrtc_present() {
        eprintln!("error: libnvrtc not found (set MEGAGEMMA_CUDA_LIB_DIR, e.g. to .cache/nvrtc: tools/fetch_nvrtc.sh)");
        std::process::exit(1);
    }
    let run = || -> megagemma_model::Result<()> {
        let src = kernel_source(file)?;
        let compiled = compile_cubin(file, &src, &options(arch)?)?;
        std::fs::write(out, &compiled.cubin).map_err(|e| megagemma_model::Error::msg(format!("{out}: {e}")))?;
        eprint!("{}", compiled.log);
        Ok(())
    };
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
