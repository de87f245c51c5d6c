"""``replayssm-attribute`` (issue 18, item 2) on the embedded models: outputs, ranking, one unit's
KL against a direct computation, and additivity of the contributions."""

import json
import math

import pandas as pd
import pytest
import torch

from replayssm_quant.evals.attribute import Unit, main, units_for


def test_units():
    assert [u.label for u in units_for({0: 4, 2: 3}, "layer")] == ["L0", "L2"]
    assert [u.label for u in units_for({0: 4, 2: 3}, "head", 2)] == ["L0H0-1", "L0H2-3", "L2H0-1", "L2H2"]
    f16 = __import__("replayssm_quant").StatePolicy.parse("shared:fp16")
    assert Unit(2, (1,)).policy_map(f16) == "map:fp32@L2H1=shared:fp16"
    u = Unit(2, (0, 1, 3))
    assert u.label == "L2H0-1+3" and u.policy_map(f16) == "map:fp32@L2H0-1=shared:fp16@L2H3=shared:fp16"
    by_decay = units_for({0: 4}, "head", 2, decays={0: [0.9, 0.1, 0.95, 0.2]})
    assert [u.heads for u in by_decay] == [(1, 3), (0, 2)]
    with pytest.raises(ValueError, match="group size"):
        units_for({0: 4}, "head", 0)


@pytest.mark.parametrize("model", ["tiny-gdn", "tiny-mamba2"])
def test_attribution_sums_to_the_all_layers_kl(model, tmp_path, capsys):
    """Per-layer contributions of read:nvfp4/rec:fp32 add up to the all-layers KL within 25%
    (measured at this size: sum/all = 1.09 on tiny-gdn, 1.03 on tiny-mamba2; at 4 docs x
    N = 1024: 1.021 and 0.999, docs/planner.md)."""
    out = tmp_path / "att"
    args = ["--model", model, "-N", "256", "--max-docs", "2", "--no-progress", "-o", str(out)]
    assert main(args) == 0
    s = json.loads((out / "attribution.json").read_text())
    assert 0.8 < s["additivity_ratio"] < 1.25, s["additivity_ratio"]
    df = pd.read_csv(out / "attribution.csv")
    assert list(df["rank"]) == list(range(1, len(df) + 1))
    assert df["kl_mean"].is_monotonic_decreasing and (df["kl_mean"] > 0).all()
    assert abs(df["share"].sum() - 1) < 1e-9
    assert (out / "heatmap.png").stat().st_size > 0 and "ratio sum/all" in (out / "attribution.md").read_text()
    decay = json.loads((out / "decay.json").read_text())["decays"]
    assert all(0 <= r["mean"] <= 1 for r in decay)
    # oracle for the top unit: its map run directly through the adapters, KL in float64
    from replayssm_quant.adapters import state_policy
    from replayssm_quant.evals.attribute import build_parser, token_documents
    from replayssm_quant.evals.kl.run import REFERENCE_WINDOW
    from replayssm_quant.models import load_model

    top = df.iloc[0]
    m, _ = load_model(model, tokenizer=False)
    docs = token_documents(build_parser().parse_args(args))
    kls = []
    for d, ids in enumerate(docs):
        x = torch.tensor([ids[:256]])
        logits = {}
        for pol, w in (("fp32", REFERENCE_WINDOW), (top["policy_map"], 16)):  # the runner's reference
            with state_policy(m, pol, window=w, prefill=False, sequence_ids=[d]), torch.no_grad():
                logits[pol] = m(x, use_cache=True).logits[0].double()
        lp, lq = (torch.log_softmax(logits[p], -1) for p in ("fp32", top["policy_map"]))
        kls.append((lp.exp() * (lp - lq)).sum(-1))
    direct = torch.cat(kls).mean().item()
    assert abs(direct - top["kl_mean"]) <= 1e-6 * top["kl_mean"] + 1e-12, (direct, top["kl_mean"])


def test_head_groups_sum_to_the_all_layers_kl(tmp_path):
    """Head groups of 4 on tiny-mamba2 (8 units): measured sum/all = 0.98 at this size."""
    out = tmp_path / "att"
    assert main(["--model", "tiny-mamba2", "--by", "head", "--group-size", "4", "-N", "256",
                 "--max-docs", "2", "--no-progress", "-o", str(out)]) == 0
    s = json.loads((out / "attribution.json").read_text())
    assert len(s["units"]) == 8 and 0.8 < s["additivity_ratio"] < 1.25, s["additivity_ratio"]
    assert {u["heads"] for u in s["units"]} == {"0-3", "4-7"}


