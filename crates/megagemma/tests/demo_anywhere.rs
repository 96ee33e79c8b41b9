//! The bundled demo model travels inside the binary: a copy of `megagemma` in another directory,
//! started from yet another one, with an empty cache, still runs it (and reuses what it wrote).

mod common;
use common::stderr;
use std::process::Command;

#[test]
fn copied_binary_runs_the_demo_from_another_directory() {
    let root = std::env::temp_dir().join(format!("megagemma-demo-anywhere-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (bin_dir, cwd, cache) = (root.join("bin"), root.join("elsewhere"), root.join("cache"));
    for d in [&bin_dir, &cwd] {
        std::fs::create_dir_all(d).unwrap();
    }
    let bin = bin_dir.join("megagemma");
    std::fs::copy(env!("CARGO_BIN_EXE_megagemma"), &bin).unwrap();
    let run = |args: &[&str]| {
        Command::new(&bin).args(args).current_dir(&cwd).env("MEGAGEMMA_CACHE", &cache).output().unwrap()
    };

    let out = run(&["run", "--prompt-ids", "2,17,99", "--greedy", "-n", "4", "--ignore-eos", "--output", "ids"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ids = String::from_utf8(out.stdout).unwrap();
    assert_eq!(ids.trim().split(',').filter(|s| s.parse::<u32>().is_ok()).count(), 4, "{ids:?}");
    let written: Vec<_> = std::fs::read_dir(&cache).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(written.len(), 1, "one demo directory in the cache: {written:?}");

    // Again, with text in and out (tokenizer and chat template from the written copy): the same
    // greedy ids as the first run, from the cached files.
    let out = run(&["run", "--prompt-ids", "2,17,99", "--greedy", "-n", "4", "--ignore-eos", "--output", "ids"]);
    assert_eq!(String::from_utf8(out.stdout).unwrap(), ids);
    let out = run(&["run", "--prompt", "Hello", "--greedy", "-n", "4", "--output", "json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(json["prompt_tokens"].as_u64().unwrap() > 1, "{json}");
    let _ = std::fs::remove_dir_all(&root);
}
