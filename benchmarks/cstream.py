"""Microbenchmark of GDN verify's stream of C (issue 15): ``Y = C X`` per (sequence, value head)
with ``C [V, K]`` FP32 (the read copy) and ``X [K, NX]`` (NX = 16: the 8 drafts' queries and
keys), against a bare read of C, on the B = 256 GDN geometry of ``benchmarks/decode.py``
(32 value heads, 128 x 128).

The seventeenth pass (docs/kernels-replay.md) measured the stream alone, tf32x3 on 16
columns, at 229 us on the H200 against 131 us for a read of the state, which puts GDN's
verify target (1.3x a step) out of reach. This script times forms of the product alone,
each checked against a float64 ``C X`` (relative Frobenius error and max error relative to
``|C| |X|``, the FP32 product's natural scale):

* ``read``: the bare read (each program sums its rows: the bandwidth floor);
* ``dot``: ``tl.dot(C_chunk [BV, KC], X_chunk [KC, NX], input_precision=P)`` for P in
  ``ieee`` (FP32 FMA), ``tf32`` (one TF32 pass: inexact, the tensor-core floor) and
  ``tf32x3`` (Triton's 3xTF32), over K in chunks of ``KC``;
* ``split3``: 3xTF32 written out (``C_hi X_hi + (C_hi X_lo + C_lo X_hi)`` with ``tf32`` dots,
  the high part by truncation of the low 13 mantissa bits), X split once per program;
* ``tdot``: the transposed product ``Y^T [NX, BV] = X^T [NX, KC] C^T [KC, BV]`` (C as the
  dot's second operand; X^T the small first one), tf32x3.

Timing: ``decode.timer`` (CUDA graph of each call, median of ``--reps``) over two sets of C
(1 GiB: beyond the L2). Usage::

    python3 benchmarks/cstream.py --out $OUT/cstream_h100.json     # device
    python3 benchmarks/cstream.py --tiny                            # interpreter (CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402


@triton.jit
def _read_kernel(c_ptr, y_ptr, V, K: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                 NX: tl.constexpr):
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    rows = vt * BV + tl.arange(0, BV)
    acc = tl.zeros([BV, KC], tl.float32)
    for k0 in range(0, K, KC):
        cols = k0 + tl.arange(0, KC)
        acc += tl.load(c_ptr + (mat * V + rows)[:, None] * K + cols[None, :])
    tl.store(y_ptr + (mat * V + rows) * NX, tl.sum(acc, axis=1))


@triton.jit
def _cx_tiles(c_ptr, x_ptr, mat, rows, cols, j, V, K: tl.constexpr, NX: tl.constexpr):
    """The chunk ``cols`` of C's rows ``rows`` ``[BV, KC]`` and of X ``[KC, NX]``."""
    c = tl.load(c_ptr + (mat * V + rows)[:, None] * K + cols[None, :])
    x = tl.load(x_ptr + (mat * K + cols)[:, None] * NX + j[None, :])
    return c, x


@triton.jit
def _dot_kernel(c_ptr, x_ptr, y_ptr, V, K: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                NX: tl.constexpr, PREC: tl.constexpr):
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    rows = vt * BV + tl.arange(0, BV)
    j = tl.arange(0, NX)
    acc = tl.zeros([BV, NX], tl.float32)
    for k0 in range(0, K, KC):
        cols = k0 + tl.arange(0, KC)
        c, x = _cx_tiles(c_ptr, x_ptr, mat, rows, cols, j, V, K, NX)
        acc = tl.dot(c, x, acc, input_precision=PREC)
    tl.store(y_ptr + (mat * V + rows)[:, None] * NX + j[None, :], acc)


