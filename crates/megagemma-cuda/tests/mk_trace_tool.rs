//! `tools/mk_trace.py` reads the JSON `MkTrace::to_json` writes and attributes a traced token's
//! time as `MkTrace::by_kernel` does (no GPU needed: the trace is built by hand).

use megagemma_cuda::MkTrace;
use std::path::PathBuf;
use std::process::Command;

/// Three blocks, four stages: a one-block stage, two stages every block works in (one with a slow
/// block), and a stage two blocks skip.
fn trace() -> MkTrace {
    #[rustfmt::skip]
    let t = vec![
        // block 0: (start, waited, end) per stage, ns
        1_000, 0, 5_000,      5_000, 6_000, 9_000,     9_000, 12_000, 20_000,   20_000, 21_000, 23_000,
        // block 1
        1_000, 0, 1_000,      1_000, 6_000, 11_000,    11_000, 12_500, 15_000,  15_000, 0, 15_000,
        // block 2
        1_000, 0, 1_000,      1_000, 5_500, 8_000,     8_000, 12_000, 14_000,   14_000, 0, 14_000,
    ];
    MkTrace { grid: 3, stages: vec!["embed_gather", "matvec_q4t_4", "matvec_q4t_4", "argmax_final"], t }
}

/// Writes `t` as the backend does to a temporary file named after `name` and this process.
fn write_trace(name: &str, t: &MkTrace) -> PathBuf {
    let path = std::env::temp_dir().join(format!("megagemma-mk-trace-{name}-{}.json", std::process::id()));
    std::fs::write(&path, t.to_json()).unwrap();
    path
}

fn run_tool(args: &[&str]) -> String {
    let tool = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tools/mk_trace.py");
    let out = Command::new("python3").arg(tool).args(args).output().expect("python3 runs");
    assert!(out.status.success(), "mk_trace.py failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8")
}

#[test]
fn the_tool_attributes_time_as_the_backend_does() {
    let t = trace();
    let path = write_trace("one", &t);
    let out = run_tool(&[path.to_str().unwrap(), "--stages", "0:4"]);
    std::fs::remove_file(&path).ok();

    // Per kernel: the token µs column equals Rust's attribution.
    let kinds = t.by_kernel();
    assert_eq!(kinds.len(), 3);
    for k in &kinds {
        let line = out.lines().find(|l| l.starts_with(k.kernel)).unwrap_or_else(|| panic!("no line for {}", k.kernel));
        let cols: Vec<&str> = line.split_whitespace().collect();
        let (stages, us): (usize, f64) = (cols[1].parse().unwrap(), cols[2].parse().unwrap());
        assert_eq!(stages, k.stages, "{line}");
        assert!((us - k.critical_us).abs() < 0.05, "{line}: Rust says {:.2} us", k.critical_us);
    }
    // matvec stages: from the one-block stage's end (5 µs) to the slow block's (11), then on to 20.
    let mv = kinds.iter().find(|k| k.kernel == "matvec_q4t_4").unwrap();
    assert!((mv.critical_us - 15.0).abs() < 1e-9, "{}", mv.critical_us);

    // Per stage: critical paths sum to the token's time; the third stage's work spans 2.5–8 µs.
    let rows: Vec<Vec<&str>> = out
        .lines()
        .skip_while(|l| !l.contains("critical us"))
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    let total: f64 = rows.iter().map(|r| r[2].parse::<f64>().unwrap()).sum();
    assert!((total - t.total_us()).abs() < 0.05, "{total} vs {}", t.total_us());
    assert_eq!(rows[2][3], "3", "{out}");
    // Stage 2: waits met 1.0, 1.5 and 1.0 µs after stage 1's last block ended; work 8, 2.5 and 2 µs.
    assert_eq!((rows[2][4], rows[2][5], rows[2][6]), ("1.00", "1.00", "1.50"), "{out}");
    assert_eq!((rows[2][7], rows[2][8], rows[2][9]), ("2.00", "2.50", "8.00"), "{out}");
}

#[test]
fn the_tool_compares_two_traces_of_one_table() {
    let a = trace();
    // B: block 0 ends the third stage 3 µs later, and its last stage follows as before.
    let mut b = trace();
    b.t[8] = 23_000;
    b.t[9..12].copy_from_slice(&[23_000, 24_000, 26_000]);
    let (pa, pb) = (write_trace("a", &a), write_trace("b", &b));
    let out = run_tool(&[pa.to_str().unwrap(), "--against", pb.to_str().unwrap()]);
    std::fs::remove_file(&pa).ok();
    std::fs::remove_file(&pb).ok();

    let compared: Vec<&str> = out.lines().skip_while(|l| !l.starts_with("A: ")).collect();
    let row = |name: &str| -> Vec<&str> {
        compared
            .iter()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row: {out}"))
            .split_whitespace()
            .collect()
    };
    // Only the matvec stages moved: +3 µs, and the whole token with them.
    assert_eq!(row("matvec_q4t_4")[4], "+3.0", "{out}");
    assert_eq!(row("argmax_final")[4], "+0.0", "{out}");
    assert_eq!(row("all")[4], "+3.0", "{out}");
    // The stage that changed most is stage 2, 3 µs slower.
    let first = compared.iter().skip_while(|l| !l.contains("changed most")).nth(1).expect("a stage line");
    assert!(first.trim_start().starts_with("2 matvec_q4t_4") && first.ends_with("(+3.00)"), "{out}");
}
