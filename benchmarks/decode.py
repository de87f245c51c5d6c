"""Decode benchmark of issue 15: ReplaySSM decode step, flush, amortised window cost and
verify against the conventional FP32 kernel (fla ``fused_recurrent``), with correctness checks
of every timed kernel in the same run. One command, one JSON.

Geometries (the issue's): GDN 16 q/k heads, 32 value heads, state 128 x 128 (``[B, HV, DV, DK]``);
Mamba-2 128 heads, 1 group, P = 64, N = 128 (``[B, H, P, N]``). Batches B in {1, 64, 256},
window L = 16, verify T = 8 drafts at every start h = 0..L-T (committed records before the
drafts; h = L-T puts the last draft on the flush slot). Float32 records.

Timed, per geometry and B (all times in microseconds, median over ``--reps`` calls, each call
bracketed by its own CUDA events; ``--tiny``: host timer, CPU interpreter). ``--timing``:
``graph`` replays each call from a CUDA graph captured once per pool entry, so the time is the
GPU time of its kernels (what a serving engine that replays its decode step from a CUDA graph
pays, and how kernels are compared: ``triton.testing.do_bench_cudagraph``); ``eager`` launches
from Python on every call, which at the step's 0.1-0.6 ms of host work per call on the lent
machine (argument checks, two launches; it varies from run to run) shows the host wherever it
exceeds the GPU time (every call at B = 1, and at B = 256 once a step's kernels take less than
its host work); ``both`` (default) times both ways and keeps the eager timing of every item
under ``"eager"``: the summary's ratios then take each item's lower median of the two
(``"best"``: each aggregate -- a policy's step mean, flush, amortised cost, verify maximum,
fla's step -- the lower of its value from the graph timings and from the eager ones, so no
sum mixes modes; a graph is not always faster: fla's step, which allocates its output state,
ran 10% slower from a graph, not explained), with the pure graph and eager ratios under
``summary.graph`` and ``summary.eager``. Added 2026-12-01 after a torch.profiler run showed the step's kernels
15-30% faster with ``shared_products`` while the eager timing, then host-bound, moved by
50-150 us at random (docs/kernels-replay.md, sixth pass).

* per policy in ``POLICIES`` (``fp32``; ``read:nvfp4/rec:fp16+sr``): the non-flush decode step
  (``{gdn,mamba2}_step_kernel``: ring append + output, read copy R in its stored form) at every
  h = 0..L-2; the flush (``{gdn,mamba2}_flush_kernel`` serving variant: stored anchor in, A and
  R out, the flush token's ``S q``, S not written; GDN: the corrections solved in the flush
  kernel, or, under a single-checkpoint policy such as ``fp32``, the cached ones folded, as the
  decode state runs it since 2026-12-02, ``GDNFold.folds_cached``; verify likewise);
  amortised per token ``(sum_h step(h) + flush) / L``; verify T = 8 at every h
  (``{gdn,mamba2}_verify_kernel``);
* the fla ``fused_recurrent`` step (GDN: ``fused_recurrent_gated_delta_rule``; Mamba-2:
  ``fused_recurrent_simple_gla`` with the group's q/k expanded to the heads), FP32 state in the
  ``[V, K]`` layout, read + write of S; skipped with the reason recorded when fla does not import;
* a conventional FP32 step as a simple Triton kernel (``replay_kernels.eager_triton``), and a
  read-only pass over the FP32 state (``o = S q``, this file's ``_read_kernel``);
* a device-to-device copy (bandwidth ceiling measured in the same run).

Every timed operation runs on a pool of input sets (states, rings, records) rotated call by call,
the pool holding at least ``POOL_L2_MULTIPLE`` x the L2 size, so L2 does not flatter small B.
Warm-up: every pool entry once (Triton compiles, fla autotunes at the timed shape), plus
``--warmup`` calls.

Traffic model (bytes; GB/s = bytes / median time): step reads R (stored bytes) and the records
of its ``h + 1`` slots; verify reads R and ``h + T`` records; flush reads the stored anchor and
``L`` records and writes A and R (stored bytes); fla / eager step read and write the FP32 S; the
read-only pass reads S; the copy reads and writes its buffer. ``achieved_vs_copy`` = GB/s over
the copy's GB/s.

Correctness (same run, same shapes, torch references of ``replayssm_quant.replay`` with the torch
quantizers): step outputs (GDN: and the new correction) against ``*_step_output``; verify
outputs (GDN: and corrections) against ``*_verify``; flush S (the store_state variant),
corrections, the flush token output against ``*_flush``; the anchor and read copies (values and
packed bytes) bit for bit against ``core.cast_checkpoints`` of the kernel's own S, and the timed
(no S) variant's copies bit for bit against the store variant's; fla's output and new state
against the torch FP32 step. Outputs: mismatch = count of ``|got - ref| > 1e-5 + 1e-5 |ref|``.

Usage::

    python benchmarks/decode.py --out $OUT/decode_h200.json          # the device run
    python benchmarks/decode.py --tiny --out /tmp/decode_tiny.json   # CPU (sets TRITON_INTERPRET)
    # no device: the summary of a stored result again, with a newer emulation result
    python benchmarks/decode.py --resummarize benchmarks/results/decode_h200.json \
        --emulation benchmarks/results/emulation_h200.json --out benchmarks/results/decode_h200.json

On the device machine (no registry there; fla 0.6.0 carried as wheels in the ignored ``.whl/``,
``carry=[".whl"]``; einops is on the image)::

    python3 -m pip install --no-deps --no-index .whl/fla_core-0.6.0-py3-none-any.whl \
        .whl/flash_linear_attention-0.6.0-py3-none-any.whl; export PYTHONPATH=$PWD; \
    python3 benchmarks/decode.py --out $OUT/decode_h200.json
"""

from __future__ import annotations

import argparse
from pathlib import Path
import os
import sys

if "--tiny" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("REPLAYSSM_BACKEND", "torch")  # references: torch quantizers

import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replay_kernels as rk  # noqa: E402  (Model, eager baselines, stats helpers)

from replayssm_quant.config import GDNFold  # noqa: E402
from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.quant import PackedTensor, pack  # noqa: E402
from replayssm_quant.replay import (core, gdn_flush, gdn_step_output, gdn_verify,  # noqa: E402
                                    mamba2_flush, mamba2_step_output, mamba2_verify)

POLICIES = {"fp32": "fp32", "nvfp4": "read:nvfp4/rec:fp16+sr"}
SEED = rk.SEED
INTERPRET = rk.INTERPRET
DEV = rk.DEV
POOL_L2_MULTIPLE = 4
ATOL = RTOL = 1e-5


