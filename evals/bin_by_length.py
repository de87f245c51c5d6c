"""Bin lm-eval per-sample results by generation length (``replayssm-bin-by-length``).

State error grows with the number of tokens run through the state, so downstream accuracy is
best read per length bucket: the generated response's length (``--length response``, the
default: decoded tokens) or the prompt's (``--length context``: the context a loglikelihood or
multiple-choice request conditions on, which long-context tasks vary). Run lm-eval with
``--log_samples``; this reads the ``samples_<task>_*.jsonl`` files of one or more output
directories (one per state policy; several directories of one policy, e.g. runs at several
context lengths, pool into one run), measures each length in tokens of the given tokenizer (or
in whitespace words without one), and writes a tidy table: one row per (run, task, metric,
length bin) with the sample count, mean and its standard error.

Example::

    replayssm-bin-by-length runs/fp32 runs/shared_nvfp4 --tokenizer Qwen/Qwen3.5-4B \\
        --bins 0 512 1024 2048 4096 8192 32768 -o by_length.csv
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import numpy as np

from replayssm_quant.outpaths import check_distinct_dirs, output_file_problem

__all__ = ["load_samples", "check_bins", "outside_bins", "bin_by_length", "main"]


def _lm_eval_results(f: Path) -> dict | None:
    try:
        res = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return res if isinstance(res, dict) and isinstance(res.get("config"), dict) else None


def _results_for(samples_file: Path, read=_lm_eval_results) -> dict | None:
    """The results JSON that lm-eval wrote with ``samples_file``: the JSON in its folder with
    the same date suffix (``samples_<task>_<date>.jsonl`` beside ``results_<date>.json``, or
    ``<name>_<date>.json`` for an ``--output_path`` ending in ``<name>.json``); else the
    folder's only lm-eval results JSON (one with a ``config`` object); else None (the label
    is then the directory's name). ``read``: the JSON reader (a per-call cache: a folder's
    results files are read once for all its samples files)."""
    date = samples_file.stem.rsplit("_", 1)[-1]
    folder = samples_file.parent
    for f in sorted(folder.glob(f"*_{date}.json")):
        res = read(f)
        if res is not None:
            return res
    found = [r for f in sorted(folder.glob("*.json")) if (r := read(f)) is not None]
    return found[0] if len(found) == 1 else None


def _task_of(samples_file: Path) -> str:
    """The task of ``samples_<task>_<date>.jsonl``."""
    return samples_file.name[len("samples_"):].rsplit("_", 1)[0]


def _model_args(cfg: dict) -> dict:
    """The run's ``--model_args`` as a dict (lm-eval records a dict, or the string given)."""
    args = cfg.get("model_args")
    if isinstance(args, dict):
        return args
    out = {}
    if isinstance(args, str):
        for part in args.replace(" ", ",").split(","):
            k, eq, v = part.partition("=")
            if eq:
                out[k.strip()] = v.strip()
    return out


#: settings of a ReplaySSM run that a label names when two runs share a policy and window:
#: (label key, results-JSON ``config`` key; ``model`` is read from the JSON's ``model_name``)
_LABEL_FIELDS = (("model", None), ("seed", "replayssm_seed"), ("dtype", "model_dtype"),
                 ("dt_limit", "replayssm_dt_limit"), ("softmax_dtype", "replayssm_softmax_dtype"),
                 ("max_drafts", "replayssm_max_drafts"))
#: model arguments that do not change a score, or that the label names already
_NEUTRAL_ARGS = {"pretrained", "state", "window", "seed", "max_drafts", "dtype", "dt_limit",
                 "softmax_dtype", "batch_size", "max_batch_size", "device", "parallelize",
                 "device_map", "max_memory_per_gpu", "max_cpu_memory", "offload_folder",
                 "trust_remote_code", "use_fast_tokenizer"}


