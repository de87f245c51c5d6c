"""GDN's FP32 decode step at B = 256 in launch variants around its default (issue 15,
thirty-fifth pass): where does the step's time over a bare read go on this device?

Each variant is ``decode.run_step`` with options of ``gdn_step_kernel``: the default
(``GDN_STEP_F32_CONFIG``: the products launch, then the ``"lean_out"`` read pass dependent on
it through PDL); ``pdl=False`` (the products launch complete before the read pass starts:
the read pass's own time without waiting); the products launch on 1, 4 or 8 warps
(``num_warps``, which in this form sets only that launch's warps); the read pass on other
tiles. CUDA-graph medians over ``decode.py``'s rotated sets at h = 0, 7 and 14, alternating
``--rounds`` times; for some variants also the kernels' CUPTI times (``op_kernels``); every
variant's output against the default's (max abs difference: the tiles reassociate sums, so
the last bits may differ; the products launch's warps and PDL may not change them).

Usage (on the device)::

    python3 benchmarks/step_variants.py --out $OUT/step_variants.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import op_kernels as ok  # noqa: E402
import replay_kernels as rk  # noqa: E402
from _commit import code_commit  # noqa: E402

from replayssm_quant.policy import StatePolicy  # noqa: E402

VARIANTS = [("default", {}), ("pdl_off", dict(pdl=False)),
            ("products_w1", dict(num_warps=1)), ("products_w4", dict(num_warps=4)),
            ("products_w8", dict(num_warps=8)),
            ("rp16x1", dict(read_pass=(16, 1, "lean_out"))),
            ("rp32x2", dict(read_pass=(32, 2, "lean_out"))),
            ("rp64x2", dict(read_pass=(64, 2, "lean_out"))),
            ("rp64x4", dict(read_pass=(64, 4, "lean_out"))),
            ("rp128x4", dict(read_pass=(128, 4, "lean_out")))]
PROFILED = ("default", "pdl_off", "products_w1", "products_w4")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--h", default="0,7,14")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_variants.py times CUDA launches; run it on the device")
    M = rk.Model("gdn", a.B, 32, 16, 128, 128, 16)
    pol = StatePolicy.parse("fp32")
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = [dc.make_set(M, gen, pol, 8, False) for _ in range(2)]
    res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "device": torch.cuda.get_device_name(), "code_commit": code_commit(),
           "timing": "CUDA graph medians (decode.timer)", "rows": []}
    for hv in (int(x) for x in a.h.split(",")):
        h = torch.full((a.B,), hv, dtype=torch.int64, device="cuda")
        base = dc.run_step(M, pool[0], h).clone()
        for rnd in range(a.rounds):
            for name, cfg in VARIANTS:
                try:
                    y = dc.run_step(M, pool[0], h, **cfg)
                    t = dc.timer(lambda i: dc.run_step(M, pool[i], h, **cfg), 2,  # noqa: B023
                                 a.reps, 3, mode="graph")
                    row = {"h": hv, "variant": name, "options": {k: list(v) if isinstance(
                        v, tuple) else v for k, v in cfg.items()}, "round": rnd,
                        "median_us": round(t["median_us"], 2),
                        "max_abs_vs_default": float((y - base).abs().max())}
                    if rnd == 0 and name in PROFILED:
                        row["kernels"] = [
                            {"kernel": r["kernel"][:40], "us": round(r["us_per_call"], 1)}
                            for r in ok.kernels_of(
                                lambda: dc.run_step(M, pool[0], h, **cfg))]  # noqa: B023
                except Exception as e:  # noqa: BLE001  (a variant that fails is recorded)
                    row = {"h": hv, "variant": name, "options": {k: list(v) if isinstance(
                        v, tuple) else v for k, v in cfg.items()}, "round": rnd,
                        "error": f"{type(e).__name__}: {str(e)[:300]}"}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
