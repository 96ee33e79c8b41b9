//! Kernel sources and their compilation: header-free `.cu` files embedded in the binary (or read
//! from `$MEGAGEMMA_KERNELS` at run time), `#include "common.cuh"` inlined here, compiled by NVRTC
//! to a CUBIN for the device's `sm_XXa` and cached on disk.

use megagemma_model::{bail, Error, Result};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// `(file name, embedded source)` of every kernel file.
pub const KERNEL_FILES: [(&str, &str); 9] = [
    ("matvec.cu", include_str!("../kernels/matvec.cu")),
    ("matvec_mma.cu", include_str!("../kernels/matvec_mma.cu")),
    ("ops.cu", include_str!("../kernels/ops.cu")),
    ("attention.cu", include_str!("../kernels/attention.cu")),
    ("prefill.cu", include_str!("../kernels/prefill.cu")),
    ("synth.cu", include_str!("../kernels/synth.cu")),
    ("draft.cu", include_str!("../kernels/draft.cu")),
    ("sample.cu", include_str!("../kernels/sample.cu")),
    ("megakernel.cu", include_str!("../kernels/megakernel.cu")),
];
const COMMON: &str = include_str!("../kernels/common.cuh");

/// The text of one kernel file or `common.cuh`: from `$MEGAGEMMA_KERNELS/<file>` when set, else
/// the embedded copy.
fn read_kernel_file(file: &str) -> Result<String> {
    match std::env::var("MEGAGEMMA_KERNELS") {
        Ok(dir) => {
            let path = PathBuf::from(dir).join(file);
            std::fs::read_to_string(&path)
                .map_err(|e| Error::msg(format!("cannot read kernel {}: {e}", path.display())))
        }
        Err(_) if file == "common.cuh" => Ok(COMMON.to_string()),
        Err(_) => match KERNEL_FILES.iter().find(|(n, _)| *n == file) {
            Some((_, src)) => Ok(src.to_string()),
            None => bail!("no kernel file named {file}"),
        },
    }
}

/// The source of `file` as NVRTC compiles it: `#include`s of other kernel files inlined (the
/// megakernel includes the stage files), then `common.cuh` inlined once.
pub fn kernel_source(file: &str) -> Result<String> {
    let mut lines = Vec::new();
    for l in read_kernel_file(file)?.lines() {
        let included = l.trim().strip_prefix("#include \"").and_then(|r| r.strip_suffix('"'));
        match included {
            Some(name) if name != "common.cuh" => lines.push(read_kernel_file(name)?),
            _ => lines.push(l.to_string()),
        }
    }
    Ok(preprocess(&lines.join("\n"), &read_kernel_file("common.cuh")?))
}

