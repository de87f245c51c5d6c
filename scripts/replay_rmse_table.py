#!/usr/bin/env python
"""Issue 3, test 7: output / anchor RMSE of state policies against fp32 on seeded random
inputs with realistic decays (alpha in [0.9, 0.9999]), Mamba-2 and GDN, several seeds.

Usage:
    python scripts/replay_rmse_table.py --seeds 0 1 2 --steps 512 --window 16 [--csv out.csv]

Prints a markdown table (the one in docs/replay.md) and, with --csv, writes the tidy rows.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time

import torch

from replayssm_quant.policy import StatePolicy
from replayssm_quant.replay.drift import DEFAULT_POLICIES, policy_drift


def _int_at_least(lo: int):
    """argparse type: an int >= ``lo``, else an error naming the value."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=_int_at_least(0), nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=_int_at_least(1), default=512, help="decode steps (tokens)")
    ap.add_argument("--window", type=_int_at_least(1), default=16, help="window L (tokens)")
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    ap.add_argument("--models", nargs="+", default=["mamba2", "gdn"], choices=["mamba2", "gdn"])
    ap.add_argument("--csv", default=None, help="write the tidy rows here")
    args = ap.parse_args(argv)
    for p in args.policies:
        try:
            StatePolicy.parse(p)
        except ValueError as e:
            ap.error(f"--policies: {e}")
    torch.set_num_threads(1)
    t0 = time.time()
    rows = [r for m in args.models for s in args.seeds
            for r in policy_drift(m, args.policies, steps=args.steps, window=args.window, seed=s)]
    print("| model | policy | seed | output RMSE (rel.) | anchor RMSE (rel.) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | `{r['policy']}` | {r['seed']} | {r['out_rmse']:.3e} | {r['anchor_rmse']:.3e} |")
    print(f"\nsteps={args.steps} window={args.window} seeds={args.seeds} "
          f"torch={torch.__version__} time={time.time() - t0:.1f}s", file=sys.stderr)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
