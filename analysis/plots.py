"""Seaborn figures of KL runs (``replayssm-kl`` output) and of theory versus simulation.

Every function takes a tidy frame, checks its columns (ValueError naming the missing ones),
returns the matplotlib Figure, and saves it when ``path`` is given (the suffix picks the format:
``.png`` or ``.svg``; :func:`save_figure` writes several). KL is in nats; ``N`` is the number of
tokens seen (position + 1), bucketed in octaves by :func:`replayssm_quant.analysis.results.kl_by_position`.
matplotlib picks its backend (Agg when headless, inline under Jupyter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from .results import (  # noqa: E402
    KL_NOISE_FLOOR,
    kl_by_position,
    require_columns,
    rtn_sr_ratio,
    shared_separate_ratio,
    uses_sr,
)

__all__ = [
    "plot_kl_vs_n",
    "plot_kl_vs_window",
    "plot_ratio_vs_n",
    "plot_top1_agreement",
    "plot_nonfinite",
    "plot_rtn_vs_sr",
    "plot_state_error_vs_decay",
    "predicted_state_error",
    "plot_theory_vs_simulation",
    "save_figure",
    "plot_attribution_heatmap",
    "POSITION_PLOT_COLUMNS",
]

POSITION_PLOT_COLUMNS = ("doc", "position", "policy", "window", "kl", "nonfinite")
_FIGSIZE = (6.4, 4.2)


def save_figure(fig, path, formats: Iterable[str] | None = None) -> list[Path]:
    """Save ``fig`` to ``path``; with ``formats`` (e.g. ``("png", "svg")``) one file per
    format with that suffix. Returns the written paths. Raises ValueError for a format other
    than png/svg/pdf."""
    path = Path(path)
    fmts = list(formats) if formats else [path.suffix.lstrip(".") or "png"]
    out = []
    for f in fmts:
        if f not in ("png", "svg", "pdf"):
            raise ValueError(f"unsupported figure format {f!r} (png, svg or pdf)")
        p = path.with_suffix("." + f)
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=120, bbox_inches="tight")
        out.append(p)
    return out


def _finish(fig, path):
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def _runs(df: pd.DataFrame) -> list[str]:
    """``["run"]`` when the frame mixes several runs (curves are then labelled by run)."""
    return ["run"] if "run" in df.columns and df["run"].nunique() > 1 else []


def _label(agg: pd.DataFrame, runs: list[str], base: pd.Series) -> pd.Series:
    return (agg["run"].astype(str) + ": " + base) if runs else base


def _select_window(df: pd.DataFrame, window):
    if window is None:
        return df
    sel = df[df["window"] == window]
    if sel.empty:
        raise ValueError(f"no rows with window={window}; windows present: {sorted(df['window'].unique())}")
    return sel


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_DASHES = ("-", "--", "-.", ":")


_UNIT_WORDS = {"doc": "documents", "sequence": "(document, SR seed) sequences"}


def _bands(ax, agg: pd.DataFrame, hue: str, x: str = "n_mid", y: str = "mean", *,
           log: bool = False, clip=None, unit: str = "doc") -> list[str]:
    """One line per ``hue`` value with its 95% band; distinct colour, marker and dash so
    overlapping curves stay visible. ``log``: the y axis is logarithmic, so a band whose lower
    bound is <= 0 (few documents) is drawn down to a tenth of the mean. ``clip``: ``(lo, hi)``
    bounds of the metric (top-1 agreement: 0..1). A bucket the run only partly covers
    (``partial``: e.g. the last octave holding one position per document)
    is drawn hollow and not joined to the line. Returns notes for the caption."""
    n = agg[hue].nunique()
    colors = sns.color_palette(n_colors=n) if n <= 10 else sns.color_palette("husl", n)
    keys = list(agg[hue].unique())
    notes = set()
    for i, key in enumerate(keys):
        g = agg[agg[hue] == key].sort_values(x)
        style = dict(color=colors[i], marker=_MARKERS[i % len(_MARKERS)], ms=4)
        partial = g["partial"].astype(bool) if "partial" in g.columns \
            else pd.Series(False, index=g.index)
        full = g[~partial]
        ax.plot(full[x], full[y], ls=_DASHES[(i // len(_MARKERS)) % len(_DASHES)], lw=1.4,
                label=str(key), **style)
        if partial.any():
            ax.plot(g.loc[partial, x], g.loc[partial, y], ls="none", mfc="none", **style)
            notes.add("hollow markers: a position bucket the run covers only in part")
        if {"ci_lo", "ci_hi"} <= set(g.columns) and g["ci_lo"].notna().any():
            lo, hi = g["ci_lo"].astype(float), g["ci_hi"].astype(float)
            if log and (lo <= 0).any():
                lo = lo.where(lo > 0, g[y] / 10)
                notes.add(f"bands: 95% CI over {_UNIT_WORDS.get(unit, unit)}; a lower bound "
                          "<= 0 is drawn at mean/10")
            if clip is not None:
                lo, hi = lo.clip(*clip), hi.clip(*clip)
            ax.fill_between(g[x], lo, hi, alpha=0.15, color=colors[i], lw=0)
    return sorted(notes)


def _legend(ax, n: int) -> None:
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2 if n > 3 else 1,
              frameon=False)


def _caption(fig, notes: Sequence[str]) -> None:
    if notes:
        fig.text(0.01, -0.02, "\n".join(notes), fontsize=7, va="top", ha="left", color="0.3")


def plot_kl_vs_n(df: pd.DataFrame, window: int | None = None, path=None, include_fp32=False,
                 unit: str = "doc"):
    """Mean KL (nats) versus tokens seen ``N``, log-log, one line per policy (and window),
    with 95% confidence bands over documents (ReplaySSM paper figure style: shared precision
    grows with ``N``, separate precision stays flat, appendix C.6).

    Args:
        df: positions frame; needs :data:`POSITION_PLOT_COLUMNS`.
        window: plot only this window ``L`` (default: all, labelled ``policy L=..``).
        path: optional output file (.png / .svg). include_fp32: keep the (zero) reference.
        unit: confidence-interval unit, ``"doc"`` or ``"sequence"`` (:func:`kl_by_position`).

    Returns: the Figure. Raises ValueError for missing columns or an absent window.
    """
    require_columns(df, POSITION_PLOT_COLUMNS, "plot_kl_vs_n")
    d = _select_window(df, window)
    if not include_fp32:
        d = d[d["policy"] != "fp32"]
    runs = _runs(d)
    agg = kl_by_position(d, by=(*runs, "policy", "window"), unit=unit)
    base = agg["policy"] + (" L=" + agg["window"].astype(str) if window is None else "")
    agg["curve"] = _label(agg, runs, base)
    zero = agg[agg["mean"] == 0]
    agg = agg[agg["mean"] > 0]
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    notes = _bands(ax, agg, "curve", log=True, unit=unit)
    low = agg[agg["mean"] < KL_NOISE_FLOOR]
    if len(low):  # float32 arithmetic differences, not rounding: keep them off the axis
        ax.set_ylim(bottom=KL_NOISE_FLOOR)
        notes.append(f"below {KL_NOISE_FLOOR:g} nats (off the axis): float32 arithmetic noise of the "
                     "emulation (e.g. read copies before their first flush), not rounding")
    if len(zero):  # exact zeros cannot sit on a log axis: say where they are
        first = zero.groupby("curve")["n_hi"].max().sort_index()
        notes.append("KL exactly 0 (not drawn on the log axis) for "
                     + "; ".join(f"{c}: N <= {int(v)}" for c, v in first.items()))
    ax.set_xscale("log")
    if len(agg):
        ax.set_yscale("log")
    ax.set_xlabel("tokens seen N")
    ax.set_ylabel("mean KL(P_fp32 || P_policy) [nats]")
    ax.set_title("KL versus N" + (f" (L={window})" if window is not None else ""))
    _legend(ax, agg["curve"].nunique())
    _caption(fig, notes)
    return _finish(fig, path)


def plot_kl_vs_window(df: pd.DataFrame, n: int | None = None, path=None, unit: str = "doc"):
    """Mean KL (nats) versus window ``L`` at a fixed ``N`` bucket, one line per policy, with
    the ratio of the smallest to the largest L's KL in the legend (paper, section 5: shared
    checkpoints gain 12x (FP8) and 23x (NVFP4) from L = 1 to 64 at N = 1K).

    Args:
        df: positions frame (needs :data:`POSITION_PLOT_COLUMNS`).
        n: tokens seen; the octave bucket holding ``n`` is used (default: the last octave the
            run covers in full).
        path: optional output file. unit: confidence-interval unit (:func:`kl_by_position`).
    Returns: the Figure. Raises ValueError for missing columns or no data at ``n``.
    """
    require_columns(df, POSITION_PLOT_COLUMNS, "plot_kl_vs_window")
    runs = _runs(df)
    agg = kl_by_position(df[df["policy"] != "fp32"], by=(*runs, "policy", "window"), unit=unit)
    if agg.empty:
        raise ValueError("plot_kl_vs_window: no non-reference policies")
    if n is None:
        full = agg[~agg["partial"].astype(bool)]
        bucket = int((full if len(full) else agg)["bucket"].max())
    else:
        bucket = int(np.floor(np.log2(n) + 1e-12))
    sel = agg[agg["bucket"] == bucket].copy()
    if sel.empty:
        raise ValueError(f"plot_kl_vs_window: no positions with N near {n}")
    if sel["window"].nunique() < 2:
        raise ValueError(f"plot_kl_vs_window: one window only ({sel['window'].iloc[0]}); run "
                         "replayssm-kl with several --windows")
    ends = sel.sort_values("window").groupby([*runs, "policy"])["mean"].agg(["first", "last"])
    gain = (ends["first"] / ends["last"]).rename("gain")
    sel = sel.merge(gain.reset_index(), on=[*runs, "policy"], how="left")
    wmin, wmax = int(sel["window"].min()), int(sel["window"].max())
    sel["curve"] = _label(sel, runs, sel["policy"] + sel["gain"].map(
        lambda g: f"  (L={wmin}/L={wmax}: {g:.3g}x)" if np.isfinite(g) else ""))
    fig, ax = plt.subplots(figsize=(_FIGSIZE[0], _FIGSIZE[1] + 0.6))
    zero = sel[~(sel["mean"] > 0)]
    pos = sel[sel["mean"] > 0]
    notes = _bands(ax, pos.drop(columns=["partial"], errors="ignore"), "curve", x="window",
                   log=True, unit=unit)
    if len(zero):
        notes.append("KL exactly 0 (not drawn on the log axis): "
                     + "; ".join(f"{p} at L={int(w)}" for p, w in
                                 zero[["policy", "window"]].itertuples(index=False)))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(sel["window"].unique()))
    ax.set_xticklabels([str(int(w)) for w in sorted(sel["window"].unique())])
    ax.set_yscale("log")
    ax.set_xlabel("window L")
    ax.set_ylabel("mean KL [nats]")
    lo, hi = sel["n_lo"].iloc[0], sel["n_hi"].iloc[0]
    ax.set_title(f"KL versus window L at N in [{lo:.0f}, {hi:.0f}]")
    _legend(ax, sel["curve"].nunique())
    _caption(fig, notes)
    return _finish(fig, path)


def plot_ratio_vs_n(df: pd.DataFrame, path=None, window: int | None = None):
    """Shared/separate KL ratio versus ``N`` (log-log), one line per (read format, rec, L).

    Pairs ``read:F/rec:G`` with ``shared:F`` (see
    :func:`replayssm_quant.analysis.results.shared_separate_ratio`); ``window``: one L
    (default: every L > 1: at L = 1 every output reads the unrounded state, so a separate
    read copy is never read). Returns the Figure.
    Raises ValueError for missing columns or when no separate policy has a shared partner.
    """
    require_columns(df, POSITION_PLOT_COLUMNS, "plot_ratio_vs_n")
    df = _select_window(df, window) if window is not None else df[df["window"] > 1]
    r = shared_separate_ratio(df)
    ratio = r["ratio"].astype(float)  # an empty result has object columns
    paired = not r.empty
    r = r[np.isfinite(ratio) & (ratio > 0)]
    if r.empty:
        raise ValueError(_no_ratio("plot_ratio_vs_n", paired,
                                   "no read:F/rec:G policy with a shared:F partner"))
    r = r.assign(curve=_label(r, _runs(df), r["shared"] + " / read:" + r["read"] + "/rec:" + r["rec"]
                              + (" L=" + r["window"].astype(str) if window is None else "")))
    return _ratio_figure(r, "KL(shared) / KL(separate)", "Shared over separate precision", window,
                         "above the dashed line the separate read copy has the lower KL", path)


def _no_ratio(who: str, paired: bool, unpaired: str) -> str:
    """Why a ratio figure has nothing to draw: ``unpaired`` when no policies pair, else every
    pair's means below :data:`KL_NOISE_FLOOR`."""
    if not paired:
        return f"{who}: {unpaired}"
    return (f"{who}: every paired bucket's mean KL is below {KL_NOISE_FLOOR:g} nats (float32 "
            "noise: no effect to take a ratio of)")


