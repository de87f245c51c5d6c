"""Per-position metrics of two logit tensors, and the runner's per-bucket summary.

KL(P || Q) in nats is computed so that it can never be negative (docs/kl-runner.md,
"Guarantees"):

* both log-probabilities come from ``log_softmax`` in float64 (the logits, FP32 or narrower,
  are exact in float64);
* the sum is written as ``KL = sum_v t_v`` with ``t_v = p_v d_v - p_v + q_v``,
  ``d_v = log p_v - log q_v``. The two extra terms add ``sum q - sum p = 0``, and each
  ``t_v = p_v f(d_v)`` with ``f(d) = d - 1 + exp(-d) >= 0`` for every real ``d``: every term
  is non-negative in exact arithmetic, whatever the rounding in ``d``;
* ``t_v`` is evaluated as ``p_v (expm1(-d_v) + d_v)`` (no cancellation between large
  terms, accurate for KL down to ~1e-30), or as ``q_v - p_v + p_v d_v`` where ``d_v < -700``
  (``expm1`` would overflow); a term below 0 can then only be float64 rounding of a
  non-negative number, and is clamped to 0 *term by term*. A sum of non-negative terms is
  non-negative, so ``kl >= 0`` holds by construction, and equals the plain
  ``sum p (log p - log q)`` to float64 rounding (~1e-16 absolute).

Non-finite logits are results, not errors: a position whose reference logits (``ref``) or
compared logits (``policy``) hold a NaN or inf anywhere gets ``nonfinite_ref`` /
``nonfinite_policy`` set, ``nonfinite = nonfinite_ref | nonfinite_policy``, and NaN for every
metric that needs the non-finite side (``kl``, ``dp_ref``; ``nll_ref`` needs only the
reference, ``nll`` only the policy); ``top1_agree`` is False there.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["kl_nonneg", "position_metrics", "pair_kl", "summarize", "bucket_sums",
           "PERCENTILES", "EXPM1_LIMIT", "CHUNK_ELEMENTS", "BUCKETS_PER_OCTAVE", "BUCKET_COLUMNS"]

PERCENTILES = (50, 90, 99, 99.9)
#: below ``d = -EXPM1_LIMIT`` the term uses ``q - p + p d`` (float64 exp overflows at ~709.78)
EXPM1_LIMIT = 700.0
#: float64 temporaries are computed for at most this many logits at a time (128 MiB each)
CHUNK_ELEMENTS = 1 << 24


def kl_nonneg(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(P || Q) in nats over the last axis from float64 log-probabilities, >= 0 by construction.

    Args:
        lp, lq: ``[..., V]`` float64 log-probabilities (``log_softmax`` outputs), finite.
    Returns:
        ``[...]`` float64, every entry >= 0 (see the module docstring for why).
    """
    d = lp - lq
    p = lp.exp()
    big = d < -EXPM1_LIMIT
    t = p * (torch.expm1(-d.clamp_min(-EXPM1_LIMIT)) + d)
    if bool(big.any()):
        t = torch.where(big, lq.exp() - p + p * d, t)
    return t.clamp_min(0.0).sum(-1)


