"""Nsight Compute's `--csv --print-units base` metric table as a list of launches, for the tools that
read it (tools/ncu_decode.sh, tools/ncu_step.sh)."""

import collections
import csv
import sys


def launches(path, tool):
    """[(kernel name, {metric name: value})] in launch order; exits with the output's tail when
    the file holds no table (ncu failed, or the program did)."""
    rows = list(csv.reader(open(path)))
    head = [i for i, r in enumerate(rows) if "Kernel Name" in r]
    if not head:
        sys.exit(f"{tool}: no ncu table in the output:\n" + open(path).read()[-2000:])
    h = rows[head[0]]
    ix = {k: i for i, k in enumerate(h)}
    by_id = collections.OrderedDict()
    for r in rows[head[0] + 1:]:
        if len(r) == len(h):
            metric, value = r[ix["Metric Name"]], r[ix["Metric Value"]].replace(",", "")
            by_id.setdefault((r[ix["ID"]], r[ix["Kernel Name"]]), {})[metric] = value
    return [(name, m) for (_, name), m in by_id.items()]
