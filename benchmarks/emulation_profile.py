"""Where one GDN layer's teacher-forced emulation spends its GPU time (issue 15's emulation
item): ``window_fast.gdn_emulate_fast`` on one segment of a 3.4B-shaped ``qwen3_5`` GDN layer
(B = 1, 16 key heads / 32 value heads, 128 x 128 state, segment 4096 tokens, L = 16) under each
policy, timed with CUDA events and profiled with ``torch.profiler``: the CUDA kernels' total
time, by kernel name, per call. ``--value-heads 40`` (20 key heads) is the layer of the random
3.4B model ``kl_throughput.py --hidden 2560`` builds, which the emulation target is measured
on: its chain has 320 programs, more than the 32-head default's 256, which changes how many
are resident (``kernels.replay.chain.resident_maxnreg``).

Usage (device)::

    python benchmarks/emulation_profile.py --out $OUT/emulation_profile_h200.json

``--host`` also lists where the host's time goes (operators by own CPU time) and every
operation that made the host wait for the GPU, with its calling line (``--host`` found the
1.8 ms ``pin_memory`` calls and the per-decode table copy fixed on 2026-12-01).

``--tiny`` runs a small shape on CPU (interpreter kernels), as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("REPLAYSSM_BACKEND", "triton")

import torch  # noqa: E402

from replayssm_quant.config import StateConfig  # noqa: E402
from replayssm_quant.replay import window as W  # noqa: E402
from replayssm_quant.replay import window_fast as WF  # noqa: E402

POLICIES = ["fp32", "shared:nvfp4+sr", "read:nvfp4/rec:fp32", "read:nvfp4/rec:fp16+sr"]


def inputs(B, T, G, H, K, V, dev, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q = torch.nn.functional.normalize(r(B, T, G, K), dim=-1)
    k = torch.nn.functional.normalize(r(B, T, G, K), dim=-1)
    v = r(B, T, H, V)
    g = torch.log(0.9 + 0.0999 * torch.rand(B, T, H, generator=gen, device=dev))
    beta = torch.sigmoid(r(B, T, H))
    return q, k, v, g, beta


def host_profile(call, top: int = 25) -> dict:
    """Where the host's time goes in one ``call()`` (CUDA): the operators with the most own
    CPU time, and the synchronising operations (``set_sync_debug_mode``), each with the
    innermost ``replayssm_quant`` line that issued it and how often."""
    import traceback
    import warnings

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call()
        torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda ev: -ev.self_cpu_time_total)
    rows = [{"name": ev.key[:120], "calls": ev.count, "self_cpu_us": ev.self_cpu_time_total}
            for ev in ops[:top]]
    syncs: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        where = [f"{fr.filename.split('replayssm_quant/')[-1]}:{fr.lineno} {fr.name}"
                 for fr in traceback.extract_stack() if "replayssm_quant" in fr.filename]
        key = f"{str(message)[:60]} | {where[-1] if where else filename + ':' + str(lineno)}"
        syncs[key] = syncs.get(key, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on exit
            warnings.simplefilter("always")
            warnings.showwarning = record
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"ops": rows, "self_cpu_us_total": sum(ev.self_cpu_time_total for ev in ops),
            "syncs": syncs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--value-heads", type=int, default=32, choices=[32, 40],
                    help="32 (16 key heads) or 40 (20 key heads: the kl_throughput model's)")
    ap.add_argument("--host", action="store_true",
                    help="also list, per policy, the host's operators by their own CPU time "
                         "(torch.profiler with CPU activity) and every operation that made the "
                         "host wait for the GPU (torch.cuda.set_sync_debug_mode('warn'), with "
                         "the calling line); CUDA only, ignored with --tiny")
    args = ap.parse_args(argv)
    if args.host and args.tiny:
        print("--host profiles the host against a GPU: ignored with --tiny (CPU)", flush=True)
    if args.reps < 1:
        ap.error(f"--reps must be >= 1, got {args.reps}")
    for pol in args.policies:
        try:
            StateConfig.build(pol, window=16)
        except ValueError as e:
            ap.error(f"--policies: {e}")
    if len(set(args.policies)) != len(args.policies):
        ap.error(f"--policies lists a policy twice: {args.policies}")
    dev = "cpu" if args.tiny else "cuda"
    H = args.value_heads
    B, T, G, H, K, V, L = (1, 64, 1, 2, 32, 16, 4) if args.tiny else (1, 4096, H // 2, H, 128,
                                                                       128, 16)
    q, k, v, g, beta = inputs(B, T, G, H, K, V, dev)
    S0 = torch.randn(B, H, V, K, device=dev) * 0.3
    out = {"command": "python " + " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "shape": dict(B=B, T=T, G=G, H=H, K=K, V=V, L=L),
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
           "policies": {}}
    for pol in args.policies:
        config = StateConfig.build(pol, window=L, seed=3)

        def call():
            carry = W.initial_carry(S0, config, layer=1)
            return WF.gdn_emulate_fast(carry, q, k, v, g, beta, config=config)

        call()  # compile / warm
        ts = []
        for _ in range(args.reps):
            if dev == "cuda":
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                s.record()
                call()
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e) * 1e3)
            else:
                t0 = time.perf_counter()
                call()
                ts.append((time.perf_counter() - t0) * 1e6)
        entry = {"median_us": statistics.median(ts), "runs_us": ts}
        if dev == "cuda":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            rows = []
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t > 0:
                    rows.append({"name": ev.key[:160], "calls": ev.count, "device_us": t})
            rows.sort(key=lambda r: -r["device_us"])
            entry["kernels"] = rows[:25]
            entry["device_us_total"] = sum(r["device_us"] for r in rows)
        if dev == "cuda" and args.host:
            entry["host"] = host_profile(call)
        out["policies"][pol] = entry
        print(f"{pol}: median {entry['median_us']:.0f} us per call", flush=True)
        for r in entry.get("kernels", [])[:12]:
            print(f"   {r['device_us']:10.0f} us {r['calls']:5d}x {r['name'][:100]}")
        if "host" in entry:
            print(f"   host: {entry['host']['self_cpu_us_total']:.0f} us own CPU time; syncs:")
            for where, n in entry["host"]["syncs"].items():
                print(f"      {n:4d}x {where}")
            for r in entry["host"]["ops"][:12]:
                print(f"   {r['self_cpu_us']:10.0f} us {r['calls']:5d}x {r['name'][:90]}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
