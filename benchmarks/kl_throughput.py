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

from evals.kl import position_metrics  # noqa: E402
from replayssm_quant.adapters import apply_state_policy  # noqa: E402
from replayssm_quant.adapters.segments import forward_segment  # noqa: E402

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
    p.add_argument("-o", "--output", default=None)
    p.add_argument("--check-chain", default=None, metavar="JSON",
                   help="only check the anchor-chain kernel against the torch flush chain at "
                        "serving shapes (mismatch counts, timings) and write JSON here")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if a.check_chain:
        return check_chain(dev, a.check_chain)
    model = load(a.model, dev, a.hidden, a.layers)
    vocab = model.config.get_text_config().vocab_size
    n_params = sum(q.numel() for q in model.parameters())
    res = {"command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": a.model, "params": n_params,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
           "threads": torch.get_num_threads(), "loadavg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
           "torch": torch.__version__, "window": a.window, "segment_len": a.segment_len,
           "step_tokens": a.step_tokens, "runs": [],
           "anchor_chain": os.environ.get("REPLAYSSM_ANCHOR_CHAIN", "auto")}
    import transformers

    res["transformers"] = transformers.__version__
    print(f"model {a.model}: {n_params / 1e6:.1f}M params on {res['device']}, threads {res['threads']}", flush=True)
    def save():
        if a.output:
            Path(a.output).parent.mkdir(parents=True, exist_ok=True)
            Path(a.output).write_text(json.dumps(res, indent=2))

    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        warm = torch.randint(3, vocab, (1, 2 * a.window + 3), generator=gen).to(dev)
        model(warm)
        for pol in a.policies:  # warm-up (Triton compiles, allocator)
            with apply_state_policy(model, pol, window=a.window, prefill=False):
                forward_segment(model, warm)
        for N in a.N:
            full = torch.randint(3, vocab, (1, N + 1), generator=gen).to(dev)
            ids, targets = full[:, :N], full[:, 1:]
            r = {"N": N}
            r["plain_s"], _ = timed(lambda: model(ids).logits, dev)
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
                    t, _ = timed(lambda: run_cell(model, ids, targets, ref, a.segment_len), dev)
                    n_step = min(a.step_tokens, N)

                    def steps():
                        c = None
                        for i in range(n_step):
                            _, c = forward_segment(model, ids[:, i:i + 1], c, start=i)
                    ts, _ = timed(steps, dev)
                step_est = ts / n_step * N
                r["policies"][pol] = {"emulate_s": t, "tok_per_s": N / t, "vs_plain": t / r["plain_s"],
                                      "step_measured_tokens": n_step, "step_measured_s": ts,
                                      "step_extrapolated_s": step_est, "speedup_vs_step": step_est / t}
                print(f"N={N:6d} {pol:24s} emulate {t:8.3f} s ({N / t:9.0f} tok/s, {t / r['plain_s']:5.2f}x plain)"
                      f"  stepwise ~{step_est:9.1f} s ({step_est / t:6.1f}x slower)", flush=True)
                save()
            del ref
            print(f"N={N:6d} plain forward {r['plain_s']:.3f} s ({N / r['plain_s']:.0f} tok/s), patched prefill "
                  f"{r['prefill_s']:.3f} s, fp32 reference {r['reference_s']:.3f} s", flush=True)
            save()
    return 0


def check_chain(dev, out):
    """Anchor-chain kernel vs the torch flush chain (core.solve_corrections + core.reconstruct
    + core.cast_state) at serving shapes: per window, the kernel's A against the torch cast of
    the kernel's own S (must be 0 mismatches) and the kernel's S against the torch flush
    arithmetic from the kernel's previous anchor; then both chains free-running."""
    from replayssm_quant.kernels import replay as kr
    from replayssm_quant.policy import StatePolicy
    from replayssm_quant.replay import core
    from replayssm_quant.replay import window as W

    res = {"device": torch.cuda.get_device_name(dev), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "cases": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for fam, H, V, K in (("gdn", 16, 128, 128), ("mamba2", 32, 64, 128)):
        for pol in ("shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr", "eager:fp8e4m3", "shared:mxfp4"):
            P = StatePolicy.parse(pol)
            L = W.effective_window(P, 16)
            T = 2048 if L > 1 else 256
            NW = T // L
            la = -0.05 * torch.rand(1, T, H, device=dev, generator=g)
            k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev, generator=g), dim=-1)
            v = torch.randn(1, T, H, V, device=dev, generator=g)
            beta = torch.rand(1, T, H, device=dev, generator=g) if fam == "gdn" else None
            ids = torch.tensor([3], device=dev)
            A0 = core.cast_state(torch.randn(1, H, V, K, device=dev, generator=g), P.rec, seed=1,
                                 stream=5)[0]
            ka = W._stream_keys(7, ids, H, torch.arange(1, NW + 1, device=dev)[None], core.ANCHOR_COPY)
            S, A = kr.anchor_chain(A0, la, k, v, beta, P.rec, L=L, seed=1, streams=ka)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            S, A = kr.anchor_chain(A0, la, k, v, beta, P.rec, L=L, seed=1, streams=ka)
            torch.cuda.synchronize()
            t_kernel = time.perf_counter() - t0
            own_mis, s_err, prev = 0, 0.0, A0
            for w in range(NW):
                r = slice(w * L, (w + 1) * L)
                wv = v[:, r] if beta is None else core.solve_corrections(prev, la[:, r], beta[:, r], v[:, r], k[:, r])
                Sref = core.reconstruct(prev, la[:, r], wv, k[:, r])
                s_err = max(s_err, float((S[:, w] - Sref).norm() / Sref.norm()))
                Ac = core.cast_state(S[:, w], P.rec, seed=1, stream=ka[:, w])[0]
                own_mis += int((Ac.view(torch.int32) != A[:, w].view(torch.int32)).sum())
                prev = A[:, w]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            At, flips = A0, []
            for w in range(NW):  # free-running torch chain (what _block ran before)
                r = slice(w * L, (w + 1) * L)
                wv = v[:, r] if beta is None else core.solve_corrections(At, la[:, r], beta[:, r], v[:, r], k[:, r])
                St = core.reconstruct(At, la[:, r], wv, k[:, r])
                At = core.cast_state(St, P.rec, seed=1, stream=ka[:, w])[0]
                flips.append(At.view(torch.int32) != A[:, w].view(torch.int32))
            torch.cuda.synchronize()
            t_torch = time.perf_counter() - t0
            first = next((w for w, f in enumerate(flips) if bool(f.any())), None)
            c = {"family": fam, "policy": pol, "shape": [1, H, V, K], "L": L, "windows": NW,
                 "A_vs_cast_of_own_S_mismatches": own_mis, "elements_per_window": H * V * K,
                 "S_vs_torch_flush_rel_err_max": s_err,
                 "free_running_A_mismatches_window1": int(flips[0].sum()),
                 "free_running_first_window_with_mismatch": first,
                 "free_running_A_mismatches_last": int(flips[-1].sum()),
                 "free_running_final_A_rel_diff": float((At - A[:, -1]).norm() / At.norm()),
                 "kernel_s": t_kernel, "torch_s": t_torch}
            res["cases"].append(c)
            print(c, flush=True)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
