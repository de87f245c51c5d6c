"""What Philox costs on the GPU: one ``tl.philox`` call per element (word 0, the SR stream
before 2026-12-02) against one call per four elements (all four words, the stream since;
``replayssm_quant/philox.py``), at the GDN state's element count (B = 256, 32 heads, 128 x 128:
134M elements), against a device copy of the same int32 buffer. Each kernel stores its words,
so the four-word kernel is bound by its stores; the bits are checked against
``philox.philox4x32`` for the first 4096 elements.

Usage (CUDA only)::

    python benchmarks/philox_bench.py --out benchmarks/results/philox_bench_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _one(out_ptr, seed, N, lo, hi, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c0 = offs.to(tl.uint32)
    r, _, _, _ = tl.philox(seed, c0, lo + c0 * 0, hi + c0 * 0, c0 * 0)
    tl.store(out_ptr + offs, r.to(tl.int32, bitcast=True), mask=offs < N)


@triton.jit
def _four(out_ptr, seed, N, lo, hi, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    c0 = (pid * (BLOCK // 4) + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, lo + c0 * 0, hi + c0 * 0, c0 * 0)
    x = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])  # 4i + w <- word w
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, x.to(tl.int32, bitcast=True), mask=offs < N)


@triton.jit
def _copy(out_ptr, in_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(in_ptr + offs, mask=offs < N), mask=offs < N)


def _median_us(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    for i in range(reps):
        ev[i].record()
        fn()
    ev[-1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) * 1e3 for i in range(reps))[reps // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--elements", type=int, default=134217728,
                    help="elements drawn (a multiple of 2048 in [4096, 2^30]; default 2^27, "
                         "the GDN state at B = 256)")
    args = ap.parse_args(argv)
    if not 4096 <= args.elements <= 2**30 or args.elements % 2048:
        ap.error(f"--elements must be a multiple of 2048 in [4096, 2^30] (int32 offsets), "
                 f"got {args.elements}")
    if not torch.cuda.is_available():
        sys.exit("philox_bench.py needs a CUDA device")
    from replayssm_quant.philox import philox4x32

    N = args.elements
    out = torch.empty(N, dtype=torch.int32, device="cuda")
    src = torch.zeros(N, dtype=torch.int32, device="cuda")
    res = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(),
           "triton": triton.__version__, "torch": torch.__version__, "elements": N,
           "units": "median us of 20 calls (CUDA events)"}
    e = torch.arange(4096, device="cuda", dtype=torch.int64)
    words = philox4x32(e >> 2, torch.tensor(5), torch.tensor(7), torch.tensor(0), 123, 0)
    for B in (1024, 2048):
        g = (triton.cdiv(N, B),)
        res[f"copy_{B}"] = _median_us(lambda: _copy[g](out, src, N, BLOCK=B))
        res[f"one_{B}"] = _median_us(lambda: _one[g](out, 123, N, 5, 7, BLOCK=B))
        one = out[:4096].to(torch.int64) & 0xFFFFFFFF
        res[f"four_{B}"] = _median_us(lambda: _four[g](out, 123, N, 5, 7, BLOCK=B))
        four = out[:4096].to(torch.int64) & 0xFFFFFFFF
        ref_one = philox4x32(e, torch.tensor(5), torch.tensor(7), torch.tensor(0), 123, 0)[0]
        res["one_matches_ref"] = bool((one == ref_one).all()) and res.get("one_matches_ref", True)
        res["four_matches_ref"] = (bool((four == torch.stack(words)[e & 3, e]).all())
                                   and res.get("four_matches_ref", True))
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