/// Replaces the first `#include "common.cuh"` line with the header's text (minus its `#pragma
/// once`) and drops any later one.
pub fn preprocess(src: &str, common: &str) -> String {
    let common: String = common.lines().filter(|l| l.trim() != "#pragma once").collect::<Vec<_>>().join("\n");
    let mut seen = false;
    src.lines()
        .filter_map(|l| match l.trim() == "#include \"common.cuh\"" {
            true if seen => None,
            true => {
                seen = true;
                Some(common.as_str())
            }
            false => Some(l),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// NVRTC options for a device of compute capability `arch` (e.g. "90a"), with the kernel
/// experiments `MEGAGEMMA_CUDA_DEFINES` switches on ([`defines`]).
pub fn options(arch: &str) -> Result<Vec<String>> {
    let mut opts =
        vec![format!("--gpu-architecture=sm_{arch}"), "--std=c++17".into(), "-lineinfo".into(), "-Xptxas=-v".into()];
    if let Ok(list) = std::env::var("MEGAGEMMA_CUDA_DEFINES") {
        opts.extend(defines(&list)?);
    }
    Ok(opts)
}

/// The items of a `MEGAGEMMA_CUDA_DEFINES` list: each as written, with its name and value ("" when
/// none), as NVRTC gets them.
fn define_items(list: &str) -> impl Iterator<Item = (&str, &str, &str)> {
    list.split([',', ';']).map(str::trim).filter(|s| !s.is_empty()).map(|item| {
        let (name, val) = item.split_once('=').unwrap_or((item, ""));
        (item, name, val)
    })
}

/// The value `NAME=VALUE` gives `name` in a `MEGAGEMMA_CUDA_DEFINES` list (`None` when absent or
/// given without a value): host settings that must follow a define read it here.
pub fn define_in<'a>(list: &'a str, name: &str) -> Option<&'a str> {
    define_items(list).find(|(_, n, v)| *n == name && !v.is_empty()).map(|(_, _, v)| v)
}

/// Whether a `MEGAGEMMA_CUDA_DEFINES` list names `name` (with or without a value): host code that
/// must match a define's kernels reads it here.
pub fn define_named(list: &str, name: &str) -> bool {
    define_items(list).any(|(_, n, _)| n == name)
}

/// `-D` options from a list of `NAME` or `NAME=VALUE` separated by `,` or `;` (C identifiers;
/// values of letters, digits, `_`, `.`, `+`, `-`): opt-in kernel variants, compiled only when asked
/// for and cached under their own key (the options are part of it). `;` lets one
/// `tools/gpu_ab.sh` variant (whose settings are comma-separated) carry several.
pub fn defines(list: &str) -> Result<Vec<String>> {
    let ident = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    let value = |s: &str| s.chars().all(|c| c.is_ascii_alphanumeric() || "_.+-".contains(c));
    let mut out = Vec::new();
    for (item, name, val) in define_items(list) {
        if !ident(name) || !value(val) {
            bail!("MEGAGEMMA_CUDA_DEFINES: '{item}' is not NAME or NAME=VALUE (a C identifier; a value of letters, digits, _ . + -)");
        }
        out.push(format!("-D{item}"));
    }
    Ok(out)
}

/// A compiled module: the CUBIN and NVRTC's log (the `-Xptxas=-v` register/spill report).
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

fn nvrtc_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::msg(format!("NVRTC {what}: {e:?}"))
}

/// NVRTC's version as "major.minor".
pub fn nvrtc_version() -> Result<String> {
    let (mut maj, mut min) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut maj, &mut min) }.result().map_err(|e| nvrtc_err("version", e))?;
    Ok(format!("{maj}.{min}"))
}

/// Compiles one preprocessed source to a CUBIN (no cache). The caller has checked that NVRTC is present.
pub fn compile_cubin(name: &str, src: &str, opts: &[String]) -> Result<Compiled> {
    use cudarc::nvrtc::{result, sys};
    let csrc = CString::new(src).map_err(|_| Error::msg(format!("kernel {name} contains a NUL byte")))?;
    let cname = CString::new(name).map_err(|_| Error::msg(format!("bad kernel name {name}")))?;
    let prog = result::create_program(&csrc, Some(&cname)).map_err(|e| nvrtc_err("create_program", e))?;
    // SAFETY: `prog` is a live program until destroyed below; buffers are sized by NVRTC.
    unsafe {
        let r = result::compile_program(prog, opts);
        let log = result::get_program_log(prog).map_err(|e| nvrtc_err("log", e))?;
        let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
        if r.is_err() {
            let _ = result::destroy_program(prog);
            bail!("kernel {name} does not compile:\n{log}");
        }
        let mut size = 0usize;
        sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| nvrtc_err("cubin size", e))?;
        let mut cubin = vec![0u8; size];
        sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _).result().map_err(|e| nvrtc_err("cubin", e))?;
        result::destroy_program(prog).map_err(|e| nvrtc_err("destroy", e))?;
        Ok(Compiled { cubin, log })
    }
}

/// Register and spill figures of one kernel, parsed from the ptxas report.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelReport {
    pub function: String,
    pub registers: u32,
    pub spill_bytes: u32,
}

