"""Whole-model decode under ReplaySSM vs the unpatched model (issue 15, "Whole model"; report,
no target).

Two random-weight FP32 models shaped like real hybrids:

* ``qwen3_5`` 4B-shaped: hidden 2560, 32 layers (3 GDN : 1 attention), GDN 16 q/k heads and
  32 value heads of 128 x 128 (the decode benchmark's GDN geometry), vocab 248,320;
* ``nemotron_h``-shaped: hidden 4096, 24 layers (9 Mamba-2, 3 attention, 12 MLP), Mamba-2
  128 heads, P = 64, N = 128, 1 group (the decode benchmark's Mamba-2 geometry), vocab 131,072,
  chunk size 8 (only the unpatched prefill's torch chunk scan reads it; at 128 it needs
  256 GiB at B = 256).

Measured (CUDA events around each call; medians):

* ``step``: at B = 256 (``--batch``), after an 8-token prompt, ``--steps`` one-token calls of
  the unpatched model (transformers' own decode path: fla's ``fused_recurrent`` for GDN when
  fla imports, its torch path otherwise; the Mamba-2 decode of the model class) and of the
  patched model under ``fp32`` with L = 16 in both decode modes of
  :func:`~replayssm_quant.adapters.apply_state_policy`: ``window`` (the default, the window
  form, bit-equal to teacher forcing) and ``serving`` (the decode state objects and their
  Triton kernels). Per mode: median non-flush call, median flush call, and the mean over whole
  windows (amortised, flush included);
* ``generate``: greedy ``model.generate`` of ``--new-tokens`` tokens at batch 64
  (``--gen-batch``) after a 32-token prompt, tokens/s (batch x new tokens / wall time), for
  the unpatched model and ``read:nvfp4/rec:fp16+sr`` in both decode modes.

Usage::

    python benchmarks/decode_model.py --out $OUT/decode_model_h200.json      # the H200
    python benchmarks/decode_model.py --backend cuda --out $OUT/decode_model_cuda.json  # GDN's CUDA kernels
    python benchmarks/decode_model.py --tiny --out /tmp/decode_model.json    # CPU smoke

Every section records the peak GiB torch allocated on the GPU (``peak_gib``); ``--skip-step``
and ``--skip-generate`` run one half alone.

On the device machine carry fla 0.6.0 as wheels (``.whl/``, see docs/kernels-replay.md).
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
from replayssm_quant import backend as be  # noqa: E402
from replayssm_quant.adapters import state_policy  # noqa: E402
from replayssm_quant.adapters.segments import forward_segment  # noqa: E402

PROMPT = 8
GEN_PROMPT = 32
MODELS = ("qwen3_5", "nemotron_h")


def qwen3_5_config(tiny: bool):
    from transformers import Qwen3_5TextConfig

    hidden, layers, vocab = (256, 4, 512) if tiny else (2560, 32, 248320)
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=(3 * hidden if tiny else 9216),
        num_hidden_layers=layers, num_attention_heads=hidden // 128, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=hidden // 128 if tiny else 16,
        linear_num_value_heads=hidden // 64 if tiny else 32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)],
        max_position_embeddings=4096, tie_word_embeddings=True)


def nemotron_h_config(tiny: bool):
    from transformers import NemotronHConfig

    hidden, heads, vocab = (256, 8, 512) if tiny else (4096, 128, 131072)
    unit = ["linear_attention", "mlp"] * 3 + ["full_attention", "mlp"]
    types = unit if tiny else unit * 3
    return NemotronHConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=(2 * hidden if tiny else 21504),
        layers_block_type=types, num_hidden_layers=len(types),
        num_attention_heads=hidden // 128, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=heads, mamba_head_dim=64, ssm_state_size=128, n_groups=1,
        # chunk_size 8: transformers' torch chunk scan (no mamba_ssm on the device) builds a
        # [B, chunks, chunk, chunk, heads, N] tensor; at chunk 128 and B = 256 that is 256 GiB
        expand=heads * 64 // hidden, conv_kernel=4, chunk_size=8, mlp_hidden_act="relu2",
        max_position_embeddings=4096, tie_word_embeddings=False)


def build(name: str, tiny: bool, device):
    from transformers import AutoModelForCausalLM

    cfg = qwen3_5_config(tiny) if name == "qwen3_5" else nemotron_h_config(tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


class Timer:
    """CUDA events around a call on CUDA, the host clock elsewhere (seconds)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return out, a.elapsed_time(b) / 1e3
        t = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t


