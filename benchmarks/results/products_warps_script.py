"""The script behind ``products_warps_h200.json`` (2026-12-03, fourteenth session): GPU time
per kernel of the decode step at B = 256, h = 7, with the step's products launch
(``_key_products_kernel``) at 1, 2, 4 or 8 warps (None: the records launch's), both models,
``fp32`` and ``read:nvfp4/rec:fp16+sr``. Run from the repository root on the device::

    OUT=<dir> python3 benchmarks/results/products_warps_script.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402
import step_profile as sp  # noqa: E402

from replayssm_quant.kernels.replay import records  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

real = records._key_products_kernel
WARPS = [None]


class _Products:
    """``_key_products_kernel`` with its launch's ``num_warps`` replaced by ``WARPS[0]``."""

    def __getitem__(self, grid):
        launch = real[grid]

        def run(*a, **kw):
            if WARPS[0]:
                kw["num_warps"] = WARPS[0]
            return launch(*a, **kw)
        return run


records._key_products_kernel = _Products()
rows = []
for name, (H, G, V, K) in {"gdn": (32, 16, 128, 128), "mamba2": (128, 1, 64, 128)}.items():
    M = rk.Model(name, 256, H, G, V, K, 16)
    for pn in ("fp32", "nvfp4"):
        gen = torch.Generator(device="cuda").manual_seed(1)
        sets = [dc.make_set(M, gen, StatePolicy.parse(dc.POLICIES[pn]), 8, False)
                for _ in range(4)]
        hv = torch.full((M.B,), 7, dtype=torch.int64, device="cuda")
        for w in (None, 1, 2, 4, 8):
            WARPS[0] = w
            step = sp.step_fn(M, sets, hv)
            for i in range(8):
                step(i)
            row = dict(model=name, policy=pn, products_warps=w,
                       kernels_us=sp.kernel_times(step, 20))
            print(row, flush=True)
            rows.append(row)
with open(os.environ["OUT"] + "/products_warps_h200.json", "w") as f:
    json.dump(rows, f, indent=1)
