#!/usr/bin/env python3
"""Where a kernel launch's instructions go, by source line: Nsight Compute's per-instruction counts
(SourceCounters) joined with the CUBIN's line table (docs/perf-notes.md, fourteenth session).

    python3 tools/ncu_lines.py SASS_CSV CUBIN_DIR [--launch I] [--top N]

SASS_CSV is `ncu -i REPORT --page source --csv --print-source sass` (one block per profiled
launch); CUBIN_DIR holds the kernel cache's CUBINs (`$MEGAGEMMA_CACHE/kernels`). The CUBIN of a
launch is the one whose SASS for that kernel matches the profiled instructions, so several builds
of a file (kernel experiments) may sit side by side. Lines refer to the kernel file as NVRTC
compiles it (`#include`s inlined, as `kernel_source` in src/compile.rs does); the table prints
each line's text. `tools/ncu_source.sh` runs the whole thing on the GPU machine.

Three tables for the launch: by call site in the kernel's top function (the second-outermost frame
of each instruction's inline chain), by source line (innermost frame), and the instructions every
warp executes exactly once (the fixed path), by call site. Counts are warp instructions; "per warp"
divides by the warps that ran the kernel's first instruction.

    python3 tools/ncu_lines.py --source FILE.cu   # the file as NVRTC compiles it (for line numbers)
"""

import argparse
import collections
import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "crates" / "megagemma-cuda" / "kernels"


def rust_lines(s):
    """`str::lines()`: split at '\n', a trailing '\r' dropped, no empty last line."""
    parts = s.split("\n")
    if parts and parts[-1] == "":
        parts.pop()
    return [p[:-1] if p.endswith("\r") else p for p in parts]


def kernel_source(name, kernels=KERNELS):
    """The source of `name` as NVRTC compiles it, character for character (src/compile.rs
    `kernel_source`, checked by a test): `#include`s of other kernel files inlined, then
    common.cuh inlined once (without `#pragma once`)."""
    read = lambda f: (kernels / f).read_text(encoding="utf-8")  # noqa: E731
    lines = []
    for line in rust_lines(read(name)):
        t = line.strip()
        inc = t[len('#include "') : -1] if t.startswith('#include "') and t.endswith('"') else None
        lines.append(read(inc) if inc is not None and inc != "common.cuh" else line)
    src = "\n".join(lines)
    common = "\n".join(l for l in rust_lines(read("common.cuh")) if l.strip() != "#pragma once")
    out, seen = [], False
    for line in rust_lines(src):
        if line.strip() == '#include "common.cuh"':
            if not seen:
                out.append(common)
                seen = True
        else:
            out.append(line)
    return "\n".join(out)


def launches(csv_path):
    """[(kernel name, [(offset, opcode text, executed, stall samples)])] per profiled launch."""
    rows = list(csv.reader(open(csv_path, newline="")))
    starts = [i for i, r in enumerate(rows) if r and r[0] == "Kernel Name"]
    out = []
    for n, b in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(rows)
        head = rows[b + 1]
        ix = {k: i for i, k in enumerate(head)}
        insts, base = [], None
        for r in rows[b + 2 : end]:
            if len(r) != len(head):
                continue
            addr = int(r[ix["Address"]], 16)
            base = addr if base is None else base
            insts.append(
                (
                    addr - base,
                    r[ix["Source"]].strip(),
                    int(r[ix["Instructions Executed"]] or 0),
                    int(r[ix["Warp Stall Sampling (All Samples)"]] or 0),
                )
            )
        out.append((rows[b][1], insts))
    return out