def test_head_group_of_a_whole_layer_is_noted(tmp_path, capsys):
    """--group-size at least a layer's heads makes every unit a whole layer: said on stderr
    (a group of 4 on 8 heads says nothing)."""
    args = ["--model", "tiny-mamba2", "--by", "head", "-N", "16", "--max-docs", "1",
            "--no-progress"]
    assert main(args + ["--group-size", "99", "-o", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "note: --group-size 99 covers every layer's 8 heads" in err, err
    s = json.loads((tmp_path / "a" / "attribution.json").read_text())
    assert {u["heads"] for u in s["units"]} == {"0-7"}
    assert main(args + ["--group-size", "4", "-o", str(tmp_path / "b")]) == 0
    assert "--group-size" not in capsys.readouterr().err


def test_bad_arguments_exit_2(capsys, tmp_path):
    assert main(["--policy", "shared:nvfp5", "-o", str(tmp_path / "x")]) == 2
    assert "nvfp5" in capsys.readouterr().err
    assert main(["--group-size", "2", "-o", str(tmp_path / "x")]) == 2  # layers are whole units
    assert "--by head" in capsys.readouterr().err
    assert main(["--by", "head", "--group-size", "0", "-o", str(tmp_path / "x")]) == 2
    assert ("replayssm-attribute: error: --group-size must be >= 1 (heads per unit), got 0"
            in capsys.readouterr().err)
    assert main(["--window", "0", "-o", str(tmp_path / "z")]) == 2
    assert "--window" in capsys.readouterr().err and not (tmp_path / "z").exists()
    assert main(["--policy", "map:fp32@L0=shared:nvfp4", "-o", str(tmp_path / "x")]) == 2
    assert "policy map" in capsys.readouterr().err
    for flag, value in (("--seed", "-3"), ("--max-docs", "0"), ("--segment-len", "0"),
                        ("-N", "0"), ("--threads", "-1")):
        assert main([flag, value, "-o", str(tmp_path / "s")]) == 2
        err = capsys.readouterr().err  # the flag as typed (not the runner's --seeds)
        shown = "--max-tokens" if flag == "-N" else flag
        assert err.startswith(f"replayssm-attribute: error: {shown} must be >= ") and value in err
        assert not (tmp_path / "s").exists()  # refused before any runner starts
    (tmp_path / "afile").write_text("x")
    assert main(["-o", str(tmp_path / "afile")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    assert main(["--device", "gpu", "-o", str(tmp_path / "g")]) == 2
    assert "--device must be cpu, cuda or cuda:I, got 'gpu'" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()
    for pol in ("fp32", "shared:fp32", "read:fp32/rec:fp32+sr", "eager:fp32"):  # the reference
        assert main(["--policy", pol, "-o", str(tmp_path / "f")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"replayssm-attribute: error: --policy {pol!r} is the FP32-state "
                              "reference itself") and "float32 rounding noise" in err
        assert not (tmp_path / "f").exists()


def test_eager_head_groups_refused_before_any_run(tmp_path, capsys, monkeypatch):
    """eager: runs at window 1 and a layer's heads share one flush schedule, so an eager:
    head group beside FP32 heads is a map the runner refuses: attribution refuses it up front
    by the flags typed (not through a sub-run's error on a map the user never wrote)."""
    import replayssm_quant.evals.attribute as at

    def no_runs(*args, **kwargs):
        raise AssertionError("a sub-run started")

    monkeypatch.setattr(at, "run_cells", no_runs)
    assert main(["--policy", "eager:fp8e4m3", "--by", "head", "-o", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replayssm-attribute: error: --policy eager:fp8e4m3 with --by head")
    assert "--by layer" in err and "replayssm-kl exited" not in err


def _fake_cells(monkeypatch, docs):
    """Replace the runner and the decay measurement of attribution by synthetic cells
    (``docs`` documents, KL growing with the cell's index) and decays of 0.5."""
    import replayssm_quant.evals.attribute as at

    def run_cells(a, policies, out):
        return pd.DataFrame([{"policy": p, "doc": d, "position": i, "kl": (k + 1) * 1e-3 * (1 + d + i),
                              "nonfinite": False, "top1_agree": True}
                             for k, p in enumerate(policies) for d in range(docs) for i in range(4)])

    monkeypatch.setattr(at, "run_cells", run_cells)
    monkeypatch.setattr(at, "measured_decays",
                        lambda a: {i: (0.5,) * h for i, h in at.ssm_structure(a.model)[0].items()})


def test_one_document_has_no_standard_error(tmp_path, capsys, monkeypatch):
    """With --max-docs 1 the standard error over documents is undefined: ``n/a`` in the
    printed table, NaN in the CSV and JSON (never 0); with two documents it is a number."""
    _fake_cells(monkeypatch, docs=1)
    out = tmp_path / "att"
    assert main(["--max-docs", "1", "-N", "16", "--no-progress", "-o", str(out)]) == 0
    table = [ln.split("|") for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 1 |")]
    assert len(table) == 1 and table[0][6].strip() == "n/a"
    assert pd.read_csv(out / "attribution.csv")["kl_se"].isna().all()
    assert "NaN" in (out / "attribution.csv").read_text()
    s = json.loads((out / "attribution.json").read_text())
    assert all(math.isnan(u["kl_se"]) for u in s["units"]) and math.isnan(s["all_layers"]["kl_se"])
    _fake_cells(monkeypatch, docs=2)
    out2 = tmp_path / "att2"
    assert main(["--max-docs", "2", "-N", "16", "--no-progress", "-o", str(out2)]) == 0
    se = pd.read_csv(out2 / "attribution.csv")["kl_se"]
    assert (se > 0).all()  # document means (k+1)e-3 * (2.5, 3.5): s.e. (k+1)e-3 / 2
    assert sorted(se) == pytest.approx([(k + 1) * 1e-3 / 2 for k in range(len(se))])


def test_interrupted_runner_exits_130(tmp_path, monkeypatch, capsys):
    """An interrupted runner (its exit code 130: finished cells kept) makes attribution exit
    130 with the resume hint, not a bad-arguments error."""
    import replayssm_quant.evals.attribute as at

    monkeypatch.setattr(at, "kl_main", lambda argv: 130)
    assert main(["-N", "16", "--max-docs", "1", "--no-progress", "-o", str(tmp_path / "o")]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "run the same command again to resume" in err
    # a terminated runner (SIGTERM, its exit code 143): attribution exits 143 and says so
    monkeypatch.setattr(at, "kl_main", lambda argv: 143)
    assert main(["-N", "16", "--max-docs", "1", "--no-progress", "-o", str(tmp_path / "o")]) == 143
    err = capsys.readouterr().err
    assert "terminated (SIGTERM)" in err and "run the same command again to resume" in err

