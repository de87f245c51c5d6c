"""Register caps (ptxas ``maxnreg``) on the decode step's launches and the split flush's pair
cast (issue 15, twenty-third pass, docs/kernels-replay.md).

B = 256 on the H200 geometries, CUDA-graph medians in us (``decode.timer``, 3 sets rotated),
each capped run checked bit for bit against the uncapped one:

* the nvfp4 step (``read:nvfp4/rec:fp16+sr``, h = 7): GDN's read pass in the records form
  with ``read_pass=(32, 2, "records", cap)``; Mamba-2's lean read pass with
  ``(64, 1, "lean", cap)``;
* the fp32 step: every records launch of the step capped (a stand-in wrapper around the
  kernel, since the fp32 step has no read pass);
* ``pack_pair_triton`` fp16+sr + nvfp4 (the split flush's casts), capped the same way.

``--read mxfp4`` (twenty-fourth pass) times the mxfp4 step (``read:mxfp4/rec:fp16+sr``),
both models on the records kernel's read pass ``(32, 2, "records", cap)``; ``--parts``
picks among ``step``, ``rec`` (the step's records launch after its read pass capped, the
read pass as the default's; not in the default set), ``fp32`` and ``pair``.

Usage (on the device)::

    python benchmarks/records_maxnreg.py --out $OUT/records_maxnreg_h200.json
    python benchmarks/records_maxnreg.py --read mxfp4 --parts step --out $OUT/records_maxnreg_mxfp4_h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402
from _commit import code_commit  # noqa: E402

import replayssm_quant.kernels.quant as kq  # noqa: E402
import replayssm_quant.kernels.replay.records as rec  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

GEOS = {"gdn": (32, 16, 128, 128), "mamba2": (128, 1, 64, 128)}
CAPS = (None, 128, 112, 104, 96, 88, 80, 64)


class Capped:
    """A Triton kernel whose every launch gets ``maxnreg=cap`` (None: unchanged)."""

    def __init__(self, kernel, cap):
        self.kernel, self.cap = kernel, cap

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        if self.cap is None:
            return launch
        return lambda *a, **kw: launch(*a, **{**kw, "maxnreg": self.cap})


class CappedRecords(Capped):
    """:class:`Capped` for ``_records_kernel``'s records launches only (``YOUT=False``): a
    read pass in the records form keeps its own cap."""

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        if self.cap is None:
            return launch
        return lambda *a, **kw: launch(*a, **(kw if kw.get("YOUT") else
                                              {**kw, "maxnreg": self.cap}))


@contextlib.contextmanager
def capped(module, name: str, cap, kind=Capped):
    """Within: ``module.name`` (a Triton kernel its module launches by that name) replaced by
    ``kind`` (:class:`Capped`, or :class:`CappedRecords`) with ``cap``; the kernel restored on
    exit."""
    real = getattr(module, name)
    setattr(module, name, kind(real, cap))
    try:
        yield
    finally:
        setattr(module, name, real)


def _same(a, b) -> bool:
    return all(torch.equal(x.view(torch.int32) if x.dtype == torch.float32 else x,
                           y.view(torch.int32) if y.dtype == torch.float32 else y)
               for x, y in zip(a, b, strict=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--read", default="nvfp4", choices=("nvfp4", "mxfp4"),
                    help="the read copy of the timed step (default nvfp4)")
    ap.add_argument("--parts", default="step,fp32,pair",
                    help="comma-separated subset of step, rec (the step's records launch "
                         "after its read pass, capped), fp32, pair (default: step, fp32, "
                         "pair)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= {"step", "rec", "fp32", "pair"}:
        raise SystemExit(f"--parts takes step, rec, fp32, pair; got {args.parts!r}")
    if not torch.cuda.is_available():
        raise SystemExit("records_maxnreg.py times CUDA launches; run it on the device")
    out = {"command": " ".join(sys.argv), "code_commit": code_commit(),
           "device": torch.cuda.get_device_name(0), "timing": "CUDA graph, median us",
           "results": {}}
    res = out["results"]

    def t(fn):
        return round(dc.timer(fn, 3, args.reps, 3, mode="graph")["median_us"], 1)

    h = torch.full((256,), 7, dtype=torch.int64, device="cuda")
    for name, geo in GEOS.items():
        M = rk.Model(name, 256, *geo, 16)
        gen = torch.Generator(device="cuda").manual_seed(3)
        rd = args.read
        if "step" in parts:
            pol = StatePolicy.parse(f"read:{rd}/rec:fp16+sr")
            sets = [dc.make_set(M, gen, pol, 8, False) for _ in range(3)]
            form = (32, 2, "records") if M.gdn or rd == "mxfp4" else (64, 1, "lean")
            res[f"{name} {rd} step default"] = t(lambda i: dc.run_step(M, sets[i], h))
            base = (dc.run_step(M, sets[0], h, read_pass=form),)
            for cap in CAPS:
                rp = (*form, cap)
                same = _same((dc.run_step(M, sets[0], h, read_pass=rp),), base)
                res[f"{name} {rd} step read_pass={rp}"] = {
                    "median_us": t(lambda i, rp=rp: dc.run_step(M, sets[i], h, read_pass=rp)),
                    "same_bits": same}
                print(name, rp, res[f"{name} {rd} step read_pass={rp}"], flush=True)
        if "rec" in parts:  # the nvfp4 / mxfp4 step's records launch (after the read pass)
            pol = StatePolicy.parse(f"read:{rd}/rec:fp16+sr")
            sets = [dc.make_set(M, gen, pol, 8, False) for _ in range(3)]
            base = None
            # Mamba-2: the records kernel's launch (its nvfp4 default has taken the lean records
            # launch since this part ran, which _records_kernel caps would not reach)
            kw = {} if M.gdn else {"lean_records": False}
            for cap in (None, 80, 72, 64, 56, 48, 40):
                with capped(rec, "_records_kernel", cap, CappedRecords):
                    o = (dc.run_step(M, sets[0], h, **kw),)
                    base = base or o
                    key = f"{name} {rd} step, records launch maxnreg={cap}"
                    res[key] = {"median_us": t(lambda i: dc.run_step(M, sets[i], h, **kw)),
                                "same_bits": _same(o, base)}
                print(name, rd, "records launch", cap, res[key], flush=True)
        if "fp32" not in parts:
            continue
        pol = StatePolicy.parse("fp32")
        sets = [dc.make_set(M, gen, pol, 8, False) for _ in range(3)]
        base = None
        for cap in (None, 160, 128, 96):
            with capped(rec, "_records_kernel", cap):
                o = (dc.run_step(M, sets[0], h),)
                base = base or o
                res[f"{name} fp32 step, records launches maxnreg={cap}"] = {
                    "median_us": t(lambda i: dc.run_step(M, sets[i], h)), "same_bits": _same(o, base)}
            print(name, "fp32", cap, res[f"{name} fp32 step, records launches maxnreg={cap}"],
                  flush=True)
        sets = None
        if "pair" not in parts:
            continue
        S = [torch.randn(256, geo[0], geo[2], geo[3], device="cuda") for _ in range(3)]
        keys = torch.arange(256 * geo[0], device="cuda").view(256, geo[0])
        def cast(i):
            return kq.pack_pair_triton(S[i], "fp16+sr", "nvfp4", seed=1, plain_stream=keys,
                                       scaled_stream=keys)
        base = None
        for cap in (None, 56, 48, 40):
            with capped(kq, "_pair_kernel", cap):
                p, s = cast(0)
                got = (p.codes, s.codes, s.block_scales, s.matrix_scale)
                base = base or got
                res[f"{name} pair cast maxnreg={cap}"] = {"median_us": t(cast),
                                                          "same_bits": _same(got, base)}
            print(name, "pair", cap, res[f"{name} pair cast maxnreg={cap}"], flush=True)
        S = None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
