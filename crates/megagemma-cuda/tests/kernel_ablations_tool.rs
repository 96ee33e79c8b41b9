//! `tools/kernel_ablations.py` still applies to the kernels as they are: every ablation's edits
//! match the source exactly once and change the file they name (no GPU needed; what the ablations
//! cost is measured on the GPU machine with `tools/gpu_ab.sh`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tool(args: &[&str]) -> std::process::Output {
    Command::new("python3").arg(root().join("tools/kernel_ablations.py")).args(args).output().expect("python3 runs")
}

fn differs(a: &Path, b: &Path) -> bool {
    std::fs::read(a).unwrap() != std::fs::read(b).unwrap()
}

#[test]
fn every_ablation_applies_to_the_current_kernels() {
    let out_dir = std::env::temp_dir().join(format!("megagemma-ablations-{}", std::process::id()));
    let out = tool(&["--check", out_dir.to_str().unwrap()]);
    assert!(out.status.success(), "kernel_ablations.py --check failed: {}", String::from_utf8_lossy(&out.stderr));
    let list = tool(&["--list"]);
    assert!(list.status.success());
    let names: Vec<String> = String::from_utf8(list.stdout)
        .unwrap()
        .lines()
        .map(|l| l.split_whitespace().next().unwrap().to_string())
        .collect();
    assert!(names.len() >= 10, "{names:?}");
    let kernels = root().join("crates/megagemma-cuda/kernels");
    for name in &names {
        let dir = out_dir.join(name);
        // Every kernel file is there, and the ablation changed at least one besides ops.cu (whose
        // argmax guard every ablation carries).
        let mut changed = Vec::new();
        for f in std::fs::read_dir(&kernels).unwrap() {
            let f = f.unwrap().path();
            let file = f.file_name().unwrap();
            assert!(dir.join(file).exists(), "{name}: {} missing", file.to_string_lossy());
            if differs(&f, &dir.join(file)) {
                changed.push(file.to_string_lossy().into_owned());
            }
        }
        assert!(changed.contains(&"ops.cu".to_string()), "{name}: no argmax guard");
        assert!(changed.len() >= 2, "{name}: changed only {changed:?}");
    }
    std::fs::remove_dir_all(&out_dir).ok();

    // --variants: gpu_ab.sh's variant arguments, one per ablation asked for, naming its folder.
    let v = tool(&[out_dir.to_str().unwrap(), "--variants", "floor", "noatt"]);
    assert!(v.status.success());
    let expect = format!(
        "floor:MEGAGEMMA_KERNELS={0}/floor noatt:MEGAGEMMA_KERNELS={0}/noatt",
        out_dir.to_str().unwrap().trim_end_matches('/')
    );
    assert_eq!(String::from_utf8_lossy(&v.stdout).trim(), expect);
    assert!(out_dir.join("noatt/attention.cu").exists());
    std::fs::remove_dir_all(&out_dir).ok();

    // An unknown name is one clear error and a non-zero exit.
    let bad = tool(&[out_dir.to_str().unwrap(), "nosuch"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown ablation(s) nosuch"));
}