# ------------------------------------------------------------------------------ read-only pass
@triton.jit
def _read_kernel(s_ptr, q_ptr, o_ptr, H, G, V, K: tl.constexpr, BV: tl.constexpr):
    """Read-only pass: ``o[b, h, rows] = S[b, h, rows, :] q[b, g(h), :]`` (one read of S)."""
    mat = tl.program_id(0).to(tl.int64)
    b = mat // H
    g = (mat - b * H) // (H // G)
    rows = tl.program_id(1) * BV + tl.arange(0, BV)
    rm = rows < V
    kk = tl.arange(0, K)
    S = tl.load(s_ptr + (mat * V + rows)[:, None] * K + kk[None, :], mask=rm[:, None], other=0.0)
    q = tl.load(q_ptr + (b * G + g) * K + kk)
    tl.store(o_ptr + mat * V + rows, tl.sum(S * q[None, :], axis=1), mask=rm)


def read_pass(S, q, bv=32):
    """``S [B, H, V, K]`` float32, grouped ``q [B, G, K]`` -> ``S q [B, H, V]``."""
    B, H, V, K = S.shape
    o = torch.empty(B, H, V, device=S.device)
    _read_kernel[(B * H, triton.cdiv(V, bv))](S, q, o, H, q.shape[1], V, K=K, BV=bv)
    return o


# ------------------------------------------------------------------------------ fla baseline
def load_fla():
    """``(gdn_fn, simple_gla_fn, version, None)`` or ``(None, None, None, reason)``."""
    if DEV != "cuda":
        return None, None, None, "no CUDA device (fla kernels need one)"
    try:
        import fla
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
        from fla.ops.simple_gla import fused_recurrent_simple_gla
    except Exception as e:  # noqa: BLE001
        return None, None, None, f"fla not importable: {type(e).__name__}: {e}"
    return (fused_recurrent_gated_delta_rule, fused_recurrent_simple_gla,
            getattr(fla, "__version__", "?"), None)


def fla_step(fns, M, st):
    """One conventional decode step with fla on set ``st`` (FP32 state ``[B, H, V, K]``,
    ``state_v_first``): returns ``(o [B, H, V], S' [B, H, V, K])``."""
    gfn, sfn = fns
    if M.gdn:
        o, S = gfn(st["fla_q"], st["fla_k"], st["nv"][:, None], g=st["nla"][:, None],
                   beta=st["nbeta"][:, None], scale=1.0, initial_state=st["S"],
                   output_final_state=True, state_v_first=True)
    else:
        o, S = sfn(st["fla_q"], st["fla_k"], st["nv"][:, None], g=st["nla"][:, None],
                   scale=1.0, initial_state=st["S"], output_final_state=True,
                   state_v_first=True)
    return o[:, 0], S


# ------------------------------------------------------------------------------ helpers
def stats(got, want):
    r = rk.stats(got, want, atol=ATOL, rtol=RTOL)
    r["passed"] = r["mismatch"] == 0 and r["nan"] == 0
    return r


def stored_bits(a, b):
    """Differing 32-bit words (float tensors) or bytes (every buffer of a PackedTensor)."""
    if isinstance(a, PackedTensor):
        n = 0
        for x, y in ((a.codes, b.codes), (a.block_scales, b.block_scales),
                     (a.matrix_scale, b.matrix_scale)):
            if x is not None:
                x, y = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
                n += int((x != y).sum())
        return n
    return rk.bit_mismatch(a, b)


def sub(st, s):
    """First ``s`` sequences of a stored copy."""
    if isinstance(st, PackedTensor):
        cut = lambda t: None if t is None else t[:s]  # noqa: E731
        return dataclasses.replace(st, codes=st.codes[:s], block_scales=cut(st.block_scales),
                                   matrix_scale=cut(st.matrix_scale),
                                   shape=torch.Size((s, *st.shape[1:])))
    return st[:s]


def deq(st):
    return st.dequantize() if isinstance(st, PackedTensor) else st


def nbytes(st):
    return rk.nbytes(st)


# How timer() times on the GPU: "eager" (each call's launches bracketed by CUDA events; the
# host's launch overhead shows wherever it exceeds the GPU time of the call), "graph" (each
# pool entry's call captured once as a CUDA graph and the replays bracketed by CUDA events:
# the GPU time of the call's kernels, as a serving engine that replays its decode step from
# a CUDA graph sees it) or "both" (graph, with the eager timing kept under "eager").
TIMING_MODES = ("eager", "graph", "both")
TIMING = "eager"


def _event_times(call, n, reps, start):
    """Microseconds of ``call(i)`` for ``reps`` calls from ``i = start``, rotating over ``n``,
    each bracketed by its own pair of CUDA events (the calls are queued back to back)."""
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for j, (s, e) in enumerate(ev):
        s.record()
        call((start + j) % n)
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in ev]


def _stats(ts, reps, n):
    return {"median_us": statistics.median(ts), "min_us": min(ts), "max_us": max(ts),
            "reps": reps, "pool": n}


