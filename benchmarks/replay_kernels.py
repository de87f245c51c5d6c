"""Check the ReplaySSM Triton kernels against their torch references at a serving shape, and
time the decode step (per read format), the flush and a conventional FP32 eager step.

Shapes (DESIGN.md section 6): GDN B=256, 16 key heads, 32 value heads, 128 x 128 state;
Mamba-2 B=256, 128 heads, 1 group, P=64, N=128; window L=16. Float32 records.

(a) Correctness, per read format (fp32, fp16, fp8e4m3, nvfp4): the decode step with h drawn
    per sequence in [0, L-2] (outputs; GDN also the new correction), verify with T=3 drafts
    (some on the flush slot), and the flush (``read:F/rec:fp32`` and ``read:F+sr/rec:fp16+sr``):
    the kernel's S against :func:`core.reconstruct`, and A/R bits against the reference cast of
    the kernel's S (must be 0) and against the reference flush's own casts (last-bit flips of S
    can move a rounding: reported, not required to be 0). The flush reference runs on the
    first ``--ref-seqs`` sequences only (it is batch-independent: streams are keyed by
    sequence id). References run in torch on the same GPU (quantizers forced to the torch
    reference with REPLAYSSM_BACKEND=torch; the kernels' inputs are packed with backend="triton").
(b) Timing (``triton.testing.do_bench``, median): the non-flush decode step kernel (append +
    correction + output-only read of R) at h = 0, 7 and 14 committed records; the flush
    (``read:F/rec:fp32``: reads the FP32 anchor, writes A and R, outputs the flush token's
    S q; GDN: plus the correction-solve kernel); the conventional FP32 eager step as a simple
    Triton kernel (read S, update, write S, output) and in plain torch; and a read-only pass
    (the step kernel at h = 0 with an FP32 read copy is one).

Usage::

    python benchmarks/replay_kernels.py --out results.json
    TRITON_INTERPRET=1 python benchmarks/replay_kernels.py --small --out /tmp/x.json  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback

from _commit import code_commit, git_commit  # noqa: F401  (decode.py, chain_tune.py: rk.*)

os.environ.setdefault("REPLAYSSM_BACKEND", "torch")  # references: torch quantizers

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.capabilities import triton_interpreting  # noqa: E402
from replayssm_quant.quant import PackedTensor, pack  # noqa: E402
from replayssm_quant.replay import (core, gdn_flush, gdn_step_output, gdn_verify,  # noqa: E402
                                    mamba2_flush, mamba2_step_output, mamba2_verify)

READ_FORMATS = ["fp32", "fp16", "fp8e4m3", "nvfp4"]
VERIFY_FORMATS = ["fp32", "nvfp4"]
# flush policies checked (and timed), per read format; the anchor input is FP32 in all of them
FLUSH_POLICIES = {"fp32": ["fp32"], "fp16": ["read:fp16/rec:fp32"],
                  "fp8e4m3": ["read:fp8e4m3/rec:fp32"],
                  "nvfp4": ["read:nvfp4/rec:fp32", "read:nvfp4+sr/rec:fp16+sr"]}
SEED = 0x1234_5678_9ABC
INTERPRET = triton_interpreting()
DEV = "cpu" if INTERPRET else "cuda"


# ------------------------------------------------------------------------------ eager baselines
@triton.jit
def _eager_kernel(s_ptr, k_ptr, q_ptr, v_ptr, la_ptr, beta_ptr, o_ptr, H, G, V,
                  K: tl.constexpr, BV: tl.constexpr, GDN: tl.constexpr):
    """Conventional FP32 decode step, one program per (sequence, head, BV value rows):
    Mamba-2 S' = a S + v k^T; GDN u = beta (v - a S k), S' = a S + u k^T; o = S' q; S stored."""
    mat = tl.program_id(0).to(tl.int64)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    rows = tl.program_id(1) * BV + tl.arange(0, BV)
    rm = rows < V
    kk = tl.arange(0, K)
    ptr = s_ptr + (mat * V + rows)[:, None] * K + kk[None, :]
    S = tl.load(ptr, mask=rm[:, None], other=0.0)
    k = tl.load(k_ptr + (b * G + g) * K + kk)
    q = tl.load(q_ptr + (b * G + g) * K + kk)
    v = tl.load(v_ptr + mat * V + rows, mask=rm, other=0.0)
    a = tl.exp(tl.load(la_ptr + mat))
    if GDN:
        u = tl.load(beta_ptr + mat) * (v - a * tl.sum(S * k[None, :], axis=1))
    else:
        u = v
    S = a * S + u[:, None] * k[None, :]
    tl.store(ptr, S, mask=rm[:, None])
    tl.store(o_ptr + mat * V + rows, tl.sum(S * q[None, :], axis=1), mask=rm)


