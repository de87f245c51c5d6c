"""``replayssm-kl``: teacher-forced per-position KL of state policies against FP32-state decoding.

For every document, the reference (the same model under the ``fp32`` state policy) and every
(policy, window, seed) cell run in lockstep, one segment of ``--segment-len`` tokens at a time,
each with its own cache (ReplaySSM state, conv state and attention KV cache carried across
segments). The reference logits of a segment are computed once and shared by all cells; KL and
the other metrics are reduced on the fly, so logits are never stored whole.

Outputs (``--output-dir``): ``positions.parquet`` (one row per document, position, policy,
window, seed), ``summary.csv`` (per policy, window and log2 position bucket), ``manifest.json``
(command, versions, model and data identity, git commit, timings). Finished (document, cell)
pieces are kept under ``parts/``; a rerun with the same arguments skips them (resume).

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

EXIT_BAD_ARGS = 2
DEFAULT_POLICIES = ("shared:nvfp4+sr", "read:nvfp4/rec:fp32", "read:nvfp4/rec:fp16+sr",
                    "eager:fp8e4m3")
COLUMNS = ("doc", "position", "policy", "window", "seed", "kl", "top1_agree", "dp_ref",
           "nll_ref", "nll", "nonfinite")
PERCENTILES = (50, 90, 99, 99.9)


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
    p.add_argument("--batch-size", type=int, default=1, help="documents per forward call (default 1)")
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
    p.add_argument("--gdn-fold", default="recompute", choices=("recompute", "cached"),
                   help="GDN flush: re-solve corrections against A (default) or fold cached ones")
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
    for name in ("segment_len", "batch_size", "max_docs"):
        if getattr(a, name) <= 0:
            raise BadArgs(f"--{name.replace('_', '-')} must be > 0, got {getattr(a, name)}")
    if any(w < 1 for w in a.windows):
        raise BadArgs(f"--windows must be >= 1, got {a.windows}")
    if any(s < 0 for s in a.seeds):
        raise BadArgs(f"--seeds must be >= 0, got {a.seeds}")
    pols = []
    for s in a.policies:
        try:
            pols.append(StatePolicy.parse(s))
        except ValueError as e:
            raise BadArgs(str(e)) from None
    names = [str(p) for p in pols]
    if len(set(names)) != len(names):
        raise BadArgs(f"duplicate policies: {names}")
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


def _load_tokenizer(path: str, vocab: int):
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path, local_files_only=os.path.isdir(path))
        probe = tok("In the beginning", add_special_tokens=False)["input_ids"]
        if probe and max(probe) < vocab:  # a directory without tokenizer files can load an empty one
            return (lambda s: tok(s, add_special_tokens=False)["input_ids"]), type(tok).__name__
    except Exception:  # noqa: BLE001 - model directories without a tokenizer
        pass
    return (lambda s: [b % vocab for b in s.encode("utf-8")]), f"utf8-bytes-mod-{vocab}"


def _make_documents(docs, encode, n_tokens: int, max_docs: int):
    """Token documents of exactly n_tokens ids: each corpus document alone if long enough, else
    joined with the following ones (blank-line separator), in corpus order."""
    out, ids, members = [], [], []
    sep = encode("\n\n")
    for d in docs:
        if ids:
            ids = ids + sep
        ids = ids + encode(d["text"])
        members.append(str(d.get("id", d.get("title", len(out)))))
        if len(ids) >= n_tokens:
            out.append({"id": "+".join(members), "ids": ids[:n_tokens]})
            ids, members = [], []
            if len(out) == max_docs:
                break
    return out


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
    logits = B * min(a.segment_len, N) * vocab * 4 * 6
    per_cache = state + kv
    total = n_params * bytes_per + per_cache * (1 + n_cells) + logits
    del torch
    return {"params": n_params, "weights_bytes": n_params * bytes_per, "state_bytes_per_cache": state,
            "kv_bytes_per_cache": kv, "caches": 1 + n_cells, "logits_bytes": logits,
            "total_bytes": total}


# ------------------------------------------------------------------------------ metrics
def position_metrics(ref_logits, logits, targets):
    """Per-position metrics in FP32 from log_softmax of both logits.

    Returns a dict of 1-D numpy arrays: kl (nats), top1_agree, dp_ref = |p(target) - p_ref(target)|
    for the document's next token, nll_ref, nll, nonfinite (policy logits not all finite)."""
    import torch

    lr = torch.log_softmax(ref_logits.float(), -1)
    lq = torch.log_softmax(logits.float(), -1)
    nonfinite = ~torch.isfinite(logits).all(-1)
    kl = (lr.exp() * (lr - lq)).sum(-1)
    t = targets[..., None]
    lrt, lqt = lr.gather(-1, t)[..., 0], lq.gather(-1, t)[..., 0]
    out = {
        "kl": kl, "top1_agree": lr.argmax(-1) == lq.argmax(-1),
        "dp_ref": (lqt.exp() - lrt.exp()).abs(), "nll_ref": -lrt, "nll": -lqt,
        "nonfinite": nonfinite,
    }
    nan = torch.tensor(float("nan"))
    for k in ("kl", "dp_ref", "nll"):
        out[k] = torch.where(nonfinite, nan, out[k])
    return {k: v.detach().cpu().numpy() for k, v in out.items()}


