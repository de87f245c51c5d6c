"""Summarise Nsight Compute's SASS view of one kernel: the share of executed instructions and
of warp-stall samples per opcode, and the 40 lines with the most stall samples.

Usage (on the device; the report from ``ncu --section SourceCounters -o REPORT ...``)::

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/ncu_sass_summary.py src.csv > summary.txt
"""

from __future__ import annotations

import collections
import csv
import sys


def _num(row, i):
    try:
        return float(row[i].replace(",", "")) if i is not None else 0.0
    except (ValueError, IndexError):
        return 0.0


def summarise(path: str) -> str:
    """The text summary of the CSV at ``path`` (raises ValueError if it has no Source column)."""
    rows = list(csv.reader(open(path, errors="replace")))
    head = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if head is None:
        raise ValueError(f"{path}: no 'Source' column (not an ncu --page source --csv dump)")
    cols = rows[head]

    def col(name):
        return next((i for i, c in enumerate(cols) if c.startswith(name)), None)

    isrc, iex, ist = col("Source"), col("Instructions Executed"), col("Warp Stall Sampling (All")
    data = [(r[isrc].strip(), _num(r, iex), _num(r, ist)) for r in rows[head + 1:]
            if len(r) > isrc]
    ops, stall = collections.Counter(), collections.Counter()
    for src, ex, st in data:
        words = src.split() or ["?"]
        op = (words[1] if words[0].startswith("@") and len(words) > 1 else words[0])
        op = op.split(".")[0]
        ops[op] += ex
        stall[op] += st
    te, ts = sum(ops.values()) or 1.0, sum(stall.values()) or 1.0
    out = [f"total inst executed {te:.4g}, stall samples {ts:.4g}, lines {len(data)}"]
    out += [f"{op:10s} inst {ex / te * 100:5.1f}%  stall {stall[op] / ts * 100:5.1f}%"
            for op, ex in ops.most_common(30)]
    out.append("top lines by stall samples:")
    out += [f"{st / ts * 100:5.2f}% {ex / te * 100:5.2f}%  {src}"
            for src, ex, st in sorted(data, key=lambda x: -x[2])[:40]]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: ncu_sass_summary.py SOURCE_PAGE.csv")
    print(summarise(sys.argv[1]))
