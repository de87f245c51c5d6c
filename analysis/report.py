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
    loud = noise[noise["path_to_effect"] > 0.1]
    if len(loud):
        lines += ["> **Path noise above 10% of the policy's KL** for: "
                  + ", ".join(f"`{r.policy}` L={r.window} ({r.run}: {r.path_to_effect:.0%})"
                              for r in loud.itertuples())
                  + ". Compare these cells only through means over many positions.", ""]
    return lines


def markdown_table(df: pd.DataFrame, max_rows: int | None = None) -> str:
    """A GitHub-flavoured markdown table of ``df`` (floats to 4 significant digits)."""
    if max_rows is not None and len(df) > max_rows:
        df = df.head(max_rows)
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    sep = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *body])


def write_report(run_dirs: Sequence, output="report.md", svg: bool = False) -> Path:
    """Write the markdown report for ``run_dirs`` to ``output``; returns its path.

    Raises:
        FileNotFoundError / ValueError: from :func:`replayssm_quant.analysis.results.load_runs`.
    """
    from . import plots, results

    runs = results.load_runs(run_dirs)
    df = runs.positions
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
              "Intervals are 95% Student-t intervals over documents.", "", "## Runs", ""]  # fmt: skip
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
            cmd = " ".join(map(str, cmd)) if isinstance(cmd, (list, tuple)) else str(cmd)
            lines.append(f"- `{name}` command: `{cmd}`")
        if isinstance(m.get("timings"), dict) and "total_s" in m["timings"]:
            lines.append(f"- `{name}` run time: {m['timings']['total_s']:.1f} s")
    lines += ["", markdown_table(pd.DataFrame(rows)), "", "## Summary per policy and window", ""]
    summ = results.summarize(df, by=("run", "policy", "window"))
    noise = (results.path_noise(runs.stepwise, by=("run", "policy", "window"))
             if len(runs.stepwise) else pd.DataFrame())
    if len(noise):
        summ = summ.merge(noise[["run", "policy", "window", "path_kl_mean"]],
                          on=["run", "policy", "window"], how="left")
    lines += [markdown_table(summ), ""]
    if len(noise):
        lines += ["`path_kl_mean`: emulation path noise of the cell, measured on its first "
                  "positions (next section): per-position KL values of that size can come from "
                  "the float32 emulation path rather than the policy.", ""]
    lines += _path_noise_section(noise)

    lines += ["## Mean KL per position octave (nats)", ""]
    agg = results.kl_by_position(df, by=("run", "policy", "window"))
    label = agg["n_lo"].astype(int).astype(str) + "+" + agg["partial"].map({True: "*", False: ""})
    wide = agg.assign(N=label).pivot_table(
        index=["run", "policy", "window"], columns="N", values="mean", sort=False
    )
    wide = wide[sorted(wide.columns, key=lambda c: int(c.split("+")[0]))].reset_index()
    lines += [markdown_table(wide), ""]
    if agg["partial"].any():
        lines += ["`*`: the run ends inside this octave, so it holds fewer positions per document "
                  "than the octave's width (the last bucket of N = 1024 holds one).", ""]

    lines += ["## Figures", ""]
    figs = [
        ("KL versus N", plots.plot_kl_vs_n, {}),
        ("KL versus window L at the largest N", plots.plot_kl_vs_window, {}),
        ("Shared / separate KL ratio versus N", plots.plot_ratio_vs_n, {}),
        ("Top-1 agreement versus N", plots.plot_top1_agreement, {}),
        ("Non-finite incidence", plots.plot_nonfinite, {}),
    ]
    import matplotlib.pyplot as plt

    for title, fn, kw in figs:
        try:
            fig = fn(df, **kw)
        except ValueError as e:  # e.g. no separate/shared pair: say so instead of failing
            lines += [f"### {title}", "", f"_not drawn: {e}_", ""]
            continue
        stem = figdir / fn.__name__.removeprefix("plot_")
        written = plots.save_figure(fig, stem, ("png", "svg") if svg else ("png",))
        plt.close(fig)
        rel = written[0].relative_to(out.parent)
        lines += [f"### {title}", "", f"![{title}]({rel.as_posix()})", ""]
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
    args = ap.parse_args(argv)
    for d in args.run_dirs:
        if Path(d).exists() and not Path(d).is_dir():
            print(f"replayssm-report: error: {d!r} is a file, not a replayssm-kl output directory",
                  file=sys.stderr)
            return 2
    try:
        path = write_report(args.run_dirs, args.output, svg=args.svg)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"replayssm-report: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
