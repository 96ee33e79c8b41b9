#!/usr/bin/env python3
"""One megakernel decode step, as each block saw it.

    MEGAGEMMA_CUDA_MK_TRACE=trace.json megagemma bench --synthetic e4b --quant q4 --backend cuda \
        --decode megakernel --tokens 8
    python3 tools/mk_trace.py trace.json [--png timeline.png] [--stages 81:89]

The trace (written by the CUDA backend after every megakernel step; the file holds the last one)
has, per block and stage, the %globaltimer nanoseconds at the stage's start, when its wait was
satisfied (0: the block did not wait) and at its end. This prints where the token's time goes per
stage kernel (the same attribution as `gpu_check megakernel`: from the previous stage's last block
to finish to this stage's last block to finish) and, with --png, draws a timeline: one row per
block, grey while waiting, coloured by stage kernel while working (needs matplotlib).

With --against OTHER.json (a trace of the same stage table, e.g. under a define) it also prints, per
stage kernel, the token's µs in both and the change, and the stages whose critical path changed most.

With `MEGAGEMMA_CUDA_DEFINES=MK_MARK=1` (or `=2`) the "wait satisfied" time of a tensor-core matvec
stage is instead when its folded residual statistics (or its first inputs) are done, so the
"waits met" column of --stages shows how long after the stage's start each phase ends.
"""
import argparse
import json
import sys


def by_kernel(trace):
    grid, names, t = trace["grid"], trace["stages"], trace["t"]
    rows = {}
    prev_end = min(t[b][0][0] for b in range(grid))
    for s, name in enumerate(names):
        cells = [t[b][s] for b in range(grid)]
        end = max(c[2] for c in cells)
        waited = [c for c in cells if c[1] != 0]
        wait = sum(c[1] - c[0] for c in waited) / len(waited) / 1e3 if waited else 0.0
        work = sum(c[2] - c[1] for c in waited) / len(waited) / 1e3 if waited else 0.0
        r = rows.setdefault(name, {"stages": 0, "critical_us": 0.0, "wait": [], "work": []})
        r["stages"] += 1
        r["critical_us"] += max(0, end - prev_end) / 1e3
        r["wait"].append(wait)
        r["work"].append(work)
        prev_end = max(prev_end, end)
    return sorted(rows.items(), key=lambda kv: -kv[1]["critical_us"])


