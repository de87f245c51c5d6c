"""GDN's flush under ``read:nvfp4/rec:fp16+sr`` (and ``read:nvfp4/rec:fp16``) as one CUDA C++
kernel (``replayssm_quant/kernels/replay/gdn_flush.cu``, ``cuda_flush.py``; issue 15,
forty-sixth pass) against the shipped Triton split flush.

The target it serves (H200, B = 256, L = 16): nvfp4 amortised >= 3x the fla step. At 5037ba1
the split flush (the re-solving fp32 flush that writes S, then the pair cast that reads it
back) took 1011 us, 63 of the 87 us a token allowed. The CUDA kernel holds S in registers: it
reads the fp16 anchor once and writes the two copies, S never leaves the chip.

On ``decode.py``'s GDN geometry (``make_set``: 32 value / 16 key heads, 128 x 128, a ring of
16 records, all committed; 4 rotated sets, CUDA-graph medians, ``decode.timer``): the serving
flush of each kernel (stored anchor in, the copies and ``y = S q`` out, S not written; the
CUDA kernel in each launch variant of ``cuda_flush.VARIANTS``) and a device copy of the
anchor's bytes (a floor). Checks, for each of the kernel's two forms (FMA variants 0-3, which
must give the same bits, and the tensor-core variants 4-7, likewise): ``decode.check_flush``
under the CUDA kernel (S, corrections and ``y`` against the torch reference, the copies
against the torch casts of the kernel's own S, bit for bit); the batch's first 8 sequences
alone give the same bits; against the Triton flush, the largest difference of S and ``y`` and the share of anchor
and read-copy bytes that differ (rounding decisions that S's last bits move).

Usage (device; nvcc and ninja)::

    python3 benchmarks/flush_nvfp4_cuda.py --out $OUT/flush_nvfp4_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import replay_kernels as rk  # noqa: E402
from _commit import code_commit  # noqa: E402

from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

POLICIES = ("read:nvfp4/rec:fp16+sr", "read:nvfp4/rec:fp16")


def _flush(fn, M, st, pol, fa, **kw):
    r = st["ring"]
    return fn(st["A"], r["la"], r["beta"], r["v"], r["k"], fa["length"], pol, q=st["q"],
              seed=fa["seed"], layer=fa["layer"], sequence_ids=fa["sequence_ids"],
              flush_index=fa["flush_index"], **kw)


def _serve(fn, M, st, pol, fa, **kw):
    return _flush(fn, M, st, pol, fa, store_state=False, dequantize=False, return_w=False, **kw)


def _first(st, fa, n):
    """The first ``n`` sequences of set ``st`` and of the flush arguments ``fa``."""
    s = dict(st, A=dc.sub(st["A"], n), q=st["q"][:n],
             ring={k: t[:n].contiguous() for k, t in st["ring"].items()})
    f = dict(fa, **{k: fa[k][:n] for k in ("length", "sequence_ids", "flush_index")})
    return s, f


def _diff_share(a, b):
    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return float((a != b).float().mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flush_nvfp4_cuda.py times CUDA launches; run it on the device")
    B, L, T = a.batch, 16, 8
    M = rk.Model("gdn", B, 32, 16, 128, 128, L)
    res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "code_commit": code_commit(), "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "timing": "CUDA graph medians, decode.timer, 4 sets rotated",
           "shape": dict(B=B, H=M.H, G=M.G, V=M.V, K=M.K, L=L), "rows": [], "checks": {}}
    ok = True
    for pol_s in POLICIES:
        pol = StatePolicy.parse(pol_s)
        gen = torch.Generator(device="cuda").manual_seed(5)
        pool = [dc.make_set(M, gen, pol, T, False) for _ in range(4)]
        n = len(pool)
        st = pool[0]
        fa = dc.flush_args(M, st)
        cfg = kr.cuda_flush.GDN_FLUSH_CUDA_CONFIG
        forms = {}  # per form (its first variant): the checks of its bits
        for form in sorted({min(kr.cuda_flush.same_bits(v)) for v in kr.cuda_flush.VARIANTS}):
            old = cfg["variant"]
            cfg["variant"] = form  # (check_flush runs the library's default variant)
            try:
                dc.GDN_FLUSH = "cuda"
                chk = dc.check_flush(M, st, pol, fa, 8)
            finally:
                dc.GDN_FLUSH = "triton"
                cfg["variant"] = old
            cu, ycu = _serve(kr.gdn_flush_cuda, M, st, pol, fa, variant=form)
            s8, f8 = _first(st, fa, 8)
            cu8, y8 = _serve(kr.gdn_flush_cuda, M, s8, pol, f8, variant=form)
            ca, c8 = cu.checkpoints, cu8.checkpoints
            chk["batch_invariant"] = bool(
                torch.equal(y8, ycu[:8])
                and torch.equal(c8.anchor_stored.codes, ca.anchor_stored.codes[:8])
                and torch.equal(c8.read_stored.codes, ca.read_stored.codes[:8])
                and torch.equal(c8.read_stored.block_scales, ca.read_stored.block_scales[:8])
                and torch.equal(c8.read_stored.matrix_scale, ca.read_stored.matrix_scale[:8]))
            full_c, _ = _flush(kr.gdn_flush_cuda, M, st, pol, fa, store_state=True,
                               dequantize=False, fallback=False, variant=form)
            full_t, yt = _flush(kr.gdn_flush_kernel, M, st, pol, fa, store_state=True,
                                dequantize=False)
            ta = full_t.checkpoints
            chk["vs_triton"] = {
                "S_max_abs": float((full_c.state - full_t.state).abs().max()),
                "y_max_abs": float((ycu - yt).abs().max()),
                "anchor_bytes_differing": _diff_share(ca.anchor_stored.codes,
                                                      ta.anchor_stored.codes),
                "read_code_bytes_differing": _diff_share(ca.read_stored.codes,
                                                         ta.read_stored.codes),
                "read_scale_bytes_differing": _diff_share(ca.read_stored.block_scales,
                                                          ta.read_stored.block_scales)}
            same = {}  # the form's other variants: its bits
            tc = kr.cuda_flush.VARIANTS[form]["tc"]
            for var in kr.cuda_flush.same_bits(form):
                cv_, yv = _serve(lambda *x, **k: kr.gdn_flush_cuda(*x, variant=var, **k), M,
                                 st, pol, fa)
                c = cv_.checkpoints
                same[var] = bool(torch.equal(yv, ycu)
                                 and torch.equal(c.anchor_stored.codes, ca.anchor_stored.codes)
                                 and torch.equal(c.read_stored.codes, ca.read_stored.codes)
                                 and torch.equal(c.read_stored.block_scales,
                                                 ca.read_stored.block_scales))
            chk["variants_same_bits"] = same
            chk["form_passed"] = bool(chk.get("passed", False) and chk["batch_invariant"]
                                      and all(same.values()))
            forms["tensor_cores" if tc else "fma"] = chk
        chk = forms
        passed = all(c["form_passed"] for c in forms.values())
        ok &= passed
        res["checks"][pol_s] = chk
        row = {"policy": pol_s}
        fas = [dc.flush_args(M, p) for p in pool]
        row["triton"] = dc.timer(lambda i: _serve(kr.gdn_flush_kernel, M, pool[i], pol, fas[i]),
                                 n, a.reps, 5, "graph")["median_us"]
        for var in kr.cuda_flush.VARIANTS:
            row[f"cuda_v{var}"] = dc.timer(
                lambda i, v=var: _serve(lambda *x, **k: kr.gdn_flush_cuda(*x, variant=v, **k),
                                        M, pool[i], pol, fas[i]),
                n, a.reps, 5, "graph")["median_us"]
        row["cuda"] = min(row[f"cuda_v{v}"] for v in kr.cuda_flush.VARIANTS)
        codes = [p["A"].codes for p in pool]
        outs = [torch.empty_like(c) for c in codes]
        row["anchor_copy"] = dc.timer(lambda i: outs[i].copy_(codes[i]), n, a.reps, 5,
                                      "graph")["median_us"]
        row["cuda_vs_triton"] = row["triton"] / row["cuda"]
        res["rows"].append(row)
        print(json.dumps(row), "checks passed" if passed else "CHECKS FAILED", flush=True)
        pool = st = None
        torch.cuda.empty_cache()
    res["checks_passed"] = ok
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({"rows": res["rows"], "checks": res["checks"], "checks_passed": ok},
                     indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