def _ratio_figure(r: pd.DataFrame, ylabel: str, title: str, window, note: str, path):
    """A KL ratio versus N (log-log, one line per ``curve`` of ``r``, dashed line at 1)."""
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    notes = _bands(ax, r, "curve", y="ratio")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens seen N")
    ax.set_ylabel(ylabel)
    ax.set_title(title + (f" (L={window})" if window is not None else ""))
    _legend(ax, r["curve"].nunique())
    _caption(fig, notes + [note])
    return _finish(fig, path)


def plot_top1_agreement(df: pd.DataFrame, window: int | None = None, path=None,
                        unit: str = "doc"):
    """Top-1 agreement with the FP32-state reference versus ``N`` (log x), per policy, with
    95% bands over documents. Needs the position columns and ``top1_agree``."""
    require_columns(df, (*POSITION_PLOT_COLUMNS, "top1_agree"), "plot_top1_agreement")
    d = _select_window(df, window)
    d = d[d["policy"] != "fp32"].assign(top1_agree=lambda x: x["top1_agree"].astype(float))
    runs = _runs(d)
    agg = kl_by_position(d, metric="top1_agree", by=(*runs, "policy", "window"), unit=unit)
    base = agg["policy"] + (" L=" + agg["window"].astype(str) if window is None else "")
    agg["curve"] = _label(agg, runs, base)
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    notes = _bands(ax, agg, "curve", clip=(0.0, 1.0), unit=unit)
    ax.set_xscale("log")
    low = float(agg["ci_lo"].clip(0, 1).min()) if len(agg) and agg["ci_lo"].notna().any() else 0.0
    ax.set_ylim(max(0.0, min(low, float(agg["mean"].min()) if len(agg) else 0.0) - 0.02), 1.005)
    ax.set_xlabel("tokens seen N")
    ax.set_ylabel("top-1 agreement")
    ax.set_title("Top-1 agreement with FP32-state decoding")
    _legend(ax, agg["curve"].nunique())
    _caption(fig, notes)
    return _finish(fig, path)


