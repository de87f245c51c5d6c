"""Where the GDN FP32 decode step loses time against a bare read of the state (issue 15):
a diagnostic on stand-in kernels, not the shipped ones.

The FP32 step of ``decode.py`` (B = 256, 32 value / 16 key heads, 128 x 128, h = 7) takes
about 171 us: a 10 us products launch and a 156 us records launch, against 131 us for a bare
read of the same 0.54 GB state (``decode.py``'s ``_read_kernel``). Forming the key products
in the records launch instead was slower still (209 us, ``records_tune --set step5``). One
explanation is per-program latency: each program streams its C tile, then runs a chain of
dependent loads and stores on the records (Z, the cached corrections U, the outputs), and
with a few programs resident per SM that chain is paid about once per wave. This script
measures that on stand-ins with the step's memory pattern and a simplified (not GDN's)
epilogue arithmetic:

* ``bare``: ``o = S q``, 32-row tiles, 4 warps (``decode._read_kernel``);
* ``read2``: ``Y = S [k, q]`` (two columns) on the step's 64 x 2 tile, stored, nothing else;
* ``epi``: ``read2`` plus the step's epilogue: the ring's ``la`` and corrections ``U [LP, BV]``
  of this head (before the stream), Z ``[LP, 2]`` from a buffer (the products launch's output)
  after it, a new correction stored into the ring and one output row;
* ``epi_z``: ``epi`` with Z formed in the program from the ring's keys (loaded before the
  stream) instead of from a buffer: what removing the products launch costs per program;
* ``*_early``: every small operand of the epilogue (k, q, Z or the key products, the new
  decay, beta and value row) loaded before the stream of C instead of after it, so that only
  arithmetic and the stores follow the stream;
* ``ring`` / ``light`` (``--set light``): the epilogue's ring sums (the decay- and
  Z-weighted sums of the ring's corrections, and the decay) in a launch of their own before
  the stream, since they do not depend on C; then ``read2``'s stream with an elementwise
  epilogue on those sums (``light`` = both launches in sequence; ``*_z``: Z formed in the
  ring launch from the ring's keys, so no products launch either);
* ``epi_ulate`` (``--set ulate``): ``epi`` with the ring's ``la`` and ``U`` loaded after the
  stream instead of before it (not live across it);
* ``*_persist``: the same work in a persistent grid (``--waves`` programs per SM), each program
  looping over (sequence, head, tile) items with the next item's C tile loaded before the
  current item's products and epilogue (a register double buffer), so the epilogue's latency
  overlaps the next load.

Each variant's outputs are checked against a float64 torch evaluation of the same stand-in
formula (``read2``: both columns; the others: the output and the new correction), to
``1e-5 + 1e-5 |ref|``. Timings: CUDA graph medians over a pool of input sets larger than L2
(``decode.timer``). Device only (``--tiny``: the checks under the interpreter on CPU).

Usage (device)::

    python3 benchmarks/step_latency.py --out $OUT/step_latency_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--tiny" in sys.argv:  # before triton is imported: the interpreter on CPU
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _cuda_ext  # noqa: E402
import decode as dc  # noqa: E402
from _commit import code_commit  # noqa: E402

B, H, G, V, K, CAP = 256, 32, 16, 128, 128, 16
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _item(mat, vt, H, G, V, BV: tl.constexpr):
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    rows = vt * BV + tl.arange(0, BV)
    return b, h, g, rows


@triton.jit
def _load_c(s_ptr, mat, rows, NMAT, V, K: tl.constexpr):
    """C rows ``[BV, K]`` of matrix ``mat`` (zeros past the last matrix: a persistent
    program's prefetch beyond its last item)."""
    kk = tl.arange(0, K)
    lim = tl.where(mat < NMAT, V, 0)
    return tl.load(s_ptr + (mat * V + rows.to(tl.int64))[:, None] * K + kk[None, :],
                   mask=(rows < lim)[:, None], other=0.0)


@triton.jit
def _pre(u_ptr, la_ptr, rk_ptr, h_ptr, b, h, g, rows, H, G, V, CAP, K: tl.constexpr,
         LP: tl.constexpr, ZIN: tl.constexpr):
    """The records loaded before the stream: la, U (and the ring keys with ZIN)."""
    idx = tl.arange(0, LP)
    hh = tl.load(h_ptr + b)
    ring = idx < hh
    la = tl.load(la_ptr + (b * CAP + idx) * H + h, mask=ring, other=0.0)
    U = tl.load(u_ptr + ((b * CAP + idx) * H + h)[:, None] * V + rows[None, :],
                mask=ring[:, None] & (rows < V)[None, :], other=0.0)
    if ZIN:
        kk = tl.arange(0, K)
        keys = tl.load(rk_ptr + ((b * CAP + idx) * G + g)[:, None] * K + kk[None, :],
                       mask=ring[:, None], other=0.0)
    else:
        keys = 0
    return hh, ring, la, U, keys


@triton.jit
def _small(ring, keys, b, h, g, rows, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr, z_ptr, H, G, V,
           K: tl.constexpr, LP: tl.constexpr, ZIN: tl.constexpr):
    """The epilogue's small operands: k, q, Z (loaded, or formed from the ring keys), the new
    decay, beta and value row."""
    kk = tl.arange(0, K)
    idx = tl.arange(0, LP)
    kn = tl.load(kn_ptr + (b * G + g) * K + kk)
    q = tl.load(q_ptr + (b * G + g) * K + kk)
    if ZIN:
        zk = tl.sum(keys * kn[None, :], axis=1)
        zq = tl.sum(keys * q[None, :], axis=1)
    else:
        zk = tl.load(z_ptr + ((b * G + g) * LP + idx) * 2, mask=ring, other=0.0)
        zq = tl.load(z_ptr + ((b * G + g) * LP + idx) * 2 + 1, mask=ring, other=0.0)
    lan = tl.load(lan_ptr + b * H + h)
    bn = tl.load(bn_ptr + b * H + h)
    vn = tl.load(vn_ptr + (b * H + h) * V + rows, mask=rows < V, other=0.0)
    return kn, q, zk, zq, lan, bn, vn


@triton.jit
def _epilogue(C, hh, ring, la, U, small, b, h, rows, u_ptr, o_ptr, H, V, CAP):
    """Stand-in epilogue: Y = C [k, q]; corrections weighted by the decays; the new correction
    into ring slot h; one output row."""
    kn, q, zk, zq, lan, bn, vn = small
    y0 = tl.sum(C * kn[None, :], axis=1)
    y1 = tl.sum(C * q[None, :], axis=1)
    _finish(y0, y1, hh, ring, la, U, small, b, h, rows, u_ptr, o_ptr, H, V, CAP)


@triton.jit
def _finish(y0, y1, hh, ring, la, U, small, b, h, rows, u_ptr, o_ptr, H, V, CAP):
    """The stand-in epilogue after the stream: ``y0 = C k``, ``y1 = C q`` given."""
    kn, q, zk, zq, lan, bn, vn = small
    cvec = tl.cumsum(la, axis=0)
    ctot = tl.sum(la, axis=0) + lan
    dec = tl.where(ring, tl.exp(ctot - cvec), 0.0)
    ek = tl.sum(U * (dec * zk)[:, None], axis=0)
    eq = tl.sum(U * (dec * zq)[:, None], axis=0)
    gam = tl.exp(ctot)
    kq = tl.sum(kn * q, axis=0)
    un = bn * (vn - gam * y0 - ek)
    o = gam * y1 + eq + un * kq
    tl.store(u_ptr + ((b * CAP + hh) * H + h) * V + rows, un, mask=rows < V)
    tl.store(o_ptr + (b * H + h) * V + rows, o, mask=rows < V)


@triton.jit
def _read2_kernel(s_ptr, kn_ptr, q_ptr, y_ptr, H, G, V, NMAT, K: tl.constexpr,
                  BV: tl.constexpr):
    mat = tl.program_id(0).to(tl.int64)
    b, h, g, rows = _item(mat, tl.program_id(1), H, G, V, BV)
    C = _load_c(s_ptr, mat, rows, NMAT, V, K)
    kk = tl.arange(0, K)
    kn = tl.load(kn_ptr + (b * G + g) * K + kk)
    q = tl.load(q_ptr + (b * G + g) * K + kk)
    y = (mat * V + rows) * 2
    tl.store(y_ptr + y, tl.sum(C * kn[None, :], axis=1), mask=rows < V)
    tl.store(y_ptr + y + 1, tl.sum(C * q[None, :], axis=1), mask=rows < V)


@triton.jit
def _epi_kernel(s_ptr, u_ptr, la_ptr, rk_ptr, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr, z_ptr,
                h_ptr, o_ptr, H, G, V, CAP, NMAT, K: tl.constexpr, BV: tl.constexpr,
                LP: tl.constexpr, ZIN: tl.constexpr, EARLY: tl.constexpr,
                ULATE: tl.constexpr = False):
    # EARLY: every small operand (and Z) before the stream of C, so that after it only
    # arithmetic and the stores remain; ULATE: the ring's la and U (and keys) after it instead
    # of before (not live across the stream)
    mat = tl.program_id(0).to(tl.int64)
    b, h, g, rows = _item(mat, tl.program_id(1), H, G, V, BV)
    if ULATE:
        C = _load_c(s_ptr, mat, rows, NMAT, V, K)
        hh, ring, la, U, keys = _pre(u_ptr, la_ptr, rk_ptr, h_ptr, b, h, g, rows, H, G, V, CAP,
                                     K, LP, ZIN)
        small = _small(ring, keys, b, h, g, rows, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr, z_ptr,
                       H, G, V, K, LP, ZIN)
        _epilogue(C, hh, ring, la, U, small, b, h, rows, u_ptr, o_ptr, H, V, CAP)
        return
    hh, ring, la, U, keys = _pre(u_ptr, la_ptr, rk_ptr, h_ptr, b, h, g, rows, H, G, V, CAP, K,
                                 LP, ZIN)
    if EARLY:
        small = _small(ring, keys, b, h, g, rows, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr, z_ptr,
                       H, G, V, K, LP, ZIN)
        C = _load_c(s_ptr, mat, rows, NMAT, V, K)
    else:
        C = _load_c(s_ptr, mat, rows, NMAT, V, K)
        small = _small(ring, keys, b, h, g, rows, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr, z_ptr,
                       H, G, V, K, LP, ZIN)
    _epilogue(C, hh, ring, la, U, small, b, h, rows, u_ptr, o_ptr, H, V, CAP)


@triton.jit
def _ring_kernel(u_ptr, la_ptr, rk_ptr, kn_ptr, q_ptr, lan_ptr, z_ptr, h_ptr, e_ptr, gam_ptr, H,
                 G, V, CAP, K: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
                 ZIN: tl.constexpr, PDL: tl.constexpr = False):
    """``light``'s first launch: what the epilogue needs from the ring, before C is read (it
    depends on the records, the new key and query and the new decay, not on C): ``E [BV, 2]``
    = the decay- and Z-weighted sums of the ring's corrections, and the matrix's decay
    ``gamma`` (one float per (sequence, head)). ``ZIN``: Z formed here from the ring's keys
    (no products launch before it). ``PDL``: let the stream's launch start at once."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    mat = tl.program_id(0).to(tl.int64)
    b, h, g, rows = _item(mat, tl.program_id(1), H, G, V, BV)
    hh, ring, la, U, keys = _pre(u_ptr, la_ptr, rk_ptr, h_ptr, b, h, g, rows, H, G, V, CAP, K,
                                 LP, ZIN)
    idx = tl.arange(0, LP)
    if ZIN:
        kk = tl.arange(0, K)
        zk = tl.sum(keys * tl.load(kn_ptr + (b * G + g) * K + kk)[None, :], axis=1)
        zq = tl.sum(keys * tl.load(q_ptr + (b * G + g) * K + kk)[None, :], axis=1)
    else:
        zk = tl.load(z_ptr + ((b * G + g) * LP + idx) * 2, mask=ring, other=0.0)
        zq = tl.load(z_ptr + ((b * G + g) * LP + idx) * 2 + 1, mask=ring, other=0.0)
    lan = tl.load(lan_ptr + b * H + h)
    cvec = tl.cumsum(la, axis=0)
    ctot = tl.sum(la, axis=0) + lan
    dec = tl.where(ring, tl.exp(ctot - cvec), 0.0)
    e = (mat * V + rows) * 2
    tl.store(e_ptr + e, tl.sum(U * (dec * zk)[:, None], axis=0), mask=rows < V)
    tl.store(e_ptr + e + 1, tl.sum(U * (dec * zq)[:, None], axis=0), mask=rows < V)
    if tl.program_id(1) == 0:
        tl.store(gam_ptr + mat, tl.exp(ctot))


@triton.jit
def _epi_light_kernel(s_ptr, u_ptr, kn_ptr, q_ptr, vn_ptr, bn_ptr, h_ptr, e_ptr, gam_ptr, o_ptr,
                      H, G, V, CAP, NMAT, K: tl.constexpr, BV: tl.constexpr,
                      PDL: tl.constexpr = False):
    """``light``'s second launch: ``read2``'s stream, then an elementwise epilogue on the
    ring's sums from ``_ring_kernel`` (no ring loads after the stream). ``PDL``: launched as
    a dependent launch of the ring launch; it waits for that grid only after the stream."""
    mat = tl.program_id(0).to(tl.int64)
    b, h, g, rows = _item(mat, tl.program_id(1), H, G, V, BV)
    C = _load_c(s_ptr, mat, rows, NMAT, V, K)
    kk = tl.arange(0, K)
    kn = tl.load(kn_ptr + (b * G + g) * K + kk)
    q = tl.load(q_ptr + (b * G + g) * K + kk)
    y0 = tl.sum(C * kn[None, :], axis=1)
    y1 = tl.sum(C * q[None, :], axis=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    e = (mat * V + rows) * 2
    ek = tl.load(e_ptr + e, mask=rows < V, other=0.0)
    eq = tl.load(e_ptr + e + 1, mask=rows < V, other=0.0)
    gam = tl.load(gam_ptr + mat)
    bn = tl.load(bn_ptr + b * H + h)
    vn = tl.load(vn_ptr + (b * H + h) * V + rows, mask=rows < V, other=0.0)
    hh = tl.load(h_ptr + b)
    un = bn * (vn - gam * y0 - ek)
    o = gam * y1 + eq + un * tl.sum(kn * q, axis=0)
    tl.store(u_ptr + ((b * CAP + hh) * H + h) * V + rows, un, mask=rows < V)
    tl.store(o_ptr + (b * H + h) * V + rows, o, mask=rows < V)


@triton.jit
def _epi_persist_kernel(s_ptr, u_ptr, la_ptr, rk_ptr, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr,
                        z_ptr, h_ptr, o_ptr, H, G, V, CAP, NT, NITEMS, NMAT, K: tl.constexpr,
                        BV: tl.constexpr, LP: tl.constexpr, ZIN: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    it = pid.to(tl.int64)
    mat = it // NT
    b, h, g, rows = _item(mat, it - mat * NT, H, G, V, BV)
    Cn = _load_c(s_ptr, mat, rows, NMAT, V, K)
    for i in range(pid, NITEMS, nprog):
        it = tl.cast(i, tl.int64)
        mat = it // NT
        b, h, g, rows = _item(mat, it - mat * NT, H, G, V, BV)
        hh, ring, la, U, keys = _pre(u_ptr, la_ptr, rk_ptr, h_ptr, b, h, g, rows, H, G, V, CAP,
                                     K, LP, ZIN)
        C = Cn
        nx = it + nprog
        mn = nx // NT
        rn = (nx - mn * NT) * BV + tl.arange(0, BV)
        Cn = _load_c(s_ptr, mn, rn, NMAT, V, K)
        small = _small(ring, keys, b, h, g, rows, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr, z_ptr,
                       H, G, V, K, LP, ZIN)
        _epilogue(C, hh, ring, la, U, small, b, h, rows, u_ptr, o_ptr, H, V, CAP)


@triton.jit
def _epi_pipe_kernel(s_ptr, s_desc, u_ptr, la_ptr, rk_ptr, kn_ptr, q_ptr, vn_ptr, bn_ptr,
                     lan_ptr, z_ptr, h_ptr, o_ptr, H, G, V, CAP, NT, NITEMS, NMAT,
                     K: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, LP: tl.constexpr,
                     STAGES: tl.constexpr, TMA: tl.constexpr, FLAT: tl.constexpr,
                     WS: tl.constexpr):
    """``epi`` in a persistent grid whose (item, key chunk) loop nest the compiler pipelines
    (``tl.range(num_stages=STAGES, flatten=FLAT)``): C arrives in ``[BV, KC]`` chunks through
    shared memory (``TMA``: tensor-descriptor loads; else the pipeliner's async copies), so
    the loads of the next item's chunks are in flight, without registers, while this item's
    epilogue runs. ``WS``: the compiler's warp specialisation of the loop."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for i in tl.range(pid, NITEMS, nprog, num_stages=STAGES, flatten=FLAT,
                      warp_specialize=WS):
        it = tl.cast(i, tl.int64)
        mat = it // NT
        vt = it - mat * NT
        b, h, g, rows = _item(mat, vt, H, G, V, BV)
        y0 = tl.zeros([BV], tl.float32)
        y1 = tl.zeros([BV], tl.float32)
        for kc in tl.range(0, K, KC):
            kk = kc + tl.arange(0, KC)
            if TMA:
                C = s_desc.load([(mat * V + vt * BV).to(tl.int32), kc])
            else:
                C = tl.load(s_ptr + (mat * V + rows)[:, None] * K + kk[None, :])
            kn = tl.load(kn_ptr + (b * G + g) * K + kk)
            q = tl.load(q_ptr + (b * G + g) * K + kk)
            y0 += tl.sum(C * kn[None, :], axis=1)
            y1 += tl.sum(C * q[None, :], axis=1)
        hh, ring, la, U, keys = _pre(u_ptr, la_ptr, rk_ptr, h_ptr, b, h, g, rows, H, G, V, CAP,
                                     K, LP, False)
        small = _small(ring, keys, b, h, g, rows, kn_ptr, q_ptr, vn_ptr, bn_ptr, lan_ptr, z_ptr,
                       H, G, V, K, LP, False)
        _finish(y0, y1, hh, ring, la, U, small, b, h, rows, u_ptr, o_ptr, H, V, CAP)


def _pipe_launch(st, var, bv, warps, waves):
    """``pipe|tma``_s{stages}_k{KC}[_flat][_ws]: ``_epi_pipe_kernel`` on ``waves`` programs
    per SM."""
    parts = var.split("_")
    stages = next(int(x[1:]) for x in parts if x.startswith("s"))
    kc = next(int(x[1:]) for x in parts if x.startswith("k"))
    tma = parts[0] == "tma"
    nt = triton.cdiv(V, bv)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 2
    desc = st["S"]
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc = TensorDescriptor.from_tensor(st["S"].view(B * H * V, K), [bv, kc])
    return _epi_pipe_kernel[(min(nsm * waves, B * H * nt),)](
        st["S"], desc, st["U"], st["la"], st["rk"], st["kn"], st["q"], st["vn"], st["bn"],
        st["lan"], st["Z"], st["h"], st["o"], H, G, V, CAP, nt, B * H * nt, B * H, K=K, BV=bv,
        KC=kc, LP=CAP, STAGES=stages, TMA=tma, FLAT="flat" in parts, WS="ws" in parts,
        num_warps=warps)


def make_set(gen, hval):
    f = dict(device=DEV, dtype=torch.float32)
    st = {"S": torch.randn(B, H, V, K, generator=gen, **f) / K ** 0.5,
          "U": torch.randn(B, CAP, H, V, generator=gen, **f),
          "la": -torch.rand(B, CAP, H, generator=gen, **f) * 0.1,
          "rk": torch.nn.functional.normalize(torch.randn(B, CAP, G, K, generator=gen, **f), dim=-1),
          "kn": torch.nn.functional.normalize(torch.randn(B, G, K, generator=gen, **f), dim=-1),
          "q": torch.randn(B, G, K, generator=gen, **f) / K ** 0.5,
          "vn": torch.randn(B, H, V, generator=gen, **f),
          "bn": torch.rand(B, H, generator=gen, **f),
          "lan": -torch.rand(B, H, generator=gen, **f) * 0.1,
          "h": torch.full((B,), hval, device=DEV, dtype=torch.int64),
          "o": torch.empty(B, H, V, **f), "y": torch.empty(B, H, V, 2, **f),
          "E": torch.empty(B, H, V, 2, **f), "gam": torch.empty(B, H, **f)}
    x = torch.stack([st["kn"], st["q"]], dim=-1)  # [B, G, K, 2]
    st["Z"] = torch.einsum("bcgk,bgkx->bgcx", st["rk"], x).contiguous()  # [B, G, CAP, 2]
    st["U0"] = st["U"].clone()
    return st


def reference(st):
    """float64 evaluation of the stand-in formula: (o, new correction)."""
    d = {k: v.double() for k, v in st.items() if v.is_floating_point()}
    hh = int(st["h"][0])
    gi = torch.arange(H, device=DEV) // (H // G)
    kn, q = d["kn"][:, gi], d["q"][:, gi]  # [B, H, K]
    y0 = torch.einsum("bhvk,bhk->bhv", d["S"], kn)
    y1 = torch.einsum("bhvk,bhk->bhv", d["S"], q)
    la = d["la"][:, :hh]  # [B, h, H]
    ctot = la.sum(1) + d["lan"]
    dec = torch.exp(ctot[:, None] - la.cumsum(1))  # [B, h, H]
    z = d["Z"][:, :, :hh][:, gi]  # [B, H, h, 2]
    U = d["U0"][:, :hh]  # [B, h, H, V]
    ek = torch.einsum("bihv,bhi->bhv", U, dec.transpose(1, 2) * z[..., 0])
    eq = torch.einsum("bihv,bhi->bhv", U, dec.transpose(1, 2) * z[..., 1])
    gam = torch.exp(ctot)[..., None]
    un = d["bn"][..., None] * (d["vn"] - gam * y0 - ek)
    o = gam * y1 + eq + un * (kn * q).sum(-1, keepdim=True)
    return o, un


_CUDA = None


def cuda_ext():
    """The CUDA C++ stand-ins (``benchmarks/cuda/step_standin.cu``), built once per process
    (``_cuda_ext.build``; device only; forty-first pass, docs/kernels-replay.md)."""
    global _CUDA
    if _CUDA is None:
        decl = ("void bare(torch::Tensor S, torch::Tensor q, torch::Tensor o, int64_t G, "
                "int64_t nw, bool cs);\n"
                "void read2(torch::Tensor S, torch::Tensor kn, torch::Tensor q, torch::Tensor y, "
                "int64_t G, int64_t nw, bool cs);\n"
                "void epi(torch::Tensor S, torch::Tensor U, torch::Tensor la, torch::Tensor rk, "
                "torch::Tensor kn, torch::Tensor q, torch::Tensor vn, torch::Tensor bn, "
                "torch::Tensor lan, torch::Tensor Z, torch::Tensor h, torch::Tensor o, int64_t G, "
                "int64_t CAP, int64_t nw, bool zin, bool cs, bool cf);\n")
        _CUDA = _cuda_ext.build("replayssm_step_standin", "step_standin.cu", decl,
                                ["bare", "read2", "epi"])
    return _CUDA


def launch_cuda(st, var, warps):
    """``cuda_{bare,read2,epi,epi_z}[_cf][_cs]``: the CUDA stand-in on ``warps`` warps per
    state matrix (``_cs``: C loaded with the streaming cache hint; ``_cf``: epi's C loads
    issued first, before the ring's loads and the key products)."""
    ext = cuda_ext()
    base = var[len("cuda_"):]
    cs = base.endswith("_cs")
    base = base.removesuffix("_cs")
    cf = base.endswith("_cf")
    base = base.removesuffix("_cf")
    if base == "bare":
        return ext.bare(st["S"], st["q"], st["o"], G, warps, cs)
    if base == "read2":
        return ext.read2(st["S"], st["kn"], st["q"], st["y"], G, warps, cs)
    return ext.epi(st["S"], st["U"], st["la"], st["rk"], st["kn"], st["q"], st["vn"], st["bn"],
                   st["lan"], st["Z"], st["h"], st["o"], G, CAP, warps, base == "epi_z", cs, cf)


def launch(st, var, bv, warps, waves=4):
    grid = (B * H, triton.cdiv(V, bv))
    if var.startswith("cuda_"):
        return launch_cuda(st, var, warps)
    if var == "bare":
        return dc._read_kernel[(B * H, triton.cdiv(V, bv))](st["S"], st["q"], st["o"], H, G, V,
                                                             K=K, BV=bv, num_warps=warps)
    if var == "read2":
        return _read2_kernel[grid](st["S"], st["kn"], st["q"], st["y"], H, G, V, B * H, K=K, BV=bv,
                                   num_warps=warps)
    if var.startswith(("pipe", "tma")):
        return _pipe_launch(st, var, bv, warps, waves)
    if var.startswith(("ring", "light")):
        # light[_z][_pdl][_wN]: the ring launch on N warps (default 4), Z formed in it (_z),
        # the stream as its dependent launch (_pdl)
        parts = var.split("_")
        rw = next((int(x[1:]) for x in parts if x.startswith("w")), 4)
        pdl = "pdl" in parts and DEV == "cuda"
        _ring_kernel[(B * H, 1)](st["U"], st["la"], st["rk"], st["kn"], st["q"], st["lan"],
                                 st["Z"], st["h"], st["E"], st["gam"], H, G, V, CAP, K=K, BV=V,
                                 LP=CAP, ZIN="z" in parts, PDL=pdl, num_warps=rw)
        if var.startswith("ring"):
            return None
        extra = dict(PDL=True, launch_pdl=True) if pdl else {}
        return _epi_light_kernel[grid](st["S"], st["U"], st["kn"], st["q"], st["vn"], st["bn"],
                                       st["h"], st["E"], st["gam"], st["o"], H, G, V, CAP,
                                       B * H, K=K, BV=bv, num_warps=warps, **extra)
    args = (st["S"], st["U"], st["la"], st["rk"], st["kn"], st["q"], st["vn"], st["bn"],
            st["lan"], st["Z"], st["h"], st["o"], H, G, V, CAP)
    zin = var.startswith("epi_z")
    early = var.endswith("early")
    if var.endswith("persist"):
        nt = triton.cdiv(V, bv)
        nsm = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 2
        return _epi_persist_kernel[(nsm * waves,)](*args, nt, B * H * nt, B * H, K=K, BV=bv, LP=CAP,
                                                   ZIN=zin, num_warps=warps)
    return _epi_kernel[grid](*args, B * H, K=K, BV=bv, LP=CAP, ZIN=zin, EARLY=early,
                             ULATE=var.endswith("ulate"), num_warps=warps)


def check(st, var, bv, warps, waves):
    st["U"].copy_(st["U0"])
    launch(st, var, bv, warps, waves)
    if DEV == "cuda":
        torch.cuda.synchronize()
    var = var.removeprefix("cuda_").removesuffix("_cs").removesuffix("_cf")
    if var == "bare":
        gi = torch.arange(H, device=DEV) // (H // G)
        want = torch.einsum("bhvk,bhk->bhv", st["S"].double(), st["q"].double()[:, gi])
        got = st["o"].double()
    elif var.startswith("ring"):  # E against the float64 sums of the reference's formula
        d = {k: v.double() for k, v in st.items() if v.is_floating_point()}
        hh = int(st["h"][0])
        gi = torch.arange(H, device=DEV) // (H // G)
        la = d["la"][:, :hh]
        ctot = la.sum(1) + d["lan"]
        dec = torch.exp(ctot[:, None] - la.cumsum(1))
        z = d["Z"][:, :, :hh][:, gi]
        U = d["U0"][:, :hh]
        want = torch.stack([torch.einsum("bihv,bhi->bhv", U, dec.transpose(1, 2) * z[..., c])
                            for c in (0, 1)], -1)
        got = st["E"].double()
        scale = 1e-5 * (1 + d["U0"][:, :max(hh, 1)].abs().amax())
        e = ((got - want).abs() / (scale + 1e-5 * want.abs())).max().item()
        return {"max_err_over_tol": e, "passed": e <= 1}
    elif var == "read2":
        gi = torch.arange(H, device=DEV) // (H // G)
        x = torch.stack([st["kn"], st["q"]], dim=-1).double()[:, gi]  # [B, H, K, 2]
        want = torch.einsum("bhvk,bhkc->bhvc", st["S"].double(), x)
        got = st["y"].double()
    else:
        o, un = reference(st)
        hh = int(st["h"][0])
        err_u = ((st["U"][:, hh].double() - un).abs() / (1e-5 + 1e-5 * un.abs())).max().item()
        got, want = st["o"].double(), o
        err_o = ((got - want).abs() / (1e-5 + 1e-5 * want.abs())).max().item()
        return {"max_err_over_tol": max(err_u, err_o), "passed": max(err_u, err_o) <= 1}
    e = ((got - want).abs() / (1e-5 + 1e-5 * want.abs())).max().item()
    return {"max_err_over_tol": e, "passed": e <= 1}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hs", type=int, nargs="+", default=[0, 7, 14])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--pool", type=int, default=2)
    ap.add_argument("--waves", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--set", default="all",
                    choices=("all", "early", "light", "ulate", "pipe", "cuda"),
                    help="all: the first run's variants (bare, read2, epi, epi_z, persistent); "
                         "early: bare, read2, epi and epi_z with and without their small "
                         "operands before the stream; light: the ring's sums in a launch "
                         "of their own before the stream (ring), then read2 with an "
                         "elementwise epilogue (light = both launches; *_z: Z formed in the "
                         "ring launch; *_pdl: the stream as a dependent launch; *_wN: the "
                         "ring launch on N warps); ulate: epi with the ring's la and U "
                         "loaded after the stream instead of before; pipe: epi in a "
                         "persistent grid whose (item, key chunk) loop the compiler "
                         "pipelines through shared memory (pipe_*: async copies, tma_*: "
                         "tensor descriptors; _sN stages, _kN key chunk, _flat: the loop "
                         "nest flattened, _ws: warp specialised; --waves programs per SM); "
                         "cuda: the CUDA C++ stand-ins (benchmarks/cuda/step_standin.cu: "
                         "cuda_{bare,read2,epi,epi_z}[_cs] and cuda_{epi,epi_z}_cf[_cs] on 4 "
                         "and 8 warps per matrix) "
                         "beside the Triton bare, read2, epi and epi_z")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU under the Triton interpreter: a small shape, checks only")
    a = ap.parse_args()
    if a.tiny:
        global B, H, G, V, K
        B, H, G, V, K = 2, 4, 2, 64, 32
    torch.manual_seed(0)
    gen = torch.Generator(device=DEV).manual_seed(0)
    cases = [("bare", 32, 4, None), ("read2", 64, 2, None), ("read2", 32, 4, None),
             ("epi", 64, 2, None), ("epi", 32, 2, None), ("epi", 32, 4, None),
             ("epi_z", 64, 2, None), ("epi_z", 32, 2, None)]
    if a.set == "early":
        cases = [("bare", 32, 4, None), ("read2", 64, 2, None), ("epi", 64, 2, None),
                 ("epi_z", 64, 2, None)] + [
            (v, bv, w, None) for v in ("epi_early", "epi_z_early")
            for bv, w in ((64, 2), (32, 2), (32, 1), (64, 4))]
    if a.set == "ulate":
        cases = [("bare", 32, 4, None), ("read2", 64, 2, None)] + [
            (v, bv, w, None) for v in ("epi", "epi_ulate")
            for bv, w in ((64, 2), (32, 2), (32, 4), (64, 4))]
    if a.set == "light":
        cases = [("bare", 32, 4, None), ("read2", 64, 2, None), ("read2", 32, 4, None),
                 ("epi", 64, 2, None)] + [
            (f"ring{z}{w}", 64, 2, None) for z in ("", "_z") for w in ("", "_w1", "_w2")] + [
            (f"light{z}{p}{w}", bv, nw, None) for z in ("", "_z") for p in ("", "_pdl")
            for w in ("_w1", "_w2") for bv, nw in ((64, 2), (128, 4))]
    if a.set == "pipe":
        cases = [("bare", 32, 4, None), ("read2", 64, 2, None), ("epi", 64, 2, None)] + [
            (f"{kind}_s{s}_k{kc}{fl}", bv, nw, w)
            for kind in ("pipe", "tma") for fl in ("_flat", "")
            for s, kc in ((3, 32), (4, 32), (3, 64))
            for bv, nw in ((64, 4), (128, 4), (64, 2)) for w in a.waves] + [
            ("tma_s3_k32_flat_ws", 64, 4, w) for w in a.waves]
        # a TMA tile must not span two matrices, a key chunk not two rows
        cases = [c for c in cases if c[1] <= V and "_k64" not in c[0] or K >= 64]
    if a.set == "cuda":
        cases = [("bare", 32, 4, None), ("read2", 64, 2, None), ("epi", 64, 2, None),
                 ("epi_z", 64, 2, None)] + [
            (f"cuda_{v}{c}", V, w, None) for v in ("bare", "read2", "epi", "epi_z", "epi_cf",
                                                   "epi_z_cf")
            for c in ("", "_cs") for w in (4, 8)]
        if DEV != "cuda":
            cases = cases[:4]
    for w in (a.waves if a.set == "all" else []):
        cases += [("epi_persist", 64, 2, w), ("epi_persist", 32, 2, w), ("epi_persist", 32, 4, w),
                  ("epi_z_persist", 64, 2, w), ("epi_z_persist", 32, 2, w)]
    rows = []
    for hv in a.hs:
        sets = [make_set(gen, hv) for _ in range(a.pool)]
        for var, bv, warps, waves in cases:
            row = {"h": hv, "variant": var, "block_v": bv, "num_warps": warps, "waves": waves}
            try:
                row["check"] = check(sets[0], var, bv, warps, waves)
                if a.tiny:
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                r = dc.timer(lambda i: launch(sets[i], var, bv, warps, waves or 4), a.pool,
                             a.reps, 3, mode="graph")
                row.update(median_us=r["median_us"], min_us=r["min_us"], timing=r["timing"])
            except Exception as err:  # noqa: BLE001  (a variant that fails to compile)
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        sets = None
        if DEV == "cuda":
            torch.cuda.empty_cache()
    out = {"command": " ".join(sys.argv),
           "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (interpreter)",
           "versions": {"torch": torch.__version__, "triton": triton.__version__},
           "code_commit": code_commit(), "shape": dict(B=B, H=H, G=G, V=V, K=K,
                                                                        CAP=CAP), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
