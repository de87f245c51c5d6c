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
``manifest.json`` (command, versions, model and data identity, BOS choice, non-finite counts,
path noise, git commit, timings). Finished (document, cell) pieces are kept under ``parts/``;
a rerun with the same arguments skips them (resume); other settings are refused.

Run ``replayssm-kl --help`` for the arguments; docs/kl-runner.md has the decisions and numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from replayssm_quant.config import GDNFold

from .documents import BOS_CHOICES, BadTokenizer, load_tokenization, make_documents
from .metrics import PERCENTILES, pair_kl, position_metrics, summarize  # noqa: F401 (re-exported)

EXIT_BAD_ARGS = 2
DEFAULT_POLICIES = ("shared:nvfp4+sr", "read:nvfp4/rec:fp32", "read:nvfp4/rec:fp16+sr",
                    "eager:fp8e4m3")
COLUMNS = ("doc", "position", "policy", "window", "seed", "kl", "top1_agree", "dp_ref",
           "nll_ref", "nll", "nonfinite", "nonfinite_ref", "nonfinite_policy")
#: ``stepwise.parquet``: kl_path = KL(stepping || emulation) of the cell, kl_path_ref the same for
#: the fp32 reference, kl = KL(ref || cell) as the runner measures it (emulation), kl_step the
#: same with both sides stepped token by token.
STEP_COLUMNS = ("doc", "position", "policy", "window", "seed", "kl_path", "kl_path_ref", "kl",
                "kl_step", "top1_path_agree", "nonfinite")
DEFAULT_STEPWISE_CHECK = 64
#: Part of the resume identity: how the stored numbers were computed. Change it whenever a
#: metric's definition or the tokenisation changes, so old part files are never mixed in.
METRICS_VERSION = "2026-12-01: float64 KL >= 0 by construction; non-finite per side; BOS"


class BadArgs(Exception):
    """A user error detected before any compute (exit code 2)."""


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


# ------------------------------------------------------------------------------ run
def _cell_key(doc, policy, window, seed) -> str:
    """Part-file key of one (document, policy, window, seed) cell. The document enters by the
    hash of its tokens, so a different corpus, tokenizer or N never reuses a finished cell."""
    return hashlib.sha1(f"{doc['sha']}|{policy}|{window}|{seed}".encode()).hexdigest()[:16]


IDENTITY_FILE = "run_identity.json"


def run_identity(a, cfg) -> dict:
    """Settings that change every number of a run besides the documents and cells: a resumed
    run must match them (checked before any compute)."""
    return {"model": str(a.model),
            "config_sha256": hashlib.sha256(cfg.to_json_string().encode()).hexdigest(),
            "dtype": a.dtype, "device_type": str(a.device).split(":")[0], "prefill": a.prefill,
            "segment_len": a.segment_len, "gdn_fold": a.gdn_fold, "dt_limit": a.dt_limit,
            "max_tokens": a.max_tokens,
            "add_bos_token": a.add_bos_token, "metrics": METRICS_VERSION}


def _check_identity(a, cfg) -> None:
    f = Path(a.output_dir) / IDENTITY_FILE
    if not f.exists():
        return
    try:
        old = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BadArgs(f"cannot read {f}: {e}") from None
    new = run_identity(a, cfg)
    diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}
    if diff:
        desc = ", ".join(f"{k}: {o!r} there vs {n!r} now" for k, (o, n) in diff.items())
        raise BadArgs(f"--output-dir {a.output_dir!r} holds a run with other settings ({desc}); "
                      "use another --output-dir or remove it")


def _earlier_manifest(out: Path) -> dict:
    """The manifest an earlier invocation left in ``out`` (empty if none or unreadable)."""
    try:
        return json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _add_timings(old, new: dict) -> dict:
    """``new`` plus the compute seconds of ``old`` (same keys; nested dicts per policy)."""
    if not isinstance(old, dict):
        return new
    out = {}
    for k, v in new.items():
        o = old.get(k)
        if isinstance(v, dict):
            out[k] = _add_timings(o if isinstance(o, dict) else {}, v)
        else:
            out[k] = v + (o if isinstance(o, (int, float)) else 0.0)
    return out


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def _versions() -> dict:
    import torch
    import transformers

    import replayssm_quant

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "replayssm_quant": replayssm_quant.__version__,
            "platform": platform.platform()}


