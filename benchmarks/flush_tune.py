"""Tune the flush kernel (issue 15): time every candidate launch configuration of
``_flush_kernel`` (variant x block_v x num_warps) at the issue's two B = 256 geometries and both
decode policies, check each against the default configuration, write JSON.

Geometries (``--tiny``: B = 2, small shapes, CPU interpreter, host timer, not a measurement):

* GDN: ``[B, 32 heads, 128 x 128]`` state, 16 key heads, L = 16 records;
* Mamba-2: ``[B, 128 heads, 64 x 128]``, 1 group, L = 16.

Policies (``--policies``): ``fp32`` and ``nvfp4`` (``read:nvfp4/rec:fp16+sr``) by default, or
any policy strings. The timed call is the serving flush
(``{gdn,mamba2}_flush_kernel``: stored anchor in, A and R out, the flush token's ``S q``, S not
written, ``dequantize=False``: no torch dequantisation of the new copies; GDN: the corrections
solved inside the flush kernel). Each configuration is warmed (compile + one call per pool set)
then timed as the median of ``--reps`` calls (CUDA events around each call), inputs rotated
over ``--pool`` sets of distinct buffers (at least 4 and at least 4 x L2 bytes), so L2 does not
flatter. The default configuration is also timed with ``dequantize=True`` (what
``benchmarks/decode.py`` measures: the wrapper then dequantises A and R in torch).
Each launch takes the flush's default anchor loads: since 2026-12-05 GDN's correction solve
against an FP32 anchor at 128 x 128 (the fp32 policy without its fold) loads them through a
TMA descriptor in the configurations the descriptor can take (``flush.FLUSH_ANCHOR_TMA``).

Checks, on pool set 0: every configuration's stored A and R are bit-identical (every byte) to
those of the first configuration of its reconstruct form (the default is the first of its
own), and its ``S q`` matches that one's to 1e-5 (atol and rtol); the first configuration of
each form (``store_state=True``) against the torch reference on the first
``--n-ref`` sequences: S to 1e-6, GDN corrections to 1e-5 (``core.solve_corrections``), A and
R bit-identical to ``core.cast_checkpoints`` of the kernel's S.

Compilation dominates a sweep, so ``--jobs`` processes first compile every configuration (one
B = 1 call each; Triton's on-disk cache then serves the timing process). ``--budget-s``
(default 150) bounds the timing, split evenly over the (model, policy) pairs: candidates are
tried in the order listed (most promising first) and the rest of a pair's are skipped (listed
in the JSON) once its share is spent.

Without ``--split-casts`` every policy times the fused flush (``split_casts=False``, also for
the matrix-scaled policies, whose kernel default is the split since the ninth pass).
``--split-casts`` times ``flush_kernel(split_casts=True)`` instead: the ``fp32`` flush writes
S (the configurations are those of the ``fp32`` flush), then the quantizer kernels cast it
(docs/kernels-replay.md "Eighth pass" and "Ninth pass"; a policy without a cast, ``fp32``,
runs the fused flush as always; the split ignores ``keys_in_kernel``, its casts' keys coming
from one launch, so under ``--split-casts`` ``default_host_keys`` is the default call again).

Usage::

    python benchmarks/flush_tune.py --out benchmarks/results/flush_tune_h200.json
    python benchmarks/flush_tune.py --tiny --out /tmp/flush_tune_tiny.json  # CPU interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if "--tiny" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from replayssm_quant.capabilities import triton_interpreting  # noqa: E402
from replayssm_quant.checkpoints import checkpoint_streams  # noqa: E402
from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.kernels.replay.flush import (DEFAULT_BV_FLUSH, DEFAULT_VARIANT,  # noqa: E402
                                                  DEFAULT_WARPS_FLUSH, flush_launch,
                                                  flush_needs_amax)
from replayssm_quant.policy import StatePolicy  # noqa: E402
from replayssm_quant.quant import PackedTensor, pack  # noqa: E402
from replayssm_quant.replay import core, gdn_flush, mamba2_flush  # noqa: E402
from replayssm_quant.config import GDNFold  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402  (timer, sub: the decode benchmark's)
from _commit import code_commit  # noqa: E402

INTERPRET = triton_interpreting()
DEV = "cpu" if INTERPRET else "cuda"
SEED = 0x1234_5678_9ABC
POLICIES = {"fp32": "fp32", "nvfp4": "read:nvfp4/rec:fp16+sr"}


def policy_string(pname: str) -> str:
    """A ``--policies`` entry: a name of ``POLICIES`` or a policy string itself."""
    return POLICIES.get(pname, pname)


def need_amax(pname: str) -> bool:
    """Whether the policy's flush needs the matrix amax (``flush.flush_needs_amax``)."""
    return flush_needs_amax(StatePolicy.parse(policy_string(pname)))