def line_table(sass_text, kernel):
    """offset -> (inline chain of line numbers, innermost first; instruction text) for `kernel`
    in `nvdisasm -gi` output."""
    lines = sass_text.splitlines()
    try:
        start = lines.index(f".text.{kernel}:")
    except ValueError:
        return None
    table, chain, pending = {}, [], []
    for line in lines[start + 1 :]:
        if line.startswith(".text."):
            break
        m = re.match(r'\s*//## File "[^"]*", line (\d+)', line)
        if m:
            pending.append(int(m.group(1)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            if pending:
                chain, pending = pending, []
            table[int(m.group(1), 16)] = (chain, m.group(2))
    return table


def opcode(text):
    parts = text.split()
    return parts[1] if parts and parts[0].startswith("@") and len(parts) > 1 else (parts[0] if parts else "")


def find_cubin(cubins, kernel, insts, nvdisasm, listings):
    """The CUBIN whose SASS of `kernel` has the profiled instructions, with its line table.
    `listings` keeps each CUBIN's `nvdisasm -gi` text across launches (a megakernel CUBIN takes
    seconds to disassemble)."""
    for path in sorted(cubins):
        if path not in listings:
            listings[path] = subprocess.run([nvdisasm, "-gi", str(path)], capture_output=True, text=True).stdout
        table = line_table(listings[path], kernel)
        if not table or len(table) != len(insts):
            continue
        if all(opcode(table.get(off, ([], ""))[1]) == opcode(text) for off, text, _, _ in insts):
            return path, table
    return None, None


def report(kernel, insts, table, source, top):
    text = source.splitlines()
    show = lambda ln: text[ln - 1].strip()[:90] if 0 < ln <= len(text) else "?"  # noqa: E731
    total = sum(n for _, _, n, _ in insts)
    stalls = sum(s for _, _, _, s in insts)
    warps = insts[0][2] if insts else 0
    by_site, by_line, once = collections.Counter(), collections.Counter(), collections.Counter()
    stall_site, stall_line = collections.Counter(), collections.Counter()
    for off, _, n, s in insts:
        chain = table[off][0] or [0]
        site = chain[-2] if len(chain) > 1 else chain[-1]
        by_site[site] += n
        stall_site[site] += s
        by_line[chain[0]] += n
        stall_line[chain[0]] += s
        if n == warps:
            once[site] += 1
    per = lambda n: n / warps if warps else 0.0  # noqa: E731
    print(f"{kernel}: {total:,} warp instructions over {warps:,} warps ({per(total):,.0f} per warp), {stalls:,} stall samples")
    print("\nby call site in the kernel's top function: per warp, share of instructions, share of stall samples")
    for ln, n in sorted(by_site.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {per(n):8.1f} {100 * n / total:5.1f}% {100 * stall_site[ln] / max(stalls, 1):5.1f}%  L{ln}: {show(ln)}")
    print("\nby source line (innermost frame)")
    for ln, n in sorted(by_line.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {per(n):8.1f} {100 * n / total:5.1f}% {100 * stall_line[ln] / max(stalls, 1):5.1f}%  L{ln}: {show(ln)}")
    print(f"\nexecuted exactly once by every warp (the fixed path): {sum(once.values())} instructions, by call site")
    for ln, n in sorted(once.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {n:6d}  L{ln}: {show(ln)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="?", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("cubins", nargs="?", help="folder of CUBINs (the kernel cache's kernels/)")
    ap.add_argument("--launch", type=int, action="append", help="profiled launch index (default: all)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--kernels", type=Path, default=KERNELS, help="kernel sources (default: the repository's)")
    ap.add_argument("--source", help="print FILE.cu as NVRTC compiles it and exit")
    args = ap.parse_args()
    if args.source:
        sys.stdout.write(kernel_source(args.source, args.kernels))
        return
    if not args.csv or not args.cubins:
        ap.error("SASS_CSV and CUBIN_DIR are required")
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm") or "/usr/local/cuda/bin/nvdisasm"
    cubins = list(Path(args.cubins).glob("*.cubin"))
    all_launches = launches(args.csv)
    listings = {}
    for i in args.launch or range(len(all_launches)):
        kernel, insts = all_launches[i]
        path, table = find_cubin(cubins, kernel, insts, nvdisasm, listings)
        print(f"=== launch {i}: {kernel}" + (f" ({path.name})" if path else ""))
        if path is None:
            print(f"  no CUBIN in {args.cubins} has this launch's SASS for {kernel}")
            continue
        file = path.name.rsplit("-", 1)[0] + ".cu"
        report(kernel, insts, table, kernel_source(file, args.kernels), args.top)
        print()


if __name__ == "__main__":
    main()