SMALL_MODEL_PARAMS = 50_000_000  # below this, CPU intra-op threads cost more than they give


def _set_threads(a, model=None) -> int:
    """Apply ``--threads`` (0 = auto) on CPU; returns the intra-op thread count used.

    Auto uses 1 thread for small models (< 50 M parameters, e.g. the embedded ones: their many
    small ops run several times slower with 2 threads, far more so on a loaded machine) or when
    the load average already exceeds the core count, else torch's default.
    """
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    elif a.device == "cpu":
        try:
            busy = os.getloadavg()[0] >= (os.cpu_count() or 1)
        except OSError:
            busy = False
        small = model is not None and sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS
        if busy or small:
            torch.set_num_threads(1)
    return torch.get_num_threads()


def _segments(N: int, P: int, S: int) -> list:
    """``(lo, hi)`` of every forward call: the prefill ``(0, P)`` if any, then segments of S."""
    bounds = [(0, P)] if P else []
    start = P
    while start < N:
        bounds.append((start, min(N, start + S)))
        start = bounds[-1][1]
    return bounds


def _step_logits(model, forward, ids, P: int, end: int):
    """Logits ``[B, end - P, V]`` of positions ``P .. end-1`` decoded token by token: the
    prefill ``ids[:, :P]`` in one call (as in the emulated run), then one forward call per token
    with the cache (the adapters' ReplaySSM step path)."""
    import torch

    cache = None
    if P:
        _, cache = forward(model, ids[:, :P], None, start=0)
    out = []
    for t in range(P, end):
        lg, cache = forward(model, ids[:, t:t + 1], cache, start=t)
        out.append(lg[:, -1].float())
    return torch.stack(out, 1)


def _stepwise_rows(ref_emul, ref_step, emul, step) -> dict:
    """Per-position stepwise-check metrics of one cell (numpy ``[B, K]`` each)."""
    import numpy as np

    kl_path, top1, nf1 = pair_kl(step, emul)
    kl_path_ref, _, nf2 = pair_kl(ref_step, ref_emul)
    kl, _, nf3 = pair_kl(ref_emul, emul)
    kl_step, _, nf4 = pair_kl(ref_step, step)
    return {"kl_path": kl_path, "kl_path_ref": kl_path_ref, "kl": kl, "kl_step": kl_step,
            "top1_path_agree": top1, "nonfinite": np.logical_or.reduce([nf1, nf2, nf3, nf4])}


def _step_dir(out: Path, K: int) -> Path:
    return out / "parts" / f"stepwise-K{K}"


def stepwise_summary(step) -> list:
    """Per (policy, window): the path noise KL(stepping || emulation) of the checked positions
    next to the policy's KL on the same positions (emulated and stepped)."""
    import numpy as np

    rows = []
    for (pol, win), g in step.groupby(["policy", "window"], sort=True):
        def mean(c):
            v = g[c].to_numpy(np.float64)
            v = v[np.isfinite(v)]
            return float(v.mean()) if v.size else math.nan
        path = g["kl_path"].to_numpy(np.float64)
        path = path[np.isfinite(path)]
        kl = mean("kl")
        rows.append({"policy": pol, "window": int(win), "positions": int(len(g)),
                     "path_kl_mean": mean("kl_path"),
                     "path_kl_p99": float(np.percentile(path, 99)) if path.size else math.nan,
                     "path_kl_max": float(path.max()) if path.size else math.nan,
                     "kl_mean": kl, "kl_step_mean": mean("kl_step"),
                     "path_to_effect": (mean("kl_path") / kl) if kl and kl > 0 else math.nan,
                     "mean_rel_diff": (kl / mean("kl_step") - 1) if mean("kl_step") > 0 else math.nan,
                     "path_kl_ref_mean": mean("kl_path_ref"),
                     "top1_path_agree": float(g["top1_path_agree"].mean()),
                     "nonfinite": int(g["nonfinite"].sum())})
    return rows


