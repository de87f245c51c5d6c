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

#: Part of the resume identity: what keys a document's stochastic-rounding streams. Since
#: 2026-12-04 a hash of the document's input tokens (before: its index in the run, so the same
#: document gave other bits in another corpus order, and a resumed run could mix the two).
SR_STREAMS = "sequence_id(document input tokens)"

#: The fp32 reference's window: L = 1 is FP32-state decoding token by token.
REFERENCE_WINDOW = 1


class BadArgs(Exception):
    """A user error detected before any compute (exit code 2)."""


class DamagedPart(Exception):
    """A part file of the output directory that cannot be read or holds other rows than its
    cell's (exit code 2: the message names the file; deleting it and rerunning recomputes
    that cell)."""


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
            "add_bos_token": a.add_bos_token, "metrics": METRICS_VERSION,
            "sr_streams": SR_STREAMS,
            # decay buckets of policy maps resolve through these (None: the model's own file)
            "decay_stats": _file_sha(getattr(a, "decay_stats", None))}


#: what sets each field of :func:`run_identity`, as the identity check's message names it
IDENTITY_FLAGS = {
    "model": "--model", "config_sha256": "the model's config (sha256)", "dtype": "--dtype",
    "device_type": "--device (type)", "prefill": "--prefill", "segment_len": "--segment-len",
    "gdn_fold": "--gdn-fold", "dt_limit": "--dt-limit",
    "max_tokens": "--max-tokens (-N; --at-N of replayssm-plan)",
    "add_bos_token": "--add-bos-token", "metrics": "the metrics version",
    "sr_streams": "the SR stream version", "decay_stats": "--decay-stats (sha256)",
}


def _file_sha(path) -> str | None:
    """sha256 of a file's bytes (None for None)."""
    if path is None:
        return None
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


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
        desc = ", ".join(f"{IDENTITY_FLAGS.get(k, k)}: {o!r} there vs {n!r} now"
                         for k, (o, n) in diff.items())
        raise BadArgs(f"--output-dir {a.output_dir!r} holds a run with other settings ({desc}); "
                      "use another --output-dir or remove it")


def _earlier_manifest(out: Path) -> dict:
    """The manifest an earlier invocation left in ``out`` (empty if none or unreadable)."""
    try:
        return json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return {}


def _ledger_path(out: Path) -> Path:
    """``parts/invocations.jsonl``: the compute of invocations that stopped at
    ``--max-cells`` (they write no manifest), counted by the invocation that writes one."""
    return out / "parts" / "invocations.jsonl"


def _ledger_append(out: Path, entry: dict) -> None:
    with open(_ledger_path(out), "a") as f:
        f.write(json.dumps(entry, default=str) + "\n")


def _ledger_read(out: Path) -> list:
    """The ledger's entries (a line cut short by a crash is skipped)."""
    try:
        lines = _ledger_path(out).read_text().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            entries.append(json.loads(line))
        except ValueError:
            continue
    return entries


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
    """HEAD of the source tree, with ``-dirty`` when its files differ from that commit (as
    ``git describe --dirty`` marks it), None outside a git checkout."""
    try:
        root = Path(__file__).resolve().parents[2]
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        if not head:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
        return head + ("-dirty" if dirty else "")
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
    return {c: (c[0], configs[c].window, c[2] if configs[c].uses_sr else seeds[0]) for c in cells}


def stepwise_summary(step) -> list:
    """Per (policy, window): the path noise KL(stepping || emulation) of the checked positions
    next to the policy's KL on the same positions (emulated and stepped)."""
    import numpy as np

    from replayssm_quant.analysis.results import path_ratios  # pandas, scipy: lazily

    rows = []
    # rows in an order fixed by the values summed below (not by the run's document order or
    # the documents' labels); rows equal in every key add the same values, in any order
    step = step.sort_values([k for k in ("position", "kl_path", "kl_path_ref", "kl", "kl_step")
                             if k in step.columns], kind="stable")
    for (pol, win), g in step.groupby(["policy", "window"], sort=True):
        def mean(c):
            v = g[c].to_numpy(np.float64)
            v = v[np.isfinite(v)]
            return float(v.mean()) if v.size else math.nan
        path = g["kl_path"].to_numpy(np.float64)
        path = path[np.isfinite(path)]
        kl = mean("kl")
        to_effect, rel = path_ratios(mean("kl_path"), kl, mean("kl_step"))
        rows.append({"policy": pol, "window": int(win), "positions": int(len(g)),
                     "path_kl_mean": mean("kl_path"),
                     "path_kl_p99": float(np.percentile(path, 99)) if path.size else math.nan,
                     "path_kl_max": float(path.max()) if path.size else math.nan,
                     "kl_mean": kl, "kl_step_mean": mean("kl_step"),
                     "path_to_effect": to_effect, "mean_rel_diff": rel,
                     "path_kl_ref_mean": mean("kl_path_ref"),
                     "top1_path_agree": float(g["top1_path_agree"].mean()),
                     "nonfinite": int(g["nonfinite"].sum())})
    return rows