def eager_triton(S, k, q, v, la, beta, gdn, bv=32):
    B, H, V, K = S.shape
    o = torch.empty(B, H, V, device=S.device)
    _eager_kernel[(B * H, triton.cdiv(V, bv))](S, k, q, v, la, beta, o, H, k.shape[1], V, K=K,
                                                BV=bv, GDN=gdn)
    return o


def eager_torch(S, k, q, v, la, beta, gdn):
    """The simplest torch FP32 step (in place on S)."""
    H = S.shape[1]
    ke, qe = core.expand_heads(k, H, 1), core.expand_heads(q, H, 1)
    a = torch.exp(la)[..., None]
    u = beta[..., None] * (v - a * core.matvec(S, ke)) if gdn else v
    S.mul_(a[..., None]).add_(u[..., :, None] * ke[..., None, :])
    return core.matvec(S, qe)


# ------------------------------------------------------------------------------ helpers
def bench(fn, warmup=10, rep=40):
    if INTERPRET:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def stats(got, want, atol=1e-5, rtol=1e-5):
    got, want = got.double(), want.double()
    d = (got - want).abs()
    return {"max_abs": float(d.max()), "rel_fro": float(d.norm() / want.norm().clamp_min(1e-30)),
            "mismatch": int((d > atol + rtol * want.abs()).sum()), "n": want.numel(),
            "nan": int(torch.isnan(got).sum())}


def bit_mismatch(a, b):
    a, b = a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    return int((a != b).sum())


def stored(S, fmt, stream):
    return S if fmt == "fp32" else pack(S, fmt, seed=SEED, stream=stream, backend="triton")


def nbytes(st):
    return st.nbytes if isinstance(st, PackedTensor) else st.numel() * st.element_size()


class Model:
    def __init__(self, name, B, H, G, V, K, L):
        self.name, self.B, self.H, self.G, self.V, self.K, self.L = name, B, H, G, V, K, L
        self.gdn = name == "gdn"
        self.cap = L + 3

    def records(self, gen, J):
        B, H, G, V, K = self.B, self.H, self.G, self.V, self.K
        la = torch.log(0.9 + 0.0999 * torch.rand(B, J, H, generator=gen, device=DEV))
        k = torch.randn(B, J, G, K, generator=gen, device=DEV)
        k = torch.nn.functional.normalize(k, dim=-1) if self.gdn else k / K ** 0.5
        w = torch.randn(B, J, H, V, generator=gen, device=DEV)
        beta = torch.sigmoid(torch.randn(B, J, H, generator=gen, device=DEV))
        return la, w, k, beta

    def query(self, gen, T=None):
        shape = (self.B, self.G, self.K) if T is None else (self.B, T, self.G, self.K)
        q = torch.randn(*shape, generator=gen, device=DEV)
        return torch.nn.functional.normalize(q, dim=-1) * self.K ** -0.5

    def state(self, gen):
        scale = 0.3 if self.gdn else 1.0
        return torch.randn(self.B, self.H, self.V, self.K, generator=gen, device=DEV) * scale


