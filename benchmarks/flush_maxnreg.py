"""Register caps (ptxas ``maxnreg``) on the flush kernel, a lead for issue 15 (twenty-third
pass, docs/kernels-replay.md): every ``_flush_kernel`` launch of a flush capped through a
stand-in wrapper (written before ``flush_kernel(maxnreg=...)``), B = 256 on the H200
geometries, the ``fp32``
flush and the split ``read:nvfp4/rec:fp16+sr`` flush (its fp32 flush reads the fp16 anchor;
the pair cast is not capped), CUDA-graph medians in us, the stored anchor of each capped run
compared bit for bit with the first run's.

Usage (on the device)::

    python benchmarks/flush_maxnreg.py --out $OUT/flush_maxnreg_h200.json
    python benchmarks/flush_maxnreg.py --models mamba2 --policies read:nvfp4/rec:fp16+sr \\
        --caps none,176,168,160,152,none,168,176 --reps 40 --out $OUT/flush_maxnreg_r2_h200.json
    python benchmarks/flush_maxnreg.py --models gdn --policies fp32 --fold-cached \\
        --caps none,224,192,168,128,none --reps 30 --out $OUT/flush_maxnreg_fold_h200.json

``--fold-cached``: GDN folds cached corrections (the ``fp32`` policy's serving flush in
``decode.py``) instead of solving them.
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
from records_maxnreg import capped  # noqa: E402

import replayssm_quant.kernels.replay.flush as F  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="gdn,mamba2")
    ap.add_argument("--policies", default="fp32,read:nvfp4/rec:fp16+sr")
    ap.add_argument("--caps", default="none,224,192,168,128,96",
                    help="comma list of caps, 'none' for the uncapped kernel (may repeat)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--fold-cached", action="store_true",
                    help="GDN folds cached corrections (the fp32 policy's serving flush in "
                         "decode.py) instead of solving them")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flush_maxnreg.py times CUDA launches; run it on the device")
    caps = [None if c == "none" else int(c) for c in args.caps.split(",")]
    out = {"command": " ".join(sys.argv), "code_commit": code_commit(),
           "device": torch.cuda.get_device_name(0), "timing": "CUDA graph, median us",
           "results": []}
    for M in ft.geometries(False, args.fold_cached):
        if M.name not in args.models.split(","):
            continue
        fk = ft.flush_kw(M)
        cfg = ft.launch_cfg(M.V, False, M.solves, M.L)
        gen = torch.Generator(device="cuda").manual_seed(5)
        for pstr in args.policies.split(","):
            pol = StatePolicy.parse(pstr)
            pool = [ft.make_set(M, gen, pol) for _ in range(3)]
            kw = fk if pol.rec.is_identity and pol.read.is_identity else dict(fk, split_casts=True)
            base = None
            for cap in caps:
                with capped(F, "_flush_kernel", cap):
                    a = ft.run_flush(M, pool[0], pol, kw, cfg)[0].checkpoints.anchor_stored
                    a = a if isinstance(a, torch.Tensor) else a.codes
                    base = a if base is None else base
                    us = dc.timer(lambda i: ft.run_flush(M, pool[i], pol, kw, cfg), 3, args.reps,
                                  3, mode="graph")["median_us"]
                row = {"model": M.name, "policy": pstr, "fold_cached": M.fold_cached,
                       "config": list(cfg), "maxnreg": cap,
                       "median_us": round(us, 1), "same_anchor_bits": torch.equal(a, base)}
                out["results"].append(row)
                print(json.dumps(row), flush=True)
            pool = None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
