"""Load and validate output directories of the teacher-forced KL runner (``replayssm-kl``).

A run directory (issue 4) holds:

* ``positions.parquet``: one row per (document, position, policy, window, seed) with columns
  :data:`POSITION_COLUMNS` -- ``kl`` is KL(P_fp32 || P_policy) in nats, ``top1_agree`` whether
  the arg-max tokens agree, ``dp_ref`` the change of the reference token's probability,
  ``nll_ref`` / ``nll`` the reference and policy negative log-likelihoods (nats), ``nonfinite``
  whether the logits of either side were not finite (runs since 2026-12-01 also say which:
  ``nonfinite_ref``, ``nonfinite_policy``);
* ``summary.csv``: the runner's own per (policy, window, position bucket) summary;
* ``stepwise.parquet`` (optional, ``--stepwise-check``): per checked position and cell,
  ``kl_path`` = KL(stepping || emulation), the float32 path noise of teacher-forced emulation,
  next to the policy's KL on the same positions (:data:`STEPWISE_COLUMNS`, :func:`path_noise`);
* ``manifest.json``: command, versions, model and data identity, git commit, timings;
* ``buckets.parquet`` (since 2026-12-01): sums per document, cell and quarter octave, read in
  place of ``positions.parquet`` when that was not kept (:func:`positions_from_buckets`);
* ``state_error.parquet`` (optional, ``--state-error``): per-layer, per-head state error and
  decay (:data:`STATE_ERROR_COLUMNS`).

:func:`load_runs` reads several directories into one frame (a ``run`` column tells them apart)
and :func:`kl_by_position` aggregates KL per position bucket with confidence intervals over
documents, which is what the plots and the report consume. :func:`write_synthetic_run` writes a
clearly labelled *synthetic* directory with the same schema (for tests and notebook fallbacks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
from scipy import stats

from replayssm_quant.policy import StatePolicy
from replayssm_quant.policymap import MAP_PREFIX, PolicyMap

__all__ = [
    "POSITION_COLUMNS",
    "Runs",
    "load_run",
    "load_runs",
    "validate_positions",
    "require_columns",
    "policy_parts",
    "add_policy_columns",
    "position_buckets",
    "kl_by_position",
    "summarize",
    "path_noise",
    "STEPWISE_COLUMNS",
    "shared_separate_ratio",
    "rtn_sr_ratio",
    "positions_from_buckets",
    "uses_sr",
    "synthetic_positions",
    "write_synthetic_run",
]

POSITION_COLUMNS = (
    "doc", "position", "policy", "window", "seed",
    "kl", "top1_agree", "dp_ref", "nll_ref", "nll", "nonfinite",
)  # fmt: skip
#: optional columns (runs since 2026-12-01): which side was not finite
NONFINITE_SIDES = ("nonfinite_ref", "nonfinite_policy")
STEPWISE_COLUMNS = (
    "doc", "position", "policy", "window", "seed",
    "kl_path", "kl_path_ref", "kl", "kl_step", "top1_path_agree", "nonfinite",
)  # fmt: skip
_NUMERIC = ("position", "window", "seed", "kl", "dp_ref", "nll_ref", "nll")
#: nats: runs before 2026-12-01 computed KL in FP32, which rounds slightly below 0; the current
#: runner's KL is >= 0 by construction (docs/kl-runner.md)
KL_NEGATIVE_TOL = -1e-4
#: nats: a mean KL below this is float32 arithmetic noise of the two forward paths (the
#: stepwise check and the fp32 policy at L > 1 measure ~1e-12), not an effect of the policy.
#: Ratios with such a mean (``path_to_effect``, ``mean_rel_diff``, the shared/separate ratio)
#: are NaN: e.g. with ``--prefill 0`` no flush falls inside the first K positions of a window
#: longer than K, so the policy's KL there is ~1e-13 and any ratio to it is noise over noise.
KL_NOISE_FLOOR = 1e-9


def path_ratios(path_kl: float, kl: float, kl_step: float) -> tuple[float, float]:
    """``(path_to_effect, mean_rel_diff)`` of a stepwise-checked cell: ``path_kl / kl`` and
    ``kl / kl_step - 1`` (means in nats), each NaN where a mean it divides by, or compares, is
    below :data:`KL_NOISE_FLOOR` (or NaN). The runner's manifest and :func:`path_noise` both
    use it."""
    to_effect = path_kl / kl if kl >= KL_NOISE_FLOOR else math.nan
    rel = kl / kl_step - 1 if min(kl, kl_step) >= KL_NOISE_FLOOR else math.nan
    return to_effect, rel


def _ratio_above_floor(num: pd.Series, den: pd.Series) -> pd.Series:
    """``num / den``, NaN where either mean is below :data:`KL_NOISE_FLOOR`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (num / den).where((num >= KL_NOISE_FLOOR) & (den >= KL_NOISE_FLOOR))


