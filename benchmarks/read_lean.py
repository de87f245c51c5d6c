"""A lean read pass for the nvfp4 decode step (issue 15): ``Y = C X`` for the NC <= 2
columns of the step (GDN: the new key and the query; Mamba-2: the query) from an nvfp4
read copy, in a kernel that does only that, against the records kernel's read pass.

A stand-in (2026-12-04, docs/kernels-replay.md "Twenty-first pass"); the shipped form is
``records._nvfp4_read_kernel``. ``FORM``: 0 reductions over blocks of decoded codes (the
packed-half decoder, or the integer one with ``--tiny``), 1 the block scale on each code
first, 2 one inline-PTX FMA chain per 32-bit word of 8 codes and column (the shipped form;
CUDA only), 9 the memory floor (codes and block scales read and summed as integers; its
check is not meaningful). Each case: (rows per program, rows per chunk, warps, stages,
half decoder, form); outputs against a float64 reference. The shipped nvfp4 step at h = 7 is
timed in the same run for scale. Usage::

    python3 benchmarks/read_lean.py --out $OUT/read_lean_h200.json   # device
    python3 benchmarks/read_lean.py --sass      # CPU: static sm_90 SASS counts only
    python benchmarks/read_lean.py --tiny       # CPU interpreter: the checks (forms 0, 1, 9)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
if "--sass" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "0"

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from replayssm_quant.kernels.replay.codec import (  # noqa: E402
    _e2m1_dot8_1, _e2m1_dot8_2, _e2m1_pairs_half, _e2m1_value, _e4m3_value)

E2M1_HALF = tl.constexpr(16384.0)

# FORM 2 calls the shipped codec._e2m1_dot8_1 / _e2m1_dot8_2 (one inline-PTX FMA chain per
# 32-bit word of 8 codes and column).


@triton.jit
def _x8(x_ptr, base, woff, t: tl.constexpr):
    return tl.load(x_ptr + base + woff + t)


@triton.jit
def _lean_read_kernel(c_ptr, bs_ptr, ms_ptr, x_ptr, y_ptr, H, G, V,
                      K: tl.constexpr, NC: tl.constexpr, BV: tl.constexpr, RC: tl.constexpr,
                      STAGES: tl.constexpr, HALF: tl.constexpr, FORM: tl.constexpr):
    """Program (matrix, tile of BV rows); rows in chunks of RC. x_ptr: X [B*G, NC, K] fp32;
    y_ptr: Y [B*H*V, NC]."""
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    NB: tl.constexpr = K // 16
    jb = tl.arange(0, NB)
    w = tl.arange(0, 8)
    xoff = (b * G + g) * NC * K + jb[:, None] * 16 + 2 * w[None, :]  # [NB, 8] even elements
    if FORM != 2:
        xe0 = tl.load(x_ptr + xoff)
        xo0 = tl.load(x_ptr + xoff + 1)
        if NC > 1:
            xe1 = tl.load(x_ptr + xoff + K)
            xo1 = tl.load(x_ptr + xoff + K + 1)
    ms = tl.load(ms_ptr + mat)
    if FORM == 2:  # X at k = 16 j + 8 wi + t: [NB, 2] per t and column
        xw = (b * G + g) * NC * K
        woff = jb[:, None] * 16 + tl.arange(0, 2)[None, :] * 8
        xa0 = _x8(x_ptr, xw, woff, 0)
        xa1 = _x8(x_ptr, xw, woff, 1)
        xa2 = _x8(x_ptr, xw, woff, 2)
        xa3 = _x8(x_ptr, xw, woff, 3)
        xa4 = _x8(x_ptr, xw, woff, 4)
        xa5 = _x8(x_ptr, xw, woff, 5)
        xa6 = _x8(x_ptr, xw, woff, 6)
        xa7 = _x8(x_ptr, xw, woff, 7)
        if NC > 1:
            xb0 = _x8(x_ptr, xw + K, woff, 0)
            xb1 = _x8(x_ptr, xw + K, woff, 1)
            xb2 = _x8(x_ptr, xw + K, woff, 2)
            xb3 = _x8(x_ptr, xw + K, woff, 3)
            xb4 = _x8(x_ptr, xw + K, woff, 4)
            xb5 = _x8(x_ptr, xw + K, woff, 5)
            xb6 = _x8(x_ptr, xw + K, woff, 6)
            xb7 = _x8(x_ptr, xw + K, woff, 7)
    for r0 in tl.range(0, BV, RC, num_stages=STAGES):
        rows = vt * BV + r0 + tl.arange(0, RC)
        rowg = mat * V + rows
        if FORM == 2:  # words of 8 codes, the products in the asm
            wrd = tl.load(c_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                          + rowg[:, None, None] * (K // 8) + jb[None, :, None] * 2
                          + tl.arange(0, 2)[None, None, :])
            sc = _e4m3_value(tl.load(bs_ptr + rowg[:, None] * NB + jb[None, :]).to(tl.int32))
            sc = sc * E2M1_HALF
            if NC == 1:
                p0 = _e2m1_dot8_1(wrd, xa0[None], xa1[None], xa2[None], xa3[None], xa4[None],
                                  xa5[None], xa6[None], xa7[None])
                tl.store(y_ptr + rowg * NC, tl.sum(tl.sum(p0, axis=2) * sc, axis=1) * ms)
            else:
                p0, p1 = _e2m1_dot8_2(wrd, xa0[None], xa1[None], xa2[None], xa3[None],
                                      xa4[None], xa5[None], xa6[None], xa7[None], xb0[None],
                                      xb1[None], xb2[None], xb3[None], xb4[None], xb5[None],
                                      xb6[None], xb7[None])
                tl.store(y_ptr + rowg * NC, tl.sum(tl.sum(p0, axis=2) * sc, axis=1) * ms)
                tl.store(y_ptr + rowg * NC + 1, tl.sum(tl.sum(p1, axis=2) * sc, axis=1) * ms)
        else:
            byte = tl.load(c_ptr + rowg[:, None, None] * (K // 2) + jb[None, :, None] * 8
                           + w[None, None, :])
            if FORM == 9:  # the memory floor: the bytes and scales read, summed as integers
                t = tl.sum(tl.sum(byte.to(tl.int32), axis=2), axis=1)
                t += tl.sum(tl.load(bs_ptr + rowg[:, None] * NB + jb[None, :]).to(tl.int32), axis=1)
                tl.store(y_ptr + rowg * NC, t.to(tl.float32) * ms)
            else:
                if HALF:
                    ve, vo = _e2m1_pairs_half(byte)
                else:
                    bi = byte.to(tl.int32)
                    ve = _e2m1_value(bi)
                    vo = _e2m1_value(bi >> 4)
                sc = _e4m3_value(tl.load(bs_ptr + rowg[:, None] * NB + jb[None, :]).to(tl.int32))
                if HALF:
                    sc = sc * E2M1_HALF
                if FORM == 0:
                    p0 = tl.sum(ve * xe0[None] + vo * xo0[None], axis=2)
                    tl.store(y_ptr + rowg * NC, tl.sum(p0 * sc, axis=1) * ms)
                    if NC > 1:
                        p1 = tl.sum(ve * xe1[None] + vo * xo1[None], axis=2)
                        tl.store(y_ptr + rowg * NC + 1, tl.sum(p1 * sc, axis=1) * ms)
                else:  # the block scale on each code first
                    ves = ve * sc[:, :, None]
                    vos = vo * sc[:, :, None]
                    y0 = tl.sum(tl.sum(ves * xe0[None] + vos * xo0[None], axis=2), axis=1)
                    tl.store(y_ptr + rowg * NC, y0 * ms)
                    if NC > 1:
                        y1 = tl.sum(tl.sum(ves * xe1[None] + vos * xo1[None], axis=2), axis=1)
                        tl.store(y_ptr + rowg * NC + 1, y1 * ms)


GEO = {"gdn": dict(B=256, H=32, G=16, V=128, K=128, NC=2),
       "mamba2": dict(B=256, H=128, G=1, V=64, K=128, NC=1)}


def make(model, dev, gen, tiny=False):
    from replayssm_quant.policy import StatePolicy
    from replayssm_quant.quant import pack
    g = dict(GEO[model])
    if tiny:
        g.update(B=2)
    B, H, G, V, K, NC = (g[k] for k in ("B", "H", "G", "V", "K", "NC"))
    S = torch.randn(B, H, V, K, generator=gen, device=dev) / K ** 0.5
    pol = StatePolicy.parse("read:nvfp4/rec:fp16+sr")
    R = pack(S, pol.read, seed=1, stream=torch.arange(B * H, device=dev).view(B, H),
             backend="torch" if dev == "cpu" else "triton")
    X = torch.randn(B, G, NC, K, generator=gen, device=dev)
    return g, R, X


def launch(g, R, X, Y, bv, rc, warps, stages, half, form):
    B, H, G, V, K, NC = (g[k] for k in ("B", "H", "G", "V", "K", "NC"))
    bv = min(bv, V)  # no row mask: a tile never passes its matrix
    rc = min(rc, bv)
    return _lean_read_kernel[(B * H, triton.cdiv(V, bv))](
        R.codes, R.block_scales, R.matrix_scale, X, Y, H, G, V, K=K, NC=NC, BV=bv, RC=rc,
        STAGES=stages, HALF=half, FORM=form, num_warps=warps)


def reference(g, R, X):
    B, H, G, V, K, NC = (g[k] for k in ("B", "H", "G", "V", "K", "NC"))
    C = R.dequantize().double()  # [B, H, V, K]
    gi = torch.arange(H, device=X.device) // (H // G)
    x = X.double()[:, gi]  # [B, H, NC, K]
    return torch.einsum("bhvk,bhck->bhvc", C, x).reshape(-1, NC)


CASES = [(32, 32, 2, 1, True, 9), (64, 64, 4, 1, True, 9)] + [
    (bv, rc, w, s, True, 2) for bv, rc, w, s in (
        (32, 32, 1, 1), (32, 32, 2, 1), (64, 64, 2, 1), (64, 64, 4, 1), (128, 32, 1, 2),
        (128, 16, 1, 3), (128, 32, 2, 2), (128, 64, 4, 2), (128, 128, 4, 1), (64, 32, 1, 2),
        (128, 64, 2, 2), (128, 128, 8, 1))] + [
    (bv, rc, w, s, half, form) for half in (True,) for form in (0, 1)
         for bv, rc, w, s in ((32, 32, 2, 1), (64, 32, 2, 2), (128, 32, 2, 2), (128, 32, 4, 2),
                              (64, 64, 4, 1), (128, 64, 4, 2), (128, 16, 1, 3), (64, 16, 1, 3))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--sass", action="store_true", help="CPU: static sm_90 SASS of each case")
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter: checks, small B")
    ap.add_argument("--models", default="gdn,mamba2")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not (a.sass or a.tiny) else "cpu"
    rows = []
    if a.sass:
        import sass_static as ss
        for model in a.models.split(","):
            g = dict(GEO[model], B=2)
            B, H, G, V, K, NC = (g[k] for k in ("B", "H", "G", "V", "K", "NC"))
            codes = torch.zeros(B, H, V, K // 2, dtype=torch.uint8)
            bsc = torch.zeros(B, H, V, K // 16, dtype=torch.uint8)

            class Rr:
                pass
            R = Rr()
            R.codes, R.block_scales, R.matrix_scale = codes, bsc, torch.ones(B, H)
            X = torch.zeros(B, G, NC, K)
            Y = torch.zeros(B * H * V, NC)
            for case in CASES:
                with ss._compiling() as comp:
                    launch(g, R, X, Y, *case)
                r = ss.sass_report(comp[-1][1].asm["cubin"], 12)
                bv, rc, w = case[:3]
                per = r["instructions"] / (rc * K / (32 * w))
                print(model, case, r["instructions"], r["usage"], f"{per:.2f}/code",
                      r["opcodes"])
        return
    import decode as dc
    import replay_kernels as rk

    from replayssm_quant.policy import StatePolicy
    gen = torch.Generator(device=dev).manual_seed(0)
    for model in a.models.split(","):
        if not a.tiny:  # the shipped nvfp4 step (read pass + records launch) at h = 7
            g = GEO[model]
            M = rk.Model(model, g["B"], g["H"], g["G"], g["V"], g["K"], 16)
            pol = StatePolicy.parse(dc.POLICIES["nvfp4"])
            sts = [dc.make_set(M, gen, pol, 8, False) for _ in range(2)]
            hh = torch.full((g["B"],), 7, dtype=torch.int64, device=dev)
            r = dc.timer(lambda i: dc.run_step(M, sts[i], hh), 2, a.reps, 3, mode="graph")
            row = {"model": model, "case": "shipped nvfp4 step, h = 7",
                   "median_us": r["median_us"], "min_us": r["min_us"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            sts = None
        pool = [make(model, dev, gen, a.tiny) for _ in range(1 if a.tiny else 2)]
        g = pool[0][0]
        Ys = [torch.empty(g["B"] * g["H"] * g["V"], g["NC"], device=dev) for _ in pool]
        want = reference(*pool[0])
        for case in CASES:
            if a.tiny and case[5] == 2:
                continue  # inline PTX: CUDA only
            if a.tiny and case[4]:
                case = case[:4] + (False,) + case[5:]
            row = {"model": model, "case": dict(zip(("bv", "rc", "warps", "stages", "half",
                                                      "form"), case))}
            try:
                launch(pool[0][0], pool[0][1], pool[0][2], Ys[0], *case)
                err = ((Ys[0].double() - want).abs()
                       / (1e-5 * want.abs().amax(0) + 1e-6)).max().item()
                row["check"] = {"max_err_over_tol": err, "passed": err <= 1 or case[5] == 9}
                if not a.tiny:
                    r = dc.timer(lambda i: launch(pool[i][0], pool[i][1], pool[i][2], Ys[i],
                                                  *case), len(pool), a.reps, 3, mode="graph")
                    row.update(median_us=r["median_us"], min_us=r["min_us"])
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows,
                       "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
                       "versions": {"torch": torch.__version__, "triton": triton.__version__}},
                      f, indent=1)


if __name__ == "__main__":
    main()