def plot_nonfinite(df: pd.DataFrame, path=None):
    """Non-finite incidence: fraction of (document, seed) sequences whose state went
    non-finite, per policy and window (bar plot; 0 bars are drawn as empty).
    Needs ``doc, seed, policy, window, nonfinite``."""
    require_columns(df, ("doc", "seed", "policy", "window", "nonfinite"), "plot_nonfinite")
    runs = _runs(df)
    seq = df.groupby([*runs, "policy", "window", "doc", "seed"], as_index=False)["nonfinite"].any()
    inc = seq.groupby([*runs, "policy", "window"], as_index=False)["nonfinite"].mean()
    inc["window"] = inc["window"].astype(str)
    if runs:
        inc["policy"] = inc["run"].astype(str) + ": " + inc["policy"]
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    if not inc["nonfinite"].any():  # nothing to draw: say so instead of empty axes
        ax.axis("off")
        ax.text(0.5, 0.5, f"no non-finite values: {len(seq)} sequences of {inc['policy'].nunique()} "
                "policies stayed finite", ha="center", va="center", fontsize=10)
        ax.set_title("Non-finite state incidence")
        return _finish(fig, path)
    sns.barplot(data=inc, x="policy", y="nonfinite", hue="window", ax=ax)
    ax.set_ylim(0, 1)
    ax.set_ylabel("fraction of sequences non-finite")
    ax.set_xlabel("")
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    ax.set_title("Non-finite state incidence")
    return _finish(fig, path)