def require_columns(df: pd.DataFrame, columns: Iterable[str], who: str) -> None:
    """Raise ValueError naming every column of ``columns`` missing from ``df``.

    Args: df: a frame; columns: the required names; who: the caller, quoted in the message.
    """
    if not isinstance(df, pd.DataFrame):
        hint = (" (load_runs returns a Runs: pass its .positions, or .stepwise / .state_error)"
                if isinstance(df, Runs) else "")
        raise ValueError(f"{who}: expected a pandas DataFrame, got {type(df).__name__}{hint}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(
            f"{who}: missing required column(s) {', '.join(missing)}; "
            f"got columns {', '.join(map(str, df.columns))}"
        )


def validate_positions(df: pd.DataFrame, source: str = "positions") -> pd.DataFrame:
    """Check a positions frame against the issue-4 schema and normalise dtypes.

    Checks: all :data:`POSITION_COLUMNS` present; numeric columns numeric; ``position >= 0``;
    ``window >= 1``; ``kl >= -1e-4`` nats on finite rows (FP32 round-off); policies parse
    (:class:`replayssm_quant.policy.StatePolicy`); no duplicate (run, doc, position, policy,
    window, seed) rows. Non-finite rows (``nonfinite`` true) may hold NaN/inf metrics.

    Returns:
        A copy with ``top1_agree`` / ``nonfinite`` as bool and ``position`` / ``window`` /
        ``seed`` as int64.
    Raises:
        ValueError: naming ``source`` and what is wrong.
    """
    require_columns(df, POSITION_COLUMNS, source)
    out = df.copy()
    for c in _NUMERIC:
        if not pd.api.types.is_numeric_dtype(out[c]):
            try:
                out[c] = pd.to_numeric(out[c])
            except (ValueError, TypeError) as e:
                raise ValueError(f"{source}: column {c!r} is not numeric ({e})") from None
    for c in ("position", "window", "seed"):
        if out[c].isna().any():
            raise ValueError(f"{source}: column {c!r} has missing values")
        out[c] = out[c].astype("int64")
    out["nonfinite"] = out["nonfinite"].astype(bool)
    for c in NONFINITE_SIDES:
        if c in out:
            out[c] = out[c].astype(bool)
            if (out[c] & ~out["nonfinite"]).any():
                raise ValueError(f"{source}: rows with {c} set but nonfinite not set")
    if "weight" in out.columns:  # rows of buckets.parquet: agreement rates, not flags
        out["top1_agree"] = out["top1_agree"].fillna(0.0).astype(float)
    else:
        out["top1_agree"] = out["top1_agree"].fillna(False).astype(bool)
    out["policy"] = out["policy"].astype(str)
    if (out["position"] < 0).any():
        raise ValueError(f"{source}: negative positions")
    if (out["window"] < 1).any():
        raise ValueError(f"{source}: window must be >= 1")
    fin = ~out["nonfinite"]
    kl = out.loc[fin, "kl"]
    if (~np.isfinite(kl)).any():
        raise ValueError(f"{source}: non-finite kl on rows not flagged nonfinite")
    if (kl < KL_NEGATIVE_TOL).any():
        raise ValueError(f"{source}: kl below {KL_NEGATIVE_TOL} nats (min {kl.min():.3g})")
    for p in out["policy"].unique():
        try:
            _parse_label(p)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None
    key = [c for c in ("run", "doc", "position", "policy", "window", "seed") if c in out]
    if out.duplicated(key).any():
        raise ValueError(f"{source}: duplicate rows for {key}")
    return out


@dataclass
class Runs:
    """Several loaded run directories.

    Attributes:
        positions: validated positions of all runs, with a ``run`` column (directory name).
        summaries: the runners' ``summary.csv`` files (``run`` column added; may be empty).
        stepwise: the ``stepwise.parquet`` tables (``run`` column added; empty when no run has
            one).
        manifests: ``{run: manifest dict}`` (empty dict where a run has no manifest).
        paths: ``{run: Path}``.
        state_error, bucket_only: see the fields.

    A run kept without ``positions.parquet`` (too large to move: one row per position) is
    read from its ``buckets.parquet`` (:func:`positions_from_buckets`): ``positions`` then
    holds one weighted row per (document, cell, quarter octave), which every mean, interval,
    agreement and incidence here weighs exactly; only per-position percentiles are lost.
    """

    positions: pd.DataFrame
    summaries: pd.DataFrame
    manifests: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)
    stepwise: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: ``state_error.parquet`` tables (``replayssm-kl --state-error``; ``run`` column added)
    state_error: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: runs read from ``buckets.parquet`` (no per-position rows: no percentiles)
    bucket_only: tuple = ()


def load_run(path) -> Runs:
    """Load one run directory; see :func:`load_runs`."""
    return load_runs([path])


