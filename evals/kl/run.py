"""``replayssm-kl``: one run -- the lockstep loop over documents, segments and cells, resume
from the finished parts, and the tables and manifest it writes (docs/kl-runner.md).

The command line, argument checks and the plan (``--dry-run``, memory estimate) are in
:mod:`replayssm_quant.evals.kl`; the per-position metrics in :mod:`.metrics`; documents and
tokenisation in :mod:`.documents`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from .metrics import bucket_sums, pair_kl, position_metrics, summarize
from .state_error import STATE_ERROR_COLUMNS, state_error_rows

COLUMNS = ("doc", "position", "policy", "window", "seed", "kl", "top1_agree", "dp_ref",
           "nll_ref", "nll", "nonfinite", "nonfinite_ref", "nonfinite_policy")


#: ``stepwise.parquet``: kl_path = KL(stepping || emulation) of the cell, kl_path_ref the same for
#: the fp32 reference, kl = KL(ref || cell) as the runner measures it (emulation), kl_step the
#: same with both sides stepped token by token.
STEP_COLUMNS = ("doc", "position", "policy", "window", "seed", "kl_path", "kl_path_ref", "kl",
                "kl_step", "top1_path_agree", "nonfinite")


#: Part of the resume identity: how the stored numbers were computed. Change it whenever a
#: metric's definition or the tokenisation changes, so old part files are never mixed in.
METRICS_VERSION = ("2026-12-01b: float64 KL >= 0 by construction; non-finite per side; BOS; "
                   "reference fp32 with L = 1")

#: The fp32 reference's window: L = 1 is FP32-state decoding token by token.
REFERENCE_WINDOW = 1


class BadArgs(Exception):
    """A user error detected before any compute (exit code 2)."""


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


def _state_dir(out: Path) -> Path:
    return out / "parts" / "state-error"


def canonical_cells(cells, configs, seeds) -> dict:
    """``{cell: computed cell}``: cells that cannot differ are computed once. An ``eager:``
    policy runs with window 1 whatever L was asked (``StateConfig.build``), and a policy that
    draws no random bits gives the same bits for every seed; such cells share the part file of
    ``(policy, effective window, seed if SR else seeds[0])`` and are labelled with their own
    window and seed in the tables."""
    return {c: (c[0], configs[c].window, c[2] if configs[c].policy.uses_sr else seeds[0]) for c in cells}


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
    # the fp32 reference: the sequential FP32 recurrence (L = 1: every token's output read
    # from the freshly updated unrounded state), whatever --windows asks, so a cell's numbers
    # do not depend on the other cells of the run
    ref_window = REFERENCE_WINDOW
    handle = apply_state_policy(model, "fp32", window=ref_window, seed=0,
                                prefill=a.prefill > 0, gdn_fold=a.gdn_fold, dt_limit=a.dt_limit)
    # every cell's settings parsed once (the policies were parsed by the argument checks)
    ref_config = handle.config
    configs = {c: StateConfig.build(pol, window=c[1], seed=c[2], fold=a.gdn_fold)
               for c, pol in zip(cells, cell_policies)}
    canon = canonical_cells(cells, configs, a.seeds)
    ucells = list(dict.fromkeys(canon.values()))  # what is computed, in request order
    for c, pol in zip(cells, cell_policies):
        if canon[c] not in configs:
            configs[canon[c]] = StateConfig.build(pol, window=canon[c][1], seed=canon[c][2],
                                                  fold=a.gdn_fold)
    E = bool(getattr(a, "state_error", False))
    state_dir = _state_dir(out)
    if E:
        state_dir.mkdir(parents=True, exist_ok=True)
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
        return parts / f"{_cell_key(token_docs[d], *canon.get(c, c))}.parquet"

    def step_part(d, c):
        return step_dir / f"{_cell_key(token_docs[d], *canon.get(c, c))}.parquet"

    def state_part(d, c):
        return state_dir / f"{_cell_key(token_docs[d], *canon.get(c, c))}.parquet"

    def missing(d, c):
        return (not part(d, c).exists() or (K and not step_part(d, c).exists())
                or (E and not state_part(d, c).exists()))

    n_new = 0
    batches = [list(range(i, min(len(token_docs), i + a.batch_size)))
               for i in range(0, len(token_docs), a.batch_size)]
    bar = tqdm(batches, desc="documents", unit="batch", disable=a.no_progress)
    with torch.no_grad():
        for batch in bar:
            todo = [c for c in ucells if any(missing(d, c) for d in batch)]
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
            err_rows = {c: [[] for _ in batch] for c in todo}
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
                    if E and (hi & (hi - 1) == 0 or hi == N):  # octave boundaries and the end
                        for bi in range(len(batch)):
                            err_rows[c][bi] += state_error_rows(
                                handle.states(ref_cache[bi]), handle.states(caches[c][bi]), hi)
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
                    if E and not state_part(d, c).exists():
                        df = pd.DataFrame(err_rows[c][bi], columns=[
                            k for k in STATE_ERROR_COLUMNS if k not in key])
                        for k, v in key.items():
                            df[k] = v
                        _write_parquet(df[list(STATE_ERROR_COLUMNS)], state_part(d, c))
    handle.remove()
    pos = _assemble(token_docs, cells, part, COLUMNS, np.arange(P, N))
    pos.to_parquet(out / "positions.parquet", index=False)
    bucket_sums(pos).to_parquet(out / "buckets.parquet", index=False)
    step = None
    if K:
        step = _assemble(token_docs, cells, step_part, STEP_COLUMNS, np.arange(P, step_end))
        step.to_parquet(out / "stepwise.parquet", index=False)
    else:  # a stepwise table of an earlier invocation would describe another run
        (out / "stepwise.parquet").unlink(missing_ok=True)
    if E:
        _assemble(token_docs, cells, state_part, STATE_ERROR_COLUMNS, None).to_parquet(
            out / "state_error.parquet", index=False)
    else:
        (out / "state_error.parquet").unlink(missing_ok=True)
    summ = summarize(pos, step)
    summ.to_csv(out / "summary.csv", index=False)
    timings["total_s"] = time.time() - t0
    earlier = _earlier_manifest(out)
    n_tok = sum(len(d["ids"]) for d in token_docs)  # N + 1 per document (the last is a target only)
    nf_by_policy = pos.groupby("policy")[["nonfinite", "nonfinite_ref", "nonfinite_policy"]].sum()
    manifest = {
        "command": _command(),
        "commands": earlier.get("commands", []) + [_command()],
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
        "shared_cells": {f"{c[0]} L={c[1]} seed={c[2]}": f"{k[0]} L={k[1]} seed={k[2]}"
                         for c, k in canon.items() if c != k},
        "shared_cells_note": "cells that cannot differ (eager: policies run with L = 1; policies "
                             "without SR ignore the seed) are computed once and labelled with "
                             "each requested window and seed",
        "state_error": bool(E),
        # compute of every invocation that contributed to these tables (a resume adds to it)
        "timings": _add_timings(earlier.get("timings"), timings) if n_new < len(ucells) * len(token_docs)
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
    print(f"{'' if a.no_progress else chr(10)}replayssm-kl: {len(token_docs)} documents x {N} tokens, "
          f"model {a.model} ({arch}), "
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


def _command() -> list:
    """The command line as the user typed it (``python -m replayssm_quant.evals.kl`` shows as
    ``replayssm-kl``, its console script)."""
    prog = os.path.basename(sys.argv[0])
    return ["replayssm-kl" if prog == "__main__.py" else prog] + sys.argv[1:]


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
            df["policy"], df["window"], df["seed"] = c[0], c[1], c[2]  # a shared part's labels
            if positions is not None and not np.array_equal(df["position"].to_numpy(), positions):
                raise RuntimeError(f"{f} holds positions {df['position'].min()}..{df['position'].max()} "
                                   f"({len(df)} rows), expected {positions[0]}..{positions[-1]}; "
                                   "delete it and rerun")
            df["doc"] = token_docs[d]["id"]
            frames.append(df[list(columns)])
    return pd.concat(frames, ignore_index=True)