def plot_rtn_vs_sr(df: pd.DataFrame, window: int | None = None, path=None):
    """KL(RTN) / KL(SR) versus ``N`` (log-log), one line per SR policy and its RTN twin
    (:func:`replayssm_quant.analysis.results.rtn_sr_ratio`); below 1 RTN is better. Paper,
    section 5: 0.40-0.51x for NVFP4 at short N, RTN growing faster with N.

    Args: df: positions frame; window: one L (default: all, labelled); path: output file.
    Returns: the Figure. Raises ValueError for missing columns or when no policy pairs.
    """
    require_columns(df, POSITION_PLOT_COLUMNS, "plot_rtn_vs_sr")
    d = _select_window(df, window)
    r = rtn_sr_ratio(d)
    ratio = r["ratio"].astype(float)
    paired = not r.empty
    r = r[np.isfinite(ratio) & (ratio > 0)]
    if r.empty:
        raise ValueError(_no_ratio("plot_rtn_vs_sr", paired,
                                   "no policy with +sr whose RTN twin is in the run"))
    r = r.assign(curve=_label(r, _runs(d), r["rtn_policy"] + " / +sr"
                              + (" L=" + r["window"].astype(str) if window is None else "")))
    return _ratio_figure(r, "KL(RTN) / KL(SR)", "Round-to-nearest over stochastic rounding", window,
                         "below the dashed line RTN has the lower KL", path)


