"""Summarise Nsight Compute's SASS view of one kernel: the share of executed instructions and
of warp-stall samples per opcode, and the 40 lines with the most stall samples.

Usage (on the device; the report from ``ncu --section SourceCounters -o REPORT ...``)::

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/ncu_sass_summary.py src.csv > summary.txt
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys


def _num(row, i):
    """The number in column ``i`` of ``row`` (an empty cell is 0)."""
    cell = row[i].replace(",", "").strip() if i < len(row) else ""
    if not cell:
        return 0.0
    try:
        return float(cell)
    except ValueError:
        raise ValueError(f"not a number in column {i}: {row[i]!r} (row {row[:2]})") from None


def summarise(path: str) -> str:
    """The text summary of the CSV at ``path`` (raises ValueError if it has no Source column)."""
    with open(path, errors="replace") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if head is None:
        raise ValueError(f"{path}: no 'Source' column (not an ncu --page source --csv dump)")
    cols = rows[head]

    def col(name):
        i = next((i for i, c in enumerate(cols) if c.startswith(name)), None)
        if i is None:
            raise ValueError(f"{path}: no '{name}...' column (profile with --section "
                             f"SourceCounters); columns: {cols}")
        return i

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
    te, ts = sum(ops.values()), sum(stall.values())
    out = [f"total inst executed {te:.4g}, stall samples {ts:.4g}, lines {len(data)}"]
    te, ts = te or 1.0, ts or 1.0  # shares of nothing are 0
    out += [f"{op:10s} inst {ex / te * 100:5.1f}%  stall {stall[op] / ts * 100:5.1f}%"
            for op, ex in ops.most_common(30)]
    out.append("top lines by stall samples:")
    out += [f"{st / ts * 100:5.2f}% {ex / te * 100:5.2f}%  {src}"
            for src, ex, st in sorted(data, key=lambda x: -x[2])[:40]]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass output")
    args = ap.parse_args(argv)
    try:
        print(summarise(args.csv))
    except (OSError, ValueError) as e:
        sys.exit(f"ncu_sass_summary.py: {e}")


if __name__ == "__main__":
    main()
