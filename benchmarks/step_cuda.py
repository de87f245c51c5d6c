"""GDN's decode step as one CUDA C++ kernel (``replayssm_quant/kernels/replay/gdn_step.cu``,
``cuda_step.py``; issue 15, forty-fifth pass) against the shipped Triton step and a bare read
of the state.

The targets it serves (H200, B = 256, L = 16): the FP32 non-flush step is most of GDN's
``fp32`` amortised time (1.540x fla at 5037ba1 against 1.6x), and the NVFP4 step must be
2.8x faster than the FP32 one (2.071x there; the Triton NVFP4 step is four dependent
launches, 76.5 us, for 82 MB). The CUDA kernel is one launch: one CTA per (sequence, value
head), a value row a thread, FP32 FMAs for the two products, the NVFP4 codes decoded exactly
by integer operations. ``stage`` 0 loads each thread's row from global memory, 1 copies the
CTA's tile into shared memory first (coalesced), 2 reads a row with 8 lanes (coalesced) and
joins their sums by shuffles; all three sum in one order (the same bits). ``stage`` 3 (NVFP4
only) forms the products on the tensor cores (bf16 operands, each exact; FP32 accumulation):
bits of its own, checked against the same reference.

On ``decode.py``'s GDN geometry (``make_set``: 32 value / 16 key heads, 128 x 128, a ring of
16 slots; 4 rotated sets, CUDA-graph medians, ``decode.timer``), for ``fp32`` and
``read:nvfp4/rec:fp16+sr`` and h = 0, 7, 14: the shipped ``gdn_step_kernel``, the CUDA
kernel at each stage, and (FP32) ``decode.read_pass``, a bare read of the state. Checks at
each h: ``decode.check_step`` under the CUDA kernel at every stage (outputs and the new
correction against the torch reference within ``1e-5 + 1e-5 |ref|``, the ring append exact),
stages 0-2 the same bits, every stage's first 8 sequences alone the same bits, and the
largest difference from the Triton step.

Usage (device; nvcc and ninja)::

    python3 benchmarks/step_cuda.py --out $OUT/step_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402
from _commit import code_commit  # noqa: E402

from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.kernels.replay import cuda_step as cs  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

POLICIES = ("fp32", "read:nvfp4/rec:fp16+sr")
HS = (0, 7, 14)


def _step_args(st, h):
    r = st["ring"]
    return (st["R"], r, st["q"], st["nk"], st["nv"], st["nla"], st["nbeta"], h)


def _first(st, n):
    """The first ``n`` sequences of set ``st``: the read copy (``decode.sub``: leading rows,
    contiguous), a copy of the ring (the step writes it), the token."""
    return dict(st, R=dc.sub(st["R"], n), ring={k: t[:n].clone() for k, t in st["ring"].items()},
                **{k: st[k][:n] for k in ("q", "nk", "nv", "nla", "nbeta")})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("step_cuda.py times CUDA launches; run it on the device")
    B, L, T = a.batch, 16, 8
    M = rk.Model("gdn", B, 32, 16, 128, 128, L)
    res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "code_commit": code_commit(), "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "timing": "CUDA graph medians, decode.timer, 4 sets rotated",
           "shape": dict(B=B, H=M.H, G=M.G, V=M.V, K=M.K, L=L), "default_config":
           cs.GDN_STEP_CUDA_CONFIG, "rows": [], "checks": {}}
    ok = True
    for pol_s in POLICIES:
        pol = StatePolicy.parse(pol_s)
        gen = torch.Generator(device="cuda").manual_seed(5)
        pool = [dc.make_set(M, gen, pol, T, False) for _ in range(4)]
        n = len(pool)
        for hv in HS:
            h = torch.full((B,), hv, dtype=torch.int64, device="cuda")
            st = pool[0]
            # checks: float64 via decode.check_step (the CUDA kernel), stages, batch, Triton
            fmt = "f32" if pol_s == "fp32" else "nvfp4"
            stages = cs.STAGES[fmt]
            dc.GDN_STEP = "cuda"
            default = cs.GDN_STEP_CUDA_CONFIG[fmt]["stage"]
            chk = {}
            try:
                for stage in stages:  # the reference check at every stage (the default's last)
                    cs.GDN_STEP_CUDA_CONFIG[fmt]["stage"] = stage
                    chk[f"stage{stage}"] = dc.check_step(M, st, h)
            finally:
                cs.GDN_STEP_CUDA_CONFIG[fmt]["stage"] = default
                dc.GDN_STEP = "triton"
            chk["passed"] = all(chk[f"stage{x}"]["passed"] for x in stages)
            outs = {}
            for stage in stages:
                ring = {k: t.clone() for k, t in st["ring"].items()}
                o = cs.gdn_step_cuda(st["R"], ring, st["q"], st["nk"], st["nv"], st["nla"],
                                     st["nbeta"], h, stage=stage, fallback=False)
                outs[stage] = (o, ring)
                s8 = _first(st, 8)
                o8 = cs.gdn_step_cuda(*_step_args(s8, h[:8].contiguous()), stage=stage,
                                      fallback=False)
                chk[f"batch_invariant_stage{stage}"] = bool(
                    torch.equal(o8, o[:8]) and torch.equal(s8["ring"]["uR"], ring["uR"][:8]))
            ring = {k: t.clone() for k, t in st["ring"].items()}
            ot = kr.gdn_step_kernel(st["R"], ring, st["q"], st["nk"], st["nv"], st["nla"],
                                    st["nbeta"], h)
            chk["stages_same_bits"] = bool(all(
                torch.equal(outs[0][0], outs[x][0])
                and all(torch.equal(outs[0][1][k], outs[x][1][k]) for k in ring) for x in (1, 2)))
            chk["max_abs_vs_triton"] = {
                f"stage{x}": {"output": float((outs[x][0] - ot).abs().max()),
                              "correction": float((outs[x][1]["uR"] - ring["uR"]).abs().max())}
                for x in stages}
            passed = bool(chk["passed"] and chk["stages_same_bits"]
                          and all(chk[f"batch_invariant_stage{x}"] for x in stages))
            ok &= passed
            res["checks"][f"{pol_s}/h{hv}"] = chk
            row = {"policy": pol_s, "h": hv}
            row["triton"] = dc.timer(lambda i: kr.gdn_step_kernel(*_step_args(pool[i], h)),
                                     n, a.reps, 5, "graph")["median_us"]
            for stage in stages:
                row[f"cuda_stage{stage}"] = dc.timer(
                    lambda i, s=stage: cs.gdn_step_cuda(*_step_args(pool[i], h), stage=s,
                                                        fallback=False),
                    n, a.reps, 5, "graph")["median_us"]
            if st["S"] is not None:
                row["bare_read"] = dc.timer(lambda i: dc.read_pass(pool[i]["S"], pool[i]["q"]),
                                            n, a.reps, 5, "graph")["median_us"]
            res["rows"].append(row)
            print(json.dumps(row), "checks passed" if passed else "CHECKS FAILED", flush=True)
        pool = st = None  # (free the sets before the next policy)
        torch.cuda.empty_cache()
    for pol_s in POLICIES:
        rows = [r for r in res["rows"] if r["policy"] == pol_s]
        res.setdefault("mean_us", {})[pol_s] = {
            k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k not in ("policy", "h")}
    m = res["mean_us"]
    mf, mn = m["fp32"], m["read:nvfp4/rec:fp16+sr"]
    res["nvfp4_step_vs_fp32_step"] = {k: mf[k] / mn[k] for k in mf if k in mn}
    res["nvfp4_step_vs_fp32_step"]["cuda_best"] = (
        min(v for k, v in mf.items() if k.startswith("cuda"))
        / min(v for k, v in mn.items() if k.startswith("cuda")))
    res["checks_passed"] = ok
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({"mean_us": m, "nvfp4_step_vs_fp32_step": res["nvfp4_step_vs_fp32_step"],
                      "checks_passed": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