def per_stage(trace, first, last):
    """Rows for stages [first, last): critical-path µs (previous stage's last block to finish to this
    stage's), blocks that worked, when their waits were satisfied (µs after the previous stage
    ended: first, median, last) and their work (min, median, max µs)."""
    grid, names, t = trace["grid"], trace["stages"], trace["t"]
    prev_end = max(t[b][first - 1][2] for b in range(grid)) if first > 0 else min(t[b][0][0] for b in range(grid))
    rows = []
    for s in range(first, last):
        cells = [t[b][s] for b in range(grid)]
        end = max(c[2] for c in cells)
        waited = [c for c in cells if c[1] != 0]
        work = sorted(c[2] - c[1] for c in waited) or [0]
        sat = sorted(c[1] - prev_end for c in waited) or [0]
        rows.append((s, names[s], (end - prev_end) / 1e3, len(waited), sat[0] / 1e3, sat[len(sat) // 2] / 1e3,
                     sat[-1] / 1e3, work[0] / 1e3, work[len(work) // 2] / 1e3, work[-1] / 1e3))
        prev_end = max(prev_end, end)
    return rows


def compare(a, b, top=12):
    """Lines comparing traces a and b of the same stage table: per stage kernel the critical-path µs
    in each and the change, then the `top` stages whose critical path changed most."""
    if a["stages"] != b["stages"]:
        sys.exit("--against: the two traces are of different stage tables")
    n = len(a["stages"])
    ka, kb = dict(by_kernel(a)), dict(by_kernel(b))
    lines = [f"{'stage kernel':<26} {'stages':>6} {'A us':>9} {'B us':>9} {'change':>8}"]
    for name in sorted(ka, key=lambda k: -abs(kb[k]["critical_us"] - ka[k]["critical_us"])):
        ua, ub = ka[name]["critical_us"], kb[name]["critical_us"]
        lines.append(f"{name:<26} {ka[name]['stages']:>6} {ua:>9.1f} {ub:>9.1f} {ub - ua:>+8.1f}")
    ra, rb = per_stage(a, 0, n), per_stage(b, 0, n)
    ta, tb = sum(r[2] for r in ra), sum(r[2] for r in rb)
    lines.append(f"{'all':<26} {n:>6} {ta:>9.1f} {tb:>9.1f} {tb - ta:>+8.1f}")
    lines.append("\nstages whose critical path changed most (us, A -> B):")
    moved = sorted(zip(ra, rb), key=lambda p: -abs(p[1][2] - p[0][2]))[:top]
    for x, y in moved:
        lines.append(f"{x[0]:>5} {x[1]:<26} {x[2]:>7.2f} -> {y[2]:>7.2f} ({y[2] - x[2]:+.2f})")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--png", help="write a timeline picture here")
    ap.add_argument("--stages", metavar="FIRST:LAST", help="also one line per stage in [FIRST, LAST) (e.g. one layer)")
    ap.add_argument("--against", metavar="OTHER", help="compare with another trace of the same stage table")
    args = ap.parse_args()
    with open(args.trace) as f:
        trace = json.load(f)
    grid, names, t = trace["grid"], trace["stages"], trace["t"]
    total = max(t[b][-1][2] for b in range(grid)) / 1e3
    print(f"{len(names)} stages on {grid} blocks, {total:.1f} us")
    print(f"{'stage kernel':<26} {'stages':>6} {'token us':>9} {'share':>6} {'mean wait us':>13} {'mean work us':>13}")
    for name, r in by_kernel(trace):
        mean = lambda v: sum(v) / len(v)
        print(f"{name:<26} {r['stages']:>6} {r['critical_us']:>9.1f} {100 * r['critical_us'] / total:>5.1f}% "
              f"{mean(r['wait']):>13.2f} {mean(r['work']):>13.2f}")
    if args.stages:
        first, last = (int(v) for v in args.stages.split(":"))
        if not 0 <= first < last <= len(names):
            sys.exit(f"--stages: need 0 <= FIRST < LAST <= {len(names)}")
        print(f"\n{'stage':>5} {'kernel':<26} {'critical us':>11} {'blocks':>6} {'waits met min/med/max us':>24} "
              f"{'work min/med/max us':>21}")
        for s, name, crit, n, s0, sm, s1, w0, w1, w2 in per_stage(trace, first, last):
            print(f"{s:>5} {name:<26} {crit:>11.2f} {n:>6} {s0:>7.2f} {sm:>7.2f} {s1:>8.2f} "
                  f"{w0:>6.2f} {w1:>6.2f} {w2:>7.2f}")
    if args.against:
        with open(args.against) as f:
            other = json.load(f)
        print(f"\nA: {args.trace}, B: {args.against}")
        print("\n".join(compare(trace, other)))
    if not args.png:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--png needs matplotlib (pip install matplotlib)")
    kinds = sorted(set(names))
    cmap = plt.get_cmap("tab20")
    colour = {k: cmap(i % 20) for i, k in enumerate(kinds)}
    fig, ax = plt.subplots(figsize=(16, 8))
    for b in range(grid):
        waits, works = [], {k: [] for k in kinds}
        for s, name in enumerate(names):
            start, waited, end = t[b][s]
            if waited > start:
                waits.append((start / 1e3, (waited - start) / 1e3))
            begin = max(start, waited)
            if end > begin:
                works[name].append((begin / 1e3, (end - begin) / 1e3))
        ax.broken_barh(waits, (b, 0.9), facecolors="0.85")
        for k, spans in works.items():
            if spans:
                ax.broken_barh(spans, (b, 0.9), facecolors=colour[k])
    ax.set_xlabel("us since the token's first stage began")
    ax.set_ylabel("block")
    ax.set_title(f"megakernel decode step: {len(names)} stages, {total:.0f} us (grey: waiting)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[k]) for k in kinds]
    ax.legend(handles, kinds, loc="upper right", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"timeline: {args.png}")


if __name__ == "__main__":
    main()