def run(a, policies, cfg_path, cfg, arch, token_docs, tokz) -> int:
    import numpy as np
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from replayssm_quant.adapters import apply_state_policy
    from replayssm_quant.adapters.segments import forward_each
    from replayssm_quant.config import StateConfig
    from replayssm_quant.models import load_model

    t0 = time.time()
    out = Path(a.output_dir)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    (out / IDENTITY_FILE).write_text(json.dumps(run_identity(a, cfg), indent=2))
    dtype = getattr(torch, a.dtype)
    if a.no_progress:  # transformers' weight-loading bar too
        import transformers

        transformers.utils.logging.disable_progress_bar()
    model, _ = load_model(a.model, dtype=dtype, device=a.device, tokenizer=False)
    threads = _set_threads(a, model)
    t_load = time.time() - t0
    cells = [(str(p), w, s) for p in policies for w in a.windows for s in a.seeds]
    cell_policies = [p for p in policies for _ in a.windows for _ in a.seeds]
    ref_window = a.windows[0]  # the fp32 reference: one fixed setting for every document
    handle = apply_state_policy(model, "fp32", window=ref_window, seed=0,
                                prefill=a.prefill > 0, gdn_fold=a.gdn_fold, dt_limit=a.dt_limit)
    # every cell's settings parsed once (the policies were parsed by the argument checks)
    ref_config = handle.config
    configs = {c: StateConfig.build(pol, window=c[1], seed=c[2], fold=a.gdn_fold)
               for c, pol in zip(cells, cell_policies)}
    N, P, S, K = a.max_tokens, a.prefill, a.segment_len, a.stepwise_check
    step_end = P + K
    step_dir = _step_dir(out, K)
    if K:
        step_dir.mkdir(parents=True, exist_ok=True)
    timings = {"load_s": t_load, "reference_s": 0.0, "policies_s": {c[0]: 0.0 for c in cells},
               "stepwise_s": 0.0}
    bounds = _segments(N, P, S)
    reported = np.concatenate([np.arange(lo, hi) for lo, hi in bounds if hi > P])
    assert reported.tolist() == list(range(P, N)), "segment bounds do not tile [prefill, N)"

    def part(d, c):
        return parts / f"{_cell_key(token_docs[d], *c)}.parquet"

    def step_part(d, c):
        return step_dir / f"{_cell_key(token_docs[d], *c)}.parquet"

    def missing(d, c):
        return not part(d, c).exists() or (K and not step_part(d, c).exists())

    n_new = 0
    batches = [list(range(i, min(len(token_docs), i + a.batch_size)))
               for i in range(0, len(token_docs), a.batch_size)]
    bar = tqdm(batches, desc="documents", unit="batch", disable=a.no_progress)
    with torch.no_grad():
        for batch in bar:
            todo = [c for c in cells if any(missing(d, c) for d in batch)]
            if not todo:
                continue
            full = torch.tensor([token_docs[d]["ids"] for d in batch], device=a.device)
            ids, targets = full[:, :N], full[:, 1:N + 1]  # position t predicts token t + 1
            # every document alone through the model, SR keyed by its index
            row_ids = dict(handle=handle, sequence_ids=list(batch))

            def forward_rows(m, x, cache, start):
                return forward_each(m, x, cache, start=start, **row_ids)

            caches = {c: None for c in todo}
            ref_cache = None
            rows = {c: [] for c in todo}
            kept = {c: [] for c in todo}  # emulated logits of the stepwise-checked positions
            ref_kept = []
            for (lo, hi) in bounds:
                tr = time.time()
                handle.use(ref_config)
                ref, ref_cache = forward_each(model, ids[:, lo:hi], ref_cache, start=lo, **row_ids)
                timings["reference_s"] += time.time() - tr
                if hi <= P:  # prefill positions are exact in every cell: not reported
                    for c in todo:
                        tp = time.time()
                        handle.use(configs[c])
                        _, caches[c] = forward_each(model, ids[:, lo:hi], caches[c], start=lo, **row_ids)
                        timings["policies_s"][c[0]] += time.time() - tp
                    continue
                ks, ke = max(lo, P) - lo, min(hi, step_end) - lo  # checked part of this segment
                if ke > ks:
                    ref_kept.append(ref[:, ks:ke].float().clone())
                for c in tqdm(todo, desc="cells", leave=False, disable=a.no_progress):
                    tp = time.time()
                    handle.use(configs[c])
                    lg, caches[c] = forward_each(model, ids[:, lo:hi], caches[c], start=lo, **row_ids)
                    rows[c].append(position_metrics(ref, lg, targets[:, lo:hi]))
                    if ke > ks:
                        kept[c].append(lg[:, ks:ke].float().clone())
                    timings["policies_s"][c[0]] += time.time() - tp
            del caches, ref_cache
            step_rows = {}
            if K:
                ts = time.time()
                handle.use(ref_config)
                ref_step = _step_logits(model, forward_rows, ids, P, step_end)
                ref_emul = torch.cat(ref_kept, 1)
                for c in todo:
                    handle.use(configs[c])
                    step = _step_logits(model, forward_rows, ids, P, step_end)
                    step_rows[c] = _stepwise_rows(ref_emul, ref_step, torch.cat(kept[c], 1), step)
                timings["stepwise_s"] += time.time() - ts
            for c in todo:
                for bi, d in enumerate(batch):
                    key = {"doc": token_docs[d]["id"], "policy": c[0], "window": c[1], "seed": c[2]}
                    f = part(d, c)
                    if not f.exists():
                        cols = {k: np.concatenate([m[k][bi] for m in rows[c]]) for k in rows[c][0]}
                        if cols["kl"].shape[0] != reported.size:
                            raise RuntimeError(f"cell {c}: {cols['kl'].shape[0]} positions for "
                                               f"{reported.size} reported ones (runner bug)")
                        df = pd.DataFrame({**key, "position": reported, **cols})
                        _write_parquet(df[list(COLUMNS)], f)
                        n_new += 1
                    if K and not step_part(d, c).exists():
                        sr = {k: v[bi] for k, v in step_rows[c].items()}
                        df = pd.DataFrame({**key, "position": np.arange(P, step_end), **sr})
                        _write_parquet(df[list(STEP_COLUMNS)], step_part(d, c))
    handle.remove()
    pos = _assemble(token_docs, cells, part, COLUMNS, np.arange(P, N))
    pos.to_parquet(out / "positions.parquet", index=False)
    step = None
    if K:
        step = _assemble(token_docs, cells, step_part, STEP_COLUMNS, np.arange(P, step_end))
        step.to_parquet(out / "stepwise.parquet", index=False)
    else:  # a stepwise table of an earlier invocation would describe another run
        (out / "stepwise.parquet").unlink(missing_ok=True)
    summ = summarize(pos, step)
    summ.to_csv(out / "summary.csv", index=False)
    timings["total_s"] = time.time() - t0
    earlier = _earlier_manifest(out)
    n_tok = sum(len(d["ids"]) for d in token_docs)  # N + 1 per document (the last is a target only)
    nf_by_policy = pos.groupby("policy")[["nonfinite", "nonfinite_ref", "nonfinite_policy"]].sum()
    manifest = {
        "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
        "commands": earlier.get("commands", []) + [[os.path.basename(sys.argv[0])] + sys.argv[1:]],
        "args": vars(a), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": _git_commit(),
        "versions": _versions(), "metrics": METRICS_VERSION,
        "model": {"name": a.model, "path": cfg_path, "model_type": arch, "dtype": a.dtype,
                  "config_sha256": hashlib.sha256(cfg.to_json_string().encode()).hexdigest(),
                  "params": int(sum(p.numel() for p in model.parameters()))},
        "data": {"dataset": a.dataset, "split": a.split, "tokenizer": tokz.name,
                 "documents": [d["id"] for d in token_docs], "tokens": n_tok,
                 "token_sha256": hashlib.sha256(json.dumps([d["ids"] for d in token_docs]).encode()).hexdigest()},
        "bos": tokz.manifest(),
        "policies": [str(p) for p in policies], "windows": a.windows, "seeds": a.seeds,
        "reference": {"policy": "fp32", "window": ref_window, "seed": 0},
        "dt_limit": str(handle.dt_limit),
        "invariance": "each document runs through the model alone (adapters.segments.forward_each); "
                      "SR streams keyed by document index; docs/invariance.md",
        "cells_computed_this_run": n_new, "threads": threads,
        # compute of every invocation that contributed to these tables (a resume adds to it)
        "timings": _add_timings(earlier.get("timings"), timings) if n_new < len(cells) * len(token_docs)
        else timings,
        "timings_this_invocation": timings,
        "nonfinite_rows": int(pos["nonfinite"].sum()),
        "nonfinite_ref_rows": int(pos["nonfinite_ref"].sum()),
        "nonfinite_policy_rows": int(pos["nonfinite_policy"].sum()),
        "nonfinite_ref_positions": int(pos.loc[pos["nonfinite_ref"], ["doc", "position"]]
                                       .drop_duplicates().shape[0]),
        "nonfinite_by_policy": {p: {k: int(v) for k, v in r.items()}
                                for p, r in nf_by_policy.iterrows()},
        "stepwise_check": {
            "tokens": K, "positions": [P, step_end],
            "what": "KL(P_stepping || P_emulation) per position: the same cell decoded token by "
                    "token (one forward call per token with the cache) versus teacher-forced "
                    "emulation; kl_mean/kl_step_mean: the policy's KL on the same positions",
            "per_policy": stepwise_summary(step) if K else [],
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    fin = pos[~pos["nonfinite"]]
    overall = fin.groupby(["policy", "window"]).agg(
        kl_mean=("kl", "mean"), kl_p99=("kl", lambda s: float(np.percentile(s, 99)) if len(s) else math.nan),
        kl_max=("kl", "max")).reset_index().merge(
        pos.groupby(["policy", "window"]).agg(
            top1_agree=("top1_agree", "mean"), nonfinite_ref=("nonfinite_ref", "sum"),
            nonfinite_policy=("nonfinite_policy", "sum"), positions=("kl", "size")).reset_index(),
        on=["policy", "window"], how="right")
    print(f"\nreplayssm-kl: {len(token_docs)} documents x {N} tokens, model {a.model} ({arch}), "
          f"{timings['total_s']:.1f} s; output {out}")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(overall.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        if K:
            sw = pd.DataFrame(manifest["stepwise_check"]["per_policy"])
            print(f"\nstepwise check, positions {P}..{step_end - 1}: path noise KL(stepping || "
                  "emulation) versus the policy's KL on the same positions")
            print(sw[["policy", "window", "path_kl_mean", "path_kl_max", "kl_mean", "kl_step_mean",
                      "path_to_effect", "mean_rel_diff", "path_kl_ref_mean"]].to_string(
                index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


def _write_parquet(df, f: Path) -> None:
    tmp = f.with_suffix(".tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, f)


def _assemble(token_docs, cells, part, columns, positions):
    """All part files of the run's documents and cells, labelled with the current document id
    (a document's cells are keyed by its tokens). Each must hold exactly ``positions``."""
    import numpy as np
    import pandas as pd

    frames = []
    for d in range(len(token_docs)):
        for c in cells:
            f = part(d, c)
            df = pd.read_parquet(f)
            if not np.array_equal(df["position"].to_numpy(), positions):
                raise RuntimeError(f"{f} holds positions {df['position'].min()}..{df['position'].max()} "
                                   f"({len(df)} rows), expected {positions[0]}..{positions[-1]}; "
                                   "delete it and rerun")
            df["doc"] = token_docs[d]["id"]
            frames.append(df[list(columns)])
    return pd.concat(frames, ignore_index=True)


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
                  f"segments of {a.segment_len}, batch {a.batch_size}, tokenizer {tokz.name}, "
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