def _format_of(policy: str) -> str | None:
    """The rounded format of a single-checkpoint policy (``shared:F`` / ``eager:F``), else None
    (also for policy maps and for non-default scale modes, which the prediction does not model)."""
    from replayssm_quant.policy import StatePolicy

    if policy.strip().lower().startswith("map:"):
        return None
    pol = StatePolicy.parse(policy)
    if policy.startswith(("shared:", "eager:")) and not pol.read.is_identity and not pol.read.scale:
        return policy.split(":", 1)[1].replace("+sr", "")
    return None


def predicted_state_error(decay_log_mean, beta_mean, fmt: str, window: int,
                          key_dim: int | None = None, seed: int = 0):
    """Relative RMS state error of a single checkpoint under SR, predicted per head by the
    driven-regime closed form of :mod:`replayssm_quant.analysis.theory` (appendix C.6, eqs.
    C6.6/C6.11/C6.12): ``sqrt(kappa)``, ``kappa = rho / (1 - a^(2L))``, with ``rho`` the
    format's per-rounding mean-square error relative to the state's (``theory.driven_sigma2`` on
    N(0, 1) draws; scaled formats make it scale-free) and ``a`` the head's per-token decay
    (geometric mean ``exp(mean log alpha)``; for GDN the delta rule's mean-square contraction
    ``theory.gdn_effective_decay(alpha, beta, key_dim)``, beta clipped to its range [0, 2]).
    ``rho`` is a Monte-Carlo mean over 65,536 N(0, 1) draws of the format's grid model
    (``seed``; it moves by ~0.3% between seeds), so the prediction is closed-form up to that.

    Args:
        decay_log_mean, beta_mean: float arrays ``[heads]`` (mean log alpha <= 0, mean beta).
        fmt: bare rounded format (``nvfp4``, ``fp8e4m3``, ...; no ``+sr`` suffix); window: L >= 1.
        key_dim: GDN key dimension d_k (None: no delta-rule contraction, Mamba-2).
        seed: of the N(0, 1) draws.
    Returns: float64 array ``[heads]`` (dimensionless; inf for a head with alpha = 1).
    Raises:
        ValueError: ``window < 1``, a mean log decay above 0, or a format the grid model does
            not know.
    """
    from . import theory

    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if np.any(np.asarray(decay_log_mean, dtype=np.float64) > 0):
        raise ValueError("decay_log_mean must be <= 0 (log of a decay in (0, 1])")

    x = np.random.default_rng(seed).standard_normal((64, 16, 64))
    _, parts = theory.driven_sigma2(x, fmt)
    a = np.exp(np.asarray(decay_log_mean, dtype=np.float64))
    if key_dim:
        _, a = theory.gdn_effective_decay(a, np.clip(np.asarray(beta_mean, np.float64), 0, 2),
                                          int(key_dim))
    return np.sqrt(parts["rho"] / -np.expm1(2 * window * np.log(np.maximum(a, 1e-300))))


