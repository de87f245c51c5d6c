"""Where the decode kernels spend their time (issue 15): run each serving decode operation of
``benchmarks/decode.py`` once at B = 256 (GDN and Mamba-2 geometries, ``fp32`` and
``read:nvfp4/rec:fp16+sr``) and report what the compiler made of every Triton kernel it
launched: registers per thread, spilled registers, shared memory, warps. The flush is the
fused ``_flush_kernel`` (``split_casts=False``); since the ninth pass the decode default for
an nvfp4 copy is the split flush (the fp32 flush, then the pair cast of ``kernels/quant.py``),
which ``--split-flush`` profiles instead.

Run it under Nsight Compute for the hardware view (the device's ``ncu`` needs
``--clock-control none``)::

    ncu --clock-control none --csv --page details \\
        --kernel-name regex:'_flush_kernel|_records_kernel' \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/kernel_profile.py --out $OUT/kernel_profile_regs.json \\
        > $OUT/kernel_profile_ncu.csv

Every operation is called ``--calls`` times (default 2: the first compiles, so under ncu the
second is the clean sample). ``--ops`` picks a subset (``step,flush,verify``), ``--models``
and ``--policies`` likewise; ``--verify-solve inverse|doubling`` (and ``--verify-fuse``) run
verify's matrix forms instead of the defaults. ``--tiny`` runs the same on the CPU interpreter (a smoke test; the
compiler facts are then empty).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--tiny" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402  (input sets and the timed operations)
import replay_kernels as rk  # noqa: E402

from replayssm_quant.kernels.replay import chain, flush, records  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

OPS = ("step", "flush", "verify")


def compiled_kernels():
    """Compiler facts of every compiled variant of the replay kernels (empty under the
    interpreter): name, registers per thread, spilled registers, shared memory bytes, warps."""
    rows = []
    for mod, name in ((flush, "_flush_kernel"), (records, "_records_kernel"),
                      (chain, "_chain_kernel")):
        fn = getattr(mod, name, None)
        caches = getattr(fn, "device_caches", None) or {}
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for key, k in getattr(cache, "items", lambda: [])():
                md = getattr(k, "metadata", None)
                rows.append({"kernel": name, "n_regs": getattr(k, "n_regs", None),
                             "n_spills": getattr(k, "n_spills", None),
                             "shared_bytes": getattr(md, "shared", None),
                             "num_warps": getattr(md, "num_warps", None),
                             "num_stages": getattr(md, "num_stages", None),
                             "key": str(key)[:600]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--models", default="gdn,mamba2")
    ap.add_argument("--policies", default="fp32,nvfp4")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--verify-solve", default=None, choices=records.SOLVE_FORMS,
                    help="run verify with this records_outputs(solve=...) instead of the "
                         "defaults' (the verify launch defaults patched for this run)")
    ap.add_argument("--split-flush", action="store_true",
                    help="profile the flush as decode.py times it (a matrix-scaled policy's "
                         "split flush: the fp32 flush, then the pair cast) instead of the fused "
                         "_flush_kernel")
    ap.add_argument("--verify-fuse", action="store_true",
                    help="GDN verify with fuse_shared_anchor=True (needs a matrix form of "
                         "--verify-solve; has an effect under the fp32 policy only)")
    args = ap.parse_args(argv)
    if args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if args.tiny and "--batch" in (argv if argv is not None else sys.argv):
        ap.error("--batch does not apply with --tiny (batch 2)")
    if args.verify_fuse and args.verify_solve == "substitution":
        ap.error("--verify-fuse needs a matrix form (--verify-solve inverse or doubling, or "
                 "the default, inverse)")
    if args.verify_solve:
        for name in [n for n in dir(records) if "VERIFY" in n and n.endswith("_CONFIG")]:
            setattr(records, name, dict(getattr(records, name), solve=args.verify_solve))
    if args.verify_fuse:
        real = dc.kr.gdn_verify_kernel  # what decode.run_verify calls

        def fused(*a, **k):
            return real(*a, **{"fuse_shared_anchor": True, **k})

        dc.kr.gdn_verify_kernel = fused
    geo = ({"gdn": (2, 1, 16, 32, 4), "mamba2": (2, 1, 16, 32, 4)} if args.tiny else
           {"gdn": (32, 16, 128, 128, 16), "mamba2": (128, 1, 64, 128, 16)})
    T = 2 if args.tiny else 8
    B = 2 if args.tiny else args.batch
    models = args.models.split(",")
    pols = args.policies.split(",")
    ops = args.ops.split(",")
    for vals, allowed, flag in ((models, geo, "--models"), (pols, dc.POLICIES, "--policies"),
                                (ops, OPS, "--ops")):
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            ap.error(f"{flag} takes a comma list of {sorted(allowed)}, got {bad or vals!r}")
    launched = []
    for m in models:
        H, G, V, K, L = geo[m]
        M = rk.Model(m, B, H, G, V, K, L)
        gen = torch.Generator(device=dc.DEV).manual_seed(7)
        for p in pols:
            policy = StatePolicy.parse(dc.POLICIES[p])
            st = dc.make_set(M, gen, policy, T, False)
            # the fused flush kernel (decode.py's default splits a matrix-scaled policy's casts
            # into the fp32 flush and the quantizer kernels: profile those with the quantizer
            # kernels' names, or flush_tune.py --split-casts)
            fa = (dc.flush_args(M, st) if args.split_flush else
                  dict(dc.flush_args(M, st), split_casts=False))
            h = torch.full((B,), L - 2, dtype=torch.int64, device=dc.DEV)
            start = torch.full((B,), L - T, dtype=torch.int64, device=dc.DEV)
            run = {"step": lambda: dc.run_step(M, st, h),
                   "flush": lambda: dc.run_flush(M, st, policy, fa),
                   "verify": lambda: dc.run_verify(M, st, start)}
            for op in ops:
                for _ in range(args.calls):
                    run[op]()
                if dc.DEV == "cuda":
                    torch.cuda.synchronize()
                launched.append(f"{m}/{p}/{op}")
                print("ran", m, p, op, flush=True)
    out = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "batch": B, "launched_in_order": launched, "calls_each": args.calls,
           "compiled": compiled_kernels()}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for r in out["compiled"]:
        print(r["kernel"], "regs", r["n_regs"], "spills", r["n_spills"], "smem",
              r["shared_bytes"], "warps", r["num_warps"])


if __name__ == "__main__":
    main()