/// Parses ptxas `-v` lines: "Compiling entry function 'f'", "... N bytes spill stores, M bytes
/// spill loads", "Used R registers". The spill line after "Function properties for g" of another
/// (non-inlined) function g belongs to g, not to the entry compiled before it.
pub fn parse_ptxas(log: &str) -> Vec<KernelReport> {
    let mut out: Vec<KernelReport> = Vec::new();
    let mut own = false; // the last "Function properties" line named the current entry
    for line in log.lines() {
        if let Some(rest) = line.split("entry function '").nth(1) {
            let f = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelReport { function: f, registers: 0, spill_bytes: 0 });
            own = true;
        } else if let Some(name) = line.split("Function properties for ").nth(1) {
            own = out.last().is_some_and(|k| k.function == name.trim());
        } else if let Some(cur) = out.last_mut() {
            let num_before = |key: &str| -> Option<u32> {
                let i = line.find(key)?;
                line[..i].split_whitespace().last()?.parse().ok()
            };
            if let (true, Some(st), Some(ld)) = (own, num_before("bytes spill stores"), num_before("bytes spill loads"))
            {
                cur.spill_bytes = st + ld;
            }
            if let Some(rest) = line.split("Used ").nth(1) {
                if let Some(r) = rest.split_whitespace().next().and_then(|r| r.parse().ok()) {
                    cur.registers = r;
                }
            }
        }
    }
    out
}

/// FNV-1a, 64-bit: a stable hash for the cache key (std's hasher is not stable across releases).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in p.iter().chain(&[0xffu8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("MEGAGEMMA_CACHE") {
        return Some(PathBuf::from(d).join("kernels"));
    }
    std::env::var("HOME").ok().map(|h| PathBuf::from(h).join(".cache/megagemma/kernels"))
}

/// Where a prebuilt CUBIN of `file` lies in `dir` (`MEGAGEMMA_CUDA_CUBINS`): keyed by the source, the
/// options (architecture and defines) and the NVRTC version, not by the GPU or the driver — an
/// `sm_90a` CUBIN is the same program on any `sm_90a` device. Written by the `prebuild_cubins`
/// example on a machine without a GPU, so the GPU machine skips a cold compile (about a minute and a
/// half, most of it the megakernel) each time it starts.
pub fn prebuilt_path(dir: &Path, file: &str, src: &str, opts: &[String], nvrtc: &str) -> PathBuf {
    let key = fnv1a(&[src.as_bytes(), opts.join(" ").as_bytes(), nvrtc.as_bytes()]);
    dir.join(format!("{}-{key:016x}.cubin", file.trim_end_matches(".cu")))
}

/// The CUBIN of `file` for this device: a prebuilt one from `$MEGAGEMMA_CUDA_CUBINS` when there is
/// one for this source, these options and this NVRTC version ([`prebuilt_path`]), else from the
/// disk cache when the key (source, options, NVRTC version, GPU name and driver) matches, else
/// compiled and stored. A cache that cannot be written is not an error.
pub fn cubin_for(file: &str, arch: &str, device_key: &str) -> Result<Vec<u8>> {
    let prebuilt = std::env::var_os("MEGAGEMMA_CUDA_CUBINS").map(PathBuf::from);
    cubin_from(file, arch, device_key, prebuilt.as_deref())
}

/// [`cubin_for`] with the prebuilt folder given.
pub fn cubin_from(file: &str, arch: &str, device_key: &str, prebuilt: Option<&Path>) -> Result<Vec<u8>> {
    let src = kernel_source(file)?;
    let opts = options(arch)?;
    let ver = nvrtc_version()?;
    if let Some(dir) = prebuilt {
        if let Ok(bytes) = std::fs::read(prebuilt_path(dir, file, &src, &opts, &ver)) {
            return Ok(bytes);
        }
    }
    let key = fnv1a(&[src.as_bytes(), opts.join(" ").as_bytes(), ver.as_bytes(), device_key.as_bytes()]);
    let path = cache_dir().map(|d| d.join(format!("{}-{key:016x}.cubin", file.trim_end_matches(".cu"))));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            return Ok(bytes);
        }
    }
    let c = compile_cubin(file, &src, &opts)?;
    if let Some(p) = &path {
        let _ = std::fs::create_dir_all(p.parent().unwrap()).and_then(|_| {
            // A name of its own per writer (threads of one process too), then an atomic rename: a
            // reader never sees a partly written file.
            static WRITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
            let n = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let tmp = p.with_extension(format!("tmp{}-{n}", std::process::id()));
            std::fs::write(&tmp, &c.cubin)?;
            std::fs::rename(&tmp, p)
        });
    }
    Ok(c.cubin)
}

