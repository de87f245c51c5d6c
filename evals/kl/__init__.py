"""``replayssm-kl``: teacher-forced per-position KL of state policies against FP32-state decoding.

For every document, the reference (the same model under the ``fp32`` state policy) and every
(policy, window, seed) cell run in lockstep, one segment of ``--segment-len`` tokens at a time,
each with its own cache (ReplaySSM state, conv state and attention KV cache carried across
segments). The reference logits of a segment are computed once and shared by all cells; KL and
the other metrics are reduced on the fly, so logits are never stored whole.

KL is computed in float64 and is >= 0 by construction; a non-finite value on either side is
recorded (``nonfinite_ref`` / ``nonfinite_policy``) and counted, never dropped silently
(:mod:`replayssm_quant.evals.kl.metrics`). Documents get BOS as the tokenizer's own default, like lm-eval's
HFLM (``--add-bos-token``, :mod:`replayssm_quant.evals.kl.documents`). The first ``--stepwise-check K``
positions of every cell are also decoded token by token, and KL(stepping || emulation) -- the
float32 path noise of teacher-forced emulation -- is reported next to the policy's KL.

Outputs (``--output-dir``): ``positions.parquet`` (one row per document, position, policy,
window, seed), ``summary.csv`` (per policy, window and log2 position bucket),
``stepwise.parquet`` (the stepwise check, one row per checked position and cell),
``buckets.parquet`` (sums per document, cell and quarter octave of N: what the report's
means, intervals and incidences need when ``positions.parquet`` is too large to keep),
``state_error.parquet`` (with ``--state-error``: per-layer, per-head state error against the
reference and each head's mean decay, :mod:`.state_error`),
``manifest.json`` (command, versions, model and data identity, BOS choice, non-finite counts,
path noise, git commit, timings). Finished (document, cell) pieces are kept under ``parts/``;
a rerun with the same arguments skips them (resume); other settings are refused.

This module is the command line and the plan (argument checks, ``--dry-run``, the memory
estimate); the run itself -- lockstep loop, resume, tables, manifest -- is
:mod:`replayssm_quant.evals.kl.run`. Run ``replayssm-kl --help`` for the arguments;
docs/kl-runner.md has the decisions and numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from replayssm_quant.config import GDNFold

from .documents import BOS_CHOICES, BadTokenizer, load_tokenization, make_documents
from .metrics import PERCENTILES, pair_kl, position_metrics, summarize  # noqa: F401 (re-exported)
from .run import (COLUMNS, IDENTITY_FILE, METRICS_VERSION, STEP_COLUMNS, BadArgs,  # noqa: F401
                  _check_identity, _set_threads, run, run_identity, stepwise_summary)

EXIT_BAD_ARGS = 2
DEFAULT_POLICIES = ("shared:nvfp4+sr", "read:nvfp4/rec:fp32", "read:nvfp4/rec:fp16+sr",
                    "eager:fp8e4m3")
DEFAULT_STEPWISE_CHECK = 64




# ------------------------------------------------------------------------------ arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="replayssm-kl",
        description="Teacher-forced per-position KL(P_fp32 || P_policy) of SSM state policies. "
        "With no --model/--dataset it runs the embedded tiny-gdn model on the embedded KJV "
        "held-out books, offline on CPU.")
    p.add_argument("--model", default="tiny-gdn",
                   help="embedded name (tiny-gdn, tiny-mamba2), local model directory or hub id "
                   "(default: tiny-gdn)")
    p.add_argument("--dataset", default=["kjv"],
                   help="'kjv' (embedded), 'pg19' (hub), or local .txt/.jsonl/.parquet files or "
                   "directories (several allowed, comma-free paths)", nargs="+")
    p.add_argument("--split", default=None, help="corpus split (kjv: heldout [default]; pg19: test)")
    p.add_argument("--max-docs", type=int, default=4, help="documents to evaluate (default 4)")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES),
                   help="state policies, e.g. shared:nvfp4+sr read:nvfp4/rec:fp16+sr eager:fp8e4m3")
    p.add_argument("--windows", nargs="+", type=int, default=[16], help="flush windows L (default 16)")
    p.add_argument("--max-tokens", "-N", type=int, default=1024, dest="max_tokens",
                   help="positions per document N (default 1024); documents shorter than N+1 "
                   "tokens are joined with the next ones")
    p.add_argument("--prefill", type=int, default=0,
                   help="prompt tokens run through the exact scan before emulation starts "
                   "(their positions are not reported; default 0)")
    p.add_argument("--segment-len", type=int, default=512, help="tokens per forward call (default 512)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="documents processed together (default 1); each document still runs "
                   "through the model alone, so results do not depend on it (docs/invariance.md)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="SR seeds (default 0)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64"),
                   help="model dtype (default float32)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU intra-op threads (default 0 = auto: 1 for models under 50 M parameters "
                   "or when the load average already exceeds the core count, else torch's default; "
                   "extra threads of many "
                   "small ops mostly wait on each other)")
    p.add_argument("--output-dir", "-o", default="kl-run", help="output directory (default ./kl-run)")
    p.add_argument("--dt-limit", default="decode", choices=("decode", "clamp"),
                   help="Mamba-2 time_step_limit rule on every call: 'decode' (default: no clamp, as "
                   "transformers' decode step and serving) or 'clamp' (as its chunked scan); "
                   "docs/adapters.md")
    p.add_argument("--gdn-fold", default="recompute", choices=[f.value for f in GDNFold],
                   help="GDN flush: re-solve corrections against A (default) or fold cached ones")
    p.add_argument("--add-bos-token", default="auto", choices=BOS_CHOICES,
                   help="BOS at the start of each document, as lm-eval's HFLM add_bos_token: auto "
                   "(default) = the tokenizer's own default (add_special_tokens=True), true = "
                   "always, false = never (add_special_tokens=False)")
    p.add_argument("--stepwise-check", type=int, default=None, metavar="K", dest="stepwise_check",
                   help="also decode the first K reported positions of every cell token by token "
                   "(one forward call per token with the cache) and report KL(stepping || "
                   f"emulation), the float32 path noise of emulation (default min({DEFAULT_STEPWISE_CHECK}, "
                   "N - prefill); 0 = off)")
    p.add_argument("--state-error", action="store_true", dest="state_error",
                   help="also record, at segment boundaries that are powers of two (and at N) and on a "
                   "flush, each SSM layer's and "
                   "head's relative state error (read copy and recurrence anchor against the fp32 "
                   "reference state) and the head's mean decay: state_error.parquet")
    p.add_argument("--dry-run", action="store_true", help="print the plan and a memory estimate, then exit")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def _check_args(a) -> list:
    """Validate everything that needs no model weights; returns parsed policies."""
    from replayssm_quant.policy import StatePolicy

    if a.max_tokens <= 0:
        raise BadArgs(f"--max-tokens must be > 0, got {a.max_tokens}")
    if a.prefill < 0 or a.prefill >= a.max_tokens:
        raise BadArgs(f"--prefill must be in [0, max-tokens) = [0, {a.max_tokens}), got {a.prefill}")
    if a.threads < 0:
        raise BadArgs(f"--threads must be >= 0, got {a.threads}")
    if Path(a.output_dir).exists() and not Path(a.output_dir).is_dir():
        raise BadArgs(f"--output-dir {a.output_dir!r} exists and is not a directory")
    for parent in Path(a.output_dir).absolute().parents:  # the nearest existing ancestor
        if parent.exists():
            if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
                raise BadArgs(f"--output-dir {a.output_dir!r} cannot be created: {str(parent)!r} "
                              f"is {'not a directory' if not parent.is_dir() else 'not writable'}")
            break
    for name in ("segment_len", "batch_size", "max_docs"):
        if getattr(a, name) <= 0:
            raise BadArgs(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if any(w < 1 for w in a.windows):
        raise BadArgs(f"--windows must be >= 1, got {a.windows}")
    if any(s < 0 for s in a.seeds):
        raise BadArgs(f"--seeds must be >= 0, got {a.seeds}")
    for flag, vals in (("--windows", a.windows), ("--seeds", a.seeds)):
        rep = sorted({v for v in vals if vals.count(v) > 1})
        if rep:
            raise BadArgs(f"{flag} repeats {', '.join(map(str, rep))} (got {' '.join(map(str, vals))}); "
                          "give each value once: every (policy, window, seed) cell must be unique")
    if a.stepwise_check is None:
        a.stepwise_check = min(DEFAULT_STEPWISE_CHECK, a.max_tokens - a.prefill)
    elif not 0 <= a.stepwise_check <= a.max_tokens - a.prefill:
        raise BadArgs(f"--stepwise-check must be in [0, max-tokens - prefill] = "
                      f"[0, {a.max_tokens - a.prefill}], got {a.stepwise_check}")
    pols = []
    for s in a.policies:
        try:
            pols.append(StatePolicy.parse(s))
        except ValueError as e:
            raise BadArgs(str(e)) from None
    same = {}
    for s, p in zip(a.policies, pols):
        same.setdefault(str(p), []).append(s)
    dup = {k: v for k, v in same.items() if len(v) > 1}
    if dup:
        desc = "; ".join(" and ".join(repr(x) for x in v) + f" are both the policy {k!r}"
                         for k, v in dup.items())
        raise BadArgs(f"duplicate policies: {desc}; give each policy once")
    if a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise BadArgs(f"--device {a.device}: CUDA is not available")
    return pols


def _load_config(model: str):
    from transformers import AutoConfig

    from replayssm_quant.adapters import SUPPORTED_ARCHITECTURES
    from replayssm_quant.models import is_embedded, resolve_model_path

    try:
        path = resolve_model_path(model)
        cfg = AutoConfig.from_pretrained(path, local_files_only=is_embedded(model) or os.path.isdir(path))
    except Exception as e:  # noqa: BLE001 - any load failure is a bad --model
        raise BadArgs(f"cannot load model config {model!r}: {e}") from None
    mt = getattr(cfg, "model_type", "")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    arch = getattr(text, "model_type", mt)
    arch = arch[:-5] if arch.endswith("_text") else arch
    if arch not in SUPPORTED_ARCHITECTURES:
        raise BadArgs(f"model {model!r} has architecture {arch!r}, which has no SSM layers this "
                      f"runner supports; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return path, cfg, arch


def _load_docs(a):
    from replayssm_quant.data import load_corpus

    docs = []
    for ds in a.dataset:
        try:
            split = a.split if ds.lower() in ("kjv", "pg19") else None
            docs.extend(load_corpus(ds, split=split))
        except Exception as e:  # noqa: BLE001
            raise BadArgs(f"cannot read dataset {ds!r}: {e}") from None
    docs = [d for d in docs if d.get("text")]
    if not docs:
        raise BadArgs(f"dataset {a.dataset} has no non-empty documents")
    return docs


# ------------------------------------------------------------------------------ estimates
def _meta_model(cfg):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def memory_estimate(cfg, a, n_cells: int) -> dict:
    """Rough peak bytes: weights + per-cache state (ReplaySSM A, R, buffer; conv; KV) for the
    reference and each live cell + one segment of logits (several FP32 copies)."""
    import torch

    from replayssm_quant.adapters import find_ssm_mixers
    from replayssm_quant.adapters import gdn as G
    from replayssm_quant.adapters import mamba2 as M

    bytes_per = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}[a.dtype]
    model = _meta_model(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    B, L, N = a.batch_size, max(a.windows), a.max_tokens
    state = 0
    for _, mixer, fam in find_ssm_mixers(model):
        H, V, K = (M.dims(mixer) if fam == "mamba2" else G.dims(mixer))
        work = 8 if a.dtype == "float64" else 4
        state += B * H * V * K * work * 2  # A and R (dequantised, working dtype)
        state += B * L * H * (V + K + 2) * work  # buffer records
        state += B * mixer.conv_dim * mixer.conv_kernel_size * bytes_per
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n_attn = sum(1 for m in model.modules() if type(m).__name__.endswith("Attention"))
    kv_heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // max(1, text.num_attention_heads or 1))
    kv = n_attn * 2 * B * N * kv_heads * head_dim * bytes_per
    vocab = text.vocab_size
    # two FP32 segments of logits + float64 temporaries of the metrics (chunked, metrics.py)
    logits = B * min(a.segment_len, N) * vocab * 4 * 2 + 6 * 8 * min(B * min(a.segment_len, N) * vocab, 1 << 24)
    K = a.stepwise_check or 0
    logits += (1 + n_cells) * B * K * vocab * 4 * 2  # kept emulation + stepping logits
    per_cache = state + kv
    total = n_params * bytes_per + per_cache * (1 + n_cells + (2 if K else 0)) + logits
    del torch
    return {"params": n_params, "weights_bytes": n_params * bytes_per, "state_bytes_per_cache": state,
            "kv_bytes_per_cache": kv, "caches": 1 + n_cells + (2 if K else 0), "logits_bytes": logits,
            "total_bytes": total}






































def _check_documents(token_docs) -> None:
    """Refuse repeated documents (same id, or same tokens): their rows would collide."""
    seen_id, seen_sha = {}, {}
    for d in token_docs:
        if d["id"] in seen_id:
            raise BadArgs(f"document id {d['id']!r} occurs twice in --dataset; give each "
                          "document once (or give them distinct ids)")
        if d["sha"] in seen_sha:
            raise BadArgs(f"documents {seen_sha[d['sha']]!r} and {d['id']!r} have the same tokens; "
                          "give each document once")
        seen_id[d["id"]] = seen_sha[d["sha"]] = d["id"]


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        policies = _check_args(a)
        cfg_path, cfg, arch = _load_config(a.model)
        docs = _load_docs(a)
        vocab = cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size
        try:
            tokz = load_tokenization(cfg_path, vocab, a.add_bos_token)
        except BadTokenizer as e:
            raise BadArgs(str(e)) from None
        token_docs = make_documents(docs, tokz, a.max_tokens + 1, a.max_docs)
        _check_identity(a, cfg)
        if not token_docs:
            raise BadArgs(f"dataset {a.dataset} has fewer than {a.max_tokens} tokens in all; "
                          "lower --max-tokens")
        _check_documents(token_docs)
        n_cells = len(policies) * len(a.windows) * len(a.seeds)
        if a.dry_run:
            est = memory_estimate(cfg, a, n_cells)
            bos = tokz.manifest()
            print(f"plan: model {a.model} ({arch}, {est['params']:,} parameters, {a.dtype}, {a.device})")
            print(f"      {len(token_docs)} documents x N={a.max_tokens} tokens (prefill {a.prefill}), "
                  f"segments of {min(a.segment_len, a.max_tokens)}, batch {a.batch_size}, tokenizer {tokz.name}, "
                  f"BOS {a.add_bos_token} ({bos['documents_starting_with_bos']} of "
                  f"{bos['documents']} documents start with BOS)")
            print(f"      {n_cells} cells = policies {[str(p) for p in policies]} x windows {a.windows} "
                  f"x seeds {a.seeds}; reference fp32 computed once per document; stepwise check of "
                  f"the first {a.stepwise_check} positions")
            print(f"      output -> {a.output_dir}")
            print(f"memory estimate: {est['total_bytes'] / 2**20:.1f} MiB (weights "
                  f"{est['weights_bytes'] / 2**20:.1f} MiB, per cache: state "
                  f"{est['state_bytes_per_cache'] / 2**20:.2f} MiB + KV {est['kv_bytes_per_cache'] / 2**20:.2f} "
                  f"MiB, x{est['caches']} caches, logits {est['logits_bytes'] / 2**20:.1f} MiB)")
            return 0
    except BadArgs as e:
        print(f"replayssm-kl: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    try:
        return run(a, policies, cfg_path, cfg, arch, token_docs, tokz)
    except KeyboardInterrupt:
        done = len(list((Path(a.output_dir) / "parts").glob("*.parquet")))
        print(f"\nreplayssm-kl: interrupted; {done} finished cells are saved in "
              f"{a.output_dir}/parts; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