def _identity(res: dict | None, fallback: str, task: str) -> tuple[str, dict]:
    """A samples file's short label (``"<policy> L=<window>"`` from its results JSON, else
    ``fallback``: the directory name) and the settings that tell runs of one label apart:
    :data:`_LABEL_FIELDS`, every other model argument that can change a score (e.g.
    ``mixed_precision_dtype``, ``gdn_fold``, ``revision``), the task's ``num_fewshot`` and
    the run's ``gen_kwargs``."""
    cfg = res.get("config") if isinstance(res, dict) else None
    if not isinstance(cfg, dict):
        return fallback, {}
    margs = _model_args(cfg)
    settings = {}
    for key, field in _LABEL_FIELDS:
        settings[key] = (res.get("model_name") or margs.get("pretrained")) if field is None \
            else cfg.get(field)
    for k in sorted(margs):
        if k not in _NEUTRAL_ARGS:
            settings[k] = margs[k]
    nshot = res.get("n-shot")
    settings["num_fewshot"] = nshot.get(task) if isinstance(nshot, dict) else None
    settings["gen_kwargs"] = cfg.get("gen_kwargs") or None
    if cfg.get("replayssm_state"):
        return f"{cfg['replayssm_state']} L={cfg.get('replayssm_window')}", settings
    return fallback, settings


def _labels(idents: list[tuple[str, dict]]) -> list[str]:
    """One label per file: the short label, extended by the settings that differ between
    files of the same short label (e.g. ``"fp32 L=16 model=tiny-gdn"`` beside ``"fp32 L=16
    model=tiny-mamba2"``, or ``mixed_precision_dtype=bfloat16``, ``num_fewshot=1``), so
    runs whose settings differ never pool under one name."""
    out = []
    for base, settings in idents:
        peers = [s for b, s in idents if b == base]
        keys = [k for k, _ in _LABEL_FIELDS]
        keys += sorted({k for s in peers for k in s} - set(keys))
        differ = [k for k in keys if len({repr(s.get(k)) for s in peers}) > 1]
        out.append(" ".join([base, *(f"{k}={settings.get(k)}" for k in differ)]))
    return out


def _context(rec) -> str | None:
    """The prompt of a logged sample: the first argument of its first request (lm-eval
    0.4: ``arguments = {"gen_args_0": {"arg_0": context, ...}}``; older: ``[[context, ...]]``)."""
    args = rec.get("arguments")
    if isinstance(args, dict) and args:
        first = args[sorted(args)[0]]
        if isinstance(first, dict):
            return first.get("arg_0")
    if isinstance(args, list) and args and isinstance(args[0], (list, tuple)) and args[0]:
        return args[0][0]
    return None


def _is_generation(rec) -> bool:
    """Whether a logged sample is a generation request (its request carries generation
    keyword arguments), as opposed to a (rolling) log-likelihood one. A sample that logs no
    request arguments counts as a generation when its response is text."""
    args = rec.get("arguments")
    if args is None:
        return True
    if isinstance(args, dict) and args:
        first = args[sorted(args)[0]]
        return isinstance(first, dict) and isinstance(first.get("arg_1"), dict)
    if isinstance(args, list) and args and isinstance(args[0], (list, tuple)):
        return len(args[0]) > 1 and isinstance(args[0][1], dict)
    return False


#: a perplexity metric's per-sample (log-likelihood, count) pair is reported under this name
PAIR_METRICS = {"word_perplexity": "nll_per_word", "byte_perplexity": "nll_per_byte",
                "bits_per_byte": "bits_per_byte"}