# ------------------------------------------------------------------------------ checks
def check_step(M, gen, fmt, streams, res):
    S = M.state(gen)
    R_st = stored(S, fmt, streams)
    R = R_st if fmt == "fp32" else R_st.dequantize()
    la, w, k, beta = M.records(gen, M.cap)
    ring = {"la": la, "v": w.clone(), "k": k}
    if M.gdn:
        ring.update(beta=beta, uR=torch.randn_like(w))
    h = torch.randint(0, M.L - 1, (M.B,), generator=gen, device=DEV)
    nla, nv, nk, nbeta = (t[:, 0] for t in M.records(gen, 1))
    q = M.query(gen)
    ref = {n: t.clone() for n, t in ring.items()}
    b = torch.arange(M.B, device=DEV)
    new = {"la": nla, "v": nv, "k": nk, "beta": nbeta}
    for n in ref:
        if n in new:
            ref[n][b, h] = new[n]
    J = int(h.max()) + 1
    if M.gdn:
        want, uR = gdn_step_output(R, ref["la"][:, :J], ref["beta"][:, :J], ref["v"][:, :J],
                                   ref["k"][:, :J], q, ref["uR"][:, :J], h + 1)
        got = kr.gdn_step_kernel(R_st, ring, q, nk, nv, nla, nbeta, h)
        res["u_new"] = stats(ring["uR"][b, h], uR[b, h])
    else:
        want = mamba2_step_output(R, ref["la"][:, :J], ref["v"][:, :J], ref["k"][:, :J], q, h + 1)
        got = kr.mamba2_step_kernel(R_st, ring, nla, nv, nk, q, h)
    res["output"] = stats(got, want)
    res["ring_append_exact"] = all(torch.equal(ring[n], ref[n]) for n in ring if n != "uR")


def check_verify(M, gen, fmt, streams, res):
    T = 3
    S = M.state(gen)
    R_st = stored(S, fmt, streams)
    R = R_st if fmt == "fp32" else R_st.dequantize()
    A = M.state(gen)
    la, w, k, beta = M.records(gen, M.cap)
    u = torch.randn_like(w)
    start = torch.randint(0, M.L - T + 1, (M.B,), generator=gen, device=DEV)
    q = M.query(gen, T)
    J = int(start.max()) + T
    if M.gdn:
        args = (la[:, :J], beta[:, :J], w[:, :J], k[:, :J], q, u[:, :J], start, M.L)
        want, uw = gdn_verify(R, A, *args)
        got, ug = kr.gdn_verify_kernel(R_st, A, *args)
        res["u_drafts"] = stats(ug, uw)
    else:
        args = (la[:, :J], w[:, :J], k[:, :J], q, start, M.L)
        want = mamba2_verify(R, A, *args)
        got = kr.mamba2_verify_kernel(R_st, A, *args)
    res["outputs"] = stats(got, want)
    res["drafts_on_flush_slot"] = int((start + T == M.L).sum())


