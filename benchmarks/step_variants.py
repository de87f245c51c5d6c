"""GDN's decode step at B = 256 in launch variants around its default (issue 15,
thirty-fifth pass): where does the step's time over a bare read go on this device?

Each variant is ``decode.run_step`` with options of ``gdn_step_kernel``: the default
(``GDN_STEP_F32_CONFIG``: the products launch, then the ``"lean_out"`` read pass dependent on
it through PDL); ``pdl=False`` (the products launch complete before the read pass starts:
the read pass's own time without waiting); the products launch on 1, 4 or 8 warps
(``num_warps``, which in this form sets only that launch's warps) and with the keys in
chunks of 64, 32 or 16 (``k_chunk``: also that launch's only; static sm_90 SASS, Triton
3.9: chunks of 32 on 2 warps take 32 registers instead of 72, so all 4096 programs fit in
one wave, 32 an SM, instead of 2.2 waves; chunks of 16 on 1 warp take 58); the read pass on
other tiles. ``--policies nvfp4`` runs the variants that apply to the nvfp4 step (its
products launch and PDL). CUDA-graph medians over ``decode.py``'s rotated sets at h = 0, 7 and 14, alternating
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
            ("products_kc64", dict(k_chunk=64)), ("products_kc32", dict(k_chunk=32)),
            ("products_kc32_w1", dict(k_chunk=32, num_warps=1)),
            ("products_kc16_w1", dict(k_chunk=16, num_warps=1)),
            ("rp16x1", dict(read_pass=(16, 1, "lean_out"))),
            ("rp32x2", dict(read_pass=(32, 2, "lean_out"))),
            ("rp64x2", dict(read_pass=(64, 2, "lean_out"))),
            ("rp64x4", dict(read_pass=(64, 4, "lean_out"))),
            ("rp128x4", dict(read_pass=(128, 4, "lean_out")))]
# (the forty-first pass's "cuda" variants timed a CUDA C++ step, since removed: see
# docs/kernels-replay.md, "Forty-first pass")
PROFILED = ("default", "pdl_off", "products_w1", "products_w4", "products_kc32")
NVFP4_VARIANTS = ("default", "pdl_off", "products_w1", "products_w4", "products_kc64",
                  "products_kc32", "products_kc32_w1")  # k_chunk >= 32 for a blocked copy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--h", default="0,7,14")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--policies", default="fp32,nvfp4", help="comma list of fp32, nvfp4")
    ap.add_argument("--variants", default=None,
                    help="comma list of variant names (default all): " +
                         ", ".join(n for n, _ in VARIANTS))
    a = ap.parse_args(argv)
    unknown = sorted(set((a.variants or "").split(",")) - {"", *(n for n, _ in VARIANTS)})
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(n for n, _ in VARIANTS)}")
    if not torch.cuda.is_available():
        raise SystemExit("step_variants.py times CUDA launches; run it on the device")
    M = rk.Model("gdn", a.B, 32, 16, 128, 128, 16)
    res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "device": torch.cuda.get_device_name(), "code_commit": code_commit(),
           "timing": "CUDA graph medians (decode.timer)", "rows": []}
    for pname in a.policies.split(","):
        pol = StatePolicy.parse(dc.POLICIES[pname])
        gen = torch.Generator(device="cuda").manual_seed(0)
        pool = [dc.make_set(M, gen, pol, 8, False) for _ in range(2)]
        variants = [v for v in VARIANTS if (pname == "fp32" or v[0] in NVFP4_VARIANTS)
                    and (a.variants is None or v[0] in a.variants.split(","))]
        run_policy(M, pname, pool, variants, a, res)
        pool = None
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


def run_policy(M, pname, pool, variants, a, res):
    """Every variant of ``variants`` at each h of ``a.h``, ``a.rounds`` times, into
    ``res["rows"]``."""
    for hv in (int(x) for x in a.h.split(",")):
        h = torch.full((a.B,), hv, dtype=torch.int64, device="cuda")
        base = dc.run_step(M, pool[0], h).clone()
        for rnd in range(a.rounds):
            for name, cfg in variants:
                row = {"policy": pname, "h": hv, "variant": name,
                       "options": {k: list(v) if isinstance(v, tuple) else v
                                   for k, v in cfg.items()}, "round": rnd}
                try:
                    y = dc.run_step(M, pool[0], h, **cfg)
                    t = dc.timer(lambda i: dc.run_step(M, pool[i], h, **cfg), 2,  # noqa: B023
                                 a.reps, 3, mode="graph")
                    kernels = [
                        {"kernel": r["kernel"][:40], "us": round(r["us_per_call"], 1)}
                        for r in ok.kernels_of(lambda: dc.run_step(M, pool[0], h, **cfg))  # noqa: B023
                    ] if rnd == 0 and name in PROFILED else None
                    row.update(median_us=round(t["median_us"], 2),
                               max_abs_vs_default=float((y - base).abs().max()))
                    if kernels is not None:
                        row["kernels"] = kernels
                except Exception as e:  # noqa: BLE001  (a variant that fails is recorded)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                res["rows"].append(row)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