@triton.jit
def _hi(x):
    """The TF32 high part of FP32 ``x``: the low 13 mantissa bits cleared. ``x - hi`` is exact
    in FP32 but has up to 13 significant bits, so the tensor core's TF32 conversion of the low
    part rounds it (``split3``'s error, 6.2e-7 against tf32x3's 1.4e-7 on the H100)."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _split3_kernel(c_ptr, x_ptr, y_ptr, V, K: tl.constexpr, BV: tl.constexpr,
                   KC: tl.constexpr, NX: tl.constexpr):
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    rows = vt * BV + tl.arange(0, BV)
    j = tl.arange(0, NX)
    big = tl.zeros([BV, NX], tl.float32)
    small = tl.zeros([BV, NX], tl.float32)
    for k0 in range(0, K, KC):
        cols = k0 + tl.arange(0, KC)
        c, x = _cx_tiles(c_ptr, x_ptr, mat, rows, cols, j, V, K, NX)
        ch = _hi(c)
        xh = _hi(x)
        small = tl.dot(ch, x - xh, small, input_precision="tf32")
        small = tl.dot(c - ch, xh, small, input_precision="tf32")
        big = tl.dot(ch, xh, big, input_precision="tf32")
    tl.store(y_ptr + (mat * V + rows)[:, None] * NX + j[None, :], big + small)


@triton.jit
def _tdot_kernel(c_ptr, x_ptr, y_ptr, V, K: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                 NX: tl.constexpr, PREC: tl.constexpr):
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    rows = vt * BV + tl.arange(0, BV)
    j = tl.arange(0, NX)
    acc = tl.zeros([NX, BV], tl.float32)
    for k0 in range(0, K, KC):
        cols = k0 + tl.arange(0, KC)
        ct = tl.load(c_ptr + (mat * V + rows)[None, :] * K + cols[:, None])  # [KC, BV]
        xt = tl.load(x_ptr + (mat * K + cols)[None, :] * NX + j[:, None])  # [NX, KC]
        acc = tl.dot(xt, ct, acc, input_precision=PREC)
    tl.store(y_ptr + (mat * V + rows)[None, :] * NX + j[:, None], acc)


def _configs(tiny: bool):
    if tiny:
        return [("read", 16, 16, 1, 1, None), ("dot", 16, 16, 1, 1, "ieee"),
                ("dot", 16, 16, 1, 1, "tf32x3"), ("split3", 16, 16, 1, 1, None),
                ("tdot", 16, 16, 1, 1, "tf32x3")]
    out = [("read", 64, 32, 4, 2, None), ("read", 128, 32, 4, 3, None)]
    for form, prec in (("dot", "tf32x3"), ("dot", "tf32"), ("dot", "ieee"), ("split3", None),
                       ("tdot", "tf32x3")):
        for bv in (64, 128):
            for kc in (16, 32):
                for w in (2, 4):
                    for st in (2, 3, 4):
                        if prec == "ieee" and (kc > 16 or st != 3):
                            continue
                        out.append((form, bv, kc, w, st, prec))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small shapes under the interpreter")
    ap.add_argument("--B", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated forms to run (default all)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    dev = "cpu" if a.tiny else "cuda"
    B, H, V, K, NX = (2, 2, 32, 32, 16) if a.tiny else (a.B, 32, 128, 128, 16)
    g = torch.Generator(device="cpu").manual_seed(0)
    n = 1 if a.tiny else 2
    Cs = [torch.randn(B * H, V, K, generator=g).to(dev) for _ in range(n)]
    X = (torch.randn(B * H, K, NX, generator=g) / K ** 0.5).to(dev)
    Y = torch.empty(B * H, V, NX, device=dev)
    ref = [torch.bmm(c.double(), X.double()) for c in Cs[:1]]
    scale = torch.bmm(Cs[0].double().abs(), X.double().abs())
    rows = []
    only = set(filter(None, a.only.split(",")))
    for form, bv, kc, w, st, prec in _configs(a.tiny):
        if only and form not in only:
            continue
        grid = (B * H, V // bv)

        def call(i, form=form, bv=bv, kc=kc, w=w, st=st, prec=prec):
            kw = dict(num_warps=w, num_stages=st)
            if form == "read":
                _read_kernel[grid](Cs[i], Y, V, K, bv, kc, NX, **kw)
            elif form == "dot":
                _dot_kernel[grid](Cs[i], X, Y, V, K, bv, kc, NX, prec, **kw)
            elif form == "split3":
                _split3_kernel[grid](Cs[i], X, Y, V, K, bv, kc, NX, **kw)
            else:
                _tdot_kernel[grid](Cs[i], X, Y, V, K, bv, kc, NX, prec, **kw)

        row = {"form": form, "block_v": bv, "k_chunk": kc, "num_warps": w, "num_stages": st,
               "precision": prec}
        try:
            call(0)
            if form != "read":
                err = Y.double() - ref[0]
                row["rel_fro"] = float(err.norm() / ref[0].norm())
                row["max_err_vs_absprod"] = float((err.abs() / scale.clamp_min(1e-30)).max())
            t = dc.timer(call, n, a.reps, 3, mode="graph") if not a.tiny else {"median_us": 0}
            row.update(median_us=t["median_us"], min_us=t.get("min_us"))
        except Exception as e:  # noqa: BLE001  (a configuration that does not compile)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    if a.out:
        res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
               "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton.__version__,
               "code_commit": os.environ.get("CODE_COMMIT", ""),
               "shape": {"B": B, "H": H, "V": V, "K": K, "NX": NX},
               "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows}
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