def load_samples(paths, tokenizer=None, length: str = "response"):
    """Per-sample rows from lm-eval ``--log_samples`` output directories.

    Args:
        paths: output directories (searched recursively for ``samples_*.jsonl``).
        tokenizer: None (length in whitespace words) or an object with ``encode``.
        length: ``"response"`` (the generated text; samples without one are skipped) or
            ``"context"`` (the prompt of the sample's first request: every task type).

    Returns:
        pandas DataFrame with columns ``run, task, doc_id, gen_len, metric, value``
        (``run``: ``"<policy> L=<window>"`` from the results JSON written with each samples
        file, or the directory's name for other models; where runs of one policy and window
        differ in model, seed, dtype, dt limit, softmax dtype or drafts, the label adds the
        settings that differ, e.g. ``"fp32 L=16 model=tiny-gdn"``)
        (``gen_len``: the length measured, response or context; ``doc_hash``: lm-eval's hash
        of the document, which pairs a sample across runs). A perplexity metric's per-sample
        ``(log-likelihood, words or bytes)`` pair becomes the sample's negative log-likelihood
        per word or byte in nats, renamed (:data:`PAIR_METRICS`: ``word_perplexity`` ->
        ``nll_per_word``, ``byte_perplexity`` -> ``nll_per_byte``; ``bits_per_byte`` stays, in
        bits); lower is better. With ``length="response"`` only generation samples count.

    Raises:
        FileNotFoundError: a path does not exist or holds no samples files.
        NotADirectoryError: a path is a file.
        ValueError: ``length`` is neither ``"response"`` nor ``"context"``; a directory is
            given twice, or inside another given one; one run (label) scores a document of a
            task in two files of one folder (a rerun written into the same --output_path, or
            runs differing only in settings the label does not name). Such runs in different
            folders get the folder in their labels instead (:func:`_separate`).
    """
    import pandas as pd

    if length not in ("response", "context"):
        raise ValueError(f"length must be 'response' or 'context', got {length!r}")
    # once each: a directory given twice or inside another would count its samples twice
    check_distinct_dirs(paths, "lm-eval output directory", "lm-eval output directories",
                        nested=True)
    files, idents = [], []
    read = functools.lru_cache(maxsize=None)(_lm_eval_results)  # each results file once
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no such lm-eval output directory: {p}")
        if not p.is_dir():
            raise NotADirectoryError(f"{p} is not a directory: give the lm-eval --output_path "
                                     "directory of a --log_samples run, not a file in it")
        found = sorted(p.rglob("samples_*.jsonl"))
        if not found:
            raise FileNotFoundError(f"{p} holds no samples_*.jsonl files (run lm-eval with --log_samples)")
        files += found
        idents += [_identity(_results_for(f, read), p.name, _task_of(f)) for f in found]
    per_file = []
    for f, label in zip(files, _labels(idents), strict=True):
        task = _task_of(f)
        rows = []
        for i, line in enumerate(f.read_text().splitlines(), 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}, line {i}: not a JSON record ({e}); expected lm-eval's "
                                 "--log_samples output, one JSON object per line") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{f}, line {i}: a JSON {type(rec).__name__}, not an "
                                 "object; expected lm-eval's --log_samples records")
            if length == "context":
                text = _context(rec)
            elif not _is_generation(rec):  # log-likelihood requests generate nothing
                continue
            else:
                resp = rec.get("resps") or [[""]]
                text = resp[0][0] if isinstance(resp[0], list) else resp[0]
            if not isinstance(text, str):  # loglikelihood tasks: no generation
                continue
            n = len(tokenizer.encode(text)) if tokenizer is not None else len(text.split())
            for m in rec.get("metrics", []):
                v = rec.get(m)
                if (isinstance(v, (list, tuple)) and len(v) == 2
                        and all(isinstance(x, (int, float)) for x in v) and v[1]):
                    v = -float(v[0]) / float(v[1])  # perplexity pair (loglik, count)
                    if m == "bits_per_byte":
                        v /= math.log(2)
                    m = PAIR_METRICS.get(m, m)
                if isinstance(v, (int, float, bool)):
                    rows.append(dict(run=label, task=task, doc_id=rec.get("doc_id"),
                                     doc_hash=rec.get("doc_hash", rec.get("doc_id")),
                                     gen_len=n, metric=m, value=float(v),
                                     _hashed="doc_hash" in rec))
        per_file.append((f, rows))
    rows = [r for _, rs in _separate(per_file) for r in rs]
    for r in rows:
        del r["_hashed"]
    return pd.DataFrame(rows, columns=["run", "task", "doc_id", "doc_hash", "gen_len", "metric",
                                       "value"])


