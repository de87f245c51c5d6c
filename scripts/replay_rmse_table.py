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

from replayssm_quant.replay.drift import DEFAULT_POLICIES, policy_drift


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    ap.add_argument("--models", nargs="+", default=["mamba2", "gdn"], choices=["mamba2", "gdn"])
    ap.add_argument("--csv", default=None, help="write the tidy rows here")
    args = ap.parse_args(argv)
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
