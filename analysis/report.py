"""``replayssm-report RUN_DIR... [-o report.md]``: a markdown report of one or several KL runs.

The report holds, for the given ``replayssm-kl`` output directories (issue 4 schema): the runs
and their manifests (command, model, data, commit), a whole-run summary table per (run, policy,
window) -- mean KL in nats with a 95% interval over documents, median, p90, p99, p99.9, max,
top-1 agreement, non-finite count (and per side where the run records it), the emulation path
noise of the ``--stepwise-check`` (KL(stepping || emulation) next to the policy's KL) --, mean
KL per position octave, and the figures of
:mod:`replayssm_quant.analysis.plots` (KL versus N, KL versus L, shared/separate ratio, top-1 agreement,
non-finite incidence) written as PNG (and SVG with ``--svg``) into ``<report stem>_figures/``
next to the report. Runs marked ``"synthetic": true`` in their manifest are flagged loudly.

Exit status: 0 on success, 2 on bad arguments or unreadable / invalid run directories
(message on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

from replayssm_quant.outpaths import check_distinct_dirs, output_file_problem

__all__ = ["main", "write_report", "markdown_table"]


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def _describe(v, key: str) -> str:
    """A short label for a manifest entry that may be a dict (``{"name": ...}``) or a list."""
    if isinstance(v, dict):
        v = v.get(key, v.get("name", "?"))
    if isinstance(v, (list, tuple)):
        v = "+".join(map(str, v))
    return str(v)


def _bos(manifest: dict) -> str:
    b = manifest.get("bos")
    if not isinstance(b, dict):
        return "?"  # runs before 2026-12-01 never added special tokens
    return (f"{b.get('add_bos_token', '?')} ({b.get('documents_starting_with_bos', '?')}/"
            f"{b.get('documents', '?')} docs start with BOS)")


def _path_noise_section(noise: pd.DataFrame) -> list:
    from .results import KL_NOISE_FLOOR
    lines = ["## Emulation path noise (stepping versus teacher-forced emulation)", ""]
    if noise.empty:
        return lines + ["_No stepwise check in these runs: rerun `replayssm-kl` with "
                        "`--stepwise-check K` (default 64) to measure it._", ""]
    lines += [
        "KL runs use teacher-forced emulation, which is a different float32 computation than "
        "decoding token by token: the input projections of T tokens and of 1 token differ in "
        "their last bits, and a rounding decision of the state format can then flip. On the "
        "first K positions of every cell the runner also decoded token by token; "
        "`path_kl_mean` is the mean per-position KL(P_stepping || P_emulation) of the cell "
        "(nats), `kl_mean` the policy's KL on the same positions (emulation), `kl_step_mean` the "
        "same with reference and policy both stepped, `path_to_effect` = path_kl_mean / kl_mean, "
        "`mean_rel_diff` = kl_mean / kl_step_mean - 1 (how far the emulated mean is from the "
        "decoded one), `path_kl_ref_mean` the fp32 reference's own path noise. Where "
        "`path_to_effect` is not small, per-position values of that size are path noise, not "
        "the policy; compare such cells through means over many positions (`mean_rel_diff`).",
        "",
        markdown_table(noise),
        "",
    ]
    quiet = noise[(noise["kl_mean"] < KL_NOISE_FLOOR) | (noise["kl_step_mean"] < KL_NOISE_FLOOR)]
    if len(quiet):
        lines += ["> **No policy effect above float32 noise** in the checked positions for: "
                  + ", ".join(f"`{r.policy}` L={r.window} ({r.run}: {r.kl_mean:.2g} nats emulated, "
                              f"{r.kl_step_mean:.2g} stepped)" for r in quiet.itertuples())
                  + f" (below {KL_NOISE_FLOOR:g} nats, e.g. no flush inside the first K "
                  "positions): their `path_to_effect` and `mean_rel_diff` are left empty.", ""]
    loud = noise[noise["path_to_effect"] > 0.1]
    if len(loud):
        lines += ["> **Path noise above 10% of the policy's KL** for: "
                  + ", ".join(f"`{r.policy}` L={r.window} ({r.run}: {r.path_to_effect:.0%})"
                              for r in loud.itertuples())
                  + ". Compare these cells only through means over many positions.", ""]
    return lines


def _summary_notes(summ: pd.DataFrame, clipped: int, unit: str) -> list:
    """Notes under the summary table: CI bounds clipped at 0, and the cells whose KL columns
    leave out non-finite positions (a policy that diverges on some positions would otherwise
    look better there)."""
    lines = []
    units = "documents" if unit == "doc" else "(document, seed) sequences"
    if clipped:
        lines += [f"`kl_ci_lo`: the 95% t interval over {units}; its lower bound is clipped at "
                  f"0 (KL >= 0) in {clipped} row(s), where few {units} make the interval wide.",
                  ""]
    bad = summ[summ["nonfinite"] > 0]
    if len(bad):
        multi = "run" in summ.columns and summ["run"].nunique() > 1
        cells = ", ".join((f"`{r.run}`: " if multi else "")
                          + f"`{r.policy}` L = {r.window} ({r.nonfinite} positions, "
                          f"{r.nonfinite_frac:.1%})" for r in bad.itertuples())
        lines += [f"**Non-finite logits** in {cells}: the `kl_*` columns are over the finite "
                  "positions only, so they leave out the positions where the run diverged "
                  "(`top1_agree` counts those as disagreement). Compare `nonfinite_frac` "
                  "first.", ""]
    return lines


def markdown_table(df: pd.DataFrame, max_rows: int | None = None) -> str:
    """A GitHub-flavoured markdown table of ``df`` (floats to 4 significant digits)."""
    if max_rows is not None and len(df) > max_rows:
        df = df.head(max_rows)
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *body])


def _key_dim(manifest: dict) -> int | None:
    """GDN key dimension d_k of a run's model (its config, found from the manifest's model
    name or path), None for Mamba-2 or when the config cannot be found here."""
    import json as _json

    from replayssm_quant.models import resolve_model_path

    m = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    for name in (m.get("name"), m.get("path")):
        if not name:
            continue
        try:
            cfg = _json.loads((Path(resolve_model_path(str(name))) / "config.json").read_text())
        except Exception:  # noqa: BLE001 -- a hub id or a path of another machine
            continue
        cfg = cfg.get("text_config", cfg)
        return cfg.get("linear_key_head_dim")
    return None


def _partial_note(agg: pd.DataFrame) -> str:
    """What the partial octaves of ``agg`` (:func:`~replayssm_quant.analysis.results.kl_by_position`
    rows, base 2) hold, computed from the runs: ``"`512+*` holds N = 512 only, 1 of the
    octave's 512 positions"``, one clause per distinct (first N, last N)."""
    part = agg[agg["partial"]]
    spans = sorted({(int(lo), int(hi)) for lo, hi in zip(part["n_lo"], part["n_hi"])})
    clauses = []
    for lo, hi in spans:
        k = hi - lo + 1
        held = f"N = {lo} only" if k == 1 else f"N = {lo}..{hi}"
        clauses.append(f"`{lo}+*` holds {held}, {k} of the octave's {lo} positions")
    return "; ".join(clauses)