def _separate(per_file: list) -> list:
    """Files whose runs share a label but score the same document (task, lm-eval doc_hash,
    metric) are different runs: in one folder that is refused (a rerun written into the same
    ``--output_path``, or runs whose settings differ only where the label does not look:
    ``num_fewshot``, ``limit``, ``gen_kwargs``, ...); in different folders every run of such a
    label adds its folder (``"fp32 L=16 [runs/a/tiny-gdn]"``). Runs of one label that score
    other documents (e.g. one policy at several context lengths) pool. Records without a
    ``doc_hash`` (an older lm-eval: doc_ids repeat across runs) are never compared."""
    first: dict = {}
    split: set = set()
    for f, rows in per_file:
        for r in rows:
            if not r["_hashed"]:
                continue
            key = (r["run"], r["task"], str(r["doc_hash"]), r["metric"])
            seen = first.setdefault(key, f)
            if seen == f:
                continue
            if seen.parent == f.parent:
                raise ValueError(
                    f"run {r['run']!r} scores document {r['doc_hash']} of task {r['task']!r} in "
                    f"two files of one folder, {str(seen)!r} and {str(f)!r}: a rerun written "
                    "into the same --output_path, or two runs whose settings differ only where "
                    "the label does not look (num_fewshot, limit, gen_kwargs, ...); give each "
                    "run its own --output_path")
            split.add(r["run"])
    for f, rows in per_file:
        for r in rows:
            if r["run"] in split:
                r["run"] = f"{r['run']} [{f.parent}]"
    return per_file


def check_bins(bins) -> list[int]:
    """``bins`` as a list of int edges, checked: at least two, non-negative (lengths are
    token or word counts) and strictly increasing.

    Raises:
        ValueError: naming the edges and what is expected.
    """
    bins = [int(b) for b in bins]
    if len(bins) < 2 or bins[0] < 0 or any(b >= c for b, c in zip(bins, bins[1:])):
        raise ValueError(f"bins must be at least two increasing non-negative edges (lengths "
                         f"are counts >= 0), got {bins}")
    return bins


def outside_bins(df, bins) -> tuple[int, int, int | None, int | None]:
    """Samples of ``df`` (:func:`load_samples` rows) whose length falls outside
    ``[bins[0], bins[-1])``, so that :func:`bin_by_length` leaves them out: ``(outside,
    samples, shortest, longest)``, counting a sample (run, task, document, length) once
    whatever its number of metrics; ``shortest``/``longest`` are the outside lengths (None
    when none is outside)."""
    key = [c for c in ("run", "task", "doc_id", "doc_hash", "gen_len") if c in df.columns]
    s = df.drop_duplicates(key)
    out = s[(s["gen_len"] < bins[0]) | (s["gen_len"] >= bins[-1])]["gen_len"]
    if out.empty:
        return 0, len(s), None, None
    return len(out), len(s), int(out.min()), int(out.max())


def bin_by_length(df, bins, baseline: str | None = None):
    """Mean and standard error of each metric per (run, task, metric, length bin).

    ``bins`` are increasing non-negative edges; lengths fall in ``[edge_i, edge_{i+1})``, and
    lengths outside ``[bins[0], bins[-1])`` are left out (:func:`outside_bins` counts them). With
    ``baseline`` (a run label, e.g. ``"fp32 L=16"``) also the paired difference of every run
    from it: ``n_paired`` samples scored by both (same task, document hash and metric),
    ``delta_mean`` and ``delta_sem`` of (value - baseline value). Paired differences remove the
    item-to-item spread, which is far larger than a state policy's effect.

    Raises:
        ValueError: fewer than two edges, a negative edge, edges not increasing, or
            ``baseline`` not a run.
    """
    import pandas as pd

    bins = check_bins(bins)
    df = df.copy()
    df["bin"] = pd.cut(df["gen_len"], bins=bins, right=False)
    g = df.groupby(["run", "task", "metric", "bin"], observed=True)["value"]
    out = g.agg(n="count", mean="mean", std="std").reset_index()
    out["sem"] = out["std"] / np.sqrt(out["n"])
    if baseline is not None:
        if baseline not in set(df["run"]):
            raise ValueError(f"baseline {baseline!r} is not one of the runs "
                             f"{sorted(set(df['run']))}")
        key = ["task", "doc_hash", "metric"]
        base = df[df["run"] == baseline][key + ["value"]].drop_duplicates(key)
        m = df.merge(base, on=key, suffixes=("", "_base"))
        m["delta"] = m["value"] - m["value_base"]
        d = m.groupby(["run", "task", "metric", "bin"], observed=True)["delta"].agg(
            n_paired="count", delta_mean="mean", delta_std="std").reset_index()
        d["delta_sem"] = d["delta_std"] / np.sqrt(d["n_paired"])
        out = out.merge(d.drop(columns="delta_std"), on=["run", "task", "metric", "bin"],
                        how="left")
    out["bin"] = out["bin"].astype(str)
    return out.drop(columns="std")