def part_path(out: Path, doc: dict, cell) -> Path:
    """Part file of one finished (document, cell): ``parts/<key>.parquet``."""
    return out / "parts" / f"{_cell_key(doc, *cell)}.parquet"


def step_part_path(out: Path, K: int, doc: dict, cell) -> Path:
    """Stepwise-check part file of one (document, cell): ``parts/stepwise-K<K>/<key>.parquet``."""
    return _step_dir(out, K) / f"{_cell_key(doc, *cell)}.parquet"


def state_part_path(out: Path, doc: dict, cell) -> Path:
    """State-error part file of one (document, cell): ``parts/state-error/<key>.parquet``."""
    return _state_dir(out) / f"{_cell_key(doc, *cell)}.parquet"


def shared_sequence_ids(seq_ids, names) -> dict:
    """The SR sequence ids (``adapters.sequence_id``, 20-bit hashes of the documents' tokens)
    that more than one document of a run draws: ``{id: [document names]}`` (empty when every
    id is distinct). Distinct documents collide by chance once a corpus has about
    ``sqrt(2^20)`` = 1024 documents (the birthday bound); such documents draw the same SR bits
    at every flush, so their rounding noise is correlated, though their values differ."""
    by_id: dict = {}
    for s, n in zip(seq_ids, names):
        by_id.setdefault(int(s), []).append(n)
    return {s: v for s, v in sorted(by_id.items()) if len(v) > 1}


def run_cells(policies, a) -> list:
    """The run's cells ``(policy string, window, seed)``, policy-major, as the tables order them."""
    return [(str(p), w, s) for p in policies for w in a.windows for s in a.seeds]


def cell_plan(policies, a) -> tuple:
    """``(cells, canon, ucells, configs)``: the requested cells (the tables' labels), the
    computed cell of each (:func:`canonical_cells`), the computed cells in request order (the
    units of work and of the part files), and the parsed ``StateConfig`` of every one (a
    :class:`~.maps.MapCellConfig` for a policy map, resolved by :func:`run` once the model is
    loaded)."""
    from .maps import cell_config

    def build(p, window, seed):
        return cell_config(p, window, seed, a.gdn_fold)

    cells = run_cells(policies, a)
    pols = [p for p in policies for _ in a.windows for _ in a.seeds]
    configs = {c: build(p, c[1], c[2]) for c, p in zip(cells, pols)}
    canon = canonical_cells(cells, configs, a.seeds)
    ucells = list(dict.fromkeys(canon.values()))
    for c, p in zip(cells, pols):
        if canon[c] not in configs:
            configs[canon[c]] = build(p, canon[c][1], canon[c][2])
    return cells, canon, ucells, configs


def pending_pairs(out: Path, token_docs, ucells, K: int, E: bool = False) -> list:
    """``(document index, computed-cell index)`` of every computed cell whose part file (or,
    with the stepwise check / ``--state-error``, whose stepwise / state-error part) is
    missing, document-major: the work left (resume)."""
    return [(d, c) for d in range(len(token_docs)) for c in range(len(ucells))
            if not part_path(out, token_docs[d], ucells[c]).exists()
            or (K and not step_part_path(out, K, token_docs[d], ucells[c]).exists())
            or (E and not state_part_path(out, token_docs[d], ucells[c]).exists())]


def write_identity(a, cfg) -> None:
    """Write ``run_identity.json`` (atomically: other ranks may be reading it)."""
    out = Path(a.output_dir)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    f = out / IDENTITY_FILE
    tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(run_identity(a, cfg), indent=2))
    os.replace(tmp, f)