def check_flush(M, gen, policy, n_ref, res):
    A = M.state(gen)
    la, w, k, beta = M.records(gen, M.L)
    length = torch.full((M.B,), M.L, dtype=torch.int64, device=DEV)
    length[1::2] = torch.randint(1, M.L + 1, (M.B // 2,), generator=gen, device=DEV)
    sid = torch.arange(M.B, device=DEV) * 3 + 1
    fi = torch.arange(M.B, device=DEV) % 7 + 1
    kw = dict(seed=SEED, layer=2, sequence_ids=sid, flush_index=fi)
    policy = StatePolicy.parse(policy)
    if M.gdn:  # the fused flush, as timed below (split_casts=False)
        out, _ = kr.gdn_flush_kernel(A, la, beta, w, k, length, policy, split_casts=False, **kw)
    else:
        out, _ = kr.mamba2_flush_kernel(A, la, w, k, length, policy, split_casts=False, **kw)
    s = slice(0, n_ref)
    kws = dict(seed=SEED, layer=2, sequence_ids=sid[s], flush_index=fi[s])
    if M.gdn:
        ref = gdn_flush(A[s], la[s], beta[s], w[s], k[s], policy, length=length[s], store=True,
                        **kws)
        live = core.length_mask(length[s], M.L)[:, :, None, None]
        res["corrections"] = stats(torch.where(live, out.w[s], 0.0), torch.where(live, ref.w, 0.0))
    else:
        ref = mamba2_flush(A[s], la[s], w[s], k[s], policy, length=length[s], store=True, **kws)
    res["state"] = stats(out.state[s], ref.state, atol=1e-6, rtol=1e-6)
    own = core.cast_checkpoints(out.state[s], policy, store=True, **kws)
    cp = out.checkpoints
    res["anchor_bits_vs_cast_of_kernel_S"] = bit_mismatch(cp.anchor[s], own.anchor)
    res["read_bits_vs_cast_of_kernel_S"] = bit_mismatch(cp.read[s], own.read)
    # against the reference flush's own casts: S differs in last bits (reassociation), so
    # FP32 copies differ in last bits, matrix-scaled copies in their scale (every value's last
    # bits), and element codes only where S crossed a rounding boundary ("code flips").
    for name, g, w_ in (("anchor", cp.anchor_stored, ref.checkpoints.anchor_stored),
                        ("read", cp.read_stored, ref.checkpoints.read_stored)):
        if isinstance(g, PackedTensor):
            gc, wc = g.codes[s].contiguous().view(torch.uint8), w_.codes.contiguous().view(torch.uint8)
            res[f"{name}_code_byte_flips_vs_reference_flush"] = int((gc != wc).sum())
        gv = g if isinstance(g, torch.Tensor) else g.dequantize()
        wv = w_ if isinstance(w_, torch.Tensor) else w_.dequantize()
        res[f"{name}_value_bits_vs_reference_flush"] = bit_mismatch(gv[s], wv)
    res["elements_compared"] = ref.state.numel()
    # the serving variant (no S written, the flush token's output S q fused): y vs S_ref q
    q = M.query(gen)
    if M.gdn:
        _, y = kr.flush_kernel(A, la, out.w, k, length, policy, q=q, store_state=False, **kw)
    else:
        _, y = kr.mamba2_flush_kernel(A, la, w, k, length, policy, q=q, store_state=False, **kw)
    res["flush_token_output"] = stats(y[s], core.matvec(ref.state, core.expand_heads(q[s], M.H, 1)))


# ------------------------------------------------------------------------------ timing
STEP_CFGS = [(32, 4), (64, 4), (32, 8), (64, 8)]  # (block_v, num_warps)
FLUSH_CFGS = [(32, 4), (32, 8), (64, 8)]


def timing_tasks(M, gen, small=False):
    """[(key, fn)] of everything timed for model M (the same list drives the warm-up)."""
    B, H, L = M.B, M.H, M.L
    streams = torch.arange(B * H, device=DEV).view(B, H)
    S = M.state(gen)
    la, w, k, beta = M.records(gen, M.cap)
    nla, nv, nk, nbeta = (t[:, 0] for t in M.records(gen, 1))
    q = M.query(gen)
    step_cfgs = [(16, 4)] if small else STEP_CFGS
    flush_cfgs = [(16, 4)] if small else FLUSH_CFGS
    tasks = []
    S2, S3 = S.clone(), S.clone()
    tasks.append(("eager_fp32_triton", lambda: eager_triton(S2, nk, q, nv, nla, nbeta, M.gdn)))
    tasks.append(("eager_fp32_torch", lambda: eager_torch(S3, nk, q, nv, nla, nbeta, M.gdn)))
    for fmt in READ_FORMATS:
        R_st = stored(S, fmt, streams)
        ring = {"la": la.clone(), "v": w.clone(), "k": k.clone()}
        if M.gdn:
            ring.update(beta=beta.clone(), uR=torch.randn_like(w))
        for hh in (0, L // 2 - 1, L - 2):
            h = torch.full((B,), hh, dtype=torch.int64, device=DEV)
            for bv, nw in step_cfgs:
                def fn(R_st=R_st, ring=ring, h=h, bv=bv, nw=nw):
                    if M.gdn:
                        return kr.gdn_step_kernel(R_st, ring, q, nk, nv, nla, nbeta, h,
                                                  block_v=bv, num_warps=nw)
                    return kr.mamba2_step_kernel(R_st, ring, nla, nv, nk, q, h, block_v=bv,
                                                 num_warps=nw)
                tasks.append((f"step|{fmt}|h{hh}|bv{bv}|w{nw}", fn))
        tasks.append((f"bytes|{fmt}", nbytes(R_st)))
    A = S.clone()
    length = torch.full((B,), L, dtype=torch.int64, device=DEV)
    la_, w_, k_, beta_ = (t[:, :L].contiguous() for t in (la, w, k, beta))
    kw = dict(seed=SEED, layer=0, sequence_ids=torch.arange(B, device=DEV),
              flush_index=torch.ones(B, dtype=torch.int64, device=DEV))
    u = w_
    for bv, nw in flush_cfgs:
        if M.gdn:
            u = kr.gdn_corrections_kernel(A, la_, beta_, w_, k_, length)
            tasks.append((f"corr|bv{bv}|w{nw}", lambda bv=bv, nw=nw: kr.gdn_corrections_kernel(
                A, la_, beta_, w_, k_, length, block_v=bv, num_warps=nw)))
        for pol in [p for f in READ_FORMATS for p in FLUSH_POLICIES[f]]:
            tasks.append((f"flush|{pol}|bv{bv}|w{nw}", lambda pol=pol, bv=bv, nw=nw: kr.flush_kernel(
                A, la_, u, k_, length, pol, q=q, store_state=False, block_v=bv, num_warps=nw,
                split_casts=False, **kw)))
    return tasks


def run_timing(M, gen, out, small=False):
    """Time every task; summarise: eager, best step config per format, flush per policy."""
    raw = out["raw_us"] = {}
    out["state_fp32_bytes"] = M.B * M.H * M.V * M.K * 4
    for key, fn in timing_tasks(M, gen, small):
        if key.startswith("bytes|"):
            out.setdefault("read_copy_bytes", {})[key[6:]] = fn
            continue
        raw[key] = bench(fn) * 1e3
        if not key.startswith("step") or key.endswith("h7|bv32|w4"):
            print(M.name, key, round(raw[key], 1), flush=True)
    out["eager_fp32_triton_us"] = raw["eager_fp32_triton"]
    out["eager_fp32_torch_us"] = raw["eager_fp32_torch"]
    out["eager_fp32_triton_GBps"] = 2 * out["state_fp32_bytes"] / (raw["eager_fp32_triton"] * 1e-6) / 1e9
    best = out["step_best"] = {}
    for fmt in READ_FORMATS:
        for hh in (0, M.L // 2 - 1, M.L - 2):
            cands = {k_: v for k_, v in raw.items() if k_.startswith(f"step|{fmt}|h{hh}|")}
            k_best = min(cands, key=cands.get)
            best.setdefault(fmt, {})[f"h{hh}"] = {"us": cands[k_best], "cfg": k_best.split("|", 3)[3]}
    fl = out["flush_best"] = {}
    corr = {k_: v for k_, v in raw.items() if k_.startswith("corr|")}
    c_best = min(corr.values()) if corr else 0.0
    for pol in [p for f in READ_FORMATS for p in FLUSH_POLICIES[f]]:
        cands = {k_: v for k_, v in raw.items() if k_.startswith(f"flush|{pol}|")}
        k_best = min(cands, key=cands.get)
        fl[pol] = {"flush_kernel_us": cands[k_best], "cfg": k_best.split("|", 2)[2],
                   "corrections_kernel_us": c_best, "total_us": cands[k_best] + c_best}


def warm(models, part, nparts, small):
    """Compile (run once) the timing tasks with index % nparts == part (parallel warm-up)."""
    i = 0
    for M in models:
        gen = torch.Generator(device=DEV).manual_seed(0)
        for key, fn in timing_tasks(M, gen, small):
            if not key.startswith("bytes|") and i % nparts == part:
                fn()
            i += 1
    if DEV == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter smoke)")
    ap.add_argument("--ref-seqs", type=int, default=16)
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--models", default="gdn,mamba2")
    ap.add_argument("--warm", default=None, help="i/n: only compile part i of n of the timing "
                    "tasks (run n of these in parallel before timing)")
    args = ap.parse_args()
    L = 16
    if args.small:
        models = [Model("gdn", 2, 4, 2, 16, 32, 4), Model("mamba2", 2, 4, 1, 16, 32, 4)]
        args.ref_seqs = 2
    else:
        models = [Model("gdn", 256, 32, 16, 128, 128, L), Model("mamba2", 256, 128, 1, 64, 128, L)]
    models = [m for m in models if m.name in args.models.split(",")]
    if args.warm:
        part, nparts = (int(x) for x in args.warm.split("/"))
        warm(models, part, nparts, args.small)
        return
    commit = git_commit()
    result = {"command": "python benchmarks/replay_kernels.py --out $OUT/replay_kernels_h200.json",
              "date": time.strftime("%Y-%m-%d"), "git_commit": commit,
              "torch": torch.__version__, "triton": triton.__version__,
              "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
              "python": platform.python_version(), "window_L": L,
              "tolerance_outputs": "mismatch counts |got-ref| > 1e-5 + 1e-5 |ref|",
              "models": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    for M in models:
        gen = torch.Generator(device=DEV).manual_seed(0)
        mres = result["models"][M.name] = {"shape": dict(B=M.B, H=M.H, G=M.G, V=M.V, K=M.K,
                                                         L=M.L)}
        streams = torch.arange(M.B * M.H, device=DEV).view(M.B, M.H)
        chk = mres["check"] = {}
        for fmt in ([] if args.skip_checks else READ_FORMATS):
            for what, fn in (("step", check_step), ("verify", check_verify)):
                if what == "verify" and fmt not in VERIFY_FORMATS:
                    continue
                r = chk.setdefault(f"{what}:{fmt}", {})
                try:
                    fn(M, gen, fmt, streams, r)
                except Exception:  # noqa: BLE001
                    r["error"] = traceback.format_exc()[-2000:]
                print(M.name, what, fmt, json.dumps(r)[:300], flush=True)
            for pol in FLUSH_POLICIES[fmt]:
                r = chk.setdefault(f"flush:{pol}", {})
                try:
                    check_flush(M, gen, pol, args.ref_seqs, r)
                except Exception:  # noqa: BLE001
                    r["error"] = traceback.format_exc()[-2000:]
                print(M.name, "flush", pol, json.dumps(r)[:400], flush=True)
            save()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        if not args.skip_timing:
            try:
                run_timing(M, gen, mres.setdefault("timing", {}), args.small)
            except Exception:  # noqa: BLE001
                mres.setdefault("timing", {})["error"] = traceback.format_exc()[-2000:]
                print(mres["timing"]["error"], flush=True)
        save()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    save()
    # short table last
    for name, m in result["models"].items():
        t = m.get("timing", {})
        print(f"== {name}: eager fp32 triton {t.get('eager_fp32_triton_us', float('nan')):.1f} us,"
              f" torch {t.get('eager_fp32_torch_us', float('nan')):.1f} us")
        for fmt, r in t.get("step_best", {}).items():
            print(f"   step {fmt:8s} " + " ".join(f"{a}={b['us']:.1f}({b['cfg']})"
                                                  for a, b in r.items()))
        for pol, r in t.get("flush_best", {}).items():
            print(f"   flush {pol:26s} total={r['total_us']:.1f} us ({r['cfg']})")
        bad = {k: v for k, v in m.get("check", {}).items() if "error" in v}
        print("   check errors:", list(bad) or "none", "timing error:", "error" in t)

if __name__ == "__main__":
    main()