def set_shared_products(on: bool) -> list[str]:
    """Set ``shared_products`` in every records launch default that has the key (the serving
    step and verify wrappers read these dicts at call time). Returns the names changed."""
    from replayssm_quant.kernels.replay import records

    names = [n for n, v in vars(records).items()
             if n.endswith("_CONFIG") and isinstance(v, dict) and "shared_products" in v]
    for n in names:
        getattr(records, n)["shared_products"] = on
    return names


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def step_times(model, B: int, steps: int, vocab: int, device, timer) -> list[float]:
    """Seconds of each of ``steps`` one-token calls after an 8-token prompt (greedy tokens)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (B, PROMPT), generator=gen).to(device)
    logits, cache = forward_segment(model, ids)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    out = []
    for i in range(steps):
        (logits, cache), t = timer(lambda: forward_segment(model, nxt, cache, start=PROMPT + i))
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out.append(t)
    return out


def window_summary(ts: list[float], L: int, skip: int) -> dict:
    """Per-call times of a patched run: call i (0-based, after the prompt) is the (i+1)-th step
    since the prefill's flush 0, so it flushes when (i + 1) % L == 0. ``skip`` whole windows
    are warm-up."""
    ts = ts[skip * L:]
    flush = [t for i, t in enumerate(ts) if (i + 1) % L == 0]
    plain = [t for i, t in enumerate(ts) if (i + 1) % L != 0]
    whole = len(ts) // L * L
    return {"nonflush_median_us": median(plain) * 1e6, "flush_median_us": median(flush) * 1e6,
            "amortised_us": sum(ts[:whole]) / max(whole, 1) * 1e6, "calls": len(ts),
            "all_us": [t * 1e6 for t in ts]}


def peak_reset(device) -> None:
    """Start a peak-memory window (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float | None:
    """Peak bytes allocated by torch on ``device`` since :func:`peak_reset`, in GiB (None off
    CUDA): what a run needs beyond the card's other tenants."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def gen_rate(model, B: int, new: int, vocab: int, device, timer) -> dict:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (B, GEN_PROMPT), generator=gen).to(device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    model.generate(ids, **dict(kw, max_new_tokens=2, min_new_tokens=2))  # warm
    out, t = timer(lambda: model.generate(ids, **kw))
    made = out.shape[1] - GEN_PROMPT
    return {"seconds": t, "new_tokens": made, "tokens_per_s": B * made / t}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="tiny configs on CPU (smoke test)")
    ap.add_argument("--models", default="qwen3_5,nemotron_h")
    ap.add_argument("--batch", type=int, default=None, help="step batch (default 256; tiny 2)")
    ap.add_argument("--gen-batch", type=int, default=None, help="generate batch (64; tiny 2)")
    ap.add_argument("--new-tokens", type=int, default=None, help="generate length (64; tiny 5)")
    ap.add_argument("--windows", type=int, default=None,
                    help="timed windows of L = 16 per patched run, after one warm-up window "
                         "(default 3; tiny 1)")
    ap.add_argument("--skip-generate", action="store_true")
    ap.add_argument("--skip-step", action="store_true", help="generate only (no step timings)")
    ap.add_argument("--backend", choices=("auto", "triton", "cuda"), default=None,
                    help="REPLAYSSM_BACKEND for the patched runs (default: the environment's, "
                         "else auto); cuda runs GDN's CUDA C++ step, verify and flush where "
                         "they apply (docs/kernels-replay.md)")
    ap.add_argument("--shared-products", choices=("on", "off"), default="on",
                    help="serving decode: the record-key products launch as in the committed "
                         "launch defaults (on) or switched off in every default that sets it "
                         "(off), for an end-to-end A/B (docs/kernels-replay.md, sixth pass)")
    a = ap.parse_args(argv)
    for name, v in (("--batch", a.batch), ("--gen-batch", a.gen_batch),
                    ("--new-tokens", a.new_tokens), ("--windows", a.windows)):
        if v is not None and v < 1:
            ap.error(f"{name} must be a positive int, got {v}")
    if a.backend is not None:
        os.environ[be.ENV] = a.backend
    models = a.models.split(",")
    if not models or any(m not in MODELS for m in models):
        ap.error(f"--models takes a comma list of {MODELS}, got {a.models!r}")
    dev = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    B = a.batch if a.batch is not None else (2 if a.tiny else 256)
    GB = a.gen_batch if a.gen_batch is not None else (2 if a.tiny else 64)
    new = a.new_tokens if a.new_tokens is not None else (5 if a.tiny else 64)
    L = 4 if a.tiny else 16
    windows = a.windows if a.windows is not None else (1 if a.tiny else 3)
    timer = Timer(dev)
    if a.shared_products == "off":
        set_shared_products(False)
    try:
        import fla  # noqa: F401

        fla_ver = getattr(fla, "__version__", "?")
    except Exception as e:  # noqa: BLE001
        fla_ver = f"not importable: {type(e).__name__}"
    import transformers

    res = {"command": "python " + " ".join(sys.argv) if argv is None else repr(argv),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "versions": {"python": platform.python_version(), "torch": torch.__version__,
                        "transformers": transformers.__version__, "fla": fla_ver},
           "code_commit": code_commit(short=True),
           "backend": os.environ.get(be.ENV) or "auto",
           "shared_products": a.shared_products, "batch": B, "gen_batch": GB,
           "new_tokens": new, "window_L": L, "models": {}}

    def save():
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))

    with torch.no_grad():
        for name in models:
            model = build(name, a.tiny, dev)
            vocab = model.config.vocab_size
            r = res["models"][name] = {"params": sum(p.numel() for p in model.parameters())}
            print(f"{name}: {r['params'] / 1e6:.1f} M params", flush=True)
            if not a.skip_step:
                peak_reset(dev)
                ts = step_times(model, B, 4 + 12, vocab, dev, timer)
                r["unpatched_step"] = {"median_us": median(ts[4:]) * 1e6,
                                       "all_us": [t * 1e6 for t in ts[4:]],
                                       "peak_gib": peak_gib(dev)}
            for mode in () if a.skip_step else ("window", "serving"):
                peak_reset(dev)
                with state_policy(model, "fp32", window=L, decode=mode):
                    ts = step_times(model, B, (windows + 1) * L, vocab, dev, timer)
                s = r[f"fp32_{mode}_step"] = window_summary(ts, L, 1)
                s["peak_gib"] = peak_gib(dev)
                s["amortised_vs_unpatched"] = r["unpatched_step"]["median_us"] / s["amortised_us"]
                print(f"  step B={B}: unpatched {r['unpatched_step']['median_us']:.0f} us, fp32 "
                      f"{mode}: non-flush {s['nonflush_median_us']:.0f} flush "
                      f"{s['flush_median_us']:.0f} amortised {s['amortised_us']:.0f} us "
                      f"({s['amortised_vs_unpatched']:.2f}x unpatched)", flush=True)
                save()
            if not a.skip_generate:
                peak_reset(dev)
                g = r["generate"] = {"unpatched": gen_rate(model, GB, new, vocab, dev, timer)}
                g["unpatched"]["peak_gib"] = peak_gib(dev)
                for mode in ("window", "serving"):
                    peak_reset(dev)
                    with state_policy(model, "read:nvfp4/rec:fp16+sr", window=L, decode=mode):
                        g[f"nvfp4_{mode}"] = gen_rate(model, GB, new, vocab, dev, timer)
                    g[f"nvfp4_{mode}"]["peak_gib"] = peak_gib(dev)
                    g[f"nvfp4_{mode}"]["vs_unpatched"] = (g[f"nvfp4_{mode}"]["tokens_per_s"]
                                                          / g["unpatched"]["tokens_per_s"])
                    save()
                print("  generate tok/s: " + ", ".join(
                    f"{k} {v['tokens_per_s']:.0f}" + (f" (peak {v['peak_gib']:.1f} GiB)"
                                                     if v["peak_gib"] is not None else "")
                    for k, v in g.items()), flush=True)
            save()
            del model
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    save()
    return res


if __name__ == "__main__":
    main()
