"""Every GPU kernel one decode operation launches, with its GPU time (issue 15): the flush
(``decode.run_flush``: the timed serving form), the step at h = 7 and verify at h = 0, for
both B = 256 geometries of ``benchmarks/decode.py`` and its two policies.

``decode.py`` times an operation as a whole (a CUDA graph of the call); this script shows
what that whole is made of: ``torch.profiler`` (CUPTI) over 5 calls after 3 warm ones, the
mean count and device time of each kernel per call, the kernels sorted by time. Small torch
kernels (argument checks, masks) cost 1-3 us each plus their gap in the graph: at B = 256
on the H100 they were 85 us of GDN's 498 us fp32 flush before the thirty-third pass
(docs/kernels-replay.md). Device only; ``--tiny`` runs the calls on the CPU interpreter
(no kernel times: a check that the script runs).

Usage (device)::

    python3 benchmarks/op_kernels.py --out $OUT/op_kernels_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402

from replayssm_quant.policy import StatePolicy  # noqa: E402

GEOMETRIES = {"gdn": (32, 16, 128, 128), "mamba2": (128, 1, 64, 128)}  # H, G, V, K
TINY = {"gdn": (4, 2, 16, 32), "mamba2": (4, 1, 16, 32)}


def kernels_of(fn, calls: int = 5, warm: int = 3) -> list[dict]:
    """``[{"kernel", "per_call", "us_per_call"}]`` of ``fn()``: every device kernel's count
    and GPU time per call (CUPTI), sorted by time; empty off CUDA."""
    for _ in range(warm):
        fn()
    cuda = dc.DEV == "cuda"
    if cuda:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as p:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    for e in p.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if cuda and t and e.device_type.name == "CUDA":
            rows.append({"kernel": e.key[:120], "per_call": e.count / calls,
                         "us_per_call": t / calls})
    return sorted(rows, key=lambda r: -r["us_per_call"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter, B = 2, small heads")
    ap.add_argument("--out", default="")
    ap.add_argument("--models", default="gdn,mamba2", help="comma list (default both)")
    a = ap.parse_args(argv)
    B = 2 if a.tiny else a.B
    res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "device": torch.cuda.get_device_name() if dc.DEV == "cuda" else "cpu",
           "torch": torch.__version__, "code_commit": os.environ.get("CODE_COMMIT", ""),
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "B": B, "ops": {}}
    models = [m for m in a.models.split(",") if m]
    bad = set(models) - set(GEOMETRIES)
    if bad or not models:
        ap.error(f"--models takes a comma list of {sorted(GEOMETRIES)}, got {a.models!r}")
    for mname, (H, G, V, K) in (TINY if a.tiny else GEOMETRIES).items():
        if mname not in models:
            continue
        M = rk.Model(mname, B, H, G, V, K, 16)
        gen = torch.Generator(device=dc.DEV).manual_seed(0)
        for pname, pstr in dc.POLICIES.items():
            pol = StatePolicy.parse(pstr)
            st = dc.make_set(M, gen, pol, 8, False)
            fa = dc.flush_args(M, st)
            h7 = torch.full((B,), 7, dtype=torch.int64, device=dc.DEV)
            h0 = torch.zeros(B, dtype=torch.int64, device=dc.DEV)
            ops = {"flush": lambda: dc.run_flush(M, st, pol, fa),  # noqa: B023
                   "step_h7": lambda: dc.run_step(M, st, h7),  # noqa: B023
                   "verify_h0": lambda: dc.run_verify(M, st, h0)}  # noqa: B023
            for oname, fn in ops.items():
                # --tiny: one call, no warm-up (the interpreter has no kernel times to take)
                rows = kernels_of(fn, calls=1, warm=0) if a.tiny else kernels_of(fn)
                key = f"{mname}/{pname}/{oname}"
                res["ops"][key] = {"kernels_per_call": sum(r["per_call"] for r in rows),
                                   "gpu_us_per_call": sum(r["us_per_call"] for r in rows),
                                   "kernels": rows}
                print(f"{key}: {res['ops'][key]['kernels_per_call']:.0f} kernels, "
                      f"{res['ops'][key]['gpu_us_per_call']:.1f} us GPU", flush=True)
                for r in rows[:6]:
                    print(f"    {r['us_per_call']:8.1f} us  x{r['per_call']:.0f}  "
                          f"{r['kernel'][:70]}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
