#!/usr/bin/env python
"""Seeded recipe for the two embedded reference models (``tiny-gdn``, ``tiny-mamba2``).

Everything needed to rebuild ``replayssm_quant/models/tiny_gdn`` and
``replayssm_quant/models/tiny_mamba2`` from scratch:

1. data: the embedded KJV corpus (``replayssm_quant.data``), training split only
   (55 books; the 11 held-out books are never seen). The last ``--val-frac`` (3%) of
   every training book's tokens is kept aside as a validation stream for checkpoint
   selection, so the held-out books are used only for the final numbers.
2. tokenizer: byte-level BPE trained with ``tokenizers`` on the training split
   (vocabulary 4096 including one special token ``<|endoftext|>``), saved in Hugging Face
   format; both models share it.
3. models: ``nemotron_h`` (Mamba-2 hybrid) and ``qwen3_5_text`` (Gated DeltaNet hybrid),
   configs in :func:`model_config`, initialised by transformers' own ``_init_weights``
   under ``torch.manual_seed(seed)``, except the Gated DeltaNet ``dt_bias``, which is
   initialised as in flash-linear-attention (:func:`init_gdn_dt_bias`; transformers'
   ``dt_bias = 1`` starts every head at alpha ~ 0 and the trained model kept almost no slow
   heads). Mamba-2 trains with ``time_step_min = 1e-5`` and is saved with 1e-30 so that
   transformers' chunked-path dt clamp (absent from the decode step) never binds in use
   (:data:`TRAIN_TIME_STEP_MIN`).
4. schedule: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only), linear warm-up
   then cosine decay to 10% of the peak (2e-3), gradient clipping at 1.0, batches of
   ``--batch`` (32) windows of ``--seq-len`` (512) tokens drawn uniformly at random (seeded)
   from the training stream (books joined by ``<|endoftext|>``), training-only residual
   dropout 0.2 (:func:`add_residual_dropout`), 800 steps; validation every ``--eval-every``
   (20) steps; the checkpoint with the lowest validation loss is saved (FP32 weights).
   The defaults are the recipe of the shipped models (``docs/models/training/README.md``).

Commands::

    # everything, sequentially (GPU recommended; runs on CPU too, slowly)
    python scripts/train_reference_models.py all --out build/refmodels
    # or in stages (the device run trained both models in parallel on one H200)
    python scripts/train_reference_models.py prepare --out build/refmodels
    python scripts/train_reference_models.py train --arch gdn    --out build/refmodels
    python scripts/train_reference_models.py train --arch mamba2 --out build/refmodels
    # then copy build/refmodels/tiny_gdn and tiny_mamba2 into replayssm_quant/models/

Each ``train`` writes ``<out>/<model dir>/`` (config.json, generation_config.json,
model.safetensors, tokenizer files) and ``<out>/<name>-training.json`` (config, schedule,
loss and validation curves, timings, versions, the command line).

``--time-budget`` (seconds) is a guard for leased machines: after ``--probe-steps``
steps the step time is measured, and if ``--steps`` would not fit, the total step count
(and with it the cosine schedule, which has not started decaying yet) is reduced once.
The log records ``steps_planned`` and ``steps_run``; pass ``--steps <steps_run>`` to
reproduce a run without the guard.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from replayssm_quant.data import kjv_books  # noqa: E402

VOCAB_SIZE = 4096
EOS = "<|endoftext|>"
NAMES = {"gdn": "tiny-gdn", "mamba2": "tiny-mamba2"}
# Mamba-2 dt clamp. transformers' chunked (training / prefill) path clamps
# dt >= config.time_step_min; the single-token decode step does not (DESIGN.md section 3).
# Training uses TRAIN_TIME_STEP_MIN; the saved config carries SHIPPED_TIME_STEP_MIN, so the
# clamp never binds and prefill computes the same recurrence as decode. The slowest heads
# push dt below any floor (with 1e-3, the first version, the clamp bound on up to 93% of
# their held-out positions; with 1e-5 on up to ~30%), see docs/models/tiny-mamba2.md.
TRAIN_TIME_STEP_MIN = 1e-5
SHIPPED_TIME_STEP_MIN = 1e-30
DIRS = {"gdn": "tiny_gdn", "mamba2": "tiny_mamba2"}


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(out_dir: Path, vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE on the KJV training split; saved in HF format under ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [d["text"] for d in kjv_books("train")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    hf.model_max_length = 1 << 20
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out_dir)
    return hf


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def token_streams(tok, val_frac: float):
    """Training stream, validation stream (tails of training books), held-out books."""
    eos = tok.convert_tokens_to_ids(EOS)
    train, val = [], []
    for d in kjv_books("train"):
        ids = tok(d["text"], add_special_tokens=False)["input_ids"]
        cut = int(round(len(ids) * (1.0 - val_frac)))
        train.extend(ids[:cut] + [eos])
        val.extend(ids[cut:] + [eos])
    heldout = {d["title"]: tok(d["text"], add_special_tokens=False)["input_ids"] for d in kjv_books("heldout")}
    return torch.tensor(train), torch.tensor(val), heldout


# --------------------------------------------------------------------------- models


def model_config(arch: str, vocab_size: int, eos_id: int):
    """The two reference configurations (a few million parameters each)."""
    from transformers import NemotronHConfig, Qwen3_5TextConfig

    if arch == "mamba2":
        # M = Mamba-2, - = MLP (squared ReLU), * = attention (GQA, no positional encoding,
        # as in Nemotron-H). 4 Mamba-2 layers of 8 heads x (P=64, N=64), one group.
        return NemotronHConfig(
            vocab_size=vocab_size,
            hidden_size=256,
            hybrid_override_pattern="M-M*M-M",
            tie_word_embeddings=False,  # NemotronHForCausalLM does not tie
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            mlp_hidden_act="relu2",
            mamba_num_heads=8,
            mamba_head_dim=64,
            ssm_state_size=64,
            n_groups=1,
            conv_kernel=4,
            expand=2,
            chunk_size=128,
            # see TRAIN_TIME_STEP_MIN; time_step_floor keeps the initial dt >= 1e-4
            # (log-uniform in [time_step_min, 0.1] at init, then floored).
            time_step_min=TRAIN_TIME_STEP_MIN,
            time_step_max=0.1,
            time_step_floor=1e-4,
            max_position_embeddings=1 << 20,
            pad_token_id=eos_id,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            use_cache=True,
        )
    if arch == "gdn":
        # 6 layers: Gated DeltaNet x3, full attention, Gated DeltaNet x2 (Qwen3.5's 3:1 pattern,
        # truncated); GDN: 2 key heads and 4 value heads (grouped), d_k = d_v = 64.
        return Qwen3_5TextConfig(
            vocab_size=vocab_size,
            hidden_size=256,
            intermediate_size=384,
            num_hidden_layers=6,
            layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=True,
            max_position_embeddings=1 << 20,
            pad_token_id=eos_id,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
        )
    raise ValueError(f"unknown arch {arch!r}; expected 'gdn' or 'mamba2'")


def init_gdn_dt_bias(model, seed: int, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> int:
    """Re-initialise every Gated DeltaNet ``dt_bias`` as flash-linear-attention's
    ``GatedDeltaNet`` (and Mamba-2) do: dt log-uniform in [dt_min, dt_max], floored, then
    ``dt_bias = softplus^-1(dt)``. transformers' Qwen3.5 init sets ``dt_bias = 1`` instead,
    which with A in [0.01, 16] starts every head at alpha = exp(-A * softplus(a + 1)) ~ 0
    (forget at once); a first model trained from that init kept almost no slow heads."""
    gen = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for layer in model.model.layers:
            la = getattr(layer, "linear_attn", None)
            if la is None:
                continue
            h = la.dt_bias.numel()
            dt = torch.exp(torch.rand(h, generator=gen) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            dt = dt.clamp(min=floor)
            la.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).to(la.dt_bias))
            n += 1
    return n


def add_residual_dropout(model, p: float) -> list:
    """Training-only regularisation: dropout on the embedding output and on every
    sub-layer's output before it is added to the residual stream (forward hooks, so the
    architecture and the saved model are unchanged; inactive in ``eval()``)."""
    if p <= 0:
        return []

    def hook(module, inputs, output):
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True),) + tuple(output[1:])
        return F.dropout(output, p, True)

    targets = [model.get_input_embeddings()]
    for layer in model.model.layers:
        for name in ("mixer", "linear_attn", "self_attn", "mlp"):  # nemotron_h | qwen3_5
            sub = getattr(layer, name, None)
            if isinstance(sub, torch.nn.Module):
                targets.append(sub)
    return [m.register_forward_hook(hook) for m in targets]


def param_groups(model, weight_decay: float):
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, total: int, warmup: int, peak: float, floor_frac: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def mean_nll(model, ids: torch.Tensor, seq_len: int, batch: int, device, amp_dtype=None) -> tuple[float, int]:
    """Mean next-token NLL (nats) over non-overlapping windows of ``seq_len`` tokens."""
    model.eval()
    n_win = len(ids) // seq_len
    tot, cnt = 0.0, 0
    windows = ids[: n_win * seq_len].view(n_win, seq_len)
    rest = ids[n_win * seq_len :]
    chunks = [windows[i : i + batch] for i in range(0, n_win, batch)]
    if len(rest) > 1:
        chunks.append(rest[None])
    for x in chunks:
        x = x.to(device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                               reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1), cnt


def unigram_nll(train_ids: torch.Tensor, targets: list[torch.Tensor], vocab: int, seq_len: int) -> float:
    """Add-one smoothed unigram model from the training stream, scored on the same
    targets as :func:`mean_nll` (every window's tokens after its first)."""
    counts = torch.bincount(train_ids, minlength=vocab).double() + 1.0
    logp = torch.log(counts / counts.sum())
    tot, cnt = 0.0, 0
    for ids in targets:
        n_win = len(ids) // seq_len
        parts = [ids[: n_win * seq_len].view(n_win, seq_len)[:, 1:].reshape(-1)]
        rest = ids[n_win * seq_len :]
        if len(rest) > 1:
            parts.append(rest[1:])
        t = torch.cat(parts)
        tot += -logp[t].sum().item()
        cnt += t.numel()
    return tot / cnt


# --------------------------------------------------------------------------- train


def versions() -> dict:
    import tokenizers
    import transformers

    v = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name(0)
    return v


def train(args) -> dict:
    from transformers import AutoModelForCausalLM

    out = Path(args.out)
    tok_dir = Path(args.tokenizer) if args.tokenizer else out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(tok_dir, args.vocab_size)
    tok = load_tokenizer(tok_dir)
    eos_id = tok.convert_tokens_to_ids(EOS)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    amp_dtype = {"fp32": None, "bf16": torch.bfloat16}[args.amp]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    t0 = time.time()
    train_ids, val_ids, heldout = token_streams(tok, args.val_frac)
    t_data = time.time() - t0

    torch.manual_seed(args.seed)
    cfg = model_config(args.arch, len(tok), eos_id)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.arch == "gdn" and args.gdn_dt_init == "fla":
        init_gdn_dt_bias(model, args.seed + 2)
    hooks = add_residual_dropout(model, args.dropout)
    print(f"[{args.arch}] {type(model).__name__}: {n_params / 1e6:.3f} M params; "
          f"train {len(train_ids)} tokens, val {len(val_ids)}, heldout {sum(map(len, heldout.values()))}", flush=True)

    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(args.seed + 1)
    total = args.steps
    log = {"train": [], "val": []}
    best = (float("inf"), -1, None)
    model.train()
    t_train = time.time()
    tokens_seen = 0
    step = 0
    t_probe = None
    while step < total:
        lr = lr_at(step, total, args.warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_ids) - args.seq_len - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + args.seq_len + 1] for s in starts.tolist()]).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens_seen += x[:, 1:].numel()
        if step == 3 and device.type == "cuda":
            torch.cuda.synchronize()
            t_probe = time.time()
        if step == args.probe_steps + 3 and t_probe is not None:
            torch.cuda.synchronize()
            dt = (time.time() - t_probe) / args.probe_steps
            tok_s = args.batch * args.seq_len / dt
            # evals cost about one step per 8 val windows per eval; budget 15% for them
            budget_steps = int((args.time_budget - (time.time() - t_train)) / (dt * 1.15)) + step
            print(f"[{args.arch}] probe: {dt * 1e3:.1f} ms/step, {tok_s / 1e3:.0f} k tokens/s; "
                  f"budget allows ~{budget_steps} steps", flush=True)
            log["probe"] = {"ms_per_step": dt * 1e3, "tokens_per_s": tok_s, "budget_steps": budget_steps}
            if args.time_budget > 0 and budget_steps < total:
                total = max(budget_steps, args.warmup + 1)
                print(f"[{args.arch}] reducing steps {args.steps} -> {total} to fit --time-budget", flush=True)
        if step % args.log_every == 0 or step == total:
            log["train"].append({"step": step, "loss": loss.item(), "lr": lr, "grad_norm": float(gnorm),
                                 "tokens": tokens_seen, "elapsed_s": time.time() - t_train})
        if step % args.eval_every == 0 or step == total:
            v, _ = mean_nll(model, val_ids, args.seq_len, args.eval_batch, device, amp_dtype)
            log["val"].append({"step": step, "val_nll": v, "elapsed_s": time.time() - t_train})
            print(f"[{args.arch}] step {step}/{total} loss {loss.item():.3f} val {v:.3f} "
                  f"lr {lr:.2e} {time.time() - t_train:.0f}s", flush=True)
            if v < best[0]:
                best = (v, step, {k: t.detach().clone() for k, t in model.state_dict().items()})
        if args.time_budget > 0 and time.time() - t_train > args.time_budget * 1.25:
            print(f"[{args.arch}] hard stop at step {step}: time budget exceeded", flush=True)
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t_train

    for h in hooks:
        h.remove()
    model.load_state_dict(best[2])
    t1 = time.time()
    held_tok = list(heldout.values())
    if args.heldout_limit > 0:  # smoke tests only: truncate each held-out book
        held_tok = [ids[: args.heldout_limit] for ids in held_tok]
    held = [mean_nll(model, torch.tensor(ids), args.seq_len, args.eval_batch, device, amp_dtype) for ids in held_tok]
    held_nll = sum(n * c for n, c in held) / sum(c for _, c in held)
    uni = unigram_nll(train_ids, [torch.tensor(i) for i in held_tok], len(tok), args.seq_len)
    eval_s = time.time() - t1

    model_dir = out / DIRS[args.arch]
    model = model.to("cpu").float()
    model.config.use_cache = True
    if args.arch == "mamba2":
        model.config.time_step_min = SHIPPED_TIME_STEP_MIN  # disable the chunked-path clamp, see above
    model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)

    result = {
        "name": NAMES[args.arch],
        "arch": args.arch,
        "model_type": cfg.model_type,
        "class": type(model).__name__,
        "n_params": n_params,
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "args": vars(args),
        "steps_planned": args.steps,
        "steps_run": step,
        "best_step": best[1],
        "best_val_nll": best[0],
        "heldout_nll": held_nll,
        "heldout_ppl": math.exp(held_nll),
        "unigram_heldout_nll": uni,
        "reduction_vs_unigram": 1 - held_nll / uni,
        "tokens": {"train": len(train_ids), "val": len(val_ids), "heldout": sum(map(len, held_tok)),
                   "seen": tokens_seen},
        "timing_s": {"data": t_data, "train": train_s, "final_eval": eval_s},
        "versions": versions(),
        "log": log,
    }
    (out / f"{NAMES[args.arch]}-training.json").write_text(json.dumps(result, indent=1))
    print(f"[{args.arch}] done: best step {best[1]} val {best[0]:.3f}; held-out NLL {held_nll:.3f} "
          f"(ppl {math.exp(held_nll):.1f}) vs unigram {uni:.3f} ({100 * (1 - held_nll / uni):.1f}% lower); "
          f"train {train_s:.0f}s", flush=True)
    return result


