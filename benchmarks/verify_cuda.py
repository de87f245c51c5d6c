"""GDN verify of T = 8 drafts as one CUDA C++ kernel with the products on the tensor cores
(``replayssm_quant/kernels/replay/gdn_verify.cu``, built here with every launch variant;
issue 15, forty-second and forty-third passes), against the shipped Triton verify and the
shipped step.

The verify target is <= 1.3x a standard non-flush step; the shipped kernel reaches 2.38x on
the H200 (``decode_h200.json`` at 5037ba1). Its time is not DRAM time: one program per
(sequence, value head, row block) at 12 % occupancy and 255 registers runs the key
products, the coefficients, the solve and the epilogue in series with the stream of R.
The CUDA kernel loads R's rows straight into ``mma.sync`` fragments (3xTF32, FP32
accumulation: the shipped kernel's ``tf32x3`` class of accuracy), forms the ring keys'
products as one more m-tile, and solves one value row per thread, at 80-104 registers (3-6
CTAs per SM, by variant), so that one CTA's chain runs beside other CTAs' streams. It covers
the ``fp32`` policy's verify (read copy = anchor, FP32, cached corrections folded: what the
decode state runs), DK = DV = 128, T <= 8, J <= 16; the library runs it under
backend="cuda" (cuda_verify.py). On the H100
(744aff1) its best variant ran at 1.32x the step against the shipped kernel's 1.89x
(docs/kernels-replay.md, "Forty-second pass").

On ``decode.py``'s GDN geometry at B = 256 (4 rotated FP32 sets, CUDA-graph medians,
``decode.timer``): for each start h = 0..L-T the shipped ``gdn_verify_kernel`` and each CUDA
variant (``nw``: warps a CTA, ``pf``: units of R loaded ahead, ``mb``: CTAs per SM asked of
ptxas, ``ep``: where the epilogue's ring operands are loaded, see ``VARIANTS``); the
shipped step at h = 0..L-2 (its mean is the target's denominator); a bare read of the state
(``decode.read_pass``). Checks at every h, at per-sequence starts, and with T = 3 drafts on
a 12-slot ring: outputs and corrections of every variant against a float64 ``gdn_verify``
of the first ``--ref-seqs`` sequences (``1e-5 + 1e-5 |ref|``, as ``decode.py``), against the
shipped kernel on all sequences (max abs difference), batch invariance (the first 8
sequences alone, and the batch reversed, give the same bits), and the library's wrapper
``gdn_verify_cuda`` on the first J slots of a longer ring (a decode state's layout), and in
place there (``out=u_known``, as the decode state runs it), giving the same bits as the bare
call. Timed besides: the library's wrapper (``library``) and its in-place form
(``library_in_place``: corrections written only from the start on).

Usage (device; nvcc and ninja, as the lent image has)::

    python3 benchmarks/verify_cuda.py --out $OUT/verify_cuda.json
    python3 benchmarks/verify_cuda.py --variants nw8_pf3_mb0_cpa,nw4_pf3_mb0 --out ...
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

from replayssm_quant.config import GDNFold  # noqa: E402
from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.kernels.replay import cuda_verify as cv  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.replay import gdn_verify  # noqa: E402

# (warps, units ahead, CTAs per SM asked of ptxas, where the epilogue's ring operands load:
# 0 late into registers, 1 early into registers, 2 by cp.async into shared memory)
VARIANTS = ([(4, 3, 0, 0), (4, 4, 5, 0), (4, 3, 6, 0), (4, 2, 6, 0)]
            + [(4, pf, 0, 2) for pf in (3, 4)] + [(4, 3, 6, 2)]
            + [(8, 3, 3, 0), (8, 3, 0, 2), (8, 4, 0, 2)]
            # 64 registers, 4 CTAs of 8 warps an SM (ptxas spills 12-16 bytes, outside the
            # stream's loop in the static SASS): nw8_pf2_mb4_cpa 279.7 us on the H100 at
            # 9faf565, fastest at h = 0..7, against 278.9 for the default
            + [(8, 2, 4, 2), (8, 2, 0, 2)])
LAUNCH = cv.LAUNCH
T_MAX, J_MAX, DIM = cv.T_MAX, cv.J_MAX, cv.DIM
decomposition = cv.decomposition  # the kernel's formula in torch (the CPU oracle)


#: build every variant of LAUNCH (False when the variants asked are all in the library's
#: build, LIBRARY_VARIANTS: one short build, shared with the library's own)
ALL = True


def ext():
    """The CUDA kernel with every variant of ``LAUNCH`` (or the library's, ``ALL``), built once
    per process for the device's architecture (``cuda_verify.build``)."""
    return cv.build(all_variants=ALL)


def check_args(R, la, beta, v, k, q, uk, start, nw, pf, mb, ep=0):
    """The kernel's preconditions, checked here (a failed check in nvcc-compiled host code
    took the process down in the forty-first pass): shapes, then ranges (T <= 8, J <= 16,
    0 <= start <= J - T, the launch variant), then dtypes and device. Raises ValueError
    naming the input."""
    if not isinstance(R, torch.Tensor) or R.dim() != 4 or tuple(R.shape[2:]) != (DIM, DIM):
        raise ValueError(f"R must be [B, H, {DIM}, {DIM}], got "
                         f"{tuple(R.shape) if isinstance(R, torch.Tensor) else type(R)}")
    B, H = R.shape[:2]
    J = la.shape[1] if la.dim() == 3 else -1
    T = q.shape[1] if q.dim() == 4 else -1
    G = k.shape[2] if k.dim() == 4 else -1
    ins = {"la": la, "beta": beta, "v": v, "k": k, "q": q, "uk": uk}
    want = {"la": (B, J, H), "beta": (B, J, H), "v": (B, J, H, DIM), "k": (B, J, G, DIM),
            "q": (B, T, G, DIM), "uk": (B, J, H, DIM)}
    for name, t in ins.items():
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]} (from R, la, k and q), got "
                             f"{tuple(t.shape)}")
    if G < 1 or H % G:
        raise ValueError(f"key heads G={G} must divide value heads H={H}")
    if not 1 <= T <= T_MAX:
        raise ValueError(f"T (drafts) must be in 1..{T_MAX}, got {T}")
    if not 1 <= J <= J_MAX:
        raise ValueError(f"J (ring slots) must be in 1..{J_MAX}, got {J}")
    if start.dtype != torch.int64 or tuple(start.shape) != (B,):
        raise ValueError(f"start must be int64 [{B}], got {start.dtype} {tuple(start.shape)}")
    if bool(((start < 0) | (start + T > J)).any()):
        raise ValueError(f"start must be in 0..J-T = 0..{J - T}, got {start.tolist()}")
    if nw not in LAUNCH:
        raise ValueError(f"nw must be one of {tuple(LAUNCH)}, got {nw}")
    if ep not in (0, 1, 2):
        raise ValueError(f"ep must be 0, 1 or 2, got {ep}")
    for name, val in (("pf", pf), ("mb", mb)):
        if val not in LAUNCH[nw][name]:
            raise ValueError(f"{name} must be one of {LAUNCH[nw][name]} with nw={nw}, "
                             f"got {val}")
    for name, t in {"R": R, **ins}.items():
        if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cuda:
            raise ValueError(f"{name} must be a contiguous float32 CUDA tensor, got "
                             f"{t.dtype}, contiguous={t.is_contiguous()}, {t.device}")
        if t.data_ptr() % 16:  # the kernel's float4 loads and cp.async
            raise ValueError(f"{name} must start on a 16-byte boundary (a view at an offset "
                             f"of a multiple of 4 floats), got address {t.data_ptr():#x}")
    if start.device != R.device or not start.is_contiguous():
        raise ValueError(f"start must be contiguous on {R.device}, got {start.device}, "
                         f"contiguous={start.is_contiguous()}")


