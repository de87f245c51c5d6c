"""GPU time per kernel and host time per call of the decode step (issue 15), with and without
``shared_products`` (the products with the record keys once per (sequence, key group) in a
launch before the records kernel).

The eager timings of ``decode.py`` are host-bound once a step's kernels take about as long as
its host work (argument checks, launches: 0.1-0.6 ms a call on the lent machine, varying from
run to run), so they cannot tell a faster kernel from a slower host path. This script separates
the two:

* GPU time: ``torch.profiler`` (CUPTI) over ``--calls`` calls, the mean device time of each
  kernel per call;
* host time: wall time of ``--calls`` calls launched back to back without synchronising,
  divided by the number of calls (the GPU queue is not full, so this is the host's work).

B = 256 geometries of ``decode.py`` (GDN 32 value / 16 key heads 128 x 128; Mamba-2 128 heads,
one group, 64 x 128), policies ``fp32`` and ``read:nvfp4/rec:fp16+sr``, step at h = 0, 7, 14,
four input sets rotated. Device only.

Usage (device)::

    python3 benchmarks/step_profile.py --out $OUT/step_shared_products_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402

from replayssm_quant.policy import StatePolicy  # noqa: E402

MODELS = {"gdn": (32, 16, 128, 128), "mamba2": (128, 1, 64, 128)}


def step_fn(M, sets, hv, shared):
    return lambda i: dc.run_step(M, sets[i % len(sets)], hv, shared_products=shared)


def kernel_times(step, calls):
    """Mean device microseconds per call of every kernel ``step`` launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            step(i)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        tot = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if tot:
            out[e.key[:60]] = round(tot / calls, 1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--h", default="0,7,14", help="comma list of record counts before the step")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("step_profile.py needs a CUDA device")
    rows = []
    for name, (H, G, V, K) in MODELS.items():
        M = rk.Model(name, args.batch, H, G, V, K, 16)
        for pname, pol in dc.POLICIES.items():
            gen = torch.Generator(device="cuda").manual_seed(1)
            sets = [dc.make_set(M, gen, StatePolicy.parse(pol), 8, False) for _ in range(4)]
            for h in (int(x) for x in args.h.split(",")):
                hv = torch.full((M.B,), h, dtype=torch.int64, device="cuda")
                for shared in (False, True):
                    step = step_fn(M, sets, hv, shared)
                    for i in range(8):  # compile, warm
                        step(i)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for i in range(args.calls):
                        step(i)
                    host = (time.perf_counter() - t) / args.calls * 1e6
                    torch.cuda.synchronize()
                    ks = kernel_times(step, args.calls)
                    row = dict(model=name, policy=pname, h=h, shared_products=shared,
                               host_us=round(host, 1), kernels_us=ks,
                               gpu_us=round(sum(ks.values()), 1))
                    print(row, flush=True)
                    rows.append(row)
    result = {"command": "python " + " ".join(sys.argv) if argv is None else repr(argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git_commit": rk.git_commit(),
              "code_commit": rk.code_commit(), "device": torch.cuda.get_device_name(),
              "batch": args.batch, "calls": args.calls, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
