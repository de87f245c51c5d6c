"""Throughput of teacher-forced KL runs (issue 4, "Speed"): tokens/s of each state policy's
emulation (the patched model over N tokens in segments, as ``replayssm-kl`` runs a cell,
KL metrics included) against a plain FP32 forward of the unpatched model, the patched
prefill (exact chunked scan) and stepwise decoding (one token per call through the patched
model; measured on a prefix of ``--step-tokens`` tokens and extrapolated per token to N).

CPU (embedded tiny models):
    python benchmarks/kl_throughput.py --model tiny-gdn --N 1024 8192 --threads 1 \
        -o benchmarks/results/kl_throughput_cpu.json
GPU (random-weight qwen3_5, hidden 1024, 24 layers):
    python benchmarks/kl_throughput.py --model random-qwen3_5 --device cuda --N 8192 \
        -o benchmarks/results/kl_throughput_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _commit import code_commit  # noqa: E402
from replayssm_quant.evals.kl import position_metrics  # noqa: E402
from replayssm_quant.adapters import apply_state_policy  # noqa: E402
from replayssm_quant.adapters.segments import forward_segment  # noqa: E402
from replayssm_quant.backend import requested_backend  # noqa: E402
from replayssm_quant.config import StateConfig  # noqa: E402

POLICIES = ("fp32", "read:nvfp4/rec:fp32", "shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr",
            "eager:fp8e4m3")


def random_qwen3_5(hidden: int, layers: int, device):
    """A qwen3_5 text model with random weights (3 GDN layers per full-attention layer)."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 512), head_dim=128,
        linear_num_key_heads=hidden // 128, linear_num_value_heads=hidden // 64,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=65536, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def load(name: str, device, hidden: int, layers: int):
    if name == "random-qwen3_5":
        return random_qwen3_5(hidden, layers, device)
    from replayssm_quant.models import load_model

    return load_model(name, device=device, tokenizer=False)[0]


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def timed_median(fn, device, repeat: int):
    """Median wall time of ``repeat`` runs (seconds) and every run's time."""
    ts = [timed(fn, device)[0] for _ in range(max(1, repeat))]
    return sorted(ts)[len(ts) // 2], ts


def run_cell(model, ids, targets, ref, seg):
    cache, N = None, ids.shape[1]
    for lo in range(0, N, seg):
        hi = min(N, lo + seg)
        lg, cache = forward_segment(model, ids[:, lo:hi], cache, start=lo)
        position_metrics(ref[lo // seg], lg, targets[:, lo:hi])




def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-gdn")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--device", default="cpu")
    p.add_argument("--N", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--segment-len", type=int, default=2048)
    p.add_argument("--step-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1,
                   help="time the plain forward and each policy this many times (median)")
    p.add_argument("-o", "--output", default=None)
    p.add_argument("--profile", nargs="*", default=[], metavar="POLICY",
                   help="after the timings, profile one cell of each POLICY at the last N with "
                        "torch.profiler and write the CUDA/CPU op tables next to --output")
    p.add_argument("--tune", action="store_true",
                   help="with --check-chain: also time row tiles x warps of the split launch")
    p.add_argument("--check-chain", default=None, metavar="JSON",
                   help="only check the anchor-chain kernel against the torch flush chain at "
                        "serving shapes (mismatch counts, timings) and write JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if a.check_chain:
        return check_chain(dev, a.check_chain, a.tune)
    model = load(a.model, dev, a.hidden, a.layers)
    vocab = model.config.get_text_config().vocab_size
    n_params = sum(q.numel() for q in model.parameters())
    res = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": a.model, "params": n_params,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
           "threads": torch.get_num_threads(), "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
           "torch": torch.__version__, "window": a.window, "segment_len": a.segment_len,
           "step_tokens": a.step_tokens, "repeat": a.repeat, "runs": [],
           "anchor_chain": requested_backend("chain").value,  # REPLAYSSM_BACKEND (backend.py)
           "code_commit": code_commit()}
    import transformers

    res["transformers"] = transformers.__version__
    print(f"model {a.model}: {n_params / 1e6:.1f}M params on {res['device']}, threads {res['threads']}", flush=True)
    def save():
        if a.output:
            Path(a.output).parent.mkdir(parents=True, exist_ok=True)
            Path(a.output).write_text(json.dumps(res, indent=2))

    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        # warm-up (Triton compiles, allocator) at the shapes of the timed runs: a full segment
        # and a partial window
        warm = torch.randint(3, vocab, (1, min(a.segment_len, max(a.N)) + 3), generator=gen).to(dev)
        model(warm)
        for pol in a.policies:
            with apply_state_policy(model, pol, window=a.window, prefill=False):
                forward_segment(model, warm)
        for N in a.N:
            full = torch.randint(3, vocab, (1, N + 1), generator=gen).to(dev)
            ids, targets = full[:, :N], full[:, 1:]
            r = {"N": N}
            r["plain_s"], r["plain_runs_s"] = timed_median(lambda: model(ids).logits, dev, a.repeat)
            with apply_state_policy(model, "fp32", window=a.window, prefill=True):
                r["prefill_s"], _ = timed(lambda: forward_segment(model, ids), dev)
            with apply_state_policy(model, "fp32", window=a.window, prefill=False):
                def ref_run():
                    out, cache = [], None
                    for lo in range(0, N, a.segment_len):
                        lg, cache = forward_segment(model, ids[:, lo:lo + a.segment_len], cache, start=lo)
                        out.append(lg)
                    return out
                r["reference_s"], ref = timed(ref_run, dev)
            r["policies"] = {}
            res["runs"].append(r)
            for pol in a.policies:
                with apply_state_policy(model, pol, window=a.window, prefill=False):
                    t, runs = timed_median(lambda ref=ref: run_cell(model, ids, targets, ref, a.segment_len), dev,
                                           a.repeat)
                    n_step = min(a.step_tokens, N)

                    def steps():
                        c = None
                        for i in range(n_step):
                            _, c = forward_segment(model, ids[:, i:i + 1], c, start=i)
                    ts, _ = timed(steps, dev)
                step_est = ts / n_step * N
                r["policies"][pol] = {"emulate_s": t, "emulate_runs_s": runs, "tok_per_s": N / t,
                                      "vs_plain": t / r["plain_s"],
                                      "step_measured_tokens": n_step, "step_measured_s": ts,
                                      "step_extrapolated_s": step_est, "speedup_vs_step": step_est / t}
                print(f"N={N:6d} {pol:24s} emulate {t:8.3f} s ({N / t:9.0f} tok/s, {t / r['plain_s']:5.2f}x plain)"
                      f"  stepwise ~{step_est:9.1f} s ({step_est / t:6.1f}x slower)", flush=True)
                save()
            for pol in a.profile if N == a.N[-1] else []:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with apply_state_policy(model, pol, window=a.window, prefill=False):
                    with profile(activities=acts) as prof:
                        run_cell(model, ids, targets, ref, a.segment_len)
                        sync(dev)
                key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
                table = prof.key_averages().table(sort_by=key, row_limit=40)
                print(table, flush=True)
                if a.output:
                    name = "profile_" + pol.replace(":", "-").replace("/", "_").replace("+", "-") + ".txt"
                    (Path(a.output).parent / name).write_text(table)
            del ref
            print(f"N={N:6d} plain forward {r['plain_s']:.3f} s ({N / r['plain_s']:.0f} tok/s), patched prefill "
                  f"{r['prefill_s']:.3f} s, fp32 reference {r['reference_s']:.3f} s", flush=True)
            save()
    return 0


def _torch_chain(A0, la, k, v, beta, spec, L, ka, upto=None):
    """Free-running torch flush chain (core.solve_corrections + reconstruct + cast_state)."""
    from replayssm_quant.replay import core

    At, out = A0, []
    for w in range(upto or la.shape[1] // L):
        r = slice(w * L, (w + 1) * L)
        wv = v[:, r] if beta is None else core.solve_corrections(At, la[:, r], beta[:, r], v[:, r], k[:, r])
        St = core.reconstruct(At, la[:, r], wv, k[:, r])
        At = core.cast_state(St, spec, seed=1, stream=ka[:, w])[0]
        out.append(At)
    return out


def check_chain(dev, out, tune: bool = False):
    """Anchor-chain kernel at serving shapes on the GPU. Per case: (1) the split launch (one
    program per row tile, matrix amax through atomics, anchor kept in registers) against one
    program per matrix (what the interpreter runs; reads the anchor back from memory):
    mismatch counts of S and A (0 expected except GDN with FP4 anchors, where the reduction
    order of A k follows the register layout, see docs/kl-throughput.md); (2) each window's A
    against the torch cast of the kernel's own S (0 mismatches) and S against the torch flush
    arithmetic from the kernel's previous anchor;
    (3) one launch per window (the step path) against one launch for all windows: A
    bit-identical; (4) batch independence: the sequence alone and inside a batch of 3;
    (5) single-checkpoint policies: the outputs written by the kernel against a float64
    reference from its own anchors, and the last-anchor-only launch against the full chain;
    (6) timings (split, unsplit, torch loop) and the free-running torch chain's divergence;
    (7) with ``tune``, the split launch's time per window for row tiles x warps."""
    from replayssm_quant.kernels import replay as kr
    from replayssm_quant.policy import StatePolicy
    from replayssm_quant.replay import core
    from replayssm_quant.replay import window_fast as WF

    def bits_diff(a, b):
        return int((a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)).sum())

    def clock(fn):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, r

    res = {"device": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "torch": torch.__version__, "cases": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for fam, H, V, K in (("gdn", 16, 128, 128), ("mamba2", 32, 64, 128)):
        for pol in ("shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr", "eager:fp8e4m3", "shared:mxfp4", "fp32",
                    "read:nvfp4/rec:fp32"):
            P = StatePolicy.parse(pol)
            L = StateConfig.build(P, window=16).window
            T = 2048
            NW = T // L
            B = 3
            la = -0.05 * torch.rand(B, T, H, device=dev, generator=g)
            k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1)
            q = torch.nn.functional.normalize(torch.randn(B, T, H, K, device=dev, generator=g), dim=-1)
            v = torch.randn(B, T, H, V, device=dev, generator=g)
            beta = torch.rand(B, T, H, device=dev, generator=g) if fam == "gdn" else None
            ids = torch.tensor([3, 4, 5], device=dev)
            A0 = core.cast_state(torch.randn(B, H, V, K, device=dev, generator=g), P.rec, seed=1,
                                 stream=5)[0]
            ka = WF._stream_keys(7, ids, H, torch.arange(1, NW + 1, device=dev)[None].expand(B, -1),
                                core.ANCHOR_COPY)
            one = lambda t: None if t is None else t[1:2]  # noqa: E731  the middle sequence alone
            args1 = (A0[1:2], one(la), one(k), one(v), one(beta), P.rec)
            kw1 = dict(L=L, seed=1, streams=ka[1:2])
            t_split, r = clock(lambda: kr.anchor_chain(*args1, **kw1))
            t_unsplit, u = clock(lambda: kr.anchor_chain(*args1, **kw1, split=False))
            S, A = r.states, r.anchors
            c = {"family": fam, "policy": pol, "shape": [1, H, V, K], "L": L, "windows": NW,
                 "block_v": kr.chain_block_v(V, K), "elements_per_window": H * V * K,
                 "split_vs_unsplit_S_mismatches": bits_diff(S, u.states),
                 "split_vs_unsplit_A_mismatches": bits_diff(A, u.anchors)}
            own_mis, s_err, prev = 0, 0.0, A0[1:2]
            for w in range(NW):
                r_ = slice(w * L, (w + 1) * L)
                wv = one(v)[:, r_] if beta is None else core.solve_corrections(
                    prev, one(la)[:, r_], one(beta)[:, r_], one(v)[:, r_], one(k)[:, r_])
                Sref = core.reconstruct(prev, one(la)[:, r_], wv, one(k)[:, r_])
                s_err = max(s_err, float((S[:, w] - Sref).norm() / Sref.norm()))
                Ac = core.cast_state(S[:, w], P.rec, seed=1, stream=ka[1:2, w])[0]
                own_mis += bits_diff(Ac, A[:, w])
                prev = A[:, w]
            c.update({"A_vs_cast_of_own_S_mismatches": own_mis, "S_vs_torch_flush_rel_err_max": s_err})
            steps = min(NW, 256)  # (3) one launch per window, as the step path
            At, step_mis = A0[1:2], 0
            for w in range(steps):
                r_ = slice(w * L, (w + 1) * L)
                st = kr.anchor_chain(At, one(la)[:, r_], one(k)[:, r_], one(v)[:, r_],
                                     None if beta is None else one(beta)[:, r_], P.rec, L=L, seed=1,
                                     streams=ka[1:2, w:w + 1])
                At = st.anchors[:, 0]
                step_mis += bits_diff(At, A[:, w])
            c.update({"stepwise_windows": steps, "stepwise_vs_chain_A_mismatches": step_mis})
            rb = kr.anchor_chain(A0, la, k, v, beta, P.rec, L=L, seed=1, streams=ka)  # (4)
            c["batch3_vs_alone_A_mismatches"] = bits_diff(rb.anchors[1:2], A)
            if P.single_checkpoint:  # (5)
                t_out, ro = clock(lambda: kr.anchor_chain(*args1, **kw1, q=one(q), store_states=False,
                                                          all_anchors=False))
                c["outputs_launch_s"] = t_out
                c["last_anchor_mismatches"] = bits_diff(ro.anchors[:, 0], A[:, -1])
                d = torch.float64
                err, prev = 0.0, A0[1:2].to(d)
                for w in range(NW):
                    r_ = slice(w * L, (w + 1) * L)
                    la_w, k_w, q_w = (one(x)[:, r_].to(d) for x in (la, k, q))
                    wv = one(v)[:, r_].to(d) if beta is None else core.solve_corrections(
                        prev, la_w, one(beta)[:, r_].to(d), one(v)[:, r_].to(d), k_w)
                    ref = core.window_outputs(prev, la_w, wv, k_w, q_w)
                    ref[:, -1] = core.matvec(S[:, w].to(d), q_w[:, -1])
                    err = max(err, float((ro.outputs[:, r_].to(d) - ref).norm() / ref.norm()))
                    prev = A[:, w].to(d)
                c["outputs_vs_float64_rel_err_max"] = err
            torch.cuda.synchronize()  # (6)
            t0 = time.perf_counter()
            tw = min(NW, 128)
            free = _torch_chain(A0[1:2], one(la), one(k), one(v), one(beta), P.rec, L, ka[1:2], upto=tw)
            torch.cuda.synchronize()
            c.update({"kernel_split_s": t_split, "kernel_unsplit_s": t_unsplit,
                      "torch_loop_s_per_window": (time.perf_counter() - t0) / tw,
                      "free_running_A_mismatches_window1": bits_diff(free[0], A[:, 0]),
                      "free_running_final_A_rel_diff": float((free[-1] - A[:, tw - 1]).norm() / free[-1].norm())})
            res["cases"].append(c)
            print(c, flush=True)
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            Path(out).write_text(json.dumps(res, indent=2))
    res["tuning"] = []  # (7) row tile and warps of the split launch, B = 1
    for fam, H, V, K, pol in (("gdn", 16, 128, 128, "shared:nvfp4+sr"), ("gdn", 16, 128, 128, "eager:fp8e4m3"),
                              ("gdn", 16, 128, 128, "read:nvfp4/rec:fp16+sr"),
                              ("mamba2", 32, 64, 128, "shared:nvfp4+sr")) if tune else ():
        P = StatePolicy.parse(pol)
        L = StateConfig.build(P, window=16).window
        T = 2048
        NW = T // L
        la = -0.05 * torch.rand(1, T, H, device=dev, generator=g)
        k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev, generator=g), dim=-1)
        q = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev, generator=g), dim=-1)
        v = torch.randn(1, T, H, V, device=dev, generator=g)
        beta = torch.rand(1, T, H, device=dev, generator=g) if fam == "gdn" else None
        A0 = core.cast_state(torch.randn(1, H, V, K, device=dev, generator=g), P.rec, seed=1, stream=5)[0]
        ka = WF._stream_keys(7, torch.tensor([0]), H, torch.arange(1, NW + 1)[None], core.ANCHOR_COPY)
        qq = q if P.single_checkpoint else None
        for bv, nw in ((8, 1), (8, 2), (16, 1), (16, 2), (16, 4), (32, 2), (32, 4), (64, 4)):
            try:
                t, _ = clock(lambda: kr.anchor_chain(A0, la, k, v, beta, P.rec, L=L, seed=1, streams=ka,
                                                     q=qq, store_states=qq is None, all_anchors=False,
                                                     block_v=bv, num_warps=nw))
            except Exception as e:  # noqa: BLE001  (a config that does not compile)
                t = repr(e)[:200]
            row = {"family": fam, "policy": pol, "windows": NW, "block_v": bv, "num_warps": nw,
                   "seconds": t, "us_per_window": t / NW * 1e6 if isinstance(t, float) else None}
            res["tuning"].append(row)
            print(row, flush=True)
        Path(out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
