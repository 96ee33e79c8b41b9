//! `tools/gpu_ab.sh` runs every variant's bench with that variant's environment only and with its
//! own build (`label@DIR`), in the order and with the labels it prints, after each binary's
//! `--version`, with `BENCH_ARGS` added to every run (no GPU needed: stand-in `megagemma`s echo
//! what they got).

use std::path::PathBuf;
use std::process::Command;

#[test]
fn each_variant_runs_with_its_own_environment() {
    let dir = std::env::temp_dir().join(format!("megagemma-gpu-ab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    for (d, name) in [(&dir, "main"), (&other, "other")] {
        let fake = d.join("megagemma");
        let script = format!(
            "#!/bin/sh\necho \"decode {name} waves=${{MEGAGEMMA_CUDA_MMA_WAVES:-unset}} keys=${{MEGAGEMMA_CUDA_ATT_SPLIT_KEYS:-unset}} $*\"\n"
        );
        std::fs::write(&fake, script).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    }
    let tool = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/gpu_ab.sh");
    let out = Command::new("bash")
        .arg(&tool)
        .arg(&dir)
        // base after w3: a variant's environment must not leak into the next.
        .args([
            "w3:MEGAGEMMA_CUDA_MMA_WAVES=3".to_string(),
            "base".to_string(),
            "both:MEGAGEMMA_CUDA_MMA_WAVES=3,MEGAGEMMA_CUDA_ATT_SPLIT_KEYS=16".to_string(),
            format!("alt@{}:MEGAGEMMA_CUDA_MMA_WAVES=2", other.display()),
        ])
        .env("ROUNDS", "1")
        .env("MODELS", "e2b")
        .env("DECODES", "megakernel")
        .env("BENCH_ARGS", "--batch 4")
        .env_remove("MEGAGEMMA_CUDA_MMA_WAVES")
        .env_remove("MEGAGEMMA_CUDA_ATT_SPLIT_KEYS")
        .output()
        .expect("bash runs");
    std::fs::remove_dir_all(&dir).ok();
    assert!(out.status.success(), "gpu_ab.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    // First each binary's --version (which names its commit), then one line per run.
    let (versions, lines): (Vec<&str>, Vec<&str>) = text.lines().partition(|l| !l.starts_with("round "));
    assert_eq!(versions.len(), 4, "{text}");
    assert!(versions[0].starts_with("w3: decode main ") && versions[0].ends_with("--version"), "{text}");
    assert!(versions[3].contains(": decode other ") && versions[3].ends_with("--version"), "{text}");
    assert_eq!(lines.len(), 4, "{text}");
    let expect = [
        ("w3", "main waves=3 keys=unset"),
        ("base", "main waves=unset keys=unset"),
        ("both", "main waves=3 keys=16"),
        ("alt", "other waves=2 keys=unset"),
    ];
    for (line, (label, env)) in lines.iter().zip(expect) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&fields[..5], ["round", "1", "e2b", "megakernel", label], "{line}");
        assert!(line.contains(env), "{line}");
        assert!(
            line.contains("--synthetic e2b --quant q4 --backend cuda")
                && line.contains("--decode megakernel --batch 4"),
            "{line}"
        );
    }

    // No variants: one error line and a non-zero exit.
    let none = Command::new("bash").arg(&tool).arg("/nonexistent").output().expect("bash runs");
    assert!(!none.status.success());
    assert_eq!(String::from_utf8_lossy(&none.stderr).trim(), "tools/gpu_ab.sh: no variants given");
}
