#!/usr/bin/env bash
# The real Gemma 3 270M GGUF (253 MB) for the GPU machine, whose calls carry at most 64 MiB:
#   tools/ship_gguf.sh [FILE]   here: split FILE (default: the file `megagemma pull gemma3-270m` puts in
#                               .cache/megagemma/models) into .gpu-gguf/part_* of 47 MiB, print the calls
#   tools/ship_gguf.sh --join   on the GPU machine: join the pieces into
#                               .gpu-gguf/gemma-3-270m-q4_k_m.gguf and check its SHA-256
# Send the pieces in back-to-back device calls as printed (a machine stays warm ~30 s after a call
# and keeps ignored files between calls; the first call also carries `.gpu`, the binaries); the
# last call runs `--join`, then `tools/gpu_session.sh`, which finds the file and checks CUDA's ids
# against transformers' (tools/gguf_check.py).
set -euo pipefail
DIR=.gpu-gguf
NAME=gemma-3-270m-q4_k_m.gguf
if [ "${1:-}" = "--join" ]; then
  cat "$DIR"/part_* > "$DIR/$NAME"
  (cd "$DIR" && sha256sum -c SHA256SUMS)
  exit 0
fi
FILE=${1:-.cache/megagemma/models/$NAME}
[ -f "$FILE" ] || { echo "ship_gguf.sh: $FILE not found (megagemma pull gemma3-270m)" >&2; exit 2; }
rm -rf "$DIR" && mkdir -p "$DIR"
split -b 47M -a 2 "$FILE" "$DIR/part_"
(cd "$(dirname "$FILE")" && sha256sum "$(basename "$FILE")") > "$DIR/SHA256SUMS"
# Pack the pieces into calls of at most 64 MiB, counting the tracked tree every call sends too;
# the first call also carries .gpu (the binaries).
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024 - ${tree:-0} - 1024 * 1024))
gpu=$(du -sb .gpu 2>/dev/null | cut -f1)
python3 - "$limit" "${gpu:-0}" "$DIR" <<'PY'
import os, sys
limit, gpu, d = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
parts = sorted(f for f in os.listdir(d) if f.startswith("part_"))
calls = [[".gpu", f"{d}/SHA256SUMS"]]
room = [limit - gpu]
for p in sorted(parts, key=lambda f: -os.path.getsize(f"{d}/{f}")):
    size = os.path.getsize(f"{d}/{p}")
    i = next((i for i, r in enumerate(room) if r >= size), None)
    if i is None:
        calls.append([]), room.append(limit)
        i = len(calls) - 1
    calls[i].append(f"{d}/{p}")
    room[i] -= size
for i, c in enumerate(calls):
    last = i == len(calls) - 1
    cmd = "tools/ship_gguf.sh --join && QUICK=1 tools/gpu_session.sh .gpu" if last else f"ls -la {d}"
    print(f"call {i + 1}: carry {c}  command: {cmd}")
PY
