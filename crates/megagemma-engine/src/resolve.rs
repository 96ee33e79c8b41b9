//! What `--model` names, as a path on disk. In order:
//!
//! 1. a path that exists (a checkpoint directory or a `.gguf` file);
//! 2. a name `megagemma pull --list` knows (fetched into the cache on first use);
//! 3. a Hugging Face repo id, `org/name` or `org/name@revision`, looked up in the local Hugging
//!    Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//!    else `~/.cache/huggingface/hub`) in its snapshot layout:
//!    `models--org--name/refs/<revision>` holds a commit hash, `snapshots/<hash>/` the files.
//!    A GGUF repo holds one file per quantization: `org/name:Q4_K_M` (llama.cpp's `-hf` spelling,
//!    also after a revision) picks the `.gguf` whose name holds the tag; vision and audio
//!    projector files (`mmproj*.gguf`) are never the model.
//!
//! Nothing is downloaded from the Hugging Face Hub: a repo that is not in the cache is an error
//! that says how to get it. With `HF_HUB_OFFLINE` set nothing is fetched at all: a known name
//! must already be in megagemma's cache.

use crate::pull;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// Where to look, read once from the environment (tests build their own).
#[derive(Clone, Debug)]
pub struct Locations {
    /// The Hugging Face hub cache directory (`.../huggingface/hub`), if any could be named.
    pub hf_hub: Option<PathBuf>,
    /// `HF_HUB_OFFLINE`: fetch nothing over the network.
    pub offline: bool,
}

impl Locations {
    pub fn from_env() -> Locations {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let hf_hub = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub")));
        let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| is_truthy(&v));
        Locations { hf_hub, offline }
    }
}

/// huggingface_hub's reading of a boolean environment variable.
fn is_truthy(v: &str) -> bool {
    matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true")
}

/// `--model` as a path on disk, fetching a known name when needed (see the module docs).
pub fn resolve_model(arg: &Path) -> Result<PathBuf> {
    resolve_with(arg, &Locations::from_env())
}

pub fn resolve_with(arg: &Path, loc: &Locations) -> Result<PathBuf> {
    if arg.exists() {
        return Ok(arg.to_path_buf());
    }
    let Some(text) = arg.to_str() else {
        bail!("model {} does not exist", arg.display());
    };
    if let Some(known) = pull::find(text) {
        let cached = pull::cached_path(known)?;
        if cached.exists() {
            return Ok(cached);
        }
        if loc.offline {
            bail!(
                "model `{text}` is not in the cache ({}) and HF_HUB_OFFLINE is set: run `megagemma pull {text}` while online",
                cached.display()
            );
        }
        return pull::ensure(known);
    }
    if let Some(repo) = RepoId::parse(text) {
        return find_in_hf_cache(&repo, loc);
    }
    bail!(
        "model {text} does not exist (give a checkpoint directory, a .gguf file, a name `megagemma pull --list` \
         knows, or a Hugging Face repo id such as google/gemma-3-270m-it)"
    )
}

/// `org/name[@revision]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoId {
    pub org: String,
    pub name: String,
    /// A branch or tag (read from `refs/`) or a commit hash; `main` when not given.
    pub revision: String,
    /// `:TAG` after the id: which `.gguf` file of a GGUF repo (e.g. `Q4_K_M`), matched
    /// case-insensitively against the file names.
    pub quant: Option<String>,
}

impl RepoId {
    /// A repo id as the Hub spells them (letters, digits, `-`, `_`, `.`; no `--` or `..`; at
    /// most 96 characters per part), else `None`.
    pub fn parse(text: &str) -> Option<RepoId> {
        // `:TAG` last (a git ref cannot hold a colon): `org/name:Q4_K_M`, `org/name@v1:Q8_0`.
        let (text, quant) = match text.rsplit_once(':') {
            Some((rest, tag)) => {
                let tag_ok = !tag.is_empty()
                    && tag.len() <= 64
                    && tag.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
                if !tag_ok {
                    return None;
                }
                (rest, Some(tag.to_string()))
            }
            None => (text, None),
        };
        let (id, revision) = match text.split_once('@') {
            Some((id, rev)) => (id, rev),
            None => (text, "main"),
        };
        let (org, name) = id.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 96
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
                && !p.starts_with(['-', '.'])
                && !p.ends_with(['-', '.'])
                && !p.contains("--")
                && !p.contains("..")
        };
        let rev_ok = !revision.is_empty()
            && !revision.contains("..")
            && !revision.starts_with('/')
            && revision.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
        (part_ok(org) && part_ok(name) && rev_ok).then(|| RepoId {
            org: org.to_string(),
            name: name.to_string(),
            revision: revision.to_string(),
            quant,
        })
    }

    fn id(&self) -> String {
        format!("{}/{}", self.org, self.name)
    }

    /// The repo's folder in the hub cache.
    pub fn cache_folder(&self) -> String {
        format!("models--{}--{}", self.org, self.name)
    }
}

