"""Triton's ``num_stages`` for the flush launches (issue 15, 2026-12-02, thirteenth session).

Times the flush at B = 256 on the H200 geometries (``flush_tune.py``'s sets, ``fp32`` policy,
the serving call: stored anchor in, A out, S q, S not written) with
``flush.FLUSH_NUM_STAGES`` set to Triton's default (3, passed explicitly; ``default``) and to
1-4, for four launches: GDN's fold of cached corrections (a single-checkpoint policy's flush,
``loop`` 32 x 2 ``tf32x3_full``), GDN's fused correction solve (``loop`` 16 x 2
``tf32x3_full`` + inverse, and the former ``loop`` 64 x 4 FP32 dot + inverse) and Mamba-2's
fp32 flush (``loop`` 32 x 2 ``tf32x3_full``). CUDA-graph medians (``decode.timer``, 30 calls,
4 sets rotated); ``same_bits``: the stored anchor equals the first depth's byte for byte.
Every launch takes the ordinary anchor loads (``anchor_tma=False``): since 2026-12-05 GDN's
correction solve against an FP32 anchor takes a TMA descriptor at a fixed loop depth by
default (``flush.FLUSH_ANCHOR_TMA``), which this depth sweep would not reach.

Usage (on the device; fla not needed)::

    python benchmarks/flush_stages.py --out $OUT/flush_stages_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import flush_tune as ft  # noqa: E402
from _commit import code_commit  # noqa: E402

import replayssm_quant.kernels.replay.flush as F  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

CASES = [("gdn", True, ("loop", 32, 2, "tf32x3_full")),
         ("gdn", False, ("loop", 16, 2, "tf32x3_full+inverse")),
         ("gdn", False, ("loop", 64, 4, "dot+inverse")),
         ("mamba2", False, ("loop", 32, 2, "tf32x3_full"))]
DEPTHS = (("default", 3), ("1", 1), ("2", 2), ("3", 3), ("4", 4))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flush_stages.py times CUDA launches; run it on the device")
    pol = StatePolicy.parse("fp32")
    out = {"command": " ".join(sys.argv), "code_commit": code_commit(),
           "device": torch.cuda.get_device_name(0), "timing": "CUDA graph, decode.timer",
           "results": {}}
    keep = F.FLUSH_NUM_STAGES
    try:
        for name, fold, cfg in CASES:
            M = next(m for m in ft.geometries(False, fold) if m.name == name)
            gen = torch.Generator(device="cuda").manual_seed(5)
            pool = [ft.make_set(M, gen, pol) for _ in range(4)]
            fk = ft.flush_kw(M)
            base = None
            for label, ns in DEPTHS:
                F.FLUSH_NUM_STAGES = ns
                r, _ = ft.run_flush(M, pool[0], pol, fk, cfg, anchor_tma=False)
                a = r.checkpoints.anchor_stored
                same = None if base is None else bool(torch.equal(a, base))
                base = a.clone() if base is None else base
                t = dc.timer(lambda i: ft.run_flush(M, pool[i], pol, fk, cfg,
                                                    anchor_tma=False), len(pool),
                             args.reps, 3, mode="graph")
                key = f"{name}{'-fold-cached' if fold else ''} {'/'.join(map(str, cfg))} " \
                      f"stages={label}"
                out["results"][key] = {"median_us": t["median_us"], "min_us": t["min_us"],
                                       "same_bits_as_default": same}
                print(key, out["results"][key], flush=True)
    finally:
        F.FLUSH_NUM_STAGES = keep
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
