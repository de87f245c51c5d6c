"""GDN's FP32 flush (the fold of cached corrections, what the ``fp32`` policy's decode state
runs): the shipped Triton kernel against a CUDA C++ stand-in of the same bytes and formula
(issue 15, forty-first pass; ``benchmarks/cuda/fold_standin.cu``).

On the H200 the shipped fold moves its 1175 MB at about 75% of the device copy's rate (335 us
against about 250), on the H100 at about its rate. The question is whether a hand-written
kernel (one CTA per state matrix, the weights ``gamma_{i+1:L} u_i`` staged in shared memory, a
register double buffer of rows, FP32 FMAs in slot order) gets closer on the H200. Nothing
shipped uses it.

At B = 256 on ``flush_tune.py``'s GDN fold geometry and sets (4 rotated; CUDA-graph medians,
``decode.timer``): the shipped serving flush (``flush_tma.launch(M, {})``, stored anchor in,
copies out, ``S q``), each CUDA variant (``nw`` warps per matrix, rows in chunks of ``ch``,
``cs``: streaming cache hints), and a device copy of the anchor (the ceiling). Checks: every
CUDA variant's ``S_L`` and ``y = S_L q`` against a float64 evaluation of the fold on the first
4 sequences (``1e-5 + 1e-5 |ref|``, as ``decode.py``'s outputs), and against the shipped
kernel's store-state ``S`` / ``y`` on all sequences (max abs difference recorded).

Usage (device; nvcc and ninja, as the lent image has)::

    python3 benchmarks/flush_cuda.py --out $OUT/flush_cuda_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cuda_ext  # noqa: E402
import decode as dc  # noqa: E402
import flush_tma  # noqa: E402
import flush_tune as ft  # noqa: E402
from _commit import code_commit  # noqa: E402

from replayssm_quant.policy import StatePolicy  # noqa: E402

VARIANTS = [(nw, ch, cs) for nw in (4, 8) for ch in (8, 4) for cs in (False, True)]
N_REF = 4
TOL = 1e-5


def ext():
    """The CUDA stand-in, built once per process for the device's architecture."""
    decl = ("void fold(torch::Tensor C, torch::Tensor Snew, torch::Tensor U, torch::Tensor la, "
            "torch::Tensor rk, torch::Tensor q, torch::Tensor y, int64_t G, int64_t nw, "
            "int64_t ch, bool cs);\n")
    return _cuda_ext.build("replayssm_fold_standin", "fold_standin.cu", decl, ["fold"])


def reference(st, n):
    """float64 fold of the first ``n`` sequences: ``(S_L [n, H, V, K], y [n, H, V])``."""
    A, u, la, k, q = (st[x][:n].double() for x in ("A", "u", "la", "k", "q"))
    H, G = A.shape[1], k.shape[2]
    gi = torch.arange(H, device=A.device) // (H // G)
    c = la.cumsum(1)  # [n, L, H]
    ctot = c[:, -1]  # [n, H]
    d = torch.exp(ctot[:, None] - c)  # gamma_{i+1:L} [n, L, H]
    S = torch.exp(ctot)[..., None, None] * A + torch.einsum(
        "blh,blhv,blhk->bhvk", d, u, k[:, :, gi])
    y = torch.einsum("bhvk,bhk->bhv", S, q[:, gi])
    return S, y


def err(got, want):
    return float(((got.double() - want).abs() / (TOL + TOL * want.abs())).max())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flush_cuda.py times CUDA launches; run it on the device")
    mod = ext()
    M = next(m for m in ft.geometries(False, True) if m.name == "gdn")
    pol = StatePolicy.parse("fp32")
    gen = torch.Generator(device="cuda").manual_seed(5)
    pool = [ft.make_set(M, gen, pol) for _ in range(4)]
    fk = ft.flush_kw(M)
    cfg, extra = flush_tma.launch(M, {})
    outs = [(torch.empty_like(st["A"]), torch.empty(M.B, M.H, M.V, device="cuda"))
            for st in pool]
    st0 = pool[0]
    res, y_tr = ft.run_flush(M, st0, pol, fk, cfg, store_state=True, dequantize=True, **extra)
    S_ref, y_ref = reference(st0, N_REF)
    out = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "code_commit": code_commit(), "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "timing": "CUDA graph medians, decode.timer, 4 sets rotated",
           "shape": dict(B=M.B, H=M.H, G=M.G, V=M.V, K=M.K, L=M.L),
           "shipped_check": {"S_err_over_tol": err(res.state[:N_REF], S_ref),
                             "y_err_over_tol": err(y_tr[:N_REF].reshape(y_ref.shape), y_ref)},
           "rows": []}
    print(json.dumps(out["shipped_check"]), flush=True)

    def cuda_call(i, nw, ch, cs):
        st = pool[i]
        mod.fold(st["A"], outs[i][0], st["u"], st["la"], st["k"], st["q"], outs[i][1], M.G, nw,
                 ch, cs)

    for rnd in range(a.rounds):
        rows = [("shipped", None)] + [(f"cuda_nw{nw}_ch{ch}{'_cs' if cs else ''}", v)
                                      for v in VARIANTS for nw, ch, cs in [v]] + [("copy", None)]
        for label, v in rows:
            row = {"config": label, "round": rnd}
            try:
                if label == "shipped":
                    fn = lambda i: ft.run_flush(M, pool[i], pol, fk, cfg, **extra)  # noqa: E731
                elif label == "copy":
                    fn = lambda i: outs[i][0].copy_(pool[i]["A"])  # noqa: E731
                else:
                    fn = lambda i, v=v: cuda_call(i, *v)  # noqa: E731
                    if rnd == 0:
                        cuda_call(0, *v)
                        torch.cuda.synchronize()
                        S, y = outs[0]
                        row["check"] = {
                            "S_err_over_tol": err(S[:N_REF], S_ref),
                            "y_err_over_tol": err(y[:N_REF], y_ref),
                            "S_max_abs_vs_shipped": float((S - res.state).abs().max()),
                            "y_max_abs_vs_shipped": float(
                                (y - y_tr.reshape(y.shape)).abs().max())}
                        row["check"]["passed"] = max(row["check"]["S_err_over_tol"],
                                                     row["check"]["y_err_over_tol"]) <= 1
                row["median_us"] = round(dc.timer(fn, 4, a.reps, 3, mode="graph")["median_us"], 1)
            except Exception as e:  # noqa: BLE001  (a variant that fails is recorded)
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