/// The snapshot directory of `repo` in the hub cache, then the model in it: the directory
/// itself when it holds `config.json`, else its `.gguf` file (the one, or the one `repo.quant`
/// names).
pub fn find_in_hf_cache(repo: &RepoId, loc: &Locations) -> Result<PathBuf> {
    let how = if loc.offline {
        format!("download it with `hf download {}` (HF_HUB_OFFLINE is set: nothing is fetched)", repo.id())
    } else {
        format!(
            "download it with `hf download {}` (megagemma reads the cache, it does not download from the Hub)",
            repo.id()
        )
    };
    let Some(hub) = &loc.hf_hub else {
        bail!("model {} is not a path, and there is no Hugging Face cache to look in (set HF_HUB_CACHE or HF_HOME); {how}", repo.id());
    };
    let folder = hub.join(repo.cache_folder());
    if !folder.is_dir() {
        bail!("model {} is not a path and not in the Hugging Face cache {}; {how}", repo.id(), hub.display());
    }
    let snapshots = folder.join("snapshots");
    let snapshot = snapshot_dir(&folder, &snapshots, &repo.revision)
        .with_context(|| format!("model {} in the Hugging Face cache {}", repo.id(), hub.display()))?;
    model_in_snapshot(&snapshot, repo.quant.as_deref())
        .with_context(|| format!("model {} ({})", repo.id(), snapshot.display()))
}

fn snapshot_dir(folder: &Path, snapshots: &Path, revision: &str) -> Result<PathBuf> {
    let is_hash = revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit());
    if is_hash {
        let d = snapshots.join(revision);
        if d.is_dir() {
            return Ok(d);
        }
        bail!("no snapshot {revision} (download that revision)");
    }
    let reference = folder.join("refs").join(revision);
    if reference.is_file() {
        let hash =
            std::fs::read_to_string(&reference).with_context(|| format!("cannot read {}", reference.display()))?;
        let hash = hash.trim();
        if hash.is_empty() || hash.contains(['/', '\\']) || hash.contains("..") {
            bail!("{} does not hold a commit hash", reference.display());
        }
        let d = snapshots.join(hash);
        if d.is_dir() {
            return Ok(d);
        }
        bail!("{} names snapshot {hash}, which is missing (download the model again)", reference.display());
    }
    // No ref for `main` (the files were fetched by commit hash): one snapshot is unambiguous.
    if revision == "main" {
        let dirs: Vec<PathBuf> = std::fs::read_dir(snapshots)
            .map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_dir()).collect())
            .unwrap_or_default();
        match dirs.len() {
            1 => return Ok(dirs.into_iter().next().expect("one snapshot")),
            0 => bail!("it has no snapshot (the download did not finish?)"),
            n => bail!("it has {n} snapshots and no refs/main: name one as ORG/NAME@COMMIT"),
        }
    }
    bail!("no revision `{revision}` (refs/{revision} is missing)")
}