def plot_state_error_vs_decay(se: pd.DataFrame, policies: Sequence[str] | None = None,
                              window: int | None = None, key_dim: int | None = None, path=None):
    """Per-head relative state error of the read copy at the end of the run versus the head's
    per-token decay, one panel per policy, one colour per layer, with the driven-regime
    prediction of :func:`predicted_state_error` for SR policies (grey crosses) and the Spearman
    rank correlation of measured and predicted errors in each panel's title.

    Args:
        se: ``state_error.parquet`` frame (``replayssm-kl --state-error``): ``policy, window,
            position, layer, head, err_read, log_decay, beta`` (``key_dim`` if present).
        policies: panels (default: the single-checkpoint SR policies present, else the first
            four policies). ``eager:`` policies round every token, so their prediction uses
            L = 1.
        window: one L (default 16 if present, else the largest).
        key_dim: GDN key dimension (default: the ``key_dim`` column; None for Mamba-2). The x
            axis is the per-token decay itself; for GDN the prediction uses the delta rule's
            effective decay computed from it and beta.
        path: optional output file.
    Returns: the Figure. Raises ValueError for missing columns, a window the table does not
    hold, or nothing to draw.
    """
    from scipy import stats as sstats

    require_columns(se, ("policy", "window", "position", "layer", "head", "err_read",
                         "log_decay", "beta"), "plot_state_error_vs_decay")
    ws = sorted(int(w) for w in se["window"].unique())
    if window is None:
        window = 16 if 16 in ws else ws[-1]
    elif window not in ws:
        raise ValueError(f"plot_state_error_vs_decay: window {window} not in the table's "
                         f"windows {ws}")
    d = se[(se["window"] == window) & (se["policy"] != "fp32")]
    d = d[d["position"] == d["position"].max()]
    if policies is None:
        cand = [p for p in sorted(d["policy"].unique()) if _format_of(p) and uses_sr(p)]
        policies = cand or sorted(d["policy"].unique())[:4]
    d = d[d["policy"].isin(policies)]
    if d.empty:
        raise ValueError(f"plot_state_error_vs_decay: no rows for {list(policies)} at L={window}")
    if key_dim is None and "key_dim" in d.columns and not (d["beta"] == 1).all():
        key_dim = int(d["key_dim"].iloc[0])
    g = d.groupby(["policy", "layer", "head"], as_index=False).agg(
        err=("err_read", "mean"), log_decay=("log_decay", "mean"), beta=("beta", "mean"))
    g["x"] = -np.expm1(g["log_decay"])  # 1 - a
    layers = sorted(g["layer"].unique())
    pal = dict(zip(layers, sns.color_palette(n_colors=len(layers))))
    fig, axes = plt.subplots(1, len(policies), figsize=(3.3 * len(policies) + 0.6, 3.6),
                             squeeze=False, sharey=True)
    for ax, pol in zip(axes[0], policies):
        h = g[g["policy"] == pol]
        for layer, hl in h.groupby("layer"):
            ax.scatter(hl["x"], hl["err"], s=22, color=pal[layer], label=f"layer {layer}",
                       zorder=3)
        title = pol
        fmt = _format_of(pol)
        if fmt and uses_sr(pol) and len(h):
            eff = 1 if pol.startswith("eager:") else window  # eager rounds every token
            pred = predicted_state_error(h["log_decay"], h["beta"], fmt, eff, key_dim)
            ax.scatter(h["x"], pred, marker="x", s=18, color="0.45", label="prediction", zorder=2)
            if len(h) > 2:
                r = sstats.spearmanr(h["err"], pred).statistic
                title += f"\nSpearman(measured, predicted) = {r:.2f}"
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("1 - a  (a = exp(mean log decay) per token)")
    axes[0][0].set_ylabel("relative read-copy error ||R - S|| / ||S||")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        for hd, lb in zip(*ax.get_legend_handles_labels()):
            if lb not in labels:
                handles.append(hd)
                labels.append(lb)
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5),
               frameon=False)
    pos = int(d["position"].max())
    fig.suptitle(f"Per-head state error versus decay at N = {pos}, L = {window}", fontsize=10)
    _caption(fig, ["points: mean over documents and seeds per (layer, head); slow heads "
                   "(small 1 - a) sit left; the prediction assumes the driven regime "
                   "(small error, SR) and, for GDN, an isotropic error under the delta rule"
                   + (f" (d_k = {key_dim})" if key_dim else "")])
    return _finish(fig, path)


