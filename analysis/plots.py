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
    kl_by_position,
    require_columns,
    shared_separate_ratio,
)

__all__ = [
    "plot_kl_vs_n",
    "plot_kl_vs_window",
    "plot_ratio_vs_n",
    "plot_top1_agreement",
    "plot_nonfinite",
    "plot_theory_vs_simulation",
    "save_figure",
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


def _bands(ax, agg: pd.DataFrame, hue: str, x: str = "n_mid", y: str = "mean", *,
           log: bool = False, clip=None) -> list[str]:
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
                notes.add("bands: 95% CI over documents; a lower bound <= 0 is drawn at mean/10")
            if clip is not None:
                lo, hi = lo.clip(*clip), hi.clip(*clip)
            ax.fill_between(g[x], lo, hi, alpha=0.15, color=colors[i], lw=0)
    return sorted(notes)


def _legend(ax, n: int) -> None:
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2 if n > 3 else 1,
              frameon=False)


def _caption(fig, notes: Sequence[str]) -> None:
    if notes:
        fig.text(0.01, -0.02, "\n".join(notes), fontsize=7, va="top", ha="left", color="0.3")


def plot_kl_vs_n(df: pd.DataFrame, window: int | None = None, path=None, include_fp32=False):
    """Mean KL (nats) versus tokens seen ``N``, log-log, one line per policy (and window),
    with 95% confidence bands over documents (ReplaySSM paper figure style: shared precision
    grows with ``N``, separate precision stays flat, appendix C.6).

    Args:
        df: positions frame; needs :data:`POSITION_PLOT_COLUMNS`.
        window: plot only this window ``L`` (default: all, labelled ``policy L=..``).
        path: optional output file (.png / .svg). include_fp32: keep the (zero) reference.

    Returns: the Figure. Raises ValueError for missing columns or an absent window.
    """
    require_columns(df, POSITION_PLOT_COLUMNS, "plot_kl_vs_n")
    d = _select_window(df, window)
    if not include_fp32:
        d = d[d["policy"] != "fp32"]
    runs = _runs(d)
    agg = kl_by_position(d, by=(*runs, "policy", "window"))
    base = agg["policy"] + (" L=" + agg["window"].astype(str) if window is None else "")
    agg["curve"] = _label(agg, runs, base)
    zero = agg[agg["mean"] == 0]
    agg = agg[agg["mean"] > 0]
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    notes = _bands(ax, agg, "curve", log=True)
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


def plot_kl_vs_window(df: pd.DataFrame, n: int | None = None, path=None):
    """Mean KL (nats) versus window ``L`` at a fixed ``N`` bucket, one line per policy.

    Args:
        df: positions frame (needs :data:`POSITION_PLOT_COLUMNS`).
        n: tokens seen; the octave bucket holding ``n`` is used (default: the last bucket).
        path: optional output file.
    Returns: the Figure. Raises ValueError for missing columns or no data at ``n``.
    """
    require_columns(df, POSITION_PLOT_COLUMNS, "plot_kl_vs_window")
    runs = _runs(df)
    agg = kl_by_position(df[df["policy"] != "fp32"], by=(*runs, "policy", "window"))
    agg["curve"] = _label(agg, runs, agg["policy"])
    if agg.empty:
        raise ValueError("plot_kl_vs_window: no non-reference policies")
    if n is None:
        bucket = int(agg["bucket"].max())
    else:
        bucket = int(np.floor(np.log2(n) + 1e-12))
    sel = agg[agg["bucket"] == bucket]
    if sel.empty:
        raise ValueError(f"plot_kl_vs_window: no positions with N near {n}")
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    log = bool((sel["mean"] > 0).all())
    notes = _bands(ax, sel.drop(columns=["partial"], errors="ignore"), "curve", x="window",
                   log=log)
    ax.set_xscale("log", base=2)
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("window L")
    ax.set_ylabel("mean KL [nats]")
    lo, hi = sel["n_lo"].iloc[0], sel["n_hi"].iloc[0]
    ax.set_title(f"KL versus window at N in [{lo:.0f}, {hi:.0f}]")
    _legend(ax, sel["curve"].nunique())
    _caption(fig, notes)
    return _finish(fig, path)


def plot_ratio_vs_n(df: pd.DataFrame, path=None):
    """Shared/separate KL ratio versus ``N`` (log-log), one line per (read format, rec, L).

    Pairs ``read:F/rec:G`` with ``shared:F`` (see
    :func:`replayssm_quant.analysis.results.shared_separate_ratio`). Returns the Figure.
    Raises ValueError for missing columns or when no separate policy has a shared partner.
    """
    require_columns(df, POSITION_PLOT_COLUMNS, "plot_ratio_vs_n")
    r = shared_separate_ratio(df)
    ratio = r["ratio"].astype(float)  # an empty result has object columns
    r = r[np.isfinite(ratio) & (ratio > 0)]
    if r.empty:
        raise ValueError("plot_ratio_vs_n: no read:F/rec:G policy with a shared:F partner")
    runs = _runs(df)
    r = r.assign(curve=_label(r, runs, r["shared"] + " / read:" + r["read"] + "/rec:" + r["rec"]
                              + " L=" + r["window"].astype(str)))
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    _bands(ax, r, "curve", y="ratio")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens seen N")
    ax.set_ylabel("KL(shared) / KL(separate)")
    ax.set_title("Shared over separate precision")
    _legend(ax, r["curve"].nunique())
    return _finish(fig, path)


def plot_top1_agreement(df: pd.DataFrame, window: int | None = None, path=None):
    """Top-1 agreement with the FP32-state reference versus ``N`` (log x), per policy, with
    95% bands over documents. Needs the position columns and ``top1_agree``."""
    require_columns(df, (*POSITION_PLOT_COLUMNS, "top1_agree"), "plot_top1_agreement")
    d = _select_window(df, window)
    d = d[d["policy"] != "fp32"].assign(top1_agree=lambda x: x["top1_agree"].astype(float))
    runs = _runs(d)
    agg = kl_by_position(d, metric="top1_agree", by=(*runs, "policy", "window"))
    base = agg["policy"] + (" L=" + agg["window"].astype(str) if window is None else "")
    agg["curve"] = _label(agg, runs, base)
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    notes = _bands(ax, agg, "curve", clip=(0.0, 1.0))
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