TOL = 1e-5
# the targets (3 x the FP32 non-flush step of benchmarks/results/decode_h200_baseline)
TARGET_US = {"gdn": 850.0, "mamba2": 1000.0}


class Geo:
    def __init__(self, name, B, H, G, V, K, L):
        self.name, self.B, self.H, self.G, self.V, self.K, self.L = name, B, H, G, V, K, L
        self.gdn = name == "gdn"
        self.fold_cached = False  # GDN: fold cached corrections (--fold-cached), no solve

    @property
    def solves(self):
        """Whether the timed flush solves GDN's corrections in the kernel."""
        return self.gdn and not self.fold_cached

    def as_dict(self):
        return {n: getattr(self, n) for n in ("B", "H", "G", "V", "K", "L")}


def geometries(tiny, fold_cached=False):
    if tiny:
        geos = [Geo("gdn", 2, 4, 2, 40, 32, 4), Geo("mamba2", 2, 4, 1, 24, 32, 4)]
    else:
        geos = [Geo("gdn", 256, 32, 16, 128, 128, 16), Geo("mamba2", 256, 128, 1, 64, 128, 16)]
    for M in geos:
        M.fold_cached = bool(fold_cached) and M.gdn
    return geos


FORMS = ("dot", "rank1", "tf32x3", "dot_full", "tf32x3_full", "dot+inverse", "tf32x3+inverse",
         "dot_full+inverse", "tf32x3_full+inverse")