def _graphs(fn, n):
    """One CUDA graph per pool entry of ``fn(i)`` (captured after the eager warm-up, so every
    kernel is compiled and autotuned; one memory pool shared by the graphs: their outputs are
    never read)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # a warm call on the capture's side stream (torch's recipe)
        fn(0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for i in range(n):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            fn(i)
        graphs.append(g)
    for g in graphs:  # one warm replay each (the first launch of a graph uploads it)
        g.replay()
    torch.cuda.synchronize()
    return graphs


def timer(fn, n, reps, warmup, mode=None):
    """Median microseconds of ``fn(i)`` over ``reps`` calls, rotating ``i`` over ``n`` sets;
    warm-up: every set once plus ``warmup`` calls. CUDA events per call (host timer with
    ``--tiny``). ``mode`` (default the module's ``TIMING``): see ``TIMING_MODES``; a call
    that cannot be captured (it synchronises with the host) is timed eagerly and the capture
    error is recorded. Returns ``{"median_us", "min_us", "max_us", "reps", "pool",
    "timing"}`` (and ``"eager"``: the eager timing, with ``"both"``; ``"graph_error"``)."""
    mode = TIMING if mode is None else mode
    if mode not in TIMING_MODES:
        raise ValueError(f"timing mode must be one of {TIMING_MODES}, got {mode!r}")
    i = 0
    for _ in range(n + warmup):
        fn(i % n)
        i += 1
    if DEV != "cuda":
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(i % n)
            ts.append((time.perf_counter() - t) * 1e6)
            i += 1
        return {**_stats(ts, reps, n), "timing": "host"}
    eager = None
    if mode in ("eager", "both"):
        eager = {**_stats(_event_times(fn, n, reps, i), reps, n), "timing": "eager"}
        if mode == "eager":
            return eager
    try:
        graphs = _graphs(fn, n)
    except Exception as err:  # noqa: BLE001  (a host synchronisation inside the call)
        torch.cuda.synchronize()
        out = eager or {**_stats(_event_times(fn, n, reps, i), reps, n), "timing": "eager"}
        out = {**out, "graph_error": f"{type(err).__name__}: {str(err)[:300]}"}
        if mode == "both":  # the same keys as a captured item (the eager timing twice)
            out["eager"] = {k: out[k] for k in ("median_us", "min_us", "max_us")}
        return out
    out = {**_stats(_event_times(lambda j: graphs[j].replay(), n, reps, 0), reps, n),
           "timing": "graph"}
    if eager is not None:
        out["eager"] = {k: eager[k] for k in ("median_us", "min_us", "max_us")}
    return out


def gbps(nbytes_, r, copy_gbps=None):
    """Add ``GBps`` (and ``achieved_vs_copy``) for ``nbytes_`` moved in ``r["median_us"]``."""
    r["bytes"] = int(nbytes_)
    r["GBps"] = nbytes_ / (r["median_us"] * 1e-6) / 1e9
    if copy_gbps:
        r["achieved_vs_copy"] = r["GBps"] / copy_gbps
    return r


def record_bytes(M, n):
    """Bytes of ``n`` buffer records of the batch: la, k, w (v or correction), GDN beta."""
    per = M.H * 4 + M.G * M.K * 4 + M.H * M.V * 4 + (M.H * 4 if M.gdn else 0)
    return M.B * n * per


def l2_bytes():
    if DEV != "cuda":
        return 1 << 16
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


# ------------------------------------------------------------------------------ input sets
def make_set(M, gen, policy, T, with_fla):
    """One input set: FP32 state S ``[B, H, V, K]``, its stored read copy R and anchor A under
    ``policy``, a ring of L records (``la, beta [B,L,H]``, ``v, uR [B,L,H,V]``,
    ``k [B,L,G,K]``), a new record (``nla, nbeta [B,H]``, ``nv [B,H,V]``, ``nk [B,G,K]``),
    queries ``q [B,G,K]``, ``qT [B,T,G,K]``. ``S`` is None where neither copy is FP32."""
    B, H, L = M.B, M.H, M.L
    S = M.state(gen)
    streams = torch.arange(B * H, device=DEV).view(B, H)
    if policy.single_checkpoint and policy.rec.is_identity:
        A = R = S
    else:
        A = S if policy.rec.is_identity else pack(S, policy.rec, seed=SEED, stream=streams,
                                                  backend="triton")
        R = S if policy.read.is_identity else pack(S, policy.read, seed=SEED,
                                                   stream=streams + B * H, backend="triton")
        if A is not S and R is not S:
            S = None  # not read by the ReplaySSM operations: not held in the pool
    la, w, k, beta = M.records(gen, L)
    ring = {"la": la, "v": w, "k": k}
    if M.gdn:
        ring.update(beta=beta, uR=torch.randn_like(w) * 0.1)
    extra = {}
    if M.gdn and GDN_VERIFY == "cuda":  # run_verify's out= (made here, not in a graph capture)
        extra["uR_out"] = ring["uR"].clone()
    nla, nv, nk, nbeta = (t[:, 0] for t in M.records(gen, 1))
    st = {"S": S, "A": A, "R": R, "ring": ring, "nla": nla, "nv": nv.contiguous(),
          "nk": nk.contiguous(), "nbeta": nbeta, "q": M.query(gen), "qT": M.query(gen, T),
          # GDN: what the decode state's flush and verify fold (GDNFold.folds_cached): the
          # cached corrections where R is A, else corrections re-solved against A
          "fold": GDNFold.CACHED if GDNFold.RECOMPUTE.folds_cached(policy)
          else GDNFold.RECOMPUTE, **extra}
    if with_fla:
        # fla: [B, 1, heads, K]; Mamba-2's single group expanded to the H heads
        for n_, t in (("fla_q", st["q"]), ("fla_k", st["nk"])):
            st[n_] = (t if M.gdn else core.expand_heads(t, H, 1))[:, None].contiguous()
    return st


def set_bytes(st):
    """Bytes of one input set that the timed operations touch (S / A / R once each, the ring)."""
    uniq = {id(t): t for t in (st["S"], st["A"], st["R"]) if t is not None}
    return sum(nbytes(t) for t in uniq.values()) + sum(
        t.numel() * t.element_size() for t in st["ring"].values())


FLUSH_KW = dict(seed=SEED, layer=0)


def flush_args(M, st):
    B = M.B
    return dict(sequence_ids=torch.arange(B, device=DEV) * 3 + 1,
                flush_index=torch.ones(B, dtype=torch.int64, device=DEV),
                length=torch.full((B,), M.L, dtype=torch.int64, device=DEV), **FLUSH_KW)


# ------------------------------------------------------------------------------ operations
def run_step(M, st, h, **cfg):
    """Non-flush decode step on set ``st`` at ``h`` (int64 ``[B]`` committed records):
    appends the new record to ring slot h, returns ``o [B, H, V]``. ``cfg``: launch options
    of the Triton step wrappers (default: theirs; given, the Triton kernel runs even under
    ``--gdn-step cuda``). GDN under ``--gdn-step cuda``: ``gdn_step_cuda``."""
    r = st["ring"]
    if M.gdn:
        step = kr.gdn_step_cuda if GDN_STEP == "cuda" and not cfg else kr.gdn_step_kernel
        return step(st["R"], r, st["q"], st["nk"], st["nv"], st["nla"], st["nbeta"], h, **cfg)
    return kr.mamba2_step_kernel(st["R"], r, st["nla"], st["nv"], st["nk"], st["q"], h, **cfg)


#: GDN's step kernel (--gdn-step): "triton" (gdn_step_kernel) or "cuda" (gdn_step_cuda: the
#: CUDA C++ kernel where it applies, FP32 and NVFP4 read copies; the Triton kernel elsewhere)
GDN_STEP = "triton"

#: GDN's flush kernel (--gdn-flush): "triton" (gdn_flush_kernel) or "cuda" (gdn_flush_cuda:
#: the CUDA C++ kernel where it applies, read:nvfp4/rec:fp16[+sr]; the Triton kernel elsewhere)
GDN_FLUSH = "triton"

#: GDN's verify kernel (--gdn-verify): "triton" (gdn_verify_kernel) or "cuda"
#: (gdn_verify_cuda: the CUDA C++ kernel where it applies, the fp32 policy here; the Triton
#: kernel for the other policies)
GDN_VERIFY = "triton"


def run_verify(M, st, start, out=None, **cfg):
    """Verify of ``T`` drafts at slots ``start..start+T-1`` (int64 ``[B]``), records from the
    ring (committed then drafts); returns ``o [B, T, H, V]`` (GDN: ``(o, uR [B, L, H, V])``).
    ``cfg``: launch options of the verify wrappers (default: theirs; GDN: of the kernel that
    ``GDN_VERIFY`` names). GDN under ``--gdn-verify cuda``: the decode state's form, the
    corrections written from ``start`` on into ``out`` (default: ``st["uR_out"]``, a copy of
    the ring's made by :func:`make_set`, so the inputs stay as they are; the state writes its
    ring in place), the known ones not rewritten."""
    r = st["ring"]
    if M.gdn:
        args = (st["R"], st["A"], r["la"], r["beta"], r["v"], r["k"], st["qT"], r["uR"],
                start, M.L, st["fold"] is GDNFold.CACHED)
        if GDN_VERIFY == "cuda":
            return kr.gdn_verify_cuda(*args, out=st["uR_out"] if out is None else out, **cfg)
        return kr.gdn_verify_kernel(*args, **cfg)
    return kr.mamba2_verify_kernel(st["R"], st["A"], r["la"], r["v"], r["k"], st["qT"],
                                   start, M.L, **cfg)


def run_flush(M, st, policy, fa, store_state=False):
    """Flush of the L ring records into the stored anchor ``st["A"]``, with the flush token's
    output ``S q``; returns ``(FlushResult, y [B, H, V])``. The timed serving form
    (``store_state`` False) also passes ``return_w=False``: ``FlushResult.w`` (the folded
    corrections, which a serving engine never reads) is None, so GDN's fold of cached
    corrections takes them unmasked and its solve does not write them out; the checked
    store-state form returns them."""
    r = st["ring"]
    length = fa["length"]
    kw = {k_: v for k_, v in fa.items() if k_ != "length"}
    if M.gdn:
        flush = kr.gdn_flush_cuda if GDN_FLUSH == "cuda" else kr.gdn_flush_kernel
        return flush(st["A"], r["la"], r["beta"], r["v"], r["k"], length, policy,
                     q=st["q"], store_state=store_state, dequantize=store_state,
                     u_cached=r["uR"], fold_cached_corrections=st["fold"] is GDNFold.CACHED,
                     return_w=store_state, **kw)
    return kr.mamba2_flush_kernel(st["A"], r["la"], r["v"], r["k"], length, policy, q=st["q"],
                                  store_state=store_state, dequantize=store_state,
                                  return_w=store_state, **kw)


# ------------------------------------------------------------------------------ checks
def check_step(M, st, h):
    """Kernel step at ``h`` (int64 [B]) on a copy of the ring vs the torch reference."""
    ring = {n: t.clone() for n, t in st["ring"].items()}
    ref = {n: t.clone() for n, t in ring.items()}
    b = torch.arange(M.B, device=DEV)
    for n, t in (("la", st["nla"]), ("v", st["nv"]), ("k", st["nk"]), ("beta", st["nbeta"])):
        if n in ref:
            ref[n][b, h] = t
    J = int(h.max()) + 1
    R = deq(st["R"])
    res = {}
    tmp = dict(st, ring=ring)
    got = run_step(M, tmp, h)
    if M.gdn:
        want, uR = gdn_step_output(R, ref["la"][:, :J], ref["beta"][:, :J], ref["v"][:, :J],
                                   ref["k"][:, :J], st["q"], ref["uR"][:, :J], h + 1)
        res["u_new"] = stats(ring["uR"][b, h], uR[b, h])
    else:
        want = mamba2_step_output(R, ref["la"][:, :J], ref["v"][:, :J], ref["k"][:, :J],
                                  st["q"], h + 1)
    res["output"] = stats(got, want)
    res["ring_append_exact"] = all(torch.equal(ring[n], ref[n]) for n in ring if n != "uR")
    res["passed"] = res["ring_append_exact"] and all(
        v["passed"] for v in res.values() if isinstance(v, dict))
    return res


def check_verify(M, st, start):
    r = st["ring"]
    R, A = deq(st["R"]), deq(st["A"])
    res = {}
    if M.gdn:
        got, ug = run_verify(M, st, start, out=r["uR"].clone())  # (cuda: slots < start kept)
        want, uw = gdn_verify(R, A, r["la"], r["beta"], r["v"], r["k"], st["qT"], r["uR"],
                              start, M.L, st["fold"])
        res["corrections"] = stats(ug, uw)
    else:
        got = run_verify(M, st, start)
        want = mamba2_verify(R, A, r["la"], r["v"], r["k"], st["qT"], start, M.L)
    res["outputs"] = stats(got, want)
    res["drafts_on_flush_slot"] = int((start + st["qT"].shape[1] == M.L).sum())
    res["passed"] = all(v["passed"] for v in res.values() if isinstance(v, dict))
    return res


def check_flush(M, st, policy, fa, n_ref):
    """Store-state flush vs the reference flush (first ``n_ref`` sequences), the kernel's
    copies vs the torch cast of the kernel's S, and the timed variant's copies vs these."""
    out, y = run_flush(M, st, policy, fa, store_state=True)
    out2, y2 = run_flush(M, st, policy, fa, store_state=False)
    s = slice(0, n_ref)
    r = st["ring"]
    A = deq(sub(st["A"], n_ref))
    kws = dict(seed=SEED, layer=fa["layer"], sequence_ids=fa["sequence_ids"][s],
               flush_index=fa["flush_index"][s])
    length = fa["length"][s]
    res = {"sequences_vs_reference": n_ref}
    if M.gdn:
        ref = gdn_flush(A, r["la"][s], r["beta"][s], r["v"][s], r["k"][s], policy,
                        length=length, u_cached=r["uR"][s], fold=st["fold"], store=True,
                        **kws)
        res["corrections"] = stats(out.w[s], ref.w)
    else:
        ref = mamba2_flush(A, r["la"][s], r["v"][s], r["k"][s], policy, length=length,
                           store=True, **kws)
    res["state"] = stats(out.state[s], ref.state)
    res["flush_token_output"] = stats(y2[s], core.matvec(
        ref.state, core.expand_heads(st["q"][s], M.H, 1)))
    own = core.cast_checkpoints(out.state, policy, store=True, sequence_ids=fa["sequence_ids"],
                                flush_index=fa["flush_index"], seed=SEED, layer=fa["layer"])
    cp, cp2 = out.checkpoints, out2.checkpoints
    res["anchor_value_bits_vs_cast_of_kernel_S"] = rk.bit_mismatch(cp.anchor, own.anchor)
    res["read_value_bits_vs_cast_of_kernel_S"] = rk.bit_mismatch(cp.read, own.read)
    res["anchor_stored_bytes_vs_cast_of_kernel_S"] = stored_bits(cp.anchor_stored,
                                                                 own.anchor_stored)
    res["read_stored_bytes_vs_cast_of_kernel_S"] = stored_bits(cp.read_stored, own.read_stored)
    res["timed_variant_anchor_vs_store_variant"] = stored_bits(cp2.anchor_stored,
                                                               cp.anchor_stored)
    res["timed_variant_read_vs_store_variant"] = stored_bits(cp2.read_stored, cp.read_stored)
    res["timed_variant_output_vs_store_variant"] = stats(y2, y)
    exact = [v for k_, v in res.items() if not isinstance(v, dict) and k_ != "sequences_vs_reference"]
    res["passed"] = all(v["passed"] for v in res.values() if isinstance(v, dict)) and all(
        v == 0 for v in exact)
    return res


def check_fla(fns, M, st):
    o, S = fla_step(fns, M, st)
    S_ref = st["S"].clone()
    o_ref = rk.eager_torch(S_ref, st["nk"], st["q"], st["nv"], st["nla"], st["nbeta"], M.gdn)
    res = {"output": stats(o, o_ref), "state": stats(S, S_ref)}
    res["passed"] = res["output"]["passed"] and res["state"]["passed"]
    return res


# ------------------------------------------------------------------------------ one shape
def run_shape(M, T, args, copy_gbps, fla_fns, log):
    """All timings and checks of one geometry at one batch; returns its JSON object."""
    gen = torch.Generator(device=DEV).manual_seed(M.B * 7 + M.H)
    L, B = M.L, M.B
    out = {"shape": dict(B=B, H=M.H, G=M.G, V=M.V, K=M.K, L=L, T=T),
           "state_fp32_bytes": B * M.H * M.V * M.K * 4, "policies": {}, "checks": {}}
    sb = out["state_fp32_bytes"]
    n_ref = B if args.ref_seqs <= 0 else min(B, args.ref_seqs)
    target = POOL_L2_MULTIPLE * l2_bytes()
    tm = lambda fn, n: timer(fn, n, args.reps, args.warmup)  # noqa: E731
    # --- baselines on FP32 states
    probe = make_set(M, gen, StatePolicy.parse("fp32"), T, fla_fns is not None)
    n = args.pool or max(2, math.ceil(target / set_bytes(probe)))
    pool = [probe] + [make_set(M, gen, StatePolicy.parse("fp32"), T, fla_fns is not None)
                      for _ in range(n - 1)]
    base = out["baselines"] = {"pool_sets": n, "pool_bytes": n * set_bytes(probe)}
    base["read_only_fp32"] = gbps(sb, tm(lambda i: read_pass(pool[i]["S"], pool[i]["q"]), n),
                                  copy_gbps)
    base["eager_fp32_triton"] = gbps(2 * sb, tm(lambda i: rk.eager_triton(
        pool[i]["S"], pool[i]["nk"], pool[i]["q"], pool[i]["nv"], pool[i]["nla"],
        pool[i]["nbeta"], M.gdn), n), copy_gbps)
    want_ro = core.matvec(probe["S"], core.expand_heads(probe["q"], M.H, 1))
    out["checks"]["read_only_fp32"] = stats(read_pass(probe["S"], probe["q"]), want_ro)
    if fla_fns is not None:
        out["checks"]["fla_step"] = check_fla(fla_fns, M, probe)
        base["fla_step"] = gbps(2 * sb, tm(lambda i: fla_step(fla_fns, M, pool[i]), n),
                                copy_gbps)
    else:
        base["fla_step"] = None
    log(M.name, B, "baselines", {k_: round(v["median_us"], 1) for k_, v in base.items()
                                 if isinstance(v, dict)})
    pool.clear()  # free the pool before the next one
    if DEV == "cuda":
        torch.cuda.empty_cache()
    # --- ReplaySSM, per policy
    for pname, pstr in POLICIES.items():
        policy = StatePolicy.parse(pstr)
        probe = make_set(M, gen, policy, T, False)
        n = args.pool or max(2, math.ceil(target / set_bytes(probe)))
        pool = [probe] + [make_set(M, gen, policy, T, False) for _ in range(n - 1)]
        fa = flush_args(M, probe)
        res = out["policies"][pname] = {"policy": pstr, "pool_sets": n,
                                        "read_copy_bytes": nbytes(probe["R"]),
                                        "anchor_bytes": nbytes(probe["A"]),
                                        "step": {}, "verify": {}}
        chk = out["checks"][pname] = {"step": {}, "verify": {}}
        for h in range(L - 1):
            hv = torch.full((B,), h, dtype=torch.int64, device=DEV)
            chk["step"][f"h{h}"] = check_step(M, probe, hv)
            res["step"][f"h{h}"] = gbps(nbytes(probe["R"]) + record_bytes(M, h + 1), tm(
                lambda i, hv=hv: run_step(M, pool[i], hv), n), copy_gbps)
        for h in range(L - T + 1):
            hv = torch.full((B,), h, dtype=torch.int64, device=DEV)
            chk["verify"][f"h{h}"] = check_verify(M, probe, hv)
            res["verify"][f"h{h}"] = gbps(nbytes(probe["R"]) + record_bytes(M, h + T), tm(
                lambda i, hv=hv: run_verify(M, pool[i], hv), n), copy_gbps)
        try:
            chk["flush"] = check_flush(M, probe, policy, fa, n_ref)
        except Exception:  # noqa: BLE001
            chk["flush"] = {"passed": False, "error": traceback.format_exc()[-2000:]}
        fb = nbytes(probe["A"]) + record_bytes(M, L) + nbytes(probe["A"]) + (
            0 if policy.single_checkpoint else nbytes(probe["R"]))
        res["flush"] = gbps(fb, tm(lambda i: run_flush(M, pool[i], policy, fa), n), copy_gbps)
        agg = aggregates(res, None, L)  # (--timing both: summarize adds "eager" and "best")
        res.update({k: agg[k] for k in ("step_mean_us", "amortised_us", "verify_max_us")})
        log(M.name, B, pname, "step", round(res["step_mean_us"], 1), "flush",
            round(res["flush"]["median_us"], 1), "amortised", round(res["amortised_us"], 1),
            "verify max", round(res["verify_max_us"], 1))
        pool.clear()  # free the pool before the next one
        if DEV == "cuda":
            torch.cuda.empty_cache()
    return out


def has_eager(res):
    """Whether every timed item of a policy carries an eager timing (``--timing both``)."""
    return all("eager" in v for v in (*res["step"].values(), *res["verify"].values(),
                                       res["flush"]))


def item_us(v, which=None):
    """One timed item's median: as timed (None or ``"graph"``: the run's mode) or
    ``"eager"`` (kept by ``--timing both``)."""
    return v["eager"]["median_us"] if which == "eager" else v["median_us"]


def aggregates(res, which, L):
    """A policy's step mean, flush, amortised and verify maximum, all from one timing mode
    (``item_us(.., which)``), or ``which == "best"``: each aggregate the lower of its graph
    and its eager value (every aggregate from one consistent mode; no mixing of modes
    inside a sum)."""
    if which == "best":
        g, e = aggregates(res, None, L), aggregates(res, "eager", L)
        return {k: min(g[k], e[k]) for k in g}
    st = [item_us(v, which) for v in res["step"].values()]
    fl = item_us(res["flush"], which)
    return {"step_mean_us": sum(st) / len(st), "flush_us": fl, "amortised_us": (sum(st) + fl) / L,
            "verify_max_us": max(item_us(v, which) for v in res["verify"].values())}


def ratios(shape, which=None):
    """The issue's summary ratios for one shape (None where fla is missing); ``which``: the
    run's timings (None), or the ``"eager"`` / ``"best"`` aggregates of ``--timing both``
    (None when there are none)."""
    p32, p4 = shape["policies"]["fp32"], shape["policies"]["nvfp4"]
    fla = shape["baselines"]["fla_step"]
    if which:
        L = shape["shape"]["L"]
        if not (has_eager(p32) and has_eager(p4)):
            return None
        p32, p4 = ({**(a := aggregates(p, which, L)), "flush": {"median_us": a["flush_us"]}}
                   for p in (p32, p4))
        fla = fla and "eager" in fla and {"median_us": min(item_us(fla), item_us(fla, "eager"))
                                          if which == "best" else item_us(fla, which)}
    f = fla["median_us"] if fla else None
    return {
        "fp32_amortised_vs_fla": f / p32["amortised_us"] if f else None,
        "nvfp4_amortised_vs_fla": f / p4["amortised_us"] if f else None,
        "nvfp4_step_vs_fp32_step": p32["step_mean_us"] / p4["step_mean_us"],
        "flush_vs_step": p32["flush"]["median_us"] / p32["step_mean_us"],
        "verify_T8_vs_step": p32["verify_max_us"] / p32["step_mean_us"],
        # the same for the nvfp4 policy (not targets; for the doc)
        "nvfp4_flush_vs_nvfp4_step": p4["flush"]["median_us"] / p4["step_mean_us"],
        "nvfp4_verify_vs_nvfp4_step": p4["verify_max_us"] / p4["step_mean_us"],
    }


def all_passed(obj):
    """True when every ``passed`` key below ``obj`` is True."""
    if isinstance(obj, dict):
        return all(all_passed(v) for k_, v in obj.items() if k_ != "passed") and \
            obj.get("passed", True) is True
    return True


# ------------------------------------------------------------------------------ main
def summarize(result, emulation=None):
    """Fill ``result["summary"]`` (ratios of every model and batch from the stored timings,
    the issue's targets at the largest batch, and the emulation item from a
    ``kl_throughput.py`` JSON at path ``emulation``) and ``result["checks_passed"]``."""
    summary = result["summary"] = {"by_batch": {}}
    batches = result["batches"]
    big = f"B{max(batches)}"
    for name, shapes in result["models"].items():
        ok = {b: s for b, s in shapes.items() if "error" not in s}
        for s in ok.values():  # the stored eager / best aggregates, by the current rule
            for p in s.get("policies", {}).values():
                if has_eager(p):
                    for which in ("eager", "best"):
                        p[which] = aggregates(p, which, s["shape"]["L"])
        # with --timing both the ratios use, for each aggregate (a step mean, an amortised
        # cost, fla's step), the lower of its graph and its eager value ("best"); the pure
        # graph and eager ratios are kept under summary.graph / .eager
        best = {b: ratios(s, "best") for b, s in ok.items()}
        per = {b: best[b] or ratios(s) for b, s in ok.items()}
        summary["by_batch"][name] = per
        summary[name] = per.get(big)
        if big in ok and best[big]:
            summary.setdefault("graph", {})[name] = ratios(ok[big])
            summary.setdefault("eager", {})[name] = ratios(ok[big], "eager")
    summary["batch_of_targets"] = max(batches)
    if "graph" in summary:
        summary["rule"] = ("each aggregate (step mean, flush, amortised, verify maximum, fla's "
                           "step) is the lower of its all-graph and all-eager value; "
                           "summary.graph / summary.eager: each mode alone")
    summary["emulation_vs_plain_fla_max"] = None  # the emulation item: kl_throughput.py
    if emulation:
        emu = json.loads(Path(emulation).read_text())
        per = {f"N{r['N']}:{p}": v["vs_plain"] for r in emu["runs"]
               for p, v in r.get("policies", {}).items()}
        summary["emulation"] = {"source": str(emulation), "command": emu.get("command"),
                                "params": emu.get("params"), "vs_plain": per,
                                "code_commit": emu.get("code_commit")}
        summary["emulation_vs_plain_fla_max"] = max(per.values()) if per else None
    result["checks_passed"] = all_passed({n: {b: s.get("checks", {"passed": False})
                                              for b, s in m.items()}
                                          for n, m in result["models"].items()}) and all(
        "error" not in s for m in result["models"].values() for s in m.values())
    return result


def resummarize(path, emulation, out, argv):
    """Recompute the summary of the decode result at ``path`` (no timing; e.g. with a newer
    emulation JSON; without one the stored emulation item stays) and write it to ``out``,
    noting when and from what. Every model and batch stored is summarised (``--models``,
    ``--batches`` do not apply)."""
    result = json.loads(Path(path).read_text())
    old = result.get("summary", {})
    summarize(result, emulation)
    if not emulation:  # keep the stored emulation item
        for key in ("emulation", "emulation_vs_plain_fla_max"):
            if key in old:
                result["summary"][key] = old[key]
    result.setdefault("resummarized", []).append(
        {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "from": str(path),
         "emulation": emulation, "command": "python benchmarks/decode.py " + " ".join(
             sys.argv[1:] if argv is None else argv)})
    Path(out).write_text(json.dumps(result, indent=1))
    return result


def apply_read_pass_overrides(specs) -> dict:
    """``--read-pass CONFIG=BV,W,FORM``: set ``replay.records.CONFIG["read_pass"]`` to
    ``(BV, W, FORM)`` for this process (a form of ``records.STEP_FORMS`` also drops the
    configuration's ``lean_records``). Returns ``{CONFIG: the configuration now}``; raises
    ValueError naming a bad specification, an unknown configuration or form."""
    recs = kr.records
    out = {}
    for spec in specs:
        name, sep, val = spec.partition("=")
        parts = val.split(",")
        if not sep or len(parts) != 3:
            raise ValueError(f"--read-pass takes CONFIG=BV,W,FORM, got {spec!r}")
        if not (name.endswith("_CONFIG") and isinstance(getattr(recs, name, None), dict)):
            raise ValueError(f"--read-pass: {name!r} is not a configuration of "
                             f"replay.records (e.g. GDN_STEP_F32_CONFIG)")
        try:
            bv, w = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"--read-pass: BV and W must be ints, got {spec!r}") from None
        if parts[2] not in recs.READ_FORMS:
            raise ValueError(f"--read-pass: form {parts[2]!r} is not one of {recs.READ_FORMS}")
        cfg = dict(getattr(recs, name), read_pass=(bv, w, parts[2]))
        if parts[2] in recs.STEP_FORMS:
            cfg.pop("lean_records", None)
        setattr(recs, name, cfg)
        out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}
    return out


def apply_flush_tma_overrides(specs) -> dict:
    """``--flush-tma SOLVE,V,K,FORMAT=DEPTH`` (or ``=none``): set (or drop) the key
    ``(bool(SOLVE), V, K, FORMAT)`` of ``replay.flush.FLUSH_ANCHOR_TMA``, the flushes whose
    default launch loads the anchor's tiles through a TMA descriptor with a row-tile loop of
    pipeline depth DEPTH (e.g. ``0,128,128,fp32=2``: GDN's fold of cached corrections, the
    ``fp32`` policy's flush). Returns the table now, its keys as strings; raises ValueError
    naming a malformed specification, a SOLVE other than 0 or 1, a non-positive V or K, a
    FORMAT the descriptor cannot load (fp32, fp16, bf16) or a DEPTH outside [1, 8]."""
    table = kr.flush.FLUSH_ANCHOR_TMA
    for spec in specs:
        key, sep, val = spec.partition("=")
        parts = key.split(",")
        if not sep or len(parts) != 4:
            raise ValueError(f"--flush-tma takes SOLVE,V,K,FORMAT=DEPTH (or =none), "
                             f"got {spec!r}")
        if parts[0] not in ("0", "1"):
            raise ValueError(f"--flush-tma: SOLVE must be 0 or 1, got {parts[0]!r}")
        try:
            V, K = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"--flush-tma: V and K must be ints, got {spec!r}") from None
        if V < 1 or K < 1:
            raise ValueError(f"--flush-tma: V and K must be positive, got {spec!r}")
        if parts[3] not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"--flush-tma: FORMAT must be fp32, fp16 or bf16 (what the "
                             f"descriptor loads), got {parts[3]!r}")
        k = (parts[0] == "1", V, K, parts[3])
        if val == "none":
            table.pop(k, None)
            continue
        if not (val.isascii() and val.isdigit() and 1 <= int(val) <= 8):
            raise ValueError(f"--flush-tma: DEPTH must be an int in [1, 8] or none, "
                             f"got {val!r}")
        table[k] = int(val)
    return {",".join(str(int(x) if isinstance(x, bool) else x) for x in k): d
            for k, d in table.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true",
                    help="CPU interpreter, tiny shapes, host timer (CI smoke)")
    ap.add_argument("--models", default="gdn,mamba2")
    ap.add_argument("--batches", default=None, help="comma list (default 1,64,256; tiny 1,2)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (default 50; tiny 1)")
    ap.add_argument("--warmup", type=int, default=None, help="extra warm-up calls (default 5)")
    ap.add_argument("--pool", type=int, default=0, help="sets per pool (0: >= 4 x L2; tiny 2)")
    ap.add_argument("--timing", default="both", choices=TIMING_MODES,
                    help="graph: CUDA-graph replays (the kernels' GPU time, as a serving engine "
                         "replaying its decode step sees it); eager: launched from Python each "
                         "call (host launch overhead included where it exceeds the GPU time); "
                         "both (default): both, each item's eager timing under 'eager'; the "
                         "summary then takes each aggregate's lower value of the two modes "
                         "(summary.graph, summary.eager: each mode alone)")
    ap.add_argument("--emulation", default=None, metavar="JSON",
                    help="a benchmarks/kl_throughput.py result (the issue's emulation item: "
                         "3.4B-shaped qwen3_5, N = 16384, fla installed); its worst policy's "
                         "emulate/plain ratio becomes summary.emulation_vs_plain_fla_max")
    ap.add_argument("--ref-seqs", type=int, default=0,
                    help="sequences checked against the reference flush (0: all)")
    ap.add_argument("--read-pass", action="append", default=[], metavar="CONFIG=BV,W,FORM",
                    help="time a step configuration of replay.records with another read pass "
                         "(e.g. GDN_STEP_F32_CONFIG=32,1,lean_one); a form that does the "
                         "records work in its read pass drops the configuration's "
                         "lean_records; recorded under 'overrides' (repeatable)")
    ap.add_argument("--flush-tma", action="append", default=[],
                    metavar="SOLVE,V,K,FORMAT=DEPTH",
                    help="time the flushes keyed SOLVE,V,K,FORMAT with the anchor's tiles "
                         "through a TMA descriptor at loop depth DEPTH, or with the ordinary "
                         "loads (=none): replay.flush.FLUSH_ANCHOR_TMA, e.g. 0,128,128,fp32=2 "
                         "for GDN's fp32 fold; the table is recorded under "
                         "'overrides' (repeatable)")
    ap.add_argument("--gdn-verify", default="triton", choices=("triton", "cuda"),
                    help="GDN's verify kernel: triton (gdn_verify_kernel, default) or cuda "
                         "(gdn_verify_cuda: the CUDA C++ kernel where it applies, the fp32 "
                         "policy; the Triton kernel elsewhere; needs nvcc)")
    ap.add_argument("--gdn-step", default="triton", choices=("triton", "cuda"),
                    help="GDN's step kernel: triton (gdn_step_kernel, default) or cuda "
                         "(gdn_step_cuda: the CUDA C++ kernel where it applies, FP32 and "
                         "NVFP4 read copies; the Triton kernel elsewhere; needs nvcc)")
    ap.add_argument("--gdn-flush", default="triton", choices=("triton", "cuda"),
                    help="GDN's flush kernel: triton (gdn_flush_kernel, default) or cuda "
                         "(gdn_flush_cuda: the CUDA C++ kernel where it applies, "
                         "read:nvfp4/rec:fp16[+sr]; the Triton kernel elsewhere; needs nvcc)")
    ap.add_argument("--resummarize", default=None, metavar="JSON",
                    help="time nothing: recompute the summary of this decode result (with "
                         "--emulation) and write it to --out")
    args = ap.parse_args(argv)
    global TIMING
    TIMING = args.timing
    if args.resummarize:
        if not Path(args.resummarize).is_file():
            ap.error(f"--resummarize: no such file {args.resummarize!r}")
        if args.emulation and not Path(args.emulation).is_file():
            ap.error(f"--emulation: no such file {args.emulation!r}")
        return resummarize(args.resummarize, args.emulation, args.out, argv)
    try:
        overrides = apply_read_pass_overrides(args.read_pass)
        if args.flush_tma:
            overrides["FLUSH_ANCHOR_TMA"] = apply_flush_tma_overrides(args.flush_tma)
    except ValueError as e:
        ap.error(str(e))
    global GDN_VERIFY
    GDN_VERIFY = args.gdn_verify
    if GDN_VERIFY == "cuda" and DEV != "cuda":
        ap.error("--gdn-verify cuda needs a CUDA device")
    global GDN_STEP
    GDN_STEP = args.gdn_step
    if GDN_STEP == "cuda" and DEV != "cuda":
        ap.error("--gdn-step cuda needs a CUDA device")
    global GDN_FLUSH
    GDN_FLUSH = args.gdn_flush
    if GDN_FLUSH == "cuda" and DEV != "cuda":
        ap.error("--gdn-flush cuda needs a CUDA device")
    if args.tiny != INTERPRET:
        raise SystemExit("--tiny needs TRITON_INTERPRET=1 set before triton is imported "
                         "(decode.py sets it when --tiny is on its command line)")
    L, T = (4, 2) if args.tiny else (16, 8)
    try:
        batches = [int(b) for b in (args.batches or ("1,2" if args.tiny else "1,64,256")).split(",")]
    except ValueError:
        ap.error(f"--batches must be a comma list of positive ints, got {args.batches!r}")
    if any(b < 1 for b in batches):
        ap.error(f"--batches must be positive, got {args.batches!r}")
    for name, v in (("--reps", args.reps), ("--warmup", args.warmup), ("--pool", args.pool),
                    ("--ref-seqs", args.ref_seqs)):
        if v is not None and v < 0:
            ap.error(f"{name} must be >= 0, got {v}")
    args.reps = args.reps or (1 if args.tiny else 50)
    args.pool = args.pool or (2 if args.tiny else 0)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 5)
    if args.tiny:
        geo = {"gdn": (2, 1, 16, 32), "mamba2": (2, 1, 16, 32)}  # (H, G, V, K)
    else:
        geo = {"gdn": (32, 16, 128, 128), "mamba2": (128, 1, 64, 128)}
    names = args.models.split(",")
    bad = [m for m in names if m not in geo]
    if bad or not names:
        ap.error(f"--models takes a comma list of {sorted(geo)}, got {args.models!r}")
    gfn, sfn, fla_ver, fla_reason = load_fla()
    fla_fns = (gfn, sfn) if gfn is not None else None
    commit = rk.git_commit()
    result = {"command": "python " + " ".join(sys.argv) if argv is None else
              "decode.main(" + repr(argv) + ")",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git_commit": commit,
              "code_commit": rk.code_commit(),
              "device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)",
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__, "fla": fla_ver,
                           "cuda": torch.version.cuda},
              "fla": {"available": fla_fns is not None, "skip_reason": fla_reason,
                      "gdn": "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
                      "mamba2": "fla.ops.simple_gla.fused_recurrent_simple_gla"},
              "overrides": overrides, "gdn_verify": GDN_VERIFY, "gdn_step": GDN_STEP,
              "gdn_flush": GDN_FLUSH,
              "window_L": L, "verify_T": T, "batches": batches, "policies": POLICIES,
              "timing": f"median of {args.reps} calls, CUDA events per call, pool rotated "
                        f"(>= {POOL_L2_MULTIPLE} x L2 = {POOL_L2_MULTIPLE * l2_bytes()} bytes); "
                        f"mode {args.timing!r}: " + {
                            "graph": "CUDA-graph replays of each call (GPU time)",
                            "eager": "Python launches per call (host overhead included where "
                                     "it exceeds the GPU time)",
                            "both": "CUDA-graph replays and eager launches; the summary takes "
                                    "each aggregate's lower value of the two (summary.graph, "
                                    "summary.eager: each mode alone)"}[args.timing]
                        if not args.tiny else "host timer (interpreter), not a measurement",
              "tolerance_outputs": f"mismatch = count of |got-ref| > {ATOL} + {RTOL} |ref|",
              "notes": ["step at h reads h + 1 records; amortised = (sum over h = 0..L-2 of "
                        "step + flush) / L", "the timed flush is the serving form: stored anchor in, "
                        "stored A and R out (dequantize=False), the flush token's S q, S not "
                        "written; GDN's correction solve is fused into the flush kernel; the "
                        "SR stream keys are packed inside the flush kernel (keys_in_kernel, the "
                        "default since 2026-12-01; before: checkpoint_streams, in the timing); "
                        "since 2026-12-02 (ninth pass) the flush of a policy with a "
                        "matrix-scaled copy (nvfp4) takes the default split_casts: the fp32 "
                        "flush writes S, then the quantizer kernels cast it, with the stream "
                        "keys of checkpoint_streams built in one launch (flush._split_keys, in "
                        "the timing); since 2026-12-04 both casts in one launch "
                        "(pack_pair_triton: the matrix-amax pass, then each tile once; "
                        "cast_form='pair'); since 2026-12-05 in the lean pair form "
                        "(cast_form='pair_lean') and, beside an fp16 / bf16 copy, with the "
                        "matrix amax taken by the fp32 flush as it writes S (flush_amax: S "
                        "read once); the flush's bytes and GB/s follow the traffic model "
                        "of the fused flush, which does not count the split's float32 S "
                        "(written once, read once or twice by the pair cast: 0.5-1 GiB more "
                        "at GDN's B = 256); since 2026-12-05 (thirty-third pass) with "
                        "return_w=False (FlushResult.w None: GDN's cached corrections are "
                        "folded unmasked, the kernel reading slots < length only, and its "
                        "solve does not write them out) and the per-sequence range checks "
                        "in one launch (codec._assert_ranges) instead of one torch kernel "
                        "per comparison",
                        "verify_T8_vs_step: worst start h over the mean FP32 non-flush step",
                        "verify timings include, for GDN, the clone/mask of the correction "
                        "buffer (the wrappers no longer synchronise with the host); under "
                        "--gdn-verify cuda (since 2026-12-06) the decode state's in-place "
                        "form instead: the corrections written from the start on into a "
                        "ring-shaped buffer (out=), the known ones not rewritten",
                        "summary[gdn|mamba2] is at the largest batch (the issue's targets are at"
                        " B = 256); by_batch has every batch"],
              "models": {}}

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    def log(*a):
        print(*a, flush=True)

    # device copy (bandwidth ceiling)
    nb = (1 << 16) if args.tiny else max(1 << 30, POOL_L2_MULTIPLE * l2_bytes())
    src = torch.randn(nb // 4, device=DEV)
    dst = torch.empty_like(src)
    # timed eagerly in every mode: one large launch (no host overhead to hide), and a CUDA
    # graph turns it into a memcpy node that ran at 2.7 instead of 4.2 TB/s on the H200
    # (794 against 508 us for 2 GiB, decode.py --timing both on 2026-12-01)
    copy = gbps(2 * nb, timer(lambda i: dst.copy_(src), 1, args.reps, args.warmup,
                              mode="eager"))
    copy["copy_exact"] = bool(torch.equal(dst, src))
    result["device_copy"] = copy
    src = dst = None
    log("copy", round(copy["GBps"], 1), "GB/s")
    for name in names:
        H, G, V, K = geo[name]
        for B in batches:
            M = rk.Model(name, B, H, G, V, K, L)
            try:
                r = run_shape(M, T, args, copy["GBps"], fla_fns, log)
            except Exception:  # noqa: BLE001
                r = {"error": traceback.format_exc()[-3000:]}
                log(r["error"])
            result["models"].setdefault(name, {})[f"B{B}"] = r
            save()
    summarize(result, args.emulation)
    save()
    # short table last
    log("== decode", result["device"], "checks passed:", result["checks_passed"])
    for name in names:
        for b, s in result["models"][name].items():
            if "error" in s:
                log(f"{name} {b}: ERROR")
                continue
            fla = s["baselines"]["fla_step"]
            log(f"{name} {b}: fla {fla['median_us'] if fla else float('nan'):.1f} us, "
                f"read-only {s['baselines']['read_only_fp32']['median_us']:.1f} us, " +
                ", ".join(f"{p}: step {r['step_mean_us']:.1f} flush "
                          f"{r['flush']['median_us']:.1f} amort {r['amortised_us']:.1f} "
                          f"verify<= {r['verify_max_us']:.1f}"
                          for p, r in s["policies"].items()))
        log(name, "summary", json.dumps(result["summary"].get(name)))
    return result


if __name__ == "__main__":
    out = main()
    sys.exit(0 if out["checks_passed"] else 1)  # a failed check or shape fails the command