def plot_theory_vs_simulation(
    frame: pd.DataFrame,
    measured: str = "state_var",
    predicted: Sequence[str] = ("pred_state_var", "cf_state_var"),
    path=None,
):
    """Measured error variance versus step with the closed-form predictions (eqs. C6.4/C6.6),
    log y, one panel per format, one colour per decay (from :func:`replayssm_quant.analysis.simulate.simulate`).

    Args: frame: simulation frame; measured / predicted: its column names. Returns the Figure.
    Raises ValueError for missing columns.
    """
    require_columns(frame, ("format", "decay", "step", measured, *predicted), "plot_theory_vs_simulation")
    fmts = list(dict.fromkeys(frame["format"]))
    fig, axes = plt.subplots(1, len(fmts), figsize=(3.6 * len(fmts), 3.4), squeeze=False)
    styles = ["--", ":", "-."]
    for ax, f in zip(axes[0], fmts):
        d = frame[frame["format"] == f]
        pal = dict(zip(sorted(d["decay"].unique()), sns.color_palette(n_colors=d["decay"].nunique())))
        for a, g in d.groupby("decay"):
            g = g.sort_values("step")
            ax.plot(g["step"], g[measured], color=pal[a], lw=1.2, label=f"a={a} measured")
            for s, c in zip(styles, predicted):
                ax.plot(g["step"], g[c], color=pal[a], ls=s, lw=1, label=f"a={a} {c}")
        ax.set_yscale("log")
        ax.set_title(f)
        ax.set_xlabel("step t")
    axes[0][0].set_ylabel(measured)
    axes[0][-1].legend(fontsize=6)
    return _finish(fig, path)


ATTRIBUTION_COLUMNS = ("layer", "heads", "kl_mean")


def plot_attribution_heatmap(df: pd.DataFrame, decays, heads, path=None, title: str | None = None):
    """Layer x head heatmap of a KL attribution (``replayssm-attribute``): colour = log10 of
    each unit's mean KL (nats; a head group's or a whole layer's cells share its value), each
    cell annotated with that head's mean decay.

    Args:
        df: one row per unit with ``layer`` (int), ``heads`` (``"a"``, ``"a-b"`` inclusive, or
            runs joined by ``+``) and ``kl_mean``.
        decays: ``{layer: per-head mean decays}``. heads: ``{layer: number of heads}``.
        path: where to save (png/svg), or None. title: figure title.

    Returns:
        the Figure. Raises ValueError naming missing columns.
    """
    require_columns(df, ATTRIBUTION_COLUMNS, "plot_attribution_heatmap")
    layers = sorted(heads)
    width = max(heads.values())
    val = np.full((len(layers), width), np.nan)
    ann = np.full((len(layers), width), "", dtype=object)
    for r in df.itertuples():
        row = layers.index(int(r.layer))
        kl = float(r.kl_mean)
        for part in str(r.heads).split("+"):  # "0-3" or "1+4+6"
            a, _, b = part.partition("-")
            val[row, int(a): int(b or a) + 1] = np.log10(kl) if kl > 0 else np.nan
    for row, i in enumerate(layers):
        for h in range(heads[i]):
            ann[row, h] = f"{decays[i][h]:.3f}"
    fig, ax = plt.subplots(figsize=(1.0 + 0.75 * width, 0.9 + 0.55 * len(layers)))
    sns.heatmap(val, annot=ann, fmt="", cmap="rocket_r", mask=~np.isfinite(val), ax=ax,
                cbar_kws={"label": "log10 mean KL (nats/token)"}, annot_kws={"fontsize": 8},
                linewidths=0.5, linecolor="white")
    ax.set_xticks(np.arange(width) + 0.5, [str(h) for h in range(width)])
    ax.set_yticks(np.arange(len(layers)) + 0.5, [f"layer {i}" for i in layers], rotation=0)
    ax.set_xlabel("head (annotation: mean decay)")
    ax.set_ylabel("")
    if title:
        ax.set_title(title, fontsize=9)
    return _finish(fig, path)