fn model_in_snapshot(dir: &Path, quant: Option<&str>) -> Result<PathBuf> {
    if dir.join("config.json").exists() {
        if let Some(tag) = quant {
            bail!(
                "`:{tag}` picks a .gguf file, but the snapshot is a checkpoint directory (config.json): drop the tag"
            );
        }
        return Ok(dir.to_path_buf());
    }
    let name_of = |p: &PathBuf| p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Projector files (vision / audio encoders) sit beside the language model in GGUF repos.
    let mut ggufs: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")))
        .filter(|p| !name_of(p).to_ascii_lowercase().starts_with("mmproj"))
        .collect();
    ggufs.sort();
    let names = |files: &[PathBuf]| files.iter().map(name_of).collect::<Vec<_>>().join(", ");
    if ggufs.is_empty() {
        bail!("the snapshot has neither config.json nor a model .gguf file");
    }
    let Some(tag) = quant else {
        if ggufs.len() == 1 {
            return Ok(ggufs.remove(0));
        }
        bail!(
            "the snapshot has several .gguf files ({}): pick one as ORG/NAME:QUANT (e.g. `:Q4_K_M`) or give its path",
            names(&ggufs)
        );
    };
    // A repo's files share the model's name and end in their quantization (`gemma-4-E4B-it-` +
    // `Q4_K_M`, `UD-Q4_K_M`, …): a tag equal to that ending wins, then a tag that is whole pieces
    // of one name.
    let stems: Vec<String> =
        ggufs.iter().map(|p| name_of(p).to_ascii_lowercase().trim_end_matches(".gguf").to_string()).collect();
    let prefix = model_prefix_len(&stems);
    let lower = tag.to_ascii_lowercase();
    let exact: Vec<usize> = (0..ggufs.len()).filter(|&i| stems[i][prefix..] == lower).collect();
    if exact.len() == 1 {
        return Ok(ggufs[exact[0]].clone());
    }
    let matching: Vec<PathBuf> =
        (0..ggufs.len()).filter(|&i| holds_tag(&stems[i], &lower)).map(|i| ggufs[i].clone()).collect();
    match matching.len() {
        0 => bail!("no .gguf file matches `:{tag}` (the snapshot has {})", names(&ggufs)),
        1 => Ok(matching[0].clone()),
        _ => bail!("several .gguf files match `:{tag}` ({}): give a longer tag or the file's path", names(&matching)),
    }
}

/// Whether `tag` is one or more whole `-` / `.` / `_`-separated pieces of `stem` (`q4_k` is in
/// `…-q4_k_m`, `f16` is not in `…-bf16`).
fn holds_tag(stem: &str, tag: &str) -> bool {
    let sep = |b: Option<&u8>| b.is_none_or(|b| matches!(b, b'-' | b'.' | b'_'));
    stem.match_indices(tag).any(|(i, _)| {
        sep(i.checked_sub(1).and_then(|j| stem.as_bytes().get(j))) && sep(stem.as_bytes().get(i + tag.len()))
    })
}

