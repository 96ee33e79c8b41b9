//! The fuzzers' guarantee on the stable toolchain: a seeded mutator (deterministic, a few
//! thousand cases) over the committed seed corpora (`fuzz/seeds`, built from the test fixtures)
//! feeds the same harness the cargo-fuzz targets run (`fuzz/src/harness.rs`). Any panic fails
//! the test and leaves the input under `target/untrusted-failures/` for a regression test.

#[path = "../../../fuzz/src/harness.rs"]
mod harness;

mod common;
use common::repo_root;

/// xorshift64*: small, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Integers that break size arithmetic, as little-endian u64 (a prefix is used for shorter fields).
const INTERESTING_INTS: [u64; 10] = [0, 1, 2, 3, 0x7f, 0xffff_ffff, 0x1_0000_0001, 1 << 31, 1 << 62, u64::MAX];
/// JSON values that replace a number or string in a JSON part.
const INTERESTING_JSON: [&str; 14] = [
    "0",
    "1",
    "-1",
    "3",
    "4294967297",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "0.5",
    "null",
    "true",
    "\"x\"",
    "[]",
    "{}",
];

fn mutate(input: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut b = input.to_vec();
    for _ in 0..1 + rng.below(3) {
        let len = b.len().max(1);
        match rng.below(7) {
            0 => {
                // Flip one bit.
                let i = rng.below(len);
                if let Some(x) = b.get_mut(i) {
                    *x ^= 1 << rng.below(8);
                }
            }
            1 => {
                // Overwrite 1, 2, 4 or 8 bytes with an interesting integer.
                let width = [1, 2, 4, 8][rng.below(4)];
                let v = INTERESTING_INTS[rng.below(INTERESTING_INTS.len())].to_le_bytes();
                let i = rng.below(len);
                for (k, byte) in v.iter().take(width).enumerate() {
                    if let Some(x) = b.get_mut(i + k) {
                        *x = *byte;
                    }
                }
            }
            2 => {
                // Replace a JSON number or string token with an interesting value.
                let starts: Vec<usize> = (0..b.len())
                    .filter(|&i| {
                        (b[i].is_ascii_digit() || b[i] == b'"')
                            && (i == 0 || matches!(b[i - 1], b':' | b' ' | b'[' | b','))
                    })
                    .collect();
                if starts.is_empty() {
                    continue;
                }
                let s = starts[rng.below(starts.len())];
                let e = if b[s] == b'"' {
                    b[s + 1..].iter().position(|&c| c == b'"').map_or(b.len(), |p| s + p + 2)
                } else {
                    b[s..].iter().position(|c| !(c.is_ascii_digit() || b".eE+-".contains(c))).map_or(b.len(), |p| s + p)
                };
                let with = INTERESTING_JSON[rng.below(INTERESTING_JSON.len())].as_bytes();
                b.splice(s..e, with.iter().copied());
            }
            3 => b.truncate(rng.below(len)),
            4 => {
                // Delete a range.
                let i = rng.below(len);
                let n = rng.below(64).min(b.len().saturating_sub(i));
                b.drain(i..i + n);
            }
            5 => {
                // Duplicate a range in place.
                let i = rng.below(len);
                let n = rng.below(64).min(b.len().saturating_sub(i));
                let chunk = b[i..i + n].to_vec();
                b.splice(i..i, chunk);
            }
            _ => {
                // Random bytes.
                let i = rng.below(len).min(b.len());
                let n = 1 + rng.below(8);
                let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                b.splice(i..i, bytes);
            }
        }
    }
    b
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = repo_root().join("fuzz/seeds").join(target);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    paths.sort();
    assert!(!paths.is_empty(), "no seeds in {}", dir.display());
    paths.iter().map(|p| std::fs::read(p).unwrap()).collect()
}

/// `cases` mutants of the target's seeds (round robin), plus the seeds themselves.
fn check(target: &str, cases: usize, run: fn(&[u8])) {
    let seeds = seeds(target);
    for s in &seeds {
        run(s);
    }
    for case in 0..cases {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (case as u64 + 1).wrapping_mul(0xd1b5_4a32_d192_ed03));
        let input = mutate(&seeds[case % seeds.len()], &mut rng);
        if std::panic::catch_unwind(|| run(&input)).is_err() {
            let dir = repo_root().join("target/untrusted-failures");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(format!("{target}-{case}"));
            std::fs::write(&path, &input).unwrap();
            panic!("{target}: case {case} panicked; input saved to {}", path.display());
        }
    }
}

#[test]
fn config_mutants() {
    check("config", 3000, harness::config);
}

#[test]
fn safetensors_mutants() {
    check("safetensors", 2000, harness::safetensors);
}

#[test]
fn load_dir_mutants() {
    check("load_dir", 1000, harness::load_dir);
}

#[test]
fn gguf_mutants() {
    check("gguf", 2000, harness::gguf);
}