def select(runs: list[str], out: Path) -> dict:
    """For each model, keep the candidate run with the lowest validation NLL (never the
    held-out numbers) and copy its model directory and log into ``out``."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    table = {}
    for name, dirname in ((NAMES[a], DIRS[a]) for a in NAMES):
        cands = []
        for r in runs:
            f = Path(r) / f"{name}-training.json"
            if f.exists():
                d = json.loads(f.read_text())
                cands.append({"run": r, "best_val_nll": d["best_val_nll"], "heldout_nll": d["heldout_nll"],
                              "reduction_vs_unigram": d["reduction_vs_unigram"], "steps": d["steps_run"],
                              "dropout": d["args"].get("dropout", 0.0), "command": d["command"]})
        if not cands:
            continue
        best = min(cands, key=lambda c: c["best_val_nll"])
        shutil.copytree(Path(best["run"]) / dirname, out / dirname, dirs_exist_ok=True)
        shutil.copy(Path(best["run"]) / f"{name}-training.json", out / f"{name}-training.json")
        table[name] = {"chosen": best["run"], "candidates": cands}
        print(f"{name}: chose {best['run']} (val {best['best_val_nll']:.3f}, held-out {best['heldout_nll']:.3f}); "
              + "; ".join(f"{c['run']}: val {c['best_val_nll']:.3f}" for c in cands))
    (out / "selection.json").write_text(json.dumps(table, indent=1))
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("prepare", "train", "all"):
        s = sub.add_parser(name)
        s.add_argument("--out", default="build/refmodels")
        s.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
        if name == "prepare":
            continue
        if name == "train":
            s.add_argument("--arch", choices=sorted(NAMES), required=True)
        s.add_argument("--seed", type=int, default=1234)
        s.add_argument("--steps", type=int, default=800)
        s.add_argument("--warmup", type=int, default=80)
        s.add_argument("--batch", type=int, default=32)
        s.add_argument("--seq-len", type=int, default=512)
        s.add_argument("--lr", type=float, default=2e-3)
        s.add_argument("--weight-decay", type=float, default=0.1)
        s.add_argument("--dropout", type=float, default=0.2,
                       help="training-only residual dropout (forward hooks), see add_residual_dropout")
        s.add_argument("--gdn-dt-init", choices=("fla", "hf"), default="fla",
                       help="GDN dt_bias init: 'fla' (dt log-uniform in [1e-3, 0.1], as fla/Mamba-2) or "
                            "'hf' (transformers' Qwen3.5 init, dt_bias = 1)")
        s.add_argument("--tokenizer", default=None, help="tokenizer dir (default <out>/tokenizer; trained if missing)")
        s.add_argument("--clip", type=float, default=1.0)
        s.add_argument("--val-frac", type=float, default=0.03)
        s.add_argument("--eval-every", type=int, default=20)
        s.add_argument("--eval-batch", type=int, default=32)
        s.add_argument("--log-every", type=int, default=10)
        s.add_argument("--amp", choices=("fp32", "bf16"), default="fp32",
                       help="fp32 (TF32 matmuls on GPU) or bf16 autocast; weights stay FP32")
        s.add_argument("--device", default=None)
        s.add_argument("--time-budget", type=float, default=0.0, help="seconds; 0 = no guard")
        s.add_argument("--probe-steps", type=int, default=20)
        s.add_argument("--heldout-limit", type=int, default=0,
                       help="smoke tests: evaluate only the first N tokens of each held-out book (0 = all)")
    s = sub.add_parser("select", help="pick, per model, the candidate run with the lowest validation NLL")
    s.add_argument("--out", required=True)
    s.add_argument("runs", nargs="+")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.cmd == "select":
        select(args.runs, out)
        return
    if args.cmd == "prepare":
        tok = train_tokenizer(out / "tokenizer", args.vocab_size)
        print(f"tokenizer: {len(tok)} tokens -> {out / 'tokenizer'}")
        return
    if args.cmd == "all":
        train_tokenizer(out / "tokenizer", args.vocab_size)
        for arch in ("gdn", "mamba2"):
            args.arch = arch
            train(args)
        return
    train(args)


if __name__ == "__main__":
    main()