def _main_window(df: pd.DataFrame, window: int | None) -> int | None:
    """The window of the per-N figures: the one asked, else 16 if the run has it, else the
    only one, else the largest (None if the frame has none)."""
    ws = sorted(int(w) for w in df["window"].unique())
    if window is not None:
        return window
    if not ws:
        return None
    return 16 if 16 in ws else ws[-1]


def write_report(run_dirs: Sequence, output="report.md", svg: bool = False,
                 window: int | None = None, unit: str = "doc",
                 from_buckets: bool = False) -> Path:
    """Write the markdown report for ``run_dirs`` to ``output``; returns its path.

    Args:
        window: the window L of the per-N figures (KL, top-1 agreement, RTN vs SR versus N;
            default 16 if present, else the largest); the KL-versus-L figures use every window.
        unit: confidence-interval unit: ``"doc"`` (documents) or ``"sequence"`` ((document,
            SR seed) pairs; :func:`replayssm_quant.analysis.results.kl_by_position`).
        from_buckets: read each run's ``buckets.parquet`` where it has one, even when
            ``positions.parquet`` exists (fast; no per-position percentiles;
            :func:`~replayssm_quant.analysis.results.load_runs`).
    Raises:
        FileNotFoundError / ValueError: from :func:`replayssm_quant.analysis.results.load_runs`,
            an absent window, or a run directory given twice.
    """
    from . import plots, results

    check_distinct_dirs(run_dirs)
    runs = results.load_runs(run_dirs, prefer_buckets=from_buckets)
    df = runs.positions
    main_w = _main_window(df, window)
    if window is not None and window not in set(df["window"]):
        raise ValueError(f"--window {window}: the runs hold windows {sorted(set(df['window']))}")
    out = Path(output)
    figdir = out.parent / (out.stem + "_figures")
    figdir.mkdir(parents=True, exist_ok=True)
    lines = ["# ReplaySSM state-precision KL report", ""]
    synthetic = [r for r, m in runs.manifests.items() if m.get("synthetic")]
    if synthetic or ("synthetic" in df.columns and df["synthetic"].any()):
        lines += [
            "> **SYNTHETIC DATA** in run(s) " + ", ".join(synthetic or ["?"]) + ": not a "
            "measurement (generated by `replayssm_quant.analysis.results.write_synthetic_run`).",
            "",
        ]
    lines += ["KL(P_fp32 || P_policy) per position, in nats; N = tokens seen (position + 1).",
              "Intervals are 95% Student-t intervals over "
              + ("documents." if unit == "doc" else
                 "(document, SR seed) sequences (a policy without SR counts once per "
                 "document): they cover rounding and position noise; with few documents they "
                 "do not cover document-to-document variation."), ""]
    if runs.bucket_only:
        lines += [f"Run(s) {', '.join(runs.bucket_only)} were read from `buckets.parquet` "
                  "(sums per document, cell and quarter octave; `positions.parquet` not kept): "
                  "means, intervals, agreement and incidence are exact, per-position "
                  "percentiles are not available there (`summary.csv` of the run has them per "
                  "octave).", ""]
    lines += ["## Runs", ""]
    rows = []
    for name, path in runs.paths.items():
        m = runs.manifests.get(name, {})
        sub = df[df["run"] == name]
        rows.append(
            dict(
                run=name, path=str(path), model=_describe(m.get("model", "?"), "name"),
                data=_describe(m.get("data", m.get("dataset", "?")), "dataset"),
                commit=str(m.get("git_commit", m.get("commit", "?")))[:12],
                docs=sub["doc"].nunique(), max_N=int(sub["position"].max()) + 1,
                policies=sub["policy"].nunique(), windows=sub["window"].nunique(),
                bos=_bos(m),
            )  # fmt: skip
        )
        cmd = m.get("command")
        if cmd:
            if isinstance(cmd, (list, tuple)):  # runs before 2026-12-01 logged python -m as
                cmd = ["replayssm-kl" if i == 0 and str(c) == "__main__.py" else str(c)
                       for i, c in enumerate(cmd)]  # __main__.py
            cmd = " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)
            lines.append(f"- `{name}` command: `{cmd}`")
        if isinstance(m.get("timings"), dict) and "total_s" in m["timings"]:
            lines.append(f"- `{name}` run time: {m['timings']['total_s']:.1f} s")
    lines += ["", markdown_table(pd.DataFrame(rows)), "", "## Summary per policy and window", ""]
    summ = results.summarize(df, by=("run", "policy", "window"), unit=unit)
    noise = (results.path_noise(runs.stepwise, by=("run", "policy", "window"))
             if len(runs.stepwise) else pd.DataFrame())
    if len(noise):
        summ = summ.merge(noise[["run", "policy", "window", "path_kl_mean"]],
                          on=["run", "policy", "window"], how="left")
    below = summ["kl_ci_lo"] < 0
    summ["kl_ci_lo"] = summ["kl_ci_lo"].clip(lower=0.0)  # NaN (one document) stays NaN
    lines += [markdown_table(summ), ""]
    lines += _summary_notes(summ, int(below.sum()), unit)
    if len(noise):
        lines += ["`path_kl_mean`: emulation path noise of the cell, measured on its first "
                  "positions (next section): per-position KL values of that size can come from "
                  "the float32 emulation path rather than the policy.", ""]
    lines += _path_noise_section(noise)

    lines += ["## Mean KL per position octave (nats)", ""]
    agg = results.kl_by_position(df, by=("run", "policy", "window"), unit=unit)
    label = agg["n_lo"].astype(int).astype(str) + "+" + agg["partial"].map({True: "*", False: ""})
    wide = agg.assign(N=label).pivot_table(
        index=["run", "policy", "window"], columns="N", values="mean", sort=False
    )
    wide = wide[sorted(wide.columns, key=lambda c: int(c.split("+")[0]))].reset_index()
    lines += [markdown_table(wide), ""]
    if agg["partial"].any():
        lines += ["`*`: the run ends inside this octave, so it holds fewer positions per document "
                  f"than the octave's width ({_partial_note(agg)}).", ""]

    lines += ["## Figures", ""]
    wkw = {"window": main_w} if df["window"].nunique() > 1 else {}
    wt = f" (L = {main_w})" if wkw else ""
    big = int(df["position"].max()) + 1
    figs = [
        (f"KL versus N{wt}", plots.plot_kl_vs_n, {**wkw, "unit": unit}, "kl_vs_n"),
        ("KL versus window L at N = 1024-2047", plots.plot_kl_vs_window,
         {"n": 1024, "unit": unit}, "kl_vs_window_n1024"),
        ("KL versus window L at the largest N", plots.plot_kl_vs_window, {"unit": unit},
         "kl_vs_window"),
        (f"Shared / separate KL ratio versus N{wt}", plots.plot_ratio_vs_n, wkw, "ratio_vs_n"),
        (f"RTN / SR KL ratio versus N{wt}", plots.plot_rtn_vs_sr, wkw, "rtn_vs_sr"),
        (f"Top-1 agreement versus N{wt}", plots.plot_top1_agreement, {**wkw, "unit": unit},
         "top1_agreement"),
        ("Non-finite incidence", plots.plot_nonfinite, {}, "nonfinite"),
    ]
    if big < 2048:  # the N = 1K figure would be the largest-N one
        figs = [f for f in figs if f[3] != "kl_vs_window_n1024"]
    import matplotlib.pyplot as plt

    def draw(title, make, stem_name):
        nonlocal lines
        try:
            fig = make()
        except ValueError as e:  # e.g. no separate/shared pair: say so instead of failing
            lines += [f"### {title}", "", f"_not drawn: {e}_", ""]
            return
        stem = figdir / stem_name
        written = plots.save_figure(fig, stem, ("png", "svg") if svg else ("png",))
        plt.close(fig)
        rel = written[0].relative_to(out.parent)
        lines += [f"### {title}", "", f"![{title}]({rel.as_posix()})", ""]

    for title, fn, kw, stem_name in figs:
        draw(title, lambda fn=fn, kw=kw: fn(df, **kw), stem_name)
    se = runs.state_error
    if len(se):
        lines += ["## State error versus decay", "",
                  "Per-layer, per-head relative error of the read copy against the fp32 "
                  "reference state at the run's last position (`replayssm-kl --state-error`), "
                  "against each head's per-token decay, with the driven-regime prediction "
                  "(`analysis.plots.predicted_state_error`).", ""]
        for name in sorted(se["run"].unique()):
            sub = se[se["run"] == name]
            kd = _key_dim(runs.manifests.get(name, {})) if not (sub["beta"] == 1).all() else None
            draw(f"State error versus decay: {name}",
                 lambda sub=sub, kd=kd: plots.plot_state_error_vs_decay(
                     sub, key_dim=kd, window=main_w if main_w in set(sub["window"]) else None),
                 f"state_error_vs_decay_{name}")
    out.write_text("\n".join(lines))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point ``replayssm-report``; returns the exit status (0 ok, 2 bad input)."""
    ap = argparse.ArgumentParser(
        prog="replayssm-report",
        description="Markdown report (tables and figures) of replayssm-kl output directories.",
    )
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="replayssm-kl output dirs")
    ap.add_argument("-o", "--output", default="report.md", help="report file (default report.md)")
    ap.add_argument("--svg", action="store_true", help="also write SVG figures")
    ap.add_argument("--window", type=int, default=None,
                    help="window L of the per-N figures (default 16 if present, else the largest)")
    ap.add_argument("--ci-unit", choices=("doc", "sequence"), default="doc",
                    help="confidence-interval unit: documents (default) or (document, SR seed) "
                    "sequences")
    ap.add_argument("--from-buckets", action="store_true",
                    help="read buckets.parquet where a run has it, even if positions.parquet "
                    "exists: much faster on long runs (sums per quarter octave; same bucket "
                    "means and intervals, no per-position percentiles)")
    args = ap.parse_args(argv)
    for d in args.run_dirs:
        if Path(d).exists() and not Path(d).is_dir():
            print(f"replayssm-report: error: {d!r} is a file, not a replayssm-kl output directory",
                  file=sys.stderr)
            return 2
    if Path(args.output).is_dir():
        print(f"replayssm-report: error: --output {args.output!r} is a directory; give the "
              "report's file name (e.g. report.md)", file=sys.stderr)
        return 2
    problem = output_file_problem(args.output)  # a file on the way, an unwritable directory
    if problem:
        print(f"replayssm-report: error: {problem}", file=sys.stderr)
        return 2
    try:
        path = write_report(args.run_dirs, args.output, svg=args.svg, window=args.window,
                            unit=args.ci_unit, from_buckets=args.from_buckets)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"replayssm-report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