def candidates(V, tiny, need_amax=False, gdn=False, forms=None, slots=16):
    """(variant, block_v, num_warps, reconstruct), most promising first; the default of a call
    (``flush.flush_launch`` with the geometry's record slots) first, then the rest (each form's
    first is the one its other configurations are compared with bit for bit). One tile per
    matrix (block_v >= V) is the same kernel for both variants (listed as "grid"). ``gdn``: also the dot forms with the
    correction solve by the inverse (``"dot+inverse"``, ``"tf32x3+inverse"``: reconstruct
    form + ``solve_form``). ``forms``: keep only these reconstruct forms (and the default)."""
    single = max(16, triton.next_power_of_2(V))
    if tiny:  # the call default (one tile), then several tiles of each variant and form
        cands = [("grid", 16, 4, "rank1"), ("loop", 16, 4, "dot"), ("loop", 16, 4, "tf32x3_full")]
    else:
        cands = [(DEFAULT_VARIANT, DEFAULT_BV_FLUSH, DEFAULT_WARPS_FLUSH, "dot")]
        cands += [c + ("rank1",) for c in (
            ("loop", 32, 4), ("grid", single, 4), ("grid", single, 8), ("grid", 64, 4),
            ("grid", 32, 4), ("loop", 64, 4), ("grid", 16, 4), ("grid", 32, 2), ("loop", 16, 2),
            ("grid", 64, 8))]
        cands += [c + ("tf32x3",) for c in (
            ("grid", single, 4), ("grid", single, 8), ("grid", 64, 4), ("loop", 32, 4),
            ("grid", 32, 4), ("loop", 64, 8), ("grid", 64, 8))]
        cands += [c + ("dot",) for c in (
            ("grid", single, 8), ("grid", single, 16), ("grid", 64, 4), ("grid", 16, 4),
            ("loop", 32, 4), ("grid", 32, 8), ("grid", single, 4), ("loop", 64, 8),
            ("grid", 64, 8), ("loop", 16, 4))]
        # the dot forms on whole [BV, K] tiles (2026-12-02, thirteenth session)
        cands += [c + ("tf32x3_full",) for c in (
            ("loop", 32, 4), ("grid", single, 8), ("grid", 64, 4), ("loop", 64, 4),
            ("grid", 32, 4), ("loop", 16, 4), ("loop", 32, 2), ("grid", single, 4),
            ("loop", 64, 8), ("grid", 16, 2), ("loop", 32, 1), ("loop", 16, 2), ("loop", 64, 2),
            ("grid", 32, 2), ("loop", 16, 1))]
        cands += [c + ("dot_full",) for c in (
            ("loop", 32, 4), ("grid", 64, 4), ("grid", single, 8), ("loop", 16, 2))]
    if gdn:
        cands += [c + ("dot+inverse",) for c in (
            ("loop", 32, 4), ("grid", single, 8), ("loop", 64, 4), ("grid", 32, 4),
            ("grid", single, 4))]
        cands += [c + ("tf32x3+inverse",) for c in (
            ("loop", 32, 4), ("grid", single, 8), ("grid", single, 4))]
        cands += [c + ("tf32x3_full+inverse",) for c in (
            ("loop", 32, 4), ("loop", 64, 4), ("grid", single, 8), ("grid", 64, 4),
            ("loop", 16, 4), ("grid", 32, 4), ("loop", 32, 2), ("loop", 16, 2), ("loop", 64, 2))]
        cands += [c + ("dot_full+inverse",) for c in (
            ("loop", 64, 4), ("loop", 32, 4), ("grid", single, 8), ("loop", 32, 2),
            ("loop", 64, 2))]
    if tiny and gdn:
        cands += [("loop", 16, 4, "dot+inverse")]
    out = []
    default = launch_cfg(V, need_amax, gdn, slots)  # what flush_kernel runs
    for var, bv, nw, form in [default] + cands:
        if bv >= V:  # one tile: the variants coincide; the smallest such block
            var, bv = "grid", single
        if (var, bv, nw, form) not in out:
            out.append((var, bv, nw, form))
    if forms is not None:  # the default (the reference of its form) and the forms asked for
        out = out[:1] + [c for c in out[1:] if c[3] in forms]
    return out


def l2_bytes():
    if DEV != "cuda":
        return 1 << 16
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20))


def nbytes(t):
    if t is None:
        return 0
    if isinstance(t, PackedTensor):
        return sum(nbytes(x) for x in (t.codes, t.block_scales, t.matrix_scale))
    return t.numel() * t.element_size()


def make_set(M, gen, policy):
    """A stored anchor (the policy's rec format, packed with SR streams) and L records."""
    B, H, G, V, K, L = M.B, M.H, M.G, M.V, M.K, M.L
    S = torch.randn(B, H, V, K, generator=gen, device=DEV) * (0.3 if M.gdn else 1.0)
    streams = torch.arange(B * H, device=DEV).view(B, H)
    A = S if policy.rec.is_identity else pack(S, policy.rec, seed=SEED, stream=streams,
                                              backend="triton")
    del S
    la = torch.log(0.9 + 0.0999 * torch.rand(B, L, H, generator=gen, device=DEV))
    k = torch.randn(B, L, G, K, generator=gen, device=DEV)
    k = torch.nn.functional.normalize(k, dim=-1) if M.gdn else k / K ** 0.5
    v = torch.randn(B, L, H, V, generator=gen, device=DEV)
    beta = torch.sigmoid(torch.randn(B, L, H, generator=gen, device=DEV))
    q = torch.nn.functional.normalize(torch.randn(B, G, K, generator=gen, device=DEV), dim=-1)
    st = {"A": A, "la": la, "k": k, "v": v, "beta": beta, "q": q * K ** -0.5,
          "length": torch.full((B,), L, dtype=torch.int64, device=DEV)}
    if M.fold_cached:  # cached corrections to fold (their values do not change the timing)
        st["u"] = torch.randn(B, L, H, V, generator=gen, device=DEV) * 0.1
    return st


def set_bytes(st):
    return sum(nbytes(t) for t in st.values())


