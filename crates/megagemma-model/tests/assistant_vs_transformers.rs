//! The MTP assistant against transformers (`tests/fixtures/assistants/`, written by
//! `tools/make_fixtures.py`): two assistants for the `ple_shared_dw` target, one with a dense tied
//! head and one with the centroid head.
//!
//! * Every recorded round — the target's position and token, drafted with the target's K/V as
//!   committed — gives transformers' float64 draft ids, and the drafter's logits within 1e-4
//!   relative L2 where they were recorded. Rounds reach past the sliding window (8) of the target,
//!   so the W+1 newest sliding keys are exercised.
//! * transformers' own assisted generation drafted the same ids wherever it saw the target's K/V as
//!   committed (its first round), and its output equals greedy.
//! * With vLLM's convention (`DraftQuery::AtLastCommitted`), the drafts of transformers' assistant
//!   driven that way.
//! * Assistants that do not fit the target fail to load with one line naming the mismatch.

use megagemma_model::assistant::{draft, draft_with, AssistantModel, DraftQuery, TargetKv};
use megagemma_model::cpu::forward::forward_chunk;
use megagemma_model::cpu::kv::KvCache;
use megagemma_model::cpu::ops::argmax;
use megagemma_model::quant::load::QuantMode;
use megagemma_model::Model;
use serde_json::Value;
use std::path::{Path, PathBuf};

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn assistant_dir(kind: &str) -> PathBuf {
    fixtures_dir().join("assistants").join(kind)
}

fn expected(kind: &str) -> Value {
    let path = assistant_dir(kind).join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn target() -> Model {
    Model::load(&fixtures_dir().join("ple_shared_dw")).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// The target decoded through `seq` one token at a time, keeping every committed K/V row of every
/// cache layer (a sliding ring keeps only its newest) and the final-normed hidden state of every
/// position.
struct History {
    keys: Vec<Vec<Vec<f32>>>,
    values: Vec<Vec<Vec<f32>>>,
    hidden: Vec<Vec<f32>>,
}

impl History {
    fn record(target: &Model, seq: &[u32]) -> History {
        let n_layers = target.plan.layers.len();
        let mut h = History { keys: vec![vec![]; n_layers], values: vec![vec![]; n_layers], hidden: vec![] };
        let mut kv = KvCache::new(&target.plan);
        for (pos, &tok) in seq.iter().enumerate() {
            let out = forward_chunk(&target.plan, &target.weights, &mut kv, &[tok], 1);
            kv.commit(1).unwrap();
            h.hidden.push(out.hidden);
            for l in target.plan.cache_layers() {
                h.keys[l.index].push(kv.layer(l.index).key(pos).to_vec());
                h.values[l.index].push(kv.layer(l.index).value(pos).to_vec());
            }
        }
        h
    }

    /// The cache as it stood with positions `0 .. p` committed.
    fn at(&self, p: usize) -> HistoryView<'_> {
        HistoryView { h: self, committed: p }
    }
}

struct HistoryView<'a> {
    h: &'a History,
    committed: usize,
}

impl TargetKv for HistoryView<'_> {
    fn committed(&self) -> usize {
        self.committed
    }
    fn holds(&self, _layer: usize, _first: usize) -> bool {
        true
    }
    fn key(&self, layer: usize, pos: usize) -> &[f32] {
        assert!(pos < self.committed, "read of uncommitted position {pos}");
        &self.h.keys[layer][pos]
    }
    fn value(&self, layer: usize, pos: usize) -> &[f32] {
        assert!(pos < self.committed, "read of uncommitted position {pos}");
        &self.h.values[layer][pos]
    }
}

struct Case {
    name: String,
    seq: Vec<u32>,
    rounds: Vec<Value>,
    transformers_rounds: Vec<Value>,
}

fn cases(exp: &Value) -> Vec<Case> {
    exp["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert_eq!(c["assisted_ids"], c["greedy_ids"], "transformers' assisted generation equals greedy");
            let mut seq = ids(&c["prompt_ids"]);
            seq.extend(ids(&c["greedy_ids"]));
            Case {
                name: c["name"].as_str().unwrap().to_string(),
                seq,
                rounds: c["rounds"].as_array().unwrap().clone(),
                transformers_rounds: c["transformers_rounds"].as_array().unwrap().clone(),
            }
        })
        .collect()
}

