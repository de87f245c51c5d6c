"""``replayssm-attribute``: where a policy's KL comes from, one layer (or head group) at a time.

For a policy P, every SSM layer -- or, with ``--by head``, every group of ``--group-size`` heads
of every layer -- is quantised alone at P while every other head keeps the FP32 state (the
policy map ``map:fp32@L<i>=P`` or ``map:fp32@L<i>H<a>-<b>=P``), and its KL(P_fp32 || P_unit)
against the FP32-state reference is measured on held-out text. All units, and P on every layer
("all"), run as cells of ONE ``replayssm-kl`` run (:func:`replayssm_quant.evals.kl.main`; its
output, resumable, is kept under ``OUT/kl``): the reference is computed once per document,
every document runs alone, SR is keyed by document, and the same positions are compared.

Outputs (``-o OUT``):

* ``attribution.csv`` / ``attribution.md``: one row per unit, ranked by mean KL: layer, heads,
  mean KL (nats, over all finite positions of all documents) with its standard error over
  documents (NaN, ``n/a`` in the markdown, with one document), share of the summed
  contributions, the heads' mean decay, the cell's policy map; the markdown adds the
  all-layers KL and the additivity ratio sum(units) / all.
* ``heatmap.png``: layer x head, colour = log10 of the unit's KL (a head group's cells share
  its value), each cell annotated with that head's mean decay (seaborn).
* ``decay.json``: per-head mean decay measured on the same documents
  (:func:`replayssm_quant.adapters.measure_head_decay`; the ``decay_stats`` format).
* ``attribution.json``: settings, the all-layers KL, the sum and the ratio, per-unit rows.

Additivity: to first order the logit perturbations of separate heads add, and KL is quadratic
in a small perturbation, so sum(units) equals KL(all) up to the cross terms (correlated errors
of different units); docs/planner.md gives the measured ratios on the embedded models.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from replayssm_quant.policy import StatePolicy

from .kl import (EXIT_BAD_ARGS, EXIT_INTERRUPTED, EXIT_TERMINATED, BadArgs, Terminated,
                 check_backend_env, check_device, check_output_dir, interrupt_exit,
                 interrupt_on_sigterm)
from .kl import main as kl_main

__all__ = ["Unit", "units_for", "kl_argv", "run_cells", "check_rerun", "cell_stats", "ssm_structure",
           "token_documents", "main", "build_parser"]


def _runs(heads) -> list[tuple[int, int]]:
    """Inclusive ``(lo, hi)`` runs of consecutive indices in sorted ``heads``."""
    out: list[list[int]] = []
    for h in sorted(heads):
        if out and h == out[-1][1] + 1:
            out[-1][1] = h
        else:
            out.append([h, h])
    return [(a, b) for a, b in out]


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


@dataclass(frozen=True)
class Unit:
    """One attributed piece: a whole layer (``heads`` None) or a set of heads of ``layer``
    (a sorted tuple; consecutive when grouped by index, any set when grouped by decay)."""

    layer: int
    heads: tuple[int, ...] | None

    @property
    def label(self) -> str:
        """``L3``, ``L3H0-3`` or ``L3H1+4+6``."""
        if self.heads is None:
            return f"L{self.layer}"
        return f"L{self.layer}H" + "+".join(_span(a, b) for a, b in _runs(self.heads))

    @property
    def heads_text(self) -> str:
        """``"0-3"`` / ``"1+4+6"`` (all heads for a layer unit: the caller knows how many)."""
        return "" if self.heads is None else "+".join(_span(a, b) for a, b in _runs(self.heads))

    def rules(self, policy: StatePolicy) -> list[str]:
        """Compact-map rules putting ``policy`` on this unit."""
        if self.heads is None:
            return [f"L{self.layer}={policy}"]
        return [f"L{self.layer}H{_span(a, b)}={policy}" for a, b in _runs(self.heads)]

    def policy_map(self, policy: StatePolicy, base: StatePolicy | None = None) -> str:
        """Compact map: ``base`` (default fp32) everywhere, ``policy`` on this unit."""
        base = base or StatePolicy.parse("fp32")
        return "@".join([f"map:{base}", *self.rules(policy)])


def units_for(ssm_heads: dict[int, int], by: str, group: int = 1, decays=None) -> list[Unit]:
    """Units of a model: one per SSM layer (``by="layer"``) or groups of ``group`` heads of
    every layer (``by="head"``; a layer's last group may be smaller): consecutive heads, or,
    with ``decays`` (``{layer: per-head mean decays}``), heads of similar mean decay (each
    layer's heads sorted by decay, then chunked).

    Raises:
        ValueError: ``by`` not layer/head, ``group`` < 1, or decays missing a layer.
    """
    if by not in ("layer", "head"):
        raise ValueError(f"by must be 'layer' or 'head', got {by!r}")
    if group < 1:
        raise ValueError(f"group size must be >= 1, got {group}")
    out = []
    for i, H in sorted(ssm_heads.items()):
        if by == "layer":
            out.append(Unit(i, None))
            continue
        order = list(range(H))
        if decays is not None:
            if i not in decays or len(decays[i]) != H:
                raise ValueError(f"decays for layer {i}: expected {H} values")
            order.sort(key=lambda h: (decays[i][h], h))
        out.extend(Unit(i, tuple(sorted(order[a: a + group]))) for a in range(0, H, group))
    return out


# ------------------------------------------------------------------------------ shared options
def add_run_arguments(p: argparse.ArgumentParser, n_flags=("--max-tokens", "-N")) -> None:
    """The options passed through to ``replayssm-kl`` (shared with ``replayssm-plan``, which
    also names N ``--at-N``)."""
    p.add_argument("--model", default="tiny-gdn",
                   help="embedded name (tiny-gdn, tiny-mamba2), local model directory or hub id "
                   "(default: tiny-gdn)")
    p.add_argument("--dataset", nargs="+", default=["kjv"], help="as replayssm-kl (default kjv)")
    p.add_argument("--split", default=None, help="corpus split (kjv: heldout)")
    p.add_argument("--max-docs", type=int, default=4, help="documents (default 4)")
    p.add_argument(*n_flags, type=int, default=1024, dest="max_tokens",
                   help="positions per document N (default 1024)")
    p.add_argument("--window", type=int, default=16, help="flush window L (default 16)")
    p.add_argument("--seed", type=int, default=0, help="SR seed (default 0)")
    p.add_argument("--segment-len", type=int, default=512, help="tokens per forward call (default 512)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                   help="model dtype (default float32)")
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda or cuda:I (default cpu)")
    p.add_argument("--threads", type=int, default=0, help="as replayssm-kl (0 = auto)")
    p.add_argument("--dt-limit", default="decode", choices=("decode", "clamp"),
                   help="Mamba-2 time_step_limit rule, as replayssm-kl (default decode: no clamp, "
                   "as transformers' decode step)")
    p.add_argument("--gdn-fold", default="recompute", choices=("recompute", "cached"),
                   help="GDN flush: re-solve corrections against the anchor (default) or fold "
                   "cached ones, as replayssm-kl")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")


def check_run_arguments(a, n_flag: str = "--max-tokens", n_least: int = 1) -> None:
    """The options :func:`add_run_arguments` adds, checked with the names the user typed
    before any runner starts (``n_flag``: this command's name for N, at least ``n_least``),
    ``REPLAYSSM_BACKEND`` against the device (:func:`~replayssm_quant.evals.kl.check_backend_env`)
    and the output directory (:func:`replayssm_quant.evals.kl.check_output_dir`).

    Raises:
        BadArgs: naming the option, its value and what is expected.
    """
    for flag, value, least in (("--max-docs", a.max_docs, 1), (n_flag, a.max_tokens, n_least),
                               ("--window", a.window, 1), ("--seed", a.seed, 0),
                               ("--segment-len", a.segment_len, 1), ("--threads", a.threads, 0)):
        if value < least:
            raise BadArgs(f"{flag} must be >= {least}, got {value}")
    check_device(a.device)
    check_backend_env(a.device)  # REPLAYSSM_BACKEND: a backend that runs on the device
    check_output_dir(a.output_dir)


def splits_layers(heads: dict[int, int], group_size: int) -> bool:
    """Whether head groups of ``group_size`` leave some layer (``heads``: layer -> head count)
    in more than one unit: then an ``eager:`` unit would sit beside windowed heads of its layer,
    which one flush schedule per layer forbids (docs/planner.md)."""
    return any(group_size < h for h in heads.values())


def kl_argv(a, policies, out: Path) -> list[str]:
    """The ``replayssm-kl`` command line of a run of ``policies`` (strings) into ``out``: one
    window, one seed, no stepwise check (the runner measures it separately when asked)."""
    argv = ["--model", a.model, "--dataset", *a.dataset, "--max-docs", str(a.max_docs),
            "--max-tokens", str(a.max_tokens), "--windows", str(a.window), "--seeds", str(a.seed),
            "--segment-len", str(a.segment_len), "--dtype", a.dtype, "--device", a.device,
            "--threads", str(a.threads), "--dt-limit", a.dt_limit, "--gdn-fold", a.gdn_fold,
            "--stepwise-check", "0", "--no-other-cells-note", "-o", str(out), "--policies",
            *policies]
    if a.split:
        argv += ["--split", a.split]
    if a.no_progress:
        argv.append("--no-progress")
    return argv


def run_cells(a, policies, out: Path):
    """Run ``policies`` (strings: policies or compact maps) as cells of one ``replayssm-kl``
    run into ``out`` (resumable; the runner's stdout goes to ``out/runner.log``) and return its
    ``positions.parquet`` as a DataFrame (``policy`` = each cell's canonical text).

    Raises:
        BadArgs: the runner refused the arguments (its message is in ``out/runner.log`` and
            on stderr) or failed.
        KeyboardInterrupt: the runner was interrupted (exit 130; :class:`Terminated` for
            SIGTERM, exit 143; its finished cells stay in ``out`` for the next run).
    """
    import pandas as pd

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "runner.log", "a") as log, contextlib.redirect_stdout(log):
        rc = kl_main(kl_argv(a, list(policies), out))
    if rc in (EXIT_INTERRUPTED, EXIT_TERMINATED):  # its finished cells are kept for the next run
        raise Terminated if rc == EXIT_TERMINATED else KeyboardInterrupt
    if rc != 0:
        raise BadArgs(f"replayssm-kl exited with {rc} (see the message above and {out / 'runner.log'})")
    return pd.read_parquet(out / "positions.parquet")


def check_rerun(a, out: Path) -> None:
    """Where ``out`` already holds a ``replayssm-kl`` run, check that this invocation's
    settings are that run's (the runner's own identity check, naming what differs), so that
    a refused rerun is refused before the caller touches anything beside it (an earlier
    plan's files stay as they were).

    Raises:
        BadArgs: the settings differ (the runner's message, then that nothing changed).
    """
    from .kl import _check_identity, _load_config, build_parser as kl_parser

    out = Path(out)
    ka = kl_parser().parse_args(kl_argv(a, ["fp32"], out))
    try:
        _check_identity(ka, _load_config(ka.model)[1])  # no identity file there: nothing to check
    except BadArgs as e:
        raise BadArgs(f"{e}; nothing in {out.parent} was changed") from None


def cell_stats(pos, policy: str, min_position: int = 0) -> dict:
    """Mean KL of one cell over its finite rows at positions >= ``min_position`` (nats), its
    standard error over documents (document means; NaN for fewer than two documents, where it
    is undefined), and counts.

    Raises:
        ValueError: the cell is not in ``pos``.
    """
    import numpy as np

    rows = pos[(pos["policy"] == policy) & (pos["position"] >= min_position)]
    if rows.empty:
        raise ValueError(f"no rows for cell {policy!r}")
    fin = rows[~rows["nonfinite"]]
    per_doc = fin.groupby("doc")["kl"].mean().to_numpy(np.float64)
    se = float(per_doc.std(ddof=1) / math.sqrt(per_doc.size)) if per_doc.size > 1 else math.nan
    return {"kl_mean": float(fin["kl"].mean()) if len(fin) else math.nan, "kl_se": se,
            "kl_p99": float(np.percentile(fin["kl"], 99)) if len(fin) else math.nan,
            "top1_agree": float(rows["top1_agree"].mean()), "positions": int(len(rows)),
            "nonfinite": int(rows["nonfinite"].sum())}


def ssm_structure(model: str) -> tuple[dict[int, int], dict[int, tuple[int, int]]]:
    """``({layer: heads}, {layer: (V, K)})`` of a model's SSM layers, from its config alone
    (a weightless copy). Raises BadArgs for a model the runner would refuse."""
    from .kl import _load_config
    from .kl.maps import ssm_layout

    _, cfg, _ = _load_config(model)
    return ssm_layout(cfg)


def token_documents(a, n_flag: str = "--max-tokens") -> list[list[int]]:
    """The token ids the KL run of ``a`` evaluates (the runner's own loading and tokenisation:
    N + 1 ids per document).

    Raises:
        BadArgs: the dataset holds no document of N + 1 tokens (the runner's message, with
            this command's name for N, ``n_flag``).
    """
    from .kl import _load_config, _load_docs, build_parser as kl_parser, check_found_documents
    from .kl.documents import load_tokenization, make_documents

    ka = kl_parser().parse_args(kl_argv(a, ["fp32"], Path("unused")))
    path, cfg, _ = _load_config(ka.model)
    vocab = cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size
    tokz = load_tokenization(path, vocab, ka.add_bos_token)
    docs = make_documents(_load_docs(ka), tokz, ka.max_tokens + 1, ka.max_docs)
    check_found_documents(docs, ka, n_flag)
    return [d["ids"] for d in docs]


def measured_decays(a, n_flag: str = "--max-tokens") -> dict[int, tuple[float, ...]]:
    """Per-head mean decay on the run's own documents (:func:`measure_head_decay`; BadArgs
    from :func:`token_documents` where there are none)."""
    import torch

    from replayssm_quant.adapters import measure_head_decay
    from replayssm_quant.models import load_model

    model, _ = load_model(a.model, dtype=getattr(torch, a.dtype), device=a.device, tokenizer=False)
    return measure_head_decay(model, token_documents(a, n_flag), dt_limit=a.dt_limit)


def decay_json(decays: dict[int, tuple[float, ...]], what: str) -> dict:
    """The ``decay_stats`` file form of per-head decays."""
    return {"what": what, "decays": [{"layer": i, "head": h, "mean": d}
                                     for i, v in sorted(decays.items()) for h, d in enumerate(v)]}


# ------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="replayssm-attribute",
        description="KL contribution of each SSM layer (or head group) under a state policy: "
        "quantise one unit at a time, the rest FP32, against the FP32-state reference.")
    p.add_argument("--policy", default="read:nvfp4/rec:fp32",
                   help="the policy to attribute (default read:nvfp4/rec:fp32)")
    p.add_argument("--by", default="layer", choices=("layer", "head"),
                   help="units: whole layers (default) or head groups")
    p.add_argument("--group-size", type=int, default=1, help="heads per unit with --by head (default 1)")
    p.add_argument("--output-dir", "-o", default="attribution",
                   help="output directory (default: ./attribution)")
    add_run_arguments(p)
    return p


def attribute(a, out: Path) -> dict:
    """Run the attribution of ``a`` (parsed :func:`build_parser` arguments) into ``out`` and
    write its tables, heatmap and decays; returns the ``attribution.json`` content."""
    import pandas as pd

    from replayssm_quant.analysis.plots import plot_attribution_heatmap

    policy = StatePolicy.parse(a.policy)
    heads, _ = ssm_structure(a.model)
    if policy.is_eager and a.by == "head" and splits_layers(heads, a.group_size):
        most = max(heads.values())
        raise BadArgs(
            f"--policy {policy} with --by head: eager: policies round the state after every "
            "token (window 1) and all heads of a layer share one flush schedule "
            "(docs/planner.md, 'One flush schedule per layer'), so an eager: head group cannot "
            f"sit beside the FP32 heads of its layer, and the units here are groups of "
            f"{a.group_size} head(s) of layers of up to {most}; attribute eager: policies "
            f"--by layer, or --by head --group-size {most}")
    units = units_for(heads, a.by, a.group_size)
    if a.by == "head" and heads and a.group_size >= max(heads.values()):
        print(f"replayssm-attribute: note: --group-size {a.group_size} covers every layer's "
              f"{max(heads.values())} heads: each unit is a whole layer (as --by layer)",
              file=sys.stderr)
    cells = {u.label: u.policy_map(policy) for u in units}
    cells["all"] = str(policy)
    pos = run_cells(a, list(cells.values()), out / "kl")
    decays = measured_decays(a)
    rows = []
    for u in units:
        st = cell_stats(pos, cells[u.label])
        hs = range(heads[u.layer]) if u.heads is None else u.heads
        d = [decays[u.layer][h] for h in hs]
        rows.append({"unit": u.label, "layer": u.layer,
                     "heads": u.heads_text or _span(0, heads[u.layer] - 1),
                     **st, "mean_decay": sum(d) / len(d), "policy_map": cells[u.label]})
    df = pd.DataFrame(rows).sort_values("kl_mean", ascending=False, kind="stable").reset_index(drop=True)
    df.insert(0, "rank", range(1, len(df) + 1))
    total = float(df["kl_mean"].sum())
    df["share"] = df["kl_mean"] / total if total > 0 else math.nan
    whole = cell_stats(pos, cells["all"])
    ratio = total / whole["kl_mean"] if whole["kl_mean"] > 0 else math.nan
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "attribution.csv", index=False, na_rep="NaN")
    (out / "decay.json").write_text(json.dumps(decay_json(
        decays, f"per-head mean decay over the {a.max_docs} x {a.max_tokens}-token documents of "
        f"this attribution (replayssm_quant.adapters.measure_head_decay)"), indent=1))
    summary = {"model": a.model, "policy": str(policy), "by": a.by, "group_size": a.group_size,
               "documents": a.max_docs, "N": a.max_tokens, "window": a.window, "seed": a.seed,
               "all_layers": whole, "sum_of_units": total, "additivity_ratio": ratio,
               "units": df.to_dict(orient="records")}
    (out / "attribution.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "attribution.md").write_text(_markdown(df, summary))
    plot_attribution_heatmap(df, decays, heads, path=out / "heatmap.png",
                             title=f"{a.model}: KL of {policy} one {'layer' if a.by == 'layer' else 'head group'} "
                                   f"at a time (N={a.max_tokens}, {a.max_docs} docs)")
    return summary


def _fmt_se(se) -> str:
    """A standard error for a table: 2 significant digits, ``n/a`` where it is undefined (NaN:
    fewer than two documents)."""
    return "n/a" if se is None or math.isnan(se) else f"{se:.2g}"


def _markdown(df, s: dict) -> str:
    lines = [f"# KL attribution: `{s['policy']}` on {s['model']}", "",
             f"{s['documents']} documents x N = {s['N']} tokens, window {s['window']}, seed {s['seed']}; "
             f"units: {s['by']}" + (f" groups of {s['group_size']}" if s["by"] == "head" else "") + ".",
             "",
             f"KL with every layer at the policy: {s['all_layers']['kl_mean']:.4g} nats/token; "
             f"sum of the units' KL: {s['sum_of_units']:.4g}; ratio sum/all = {s['additivity_ratio']:.3f}.",
             "", "| rank | unit | layer | heads | mean KL | s.e. | share | mean decay | top-1 agree |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in df.itertuples():
        lines.append(f"| {r.rank} | {r.unit} | {r.layer} | {r.heads} | {r.kl_mean:.3g} | {_fmt_se(r.kl_se)} | "
                     f"{r.share:.1%} | {r.mean_decay:.3f} | {r.top1_agree:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """``replayssm-attribute``; the exit code: 0, 2 for bad input, 130 when interrupted
    (Ctrl-C), 143 when terminated (SIGTERM); the finished runs are kept either way."""
    with interrupt_on_sigterm():
        return _main(argv)


def _main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if str(a.policy).lower().startswith("map:") or str(a.policy).endswith(".json"):
            raise BadArgs(f"--policy {a.policy!r}: attribution puts one unit at a time at a "
                          "single policy; give a policy string, not a policy map")
        pol = StatePolicy.parse(a.policy)
        if pol.read.is_identity and pol.rec.is_identity:  # fp32, and eager:fp32 (window 1)
            raise BadArgs(f"--policy {a.policy!r} is the FP32-state reference itself (it reads "
                          f"as '{pol}', which rounds no state): every unit's KL would be "
                          "float32 rounding noise, not a contribution; give a policy that "
                          "rounds the state (e.g. read:nvfp4/rec:fp32)")
        if a.group_size < 1:
            raise BadArgs(f"--group-size must be >= 1 (heads per unit), got {a.group_size}")
        if a.group_size != 1 and a.by != "head":
            raise BadArgs(f"--group-size {a.group_size} needs --by head (layers are whole units)")
        check_run_arguments(a)
        units_for({0: 1}, a.by, a.group_size)
        summary = attribute(a, Path(a.output_dir))
    except (BadArgs, ValueError) as e:
        print(f"replayssm-attribute: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except KeyboardInterrupt as e:
        code, what = interrupt_exit(e)
        print(f"\nreplayssm-attribute: {what}; the finished runs are kept under {a.output_dir}; run the "
              "same command again to resume", file=sys.stderr)
        return code
    print(f"replayssm-attribute: {summary['model']}, {summary['policy']}: all layers "
          f"{summary['all_layers']['kl_mean']:.4g} nats, sum of {len(summary['units'])} units "
          f"{summary['sum_of_units']:.4g} (ratio {summary['additivity_ratio']:.3f}); output {a.output_dir}")
    print((Path(a.output_dir) / "attribution.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