def _chunks(n_rows: int, vocab: int):
    step = max(1, CHUNK_ELEMENTS // max(1, vocab))
    for lo in range(0, n_rows, step):
        yield slice(lo, min(n_rows, lo + step))


def position_metrics(ref_logits, logits, targets) -> dict:
    """Per-position metrics of ``logits`` against ``ref_logits``, in float64.

    Args:
        ref_logits, logits: ``[..., V]`` (any float dtype, any device).
        targets: ``[...]`` int64, the document's next token at each position.
    Returns:
        dict of numpy arrays of shape ``[...]``: ``kl`` = KL(P_ref || P) (nats, >= 0),
        ``top1_agree``, ``dp_ref`` = |P(target) - P_ref(target)|, ``nll_ref``, ``nll``,
        ``nonfinite_ref``, ``nonfinite_policy``, ``nonfinite`` (either side; see the module
        docstring for which metrics turn NaN).
    """
    shape = tuple(ref_logits.shape[:-1])
    V = ref_logits.shape[-1]
    r = ref_logits.reshape(-1, V)
    q = logits.reshape(-1, V)
    t = targets.reshape(-1, 1).to(r.device)
    n = r.shape[0]
    out = {k: torch.empty(n, dtype=torch.float64) for k in ("kl", "dp_ref", "nll_ref", "nll")}
    out.update({k: torch.empty(n, dtype=torch.bool)
                for k in ("top1_agree", "nonfinite_ref", "nonfinite_policy")})
    for s in _chunks(n, V):
        nf_r = ~torch.isfinite(r[s]).all(-1)
        nf_q = ~torch.isfinite(q[s]).all(-1)
        lr = torch.log_softmax(r[s].double(), -1)
        lq = torch.log_softmax(q[s].double(), -1)
        kl = kl_nonneg(lr, lq)
        lrt, lqt = lr.gather(-1, t[s])[:, 0], lq.gather(-1, t[s])[:, 0]
        either = nf_r | nf_q
        nan = torch.tensor(math.nan, dtype=torch.float64, device=r.device)
        out["kl"][s] = torch.where(either, nan, kl).cpu()
        out["dp_ref"][s] = torch.where(either, nan, (lqt.exp() - lrt.exp()).abs()).cpu()
        out["nll_ref"][s] = torch.where(nf_r, nan, -lrt).cpu()
        out["nll"][s] = torch.where(nf_q, nan, -lqt).cpu()
        out["top1_agree"][s] = ((lr.argmax(-1) == lq.argmax(-1)) & ~either).cpu()
        out["nonfinite_ref"][s] = nf_r.cpu()
        out["nonfinite_policy"][s] = nf_q.cpu()
    res = {k: v.numpy().reshape(shape) for k, v in out.items()}
    res["nonfinite"] = res["nonfinite_ref"] | res["nonfinite_policy"]
    return res


def pair_kl(p_logits, q_logits):
    """``(kl, top1_agree, nonfinite)`` of KL(P || Q) per position (numpy, shape ``[...]``):
    float64 and >= 0 like :func:`position_metrics`; NaN and ``nonfinite`` where either side is
    not finite."""
    m = position_metrics(p_logits, q_logits,
                         torch.zeros(p_logits.shape[:-1], dtype=torch.int64))
    return m["kl"], m["top1_agree"], m["nonfinite"]


def _bucket(position: np.ndarray) -> np.ndarray:
    """``floor(log2(position + 1))`` for positions >= 0 (exact: integer bit length)."""
    pos = np.asarray(position, dtype=np.int64)
    if pos.size and pos.min() < 0:
        raise ValueError(f"positions must be >= 0 (got minimum {int(pos.min())}); "
                         "this is a runner bug, not a result")
    return (np.frexp((pos + 1).astype(np.float64))[1] - 1).astype(np.int64)


#: ``buckets.parquet`` resolution: quarter octaves of N = position + 1
BUCKETS_PER_OCTAVE = 4
BUCKET_COLUMNS = ("doc", "policy", "window", "seed", "qbucket", "pos_min", "pos_max", "n",
                  "kl_n", "kl_sum", "kl_max", "top1_sum", "nonfinite", "nonfinite_ref",
                  "nonfinite_policy")


def quarter_bucket(position: np.ndarray) -> np.ndarray:
    """``floor(4 log2(position + 1))``: quarter-octave bucket of each position, int64 of the
    input's shape, so four consecutive buckets make one octave of :func:`_bucket`.

    Raises:
        ValueError: a negative position.
    """
    n = np.asarray(position, dtype=np.int64) + 1
    if n.size and n.min() < 1:
        raise ValueError(f"positions must be >= 0, got minimum {int(n.min()) - 1}")
    q = np.floor(BUCKETS_PER_OCTAVE * np.log2(n.astype(np.float64))).astype(np.int64)
    # guard the float log at the exact boundaries 2^(q/4): the bucket's lower bound must hold
    lo = np.ceil(2.0 ** (q / BUCKETS_PER_OCTAVE) - 1e-9)
    q = np.where(n < lo, q - 1, q)
    return q


def bucket_sums(df):
    """Sums per (doc, policy, window, seed, quarter-octave bucket of N) of a positions frame:
    ``n`` positions, ``kl_n`` / ``kl_sum`` / ``kl_max`` / ``top1_sum`` over the finite rows
    (nats; agreements), and the non-finite counts. Exact building blocks of every mean, CI over
    documents and seeds, and incidence the report draws, small enough to keep where
    ``positions.parquet`` (one row per position) is too large to move (``buckets.parquet``).

    Args:
        df: positions frame with ``doc, policy, window, seed, position, kl, top1_agree,
            nonfinite, nonfinite_ref, nonfinite_policy`` (the runner's, since 2026-12-01).
    Returns:
        Frame with :data:`BUCKET_COLUMNS`. Top-1 agreement counts finite positions only (the
        runner's ``summary.csv`` counts a non-finite position as a disagreement).
    Raises:
        KeyError: a missing column; ValueError: a negative position."""
    import pandas as pd

    d = df[["doc", "policy", "window", "seed", "position", "kl", "top1_agree", "nonfinite",
            "nonfinite_ref", "nonfinite_policy"]].copy()
    d["qbucket"] = quarter_bucket(d["position"].to_numpy())
    fin = ~d["nonfinite"].to_numpy(bool) & np.isfinite(d["kl"].to_numpy(np.float64))
    d["kl_fin"] = np.where(fin, d["kl"].to_numpy(np.float64), 0.0)
    d["kl_n"] = fin.astype(np.int64)
    d["kl_mx"] = np.where(fin, d["kl"].to_numpy(np.float64), -np.inf)
    d["top1_fin"] = fin & d["top1_agree"].to_numpy(bool)
    g = d.groupby(["doc", "policy", "window", "seed", "qbucket"], sort=True)
    out = g.agg(pos_min=("position", "min"), pos_max=("position", "max"), n=("position", "size"),
                kl_n=("kl_n", "sum"), kl_sum=("kl_fin", "sum"), kl_max=("kl_mx", "max"),
                top1_sum=("top1_fin", "sum"), nonfinite=("nonfinite", "sum"),
                nonfinite_ref=("nonfinite_ref", "sum"),
                nonfinite_policy=("nonfinite_policy", "sum")).reset_index()
    out["kl_max"] = out["kl_max"].where(out["kl_n"] > 0)
    return pd.DataFrame(out)[list(BUCKET_COLUMNS)]


def _stats(values: np.ndarray) -> dict:
    fin = values[np.isfinite(values)]
    n = fin.size
    mean = float(fin.mean()) if n else math.nan
    half = 1.96 * float(fin.std(ddof=1)) / math.sqrt(n) if n > 1 else math.nan
    pct = np.percentile(fin, PERCENTILES) if n else [math.nan] * len(PERCENTILES)
    return {"mean": mean, "ci_lo": mean - half, "ci_hi": mean + half, "median": float(pct[0]),
            "p90": float(pct[1]), "p99": float(pct[2]), "p999": float(pct[3]),
            "max": float(fin.max()) if n else math.nan}


def summarize(df, stepwise=None):
    """Per (policy, window, log2 position bucket) summary; ``bucket = floor(log2(position+1))``.

    Columns: ``n`` rows, KL mean with a normal 95% interval over positions (its lower bound
    clipped at 0, since KL >= 0; as the report clips its own), median, p90, p99,
    p99.9, max (finite rows only), ``top1_agree`` (non-finite rows count as disagreement),
    ``nonfinite`` (either side), ``nonfinite_ref``, ``nonfinite_policy``. With ``stepwise``
    (the ``--stepwise-check`` table) also ``path_n``, ``path_kl_mean``, ``path_kl_max``
    (KL(stepping || emulation) of the cell) and ``path_kl_ref_mean`` (the same for the
    reference) over the checked positions of the bucket (0 / NaN in buckets not checked).
    """
    import pandas as pd

    # rows in an order fixed by their values (position, then the KL summed below), so every
    # sum is taken in an order that depends on neither the corpus order nor the documents'
    # labels (which fall back to a corpus position for unnamed records); rows equal in both
    # keys add the same value, in any order
    keys = [k for k in ("position", "kl") if k in df.columns]
    d = df.sort_values(keys, kind="stable").reset_index(drop=True) if keys else df.copy()
    d["bucket"] = _bucket(d["position"].to_numpy())
    sw = None
    if stepwise is not None and len(stepwise):
        skeys = [k for k in ("position", "kl_path", "kl_path_ref") if k in stepwise.columns]
        sw = stepwise.sort_values(skeys, kind="stable").reset_index(drop=True)
        sw["bucket"] = _bucket(sw["position"].to_numpy())
        sw = {k: g for k, g in sw.groupby(["policy", "window", "bucket"], sort=True)}
    rows = []
    for (pol, win, b), g in d.groupby(["policy", "window", "bucket"], sort=True):
        st = _stats(g.loc[~g["nonfinite"], "kl"].to_numpy(np.float64))
        if st["ci_lo"] < 0:  # KL >= 0: the interval's lower bound is clipped (NaN stays NaN)
            st["ci_lo"] = 0.0
        row = {"policy": pol, "window": int(win), "bucket": int(b),
               "pos_lo": int(2 ** b - 1), "pos_hi": int(2 ** (b + 1) - 2), "n": int(len(g)),
               **{f"kl_{k}": v for k, v in st.items()},
               "top1_agree": float(g["top1_agree"].mean()), "nonfinite": int(g["nonfinite"].sum()),
               "nonfinite_ref": int(g["nonfinite_ref"].sum()),
               "nonfinite_policy": int(g["nonfinite_policy"].sum())}
        if sw is not None:
            s = sw.get((pol, win, b))
            path = s.loc[~s["nonfinite"], "kl_path"].to_numpy(np.float64) if s is not None else np.array([])
            pref = s.loc[~s["nonfinite"], "kl_path_ref"].to_numpy(np.float64) if s is not None else np.array([])
            row.update(path_n=int(path.size), path_kl_mean=float(path.mean()) if path.size else math.nan,
                       path_kl_max=float(path.max()) if path.size else math.nan,
                       path_kl_ref_mean=float(pref.mean()) if pref.size else math.nan)
        rows.append(row)
    return pd.DataFrame(rows)