def summarize(df):
    """Per (policy, window, log2 position bucket) summary (``bucket`` = ``floor(log2(position+1))``)."""
    import numpy as np
    import pandas as pd

    d = df.copy()
    d["bucket"] = np.floor(np.log2(d["position"].to_numpy(np.float64) + 1.0) + 1e-12).astype(np.int64)
    rows = []
    for (pol, win, b), g in d.groupby(["policy", "window", "bucket"], sort=True):
        fin = g.loc[~g["nonfinite"], "kl"].to_numpy(np.float64)
        fin = fin[np.isfinite(fin)]
        n = fin.size
        mean = float(fin.mean()) if n else math.nan
        half = 1.96 * float(fin.std(ddof=1)) / math.sqrt(n) if n > 1 else math.nan
        pct = np.percentile(fin, PERCENTILES) if n else [math.nan] * len(PERCENTILES)
        rows.append({
            "policy": pol, "window": int(win), "bucket": int(b),
            "pos_lo": int(2 ** b - 1), "pos_hi": int(2 ** (b + 1) - 2), "n": int(len(g)),
            "kl_mean": mean, "kl_ci_lo": mean - half, "kl_ci_hi": mean + half,
            "kl_median": float(pct[0]), "kl_p90": float(pct[1]), "kl_p99": float(pct[2]),
            "kl_p999": float(pct[3]), "kl_max": float(fin.max()) if n else math.nan,
            "top1_agree": float(g["top1_agree"].mean()), "nonfinite": int(g["nonfinite"].sum()),
        })
    return pd.DataFrame(rows)


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
            "segment_len": a.segment_len, "gdn_fold": a.gdn_fold, "max_tokens": a.max_tokens}


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


