#!/usr/bin/env bash
# Install the official OpenAI Python client (pinned) into .cache/openai-client, for the test that
# checks `megagemma serve` with it (crates/megagemma/tests/serve_openai_client.rs).
# Usage: tools/fetch_openai_client.sh, then PYTHONPATH=.cache/openai-client python3 ...
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.cache/openai-client"
version="3.57.0"
if [[ -f "$dest/.installed-$version" ]]; then
  exit 0
fi
tmp="$dest.partial.$$"
rm -rf "$tmp"
# pip's resolver may warn about unrelated packages of the system Python: show its output only
# when the install fails.
if ! PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
  --no-warn-script-location --target "$tmp" "openai==$version" >"$tmp.log" 2>&1; then
  cat "$tmp.log" >&2
  rm -rf "$tmp" "$tmp.log"
  echo "error: pip install openai==$version failed (is PyPI reachable?)" >&2
  exit 1
fi
rm -f "$tmp.log"
touch "$tmp/.installed-$version"
rm -rf "$dest"
mv "$tmp" "$dest" 2>/dev/null || { rm -rf "$tmp"; [[ -f "$dest/.installed-$version" ]]; }
echo "openai $version in $dest"
