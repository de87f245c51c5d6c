"""The products launch on a persistent grid (issue 15, thirty-fifth pass): time a decode step
at B = 256 on ``decode.py``'s geometries with ``records.PRODUCTS_PROGRAMS`` set to each of
``--programs`` (``none``: one program per (sequence, key group), the default; ``Nsm``: N per
streaming multiprocessor), alternating them ``--rounds`` times, CUDA-graph medians over
``decode.py``'s rotated sets; each step's output compared bit for bit with the default's.

With PDL a dependent launch may start only once every program of the launch before it has
started. One program per pair (B * G = 4096 for GDN) takes several waves, so the read pass
waits for the products launch's last wave; a grid of one wave lets it start at once.

Usage (on the device)::

    python3 benchmarks/products_grid.py --out $OUT/products_grid.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402
from _commit import code_commit  # noqa: E402

from replayssm_quant.kernels.replay import records  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

GEOMETRIES = {"gdn": (32, 16, 128, 128), "mamba2": (128, 1, 64, 128)}  # H, G, V, K


def programs(spec: str, sms: int):
    if spec == "none":
        return None
    if spec.endswith("sm"):
        return int(spec[:-2]) * sms
    return int(spec)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--models", default="gdn,mamba2")
    ap.add_argument("--policies", default="fp32,nvfp4")
    ap.add_argument("--programs", default="none,1sm,2sm,4sm,8sm,14sm")
    ap.add_argument("--h", default="0,7,14")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "device": torch.cuda.get_device_name(), "sms": sms, "code_commit": code_commit(),
           "timing": "CUDA graph medians (decode.timer)", "rows": []}
    for mname in a.models.split(","):
        H, G, V, K = GEOMETRIES[mname]
        M = rk.Model(mname, a.B, H, G, V, K, 16)
        for pname in a.policies.split(","):
            pol = StatePolicy.parse(dc.POLICIES.get(pname, pname))
            gen = torch.Generator(device="cuda").manual_seed(0)
            pool = [dc.make_set(M, gen, pol, 8, False) for _ in range(2)]
            for hv in (int(x) for x in a.h.split(",")):
                h = torch.full((a.B,), hv, dtype=torch.int64, device="cuda")
                base = None
                for rnd in range(a.rounds):
                    for spec in a.programs.split(","):
                        records.PRODUCTS_PROGRAMS = programs(spec, sms)
                        try:
                            y = dc.run_step(M, pool[0], h).clone()
                            base = y if base is None else base
                            t = dc.timer(lambda i: dc.run_step(M, pool[i], h), 2, a.reps, 3,
                                         mode="graph")
                        finally:
                            records.PRODUCTS_PROGRAMS = None
                        row = {"model": mname, "policy": pname, "h": hv, "round": rnd,
                               "programs": spec, "median_us": round(t["median_us"], 2),
                               "same_bits": bool(torch.equal(y.view(torch.int32),
                                                             base.view(torch.int32)))}
                        res["rows"].append(row)
                        print(json.dumps(row), flush=True)
            pool = None
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
