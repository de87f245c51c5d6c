"""Launch options of the anchor-chain kernel (``kernels.replay.anchor_chain``) at the shape of
issue 15's emulation item: one 4096-token segment (B = 1, L = 16) of a GDN layer with 32 value
heads (``gdn``) or 40 (``qwen3_5``: the 3.4B random model ``kl_throughput.py --hidden 2560``
builds), 128 x 128 state, and of a ``nemotron_h``-shaped Mamba-2 layer (128 heads, 64 x 128),
for the launches the teacher-forced window form makes:

* ``fp32`` and ``shared:nvfp4+sr`` (single-checkpoint policies): the chain writes every output
  (``q`` given, last anchor only);
* ``rec:fp32``, ``rec:fp16+sr``, ``rec:nvfp4+sr`` (the anchors of dual policies): states
  stored, no outputs.

For each case every configuration (``--set launch``: ``prefetch``, the amax ``exchange`` of
split tiles, value rows per program, warps; ``--set regs``: the register cap ``maxnreg``) is timed
(median of CUDA events over ``--reps`` calls) and its states, anchors and outputs compared bit
for bit with the first launch's (``same_bits``; ``prefetch``, ``exchange`` and ``maxnreg`` must
not change a bit; another tile shape may: the in-tile reduction order follows the register
layout). On the device each row also has the compiled kernel's registers and spills.

Usage (device)::

    python benchmarks/chain_tune.py --out $OUT/chain_tune_h200.json

``--check-batch 2`` times nothing: every sequence of a two-sequence launch against itself
alone, bit for bit (at 32 GDN heads the two launches get different register caps).
``--tiny`` runs small shapes on CPU under the Triton interpreter (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from replayssm_quant.kernels import replay as kr  # noqa: E402
from replayssm_quant.replay import core  # noqa: E402
from replayssm_quant.replay import window_fast as WF  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402  (timer, git_commit: the decode benchmark's)

CASES = {  # name: (anchor format, outputs written in the chain)
    "fp32": ("fp32", True),
    "shared:nvfp4+sr": ("nvfp4+sr", True),
    "rec:fp32": ("fp32", False),
    "rec:fp16+sr": ("fp16+sr", False),
    "rec:nvfp4+sr": ("nvfp4+sr", False),
    # where an fp8 / nvfp4 anchor's time goes (--cases): RTN casts, an elementwise cast with
    # the matrix amax exchange (fp8), the block cast (nvfp4)
    "rec:fp16": ("fp16", False),
    "rec:fp8e4m3": ("fp8e4m3", False),
    "rec:nvfp4": ("nvfp4", False),
}
DEFAULT_CASES = ["fp32", "shared:nvfp4+sr", "rec:fp32", "rec:fp16+sr", "rec:nvfp4+sr"]
# (prefetch, exchange, block_v (None: chain_block_v), num_warps, maxnreg); None: the default,
# maxnreg "auto": resident_maxnreg. --set launch: the first is the first form (no prefetch,
# the counter exchange, no register cap) at the default tile; --set regs: register caps.
W0 = kr.CHAIN_WARPS
SETS = {
    "launch": [(False, "counter", None, W0, None), (True, "counter", None, W0, None),
               (False, "slots", None, W0, None), (True, "slots", None, W0, None),
               (None, None, None, W0, "auto"), (True, "slots", None, 2, None),
               (True, "slots", None, 8, None)],
    "regs": [(None, None, None, W0, None), (None, None, None, W0, "auto"),
             (None, None, None, W0, 168), (None, None, None, W0, 128)],
    "tiles": [(None, None, None, W0, "auto"), (None, None, 32, 4, "auto"),
              (None, None, 32, 8, "auto"), (None, None, 8, 4, "auto")],
}


def geometries(tiny):
    """(name, B, T, H, V, K, L, gdn). ``qwen3_5``: the 3.4B random model of
    ``kl_throughput.py --hidden 2560`` (40 value heads); ``gdn``: 32 value heads."""
    if tiny:
        return [("gdn", 1, 16, 2, 8, 32, 4, True), ("mamba2", 1, 16, 2, 8, 32, 4, False)]
    return [("gdn", 1, 4096, 32, 128, 128, 16, True),
            ("qwen3_5", 1, 4096, 40, 128, 128, 16, True),
            ("mamba2", 1, 4096, 128, 64, 128, 16, False)]


def make_inputs(geo, dev, seed=0, decay="slow"):
    """Random records; ``decay="slow"``: per-token decays in [0.9, 0.9999]; ``"model"``: as
    a randomly initialised qwen3_5 GDN layer (log decay ``-A softplus(a + 1)``, A ~ U(0.01,
    16) per head as transformers initialises ``A_log``): most heads forget within a token or
    two, so the state holds many tiny values."""
    _, B, T, H, V, K, L, gdn = geo
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device=dev)  # noqa: E731
    if decay == "model":
        A = 0.01 + (16 - 0.01) * torch.rand(H, generator=g, device=dev)
        la = -A * torch.nn.functional.softplus(1.0 + 0.3 * r(B, T, H))
    else:
        la = torch.log(0.9 + 0.0999 * torch.rand(B, T, H, generator=g, device=dev))
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    beta = torch.sigmoid(r(B, T, H)) if gdn else None
    A0 = r(B, H, V, K) * 0.3
    NW = T // L
    keys = WF._stream_keys(1, torch.arange(B), H, torch.arange(1, NW + 1)[None].expand(B, -1),
                           core.ANCHOR_COPY)
    return dict(anchor=A0, la=la, k=k, v=v, beta=beta, q=q, streams=keys)


def run(geo, x, case, cfg):
    spec, out = CASES[case]
    pf, ex, bv, nw, mr = cfg
    return kr.anchor_chain(x["anchor"], x["la"], x["k"], x["v"], x["beta"], spec, L=geo[6],
                           seed=3, streams=x["streams"], q=x["q"] if out else None,
                           store_states=not out, all_anchors=not out, block_v=bv,
                           num_warps=nw, prefetch=pf, exchange=ex, maxnreg=mr)


def _kernel_cache():
    from replayssm_quant.kernels.replay import chain

    try:
        return chain._chain_kernel.device_caches[torch.cuda.current_device()][0]
    except Exception:  # noqa: BLE001
        return {}


def compiled_regs(before: int):
    """(registers, spills) of the chain kernel the last call compiled, if it compiled one
    (the cache had ``before`` entries); (None, None) where it reused a kernel or is unknown."""
    try:
        ks = list(_kernel_cache().values())
        if len(ks) <= before:
            return None, None
        k = ks[-1]
        k._init_handles()
        return int(k.n_regs), int(k.n_spills)
    except Exception:  # noqa: BLE001
        return None, None


def _precompile(task):
    """Worker (a spawned process): compile one launch by running it on one window (T, NW and
    the sizes are not specialised), so the main process loads it from Triton's disk cache."""
    geo, case, cfg = task
    t = time.perf_counter()
    try:
        geo1 = (geo[0], 1, geo[6], *geo[3:])
        run(geo1, make_inputs(geo1, "cuda"), case, cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{geo[0]} {case} {cfg}: {type(e).__name__}: {str(e)[:300]} ({time.perf_counter() - t:.0f} s)"


def precompile(tasks, jobs):
    import concurrent.futures as cf
    import multiprocessing as mp

    t = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as ex:
        errors = [e for e in ex.map(_precompile, tasks) if e]
    return {"tasks": len(tasks), "jobs": jobs, "seconds": round(time.perf_counter() - t, 1),
            "errors": errors}


def same_bits(a, b):
    for s, t in zip(a, b):
        if (s is None) != (t is None):
            return False
        if s is not None and not torch.equal(s.view(torch.int32), t.view(torch.int32)):
            return False
    return True


def check_batch(geo, case, dev, decay, batch):
    """Each sequence of a ``batch``-sequence launch against the same sequence launched alone
    (default launch options, so the register cap ``maxnreg="auto"`` may differ between the
    two: e.g. 32 GDN heads, 8 tiles: 256 programs alone, no cap; 512 for two, capped at 128).
    Returns ``{"maxnreg": (alone, batched), "mismatch": differing elements per sequence}``."""
    from replayssm_quant.kernels.replay.chain import _sm_count, chain_block_v, resident_maxnreg

    gb = (geo[0], batch, *geo[2:])
    x = make_inputs(gb, dev, decay=decay)
    full = run(gb, x, case, (None, None, None, W0, "auto"))
    g1 = (geo[0], 1, *geo[2:])
    mism = []
    for i in range(batch):
        xi = {k: (None if t is None else t[i:i + 1]) for k, t in x.items()}
        alone = run(g1, xi, case, (None, None, None, W0, "auto"))
        n = 0
        for a, b in zip(alone, full):
            if a is not None:
                n += int((a.contiguous().view(torch.int32)
                          != b[i:i + 1].contiguous().view(torch.int32)).sum())
        mism.append(n)
    nt = -(-geo[4] // chain_block_v(geo[4], geo[5]))
    sms = _sm_count(dev) if dev == "cuda" else 0
    caps = [resident_maxnreg(b * geo[3] * nt, W0, sms) for b in (1, batch)]
    return {"model": geo[0], "case": case, "batch": batch, "maxnreg": caps, "mismatch": mism}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=list(CASES))
    ap.add_argument("--decay", choices=["slow", "model"], default="slow",
                    help="record decays: slow (default) or as a random qwen3_5 layer's")
    ap.add_argument("--check-batch", type=int, default=0, metavar="B",
                    help="time nothing: each sequence of a B-sequence launch against itself "
                         "alone, bit for bit (the register cap may differ between the two)")
    ap.add_argument("--default-only", action="store_true",
                    help="time the first form and the default launch only")
    ap.add_argument("--models", nargs="+", default=["gdn", "mamba2"],
                    choices=["gdn", "qwen3_5", "mamba2"])
    ap.add_argument("--set", choices=sorted(SETS), default="launch",
                    help="launch: prefetch / exchange / warps; regs: register caps; tiles: "
                         "value rows per program (these may change bits)")
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1),
                    help="processes compiling the launches before timing (device only)")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    if args.check_batch < 0 or args.check_batch == 1:
        ap.error(f"--check-batch takes a batch of at least 2, got {args.check_batch}")
    dev = "cpu" if args.tiny else "cuda"
    configs = SETS[args.set][:4] if args.tiny else SETS[args.set]
    if args.default_only:
        configs = [SETS["launch"][0], (None, None, None, W0, "auto")]
    commit = dc.rk.git_commit(short=True)
    result = {"command": "python " + " ".join(sys.argv) if argv is None else
              "chain_tune.main(" + repr(argv) + ")",
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "git_commit": commit,
              "code_commit": dc.rk.code_commit(short=True),
              "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__},
              "decay": args.decay,
              "defaults": {"prefetch": kr.CHAIN_PREFETCH, "exchange": kr.CHAIN_EXCHANGE,
                           "warps": kr.CHAIN_WARPS},
              "results": []}
    geos = [g for g in geometries(args.tiny) if g[0] in args.models]
    if args.check_batch:
        result["check_batch"] = [check_batch(g, c, dev, args.decay, args.check_batch)
                                 for g in geos for c in args.cases]
        for r in result["check_batch"]:
            print(json.dumps(r), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return result
    if dev == "cuda" and args.jobs > 1:
        result["precompile"] = precompile(
            [(g, c, cfg) for g in geos for c in args.cases for cfg in configs], args.jobs)
        print(json.dumps(result["precompile"]), flush=True)
    for geo in geos:
        x = make_inputs(geo, dev, decay=args.decay)
        for case in args.cases:
            base = None
            for cfg in configs:
                ncache = len(_kernel_cache()) if dev == "cuda" else 0
                t0 = time.perf_counter()
                got = run(geo, x, case, cfg)
                row = {"model": geo[0], "case": case, "prefetch": cfg[0], "exchange": cfg[1],
                       "block_v": cfg[2] or kr.chain_block_v(geo[4], geo[5]), "warps": cfg[3],
                       "maxnreg": cfg[4], "first_call_s": round(time.perf_counter() - t0, 2)}
                if dev == "cuda":
                    row["regs"], row["spills"] = compiled_regs(ncache)
                if base is None:
                    base = got
                row["same_bits"] = same_bits(base, got)
                # one warm-up call, then CUDA events per call (on the interpreter, one call)
                row.update(dc.timer(lambda i: run(geo, x, case, cfg), 1,
                                    args.reps if dev == "cuda" else 1, 0))
                result["results"].append(row)
                print(json.dumps(row), flush=True)
                del got
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
