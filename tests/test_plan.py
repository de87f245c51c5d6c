"""``replayssm-plan`` (issue 18, item 3): the knapsack against brute force, byte counts against
hand-computed packed sizes, map construction, and an end-to-end plan whose budget is checked
by an independent fresh ``replayssm-kl`` run."""

import itertools
import json
import math
import random

import pandas as pd
import pytest

from replayssm_quant.evals.plan import main, plan_map, policy_bytes, solve_plan
from replayssm_quant.policy import StatePolicy
from replayssm_quant.policymap import PolicyMap

P = StatePolicy.parse


@pytest.mark.parametrize("seed", range(12))
def test_solve_plan_against_brute_force(seed):
    """Bounds from exhaustive enumeration: the plan's exact KL sum is within the target, its
    cost is no worse than the best plan within target * (1 - units / bins) (every such plan
    survives the conservative rounding), and no better than the best within the target."""
    rng = random.Random(seed)
    units, opts, bins = rng.randint(1, 5), rng.randint(1, 4), 50
    costs = [[rng.uniform(1, 10) for _ in range(opts)] + [20.0] for _ in range(units)]
    kls = [[rng.uniform(0, 1) for _ in range(opts)] + [0.0] for _ in range(units)]
    target = rng.uniform(0.2, 2.0)
    choice, cost, kl = solve_plan(costs, kls, target, bins)
    assert kl <= target + 1e-12
    assert math.isclose(cost, sum(costs[u][o] for u, o in enumerate(choice)))

    def best(limit):
        out = math.inf
        for combo in itertools.product(*(range(opts + 1) for _ in range(units))):
            if sum(kls[u][o] for u, o in enumerate(combo)) <= limit:
                out = min(out, sum(costs[u][o] for u, o in enumerate(combo)))
        return out

    assert best(target) - 1e-9 <= cost <= best(target * (1 - units / bins)) + 1e-9


def test_solve_plan_errors():
    with pytest.raises(ValueError, match="no option of unit 0"):
        solve_plan([[1.0]], [[5.0]], 1.0)
    with pytest.raises(ValueError, match="target must be > 0"):
        solve_plan([[1.0]], [[0.0]], 0.0)


def test_policy_bytes_by_hand():
    """64 x 64 matrices: nvfp4 = 2048 code bytes + 64*4 E4M3 block scales + 4 (FP32 matrix
    scale); fp8e4m3 = 4096 + 4; fp16 = 8192; fp32 = 16384; mxfp4 = 2048 + 64*2."""
    nv = policy_bytes("read:nvfp4/rec:fp16", 64, 64, 16)
    assert (nv["read"], nv["rec"]) == (2308, 8192)
    assert nv["per_token"] == (15 * 2308 + 2 * 8192 + 2308) / 16 and nv["footprint"] == 2308 + 8192
    assert policy_bytes("fp32", 64, 64, 16)["per_token"] == 17 * 16384 / 16
    assert policy_bytes("shared:fp8e4m3", 64, 64, 16)["footprint"] == 4100
    assert policy_bytes("eager:fp16", 64, 64, 16)["per_token"] == 2 * 8192  # L = 1
    assert policy_bytes("read:mxfp4+rceil/rec:fp32", 64, 64, 8)["read"] == 2048 + 128


def test_plan_map_roundtrip():
    rng = random.Random(0)
    pols = [P("fp32"), P("shared:fp16"), P("read:nvfp4/rec:fp16")]
    heads = {0: 4, 2: 8, 5: 3}
    for _ in range(20):
        per = {i: [rng.choice(pols) for _ in range(h)] for i, h in heads.items()}
        per[5] = [pols[1]] * 3  # a layer that agrees on a policy
        m = PolicyMap.from_dict(plan_map(per, "x", {"k": 1}))
        assert m.head_policies(heads) == per
        assert m.name == "x"