def run(a, policies, cfg_path, cfg, arch, token_docs, tok_name) -> int:
    import numpy as np
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from replayssm_quant.adapters import apply_state_policy
    from replayssm_quant.adapters.segments import forward_segment
    from replayssm_quant.models import load_model

    t0 = time.time()
    out = Path(a.output_dir)
    parts = out / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    (out / IDENTITY_FILE).write_text(json.dumps(run_identity(a, cfg), indent=2))
    dtype = getattr(torch, a.dtype)
    model, _ = load_model(a.model, dtype=dtype, device=a.device, tokenizer=False)
    threads = _set_threads(a, model)
    t_load = time.time() - t0
    cells = [(str(p), w, s) for p in policies for w in a.windows for s in a.seeds]
    handle = apply_state_policy(model, "fp32", window=a.windows[0], seed=0,
                                prefill=a.prefill > 0, gdn_fold=a.gdn_fold)
    N, P, S = a.max_tokens, a.prefill, a.segment_len
    timings = {"load_s": t_load, "reference_s": 0.0, "policies_s": {c[0]: 0.0 for c in cells}}
    bounds = [(0, P)] if P else []
    start = P
    while start < N:
        bounds.append((start, min(N, start + S)))
        start = bounds[-1][1]
    n_new = 0
    batches = [list(range(i, min(len(token_docs), i + a.batch_size)))
               for i in range(0, len(token_docs), a.batch_size)]
    bar = tqdm(batches, desc="documents", unit="batch", disable=a.no_progress)
    with torch.no_grad():
        for batch in bar:
            todo = [c for c in cells if any(not (parts / f"{_cell_key(token_docs[d], *c)}.parquet").exists()
                                            for d in batch)]
            if not todo:
                continue
            full = torch.tensor([token_docs[d]["ids"] for d in batch], device=a.device)
            ids, targets = full[:, :N], full[:, 1:N + 1]  # position t predicts token t + 1
            handle.sequence_ids = list(batch)
            caches = {c: None for c in todo}
            ref_cache = None
            rows = {c: [] for c in todo}
            for (lo, hi) in bounds:
                tr = time.time()
                handle.set_policy("fp32")
                ref, ref_cache = forward_segment(model, ids[:, lo:hi], ref_cache, start=lo)
                timings["reference_s"] += time.time() - tr
                if hi <= P:  # prefill positions are exact in every cell: not reported
                    for c in todo:
                        tp = time.time()
                        handle.set_policy(c[0], window=c[1], seed=c[2])
                        _, caches[c] = forward_segment(model, ids[:, lo:hi], caches[c], start=lo)
                        timings["policies_s"][c[0]] += time.time() - tp
                    continue
                for c in tqdm(todo, desc="cells", leave=False, disable=a.no_progress):
                    tp = time.time()
                    handle.set_policy(c[0], window=c[1], seed=c[2])
                    lg, caches[c] = forward_segment(model, ids[:, lo:hi], caches[c], start=lo)
                    m = position_metrics(ref, lg, targets[:, lo:hi])
                    timings["policies_s"][c[0]] += time.time() - tp
                    rows[c].append(m)
            for c in todo:
                for bi, d in enumerate(batch):
                    f = parts / f"{_cell_key(token_docs[d], *c)}.parquet"
                    if f.exists():
                        continue
                    cols = {k: np.concatenate([m[k][bi] for m in rows[c]]) for k in rows[c][0]}
                    n = cols["kl"].shape[0]
                    df = pd.DataFrame({"doc": token_docs[d]["id"], "position": np.arange(N - n, N),
                                       "policy": c[0], "window": c[1], "seed": c[2], **cols})
                    df["nonfinite"] = df["nonfinite"].astype(bool)
                    df["top1_agree"] = df["top1_agree"].astype(bool)
                    df[list(COLUMNS)].to_parquet(f.with_suffix(".tmp"), index=False)
                    os.replace(f.with_suffix(".tmp"), f)
                    n_new += 1
    handle.remove()
    frames = []
    for d in range(len(token_docs)):
        for c in cells:
            f = parts / f"{_cell_key(token_docs[d], *c)}.parquet"
            if f.exists():
                frames.append(pd.read_parquet(f))
    pos = pd.concat(frames, ignore_index=True)
    pos.to_parquet(out / "positions.parquet", index=False)
    summ = summarize(pos)
    summ.to_csv(out / "summary.csv", index=False)
    timings["total_s"] = time.time() - t0
    n_tok = sum(len(d["ids"]) for d in token_docs)  # N + 1 per document (the last is a target only)
    manifest = {
        "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
        "args": vars(a), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": _git_commit(),
        "versions": _versions(),
        "model": {"name": a.model, "path": cfg_path, "model_type": arch, "dtype": a.dtype,
                  "config_sha256": hashlib.sha256(cfg.to_json_string().encode()).hexdigest(),
                  "params": int(sum(p.numel() for p in model.parameters()))},
        "data": {"dataset": a.dataset, "split": a.split, "tokenizer": tok_name,
                 "documents": [d["id"] for d in token_docs], "tokens": n_tok,
                 "token_sha256": hashlib.sha256(json.dumps([d["ids"] for d in token_docs]).encode()).hexdigest()},
        "policies": [str(p) for p in policies], "windows": a.windows, "seeds": a.seeds,
        "cells_computed_this_run": n_new, "timings": timings, "threads": threads,
        "nonfinite_rows": int(pos["nonfinite"].sum()),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
    overall = pos.groupby(["policy", "window"]).agg(
        kl_mean=("kl", "mean"), kl_p99=("kl", lambda s: float(np.nanpercentile(s, 99)) if s.notna().any() else math.nan),
        kl_max=("kl", "max"), top1_agree=("top1_agree", "mean"), nonfinite=("nonfinite", "sum"),
        positions=("kl", "size")).reset_index()
    print(f"\nreplayssm-kl: {len(token_docs)} documents x {N} tokens, model {a.model} ({arch}), "
          f"{timings['total_s']:.1f} s; output {out}")
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print(overall.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        policies = _check_args(a)
        cfg_path, cfg, arch = _load_config(a.model)
        docs = _load_docs(a)
        vocab = cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size
        encode, tok_name = _load_tokenizer(cfg_path, vocab)
        token_docs = _make_documents(docs, encode, a.max_tokens + 1, a.max_docs)
        for d in token_docs:
            d["sha"] = hashlib.sha256(json.dumps(list(d["ids"])).encode()).hexdigest()[:24]
        _check_identity(a, cfg)
        if not token_docs:
            raise BadArgs(f"dataset {a.dataset} has fewer than {a.max_tokens} tokens in all; "
                          "lower --max-tokens")
        n_cells = len(policies) * len(a.windows) * len(a.seeds)
        if a.dry_run:
            est = memory_estimate(cfg, a, n_cells)
            print(f"plan: model {a.model} ({arch}, {est['params']:,} parameters, {a.dtype}, {a.device})")
            print(f"      {len(token_docs)} documents x N={a.max_tokens} tokens (prefill {a.prefill}), "
                  f"segments of {a.segment_len}, batch {a.batch_size}, tokenizer {tok_name}")
            print(f"      {n_cells} cells = policies {[str(p) for p in policies]} x windows {a.windows} "
                  f"x seeds {a.seeds}; reference fp32 computed once per document")
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
        return run(a, policies, cfg_path, cfg, arch, token_docs, tok_name)
    except KeyboardInterrupt:
        done = len(list((Path(a.output_dir) / "parts").glob("*.parquet")))
        print(f"\nreplayssm-kl: interrupted; {done} finished cells are saved in "
              f"{a.output_dir}/parts; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
