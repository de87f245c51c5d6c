"""Does the split nvfp4 flush's pair cast (bound by instructions) overlap with the fp32 flush
(bound by DRAM) when it runs on a second CUDA stream? (issue 15, twenty-third pass,
docs/kernels-replay.md.)

B = 256 on the H200 geometries, ``read:nvfp4/rec:fp16+sr``, CUDA-graph medians in us
(``decode.timer``; a captured graph keeps the two streams' launches as parallel branches):
the split flush; the fp32 flush and ``pack_pair_triton`` alone; the two on independent data
at once, the cast on a second stream of high or normal priority; and the batch cut into C
chunks (2, 4, 8, 16), each chunk's fp32 flush then its pair cast, on one stream
(sequential) or with the casts on the second stream behind each chunk's flush (pipelined).
Timing only: the chunks' copies are not assembled into one batch.

Usage (on the device)::

    python benchmarks/flush_overlap.py --out $OUT/flush_overlap_h200.json
    python benchmarks/flush_overlap.py --tiny --out /tmp/fo.json   # CPU, TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

if "--tiny" in sys.argv:  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode as dc  # noqa: E402
import flush_tune as ft  # noqa: E402
from _commit import code_commit  # noqa: E402

from replayssm_quant.kernels.quant import pack_pair_triton  # noqa: E402
from replayssm_quant.policy import StatePolicy  # noqa: E402

POLICY = StatePolicy.parse("read:nvfp4/rec:fp16+sr")
FP32 = StatePolicy.parse("fp32")


def _cast(S, keys):
    return pack_pair_triton(S, POLICY.rec, POLICY.read, seed=ft.SEED, plain_stream=keys,
                            scaled_stream=keys)


def _chunked(M, sets, cfg, keys, side):
    """Each chunk's fp32 flush, then its pair cast (on ``side`` behind the flush, or on the
    current stream where ``side`` is None)."""
    fk = ft.flush_kw(M)
    cur = torch.cuda.current_stream() if side is not None else None
    outs = []
    for st in sets:
        S = ft.run_flush(M, st, FP32, fk, cfg)[0].checkpoints.anchor_stored
        if side is None:
            outs.append(_cast(S, keys))
            continue
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            outs.append(_cast(S, keys))
    if side is not None:
        cur.wait_stream(side)
    return outs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON output path")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="small shapes on the interpreter")
    args = ap.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("flush_overlap.py times CUDA streams; run it on the device (or --tiny)")
    reps, n = (args.reps, 3) if not args.tiny else (1, 1)
    mode = "graph" if not args.tiny else None
    streams = {} if args.tiny else {"hi": torch.cuda.Stream(priority=-1),
                                    "lo": torch.cuda.Stream(priority=0)}
    out = {"command": " ".join(sys.argv), "code_commit": code_commit(),
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "policy": str(POLICY), "timing": "CUDA graph, decode.timer, median us",
           "results": {}}

    def t(fn):
        return dc.timer(fn, n, reps, 3, mode=mode)["median_us"]

    for M0 in ft.geometries(args.tiny):
        cfg = ft.launch_cfg(M0.V, False, M0.gdn, M0.L)
        gen = torch.Generator(device=ft.DEV).manual_seed(5)
        fk = ft.flush_kw(M0)
        res = {}
        pool = [ft.make_set(M0, gen, POLICY) for _ in range(n)]
        S = [ft.run_flush(M0, st, FP32, fk, cfg)[0].checkpoints.anchor_stored for st in pool]
        keys = torch.arange(M0.B * M0.H, device=ft.DEV).view(M0.B, M0.H)
        split = dict(fk, split_casts=True, cast_form="pair")
        res["split_flush_pair"] = t(lambda i: ft.run_flush(M0, pool[i], POLICY, split, cfg))
        res["fp32_flush"] = t(lambda i: ft.run_flush(M0, pool[i], FP32, fk, cfg))
        res["pair_cast"] = t(lambda i: _cast(S[i], keys))
        for name, side in streams.items():
            def both(i, side=side):
                cur = torch.cuda.current_stream()
                side.wait_stream(cur)
                with torch.cuda.stream(side):
                    o = _cast(S[(i + 1) % n], keys)
                r = ft.run_flush(M0, pool[i], FP32, fk, cfg)
                cur.wait_stream(side)
                return r, o
            res[f"independent_at_once_{name}"] = t(both)
        pool = S = None  # free the B = 256 sets before the chunks
        for C in (2, 4, 8, 16):
            if M0.B % C:
                continue
            M = copy.copy(M0)
            M.B = M0.B // C
            kc = torch.arange(M.B * M.H, device=ft.DEV).view(M.B, M.H)
            sets = [[ft.make_set(M, gen, POLICY) for _ in range(C)] for _ in range(n)]
            res[f"chunks{C}_sequential"] = t(lambda i: _chunked(M, sets[i], cfg, kc, None))
            for name, side in streams.items():
                res[f"chunks{C}_pipelined_{name}"] = t(
                    lambda i, side=side: _chunked(M, sets[i], cfg, kc, side))
            sets = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        out["results"][M0.name] = res
        print(M0.name, json.dumps(res), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
