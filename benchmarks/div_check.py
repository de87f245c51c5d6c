"""Check ``kernels.quant._div_by_rcp`` (NVFP4 element division by one reciprocal per block and
FMA refinements) against ``tl.math.div_rn`` on the GPU, every float32 dividend of a range per
divisor (issue 15, twenty-third pass; docs/kernels-replay.md).

Divisors: every positive E4M3 block scale (the 126 finite codes from 2^-9 to 448) times
random NVFP4 matrix scales spread log-uniformly over ``RCP_MATRIX_SCALE_RANGE``, the range's
ends, mantissas of all ones and of one, and random divisors in [2^-95, 2^95]. Per divisor b,
every float32 x with x / b in [2^-3, 9.5) (about 5.5e7 dividends, the quotients where the
E2M1 RTN code reads the quotient's bits) must give the same bits; and a sweep of x / b in
[2^-40, 2^-3) (every 64th float32) must give a quotient below 0.25 (the same code, 0).
Negative dividends are the same computation with the sign bit set (checked in the tests).

Usage (on the device)::

    python benchmarks/div_check.py --out $OUT/div_check_h200.json
    TRITON_INTERPRET=1 python benchmarks/div_check.py --tiny --out /tmp/dc.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--tiny" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _commit import code_commit  # noqa: E402

from replayssm_quant import formats as F  # noqa: E402
from replayssm_quant.kernels import quant as kq  # noqa: E402


@triton.jit
def _sweep_kernel(b_ptr, start_ptr, n_ptr, bad_ptr, STEP: tl.constexpr, EXACT: tl.constexpr,
                  BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Program (d, c): divisor d, dividends ``bits(start_d) + STEP i`` for the i of chunk c;
    counts into ``bad_ptr[d]`` the dividends whose quotient differs from ``div_rn``'s
    (``EXACT``) or is not below 0.25."""
    d = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.load(b_ptr + d)
    start = tl.load(start_ptr + d)
    n = tl.load(n_ptr + d)
    y = tl.math.div_rn(1.0, b)
    bad = tl.zeros([BLOCK], tl.int32)
    for it in range(ITERS):
        i = (c * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        x = (start + i * STEP).to(tl.float32, bitcast=True)
        bb = tl.full([BLOCK], 1.0, tl.float32) * b
        yy = tl.full([BLOCK], 1.0, tl.float32) * y
        q = kq._div_by_rcp(x, bb, yy)
        if EXACT:
            want = tl.math.div_rn(x, bb)
            wrong = q.to(tl.int32, bitcast=True) != want.to(tl.int32, bitcast=True)
        else:
            wrong = q >= 0.25
        bad += (ok & wrong).to(tl.int32)
    tl.atomic_add(bad_ptr + d, tl.sum(bad, axis=0))


def divisors(n_scales: int, n_random: int, gen: torch.Generator) -> torch.Tensor:
    """float32 divisors in [2^-95, 2^95] (module docstring)."""
    lo, hi = kq.RCP_MATRIX_SCALE_RANGE
    codes = torch.arange(1, 127, dtype=torch.uint8)  # positive finite E4M3 codes but zero
    e4m3 = codes.view(torch.float8_e4m3fn).float()
    sg = torch.exp2(torch.empty(n_scales).uniform_(math.log2(lo), math.log2(hi), generator=gen))
    sg[:2] = torch.tensor([lo, hi])
    prod = (e4m3[:, None] * sg[None, :]).flatten()  # RN(s_b s_g), as _block_scale
    ends = torch.tensor([2.0 ** -95, 2.0 ** 95, (2 - 2 ** -23) * 2.0 ** 94,
                         (2 - 2 ** -23) * 2.0 ** -95, 1.0, 1 + 2 ** -23, 2 - 2 ** -23, 3.0])
    rnd = torch.exp2(torch.empty(n_random).uniform_(-95, 95, generator=gen))
    rnd = rnd * (1 + torch.rand(n_random, generator=gen))
    b = torch.cat([prod, ends, rnd]).float().clamp(2.0 ** -95, 2.0 ** 95)
    return b


def sweep(b: torch.Tensor, z_lo: float, z_hi: float, step: int, exact: bool, dev: str,
          block: int, iters: int) -> torch.Tensor:
    """Bad counts per divisor over the dividends x = b z, z in [z_lo, z_hi) (float32 bit
    patterns from RN(b z_lo) to RN(b z_hi), every ``step``-th)."""
    lo = (b.double() * z_lo).float().view(torch.int32).long()
    hi = (b.double() * z_hi).float().view(torch.int32).long()
    n = (hi - lo) // step + 1
    chunks = int(triton.cdiv(int(n.max()), block * iters))
    bad = torch.zeros(b.numel(), dtype=torch.int32, device=dev)
    _sweep_kernel[(b.numel(), chunks)](b.contiguous().to(dev), lo.to(torch.int32).to(dev),
                                        n.to(torch.int32).to(dev), bad, STEP=step, EXACT=exact,
                                        BLOCK=block, ITERS=iters)
    return bad.cpu(), int(n.sum())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scales", type=int, default=256, help="matrix scales per E4M3 value")
    ap.add_argument("--random", type=int, default=4096, help="random divisors")
    ap.add_argument("--tiny", action="store_true", help="a few divisors, every 4096th "
                    "dividend, on the interpreter")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("div_check.py runs on the GPU (or --tiny on the interpreter)")
    gen = torch.Generator().manual_seed(2026)
    if args.tiny:
        b = divisors(2, 4, gen)[::37].contiguous()
        step, block, iters = 4096, 256, 4
    else:
        b = divisors(args.scales, args.random, gen)
        step, block, iters = 1, 1024, 16
    out = {"command": " ".join(sys.argv), "code_commit": code_commit(),
           "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (interpreter)",
           "divisors": b.numel(), "rcp_matrix_scale_range": list(kq.RCP_MATRIX_SCALE_RANGE),
           "e2m1_max": F.E2M1_MAX}
    for name, (z_lo, z_hi, st, exact) in {
            "exact_2^-3_to_9.5": (0.125, 9.5, step, True),
            "below_0.25_2^-40_to_2^-3": (2.0 ** -40, 0.125, step * 64, False)}.items():
        t = time.perf_counter()
        bad, checked = sweep(b, z_lo, z_hi, st, exact, dev, block, iters)
        if dev == "cuda":
            torch.cuda.synchronize()
        worst = [float(b[i]) for i in bad.nonzero().flatten()[:10]]
        out[name] = {"checked": checked, "bad": int(bad.sum()), "bad_divisors": worst,
                     "seconds": round(time.perf_counter() - t, 2), "step": st}
        print(name, json.dumps(out[name]), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if any(out[k]["bad"] for k in out if isinstance(out[k], dict) and "bad" in out[k]):
        raise SystemExit("div_check: _div_by_rcp differs from div_rn (see the JSON)")


if __name__ == "__main__":
    main()