def cuda_verify(mod, R, la, beta, v, k, q, uk, start, nw=4, pf=3, mb=0, ep=0, out=None,
                check=True):
    """``(o [B, T, H, V], uR [B, J, H, V])`` of the CUDA kernel (``out``: preallocated pair;
    ``nw, pf, mb, ep``: the kernel's template parameters NW, PF, MB, EP)."""
    if check:
        check_args(R, la, beta, v, k, q, uk, start, nw, pf, mb, ep)
        if out is not None:
            want = ((R.shape[0], q.shape[1], R.shape[1], DIM), (R.shape[0], la.shape[1],
                                                               R.shape[1], DIM))
            for name, t, w in (("o", out[0], want[0]), ("uR", out[1], want[1])):
                if tuple(t.shape) != w or t.dtype != torch.float32 or not t.is_contiguous() \
                        or t.device != R.device:
                    raise ValueError(f"out {name} must be a contiguous float32 {w} tensor on "
                                     f"{R.device}, got {t.dtype} {tuple(t.shape)} {t.device}")
    B, H, J, T = R.shape[0], R.shape[1], la.shape[1], q.shape[1]
    o, u = out if out is not None else (
        torch.empty(B, T, H, DIM, device=R.device), torch.empty(B, J, H, DIM, device=R.device))
    mod.gdn_verify_cuda(R, la, beta, v, k, q, uk, start, o, u, 1, nw, pf, mb, ep)
    return o, u


