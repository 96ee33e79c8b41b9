//! Finding the CUDA libraries. cudarc opens libcuda, libnvrtc and libcublas by bare name and panics
//! when it cannot; so candidate directories are preloaded by absolute path first (libnvrtc dlopens
//! its builtins and libcublas its Lt half by soname, without RUNPATH, so those go first), and every
//! CUDA call is gated on cudarc's `is_culib_present`.

use std::path::PathBuf;
use std::sync::OnceLock;

const NVRTC_LIBS: [&str; 2] = ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"];
/// cuBLAS runs the matrix products of long passes (prefill); without it they take the matvecs.
const CUBLAS_LIBS: [&str; 2] = ["libcublasLt.so.13", "libcublas.so.13"];

/// Directories searched, in order: `$MEGAGEMMA_CUDA_LIB_DIR`, `$CUDA_HOME/lib64`, the usual toolkit places.
fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Ok(d) = std::env::var("MEGAGEMMA_CUDA_LIB_DIR") {
        dirs.push(PathBuf::from(d));
    }
    if let Ok(d) = std::env::var("CUDA_HOME") {
        dirs.push(PathBuf::from(d).join("lib64"));
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib",
        "/usr/local/cuda-13.0/targets/x86_64-linux/lib",
        "/usr/local/cuda-13.0/lib64",
    ] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// Loads NVRTC and cuBLAS (and keeps them loaded), each from the first candidate directory that
/// has it. Idempotent.
pub fn preload() {
    static KEEP: OnceLock<Vec<libloading::Library>> = OnceLock::new();
    KEEP.get_or_init(|| {
        let mut kept = load_first(&NVRTC_LIBS);
        kept.extend(load_first(&CUBLAS_LIBS));
        kept
    });
}

/// `names`, in order, from the first candidate directory where all of them load.
fn load_first(names: &[&str]) -> Vec<libloading::Library> {
    for dir in candidate_dirs() {
        if !names.iter().all(|l| dir.join(l).is_file()) {
            continue;
        }
        let mut libs = Vec::new();
        for l in names {
            // SAFETY: loading a shared library runs its initialisers; these are NVIDIA's own.
            match unsafe { libloading::Library::new(dir.join(l)) } {
                Ok(lib) => libs.push(lib),
                Err(_) => break,
            }
        }
        if libs.len() == names.len() {
            return libs;
        }
    }
    Vec::new()
}

/// Whether the CUDA driver library can be opened (probed once per process: the CLI asks before
/// loading a model, to choose its layouts, and again when it opens the backend).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        preload();
        // SAFETY: only probes whether the library loads.
        unsafe { cudarc::driver::sys::is_culib_present() }
    })
}

/// Whether NVRTC can be opened.
pub fn nvrtc_present() -> bool {
    preload();
    // SAFETY: only probes whether the library loads.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether cuBLAS can be opened.
pub fn cublas_present() -> bool {
    preload();
    // SAFETY: only probes whether the library loads.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}