def flush_kw(M, split_casts=False):
    """Stream and launch keywords of a timed flush; ``split_casts`` explicit (the kernel's
    default splits the casts of matrix-scaled policies, which would change what is tuned)."""
    return dict(seed=SEED, layer=0, sequence_ids=torch.arange(M.B, device=DEV) * 3 + 1,
                flush_index=torch.ones(M.B, dtype=torch.int64, device=DEV),
                split_casts=split_casts)


def launch_cfg(V, need_amax, gdn, slots):
    """The launch ``flush_kernel`` runs by default (``flush.flush_launch``) as
    :func:`run_flush`'s ``cfg``: ``(variant, block_v, num_warps, form)``, the form
    ``"<reconstruct>+inverse"`` where GDN's solve (``gdn``) takes the inverse."""
    dv, db, dw, dr, ds = flush_launch(V, need_amax, gdn, slots)
    return dv, db, dw, dr + ("+inverse" if gdn and ds == "inverse" else "")


def run_flush(M, st, policy, fk, cfg, store_state=False, dequantize=False,
              keys_in_kernel=None, **launch):
    """The flush of set ``st`` in launch ``cfg`` (``(variant, block_v, num_warps, form)``);
    ``launch``: further options of the flush call (e.g. ``anchor_tma``)."""
    var, bv, nw, form = cfg
    # "dot+inverse": reconstruct + solve_form; a bare form solves by substitution
    form, _, solve_form = form.partition("+")
    # return_w: the timed serving form (store_state False) skips FlushResult.w, as
    # decode.run_flush does; the checked store-state form returns it
    kw = dict(q=st["q"], store_state=store_state, dequantize=dequantize, block_v=bv,
              num_warps=nw, variant=var, keys_in_kernel=keys_in_kernel, reconstruct=form,
              solve_form=solve_form or "substitution", return_w=store_state, **fk, **launch)
    if M.gdn:
        if M.fold_cached:
            kw.update(u_cached=st["u"], fold_cached_corrections=True)
        return kr.gdn_flush_kernel(st["A"], st["la"], st["beta"], st["v"], st["k"],
                                   st["length"], policy, **kw)
    return kr.mamba2_flush_kernel(st["A"], st["la"], st["v"], st["k"], st["length"], policy,
                                  **kw)


def _precompile(task):
    """Worker (a spawned process): compile one configuration by running it once at B = 1 (the
    kernels' specialisation does not depend on B), so the main process loads it from Triton's
    on-disk cache. Returns ``(task, seconds, error or None)``."""
    name, pname, cfg, tiny, store, fold_cached = task
    t = time.perf_counter()
    try:
        M = next(m for m in geometries(tiny, fold_cached) if m.name == name)
        M.B = 1
        policy = StatePolicy.parse(policy_string(pname))
        st = make_set(M, torch.Generator(device=DEV).manual_seed(0), policy)
        run_flush(M, st, policy, flush_kw(M), cfg, store_state=store, dequantize=store)
        if DEV == "cuda":
            torch.cuda.synchronize()
        return task, time.perf_counter() - t, None
    except Exception as e:  # noqa: BLE001
        return task, time.perf_counter() - t, f"{type(e).__name__}: {str(e)[:300]}"


def precompile(tasks, jobs):
    """Compile ``tasks`` in ``jobs`` spawned processes (Triton's cache is on disk)."""
    import concurrent.futures as cf
    import multiprocessing as mp

    t = time.perf_counter()
    errors = []
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        for task, _, err in ex.map(_precompile, tasks):
            if err:
                errors.append({"model": task[0], "policy": task[1], "config": list(task[2]),
                               "error": err})
    return {"tasks": len(tasks), "jobs": jobs, "seconds": time.perf_counter() - t,
            "errors": errors}


def stored_diff(a, b):
    """Differing bytes of two stored copies (PackedTensor buffers or FP32 tensors)."""
    if isinstance(a, PackedTensor):
        n = 0
        for x, y in ((a.codes, b.codes), (a.block_scales, b.block_scales),
                     (a.matrix_scale, b.matrix_scale)):
            if x is not None:
                n += int((x.contiguous().view(torch.uint8)
                          != y.contiguous().view(torch.uint8)).sum())
        return n
    return int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())