fn drafts_equal_transformers(kind: &str) {
    let target = target();
    let mut asst = AssistantModel::load(&assistant_dir(kind), &target, QuantMode::Stored).unwrap();
    let exp = expected(kind);
    let window = target.config.sliding_window;
    let (mut rounds, mut past_window, mut logged, mut worst) = (0, 0, 0, 0f64);
    for case in cases(&exp) {
        let history = History::record(&target, &case.seq[..case.seq.len() - 1]);
        for r in &case.rounds {
            let (p, token) = (r["position"].as_u64().unwrap() as usize, r["token"].as_u64().unwrap() as u32);
            assert_eq!(token, case.seq[p], "{kind}/{}: fixture token at {p}", case.name);
            let want = ids(&r["draft_ids"]);
            let kv = history.at(p);
            let got = draft(&asst, &target, &kv, p, token, &history.hidden[p - 1], want.len()).unwrap();
            assert_eq!(got, want, "{kind}/{} round at position {p}: drafts", case.name);
            rounds += 1;
            past_window += usize::from(p > window + 1);
            let Some(steps) = r.get("logits") else { continue };
            // The vocabulary-sized logits, step by step, with each step fed its own argmax.
            let mut seen = vec![];
            let picked = draft_with(&asst, &target, &kv, p, token, &history.hidden[p - 1], want.len(), |l| {
                seen.push(l.to_vec());
                argmax(l)
            })
            .unwrap();
            assert_eq!(picked, want, "{kind}/{} round at {p}: draft_with", case.name);
            for (j, (ours, theirs)) in seen.iter().zip(steps.as_array().unwrap()).enumerate() {
                let err = rel_l2(ours, &floats(theirs));
                assert!(err < 1e-4, "{kind}/{} round at {p}, step {j}: logits differ by {err:.2e}", case.name);
                worst = worst.max(err);
                logged += 1;
            }
        }
        asst.plan.query = DraftQuery::AtLastCommitted;
        for r in &case.rounds {
            let p = r["position"].as_u64().unwrap() as usize;
            let want = ids(&r["draft_ids_at_last_committed"]);
            let got = draft(&asst, &target, &history.at(p), p, case.seq[p], &history.hidden[p - 1], want.len());
            assert_eq!(got.unwrap(), want, "{kind}/{} round at {p}, query at p-1", case.name);
        }
        asst.plan.query = DraftQuery::AtToken;
        for r in case.transformers_rounds.iter().filter(|r| r["kv_as_committed"] == true) {
            let p = r["position"].as_u64().unwrap() as usize;
            let want = ids(&r["draft_ids"]);
            let got = draft(&asst, &target, &history.at(p), p, case.seq[p], &history.hidden[p - 1], want.len());
            assert_eq!(got.unwrap(), want, "{kind}/{}: transformers' generate() round at {p}", case.name);
        }
    }
    assert!(rounds >= 20 && past_window >= 5 && logged >= 12, "{rounds} rounds, {past_window} past W+1, {logged}");
    eprintln!(
        "{kind}: {rounds} rounds ({past_window} past the window), {logged} logit steps, worst rel. L2 {worst:.1e}"
    );
}

#[test]
fn dense_head_drafts_equal_transformers() {
    drafts_equal_transformers("dense");
}

#[test]
fn centroid_head_drafts_equal_transformers() {
    drafts_equal_transformers("centroid");
}

/// Drafting straight from the target's `KvCache`, decoded token by token: the recorded drafts at
/// every round, including rounds long after the sliding ring wrapped (it holds W+1 committed rows,
/// the keys transformers' convention reads; vLLM's reads the newest W of them).
#[test]
fn drafts_from_the_kv_cache() {
    let target = target();
    let mut asst = AssistantModel::load(&assistant_dir("centroid"), &target, QuantMode::Stored).unwrap();
    let window = target.config.sliding_window;
    for query in [DraftQuery::AtToken, DraftQuery::AtLastCommitted] {
        asst.plan.query = query;
        let recorded = match query {
            DraftQuery::AtToken => "draft_ids",
            DraftQuery::AtLastCommitted => "draft_ids_at_last_committed",
        };
        let (mut rounds, mut wrapped) = (0, 0);
        for case in cases(&expected("centroid")) {
            let mut kv = KvCache::new(&target.plan);
            let mut hidden = vec![];
            for r in &case.rounds {
                let p = r["position"].as_u64().unwrap() as usize;
                while kv.len() < p {
                    let tok = case.seq[kv.len()];
                    hidden = forward_chunk(&target.plan, &target.weights, &mut kv, &[tok], 1).hidden;
                    kv.commit(1).unwrap();
                }
                let want = ids(&r[recorded]);
                let got = draft(&asst, &target, &kv, p, case.seq[p], &hidden, want.len())
                    .unwrap_or_else(|e| panic!("{query:?} {} round at {p}: {e}", case.name));
                assert_eq!(got, want, "{query:?} {} round at {p}", case.name);
                rounds += 1;
                wrapped += usize::from(p > window + 1);
            }
        }
        assert!(rounds >= 10 && wrapped >= 5, "{query:?}: {rounds} rounds, {wrapped} after the ring wrapped");
    }
}