def test_plan_end_to_end_budget_holds_in_a_fresh_run(tmp_path, capsys):
    """tiny-mamba2, N = 128, 2 documents, head groups of 8 (grouped by decay): the plan's
    measured KL at N is within the budget, and an independent replayssm-kl run of the written
    plan file (fresh output directory) measures the same KL at N."""
    from replayssm_quant.evals.kl import main as kl_main

    out = tmp_path / "plan"
    budget = 3e-5
    rc = main(["--model", "tiny-mamba2", "--budget", str(budget), "--at-N", "128", "--max-docs", "2",
               "--group-size", "8", "--candidates", "fp32", "read:nvfp4/rec:fp16", "shared:nvfp4+sr",
               "--uniform", "shared:fp16", "--no-progress", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    s = json.loads((out / "plan.json").read_text())
    p = s["plans"][0]
    assert p["verified"] and p["measured"] <= budget
    f = out / f"plan-{budget:g}.json"
    meta = json.loads(f.read_text())["meta"]
    assert meta["measured_kl_at_n"] == p["measured"] and meta["at_N"] == 128
    # the plan is cheaper than every uniform policy it could be compared with at <= its KL
    u = p["uniform_at_equal_kl"]
    assert u is not None and p["per_token"] <= u["per_token"]
    # independent check: a fresh run of the plan file
    fresh = tmp_path / "fresh"
    assert kl_main(["--model", "tiny-mamba2", "--policies", str(f), "-N", "128", "--max-docs", "2",
                    "--stepwise-check", "0", "--no-progress", "-o", str(fresh)]) == 0
    pos = pd.read_parquet(fresh / "positions.parquet")
    kl = pos[(pos.position >= 64) & ~pos.nonfinite]["kl"].mean()
    assert kl <= budget and math.isclose(kl, p["measured"], rel_tol=1e-9)
    fr = pd.read_csv(out / "frontier.csv")
    assert {"uniform", "plan"} <= set(fr["kind"]) and (out / "frontier.png").exists()


def test_bad_arguments_exit_2(tmp_path, capsys, monkeypatch):
    # a REPLAYSSM_BACKEND that cannot run on --device cpu: one line, nothing written (it was
    # the runner's error and a second line, after decay.json; found by a new-user trial)
    monkeypatch.setenv("REPLAYSSM_BACKEND", "cuda")
    assert main(["--budget", "1e-4", "-o", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "REPLAYSSM_BACKEND='cuda' needs a CUDA device, got cpu" in err and "\n" not in err
    assert not (tmp_path / "b").exists()
    monkeypatch.delenv("REPLAYSSM_BACKEND")
    assert main(["--budget", "-1", "-o", str(tmp_path / "x")]) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["--budget", "1e-4", "--candidates", "shared:nvfp5", "-o", str(tmp_path / "x")]) == 2
    assert "nvfp5" in capsys.readouterr().err
    assert main(["--budget", "1e-4", "1e-4", "-o", str(tmp_path / "x")]) == 2
    assert "repeats" in capsys.readouterr().err
    assert main(["--model", "no-such-model", "--budget", "1e-4", "-o", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "y").exists()  # nothing written for a missing model
    (tmp_path / "afile").write_text("x")
    assert main(["--budget", "1e-4", "-o", str(tmp_path / "afile")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["--budget", "1e-4", "--seed", "-1", "-o", str(tmp_path / "y")]) == 2
    assert "--seed must be >= 0, got -1" in capsys.readouterr().err
    assert main(["--budget", "1e-4", "--at-N", "1", "-o", str(tmp_path / "y")]) == 2
    assert "--at-N must be >= 2, got 1" in capsys.readouterr().err
    for flag, value, least in (("--group-size", "0", 1), ("--bins", "9", 10), ("--max-iter", "0", 1)):
        assert main(["--budget", "1e-4", flag, value, "-o", str(tmp_path / "y")]) == 2
        assert f"{flag} must be >= {least}, got {value}" in capsys.readouterr().err
    # a bad --device is refused before the decays are measured (a traceback from
    # model.to(device) before; found by a new-user trial, 2026-12-06)
    for dev, msg in (("gpu", "--device must be cpu, cuda or cuda:I, got 'gpu'"),
                     ("meta", "--device must be cpu, cuda or cuda:I, got 'meta'")):
        assert main(["--budget", "1e-4", "--device", dev, "-o", str(tmp_path / "d")]) == 2
        assert msg in capsys.readouterr().err and not (tmp_path / "d").exists()
    short = tmp_path / "short.txt"  # shorter than N: the runner's message, N as typed here
    short.write_text("hello world\n")
    assert main(["--budget", "1e-4", "--dataset", str(short), "--at-N", "64", "--no-progress",
                 "-o", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "has fewer than 64 tokens in all; lower --at-N" in err, err
    assert not (tmp_path / "s").exists()
    import torch
    if not torch.cuda.is_available():
        assert main(["--budget", "1e-4", "--device", "cuda", "-o", str(tmp_path / "d")]) == 2
        assert "--device cuda: CUDA is not available" in capsys.readouterr().err


@pytest.mark.slow
def test_plan_tiny_gdn_budget_holds(tmp_path):
    """The same on tiny-gdn at N = 256 with the default candidates, every head its own unit."""
    out = tmp_path / "plan"
    assert main(["--model", "tiny-gdn", "--budget", "1e-4", "--at-N", "256", "--max-docs", "2",
                 "--uniform", "--no-progress", "-o", str(out)]) == 0
    p = json.loads((out / "plan.json").read_text())["plans"][0]
    assert p["verified"] and p["measured"] <= 1e-4


def test_eager_candidates_are_refused_up_front(tmp_path, capsys):
    """An eager: candidate on units smaller than a layer would make a map mixing eager and
    windowed heads of one layer, which the runner refuses mid-run: the planner refuses it
    before any run, naming the candidate and what to do (exit 2, nothing written)."""
    out = tmp_path / "p"
    assert main(["--model", "tiny-gdn", "--budget", "1e-4", "--at-N", "16", "--max-docs", "1",
                 "--candidates", "eager:fp16", "shared:fp16", "--uniform", "--no-progress",
                 "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replayssm-plan: error: --candidates eager:fp16: eager: policies round "
                          "the state after every token")
    assert "--uniform" in err and "--group-size 4" in err and "map:" not in err
    assert not out.exists()


def _fake_plan_cells(monkeypatch, seen=None):
    """Replace the plan's runner and decay measurement by synthetic one-document cells (KL
    1e-6 for every cell but fp32, 0 there); ``seen`` collects whether transformers' progress
    bar was on when the decays were measured."""
    import replayssm_quant.evals.plan as pl
    from transformers.utils import logging as hf_logging

    def run_cells(a, policies, out):
        return pd.DataFrame([{"policy": p, "doc": 0, "position": i, "kl": 0.0 if p == "fp32" else 1e-6,
                              "nonfinite": False, "top1_agree": True}
                             for p in policies for i in range(a.max_tokens)])

    def decays(a, n_flag="--max-tokens"):
        if seen is not None:
            seen.append(hf_logging.is_progress_bar_enabled())
        return {i: (0.5,) * h for i, h in pl.ssm_structure(a.model)[0].items()}

    monkeypatch.setattr(pl, "run_cells", run_cells)
    monkeypatch.setattr(pl, "measured_decays", decays)


def test_one_document_has_no_standard_error(tmp_path, capsys, monkeypatch):
    """--max-docs 1: the frontier's s.e. column says n/a (undefined from one document) and the
    CSV and JSON carry NaN, never 0."""
    _fake_plan_cells(monkeypatch)
    out = tmp_path / "p"
    assert main(["--model", "tiny-mamba2", "--budget", "1e-4", "--at-N", "8", "--max-docs", "1",
                 "--group-size", "8", "--candidates", "shared:fp16", "--uniform", "--no-progress",
                 "-o", str(out)]) == 0
    rows = [ln.split("|") for ln in capsys.readouterr().out.splitlines()
            if ln.startswith(("| uniform |", "| plan |"))]
    assert len(rows) == 3 and {r[4].strip() for r in rows} == {"n/a"}
    assert pd.read_csv(out / "frontier.csv")["kl_se"].isna().all()
    s = json.loads((out / "plan.json").read_text())
    assert math.isnan(s["plans"][0]["measured_se"]) and all(math.isnan(u["kl_se"]) for u in s["uniform"])


def test_no_progress_silences_the_weight_loading_bar(tmp_path, monkeypatch):
    """--no-progress turns transformers' progress bars (the "Loading weights" bar) off while
    the plan runs and back on afterwards; without it they stay as they were."""
    from transformers.utils import logging as hf_logging

    seen: list = []
    _fake_plan_cells(monkeypatch, seen)
    was_on = hf_logging.is_progress_bar_enabled()
    args = ["--model", "tiny-mamba2", "--budget", "1e-4", "--at-N", "8", "--max-docs", "1",
            "--group-size", "8", "--candidates", "shared:fp16", "--uniform"]
    try:
        hf_logging.enable_progress_bar()
        assert main([*args, "--no-progress", "-o", str(tmp_path / "a")]) == 0
        assert seen == [False] and hf_logging.is_progress_bar_enabled()
        assert main([*args, "-o", str(tmp_path / "b")]) == 0
        assert seen == [False, True] and hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # off before: stays off
        assert main([*args, "--no-progress", "-o", str(tmp_path / "c")]) == 0
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        (hf_logging.enable_progress_bar if was_on else hf_logging.disable_progress_bar)()


def test_refused_rerun_leaves_the_earlier_plan_untouched(tmp_path, capsys):
    """A rerun into the same folder with another --at-N is refused by the runner's identity
    check before anything is written: the earlier plan file, decay.json and plan.json stay
    byte for byte (a new-user trial lost its plan-*.json and got a decay.json of the refused
    settings beside a plan.json of the old ones)."""
    out = tmp_path / "plan"
    args = ["--model", "tiny-mamba2", "--budget", "1e-4", "--max-docs", "1", "--group-size", "8",
            "--candidates", "shared:fp16", "--uniform", "--no-progress", "-o", str(out)]
    assert main([*args, "--at-N", "16"]) in (0, 1), capsys.readouterr().err
    # its verification cells run into the same runner folder as the attribution cells: the
    # runner's note on other cells' parts is for replayssm-kl users, not repeated here
    assert "not asked for by this command" not in capsys.readouterr().err
    files = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    assert "plan-0.0001.json" in files and "decay.json" in files
    assert main([*args, "--at-N", "8"]) == 2
    err = capsys.readouterr().err
    assert "holds a run with other settings" in err and "--max-tokens" in err
    assert "nothing in" in err and "was changed" in err
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == files