def load_runs(paths: Sequence, prefer_buckets: bool = False) -> Runs:
    """Load one or several ``replayssm-kl`` output directories as one :class:`Runs`: the
    validated positions of every run in one frame (``runs.positions``, with a ``run``
    column), beside their summaries, stepwise tables, state errors and manifests. The
    table functions take the frame: ``kl_by_position(load_runs(dirs).positions)``.

    Args:
        paths: directories holding ``positions.parquet`` or ``buckets.parquet`` (one of them
            required), ``summary.csv``, ``stepwise.parquet``, ``state_error.parquet`` and
            ``manifest.json`` (optional). Run names are the directory names, made unique.
        prefer_buckets: read ``buckets.parquet`` even where ``positions.parquet`` exists (the
            fast path for long runs: a few rows per document, cell and quarter octave instead
            of one per position; base-2 bucket means, intervals and non-finite counts are
            exactly those of the positions; no per-position percentiles).

    Returns:
        :class:`Runs`.
    Raises:
        FileNotFoundError: a directory, or both its ``positions.parquet`` and
            ``buckets.parquet``, are missing (the message says so when the directory holds an
            unfinished run: ``parts/`` or ``run_identity.json`` without the tables).
        ValueError: no paths, an unreadable file, or a schema violation (see
            :func:`validate_positions`), naming the file.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("load_runs: no run directories given")
    frames, sums, steps, manifests, where, errs, bucket_only = [], [], [], {}, {}, [], []
    for p in paths:
        if not p.is_dir():
            raise FileNotFoundError(f"run directory not found: {p}")
        pq = p / "positions.parquet"
        bq = p / "buckets.parquet"
        if not pq.is_file() and not bq.is_file():
            parts = sorted((p / "parts").glob("*.parquet")) if (p / "parts").is_dir() else []
            if parts or (p / "run_identity.json").is_file():
                raise FileNotFoundError(
                    f"{p}: an unfinished replayssm-kl run ({len(parts)} finished cell file(s) in "
                    f"{p / 'parts'}, no positions.parquet yet); run the same replayssm-kl "
                    "command again to finish it, then report")
            raise FileNotFoundError(f"{p}: no positions.parquet or buckets.parquet (is this a "
                                    "replayssm-kl output?)")
        name, k = p.resolve().name, 2
        while name in where:
            name, k = f"{p.resolve().name}-{k}", k + 1
        where[name] = p
        src = bq if (bq.is_file() and (prefer_buckets or not pq.is_file())) else pq
        try:
            df = pd.read_parquet(src)
        except Exception as e:  # pyarrow raises several types
            raise ValueError(f"{src}: cannot read parquet ({e})") from None
        if src is bq:
            df = positions_from_buckets(df, str(bq))
            bucket_only.append(name)
        df = validate_positions(df, str(src))
        df.insert(0, "run", name)
        frames.append(df)
        for fname, columns, into in (("stepwise.parquet", STEPWISE_COLUMNS, steps),
                                     ("state_error.parquet", STATE_ERROR_COLUMNS, errs)):
            f = p / fname  # optional tables: validated, labelled with the run
            if f.is_file():
                try:
                    t = pd.read_parquet(f)
                except Exception as e:  # pyarrow raises several types
                    raise ValueError(f"{f}: cannot read parquet ({e})") from None
                require_columns(t, columns, str(f))
                t.insert(0, "run", name)
                into.append(t)
        sc = p / "summary.csv"
        if sc.is_file():
            try:
                s = pd.read_csv(sc)
            except Exception as e:
                raise ValueError(f"{sc}: cannot read csv ({e})") from None
            s.insert(0, "run", name)
            sums.append(s)
        mf = p / "manifest.json"
        if mf.is_file():
            try:
                manifests[name] = json.loads(mf.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{mf}: invalid JSON ({e})") from None
        else:
            manifests[name] = {}
    positions = pd.concat(frames, ignore_index=True)
    summaries = pd.concat(sums, ignore_index=True) if sums else pd.DataFrame()
    stepwise = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    state_error = pd.concat(errs, ignore_index=True) if errs else pd.DataFrame()
    return Runs(positions, summaries, manifests, where, stepwise, state_error, tuple(bucket_only))


#: ``buckets.parquet`` (replayssm-kl since 2026-12-01): sums per document, cell and quarter
#: octave of N (``replayssm_quant.evals.kl.metrics.bucket_sums``)
BUCKET_COLUMNS = ("doc", "policy", "window", "seed", "qbucket", "pos_min", "pos_max", "n",
                  "kl_n", "kl_sum", "kl_max", "top1_sum", "nonfinite")

#: ``state_error.parquet`` (``replayssm-kl --state-error``)
STATE_ERROR_COLUMNS = ("doc", "position", "policy", "window", "seed", "layer", "head",
                       "err_read", "err_anchor", "state_norm", "decay", "log_decay", "beta")


def positions_from_buckets(b: pd.DataFrame, source: str = "buckets") -> pd.DataFrame:
    """A positions-schema frame from a ``buckets.parquet`` table: per (document, cell, quarter
    octave) one row of the finite positions (``kl`` = their mean, ``top1_agree`` = their
    agreement rate, ``weight`` = their count, ``position`` = the bucket's last position) and,
    where some positions were non-finite, one row of those (``nonfinite`` set, ``weight`` =
    their count, ``position`` = the bucket's first). ``kl_max_bucket`` keeps each bucket's
    maximum. Weighted means over these rows equal the means over the positions exactly
    (up to float64 summation order) for octave buckets (base 2).

    Returns:
        Frame with :data:`POSITION_COLUMNS`, ``nonfinite_ref`` / ``nonfinite_policy``,
        ``weight`` (positions the row stands for) and ``kl_max_bucket``.
    Raises:
        ValueError: missing columns, no rows, counts outside ``0 <= kl_n <= n``, ``n < 1``,
            or duplicate (doc, policy, window, seed, qbucket) rows (naming ``source``).
    """
    require_columns(b, BUCKET_COLUMNS, source)
    if b.empty:
        raise ValueError(f"{source}: no rows")
    n, kn = pd.to_numeric(b["n"], errors="coerce"), pd.to_numeric(b["kl_n"], errors="coerce")
    if n.isna().any() or kn.isna().any() or (n < 1).any() or (kn < 0).any() or (kn > n).any():
        raise ValueError(f"{source}: bucket counts must satisfy 0 <= kl_n <= n and n >= 1")
    key = ["doc", "policy", "window", "seed", "qbucket"]
    if b.duplicated(key).any():
        raise ValueError(f"{source}: duplicate rows for {key}")
    b = b.copy()
    fin_n = b["kl_n"].astype("int64")
    nf_n = b["n"].astype("int64") - fin_n
    side = {c: b[c] if c in b else 0 for c in NONFINITE_SIDES}
    fin = b[fin_n > 0]
    rows_f = pd.DataFrame({
        "doc": fin["doc"], "position": fin["pos_max"], "policy": fin["policy"],
        "window": fin["window"], "seed": fin["seed"],
        "kl": fin["kl_sum"] / fin["kl_n"], "top1_agree": fin["top1_sum"] / fin["kl_n"],
        "dp_ref": np.nan, "nll_ref": np.nan, "nll": np.nan, "nonfinite": False,
        **{c: False for c in NONFINITE_SIDES},
        "weight": fin["kl_n"].astype(float), "kl_max_bucket": fin["kl_max"]})
    bad = b[nf_n > 0]
    rows_n = pd.DataFrame({
        "doc": bad["doc"], "position": bad["pos_min"], "policy": bad["policy"],
        "window": bad["window"], "seed": bad["seed"], "kl": np.nan, "top1_agree": 0.0,
        "dp_ref": np.nan, "nll_ref": np.nan, "nll": np.nan, "nonfinite": True,
        **{c: (side[c][nf_n > 0] > 0) if isinstance(side[c], pd.Series) else False
           for c in NONFINITE_SIDES},
        "weight": nf_n[nf_n > 0].astype(float), "kl_max_bucket": np.nan})
    out = pd.concat([rows_f, rows_n], ignore_index=True)
    return out


def uses_sr(policy: str) -> bool:
    """Whether ``policy`` draws random bits (a rounded copy with ``+sr``); for a policy map
    (``map:...``), whether any of its policies does."""
    p = _parse_label(policy)
    if isinstance(p, PolicyMap):
        return any(q.uses_sr for q in p.policies())
    return p.uses_sr


def _weights(d: pd.DataFrame) -> pd.Series:
    return d["weight"].astype(float) if "weight" in d.columns else pd.Series(1.0, index=d.index)


def _units(d: pd.DataFrame, by: list, unit: str) -> tuple:
    """The rows to use and the columns of the independent unit of a confidence interval:
    ``"doc"`` (documents) or ``"sequence"`` ((document, seed) pairs). A policy without SR gives
    the same bits for every seed (the runner computes such cells once and labels copies), so
    only its first seed's rows count, whatever the unit: copies are not data."""
    if unit not in ("doc", "sequence"):
        raise ValueError(f"unit must be 'doc' or 'sequence', got {unit!r}")
    if "seed" not in d.columns or "seed" in by:
        return d, ["doc"]
    sr = d["policy"].map({p: uses_sr(p) for p in d["policy"].unique()}).astype(bool)
    first = d.groupby([c for c in by if c != "seed"] + ["doc"])["seed"].transform("min")
    d = d[sr | (d["seed"] == first)]
    return d, (["doc", "seed"] if unit == "sequence" else ["doc"])


def _parse_label(policy: str):
    """A run's policy column value: a policy string or a policy map's canonical ``map:...``
    text (what ``replayssm-kl`` writes for maps); never a file path."""
    if policy.strip().lower().startswith(MAP_PREFIX):
        return PolicyMap.parse_compact(policy)
    return StatePolicy.parse(policy)


def policy_parts(policy: str) -> tuple[str, str, str]:
    """``(kind, read, rec)`` of a policy string, e.g. ``read:nvfp4/rec:fp32`` ->
    ``('separate', 'nvfp4', 'fp32')``; ``shared:fp8e4m3+sr`` -> ``('shared', 'fp8e4m3+sr',
    'fp8e4m3+sr')``; a policy map (``map:...``, issue 18) -> ``('map', '', '')``. Raises
    ValueError for a bad policy (DESIGN.md section 3 grammar) or map."""
    p = _parse_label(policy)
    if isinstance(p, PolicyMap):
        return "map", "", ""
    return p.kind, str(p.read), str(p.rec)


def add_policy_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Copy of ``df`` with ``kind``, ``read``, ``rec`` columns parsed from ``policy``."""
    require_columns(df, ["policy"], "add_policy_columns")
    parts = {p: policy_parts(p) for p in df["policy"].unique()}
    out = df.copy()
    out["kind"] = out["policy"].map(lambda p: parts[p][0])
    out["read"] = out["policy"].map(lambda p: parts[p][1])
    out["rec"] = out["policy"].map(lambda p: parts[p][2])
    return out


def position_buckets(positions, base: float = 2.0) -> np.ndarray:
    """Log-spaced bucket index of token positions: bucket ``b`` holds ``[base^b, base^(b+1))``
    with position 0 in bucket 0 (positions are 0-based; ``N = position + 1`` tokens seen)."""
    n = np.asarray(positions, dtype=np.float64) + 1.0
    return np.floor(np.log(n) / math.log(base) + 1e-12).astype(np.int64)


def _ci(values: np.ndarray, level: float) -> tuple[float, float, float]:
    v = values[np.isfinite(values)]
    if v.size == 0:
        return math.nan, math.nan, math.nan
    m = float(v.mean())
    if v.size < 2:
        return m, math.nan, math.nan
    half = stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size)
    return m, m - half, m + half


def kl_by_position(
    df: pd.DataFrame,
    metric: str = "kl",
    by: Sequence[str] = ("policy", "window"),
    base: float = 2.0,
    level: float = 0.95,
    unit: str = "doc",
) -> pd.DataFrame:
    """Mean of ``metric`` per log-spaced position bucket with a confidence interval.

    The interval is a Student-t interval over *documents* (per-document bucket means are the
    independent units; positions within a document are correlated), so it needs >= 2 documents
    (NaN bounds otherwise); ``unit="sequence"`` makes (document, SR seed) pairs the units
    (a policy without SR counts once per document). Non-finite rows (``nonfinite``) are
    excluded from the mean and counted in ``nonfinite``. A ``weight`` column (rows read from
    ``buckets.parquet``) weighs each row as that many positions.

    Args:
        df: positions frame (needs ``doc, position, nonfinite``, ``metric`` and ``by``).
        metric: ``kl`` (nats), ``top1_agree``, ``dp_ref``, ... ; by: grouping columns.
        base: bucket base (2: octaves; rows read from ``buckets.parquet`` need 2, since their
            quarter-octave sums do not split at other boundaries). level: CI coverage.
        unit: ``"doc"`` (default) or ``"sequence"``: the independent unit of the interval;
            ``docs`` in the result counts these units. Without a ``seed`` column (or with
            ``seed`` in ``by``) the unit is the document. With 2 units the t interval is
            wide and its lower bound can be negative.

    Returns:
        Frame with ``by`` columns plus ``bucket, n_lo, n_hi, n_mid`` (tokens seen, ``N``),
        ``partial`` (the run ends inside the bucket: fewer positions than the octave holds),
        ``mean, ci_lo, ci_hi, docs, count, nonfinite``.
    Raises:
        ValueError: missing columns, a bad ``unit``, or ``base != 2`` on weighted rows.
    """
    by = list(by)
    require_columns(df, ["doc", "position", "nonfinite", metric, *by], "kl_by_position")
    if "weight" in df.columns and base != 2.0:
        raise ValueError(f"kl_by_position: rows read from buckets.parquet hold quarter-octave "
                         f"sums; they give exact buckets for base 2 only, got base={base}")
    extra = [c for c in ("seed", "weight") if c in df.columns and c not in by]
    d = df[list(dict.fromkeys(["doc", "position", "nonfinite", metric, *by, *extra]))].copy()
    d, ucols = _units(d, by, unit)
    ucols = [c for c in ucols if c not in by]  # by = (..., "doc"): each document on its own
    d = d.copy()
    d["bucket"] = position_buckets(d["position"], base)
    d[metric] = d[metric].astype(float)
    d["nonfinite"] = d["nonfinite"].astype(bool)
    d["_w"] = _weights(d)
    d["_nf"] = d["_w"].where(d["nonfinite"], 0.0)
    keys = by + ["bucket"]
    g_all = d.groupby(keys, sort=True, dropna=False)
    out = g_all.agg(nonfinite=("_nf", "sum"), pos_max=("position", "max")).reset_index()
    fin = d[~d["nonfinite"]].copy()
    fin["_wx"] = fin["_w"] * fin[metric]
    per_doc = fin.groupby(keys + ucols, dropna=False)[["_wx", "_w"]].sum().reset_index()
    per_doc[metric] = per_doc["_wx"] / per_doc["_w"]
    per_doc = per_doc[np.isfinite(per_doc[metric])]
    agg = per_doc.groupby(keys, dropna=False)[metric].agg(["mean", "std", "count"]).reset_index()
    agg = agg.rename(columns={"count": "docs"})
    cnt = fin.groupby(keys, dropna=False)["_w"].sum().rename("count").reset_index()
    out = out.merge(agg, on=keys, how="left").merge(cnt, on=keys, how="left")
    out["docs"] = out["docs"].fillna(0).astype(int)
    out["count"] = out["count"].fillna(0).astype(int)
    dfree = np.maximum(out["docs"].to_numpy() - 1, 1)
    half = stats.t.ppf(0.5 + level / 2, dfree) * out["std"] / np.sqrt(np.maximum(out["docs"], 1))
    half = half.where(out["docs"] >= 2)
    out["ci_lo"], out["ci_hi"] = out["mean"] - half, out["mean"] + half
    b = out["bucket"].to_numpy()
    out["n_lo"] = base ** b.astype(float)
    out["n_hi"] = np.minimum(base ** (b + 1.0) - 1, out["pos_max"].to_numpy() + 1.0)
    out["n_mid"] = np.sqrt(out["n_lo"] * out["n_hi"])
    out["partial"] = out["pos_max"].to_numpy() + 1.0 < base ** (b + 1.0) - 1  # run ends inside
    out["nonfinite"] = out["nonfinite"].astype(int)
    cols = keys + ["n_lo", "n_hi", "n_mid", "partial", "mean", "ci_lo", "ci_hi", "docs", "count",
                   "nonfinite"]  # fmt: skip
    return out[cols]


def summarize(df: pd.DataFrame, by: Sequence[str] = ("policy", "window"),
              unit: str = "doc") -> pd.DataFrame:
    """Whole-run summary per ``by``: mean KL (nats) with a 95% CI over documents (or over
    (document, seed) sequences with ``unit="sequence"``, see :func:`kl_by_position`), median,
    p90, p99, p99.9, max, top-1 agreement (over all positions, a non-finite one counting as
    disagreement, as the runner's summary counts it), non-finite count and fraction (either side; with
    ``nonfinite_ref`` / ``nonfinite_policy`` columns also the count per side). Rows with a
    ``weight`` (read from ``buckets.parquet``) count as that many positions; their percentiles
    are NaN (not kept) and the maximum comes from ``kl_max_bucket``.

    Raises ValueError for missing columns or a bad ``unit``."""
    by = list(by)
    require_columns(df, ["doc", "kl", "top1_agree", "nonfinite", *by], "summarize")
    rows = []
    weighted = "weight" in df.columns
    for key, g in df.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        g, ucols = _units(g, by, unit)
        w = _weights(g)
        nf = g["nonfinite"].astype(bool)
        fin = g[~nf]
        wf = w[~nf]
        kl = fin["kl"].to_numpy(dtype=float)
        per_unit = (fin.assign(_wx=wf * fin["kl"], _w=wf).groupby(ucols)[["_wx", "_w"]].sum())
        m, lo, hi = _ci((per_unit["_wx"] / per_unit["_w"]).to_numpy(dtype=float), 0.95)
        if weighted:
            q = [math.nan] * 4
            mx = fin["kl_max_bucket"].max() if "kl_max_bucket" in fin else math.nan
        else:
            q = np.percentile(kl, [50, 90, 99, 99.9]) if kl.size else [math.nan] * 4
            mx = kl.max() if kl.size else math.nan
        n = float(w.sum())
        rows.append(
            dict(
                zip(by, key), positions=int(round(n)), kl_mean=m, kl_ci_lo=lo, kl_ci_hi=hi,
                kl_median=q[0], kl_p90=q[1], kl_p99=q[2], kl_p999=q[3],
                kl_max=float(mx),
                # non-finite positions count as disagreement, as in the runner's summary
                top1_agree=float((wf * fin["top1_agree"].astype(float)).sum()) / n
                if n else math.nan,
                nonfinite=int(round(float(w[nf].sum()))),
                nonfinite_frac=float(w[nf].sum()) / n if n else math.nan,
                **{c: int(round(float(w[g[c].astype(bool)].sum()))) for c in NONFINITE_SIDES
                   if c in g},
            )  # fmt: skip
        )
    return pd.DataFrame(rows)


def path_noise(stepwise: pd.DataFrame, by: Sequence[str] = ("policy", "window")) -> pd.DataFrame:
    """Emulation path noise per ``by`` from a ``stepwise.parquet`` table.

    ``path_kl_mean`` / ``path_kl_max``: KL(stepping || emulation) of the cell over the checked
    positions (nats); ``kl_mean``: the policy's KL on the same positions as the runner measures
    it (emulation), ``kl_step_mean``: the same with both sides stepped token by token;
    ``path_to_effect`` = ``path_kl_mean / kl_mean``; ``mean_rel_diff`` = ``kl_mean /
    kl_step_mean - 1`` (how far the emulated mean KL is from the decoded one); both NaN where
    a mean KL is below :data:`KL_NOISE_FLOOR` (no effect to compare against);
    ``path_kl_ref_mean``: the reference's own path noise. Rows with ``nonfinite`` are left out of the means and counted.

    Raises ValueError for missing columns."""
    by = list(by)
    require_columns(stepwise, [*STEPWISE_COLUMNS, *by], "path_noise")
    rows = []
    for key, g in stepwise.groupby(by, sort=True):
        key = key if isinstance(key, tuple) else (key,)
        fin = g[~g["nonfinite"].astype(bool)]

        def mean(c):
            v = fin[c].to_numpy(dtype=float)
            return float(v.mean()) if v.size else math.nan

        kl = mean("kl")
        to_effect, rel = path_ratios(mean("kl_path"), kl, mean("kl_step"))
        path = fin["kl_path"].to_numpy(dtype=float)
        rows.append(
            dict(
                zip(by, key), positions=len(g), docs=g["doc"].nunique(),
                checked=f"{int(g['position'].min())}..{int(g['position'].max())}",
                path_kl_mean=mean("kl_path"),
                path_kl_max=float(path.max()) if path.size else math.nan,
                kl_mean=kl, kl_step_mean=mean("kl_step"),
                path_to_effect=to_effect, mean_rel_diff=rel,
                path_kl_ref_mean=mean("kl_path_ref"),
                top1_path_agree=float(fin["top1_path_agree"].mean()) if len(fin) else math.nan,
                nonfinite=int(g["nonfinite"].astype(bool).sum()),
            )  # fmt: skip
        )
    return pd.DataFrame(rows)


def shared_separate_ratio(df: pd.DataFrame, base: float = 2.0) -> pd.DataFrame:
    """Ratio of mean KL, shared over separate, per position bucket.

    Each separate policy ``read:F/rec:G`` is paired with a single-checkpoint policy of the same
    read format at the same window (and run, when a ``run`` column exists): ``shared:F`` with
    the same rounding first, then ``shared:F`` with the other rounding (RTN vs ``+sr``: the
    paper's comparison is by format), then ``eager:F`` likewise. The ``shared`` column names
    the partner used.

    Returns:
        Frame with ``read, rec, shared, window, bucket, n_mid, partial, kl_shared, kl_separate,
        ratio`` (plus ``run``; ``ratio`` NaN where either mean is below
        :data:`KL_NOISE_FLOOR`); empty (same columns) when nothing pairs.
    Raises:
        ValueError: missing columns.
    """
    require_columns(df, ["policy", "window", "doc", "position", "kl", "nonfinite"], "ratio")
    extra = ["run"] if "run" in df.columns else []
    agg = add_policy_columns(
        kl_by_position(df, by=extra + ["policy", "window"], base=base)
    )
    cols = extra + ["read", "rec", "shared", "window", "bucket", "n_mid", "partial", "kl_shared",
                    "kl_separate", "ratio"]  # fmt: skip
    sep = agg[agg["kind"] == "separate"]
    shared = agg[agg["kind"].isin(["shared", "eager"])]
    if sep.empty or shared.empty:
        return pd.DataFrame(columns=cols)

    def fmt(read: pd.Series) -> pd.Series:  # the format without its rounding suffix
        return read.astype(str).str.replace("+sr", "", regex=False)

    key = extra + ["fmt", "window", "bucket"]
    sep = sep.assign(fmt=fmt(sep["read"]))
    sh = shared.assign(fmt=fmt(shared["read"]))[key + ["read", "kind", "policy", "mean"]]
    m = sep.merge(sh, on=key, suffixes=("", "_sh"))
    # preference: same rounding, then shared over eager
    m["rank"] = 2 * (m["read"] != m["read_sh"]).astype(int) + (m["kind_sh"] == "eager").astype(int)
    m = m.sort_values("rank", kind="stable").drop_duplicates(extra + ["policy", "window", "bucket"])
    m = m.rename(columns={"mean_sh": "kl_shared", "mean": "kl_separate", "policy_sh": "shared"})
    m["ratio"] = _ratio_above_floor(m["kl_shared"], m["kl_separate"])
    return m[cols].sort_values(extra + ["read", "rec", "window", "bucket"]).reset_index(drop=True)


def rtn_sr_ratio(df: pd.DataFrame, base: float = 2.0, unit: str = "doc") -> pd.DataFrame:
    """KL of round-to-nearest over stochastic rounding, per position bucket: each policy with
    ``+sr`` is paired with the same policy with every ``+sr`` removed (``shared:nvfp4+sr`` with
    ``shared:nvfp4``, ``read:nvfp4/rec:fp16+sr`` with ``read:nvfp4/rec:fp16``) at the same
    window (and run). Paper, section 5: RTN has the lower KL at short N for NVFP4 (ratio < 1)
    but grows faster with N. ``unit``: as :func:`kl_by_position` (means do not depend on it).

    Returns:
        Frame with ``sr_policy, rtn_policy, window, bucket, n_mid, partial, kl_rtn, kl_sr,
        ratio`` (plus ``run``; ``ratio`` NaN where either mean is below
        :data:`KL_NOISE_FLOOR`); empty (same columns) when nothing pairs.
    Raises:
        ValueError: missing columns.
    """
    require_columns(df, ["policy", "window", "doc", "position", "kl", "nonfinite"], "rtn_sr_ratio")
    extra = ["run"] if "run" in df.columns else []
    cols = extra + ["sr_policy", "rtn_policy", "window", "bucket", "n_mid", "partial", "kl_rtn",
                    "kl_sr", "ratio"]
    agg = kl_by_position(df, by=extra + ["policy", "window"], base=base, unit=unit)
    pols = set(agg["policy"])
    pairs = {p: p.replace("+sr", "") for p in pols if "+sr" in p and p.replace("+sr", "") in pols}
    if not pairs:
        return pd.DataFrame(columns=cols)
    key = extra + ["window", "bucket"]
    sr = agg[agg["policy"].isin(list(pairs))].assign(rtn_policy=lambda x: x["policy"].map(pairs))
    rtn = agg[agg["policy"].isin(list(pairs.values()))][key + ["policy", "mean"]]
    m = sr.merge(rtn, left_on=key + ["rtn_policy"], right_on=key + ["policy"],
                 suffixes=("", "_rtn"))
    m = m.rename(columns={"policy": "sr_policy", "mean": "kl_sr", "mean_rtn": "kl_rtn"})
    m["ratio"] = _ratio_above_floor(m["kl_rtn"], m["kl_sr"])
    return m[cols].sort_values(extra + ["sr_policy", "window", "bucket"]).reset_index(drop=True)


# ------------------------------------------------------------------------- synthetic data


def synthetic_positions(
    policies: Sequence[str] = (
        "fp32", "shared:nvfp4+sr", "read:nvfp4+sr/rec:fp32", "shared:fp8e4m3", "read:fp8e4m3/rec:fp32",
    ),
    windows: Sequence[int] = (1, 4, 16, 64),
    n_tokens: int = 512,
    docs: int = 4,
    seeds: Sequence[int] = (0,),
    decay: float = 0.995,
    seed: int = 0,
) -> pd.DataFrame:
    """A SYNTHETIC positions frame with the issue-4 schema (not measured; for tests/demos).

    KL per position follows the appendix C.6 scaling with log-normal noise: shared policies
    ``kl ~ c * Var[e]`` of eq. C6.6 with ``sigma2`` per format (grows with ``N``, saturating at
    ``1/(1 - a^(2L))``), separate policies a single-rounding level (eq. C6.7, flat in ``N``);
    ``fp32`` is exactly 0. Top-1 agreement falls with KL. No state goes non-finite except
    ``shared:*fp4*`` at window 1, flagged on a few late positions so the non-finite plot has data.

    Returns: frame with :data:`POSITION_COLUMNS` plus ``synthetic = True``.
    """
    from . import theory

    rng = np.random.default_rng(seed)
    level = {"nvfp4": 3e-2, "mxfp4": 4e-2, "fp8e4m3": 2e-3, "fp8e5m2": 8e-3, "mxfp8": 2e-3,
             "fp16": 1e-6, "bf16": 2e-5, "fp32": 0.0}  # fmt: skip
    pos = np.arange(n_tokens)
    frames = []
    for pol in policies:
        kind, read, _ = policy_parts(pol)
        base = level[read.removesuffix("+sr")] * (0.5 if read.endswith("+sr") else 1.0)
        for w in windows:
            for s in seeds:
                for d in range(docs):
                    if kind == "fp32":
                        kl = np.zeros(n_tokens)
                    elif kind == "separate":
                        kl = base * rng.lognormal(0, 0.5, n_tokens)
                    else:
                        v = theory.error_variance(decay, pos + 1, 1.0, window=w, point="read")
                        kl = base * (1 + v) * rng.lognormal(0, 0.5, n_tokens)
                    nonfinite = np.zeros(n_tokens, bool)
                    if kind in ("shared", "eager") and "fp4" in read and w == 1:
                        nonfinite[-max(1, n_tokens // 50):] = rng.random() < 0.5
                    p_agree = np.exp(-3 * kl)
                    nll_ref = rng.gamma(2.0, 1.5, n_tokens)
                    dnll = kl * rng.normal(1, 0.5, n_tokens)
                    frames.append(
                        pd.DataFrame(
                            dict(
                                doc=f"doc{d}", position=pos, policy=pol, window=w, seed=s,
                                kl=np.where(nonfinite, np.nan, kl),
                                top1_agree=rng.random(n_tokens) < p_agree,
                                dp_ref=-np.sign(dnll) * np.minimum(np.abs(dnll), 1) * 0.1,
                                nll_ref=nll_ref, nll=np.where(nonfinite, np.nan, nll_ref + dnll),
                                nonfinite=nonfinite,
                            )  # fmt: skip
                        )
                    )
    out = pd.concat(frames, ignore_index=True)
    out["synthetic"] = True
    return out


def write_synthetic_run(path, **kwargs) -> Path:
    """Write a SYNTHETIC run directory (positions.parquet, summary.csv, manifest.json with
    ``"synthetic": true``) from :func:`synthetic_positions`; returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    df = synthetic_positions(**kwargs)
    df.to_parquet(path / "positions.parquet", index=False)
    summ = summarize(df.assign(bucket=position_buckets(df["position"])),
                     by=("policy", "window", "bucket"))  # fmt: skip
    summ.to_csv(path / "summary.csv", index=False)
    manifest = {
        "synthetic": True,
        "note": "SYNTHETIC data from replayssm_quant.analysis.results.synthetic_positions; not a measurement",
        "command": "replayssm_quant.analysis.results.write_synthetic_run(" + repr(kwargs) + ")",
    }
    (path / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return path
