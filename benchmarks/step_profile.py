"""GPU time per kernel and host time per call of the decode step (issue 15) for the two values
of one launch option (``--compare``): ``shared_products`` (the products with the record keys
once per (sequence, key group) in a launch before the records kernel; off / on) or
``e2m1_decode`` (how an nvfp4 read copy's E2M1 codes are decoded: ``integer`` / ``lookup``;
the two must give the same outputs bit for bit, which is checked: ``same_bits`` per row) or
``pdl`` (programmatic dependent launch between the step's launches; off / on; same bits).

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
    python3 benchmarks/step_profile.py --compare e2m1_decode --policies nvfp4 \
        --out $OUT/step_e2m1_lookup_h200.json
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


# pdl: programmatic dependent launch between the step's launches (with it, a kernel's time
# includes its wait for the launch before it, so the per-kernel times overlap)
COMPARE = {"shared_products": (False, True), "e2m1_decode": ("integer", "lookup"),
           "pdl": (False, True)}


def step_fn(M, sets, hv, **opt):
    return lambda i: dc.run_step(M, sets[i % len(sets)], hv, **opt)


def verify_fn(M, sets, hv, **opt):
    """Verify of T = 8 drafts from ``h`` (the outputs only; GDN's corrections dropped)."""
    def run(i):
        out = dc.run_verify(M, sets[i % len(sets)], hv, **opt)
        return out[0] if M.gdn else out
    return run


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
    ap.add_argument("--h", default="0,7,14", help="comma list of record counts before the step "
                    "(--op verify: before the T = 8 drafts, at most 8)")
    ap.add_argument("--op", default="step", choices=("step", "verify"),
                    help="the timed operation: the decode step or verify of T = 8 drafts")
    ap.add_argument("--compare", default="shared_products", choices=tuple(COMPARE),
                    help="the launch option whose two values are timed")
    ap.add_argument("--policies", default=None,
                    help=f"comma list of {tuple(dc.POLICIES)} (default: all; with --compare "
                         "e2m1_decode: nvfp4)")
    args = ap.parse_args(argv)
    if args.policies is None:
        args.policies = "nvfp4" if args.compare == "e2m1_decode" else ",".join(dc.POLICIES)
    pols = args.policies.split(",")
    try:
        hs = [int(x) for x in args.h.split(",")]
    except ValueError:
        hs = []
    hmax = 14 if args.op == "step" else 8
    if not hs or any(h < 0 or h > hmax for h in hs):
        ap.error(f"--h takes a comma list of record counts in [0, {hmax}] (L = 16, "
                 f"{'one slot for the step' if args.op == 'step' else 'T = 8 drafts'}), "
                 f"got {args.h!r}")
    for name, v in (("--batch", args.batch), ("--calls", args.calls)):
        if v < 1:
            ap.error(f"{name} must be a positive int, got {v}")
    if not pols or any(p not in dc.POLICIES for p in pols):
        ap.error(f"--policies takes a comma list of {tuple(dc.POLICIES)}, got {args.policies!r}")
    if args.compare == "e2m1_decode" and "fp32" in pols:
        ap.error("--compare e2m1_decode needs policies with an E2M1 read copy: --policies "
                 "nvfp4 (fp32 decodes no E2M1 codes)")
    if not torch.cuda.is_available():
        ap.error("step_profile.py needs a CUDA device")
    rows = []
    for name, (H, G, V, K) in MODELS.items():
        M = rk.Model(name, args.batch, H, G, V, K, 16)
        for pname in pols:
            pol = dc.POLICIES[pname]
            gen = torch.Generator(device="cuda").manual_seed(1)
            sets = [dc.make_set(M, gen, StatePolicy.parse(pol), 8, False) for _ in range(4)]
            for h in hs:
                hv = torch.full((M.B,), h, dtype=torch.int64, device="cuda")
                first = None
                for val in COMPARE[args.compare]:
                    step = (step_fn if args.op == "step" else verify_fn)(
                        M, sets, hv, **{args.compare: val})
                    for i in range(8):  # compile, warm
                        step(i)
                    y = step(0).clone()  # set 0 (the append rewrites slot h with its own record)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    for i in range(args.calls):
                        step(i)
                    host = (time.perf_counter() - t) / args.calls * 1e6
                    torch.cuda.synchronize()
                    ks = kernel_times(step, args.calls)
                    row = dict(model=name, policy=pname, op=args.op, h=h,
                               **{args.compare: val},
                               host_us=round(host, 1), kernels_us=ks,
                               gpu_us=round(sum(ks.values()), 1))
                    if first is None:
                        first = y
                    else:  # against the first value's outputs
                        row["same_bits"] = bool(torch.equal(y.view(torch.int32),
                                                            first.view(torch.int32)))
                        row["max_abs_diff"] = float((y - first).abs().max())
                    print(row, flush=True)
                    rows.append(row)
    result = {"command": "python " + " ".join(sys.argv) if argv is None else repr(argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git_commit": rk.git_commit(),
              "code_commit": rk.code_commit(), "device": torch.cuda.get_device_name(),
              "batch": args.batch, "calls": args.calls, "compare": args.compare, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