def run(a, policies, cfg_path, cfg, arch, token_docs, tokz, *, work=None, group=None,
        device=None, device_map=None, params=None, left=0, plans=None) -> int:
    """Compute this rank's (document, cell) pairs and, on rank 0, write the tables.

    Args:
        work: this rank's ``(document index, cell index)`` pairs (default: every missing one).
        group: the :class:`~replayssm_quant.evals.kl.dist.Group` (default: a single process).
        device: this rank's torch device for the inputs (default ``a.device``).
        device_map: accelerate device map of ``--device-map auto`` on CUDA (None: one device).
        params: parameter count (manifest; default: counted on the loaded model).
        left: pairs that remain missing after this invocation (``--max-cells``): the tables
            are then not written.
        plans: the memory plan of every rank (recorded in the manifest).
    Returns the exit code (0).
    """
    import numpy as np
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from replayssm_quant.adapters import SEQ_ID_BITS, apply_state_policy, sequence_id
    from replayssm_quant.adapters.mamba2 import DtLimit
    from replayssm_quant.adapters.segments import forward_each
    from replayssm_quant.models import load_model

    from .maps import MapCellConfig, resolve_maps

    t0 = time.time()
    out = Path(a.output_dir)
    cells, canon, ucells, configs = cell_plan(policies, a)
    N, P, S, K = a.max_tokens, a.prefill, a.segment_len, a.stepwise_check
    E = bool(getattr(a, "state_error", False))
    if work is None:
        work = pending_pairs(out, token_docs, ucells, K, E)
    rank = group.rank if group is not None else 0
    world = group.world_size if group is not None else 1
    device = device or a.device
    # no bars with --no-progress, off rank 0, or where stderr is not a terminal (tqdm's
    # disable=None: a log file gets no redrawn bars)
    quiet = True if a.no_progress or rank != 0 else None
    if rank == 0:
        write_identity(a, cfg)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    step_end = P + K
    if K:
        _step_dir(out, K).mkdir(parents=True, exist_ok=True)
    if E:
        _state_dir(out).mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, a.dtype)
    if a.no_progress:  # transformers' weight-loading bar too
        import transformers

        transformers.utils.logging.disable_progress_bar()
    timings = {"load_s": 0.0, "reference_s": 0.0, "policies_s": {c[0]: 0.0 for c in cells},
               "stepwise_s": 0.0}
    # the fp32 reference: the sequential FP32 recurrence (L = 1: every token's output read
    # from the freshly updated unrounded state), whatever --windows asks, so a cell's numbers
    # do not depend on the other cells of the run
    ref_window = REFERENCE_WINDOW
    bounds = _segments(N, P, S)
    reported = np.concatenate([np.arange(lo, hi) for lo, hi in bounds if hi > P])
    assert reported.tolist() == list(range(P, N)), "segment bounds do not tile [prefill, N)"
    model = handle = None
    n_new = n_refs = n_step_new = n_state_new = 0
    threads = _set_threads(a)
    if work:
        kw = {"device_map": device_map} if device_map else {}
        model, _ = load_model(a.model, dtype=dtype, device=device, tokenizer=False, **kw)
        threads = _set_threads(a, model)
        if params is None:
            params = int(sum(p.numel() for p in model.parameters()))
        handle = apply_state_policy(model, "fp32", window=ref_window, seed=0,
                                    prefill=a.prefill > 0, gdn_fold=a.gdn_fold, dt_limit=a.dt_limit,
                                    decay_stats=getattr(a, "decay_stats", None))
        handle.track_input_stats = bool(getattr(a, "state_error", False))  # decays per head
        ref_config = handle.config
        # policy maps resolved against the loaded model, one StateConfig per layer
        configs = {c: handle.build_config(k.policy, window=k.window, seed=k.seed, fold=a.gdn_fold)
                   if isinstance(k, MapCellConfig) else k for c, k in configs.items()}
    timings["load_s"] = time.time() - t0

    # SR stream key of each document: the hash of its N input tokens (adapters.sequence_id, as
    # the lm-eval adapter keys a row), so a document's numbers follow it, not its index
    seq_ids = [sequence_id(d["ids"][:N]) for d in token_docs]
    shared_ids = shared_sequence_ids(seq_ids, [d["id"] for d in token_docs])
    if shared_ids and rank == 0:
        print(f"replayssm-kl: note: {sum(len(v) for v in shared_ids.values())} of "
              f"{len(seq_ids)} documents share an SR sequence id with another (a "
              f"{SEQ_ID_BITS}-bit hash of the tokens; expected once the corpus nears "
              f"sqrt(2^{SEQ_ID_BITS}) documents): their stochastic roundings draw the same "
              f"random bits, so their rounding noise is correlated (manifest.json "
              f"'sr_sequence_ids'; docs/kl-runner.md)", file=sys.stderr)
    cells_of: dict = {}  # document index -> this rank's computed cells of it, in order
    for d, c in work:
        cells_of.setdefault(d, []).append(ucells[c])
    docs = sorted(cells_of)
    batches = [docs[i:i + a.batch_size] for i in range(0, len(docs), a.batch_size)]
    bar = tqdm(batches, desc="documents", unit="batch", disable=quiet)
    with torch.no_grad():
        for batch in bar:
            # rows[c]: positions in the batch of the documents that need cell c
            rows = {c: [i for i, d in enumerate(batch) if c in cells_of[d]] for c in ucells}
            todo = [c for c in ucells if rows[c]]
            full = torch.tensor([token_docs[d]["ids"] for d in batch], device=device)
            ids, targets = full[:, :N], full[:, 1:N + 1]  # position t predicts token t + 1

            def fwd(c, x, cache, start, c_rows=None):
                # every document alone through the model, SR keyed by its own input tokens
                # (not by its place in the run: the same document, policy and seed give the
                # same bits in any corpus order or subset)
                r = list(range(len(batch))) if c_rows is None else c_rows
                return forward_each(model, x[r], cache, start=start, handle=handle,
                                    sequence_ids=[seq_ids[batch[i]] for i in r])

            # cells in passes of --cells-per-pass (each pass runs the reference again: the
            # caches of one pass's cells are live together)
            G = a.cells_per_pass or len(todo)
            ref_step = None
            for pc in [todo[i:i + G] for i in range(0, len(todo), G)]:
                n_refs += len(batch)
                caches = {c: None for c in pc}
                ref_cache = None
                metrics = {c: [] for c in pc}
                err_rows = {c: [[] for _ in rows[c]] for c in pc}  # --state-error, per row
                kept = {c: [] for c in pc}  # emulated logits of the stepwise-checked positions
                ref_kept = []
                for (lo, hi) in bounds:
                    tr = time.time()
                    handle.use(ref_config)
                    ref, ref_cache = fwd(None, ids[:, lo:hi], ref_cache, lo)
                    timings["reference_s"] += time.time() - tr
                    if hi <= P:  # prefill positions are exact in every cell: not reported
                        for c in pc:
                            tp = time.time()
                            handle.use(configs[c])
                            _, caches[c] = fwd(c, ids[:, lo:hi], caches[c], lo, rows[c])
                            timings["policies_s"][c[0]] += time.time() - tp
                        continue
                    ks, ke = max(lo, P) - lo, min(hi, step_end) - lo  # checked part of this segment
                    if ke > ks:
                        ref_kept.append(ref[:, ks:ke].float().clone())
                    for c in tqdm(pc, desc="cells", leave=False, disable=quiet):
                        tp = time.time()
                        handle.use(configs[c])
                        lg, caches[c] = fwd(c, ids[:, lo:hi], caches[c], lo, rows[c])
                        r = rows[c]
                        metrics[c].append(position_metrics(ref[r], lg, targets[r, lo:hi]))
                        if ke > ks:
                            kept[c].append(lg[:, ks:ke].float().clone())
                        # the first segment end in each octave of N, and the end
                        if E and (hi.bit_length() > lo.bit_length() or hi == N):
                            for j, bi in enumerate(r):
                                err_rows[c][j] += state_error_rows(
                                    handle.states(ref_cache[bi]), handle.states(caches[c][j]), hi)
                        timings["policies_s"][c[0]] += time.time() - tp
                del caches, ref_cache
                step_rows = {}
                if K:
                    ts = time.time()
                    if ref_step is None:  # the stepped reference: once per document batch
                        handle.use(ref_config)
                        ref_step = _step_logits(
                            model, lambda m, x, cache, start: fwd(None, x, cache, start), ids, P, step_end)
                    ref_emul = torch.cat(ref_kept, 1)
                    for c in pc:
                        handle.use(configs[c])
                        r = rows[c]
                        step = _step_logits(
                            model, lambda m, x, cache, start, c=c, r=r: fwd(c, x, cache, start, r),
                            ids, P, step_end)
                        step_rows[c] = _stepwise_rows(ref_emul[r], ref_step[r], torch.cat(kept[c], 1), step)
                    timings["stepwise_s"] += time.time() - ts
                for c in pc:
                    for j, bi in enumerate(rows[c]):
                        doc = token_docs[batch[bi]]
                        key = {"doc": doc["id"], "policy": c[0], "window": c[1], "seed": c[2]}
                        f = part_path(out, doc, c)
                        if not f.exists():
                            cols = {k: np.concatenate([m[k][j] for m in metrics[c]])
                                    for k in metrics[c][0]}
                            if cols["kl"].shape[0] != reported.size:
                                raise RuntimeError(f"cell {c}: {cols['kl'].shape[0]} positions for "
                                                   f"{reported.size} reported ones (runner bug)")
                            df = pd.DataFrame({**key, "position": reported, **cols})
                            _write_parquet(df[list(COLUMNS)], f)
                            n_new += 1
                        if K and not step_part_path(out, K, doc, c).exists():
                            sr = {k: v[j] for k, v in step_rows[c].items()}
                            df = pd.DataFrame({**key, "position": np.arange(P, step_end), **sr})
                            _write_parquet(df[list(STEP_COLUMNS)], step_part_path(out, K, doc, c))
                            n_step_new += 1
                        if E and not state_part_path(out, doc, c).exists():
                            df = pd.DataFrame(err_rows[c][j], columns=[
                                k for k in STATE_ERROR_COLUMNS if k not in key])
                            for k, v in key.items():
                                df[k] = v
                            _write_parquet(df[list(STATE_ERROR_COLUMNS)], state_part_path(out, doc, c))
                            n_state_new += 1
    if handle is not None:
        handle.remove()
    timings["total_s"] = time.time() - t0
    import socket

    mine = {"rank": rank, "host": socket.gethostname(), "device": str(device),
            "peak_memory": _peak_memory(device, device_map),
            "device_map": sorted({str(v) for v in device_map.values()}) if device_map else None,
            "pairs": len(work), "documents": len(docs), "references": n_refs,
            "cells_computed": n_new, "stepwise_parts_computed": n_step_new,
            "state_error_parts_computed": n_state_new,
            "threads": threads, "params": params, "timings": timings}
    # every rank's statistics on rank 0; this waits for the slowest rank
    ranks_stats = group.all_gather(mine) if group is not None else [mine]
    if rank != 0:
        return 0
    n_new = sum(r["cells_computed"] for r in ranks_stats)
    n_step_new = sum(r["stepwise_parts_computed"] for r in ranks_stats)
    n_state_new = sum(r["state_error_parts_computed"] for r in ranks_stats)
    params = params if params is not None else next((r["params"] for r in ranks_stats
                                                     if r["params"] is not None), None)
    if left:
        if n_new or n_step_new or n_state_new:  # its compute counts in the final manifest
            timings = _sum_timings([r["timings"] for r in ranks_stats])
            timings["total_s"] = time.time() - t0
            _ledger_append(out, {"id": f"{time.time_ns()}-{os.getpid()}",
                                 "command": _command(), "timings": timings,
                                 "cells_computed": n_new, "stepwise_parts_computed": n_step_new,
                                 "state_error_parts_computed": n_state_new})
        done = len(ucells) * len(token_docs) - left
        print(f"replayssm-kl: stopped after --max-cells {a.max_cells}: {done} of "
              f"{len(ucells) * len(token_docs)} cells are done ({n_new} in this run, on {world} "
              f"rank(s)); rerun the same command to continue. Tables are written when every "
              f"cell is done.")
        return 0
    timings = _sum_timings([r["timings"] for r in ranks_stats])
    timings["total_s"] = time.time() - t0  # wall time of this invocation (rank 0)
    # the tables: every requested cell, from its computed cell's part (labelled with its own
    # window and seed)
    pos = _assemble(token_docs, cells, lambda d, c: part_path(out, token_docs[d], canon[c]),
                    COLUMNS, np.arange(P, N))
    pos.to_parquet(out / "positions.parquet", index=False)
    bucket_sums(pos).to_parquet(out / "buckets.parquet", index=False)
    step = None
    if K:
        step = _assemble(token_docs, cells, lambda d, c: step_part_path(out, K, token_docs[d], canon[c]),
                         STEP_COLUMNS, np.arange(P, step_end))
        step.to_parquet(out / "stepwise.parquet", index=False)
    else:  # a stepwise table of an earlier invocation would describe another run
        (out / "stepwise.parquet").unlink(missing_ok=True)
    if E:
        _assemble(token_docs, cells, lambda d, c: state_part_path(out, token_docs[d], canon[c]),
                  STATE_ERROR_COLUMNS, None).to_parquet(out / "state_error.parquet", index=False)
    else:
        (out / "state_error.parquet").unlink(missing_ok=True)
    # a policy without SR has one result for every seed: its other seeds' rows are copies
    # (labels, not data) and would double its counts and narrow its intervals. Every
    # statistic below (summary.csv, the manifest's counts and stepwise summary, the printed
    # table) counts each computed row once; positions.parquet keeps the labelled copies.
    copies = [c for c, k in canon.items() if c[2] != k[2]]

    def computed(df):
        if df is None or not copies:
            return df
        return df[~pd.MultiIndex.from_frame(df[["policy", "window", "seed"]]).isin(copies)]

    upos, ustep = computed(pos), computed(step)
    summ = summarize(upos, ustep)
    summ.to_csv(out / "summary.csv", index=False)
    earlier = _earlier_manifest(out)
    # --max-cells invocations since the last manifest; none that a manifest already took in
    # (a crash between writing it and removing the ledger), and none when this invocation
    # computed every cell (their parts are gone)
    counted = set(earlier.get("invocations_counted", []))
    resumed = n_new < len(ucells) * len(token_docs)  # some cells came from earlier runs
    ledger = [e for e in _ledger_read(out) if e.get("id") not in counted] if resumed else []
    n_tok = sum(len(d["ids"]) for d in token_docs)  # N + 1 per document (the last is a target only)
    nf_by_policy = upos.groupby("policy")[["nonfinite", "nonfinite_ref", "nonfinite_policy"]].sum()
    all_timings = _add_timings(earlier.get("timings"), timings) if resumed else timings
    for e in ledger:
        all_timings = _add_timings(e.get("timings"), all_timings)
    manifest = {
        "command": _command(),
        "commands": (earlier.get("commands", []) + [e["command"] for e in ledger]
                     + [_command()]),
        "args": vars(a), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git_commit": _git_commit(),
        "versions": _versions(), "metrics": METRICS_VERSION,
        "model": {"name": a.model, "path": cfg_path, "model_type": arch, "dtype": a.dtype,
                  "config_sha256": hashlib.sha256(cfg.to_json_string().encode()).hexdigest(),
                  "params": params},
        "data": {"dataset": a.dataset, "split": a.split, "tokenizer": tokz.name,
                 "documents": [d["id"] for d in token_docs], "tokens": n_tok,
                 "token_sha256": hashlib.sha256(json.dumps([d["ids"] for d in token_docs]).encode()).hexdigest()},
        "bos": tokz.manifest(),
        "policies": [str(p) for p in policies], "windows": a.windows, "seeds": a.seeds,
        "policy_maps": resolve_maps(policies, cfg, cfg_path, getattr(a, "decay_stats", None)),
        "reference": {"policy": "fp32", "window": ref_window, "seed": 0},
        "dt_limit": str(DtLimit.parse(a.dt_limit)),
        "sr_sequence_ids": {"bits": SEQ_ID_BITS, "shared": {str(k): v for k, v in shared_ids.items()}},
        "invariance": "each document runs through the model alone (adapters.segments.forward_each); "
                      "SR streams keyed by a hash of each document's input tokens "
                      "(adapters.sequence_id); docs/invariance.md",
        "world_size": world,
        "distributed": {
            "world_size": world,
            "sharding": "the missing (document, computed cell) pairs, document-major, in contiguous blocks "
                        "of equal size (docs/distributed.md); results do not depend on it",
            "device_map": getattr(a, "device_map", None),
            "ranks": [{k: v for k, v in r.items() if k != "params"} for r in ranks_stats],
            "memory_plan": plans,
        },
        "cells_computed_this_run": n_new,
        "stepwise_parts_computed_this_run": n_step_new,
        "state_error_parts_computed_this_run": n_state_new,
        "threads": ranks_stats[0]["threads"],
        "shared_cells": {f"{c[0]} L={c[1]} seed={c[2]}": f"{k[0]} L={k[1]} seed={k[2]}"
                         for c, k in canon.items() if c != k},
        "shared_cells_note": "cells that cannot differ (eager: policies run with L = 1; policies "
                             "without SR ignore the seed) are computed once and labelled with "
                             "each requested window and seed",
        "state_error": bool(E),
        # compute of every invocation that contributed to these tables (a resume adds to it;
        # so do --max-cells invocations, through the ledger); seconds summed over ranks,
        # total_s the wall time of the invocations
        "timings": all_timings,
        "timings_this_invocation": timings,
        # the --max-cells invocations (parts/invocations.jsonl) whose compute `timings` holds
        "invocations_counted": sorted(counted | {e["id"] for e in ledger if "id" in e}),
        # computed rows (a non-SR policy's label copies for other seeds counted once)
        "nonfinite_rows": int(upos["nonfinite"].sum()),
        "nonfinite_ref_rows": int(upos["nonfinite_ref"].sum()),
        "nonfinite_policy_rows": int(upos["nonfinite_policy"].sum()),
        "nonfinite_ref_positions": int(pos.loc[pos["nonfinite_ref"], ["doc", "position"]]
                                       .drop_duplicates().shape[0]),
        "nonfinite_by_policy": {p: {k: int(v) for k, v in r.items()}
                                for p, r in nf_by_policy.iterrows()},
        "stepwise_check": {
            "tokens": K, "positions": [P, step_end],
            "what": "KL(P_stepping || P_emulation) per position: the same cell decoded token by "
                    "token (one forward call per token with the cache) versus teacher-forced "
                    "emulation; kl_mean/kl_step_mean: the policy's KL on the same positions",
            "per_policy": stepwise_summary(ustep) if K else [],
        },
    }
    tmp = out / "manifest.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, default=str))
    os.replace(tmp, out / "manifest.json")
    _ledger_path(out).unlink(missing_ok=True)  # now counted in the manifest
    fin = upos[~upos["nonfinite"]]
    overall = fin.groupby(["policy", "window"]).agg(
        kl_mean=("kl", "mean"), kl_p99=("kl", lambda s: float(np.percentile(s, 99)) if len(s) else math.nan),
        kl_max=("kl", "max")).reset_index().merge(
        upos.groupby(["policy", "window"]).agg(
            top1_agree=("top1_agree", "mean"), nonfinite_ref=("nonfinite_ref", "sum"),
            nonfinite_policy=("nonfinite_policy", "sum"), positions=("kl", "size")).reset_index(),
        on=["policy", "window"], how="right")
    where = f", {world} ranks" if world > 1 else ""
    docs = f"{len(token_docs)} document{'' if len(token_docs) == 1 else 's'}"
    parts = [f"{n} {what} part{'' if n == 1 else 's'}" for n, what in
             ((n_step_new, "stepwise-check"), (n_state_new, "state-error")) if n]
    if n_new or parts:
        took = f"{timings['total_s']:.1f} s"
        if not n_new:
            took += f": every KL cell already in the output; computed {' and '.join(parts)}"
        if all_timings["total_s"] > timings["total_s"] + 0.05:
            took += f" ({all_timings['total_s']:.1f} s with the earlier invocations)"
    else:
        took = "every cell already in the output, nothing recomputed"
    print(f"{'' if a.no_progress else chr(10)}replayssm-kl: {docs} x {N} tokens, "
          f"model {a.model} ({arch}), {took}{where}; output {out}")
    mine = {part_path(out, d, c).name for d in token_docs for c in ucells}
    other = sum(1 for f in (out / "parts").glob("*.parquet") if f.name not in mine)
    if other and not a.no_other_cells_note:  # earlier invocations' cells: kept, resumable
        print(f"replayssm-kl: note: {out / 'parts'} also holds {other} finished (document, "
              "cell) piece(s) of cells not asked for by this command; the tables and summary "
              "cover this command's cells only (docs/kl-runner.md, resuming)", file=sys.stderr)
    with pd.option_context("display.width", 160, "display.max_columns", 20):
        print("KL(P_fp32 || P_policy) per position in nats: the policy's next-token distribution "
              "against the same model with FP32 state, teacher forcing; kl_p99 / kl_max over "
              "positions; top1_agree: share of positions with the same argmax; nonfinite_*: "
              "positions with non-finite logits (left out of the KL columns)")
        print(overall.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
        if K:
            sw = pd.DataFrame(manifest["stepwise_check"]["per_policy"])
            print(f"\nstepwise check, positions {P}..{step_end - 1}: path noise KL(stepping || "
                  "emulation) versus the policy's KL on the same positions (path_to_effect = "
                  "path_kl_mean / kl_mean; mean_rel_diff = kl_mean / kl_step_mean - 1; "
                  "path_kl_ref_mean: the path noise of the FP32 reference)")
            print(sw[["policy", "window", "path_kl_mean", "path_kl_max", "kl_mean", "kl_step_mean",
                      "path_to_effect", "mean_rel_diff", "path_kl_ref_mean"]].to_string(
                index=False, float_format=lambda v: f"{v:.3g}"))
    return 0


def _command() -> list:
    """The command line as the user typed it (``python -m replayssm_quant.evals.kl`` shows as
    ``replayssm-kl``, its console script)."""
    prog = os.path.basename(sys.argv[0])
    return ["replayssm-kl" if prog == "__main__.py" else prog] + sys.argv[1:]


def _peak_memory(device, device_map) -> dict:
    """Peak bytes this process used per device: ``torch.cuda.max_memory_allocated`` of each of
    its GPUs (no CUDA context), or the peak resident set size on CPU (whole process)."""
    import torch

    if str(device).startswith("cuda"):
        gpus = sorted({v for v in device_map.values() if isinstance(v, int)}) if device_map else \
            [torch.device(device).index or 0]
        return {f"cuda:{i}": int(torch.cuda.max_memory_allocated(i)) for i in gpus}
    try:
        import resource

        return {"cpu": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}
    except (ImportError, OSError):
        return {}


def _sum_timings(items: list) -> dict:
    """Per-rank timing dicts added up key by key (nested per policy)."""
    out: dict = {}
    for t in items:
        out = _add_timings(t, out) if out else {k: (dict(v) if isinstance(v, dict) else v)
                                               for k, v in t.items()}
    return out


#: parquet schema metadata key of a part file: the (document, cell) key it was written for
#: (its file name's stem), so a part copied over another is named, not read as that cell
PART_KEY = b"replayssm_part"


def _write_parquet(df, f: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(df, preserve_index=False)
    table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                           PART_KEY: f.stem.encode()})
    tmp = f.with_suffix(".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, f)


def _read_part(f: Path):
    """A part file's rows (pandas) and the (document, cell) key it was written for (None:
    written before 2026-12-06, which recorded none), in one read."""
    import pyarrow.parquet as pq

    table = pq.read_table(f)
    key = (table.schema.metadata or {}).get(PART_KEY)
    return table.to_pandas(), (key.decode() if key is not None else None)


def _assemble(token_docs, cells, part, columns, positions):
    """All part files of the run's documents and cells, labelled with the current document id
    (a document's cells are keyed by its tokens). Each must hold exactly ``positions``."""
    import numpy as np
    import pandas as pd

    frames = []
    for d in range(len(token_docs)):
        for c in cells:
            f = part(d, c)
            try:
                df, written_for = _read_part(f)
            except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
                raise DamagedPart(f"part file {f} cannot be read ({str(e).splitlines()[0][:160]}); "
                                  f"delete it and rerun to recompute that cell") from None
            if written_for is not None and written_for != f.stem:
                raise DamagedPart(f"part file {f} was written for another cell ({written_for}): "
                                  "a part copied or renamed by hand; delete it and rerun to "
                                  "recompute that cell")
            missing = [k for k in columns if k not in df.columns and k != "doc"]
            if missing:
                raise DamagedPart(f"part file {f} lacks the columns {missing}; delete it and "
                                  f"rerun to recompute that cell")
            df["policy"], df["window"], df["seed"] = c[0], c[1], c[2]  # a shared part's labels
            if positions is not None and not np.array_equal(df["position"].to_numpy(), positions):
                raise DamagedPart(f"part file {f} holds positions {df['position'].min()}.."
                                  f"{df['position'].max()} ({len(df)} rows), expected "
                                  f"{positions[0]}..{positions[-1]}; delete it and rerun")
            df["doc"] = token_docs[d]["id"]
            frames.append(df[list(columns)])
    return pd.concat(frames, ignore_index=True)