/// The value of `#define NAME value` in the embedded kernel file `file` or `common.cuh` (what
/// follows the name, up to a `//` comment): host constants that mirror a kernel's are tested
/// against it.
#[cfg(test)]
pub(crate) fn kernel_define(file: &str, name: &str) -> String {
    let src = match file {
        "common.cuh" => COMMON,
        _ => KERNEL_FILES.iter().find(|(f, _)| *f == file).map(|(_, s)| *s).expect(file),
    };
    let head = format!("#define {name} ");
    let line = src.lines().find(|l| l.starts_with(&head)).expect(name);
    line[head.len()..].split("//").next().unwrap_or_default().trim().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_define_value_is_found_by_name() {
        assert_eq!(define_in("MMA_U1=2;MMA_BLOCKS_PER_SM=3", "MMA_BLOCKS_PER_SM"), Some("3"));
        assert_eq!(define_in("MMA_BLOCKS_PER_SM_X=3, MMA_BLOCKS_PER_SM = 4", "MMA_BLOCKS_PER_SM"), None);
        assert_eq!(define_in("MMA_BLOCKS_PER_SM", "MMA_BLOCKS_PER_SM"), None);
        assert_eq!(define_in("", "MMA_BLOCKS_PER_SM"), None);
    }

    #[test]
    fn defines_become_d_options_and_bad_ones_are_refused() {
        assert_eq!(defines("MMA_SCALES_F4, X=3,,Y_2=a.b").unwrap(), ["-DMMA_SCALES_F4", "-DX=3", "-DY_2=a.b"]);
        assert_eq!(defines("MMA_U1=2;RES_KEEP=0").unwrap(), ["-DMMA_U1=2", "-DRES_KEEP=0"]);
        assert!(defines("").unwrap().is_empty());
        assert!(define_named("A=1;FIXED_SUMS", "FIXED_SUMS") && define_named("FIXED_SUMS=1", "FIXED_SUMS"));
        assert!(!define_named("FIXED_SUMSX,A", "FIXED_SUMS") && !define_named("", "FIXED_SUMS"));
        for bad in ["1X", "A B", "X=$(rm)", "X=\"y\"", "-DX"] {
            let e = defines(bad).unwrap_err().to_string();
            assert!(e.contains("MEGAGEMMA_CUDA_DEFINES") && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn include_line_is_replaced_once_without_pragma() {
        let out = preprocess("a\n#include \"common.cuh\"\nb", "#pragma once\nX\nY");
        assert_eq!(out, "a\nX\nY\nb");
    }

    #[test]
    fn ptxas_report_is_parsed() {
        let log = "ptxas info    : Compiling entry function 'matvec' for 'sm_90a'\n\
                   ptxas info    : Function properties for matvec\n\
                   \x20   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 40 registers, used 0 barriers, 380 bytes cmem[0]\n\
                   ptxas info    : Compiling entry function 'rope' for 'sm_90a'\n\
                   \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Used 12 registers\n";
        let r = parse_ptxas(log);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0], KernelReport { function: "matvec".into(), registers: 40, spill_bytes: 8 });
        assert_eq!(r[1].registers, 12);
        assert_eq!(r[1].spill_bytes, 0);
        // A non-inlined device function's figures after an entry's are its own.
        let log = "ptxas info    : Compiling entry function 'mk' for 'sm_90a'\n\
                   ptxas info    : Function properties for mk\n\
                   \x20   136 bytes stack frame, 276 bytes spill stores, 496 bytes spill loads\n\
                   ptxas info    : Used 128 registers, used 16 barriers\n\
                   ptxas info    : Function properties for _Z6helperv\n\
                   \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n";
        assert_eq!(parse_ptxas(log), vec![KernelReport { function: "mk".into(), registers: 128, spill_bytes: 772 }]);
    }

    #[test]
    fn every_kernel_file_includes_common() {
        for (name, src) in KERNEL_FILES {
            assert!(src.contains("#include \"common.cuh\""), "{name}");
            let full = kernel_source(name).expect("source");
            assert!(!full.contains("#include"), "{name} still has an include");
            assert_eq!(full.matches("#define FMT_Q4T").count(), 1, "{name}: common.cuh inlined once");
        }
    }
}