def close_stats(got, want, tol):
    d = (got - want).abs()
    bad = d > tol + tol * want.abs()
    return {"max_abs": float(d.max()) if d.numel() else 0.0, "mismatch": int(bad.sum()),
            "nan": int(torch.isnan(got).sum())}


def reference_check(M, st, policy, fk, cfg, n_ref):
    """The store-state flush of ``cfg`` against the torch reference (first ``n_ref``
    sequences)."""
    res, y = run_flush(M, st, policy, fk, cfg, store_state=True, dequantize=True)
    s = n_ref
    fs = {n: t[:s] for n, t in fk.items() if n in ("sequence_ids", "flush_index")}
    kw = dict(seed=fk["seed"], layer=fk["layer"], **fs)
    A = st["A"] if isinstance(st["A"], torch.Tensor) else dc.sub(st["A"], s).dequantize()
    A = A[:s]
    length = st["length"][:s]
    if M.gdn:
        fold = GDNFold.CACHED if M.fold_cached else GDNFold.RECOMPUTE
        ref = gdn_flush(A, st["la"][:s], st["beta"][:s], st["v"][:s], st["k"][:s], policy,
                        length=length, u_cached=st["u"][:s] if M.fold_cached else None,
                        fold=fold, store=True, **kw)
    else:
        ref = mamba2_flush(A, st["la"][:s], st["v"][:s], st["k"][:s], policy, length=length,
                           store=True, **kw)
    out = {"sequences": s, "state": close_stats(res.state[:s], ref.state, 1e-6),
           "flush_token_output": close_stats(
               y[:s], core.matvec(ref.state, core.expand_heads(st["q"][:s], M.H, 1)), TOL)}
    if M.gdn:
        out["corrections"] = close_stats(res.w[:s], ref.w, TOL)
    want = core.cast_checkpoints(res.state[:s], policy, store=True, **kw)
    cps = res.checkpoints
    out["anchor_bytes_differ"] = stored_diff(dc.sub(cps.anchor_stored, s), want.anchor_stored)
    out["read_bytes_differ"] = stored_diff(dc.sub(cps.read_stored, s), want.read_stored)
    out["passed"] = (out["state"]["mismatch"] == 0 and out["state"]["nan"] == 0
                     and out["flush_token_output"]["mismatch"] == 0
                     and out.get("corrections", {"mismatch": 0})["mismatch"] == 0
                     and out["anchor_bytes_differ"] == 0 and out["read_bytes_differ"] == 0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU interpreter, tiny shapes")
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--reps", type=int, default=None, help="timed calls (default 25; tiny 2)")
    ap.add_argument("--pool", type=int, default=0, help="sets per pool (0: >= 4 and >= 4 x L2)")
    ap.add_argument("--n-ref", type=int, default=None,
                    help="sequences checked against the torch reference (default 4; tiny 2)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds of configuration timing, split evenly over the (model, "
                         "policy) pairs; the rest of a pair's candidates are skipped once its "
                         "share is spent (default 150; tiny: no limit)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes that compile the configurations first (default: CPU "
                         "count, at most 12; 0: compile in the timing loop; tiny: 0)")
    ap.add_argument("--models", default="gdn,mamba2", help="comma list of gdn, mamba2")
    ap.add_argument("--policies", default="fp32,nvfp4",
                    help="comma list of policies: fp32, nvfp4 (read:nvfp4/rec:fp16+sr) or "
                         "policy strings")
    ap.add_argument("--split-casts", action="store_true",
                    help="time flush_kernel(split_casts=True): the fp32 flush writes S, then "
                         "the quantizer kernels cast it; the configurations are those of the "
                         "fp32 flush; compiles in the timing loop (no --jobs)")
    ap.add_argument("--fold-cached", action="store_true",
                    help="GDN: time the flush that folds cached corrections (no solve; what a "
                         "single-checkpoint policy's decode state runs, GDNFold.folds_cached) "
                         "with the launch candidates of a flush without a solve")
    ap.add_argument("--forms", default=None,
                    help="comma list of reconstruct forms to time besides the default "
                         f"(of {', '.join(FORMS)}; default: all; 'default': the default "
                         "configuration only)")
    args = ap.parse_args()
    if not args.models or any(m not in ("gdn", "mamba2") for m in args.models.split(",")):
        ap.error(f"--models takes a comma list of gdn, mamba2, got {args.models!r}")
    if args.reps is not None and args.reps < 1:
        ap.error(f"--reps must be a positive int, got {args.reps}")
    if args.split_casts and args.jobs:
        ap.error(f"--split-casts compiles in the timing loop; drop --jobs {args.jobs}")
    if args.budget_s is not None and not args.budget_s > 0:
        ap.error(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    forms = (None if args.forms is None else [] if args.forms == "default"
             else args.forms.split(","))
    for pname in args.policies.split(","):
        try:
            StatePolicy.parse(policy_string(pname))
        except ValueError as e:
            ap.error(f"--policies: {pname!r} is neither fp32, nvfp4 nor a policy string ({e})")
    if forms is not None and args.forms != "default" and any(f not in FORMS for f in forms):
        ap.error(f"--forms takes a comma list of {FORMS}, or 'default' alone, got "
                 f"{args.forms!r}")
    if args.tiny != INTERPRET:
        raise SystemExit("--tiny needs TRITON_INTERPRET=1 (set when --tiny is on the command "
                         "line); without --tiny run on CUDA with TRITON_INTERPRET unset")
    reps = args.reps or (2 if args.tiny else 25)
    n_ref = args.n_ref or 2
    if not args.tiny:
        n_ref = args.n_ref or 4
    budget = args.budget_s if args.budget_s is not None else (float("inf") if args.tiny
                                                              else 150.0)
    pairs = len(args.models.split(",")) * len(args.policies.split(","))
    t_start = time.perf_counter()
    out = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (interpreter)",
           "versions": {"torch": torch.__version__, "triton": triton.__version__,
                        "python": platform.python_version(),
                        "cuda": torch.version.cuda},
           "command": " ".join(sys.argv), "code_commit": code_commit(),
           "default": "flush.flush_launch(V, need_amax, gdn, L): the first configuration of each "
                      "(model, policy)",
           "timing": (f"median of {reps} calls, CUDA events per call, inputs rotated over the "
                      "pool, one warm-up call per set" if not args.tiny else
                      "host timer (interpreter), not a measurement"),
           "timed_call": "serving flush: stored anchor in, A and R out, S q, store_state=False, "
                         "dequantize=False (GDN: corrections solved in the flush kernel)",
           "targets_us": TARGET_US, "models": {}, "skipped": [],
           "notes": ["passed: stored A and R bit-identical to those of the first configuration "
                     "of the same reconstruct form (every byte; the default is the first of "
                     "its form; each form's first is checked against the torch reference as "
                     "reference_check (dot) or reference_check_<form>) and S q to 1e-5"
                     if not args.tiny else
                     "tiny (interpreter): tl.dot is numpy's matmul, whose summation order "
                     "depends on the shapes, so A and R may differ across block_v in their "
                     "last bits; passed checks S q only (A, R differences are listed); on "
                     "CUDA the FP32 FMA dot sums in slot order and A, R must be identical"]}
    if args.fold_cached:
        out["fold_cached"] = True
        out["timed_call"] += ("; --fold-cached: GDN folds cached corrections (no solve), the "
                              "candidates of a flush without a solve")
    models = args.models.split(",")
    jobs = args.jobs if args.jobs is not None else (0 if args.tiny
                                                    else min(12, os.cpu_count() or 1))
    if args.split_casts:  # the workers would compile the fused kernels; compile while timing
        jobs = 0
        out["split_casts"] = True
        out["notes"].append("split_casts: flush_kernel(split_casts=True); each configuration "
                            "is the fp32 flush's launch, then pack_triton casts S twice (the "
                            "casts' keys of checkpoint_streams, built in one launch by "
                            "flush._split_keys since the ninth pass; the split ignores "
                            "keys_in_kernel, so default_host_keys times the default call; a "
                            "policy without a cast runs the fused flush)")

    def amax_of(pname):  # the launch resolution: the fp32 flush's under --split-casts
        return need_amax(pname) and not args.split_casts

    if jobs > 0:
        geos = geometries(args.tiny, args.fold_cached)
        tasks = [(M.name, pname, cfg, args.tiny, False, args.fold_cached) for M in geos
                 if M.name in models for pname in args.policies.split(",")
                 for cfg in candidates(M.V, args.tiny, amax_of(pname), M.solves, forms, M.L)]
        tasks += [(M.name, pname,
                   candidates(M.V, args.tiny, amax_of(pname), M.solves, forms, M.L)[0],
                   args.tiny, True, args.fold_cached)
                  for M in geos if M.name in models
                  for pname in args.policies.split(",")]  # the reference check's S-writing form
        try:
            out["precompile"] = precompile(tasks, jobs)
        except Exception as e:  # noqa: BLE001  (fall back to compiling in the timing loop)
            out["precompile"] = {"error": f"{type(e).__name__}: {e}"}
        print("precompile:", {k: v for k, v in out["precompile"].items() if k != "errors"},
              "errors:", len(out["precompile"].get("errors", [])), flush=True)
    for M in geometries(args.tiny, args.fold_cached):
        if M.name not in models:
            continue
        fk = flush_kw(M, split_casts=bool(args.split_casts))
        mres = out["models"][M.name] = {"geometry": M.as_dict(), "policies": {}}
        # what checkpoints.checkpoint_streams costs (on the host, a device-to-host copy of the
        # sequence ids then a pinned copy back, or from 1024 matrices on the device): the keys
        # of keys_in_kernel=False (default_host_keys); the fused default packs them in the
        # kernel, the split builds its casts' keys in one launch (flush._split_keys)
        mres["stream_keys"] = dc.timer(lambda i: checkpoint_streams(
            layer=0, sequence_ids=fk["sequence_ids"], heads=M.H,
            flush_index=fk["flush_index"]), 1, reps, 0)
        for pname in args.policies.split(","):
            policy = StatePolicy.parse(policy_string(pname))
            gen = torch.Generator(device=DEV).manual_seed(1000 + len(out["models"]))
            probe = make_set(M, gen, policy)
            per = set_bytes(probe)
            n = args.pool or max(4, -(-4 * l2_bytes() // per))
            pool = [probe] + [make_set(M, gen, policy) for _ in range(n - 1)]
            pres = mres["policies"][pname] = {"policy": policy_string(pname), "pool": n,
                                              "set_bytes": per, "configs": []}
            # nvfp4: a matrix scale
            cands = candidates(M.V, args.tiny, amax_of(pname), M.solves, forms, M.L)
            default = cands[0]
            firsts = {}  # reconstruct form -> its first configuration
            for c in cands:
                firsts.setdefault(c[3], c)
            t_pair = time.perf_counter()
            bases = {}
            for form, first in firsts.items():
                key = "reference_check" if form == "dot" else f"reference_check_{form}"
                try:
                    pres[key] = reference_check(M, probe, policy, fk, first, n_ref)
                    pres[key]["config"] = list(first)
                except Exception as e:  # noqa: BLE001
                    pres[key] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
                try:
                    bases[form] = run_flush(M, probe, policy, fk, first)
                except Exception as e:  # noqa: BLE001
                    pres.setdefault("errors", []).append(
                        f"{form} first configuration failed: {type(e).__name__}: {e}")
            if default[3] not in bases:  # the default configuration failed
                print(M.name, pname, pres.get("errors"), flush=True)
                continue
            for cfg in cands:
                entry = {"variant": cfg[0], "block_v": cfg[1], "num_warps": cfg[2],
                         "reconstruct": cfg[3]}
                if cfg not in firsts.values() and time.perf_counter() - t_pair > budget / pairs:
                    out["skipped"].append({"model": M.name, "policy": pname, **entry})
                    continue
                if cfg[3] not in bases:
                    continue
                base_res, base_y = bases[cfg[3]]
                try:
                    res, y = run_flush(M, probe, policy, fk, cfg)
                    cps, bcp = res.checkpoints, base_res.checkpoints
                    entry["anchor_bytes_differ"] = stored_diff(cps.anchor_stored,
                                                               bcp.anchor_stored)
                    entry["read_bytes_differ"] = stored_diff(cps.read_stored, bcp.read_stored)
                    entry["flush_token_output"] = close_stats(y, base_y, TOL)
                    entry["passed"] = (entry["flush_token_output"]["mismatch"] == 0
                                       and (args.tiny or (entry["anchor_bytes_differ"] == 0
                                                          and entry["read_bytes_differ"] == 0)))
                    del res, y
                    entry.update(dc.timer(lambda i, cfg=cfg: run_flush(M, pool[i], policy, fk,
                                                                       cfg), n, reps, 0))
                except Exception as e:  # noqa: BLE001  (a config that fails to compile/run)
                    entry["passed"] = False
                    entry["error"] = f"{type(e).__name__}: {str(e)[:500]}"
                pres["configs"].append(entry)
                print(f"{M.name:7s} {pname:6s} {cfg[0]:5s} bv={cfg[1]:4d} w={cfg[2]:2d} {cfg[3]:5s} "
                      f"{entry.get('median_us', float('nan')):10.1f} us "
                      f"{'ok' if entry['passed'] else 'FAIL ' + entry.get('error', '')}",
                      flush=True)
            try:
                pres["default_with_dequantize"] = dc.timer(
                    lambda i: run_flush(M, pool[i], policy, fk, default, dequantize=True), n,
                    reps, 0)
            except Exception as e:  # noqa: BLE001
                pres["default_with_dequantize"] = {"error": f"{type(e).__name__}: {e}"}
            try:  # the stream keys of checkpoint_streams (the call default packs them in kernel)
                pres["default_host_keys"] = dc.timer(
                    lambda i: run_flush(M, pool[i], policy, fk, default, keys_in_kernel=False),
                    n, reps, 0)
                r0, _ = run_flush(M, pool[0], policy, fk, default)
                r1, _ = run_flush(M, pool[0], policy, fk, default, keys_in_kernel=False)
                pres["default_host_keys"]["same_bytes"] = (
                    stored_diff(r1.checkpoints.anchor_stored, r0.checkpoints.anchor_stored) == 0
                    and stored_diff(r1.checkpoints.read_stored, r0.checkpoints.read_stored) == 0)
            except Exception as e:  # noqa: BLE001
                pres["default_host_keys"] = {"error": f"{type(e).__name__}: {e}"}
            ok = [c for c in pres["configs"] if c.get("passed") and "median_us" in c]
            if ok:
                best = min(ok, key=lambda c: c["median_us"])
                pres["best"] = {k: best[k] for k in ("variant", "block_v", "num_warps",
                                                     "reconstruct", "median_us")}
                pres["best"]["vs_target"] = best["median_us"] / TARGET_US[M.name]
            pool = probe = base_res = base_y = bases = None  # free before the next pair
            if DEV == "cuda":
                torch.cuda.empty_cache()
    out["wall_s"] = time.perf_counter() - t_start
    print()
    print(f"{'model':7s} {'policy':6s} {'best config':22s} {'us':>9s} {'target':>7s} "
          f"{'default':>9s} {'+dequant':>9s} ref")
    for mname, m in out["models"].items():
        for pname, p in m["policies"].items():
            b = p.get("best", {})
            d = next((c for c in p["configs"] if "median_us" in c), {})
            cfg = (f"{b.get('variant')} bv={b.get('block_v')} w={b.get('num_warps')} "
                   f"{b.get('reconstruct')}")
            print(f"{mname:7s} {pname:6s} {cfg:22s} {b.get('median_us', float('nan')):9.1f} "
                  f"{TARGET_US[mname]:7.0f} {d.get('median_us', float('nan')):9.1f} "
                  f"{p.get('default_with_dequantize', {}).get('median_us', float('nan')):9.1f} "
                  + " ".join(f"{k.removeprefix('reference_check').lstrip('_') or 'ref'}:"
                             f"{'ok' if v.get('passed') else 'FAIL'}"
                             for k, v in p.items() if k.startswith("reference_check")))
    if out["skipped"]:
        print(f"skipped {len(out['skipped'])} configurations (budget {budget:.0f} s)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out, f"({out['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
