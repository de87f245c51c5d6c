"""``replayssm-plan``: per-head state formats that minimise state bytes under a KL budget.

    replayssm-plan --model tiny-gdn --budget 1e-4 3e-4 --at-N 1024 --max-docs 4 -o plan-gdn

Steps (docs/planner.md has the measured frontier):

1. **Decays.** Per-head mean decay on the run's documents
   (:func:`replayssm_quant.adapters.measure_head_decay`), written as ``decay.json``. With
   ``--group-size g > 1`` the heads of each layer are grouped by similar mean decay (sorted by
   decay, chunked), so a unit holds heads that forget at the same rate; every head is annotated
   with its decay in the outputs.
2. **Attribution.** Every unit (head or head group) at every candidate policy, the rest FP32,
   plus every candidate and ``--uniform`` policy on all layers, as cells of one
   ``replayssm-kl`` run (``OUT/kl``, resumable; :mod:`.attribute`). The KL "at N" of a cell is
   its mean KL over positions ``N/2 .. N-1`` (the last octave of documents of N tokens),
   finite rows, in nats.
3. **Bytes.** Per head and sequence, with ``|X|`` the real packed size of one ``V x K`` state
   matrix in format X (codes + block and matrix scales, ``quant.pack(...).nbytes``) and window L:
   bytes moved per token = (read per step + written per flush / L) =
   ``((L - 1) |R| + |A| + |A| + [separate] |R|) / L`` (non-flush steps read R; a flush reads A
   and writes A and, for ``read:F/rec:G``, R; single-checkpoint policies have R = A; ``eager:``
   has L = 1), and the stored footprint ``|A| + [separate] |R|``. The record buffer is the same
   under every policy and is left out.
4. **Plan.** Assuming contributions add (``replayssm-attribute`` measures how well), choose
   one candidate per unit minimising the summed bytes/token with summed KL <= target: an exact
   dynamic programme over KL discretised into ``--bins`` steps of target/bins, each unit's KL
   rounded *up* (so the predicted sum never exceeds the target). Candidate ``fp32`` has KL 0.
5. **Verify.** The plan's policy map runs as a fresh cell (same reference, documents, N). If
   its measured KL exceeds the budget, the target is lowered to ``target * budget / measured
   * 0.9`` and the plan redone, at most ``--max-iter`` times; the cheapest verified plan is
   kept (none: reported as failed, exit 1).
6. **Compare.** Bytes against the cheapest uniform policy (candidates and ``--uniform``, all
   measured in the same run) whose KL is at most the plan's measured KL, and against the
   cheapest uniform policy within the budget.

Outputs (``-o OUT``): ``plan-<budget>.json`` (the policy map -- usable as ``--policies``,
``state_policy(model, path)`` or lm-eval ``state=`` -- with the plan's numbers under
``meta``), ``plan.md`` and ``frontier.csv`` (uniform policies and plans: KL at N, bytes/token,
footprint), ``frontier.png``, ``attribution.csv`` (unit x candidate KL), ``decay.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path

from replayssm_quant.policy import StatePolicy
from replayssm_quant.policymap import PolicyMap

from .attribute import (_fmt_se, _runs, _span, add_run_arguments, cell_stats, check_rerun,
                        check_run_arguments, decay_json, measured_decays, run_cells, splits_layers,
                        ssm_structure, units_for)
from .kl import EXIT_BAD_ARGS, BadArgs, interrupt_exit, interrupt_on_sigterm

__all__ = ["DEFAULT_CANDIDATES", "DEFAULT_UNIFORM", "policy_bytes", "solve_plan", "plan_map",
           "main", "build_parser"]

DEFAULT_CANDIDATES = ("fp32", "shared:fp16", "shared:fp8e4m3", "read:nvfp4/rec:fp16",
                      "read:nvfp4/rec:fp8e4m3", "shared:nvfp4+sr")
DEFAULT_UNIFORM = ("shared:bf16", "read:fp8e4m3/rec:fp16", "read:nvfp4/rec:fp32",
                   "read:fp8e4m3/rec:fp8e4m3+sr", "shared:mxfp8+rceil+sr", "read:mxfp4/rec:fp16")


# ------------------------------------------------------------------------------ bytes
def matrix_nbytes(spec, V: int, K: int) -> int:
    """Real storage of one ``V x K`` state matrix in format ``spec`` (packed codes, block
    scales, matrix scale; :class:`~replayssm_quant.packed.PackedTensor` ``nbytes``)."""
    import torch

    from replayssm_quant.quant import pack

    return pack(torch.zeros(1, V, K), spec, backend="torch").nbytes


def policy_bytes(policy, V: int, K: int, window: int) -> dict:
    """Bytes of one head (one ``V x K`` matrix, one sequence) under ``policy`` (a StatePolicy
    or its string) with window L (1 for ``eager:``): ``per_token`` = ((L-1)|R| + |A| + |A| +
    [separate]|R|) / L (read per step + written per flush / L), ``footprint`` = |A| +
    [separate]|R|, ``read``/``rec`` = |R|/|A|.

    Raises:
        ValueError: a bad policy string, window < 1.
    """
    p = StatePolicy.parse(policy)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    L = 1 if p.is_eager else window
    a = matrix_nbytes(p.rec, V, K)
    r = a if p.single_checkpoint else matrix_nbytes(p.read, V, K)
    sep = not p.single_checkpoint
    return {"per_token": ((L - 1) * r + 2 * a + (r if sep else 0)) / L,
            "footprint": a + (r if sep else 0), "read": r, "rec": a}


def model_bytes(per_head: dict[int, list], dims: dict[int, tuple[int, int]], window: int) -> dict:
    """Summed :func:`policy_bytes` over every head of every layer (``per_head``: ``{layer:
    [policy per head]}``; ``dims``: ``{layer: (V, K)}``)."""
    tot = {"per_token": 0.0, "footprint": 0}
    cache: dict = {}
    for i, pols in per_head.items():
        for p in pols:
            key = (str(p), dims[i])
            if key not in cache:
                cache[key] = policy_bytes(p, *dims[i], window)
            tot["per_token"] += cache[key]["per_token"]
            tot["footprint"] += cache[key]["footprint"]
    return tot


# ------------------------------------------------------------------------------ plan
def solve_plan(costs, kls, target: float, bins: int = 2000) -> tuple[list[int], float, float]:
    """Multiple-choice knapsack: one option per unit minimising the summed cost with summed KL
    <= ``target``.

    Args:
        costs, kls: per unit, per option (``[[c, ...], ...]``, same shapes; KL >= 0, NaN or
            inf = not allowed). target: KL budget (> 0). bins: KL resolution (target / bins);
            each KL is rounded up to it, so the returned plan's KL sum is <= target exactly.

    Returns:
        ``(choice per unit, summed cost, summed KL)``.

    Raises:
        ValueError: no feasible plan (some unit has no option within the target), bad shapes
            or target.
    """
    import numpy as np

    if not (target > 0):
        raise ValueError(f"target must be > 0, got {target}")
    if len(costs) != len(kls) or any(len(c) != len(k) for c, k in zip(costs, kls)):
        raise ValueError("costs and kls must have the same shape")
    inf = math.inf
    best = np.full(bins + 1, inf)
    best[0] = 0.0
    picks = []
    for u, (cs, ks) in enumerate(zip(costs, kls)):
        new = np.full(bins + 1, inf)
        arg = np.full(bins + 1, -1, dtype=np.int64)
        for o, (c, k) in enumerate(zip(cs, ks)):
            if not (k >= 0) or not math.isfinite(k):
                continue
            w = int(math.ceil(k / target * bins - 1e-12)) if k > 0 else 0
            if w > bins:
                continue
            cand = np.full(bins + 1, inf)
            cand[w:] = best[: bins + 1 - w] + c
            better = cand < new
            new[better] = cand[better]
            arg[better] = o
        if not np.isfinite(new).any():
            raise ValueError(f"no option of unit {u} fits the KL target {target:g}")
        best = new
        picks.append(arg)
    j = int(np.argmin(best))
    choice = []
    for u in range(len(costs) - 1, -1, -1):
        o = int(picks[u][j])
        choice.append(o)
        k = kls[u][o]
        j -= int(math.ceil(k / target * bins - 1e-12)) if k > 0 else 0
    choice.reverse()
    return choice, float(sum(costs[u][o] for u, o in enumerate(choice))), \
        float(sum(kls[u][o] for u, o in enumerate(choice)))


def plan_map(per_head: dict[int, list], name: str | None = None, meta: dict | None = None) -> dict:
    """The policy-map JSON of per-head policies (``{layer: [StatePolicy per head]}``): the
    most common policy (by heads) as default, a ``layers`` rule for a layer whose heads all
    agree on another one, ``heads`` rules for runs of heads that differ from the default."""
    count = Counter(str(p) for pols in per_head.values() for p in pols)
    default = max(count, key=lambda p: (count[p], p))
    out: dict = {"default": default}
    if name:
        out["name"] = name
    layers, heads = {}, {}
    for i, pols in sorted(per_head.items()):
        texts = [str(p) for p in pols]
        if len(set(texts)) == 1:
            if texts[0] != default:
                layers[str(i)] = texts[0]
            continue
        by: dict[str, list[int]] = {}
        for h, t in enumerate(texts):
            if t != default:
                by.setdefault(t, []).append(h)
        heads[str(i)] = {_span(a, b): t for t, hs in by.items() for a, b in _runs(hs)}
    if layers:
        out["layers"] = layers
    if heads:
        out["heads"] = heads
    if meta:
        out["meta"] = meta
    return out


# ------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="replayssm-plan",
        description="Per-head read/recurrence formats minimising state bytes under a KL budget "
        "(attribution + decay statistics), verified by a fresh KL run.")
    p.add_argument("--budget", type=float, nargs="+", required=True,
                   help="KL budget(s) in nats: mean KL(P_fp32 || P_plan) over positions N/2..N-1")
    p.add_argument("--candidates", nargs="+", default=list(DEFAULT_CANDIDATES),
                   help=f"per-head policy choices (default: {' '.join(DEFAULT_CANDIDATES)}); "
                   "eager: ones only when --group-size covers whole layers")
    p.add_argument("--uniform", nargs="*", default=list(DEFAULT_UNIFORM),
                   help="further uniform policies measured for the comparison (default: "
                   f"{' '.join(DEFAULT_UNIFORM)})")
    p.add_argument("--group-size", type=int, default=1,
                   help="heads per unit, grouped by similar mean decay (default 1: every head)")
    p.add_argument("--objective", default="per_token", choices=("per_token", "footprint"),
                   help="bytes to minimise: moved per token (default) or stored per sequence")
    p.add_argument("--bins", type=int, default=2000, help="KL resolution of the plan (default 2000)")
    p.add_argument("--max-iter", type=int, default=4, help="plan/verify rounds per budget (default 4)")
    p.add_argument("--output-dir", "-o", default="plan", help="output directory (default ./plan)")
    add_run_arguments(p, n_flags=("--at-N", "--max-tokens", "-N"))
    return p


def _check(a) -> list[StatePolicy]:
    if any(not (b > 0) or not math.isfinite(b) for b in a.budget):
        raise BadArgs(f"--budget values must be finite and > 0, got {a.budget}")
    if len(set(a.budget)) != len(a.budget):
        raise BadArgs(f"--budget repeats a value: {a.budget}; give each budget once")
    check_run_arguments(a, "--at-N", 2)
    for flag, value, least in (("--group-size", a.group_size, 1), ("--bins", a.bins, 10),
                               ("--max-iter", a.max_iter, 1)):
        if value < least:
            raise BadArgs(f"{flag} must be >= {least}, got {value}")
    cands = []
    for s in a.candidates:
        try:
            cands.append(StatePolicy.parse(s))
        except ValueError as e:
            raise BadArgs(f"--candidates: {e}") from None
    if len({str(c) for c in cands}) != len(cands):
        raise BadArgs(f"--candidates repeats a policy: {a.candidates}")
    for s in a.uniform:
        try:
            StatePolicy.parse(s)
        except ValueError as e:
            raise BadArgs(f"--uniform: {e}") from None
    fp32 = StatePolicy.parse("fp32")
    return ([fp32] if fp32 not in cands else []) + cands


def _check_eager(cands, heads: dict[int, int], group_size: int) -> None:
    """Refuse ``eager:`` candidates where a unit is less than a whole layer: all heads of a
    layer share one flush schedule (``eager:`` runs with window 1, the rest with L), so an
    ``eager:`` head group beside the layer's other heads (fp32 during attribution) is a map
    the runner refuses (docs/planner.md, "One flush schedule per layer").

    Raises:
        BadArgs: naming the eager candidates and what to do instead.
    """
    eager = [str(c) for c in cands if c.is_eager]
    if eager and splits_layers(heads, group_size):
        most = max(heads.values())
        raise BadArgs(
            f"--candidates {' '.join(eager)}: eager: policies round the state after every token "
            "(window 1) and all heads of a layer share one flush schedule (docs/planner.md), so "
            "an eager: unit cannot sit beside the windowed heads of its layer, and the units here "
            f"are groups of {group_size} head(s) of layers of up to {most}; give eager: policies "
            f"to --uniform to compare them, or plan whole layers with --group-size {most}")


def run_plan(a) -> dict:
    """The whole plan of ``a`` (parsed :func:`build_parser` arguments); returns the summary
    written to ``OUT/plan.json``."""
    import pandas as pd

    cands = _check(a)
    out = Path(a.output_dir)
    N, L = a.max_tokens, a.window
    lo = N // 2
    heads, dims = ssm_structure(a.model)  # a missing model fails here, before OUT exists
    _check_eager(cands, heads, a.group_size)
    check_rerun(a, out / "kl")  # a rerun with other settings: refused before OUT is touched
    decays = measured_decays(a, "--at-N")  # a dataset too short for N fails here, before OUT
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("plan-*.json"):  # plans of an earlier invocation are not this run's
        old.unlink()
    (out / "decay.json").write_text(json.dumps(decay_json(
        decays, f"per-head mean decay over the {a.max_docs} x {N}-token documents of this plan"), indent=1))
    units = units_for(heads, "head", a.group_size, decays if a.group_size > 1 else None)
    fp32 = StatePolicy.parse("fp32")
    unit_cells = {(u.label, str(p)): u.policy_map(p) for u in units for p in cands if p != fp32}
    uniform = list(dict.fromkeys([str(p) for p in cands] + [str(StatePolicy.parse(s)) for s in a.uniform]))
    pos = run_cells(a, list(unit_cells.values()) + uniform, out / "kl")

    def kl_at_n(cell):
        return cell_stats(pos, cell, lo)

    # attribution table: unit x candidate
    rows, costs, kls = [], [], []
    for u in units:
        V, K = dims[u.layer]
        cu, ku = [], []
        for p in cands:
            b = policy_bytes(p, V, K, L)
            n = len(u.heads)
            st = {"kl_mean": 0.0, "kl_se": 0.0, "nonfinite": 0} if p == fp32 else kl_at_n(unit_cells[(u.label, str(p))])
            kl = st["kl_mean"] if st["nonfinite"] == 0 else math.inf
            cu.append(b[a.objective] * n)
            ku.append(kl)
            rows.append({"unit": u.label, "layer": u.layer, "heads": u.heads_text, "policy": str(p),
                         "kl_at_n": kl, "kl_se": st["kl_se"], "bytes_per_token": b["per_token"] * n,
                         "mean_decay": sum(decays[u.layer][h] for h in u.heads) / n})
        costs.append(cu)
        kls.append(ku)
    pd.DataFrame(rows).to_csv(out / "attribution.csv", index=False, na_rep="NaN")

    # uniform frontier
    frontier = []
    for s in uniform:
        st = kl_at_n(s)
        per_head = {i: [StatePolicy.parse(s)] * h for i, h in heads.items()}
        frontier.append({"kind": "uniform", "policy": s, "kl_at_n": st["kl_mean"], "kl_se": st["kl_se"],
                         "kl_all": cell_stats(pos, s)["kl_mean"], "nonfinite": st["nonfinite"],
                         **model_bytes(per_head, dims, L)})
    fp32_bytes = model_bytes({i: [fp32] * h for i, h in heads.items()}, dims, L)

    # plan, verify, iterate
    plans = []
    fp32_kl = kl_at_n("fp32")["kl_mean"] if "fp32" in uniform else 0.0
    for budget in a.budget:
        if budget < fp32_kl:
            raise BadArgs(f"--budget {budget:g} is below the KL of fp32 itself at N = {N} "
                          f"({fp32_kl:.3g} nats: float32 arithmetic of the emulation), which no "
                          "plan can beat; give a larger budget")
        target, tried = budget, []
        for it in range(a.max_iter):
            choice, cost, pred = solve_plan(costs, kls, target, a.bins)
            per_head = {i: [fp32] * h for i, h in heads.items()}
            for u, o in zip(units, choice):
                for h in u.heads:
                    per_head[u.layer][h] = cands[o]
            name = f"plan-{budget:g}"
            meta = {"budget": budget, "at_N": N, "target": target, "iteration": it + 1,
                    "predicted_kl_at_n": pred, "model": a.model, "window": L,
                    "documents": a.max_docs, "group_size": a.group_size}
            pm = plan_map(per_head, name, meta)
            text = str(PolicyMap.from_dict(pm))
            vpos = run_cells(a, [text], out / "kl")
            st = cell_stats(vpos, text, lo)
            measured = st["kl_mean"] if st["nonfinite"] == 0 else math.inf
            b = model_bytes(per_head, dims, L)
            tried.append({"budget": budget, "target": target, "iteration": it + 1, "predicted": pred,
                          "measured": measured, "measured_se": st["kl_se"],
                          "kl_all": cell_stats(vpos, text)["kl_mean"], "map": pm, "canonical": text,
                          "per_head": {str(i): [str(p) for p in v] for i, v in per_head.items()}, **b})
            if measured <= budget:
                break
            target = target * budget / measured * 0.9
        ok = [t for t in tried if t["measured"] <= budget]
        best = min(ok, key=lambda t: t[a.objective]) if ok else tried[-1]
        best["verified"] = bool(ok)
        best["iterations"] = len(tried)
        best["attempts"] = [{k: t[k] for k in ("target", "predicted", "measured", "per_token")} for t in tried]
        fin = [f for f in frontier if f["nonfinite"] == 0]
        eq = [f for f in fin if f["kl_at_n"] <= best["measured"]]
        wb = [f for f in fin if f["kl_at_n"] <= budget]
        obj = a.objective
        best["uniform_at_equal_kl"] = min(eq, key=lambda f: f[obj]) if eq else None
        best["uniform_within_budget"] = min(wb, key=lambda f: f[obj]) if wb else None
        for key in ("uniform_at_equal_kl", "uniform_within_budget"):
            u = best[key]
            best[f"saved_vs_{key}"] = (1 - best[obj] / u[obj]) if u else None
        best["map"]["meta"].update(measured_kl_at_n=best["measured"], verified=best["verified"],
                                   bytes_per_token=best["per_token"], footprint=best["footprint"])
        (out / f"plan-{budget:g}.json").write_text(json.dumps(best["map"], indent=1) + "\n")
        plans.append(best)

    # tables and figure
    fr = pd.DataFrame(frontier + [{"kind": "plan", "policy": f"plan-{p['budget']:g}", "kl_at_n": p["measured"],
                                   "kl_se": p["measured_se"], "kl_all": p["kl_all"], "nonfinite": 0,
                                   "per_token": p["per_token"], "footprint": p["footprint"]} for p in plans])
    fr = fr.sort_values(["kind", "per_token"]).reset_index(drop=True)
    fr.to_csv(out / "frontier.csv", index=False, na_rep="NaN")
    summary = {"model": a.model, "N": N, "documents": a.max_docs, "window": L, "seed": a.seed,
               "objective": a.objective,
               "metric": f"mean KL over positions {lo}..{N - 1} (nats)", "candidates": [str(c) for c in cands],
               "group_size": a.group_size, "fp32_bytes": fp32_bytes, "plans": plans,
               "uniform": frontier}
    (out / "plan.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "plan.md").write_text(_markdown(summary, fr))
    _figure(fr, out / "frontier.png", f"{a.model}: state bytes vs KL at N={N} ({a.max_docs} docs, L={L})",
            a.objective)
    return summary


def _markdown(s: dict, fr) -> str:
    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    lines = [f"# Precision plan: {s['model']}", "",
             f"{s['documents']} documents x N = {s['N']}, window {s['window']}, seed {s['seed']}; KL at N = "
             f"{s['metric']}; bytes/token = state bytes moved per token per sequence, footprint = "
             f"state bytes stored per sequence, all SSM heads (fp32: {s['fp32_bytes']['per_token']:.0f} "
             f"and {s['fp32_bytes']['footprint']:.0f}); minimised: {s['objective']}; "
             f"'saved' compares it; candidates per head: {', '.join(s['candidates'])}; "
             f"head groups of {s['group_size']}.", "",
             "| budget | verified | measured KL at N | predicted | bytes/token | footprint | best uniform at <= KL "
             "| its bytes | saved | best uniform within budget | saved |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in s["plans"]:
        u, w = p["uniform_at_equal_kl"], p["uniform_within_budget"]
        ucol = f"{u['policy']} ({u['kl_at_n']:.3g}) | {u[s['objective']]:.0f}" if u else "- | -"
        lines.append(f"| {p['budget']:g} | {'yes' if p['verified'] else 'NO'} ({p['iterations']} run(s)) | "
                     f"{p['measured']:.3g} | {p['predicted']:.3g} | {p['per_token']:.0f} | {p['footprint']:.0f} | "
                     f"{ucol} | {pct(p['saved_vs_uniform_at_equal_kl'])} | {w['policy'] if w else '-'} | "
                     f"{pct(p['saved_vs_uniform_within_budget'])} |")
    lines += ["", "Frontier (uniform policies and plans):", "",
              "| kind | policy | KL at N | s.e. | KL all positions | bytes/token | footprint |",
              "|---|---|---|---|---|---|---|"]
    for r in fr.itertuples():
        lines.append(f"| {r.kind} | {r.policy} | {r.kl_at_n:.3g} | {_fmt_se(r.kl_se)} | {r.kl_all:.3g} | "
                     f"{r.per_token:.0f} | {r.footprint:.0f} |")
    lines += ["", "Per-head choices (layer: policy per head):", ""]
    for p in s["plans"]:
        lines.append(f"- budget {p['budget']:g}: " + "; ".join(
            f"L{i}: " + ", ".join(v) for i, v in p["per_head"].items()))
    return "\n".join(lines) + "\n"


def _figure(fr, path: Path, title: str, objective: str = "per_token") -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    y = objective  # the bytes the plan minimised: per_token (moved) or footprint (stored)
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    is_fp32 = fr["policy"].astype(str) == "fp32"  # its KL is float32 noise (~1e-13), not a format's
    uni = fr[(fr["kind"] == "uniform") & (fr["kl_at_n"] > 0) & ~is_fp32]
    ax.scatter(uni["kl_at_n"], uni[y], color="tab:blue", label="uniform policy", zorder=3)
    for r in uni.itertuples():
        ax.annotate(r.policy, (r.kl_at_n, getattr(r, y)), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    pl = fr[fr["kind"] == "plan"].sort_values("kl_at_n")
    ax.plot(pl["kl_at_n"], pl[y], "o-", color="tab:red", label="planned map (verified KL)", zorder=4)
    fp = fr[(fr["kind"] == "uniform") & is_fp32]
    if len(fp):
        ax.axhline(float(fp[y].iloc[0]), color="grey", ls=":", lw=1, label="fp32")
    ax.set_xscale("log")
    ax.set_xlabel("mean KL at N (nats/token)")
    ax.set_ylabel("state bytes moved per token" if y == "per_token" else "state bytes stored per sequence")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    lo = np.nanmin(fr.loc[fr["kl_at_n"] > 0, "kl_at_n"]) if (fr["kl_at_n"] > 0).any() else 1e-9
    ax.set_xlim(left=lo / 3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    """``replayssm-plan``; the exit code: 0, 1 when a budget found no verified plan, 2 for bad
    input, 130 when interrupted (Ctrl-C), 143 when terminated (SIGTERM); the finished runs
    are kept either way."""
    with interrupt_on_sigterm():
        return _main(argv)


def _main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    bar_was_on = None
    if a.no_progress:  # transformers' "Loading weights" bar too, restored on return
        from transformers.utils import logging as hf_logging

        bar_was_on = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
    try:
        s = run_plan(a)
    except (BadArgs, ValueError) as e:
        print(f"replayssm-plan: error: {e}", file=sys.stderr)
        return EXIT_BAD_ARGS
    except KeyboardInterrupt as e:
        code, what = interrupt_exit(e)
        print(f"\nreplayssm-plan: {what}; the finished runs are kept under {a.output_dir}; run the "
              "same command again to resume", file=sys.stderr)
        return code
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()
    print(f"replayssm-plan: {s['model']} at N={s['N']}; output {a.output_dir}")
    print((Path(a.output_dir) / "plan.md").read_text())
    missed = [p for p in s["plans"] if not p["verified"]]
    for p in missed:
        print(f"replayssm-plan: no plan verified within budget {p['budget']:g} after "
              f"{p['iterations']} run(s) (measured {p['measured']:.4g} nats); see docs/planner.md",
              file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