#[test]
fn draft_rejects_bad_inputs() {
    let target = target();
    let asst = AssistantModel::load(&assistant_dir("dense"), &target, QuantMode::Stored).unwrap();
    let mut kv = KvCache::new(&target.plan);
    let out = forward_chunk(&target.plan, &target.weights, &mut kv, &[2, 7, 9], 1);
    kv.commit(3).unwrap();
    let h = &out.hidden;
    let err = |r: megagemma_model::Result<Vec<u32>>| r.unwrap_err().to_string();
    assert!(err(draft(&asst, &target, &kv, 2, 5, h, 3)).contains("3 committed positions"));
    assert!(err(draft(&asst, &target, &kv, 3, 512, h, 3)).contains("out of range"));
    assert!(err(draft(&asst, &target, &kv, 3, 5, &h[1..], 3)).contains("hidden state has 63 values"));
    assert!(err(draft_with(&asst, &target, &kv, 3, 5, h, 2, |_| 9999)).contains("outside the vocabulary"));
    assert_eq!(draft(&asst, &target, &kv, 3, 5, h, 0).unwrap(), Vec::<u32>::new());
}

/// `--quant q4_0` quantizes the assistant's projections and head (rows of 32 are whole groups);
/// its drafter logits stay close to the bf16 assistant's.
#[test]
fn quantized_assistant_loads_and_drafts() {
    let target = target();
    let dir = assistant_dir("dense");
    let dense = AssistantModel::load(&dir, &target, QuantMode::Stored).unwrap();
    let q = AssistantModel::load(&dir, &target, QuantMode::Q4_0).unwrap();
    let bytes = |a: &AssistantModel| a.weights.head.stored_bytes() + a.weights.layers[0].attn.q.stored_bytes();
    assert!(bytes(&q) * 3 < bytes(&dense), "q4_0: {} bytes vs bf16 {}", bytes(&q), bytes(&dense));
    let case = &cases(&expected("dense"))[1];
    let history = History::record(&target, &case.seq[..case.seq.len() - 1]);
    let p = case.rounds[0]["position"].as_u64().unwrap() as usize;
    let logits = |a: &AssistantModel| {
        let mut first = vec![];
        draft_with(a, &target, &history.at(p), p, case.seq[p], &history.hidden[p - 1], 1, |l| {
            first = l.to_vec();
            0
        })
        .unwrap();
        first
    };
    let err = rel_l2(&logits(&q), &logits(&dense));
    assert!(err > 0.0 && err < 0.2, "q4_0 drafter logits differ from bf16 by {err:.3}");
    eprintln!("q4_0 assistant: first-step logits within {err:.3} relative L2 of bf16");
}

/// A copy of the dense assistant with `edit` applied to its config.json.
fn edited_assistant(name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let src = assistant_dir("dense");
    let dir = std::env::temp_dir().join(format!("megagemma-assistant-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    dir
}

fn load_error(dir: &Path, target: &Model) -> String {
    let msg = match AssistantModel::load(dir, target, QuantMode::Stored) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    };
    assert!(!msg.contains('\n'), "one line: {msg}");
    msg
}

/// A change to an assistant's config.json.
type ConfigEdit = fn(&mut Value);

fn add_moe(text: &mut Value) {
    text["enable_moe_block"] = true.into();
    text["num_experts"] = 2.into();
    text["top_k_experts"] = 1.into();
    text["moe_intermediate_size"] = 16.into();
}

/// A valid PLE block (its table covers the vocabulary), which an assistant must not have.
fn add_ple(text: &mut Value) {
    text["hidden_size_per_layer_input"] = 8.into();
    text["vocab_size_per_layer_input"] = text["vocab_size"].clone();
}

#[test]
fn mismatched_assistants_fail_with_one_line() {
    let target = target();
    let cases: Vec<(&str, ConfigEdit, &str)> = vec![
        ("backbone", |c| c["backbone_hidden_size"] = 32.into(), "backbone_hidden_size 32 does not match"),
        ("kv_heads", |c| c["text_config"]["num_key_value_heads"] = 4.into(), "has 4 KV heads but target"),
        ("head_dim", |c| c["text_config"]["per_layer_config"]["3"]["head_dim"] = 64.into(), "head_dim 64"),
        ("vocab", |c| c["text_config"]["vocab_size"] = 256.into(), "vocab_size 256 does not match"),
        ("shared", |c| c["text_config"]["num_kv_shared_layers"] = 2.into(), "num_kv_shared_layers is 2"),
        ("ple", |c| add_ple(&mut c["text_config"]), "per-layer embeddings"),
        ("moe", |c| add_moe(&mut c["text_config"]), "enable_moe_block must be false"),
        ("window", |c| c["text_config"]["sliding_window"] = 4.into(), "sliding_window 4 does not match"),
        ("arch", |c| c["architectures"] = serde_json::json!(["Gemma4ForCausalLM"]), "not an MTP assistant"),
    ];
    for (name, edit, want) in cases {
        let dir = edited_assistant(name, edit);
        let msg = load_error(&dir, &target);
        assert!(msg.contains(want), "{name}: `{msg}` does not say `{want}`");
        eprintln!("{name}: {msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // A Gemma 3 target has no assistant.
    let gemma3 = Model::load(&fixtures_dir().join("gemma3")).unwrap();
    let msg = load_error(&assistant_dir("dense"), &gemma3);
    assert!(msg.contains("Gemma 4 targets"), "{msg}");
    let msg = load_error(&fixtures_dir().join("assistants/missing"), &target);
    assert!(msg.contains("does not exist"), "{msg}");
}
