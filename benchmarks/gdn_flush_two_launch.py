"""Experiment (2026-12-02, twelfth session): GDN's fp32 flush in two launches against the fused
default at B = 256 (GDN 16 qk / 32 v heads, 128 x 128, L = 16).

Launch 1 solves the corrections against the anchor with the records kernel (what
``gdn_corrections_kernel`` runs, here with several launch configurations); launch 2 folds them
as Mamba-2's flush folds its values (``flush_kernel`` without ``beta``), with several fold
forms. Each row: the median of 20 CUDA-event timings of the whole call (host work, the key
fields and ``store_state=True`` included, so higher than ``decode.py``'s kernel times; compare
rows within the file), and the largest difference of the corrections / S from the fused
default's. Result: ``benchmarks/results/gdn_flush_two_launch_h200.json``; on the H200 the two
launches together were slower than the fused flush (docs/kernels-replay.md, "Twelfth pass").

Usage (CUDA): ``python benchmarks/gdn_flush_two_launch.py`` (writes to $OUT or the current
directory).
"""
import json
import os
import statistics

import torch
from replayssm_quant.kernels import replay as kr
from replayssm_quant.kernels.replay import records as rec
from replayssm_quant.policy import StatePolicy

B, H, G, V, K, L = 256, 32, 16, 128, 128, 16


def timeit(fn, reps=20):
    """Median of ``reps`` CUDA-event timings of ``fn()`` in us, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main():
    """Time the fused flush, the correction launches and the folds; write the JSON."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    A = torch.randn(B, H, V, K, device=dev, generator=gen) * 0.3
    la = torch.log(0.9 + 0.0999 * torch.rand(B, L, H, device=dev, generator=gen))
    k = torch.nn.functional.normalize(torch.randn(B, L, G, K, device=dev, generator=gen), dim=-1)
    v = torch.randn(B, L, H, V, device=dev, generator=gen)
    beta = torch.sigmoid(torch.randn(B, L, H, device=dev, generator=gen))
    length = torch.full((B,), L, dtype=torch.int64, device=dev)
    pol = StatePolicy.parse("fp32")
    seq = torch.arange(B, device=dev)
    fi = torch.zeros(B, dtype=torch.int64, device=dev)
    KW = dict(seed=0, layer=0, sequence_ids=seq, flush_index=fi, store_state=True)

    out = {"command": "python benchmarks/gdn_flush_two_launch.py", "shape": [B, H, G, V, K, L],
           "code_commit": os.environ.get("CODE_COMMIT"), "rows": []}
    ref, _ = kr.gdn_flush_kernel(A, la, beta, v, k, length, pol, **KW)
    S0, w0 = ref.state.clone(), ref.w.clone()
    t = timeit(lambda: kr.gdn_flush_kernel(A, la, beta, v, k, length, pol, **KW))
    out["rows"].append({"what": "fused default", "us": t})
    print("fused default", round(t, 1), flush=True)

    zero = torch.zeros_like(length)
    q0 = v.new_zeros(B, 0, G, K)

    def corr(cfg):
        u = torch.zeros_like(v)
        rec.records_outputs(A, ring_la=la, ring_k=k, ring_w=u, q=q0, start=zero, rows=length,
                            out_start=zero, draft={"la": la, "k": k, "v": v, "beta": beta},
                            draft_relative=False, gdn=True, w_out=u, **cfg)
        return u

    CORR = [dict(block_v=32, num_warps=4),
            dict(block_v=64, num_warps=4, use_dot="tf32x3", solve="inverse"),
            dict(block_v=128, num_warps=4, use_dot="tf32x3", solve="inverse"),
            dict(block_v=128, num_warps=4, k_chunk=64, num_stages=2, use_dot="tf32x3",
                 solve="inverse"),
            dict(block_v=128, num_warps=4, use_dot="tf32x3", solve="inverse", shared_products=True),
            dict(block_v=64, num_warps=4, use_dot="ieee", solve="inverse"),
            dict(block_v=128, num_warps=8, use_dot="ieee", solve="inverse"),
            dict(block_v=128, num_warps=4, use_dot="ieee", solve="inverse", shared_products=True)]
    best_u = None
    for cfg in CORR:
        try:
            u = corr(cfg)
            err = (u - w0).abs().max().item()
            t = timeit(lambda: corr(cfg))
        except Exception as e:  # noqa: BLE001
            print("corr", cfg, "failed", repr(e)[:200], flush=True)
            continue
        out["rows"].append({"what": "corrections", "cfg": cfg, "us": t, "max_abs_vs_fused_w": err})
        print("corr", cfg, round(t, 1), "err", err, flush=True)
        if best_u is None:
            best_u = u

    FOLD = [dict(variant="grid", block_v=128, num_warps=8, reconstruct="tf32x3"),
            dict(variant="grid", block_v=64, num_warps=4, reconstruct="tf32x3"),
            dict(variant="grid", block_v=32, num_warps=4, reconstruct="tf32x3"),
            dict(variant="grid", block_v=64, num_warps=4, reconstruct="dot"),
            dict(variant="loop", block_v=64, num_warps=4, reconstruct="dot"),
            dict(variant="loop", block_v=32, num_warps=4, reconstruct="dot"),
            dict(variant="grid", block_v=32, num_warps=2, reconstruct="dot"),
            dict(variant="grid", block_v=32, num_warps=4, reconstruct="rank1")]
    for cfg in FOLD:
        try:
            res, _ = kr.flush_kernel(A, la, best_u, k, length, pol, **KW, **cfg)
            err = (res.state - S0).abs().max().item()
            t = timeit(lambda: kr.flush_kernel(A, la, best_u, k, length, pol, **KW, **cfg))
        except Exception as e:  # noqa: BLE001
            print("fold", cfg, "failed", repr(e)[:200], flush=True)
            continue
        out["rows"].append({"what": "fold", "cfg": cfg, "us": t, "max_abs_vs_fused_S": err})
        print("fold", cfg, round(t, 1), "err", err, flush=True)

    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gdn_flush_two_launch_h200.json"), "w"),
              indent=1)


if __name__ == "__main__":
    main()
