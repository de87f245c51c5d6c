"""The flush's anchor tiles through a TMA descriptor, with a pipelined row-tile loop
(issue 15, thirty-fifth pass; ``flush_kernel(anchor_tma=..., loop_stages=...)``).

GDN's fp32 flush (the fold of cached corrections that the ``fp32`` policy's decode state
runs) moved its 1175 MB at 83% of the device copy's rate on the H200 at ba7376e; static
sm_90 SASS shows its anchor tiles loaded with ``LDG`` at the top of each iteration of the
row-tile loop, never ahead. This times, at B = 256 on ``flush_tune.py``'s geometries and sets
(CUDA-graph medians, ``decode.timer``, 4 sets rotated), the serving flush (stored anchor in,
the copies out, the flush token's ``S q``, S not written, no corrections returned): under
``fp32`` GDN's fold, GDN's correction solve and Mamba-2's flush; under
``read:nvfp4/rec:fp16+sr`` both models' split flush (whose fp32 flush reads the fp16 anchor
through the descriptor), under ``read:nvfp4/rec:fp32`` GDN's split flush (its fp32 flush
re-solves against the FP32 anchor: ``flush.FLUSH_ANCHOR_TMA``'s key, so its default takes the
descriptor on a device of capability 9.0 or more; config ``loads`` the ordinary loads),
each in its default launch and with ``anchor_tma`` / ``loop_stages`` and a few tiles,
alternating ``--rounds`` times; every row's stored copies and ``S q`` compared byte for byte
with the default's (``same_bits``).

Usage (on the device; fla not needed)::

    python3 benchmarks/flush_tma.py --out $OUT/flush_tma_h200.json
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

from replayssm_quant.policy import StatePolicy  # noqa: E402

NVFP4 = "read:nvfp4/rec:fp16+sr"
# (model, fold cached corrections, policy)
CASES = [("gdn", True, "fp32"), ("gdn", False, "fp32"), ("mamba2", False, "fp32"),
         ("gdn", False, NVFP4), ("mamba2", False, NVFP4),
         ("gdn", False, "read:nvfp4/rec:fp32")]  # the split re-solve against an FP32 anchor
# (label, launch options); the default launch first (the reference of same_bits)
CONFIGS = [("default", {}),
           ("loads", dict(anchor_tma=False)),  # the ordinary loads (the default before 2026-12-05's
           # FLUSH_ANCHOR_TMA, which keys GDN's solve against an FP32 anchor)
           ("tma", dict(anchor_tma=True)),
           ("tma_ls2", dict(anchor_tma=True, loop_stages=2)),
           ("tma_ls3", dict(anchor_tma=True, loop_stages=3)),
           # the fp16-anchor split flush at 199 registers and 43008 B of shared memory in
           # static sm_90 SASS (Triton 3.9): 5 programs an SM by both, against 4 by default
           ("tma_ls1", dict(anchor_tma=True, loop_stages=1)),
           ("ls1", dict(anchor_tma=False, loop_stages=1)),  # the ordinary loads at depth 1
           ("ls2", dict(anchor_tma=False, loop_stages=2)),
           ("tma_ls2_16x2", dict(anchor_tma=True, loop_stages=2, block_v=16, num_warps=2)),
           ("tma_ls2_64x4", dict(anchor_tma=True, loop_stages=2, block_v=64, num_warps=4)),
           ("tma_ls3_16x1", dict(anchor_tma=True, loop_stages=3, block_v=16, num_warps=1))]


def launch(M, opts):
    """``flush_tune.run_flush``'s ``cfg`` and further options for ``opts``: the default launch
    of the fp32 flush that reads the anchor (``flush.flush_launch``: the serving flush under
    ``fp32``, the split's first launch under the nvfp4 policy), with ``opts``' tile."""
    var, bv, nw, form = ft.launch_cfg(M.V, False, M.solves, M.L)
    cfg = (var, opts.get("block_v", bv), opts.get("num_warps", nw), form)
    return cfg, {k: v for k, v in opts.items() if k not in ("block_v", "num_warps")}


def same_bits(got, base):
    """Whether two ``(FlushResult, y)`` hold the same bytes in both copies and in ``y``."""
    (r, y), (r0, y0) = got, base
    return (ft.stored_diff(r.checkpoints.anchor_stored, r0.checkpoints.anchor_stored) == 0
            and ft.stored_diff(r.checkpoints.read_stored, r0.checkpoints.read_stored) == 0
            and ft.stored_diff(y, y0) == 0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default=None,
                    help="comma list of config labels (default all): " +
                         ", ".join(c for c, _ in CONFIGS))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flush_tma.py times CUDA launches; run it on the device")
    want = None if a.configs is None else set(a.configs.split(","))
    configs = [c for c in CONFIGS if want is None or c[0] in want or c[0] == "default"]
    out = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "code_commit": code_commit(), "device": torch.cuda.get_device_name(0),
           "timing": "CUDA graph medians, decode.timer", "rows": []}
    for name, fold, pstr in CASES:
        pol = StatePolicy.parse(pstr)
        M = next(m for m in ft.geometries(False, fold) if m.name == name)
        gen = torch.Generator(device="cuda").manual_seed(5)
        pool = [ft.make_set(M, gen, pol) for _ in range(4)]
        fk = ft.flush_kw(M, split_casts=pstr != "fp32")  # nvfp4: the split (its default)
        base = None
        for rnd in range(a.rounds):
            for label, opts in configs:
                cfg, extra = launch(M, opts)
                row = {"model": name, "fold_cached": fold, "policy": pstr, "config": label,
                       "options": opts, "round": rnd}
                try:
                    got = ft.run_flush(M, pool[0], pol, fk, cfg, **extra)
                    if label == "default":
                        base = got
                    if base is None:  # the default failed: nothing to compare with
                        raise RuntimeError("the default launch failed, so no reference bits")
                    us = dc.timer(lambda i: ft.run_flush(M, pool[i], pol, fk, cfg,  # noqa: B023
                                                         **extra),  # noqa: B023
                                  4, a.reps, 3, mode="graph")["median_us"]
                    row.update(median_us=round(us, 1), reference="default",
                               same_bits=same_bits(got, base))
                except Exception as e:  # noqa: BLE001  (a config that fails is recorded)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                out["rows"].append(row)
                print(json.dumps(row), flush=True)
        pool = None
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