/// Length of the model name the stems share, up to and including its last `-` or `.` (so that
/// what follows is each file's quantization): the whole common prefix of one stem's is cut back too.
fn model_prefix_len(stems: &[String]) -> usize {
    let first = stems[0].as_bytes();
    let common = stems[1..]
        .iter()
        .fold(first.len(), |n, s| n.min(first.iter().zip(s.as_bytes()).take_while(|(a, b)| a == b).count()));
    first[..common].iter().rposition(|&b| b == b'-' || b == b'.').map_or(0, |i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("megagemma-resolve-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn loc(hub: &Path) -> Locations {
        Locations { hf_hub: Some(hub.to_path_buf()), offline: false }
    }

    /// A hub-cache entry as huggingface_hub lays it out: files in `blobs/`, the snapshot's names
    /// symlinked to them, `refs/<rev>` holding the commit hash.
    fn fake_repo(hub: &Path, folder: &str, hash: &str, files: &[(&str, &[u8])], refs: &[&str]) -> PathBuf {
        let repo = hub.join(folder);
        let snap = repo.join("snapshots").join(hash);
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(repo.join("blobs")).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        for (i, (name, bytes)) in files.iter().enumerate() {
            let blob = repo.join("blobs").join(format!("blob{i}"));
            std::fs::write(&blob, bytes).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/blob{i}"), snap.join(name)).unwrap();
        }
        for r in refs {
            std::fs::write(repo.join("refs").join(r), hash).unwrap();
        }
        snap
    }

    const H1: &str = "0123456789abcdef0123456789abcdef01234567";
    const H2: &str = "fedcba9876543210fedcba9876543210fedcba98";

    #[test]
    fn repo_ids_parse() {
        let r = RepoId::parse("google/gemma-3-270m-it").unwrap();
        assert_eq!((r.org.as_str(), r.name.as_str(), r.revision.as_str()), ("google", "gemma-3-270m-it", "main"));
        assert_eq!(r.cache_folder(), "models--google--gemma-3-270m-it");
        assert_eq!(RepoId::parse("a/b@v1.0").unwrap().revision, "v1.0");
        let q = RepoId::parse("unsloth/gemma-4-E4B-it-GGUF:Q4_K_M").unwrap();
        assert_eq!(
            (q.name.as_str(), q.revision.as_str(), q.quant.as_deref()),
            ("gemma-4-E4B-it-GGUF", "main", Some("Q4_K_M"))
        );
        let q = RepoId::parse("a/b@v2:UD-Q8_K_XL").unwrap();
        assert_eq!((q.revision.as_str(), q.quant.as_deref()), ("v2", Some("UD-Q8_K_XL")));
        assert_eq!(RepoId::parse("a/b").unwrap().quant, None);
        for bad in ["gemma", "/abs/path", "./x/y", "a/b/c", "a--b/c", "a/..", "a/b@", "a/b@../x", "a/", "", "a b/c"] {
            assert_eq!(RepoId::parse(bad), None, "{bad}");
        }
        for bad in ["a/b:", "a/b:Q4/K", "a/b:Q4 K", "a:b/c", "a/b:x:y"] {
            assert_eq!(RepoId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn finds_the_snapshot_of_refs_main_and_of_other_revisions() {
        let hub = scratch("refs");
        let main = fake_repo(&hub, "models--org--tiny", H1, &[("config.json", b"{}")], &["main"]);
        let other = fake_repo(&hub, "models--org--tiny", H2, &[("config.json", b"{}")], &["v2"]);
        let l = loc(&hub);
        assert_eq!(resolve_with(Path::new("org/tiny"), &l).unwrap(), main);
        assert_eq!(resolve_with(Path::new("org/tiny@v2"), &l).unwrap(), other);
        assert_eq!(resolve_with(Path::new(&format!("org/tiny@{H2}")), &l).unwrap(), other);
        let e = format!("{:#}", resolve_with(Path::new("org/tiny@v3"), &l).unwrap_err());
        assert!(e.contains("no revision `v3`"), "{e}");
        // Without refs/main, two snapshots are ambiguous; one is not.
        std::fs::remove_file(hub.join("models--org--tiny/refs/main")).unwrap();
        let e = format!("{:#}", resolve_with(Path::new("org/tiny"), &l).unwrap_err());
        assert!(e.contains("2 snapshots"), "{e}");
        std::fs::remove_dir_all(&other).unwrap();
        assert_eq!(resolve_with(Path::new("org/tiny"), &l).unwrap(), main);
        std::fs::remove_dir_all(&hub).unwrap();
    }

    #[test]
    fn a_gguf_repo_gives_its_one_file() {
        let hub = scratch("gguf");
        let snap = fake_repo(&hub, "models--org--q", H1, &[("m-q4.gguf", b"GGUF"), ("README.md", b"x")], &["main"]);
        let l = loc(&hub);
        assert_eq!(resolve_with(Path::new("org/q"), &l).unwrap(), snap.join("m-q4.gguf"));
        std::fs::write(snap.join("m-q8.gguf"), b"GGUF").unwrap();
        let e = format!("{:#}", resolve_with(Path::new("org/q"), &l).unwrap_err());
        assert!(e.contains("several .gguf files (m-q4.gguf, m-q8.gguf)") && e.contains("ORG/NAME:QUANT"), "{e}");
        std::fs::remove_dir_all(&hub).unwrap();
    }

    #[test]
    fn a_quant_tag_picks_one_gguf_file_and_projectors_are_never_the_model() {
        let hub = scratch("quant");
        let files: &[(&str, &[u8])] = &[
            ("gemma-4-E4B-it-Q4_K_M.gguf", b"GGUF"),
            ("gemma-4-E4B-it-UD-Q4_K_M.gguf", b"GGUF"),
            ("gemma-4-E4B-it-Q8_0.gguf", b"GGUF"),
            ("mmproj-F16.gguf", b"GGUF"),
        ];
        let snap = fake_repo(&hub, "models--org--g", H1, files, &["main"]);
        let l = loc(&hub);
        let pick = |tag: &str| resolve_with(Path::new(&format!("org/g:{tag}")), &l);
        assert_eq!(pick("q8_0").unwrap(), snap.join("gemma-4-E4B-it-Q8_0.gguf"));
        // Inside both names; the one that ends in `-Q4_K_M` wins.
        assert_eq!(pick("Q4_K_M").unwrap(), snap.join("gemma-4-E4B-it-Q4_K_M.gguf"));
        assert_eq!(pick("UD-Q4_K_M").unwrap(), snap.join("gemma-4-E4B-it-UD-Q4_K_M.gguf"));
        assert_eq!(
            resolve_with(Path::new(&format!("org/g@{H1}:Q8_0")), &l).unwrap(),
            snap.join("gemma-4-E4B-it-Q8_0.gguf")
        );
        let e = format!("{:#}", pick("Q5_K_M").unwrap_err());
        assert!(e.contains("no .gguf file matches `:Q5_K_M`") && !e.contains("mmproj"), "{e}");
        let e = format!("{:#}", pick("F16").unwrap_err());
        assert!(e.contains("no .gguf file matches"), "the projector is not a candidate: {e}");
        // Pieces of a name, not any substring.
        assert_eq!(pick("Q8").unwrap(), snap.join("gemma-4-E4B-it-Q8_0.gguf"));
        assert!(pick("K_M").is_err() && pick("8_0").is_err() && pick("_0").is_err());
        let e = format!("{:#}", pick("it").unwrap_err());
        assert!(e.contains("several .gguf files match `:it`"), "{e}");
        // The projector beside one model file leaves no ambiguity without a tag.
        for (name, _) in &files[1..3] {
            std::fs::remove_file(snap.join(name)).unwrap();
        }
        assert_eq!(resolve_with(Path::new("org/g"), &l).unwrap(), snap.join("gemma-4-E4B-it-Q4_K_M.gguf"));
        // A checkpoint repo takes no tag.
        fake_repo(&hub, "models--org--c", H1, &[("config.json", b"{}")], &["main"]);
        let e = format!("{:#}", resolve_with(Path::new("org/c:Q4_K_M"), &l).unwrap_err());
        assert!(e.contains("checkpoint directory"), "{e}");
        std::fs::remove_dir_all(&hub).unwrap();
    }

    #[test]
    fn missing_repos_say_how_to_get_them() {
        let hub = scratch("missing");
        let e = format!("{:#}", resolve_with(Path::new("google/gemma-3-270m-it"), &loc(&hub)).unwrap_err());
        assert!(e.contains("not in the Hugging Face cache") && e.contains("hf download google/gemma-3-270m-it"), "{e}");
        let offline = Locations { hf_hub: Some(hub.clone()), offline: true };
        let e = format!("{:#}", resolve_with(Path::new("google/gemma-3-270m-it"), &offline).unwrap_err());
        assert!(e.contains("HF_HUB_OFFLINE is set"), "{e}");
        let e = format!("{:#}", resolve_with(Path::new("no-such-model"), &loc(&hub)).unwrap_err());
        assert!(e.contains("does not exist"), "{e}");
        // A folder whose download never finished: no snapshot at all.
        std::fs::create_dir_all(hub.join("models--org--half/snapshots")).unwrap();
        let e = format!("{:#}", resolve_with(Path::new("org/half"), &loc(&hub)).unwrap_err());
        assert!(e.contains("no snapshot"), "{e}");
        std::fs::remove_dir_all(&hub).unwrap();
    }

    #[test]
    fn an_existing_path_wins_over_a_repo_id() {
        let root = scratch("path");
        let local = root.join("org/tiny");
        std::fs::create_dir_all(&local).unwrap();
        let hub = root.join("hub");
        fake_repo(&hub, "models--org--tiny", H1, &[("config.json", b"{}")], &["main"]);
        let cwd_relative = local.clone();
        assert_eq!(resolve_with(&cwd_relative, &loc(&hub)).unwrap(), local);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn truthy_values() {
        for v in ["1", "ON", "yes", "True"] {
            assert!(is_truthy(v), "{v}");
        }
        for v in ["0", "", "off", "no"] {
            assert!(!is_truthy(v), "{v}");
        }
    }
}
