//! Embeds the commit the binary is built from (`megagemma --version`, `bench`'s table and JSON), so
//! a measurement names the code it measured. "unknown" outside a git checkout.
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    let commit = git(&["rev-parse", "--short=9", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=MEGAGEMMA_COMMIT={commit}");
    // Again when HEAD moves (a commit, a checkout): HEAD of this worktree, the branch refs. Only
    // paths that exist (a missing one would rerun this script on every build).
    let dir = git(&["rev-parse", "--absolute-git-dir"]);
    let common = git(&["rev-parse", "--path-format=absolute", "--git-common-dir"]);
    let watch = [
        dir.map(|d| format!("{d}/HEAD")),
        common.clone().map(|c| format!("{c}/refs/heads")),
        common.map(|c| format!("{c}/packed-refs")),
    ];
    for path in watch.into_iter().flatten().filter(|p| std::path::Path::new(p).exists()) {
        println!("cargo:rerun-if-changed={path}");
    }
}
