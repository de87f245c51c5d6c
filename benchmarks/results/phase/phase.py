"""Time GDN's FP32 verify at B = 256, h = 0, with the wrappers' default launch, as
records_tune.py times it (CUDA-graph medians over a pool of states larger than L2); writes
``$OUT/phase_<label>.json``. Usage (repository root, CUDA): ``python phase.py LABEL``."""
import json
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
import decode as dc  # noqa: E402
import records_tune as rt  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

dc.TIMING = "graph"
models, T = rt.geometries(False)
out = {}
for M in models:
    if not M.gdn:
        continue
    gen = torch.Generator(device="cuda").manual_seed(dc.SEED)
    pol = StatePolicy.parse(rt.POLICIES["fp32"])
    probe = dc.make_set(M, gen, pol, T, False)
    n = max(4, -(-dc.POOL_L2_MULTIPLE * dc.l2_bytes() // dc.set_bytes(probe)))
    pool = [probe] + [dc.make_set(M, gen, pol, T, False) for _ in range(n - 1)]
    r = dc.timer(lambda i, p=pool: rt.op(M, "verify", p[i], 0, {}), len(pool), 20, 3)
    out["fp32|h0"] = r["median_us"]
    print(sys.argv[1], M.name, "fp32", 0, round(r["median_us"], 1), flush=True)
json.dump(out, open(os.environ["OUT"] + f"/phase_{sys.argv[1]}.json", "w"))