#: default ``--bins`` edges (lengths in tokens, or words without a tokenizer)
DEFAULT_BINS = [0, 64, 256, 1024, 4096, 16384, 1 << 20]


def _edge(text: str) -> int:
    """``--bins`` edge parser: an int, or an error that says where the run directories go
    (``--bins`` takes every word after it, so ``--bins 5 3 RUN`` reads RUN as an edge)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid length edge {text!r}: expected an integer (give the run directories "
            "before --bins, or end its list with --)") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="replayssm-bin-by-length", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="lm-eval --output_path directories (with --log_samples)")
    ap.add_argument("--tokenizer", help="HF tokenizer (id or local dir) to count tokens; default: words")
    ap.add_argument("--bins", nargs="+", type=_edge, metavar="EDGE", default=DEFAULT_BINS,
                    help="increasing non-negative length edges: bins [e0, e1), [e1, e2), ...; "
                    "lengths outside [first, last) are left out, with a warning that counts "
                    f"them (default: {' '.join(map(str, DEFAULT_BINS))})")
    ap.add_argument("--length", choices=("response", "context"), default="response",
                    help="what to bin by: the generated response (default) or the prompt")
    ap.add_argument("--baseline", help="run label (e.g. 'fp32 L=16') to pair every sample with: "
                    "adds the mean and standard error of the paired differences")
    ap.add_argument("-o", "--output", help="CSV path for the binned table")
    a = ap.parse_args(argv)
    problem = output_file_problem(a.output) if a.output else None
    if problem:
        print(f"replayssm-bin-by-length: error: {problem}", file=sys.stderr)
        return 2
    try:
        check_bins(a.bins)  # before any tokenizer loads or sample is read
    except ValueError as e:
        print(f"replayssm-bin-by-length: error: --bins: {e}", file=sys.stderr)
        return 2
    tok = None
    if a.tokenizer:
        from transformers import AutoTokenizer

        from replayssm_quant.models import resolve_model_path

        try:
            tok = AutoTokenizer.from_pretrained(str(resolve_model_path(a.tokenizer)))
        except Exception as e:  # noqa: BLE001 -- OSError, ValueError, hub errors
            print(f"replayssm-bin-by-length: error: cannot load tokenizer {a.tokenizer!r} "
                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})",
                  file=sys.stderr)
            return 2
    try:
        samples = load_samples(a.runs, tok, a.length)
        table = bin_by_length(samples, a.bins, a.baseline)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"replayssm-bin-by-length: error: {e}", file=sys.stderr)
        return 2
    n_out, n_all, shortest, longest = outside_bins(samples, a.bins)
    if n_out:
        unit = "tokens" if tok is not None else "words"
        span = f"{shortest}" if shortest == longest else f"{shortest}..{longest}"
        print(f"replayssm-bin-by-length: warning: {n_out} of {n_all} sample(s) fall outside the "
              f"bins [{a.bins[0]}, {a.bins[-1]}) (length {span} {unit}) and are left out of "
              "the table; widen --bins to count them", file=sys.stderr)
    if samples.empty and a.length == "response":
        print("replayssm-bin-by-length: warning: these runs hold no generation samples: "
              "--length response bins generated text; for log-likelihood, multiple-choice "
              "and perplexity tasks bin by the prompt with --length context", file=sys.stderr)
    elif table.empty:
        print(f"replayssm-bin-by-length: warning: no sample falls in the bins "
              f"[{a.bins[0]}, {a.bins[-1]})", file=sys.stderr)
    print(table.to_string(index=False))
    if a.output:
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)  # as replayssm-report does
        table.to_csv(a.output, index=False)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
