//! `megagemma chat` driven through standard input: answers equal `run`'s, commands work.

mod common;
use common::*;
use std::io::Write;
use std::process::{Command, Stdio};

fn chat(input: &str, extra: &[&str]) -> (String, String, bool) {
    let d = fixtures_dir().join("gemma3");
    let mut args = vec!["chat", "--model", d.to_str().unwrap(), "--greedy", "-n", "12"];
    args.extend(extra);
    let out = megagemma_with_input(&args, input.as_bytes());
    (stdout(&out), stderr(&out), out.status.success())
}

fn run_text(prompt: &str, system: Option<&str>) -> String {
    run_text_with(prompt, system, &[])
}

fn run_text_with(prompt: &str, system: Option<&str>, extra: &[&str]) -> String {
    let d = fixtures_dir().join("gemma3");
    let mut args = vec!["run", "--model", d.to_str().unwrap(), "--prompt", prompt, "-n", "12", "--output", "json"];
    if let Some(s) = system {
        args.extend(["--system", s]);
    }
    if !extra.iter().any(|a| a.starts_with("--temperature")) {
        args.push("--greedy");
    }
    args.extend(extra);
    let out = megagemma(&args);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    v["text"].as_str().unwrap().to_string()
}

#[test]
fn first_answer_equals_run_and_commands_work() {
    let (out, err, ok) = chat("the cat sat\n/reset\n/system be brief\nthe cat sat\n/quit\nnot read\n", &[]);
    assert!(ok, "{err}");
    // One answer per message, each ended by a newline.
    let expected = format!("{}\n{}\n", run_text("the cat sat", None), run_text("the cat sat", Some("be brief")));
    assert_eq!(out, expected);
    assert_eq!(err.matches("tok/s").count(), 2, "a speed line after each answer: {err}");
    assert!(err.contains("conversation cleared"), "{err}");
}

#[test]
fn quantized_chat_answers_as_quantized_run() {
    for quant in ["q4", "q4_0"] {
        let (out, err, ok) = chat("the cat sat\n", &["--quant", quant]);
        assert!(ok, "{err}");
        let run = run_text_with("the cat sat", None, &["--quant", quant]);
        assert_eq!(out, format!("{run}\n"), "--quant {quant}");
    }
    // The quantized answer is not the stored weights' answer (else this test could not fail).
    assert_ne!(run_text_with("the cat sat", None, &["--quant", "q4"]), run_text("the cat sat", None));
    let (_, err, ok) = chat("the cat sat\n", &["--quant", "q3"]);
    assert!(!ok && err.lines().count() == 1, "{err}");
}

#[test]
fn sampled_chat_answers_as_sampled_run() {
    // chat's own "--greedy" is replaced by the sampling flags (the helper puts it first).
    let d = fixtures_dir().join("gemma3");
    let flags = ["--temperature", "0.9", "--top-k", "8", "--top-p", "0.95", "--min-p", "0.01", "--seed", "7"];
    let mut args = vec!["chat", "--model", d.to_str().unwrap(), "-n", "12"];
    args.extend(flags);
    let out = megagemma_with_input(&args, b"the cat sat\n");
    assert!(out.status.success(), "{}", stderr(&out));
    let run = run_text_with("the cat sat", None, &flags);
    assert_eq!(stdout(&out), format!("{run}\n"));
    assert_ne!(run, run_text("the cat sat", None), "sampling chose the greedy tokens: the test could not fail");
    let (_, err, ok) = chat("the cat sat\n", &["--top-k", "3"]);
    assert!(!ok && err.contains("--greedy cannot be combined"), "{err}");
}

#[test]
fn continued_lines_make_one_message() {
    let (out, err, ok) = chat("the cat\\\nsat\n", &[]);
    assert!(ok, "{err}");
    assert_eq!(out, format!("{}\n", run_text("the cat\nsat", None)));
}

#[test]
fn unknown_command_is_reported_and_the_repl_goes_on() {
    let (out, err, ok) = chat("/frobnicate\nhi\n", &[]);
    assert!(ok, "{err}");
    assert!(err.contains("unknown command"), "{err}");
    assert_eq!(out, format!("{}\n", run_text("hi", None)));
}

#[test]
fn ctrl_c_stops_the_answer_not_the_program() {
    use std::io::Read;
    let d = fixtures_dir().join("gemma3");
    let mut child = Command::new(env!("CARGO_BIN_EXE_megagemma"))
        .args([
            "chat",
            "--model",
            d.to_str().unwrap(),
            "--greedy",
            "-n",
            "30000",
            "--ignore-eos",
            "--backend",
            "cpu",
            "--ctx",
            "32768",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"the cat sat\n").unwrap();
    // Drain stdout on a thread (a full pipe would block the answer), telling when it starts.
    let mut out = child.stdout.take().unwrap();
    let (started_tx, started) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            if all.is_empty() {
                let _ = started_tx.send(());
            }
            all.extend_from_slice(&buf[..n]);
        }
        all
    });
    started.recv().unwrap();
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    stdin.write_all(b"/quit\n").unwrap();
    drop(stdin);
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "{err}");
    assert!(err.contains("(stopped)"), "the answer should say it was stopped: {err}");
    let tokens: usize = err.split('[').nth(1).and_then(|r| r.split(' ').next()).unwrap().parse().unwrap();
    assert!(tokens < 30000, "the answer ran to its budget: {err}");
    assert!(!reader.join().unwrap().is_empty());
}

#[test]
fn think_needs_a_template_with_a_thinking_mode() {
    // The Gemma 3 fixture's template ignores enable_thinking: refused, not silently ignored.
    let (_, err, ok) = chat("hi\n", &["--think"]);
    assert!(!ok);
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("error: ") && lines[0].contains("no thinking mode"), "{err}");
    let (_, err, ok) = chat("hi\n", &["--show-thoughts"]);
    assert!(!ok && err.contains("--think"), "--show-thoughts alone is refused: {err}");
}

#[test]
fn think_changes_the_prompt_of_a_gemma4_template() {
    // A Gemma 4 fixture without a template of its own gets the built-in Gemma 4 template,
    // whose enable_thinking adds `<|think|>` in a system turn.
    let src = fixtures_dir().join("ple_shared_dw");
    let d = std::env::temp_dir().join(format!("megagemma-think-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(src.join(f), d.join(f)).unwrap();
    }
    let answer = |extra: &[&str]| {
        let mut args = vec!["chat", "--model", d.to_str().unwrap(), "--greedy", "-n", "16", "--ignore-eos"];
        args.extend(extra);
        let out = megagemma_with_input(&args, b"the cat sat\n");
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let plain = answer(&[]);
    let thinking = answer(&["--think"]);
    assert!(!plain.trim().is_empty() && !thinking.trim().is_empty());
    assert_ne!(plain, thinking, "--think should change the prompt and so the greedy answer");
    // This tokenizer has no thought channel: with --show-thoughts the answer is the same.
    assert_eq!(answer(&["--think", "--show-thoughts"]), thinking);
    std::fs::remove_dir_all(&d).unwrap();
}
