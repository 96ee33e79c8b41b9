//! `megagemma run --draft ...`: the same ids as greedy, the documented trace and stats lines,
//! and one-line errors for bad drafting flags.

mod common;
use common::*;

fn run_ids(extra: &[&str]) -> std::process::Output {
    let d = fixtures_dir().join("sliding_wrap");
    let mut args = vec![
        "run",
        "--model",
        d.to_str().unwrap(),
        "--prompt-ids",
        "2,5,9,5,9,5,9",
        "--greedy",
        "--ignore-eos",
        "-n",
        "40",
        "--output",
        "ids",
    ];
    args.extend_from_slice(extra);
    megagemma(&args)
}

#[test]
fn lookup_and_oracle_drafts_print_the_greedy_ids_with_trace_and_stats() {
    let plain = run_ids(&[]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    for extra in [
        &["--draft", "lookup", "--trace-drafts", "--stats"][..],
        &["--draft", "oracle", "--acceptance", "0.5", "--k", "3", "--trace-drafts", "--stats"][..],
    ] {
        let out = run_ids(extra);
        assert!(out.status.success(), "{}", stderr(&out));
        assert_eq!(stdout(&out), stdout(&plain), "{extra:?} changed the output");
        let err = stderr(&out);
        let traces: Vec<&str> = err.lines().filter(|l| l.starts_with("draft pos=")).collect();
        assert!(!traces.is_empty(), "no trace lines: {err}");
        for t in &traces {
            let parts: Vec<&str> = t.split(' ').collect();
            assert_eq!(parts.len(), 4, "trace format: {t}");
            assert!(parts[1].strip_prefix("pos=").unwrap().parse::<usize>().is_ok(), "{t}");
            assert!(parts[2].starts_with("ids=") && parts[3].starts_with("accepted="), "{t}");
        }
        let stats = err.lines().find(|l| l.starts_with("spec: rounds")).unwrap_or_else(|| panic!("no stats: {err}"));
        assert!(stats.contains("acceptance by position") && stats.contains("tok/s"), "{stats}");
    }
}

#[test]
fn bad_drafting_flags_are_one_line_errors() {
    for (extra, needle) in [
        (&["--draft", "psychic"][..], "unknown --draft"),
        (&["--draft", "mtp"][..], "--assistant"),
        (&["--draft", "lookup", "--k", "0"][..], "--k"),
        (&["--draft", "oracle", "--acceptance", "1.5"][..], "--acceptance"),
        (&["--backend", "tpu"][..], "unknown backend"),
    ] {
        let out = run_ids(extra);
        assert!(!out.status.success(), "{extra:?} should fail");
        let err = stderr(&out);
        assert_eq!(err.lines().filter(|l| l.starts_with("error:")).count(), 1, "{err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
}

#[test]
fn mtp_with_a_committed_assistant_prints_the_greedy_ids() {
    let target = fixtures_dir().join("ple_shared_dw");
    let base = [
        "run",
        "--model",
        target.to_str().unwrap(),
        "--prompt-ids",
        "2,7,8,9",
        "--greedy",
        "--ignore-eos",
        "-n",
        "30",
        "--output",
        "ids",
        "--backend",
        "cpu",
    ];
    let plain = megagemma(&base);
    assert!(plain.status.success(), "{}", stderr(&plain));
    for head in ["dense", "centroid"] {
        let dir = fixtures_dir().join("assistants").join(head);
        let mut args = base.to_vec();
        args.extend(["--draft", "mtp", "--assistant", dir.to_str().unwrap(), "--k", "3", "--stats"]);
        let out = megagemma(&args);
        assert!(out.status.success(), "{head}: {}", stderr(&out));
        assert_eq!(stdout(&out), stdout(&plain), "{head}: MTP changed the output");
        assert!(stderr(&out).contains("spec: rounds"), "{}", stderr(&out));
    }
    // An assistant that does not fit its target is one clear line.
    let wrong = fixtures_dir().join("moe");
    let mut args = base.to_vec();
    let dir = fixtures_dir().join("assistants/dense");
    args[2] = wrong.to_str().unwrap();
    args.extend(["--draft", "mtp", "--assistant", dir.to_str().unwrap()]);
    let out = megagemma(&args);
    assert!(!out.status.success());
    assert_eq!(stderr(&out).lines().filter(|l| l.starts_with("error:")).count(), 1, "{}", stderr(&out));
}