def label(var):
    nw, pf, mb, ep = var
    return f"nw{nw}_pf{pf}_mb{mb}{('', '_ep', '_cpa')[ep]}"


def _inputs(st):
    r = st["ring"]
    return (st["R"], r["la"], r["beta"], r["v"], r["k"], st["qT"], r["uR"])


def _sel(args, idx):
    return tuple(t[idx].contiguous() for t in args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ref-seqs", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", help="comma-separated labels of VARIANTS to run (default all), "
                    "e.g. nw8_pf3_mb0_cpa,nw4_pf3_mb0")
    ap.add_argument("--profile", metavar="NW,PF,MB,EP",
                    help="only run this variant 3 times at h = 4 (for ncu), e.g. 4,3,0,1")
    a = ap.parse_args(argv)
    global VARIANTS, ALL
    if a.variants:
        by = {label(v): v for v in VARIANTS}
        bad = [x for x in a.variants.split(",") if x not in by]
        if bad:
            ap.error(f"--variants: unknown {bad}; known: {sorted(by)}")
        VARIANTS = [by[x] for x in a.variants.split(",")]
        ALL = any(v not in cv.LIBRARY_VARIANTS for v in VARIANTS)
    if not torch.cuda.is_available():
        raise SystemExit("verify_cuda.py times CUDA launches; run it on the device")
    mod = ext()
    T, L, B = 8, 16, 256
    M = rk.Model("gdn", B, 32, 16, DIM, DIM, L)
    pol = StatePolicy.parse("fp32")
    gen = torch.Generator(device="cuda").manual_seed(11)
    pool = [dc.make_set(M, gen, pol, T, False) for _ in range(4)]
    assert pool[0]["fold"] is GDNFold.CACHED and pool[0]["R"] is pool[0]["A"]
    outs = [(torch.empty(B, T, M.H, DIM, device="cuda"), torch.empty(B, L, M.H, DIM,
                                                                     device="cuda"))
            for _ in pool]
    scratch = [st["ring"]["uR"].clone() for st in pool]  # out= of "library_in_place"
    res = {"command": "python3 " + " ".join([sys.argv[0]] + sys.argv[1:]),
           "code_commit": code_commit(), "device": torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
           "timing": "CUDA graph medians, decode.timer, 4 sets rotated",
           "shape": dict(B=B, H=M.H, G=M.G, V=M.V, K=M.K, L=L, T=T),
           "checks": {}, "rows": []}
    st0 = pool[0]
    args0 = _inputs(st0)
    if a.profile:
        var = tuple(int(x) for x in a.profile.split(","))
        if len(var) != 4:
            raise SystemExit(f"--profile takes NW,PF,MB,EP, got {a.profile!r}")
        start = torch.full((B,), 4, dtype=torch.int64, device="cuda")
        for _ in range(3):
            cuda_verify(mod, *args0, start, *var)
        torch.cuda.synchronize()
        return
    nref = min(a.ref_seqs, B)
    ok = True
    def check_case(args, start, J):
        """Every variant on ``args`` (R, la, beta, v, k, q, uk) at ``start`` against float64
        ``gdn_verify`` (first ``nref`` sequences), the shipped kernel (all) and itself on the
        first 8 sequences alone and on the batch reversed (the same bits)."""
        R_, la_, beta_, v_, k_, q_, uk_ = args
        o_tr, u_tr = kr.gdn_verify_kernel(R_, R_, la_, beta_, v_, k_, q_, uk_, start, J, True)
        Rd, lad, bd, vd, kd, qd, ud = (t[:nref].double() for t in args)
        ref = gdn_verify(Rd, Rd, lad, bd, vd, kd, qd, ud, start[:nref], J, GDNFold.CACHED)
        chk = {"shipped": {"outputs": dc.stats(o_tr[:nref], ref[0]),
                           "corrections": dc.stats(u_tr[:nref], ref[1])}}
        rev = torch.arange(B - 1, -1, -1, device="cuda")
        # the ring tensors as the first J slots of a ring of J + 4 (a decode state's layout,
        # through the library's wrapper): la, beta, v, k, uk
        ring = []
        for t in (la_, beta_, v_, k_, uk_):
            big = torch.full((t.shape[0], J + 4, *t.shape[2:]), float("nan"), device="cuda")
            big[:, :J] = t
            ring.append(big[:, :J])
        for var in VARIANTS:
            o, u = cuda_verify(mod, *args, start, *var)
            nw, pf, mb, ep = var
            ol, ul = cv.gdn_verify_cuda(R_, R_, *ring[:4], q_, ring[4], start, J, True, nw=nw,
                                        pf=pf, mb=mb, ep=ep, all_variants=ALL,
                                        fallback=False)
            # in place in the ring's correction slots (out=u_known, as the decode state runs)
            big = torch.full((B, J + 4, M.H, DIM), float("nan"), device="cuda")
            big[:, :J] = uk_
            oi, ui = cv.gdn_verify_cuda(R_, R_, *ring[:4], q_, big[:, :J], start, J, True,
                                        out=big[:, :J], nw=nw, pf=pf, mb=mb, ep=ep,
                                        all_variants=ALL, fallback=False)
            o8, u8 = cuda_verify(mod, *_sel(args, slice(0, 8)), start[:8].contiguous(), *var)
            orv, urv = cuda_verify(mod, *_sel(args, rev), start[rev].contiguous(), *var)
            c = {"outputs": dc.stats(o[:nref], ref[0]),
                 "corrections": dc.stats(u[:nref], ref[1]),
                 "max_abs_vs_shipped": {"outputs": float((o - o_tr).abs().max()),
                                        "corrections": float((u - u_tr).abs().max())},
                 "batch_invariant": bool(torch.equal(o8, o[:8]) and torch.equal(u8, u[:8])
                                         and torch.equal(orv, o[rev])
                                         and torch.equal(urv, u[rev])),
                 "ring_slices_same_bits": bool(torch.equal(ol, o) and torch.equal(ul, u)),
                 "in_place_same_bits": bool(torch.equal(oi, o) and torch.equal(ui, u)
                                            and big[:, J:].isnan().all())}
            c["passed"] = (c["outputs"]["passed"] and c["corrections"]["passed"]
                           and c["batch_invariant"] and c["ring_slices_same_bits"]
                           and c["in_place_same_bits"])
            chk[label(var)] = c
        return chk

    cases = [(f"h{h}", args0, torch.full((B,), h, dtype=torch.int64, device="cuda"), L)
             for h in range(L - T + 1)]
    # per-sequence starts (every start in the first L - T + 1 sequences); and T = 3 drafts on
    # a ring of J = 12 slots (zero X columns, fewer slots), starts mixed likewise
    cases.append(("mixed", args0, torch.arange(B, device="cuda") % (L - T + 1), L))
    small = (args0[0], *(t[:, :12].contiguous() for t in args0[1:5]),
             args0[5][:, :3].contiguous(), args0[6][:, :12].contiguous())
    cases.append(("T3_J12_mixed", small, torch.arange(B, device="cuda") % 10, 12))
    for name, args, start, J in cases:
        chk = check_case(args, start, J)
        ok &= all(c["passed"] for k_, c in chk.items() if k_ != "shipped")
        res["checks"][name] = chk
        cuda = [c for k_, c in chk.items() if k_ != "shipped"]
        print(f"{name} shipped passed {chk['shipped']['outputs']['passed']} "
              f"{chk['shipped']['corrections']['passed']}; cuda variants passed "
              f"{sum(c['passed'] for c in cuda)}/{len(cuda)}; max abs vs shipped "
              f"{max(c['max_abs_vs_shipped']['outputs'] for c in cuda):.2e} (outputs) "
              f"{max(c['max_abs_vs_shipped']['corrections'] for c in cuda):.2e} (corrections)",
              flush=True)
    res["checks_passed"] = ok

    def tm(fn):
        return round(dc.timer(fn, len(pool), a.reps, 3, mode="graph")["median_us"], 1)

    for rnd in range(a.rounds):
        row = {"round": rnd, "verify": {}, "step": {}}
        row["read_only_us"] = tm(lambda i: dc.read_pass(pool[i]["S"], pool[i]["q"]))
        for h in range(L - T + 1):
            start = torch.full((B,), h, dtype=torch.int64, device="cuda")
            v = row["verify"][f"h{h}"] = {
                "shipped": tm(lambda i, s=start: dc.run_verify(M, pool[i], s)),
                # the library's path (backend="cuda"): gdn_verify_cuda's checks and the
                # allocations included, as they are in "shipped" (its range assertion is in
                # the kernel since fc2ec4d; "shipped" launches its own)
                "library": tm(lambda i, s=start: kr.gdn_verify_cuda(
                    pool[i]["R"], pool[i]["R"], *_inputs(pool[i])[1:], s, L, True)),
                # the decode state's form: the corrections written into the ring's slots from
                # the start on (out=; here into a copy of the ring's, so the inputs stay)
                "library_in_place": tm(lambda i, s=start: kr.gdn_verify_cuda(
                    pool[i]["R"], pool[i]["R"], *_inputs(pool[i])[1:], s, L, True,
                    out=scratch[i]))}
            for var in VARIANTS:
                v[label(var)] = tm(
                    lambda i, s=start, var=var: cuda_verify(
                        mod, *_inputs(pool[i]), s, *var, out=outs[i],
                        check=False))
            print(f"verify h{h}", json.dumps(v), flush=True)
        for h in range(L - 1):
            start = torch.full((B,), h, dtype=torch.int64, device="cuda")
            row["step"][f"h{h}"] = tm(lambda i, s=start: dc.run_step(M, pool[i], s))
        row["step_mean_us"] = round(statistics.mean(row["step"].values()), 1)
        keys = row["verify"]["h0"].keys()
        row["verify_max_us"] = {k: max(v[k] for v in row["verify"].values()) for k in keys}
        row["verify_max_vs_step"] = {k: round(x / row["step_mean_us"], 3)
                                     for k, x in row["verify_max_us"].items()}
        best = min((k_ for k_ in keys if k_ not in ("shipped", "library", "library_in_place")),
                   key=row["verify_max_us"].get)
        row["best_cuda"] = {"variant": best, "verify_max_us": row["verify_max_us"][best],
                            "verify_max_vs_step": row["verify_max_vs_step"][best]}
        res["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("read_only_us", "step_mean_us", "verify_max_us",
                                              "verify_max_vs_step", "best_cuda")}), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
