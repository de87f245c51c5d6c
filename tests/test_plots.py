"""Plots, result loading and the report command on small synthetic frames (issue 7)."""

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from replayssm_quant.analysis import plots, report, results  # noqa: E402

POLICIES = ("fp32", "shared:nvfp4+sr", "read:nvfp4+sr/rec:fp32", "eager:fp8e4m3",
            "read:fp8e4m3/rec:fp32")  # fmt: skip


@pytest.fixture(scope="module")
def frame():
    df = results.synthetic_positions(POLICIES, windows=(1, 16), n_tokens=64, docs=3, seed=1)
    return results.validate_positions(df)


PLOTS = [
    (plots.plot_kl_vs_n, {}, ("kl",)),
    (plots.plot_kl_vs_n, {"window": 16}, ("position",)),
    (plots.plot_kl_vs_window, {}, ("window",)),
    (plots.plot_kl_vs_window, {"n": 20}, ("doc",)),
    (plots.plot_ratio_vs_n, {}, ("policy",)),
    (plots.plot_top1_agreement, {}, ("top1_agree",)),
    (plots.plot_nonfinite, {}, ("nonfinite",)),
]


@pytest.mark.parametrize("fn,kw,drop", PLOTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_plot_makes_figure_and_rejects_missing_columns(frame, fn, kw, drop, tmp_path):
    fig = fn(frame, path=tmp_path / "f.png", **kw)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert fig.axes and any(ax.has_data() for ax in fig.axes)
    assert (tmp_path / "f.png").stat().st_size > 1000
    plt.close(fig)
    with pytest.raises(ValueError, match="missing required column.*" + drop[0]):
        fn(frame.drop(columns=list(drop)), **kw)


def test_plot_values_are_the_aggregates(frame):
    """The KL-vs-N line carries the per-bucket document means (not raw positions)."""
    fig = plots.plot_kl_vs_n(frame, window=16)
    agg = results.kl_by_position(frame[(frame["window"] == 16) & (frame["policy"] != "fp32")])
    lines = fig.axes[0].get_lines()
    i = next(j for j, ln in enumerate(lines) if ln.get_label() == "shared:nvfp4+sr")
    want = agg[agg["policy"] == "shared:nvfp4+sr"].sort_values("n_mid")
    full, part = want[~want["partial"]], want[want["partial"]]
    np.testing.assert_allclose(lines[i].get_ydata(), full["mean"].to_numpy())
    if len(part):  # a bucket the run covers in part: the hollow marker drawn right after
        assert lines[i + 1].get_markerfacecolor() == "none"
        np.testing.assert_allclose(lines[i + 1].get_ydata(), part["mean"].to_numpy())
    plt.close(fig)


def test_theory_vs_simulation_plot():
    steps = np.arange(1, 11)
    sim = pd.DataFrame({"format": "bf16", "decay": 0.9, "step": steps, "state_var": steps * 1e-5,
                        "pred_state_var": steps * 1.1e-5, "cf_state_var": steps * 1e-5})  # fmt: skip
    fig = plots.plot_theory_vs_simulation(sim)
    assert len(fig.axes[0].get_lines()) == 3
    plt.close(fig)
    with pytest.raises(ValueError, match="pred_state_var"):
        plots.plot_theory_vs_simulation(sim.drop(columns="pred_state_var"))


def test_save_figure_png_and_svg(frame, tmp_path):
    fig = plots.plot_nonfinite(frame)
    paths = plots.save_figure(fig, tmp_path / "nf", ("png", "svg"))
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert paths[1].read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match="unsupported"):
        plots.save_figure(fig, tmp_path / "nf", ("gif",))
    plt.close(fig)


def test_kl_by_position_ci_against_hand_computation():
    df = pd.DataFrame({
        "doc": ["a", "a", "b", "b", "c", "c"], "position": [3, 4, 3, 5, 4, 6],
        "policy": "shared:fp16", "window": 1, "kl": [1.0, 3.0, 2.0, 2.0, 5.0, 7.0],
        "nonfinite": False,
    })  # fmt: skip
    out = results.kl_by_position(df)
    assert len(out) == 1 and out["bucket"].iloc[0] == 2  # N = 4..7 -> octave [4, 8)
    per_doc = np.array([2.0, 2.0, 6.0])
    half = 4.302652729911275 * per_doc.std(ddof=1) / np.sqrt(3)  # t_{0.975, 2}
    assert out["mean"].iloc[0] == pytest.approx(per_doc.mean())
    assert out["ci_hi"].iloc[0] == pytest.approx(per_doc.mean() + half)


def test_load_runs_validation(tmp_path, frame):
    run = results.write_synthetic_run(tmp_path / "r1", policies=POLICIES[:3], windows=(1,),
                                      n_tokens=16, docs=2)  # fmt: skip
    runs = results.load_runs([run, run])  # the same dir twice -> two distinct run names
    assert set(runs.positions["run"]) == {"r1", "r1-2"}
    assert runs.manifests["r1"]["synthetic"] is True
    with pytest.raises(FileNotFoundError):
        results.load_runs([tmp_path / "nope"])
    bad = tmp_path / "bad"
    bad.mkdir()
    frame.drop(columns=["nll"]).to_parquet(bad / "positions.parquet")
    with pytest.raises(ValueError, match="missing required column.*nll"):
        results.load_runs([bad])
    neg = frame.copy()
    neg.loc[neg.index[1], "kl"] = -0.5
    neg.to_parquet(bad / "positions.parquet")
    with pytest.raises(ValueError, match="kl below"):
        results.load_runs([bad])
    pol = frame.assign(policy="shared:fp6")
    pol.to_parquet(bad / "positions.parquet")
    with pytest.raises(ValueError, match="fp6"):
        results.load_runs([bad])


def test_shared_separate_ratio_pairs_by_read_format(frame):
    r = results.shared_separate_ratio(frame)
    assert set(r["read"]) == {"nvfp4+sr", "fp8e4m3"}
    # no shared:fp8e4m3 exists: eager:fp8e4m3 is its shared-side partner
    assert set(r.loc[r["read"] == "fp8e4m3", "window"]) == {1, 16}
    sub = r[(r["read"] == "nvfp4+sr") & (r["window"] == 16)]
    agg = results.kl_by_position(frame[frame["window"] == 16])
    m = agg.set_index(["policy", "bucket"])["mean"]
    for _, row in sub.iterrows():
        want = m[("shared:nvfp4+sr", row["bucket"])] / m[("read:nvfp4+sr/rec:fp32", row["bucket"])]
        assert row["ratio"] == pytest.approx(want)


def test_report_command(tmp_path):
    run = results.write_synthetic_run(tmp_path / "run", policies=POLICIES, windows=(1, 16),
                                      n_tokens=32, docs=2)  # fmt: skip
    out = tmp_path / "rep" / "report.md"
    out.parent.mkdir()
    assert report.main([str(run), "-o", str(out)]) == 0
    text = out.read_text()
    assert "SYNTHETIC DATA" in text and "| shared:nvfp4+sr |" not in text.split("## Summary")[0]
    assert "## Summary per policy and window" in text and "read:nvfp4+sr/rec:fp32" in text
    for name in ("kl_vs_n", "kl_vs_window", "ratio_vs_n", "top1_agreement", "nonfinite"):
        assert f"report_figures/{name}.png" in text
        assert (out.parent / "report_figures" / f"{name}.png").is_file()
    assert report.main([str(tmp_path / "missing"), "-o", str(out)]) == 2
    json.loads((run / "manifest.json").read_text())


def test_report_refuses_a_directory_output_and_names_an_unfinished_run(tmp_path, capsys):
    """``-o`` naming a directory is refused in one line; a run directory with ``parts/`` but
    no tables (an interrupted replayssm-kl run) is named as unfinished, with what to do."""
    run = results.write_synthetic_run(tmp_path / "run", policies=POLICIES[:1], windows=(1,),
                                      n_tokens=16, docs=1)  # fmt: skip
    assert report.main([str(run), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("x")  # -o below a file: named, before any work
    assert report.main([str(run), "-o", str(tmp_path / "afile" / "r.md")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--output" in err and "afile' is not a directory" in err and "_figures" not in err
    part = tmp_path / "part"
    (part / "parts").mkdir(parents=True)
    (part / "parts" / "cell-0.parquet").write_bytes(b"")
    assert report.main([str(part), "-o", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert "unfinished replayssm-kl run (1 finished cell file(s)" in err
    assert "run the same replayssm-kl command again" in err


def test_several_runs_are_separate_curves(tmp_path):
    a = results.write_synthetic_run(tmp_path / "ra", policies=POLICIES[:2], windows=(1,),
                                    n_tokens=16, docs=2, seed=1)  # fmt: skip
    b = results.write_synthetic_run(tmp_path / "rb", policies=POLICIES[:2], windows=(1,),
                                    n_tokens=16, docs=2, seed=2)  # fmt: skip
    df = results.load_runs([a, b]).positions
    fig = plots.plot_kl_vs_n(df)
    labels = {ln.get_label() for ln in fig.axes[0].get_lines() if not ln.get_label().startswith("_")}
    assert labels == {"ra: shared:nvfp4+sr L=1", "rb: shared:nvfp4+sr L=1"}
    plt.close(fig)


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    """A real ``replayssm-kl`` run (tiny random GDN model, CPU, a few seconds) with the
    stepwise check on its first 6 positions."""
    from replayssm_quant.evals.kl import main as kl_main
    from replayssm_quant.adapters.tiny import tiny_model

    root = tmp_path_factory.mktemp("klrun")
    tiny_model("qwen3_5").save_pretrained(root / "model")
    text = "In the beginning God created the heaven and the earth. " * 4
    (root / "docs.jsonl").write_text("\n".join(json.dumps({"id": f"d{i}", "text": text[i:]})
                                               for i in range(2)))
    out = root / "run"
    assert kl_main(["--model", str(root / "model"), "--dataset", str(root / "docs.jsonl"),
                    "-N", "16", "--max-docs", "2", "--windows", "4", "--stepwise-check", "6",
                    "--policies", "eager:fp8e4m3", "shared:nvfp4+sr", "-o", str(out),
                    "--no-progress"]) == 0
    return out


def _table(text: str, section: str) -> list[dict]:
    """The first markdown table after ``section`` as a list of {column: cell}."""
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    lines = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in body.splitlines()
             if ln.startswith("|")]
    return [dict(zip(lines[0], r)) for r in lines[2:]]


def test_report_shows_path_noise(kl_run, tmp_path):
    """The report's path-noise table holds the means of the run's stepwise.parquet."""
    out = tmp_path / "report.md"
    assert report.main([str(kl_run), "-o", str(out)]) == 0
    text = out.read_text()
    rows = _table(text, "## Emulation path noise")
    step = pd.read_parquet(kl_run / "stepwise.parquet")
    assert len(rows) == 2
    for got in rows:
        g = step[step["policy"] == got["policy"]]
        assert int(got["positions"]) == len(g) == 2 * 6
        for col, want in (("path_kl_mean", g["kl_path"].mean()), ("kl_mean", g["kl"].mean()),
                          ("kl_step_mean", g["kl_step"].mean())):
            assert float(got[col]) == pytest.approx(want, rel=2e-3, abs=1e-300), col
    # the summary table carries the cell's path noise next to its KL
    summ = {r["policy"]: r for r in _table(text, "## Summary per policy and window")}
    for pol, g in step.groupby("policy"):
        assert float(summ[pol]["path_kl_mean"]) == pytest.approx(g["kl_path"].mean(), rel=2e-3)


def test_report_without_stepwise_check_says_so(tmp_path):
    run = results.write_synthetic_run(tmp_path / "run", policies=POLICIES[:2], windows=(1,),
                                      n_tokens=16, docs=2)  # fmt: skip
    out = tmp_path / "report.md"
    assert report.main([str(run), "-o", str(out)]) == 0
    assert "No stepwise check in these runs" in out.read_text()


def test_nonfinite_sides_are_summarised_and_checked(frame):
    df = frame.copy()
    df["nonfinite_ref"] = False
    df["nonfinite_policy"] = df["nonfinite"]
    i = df.index[df["policy"] == "eager:fp8e4m3"][:3]
    df.loc[i, ["nonfinite", "nonfinite_ref"]] = True
    df.loc[i, "kl"] = np.nan
    s = results.summarize(results.validate_positions(df))
    row = s[(s["policy"] == "eager:fp8e4m3") & (s["window"] == df.loc[i[0], "window"])].iloc[0]
    assert row["nonfinite_ref"] == 3 and s["nonfinite_ref"].sum() == 3
    assert s["nonfinite_policy"].sum() == df["nonfinite_policy"].sum()
    bad = df.copy()
    bad.loc[bad.index[0], ["nonfinite_ref", "nonfinite"]] = [True, False]
    with pytest.raises(ValueError, match="nonfinite_ref set but nonfinite not set"):
        results.validate_positions(bad)


# ------------------------------------------------ figures a reader can trust (issue 14 list)
def _positions(policies, kl_of, docs=3, n=40, window=16):
    """A tiny positions frame: ``kl_of(policy, doc, position)``; top-1 always agrees."""
    rows = [dict(doc=f"d{d}", position=p, policy=pol, window=window, seed=0,
                 kl=kl_of(pol, d, p), top1_agree=True, nonfinite=False)
            for pol in policies for d in range(docs) for p in range(n)]
    return pd.DataFrame(rows)


def test_ratio_pairs_a_separate_policy_with_the_shared_format_of_other_rounding():
    """The default run's policies (shared:nvfp4+sr, read:nvfp4/rec:fp32) pair by format;
    the exact-rounding partner wins when both exist."""
    kl = {"shared:nvfp4+sr": 4.0, "shared:nvfp4": 3.0, "read:nvfp4/rec:fp32": 1.0}
    df = _positions(("shared:nvfp4+sr", "read:nvfp4/rec:fp32"), lambda pol, d, p: kl[pol])
    r = results.shared_separate_ratio(df)
    assert set(r["shared"]) == {"shared:nvfp4+sr"} and np.allclose(r["ratio"], 4.0)
    df2 = _positions(tuple(kl), lambda pol, d, p: kl[pol])
    r2 = results.shared_separate_ratio(df2)
    assert set(r2["shared"]) == {"shared:nvfp4"} and np.allclose(r2["ratio"], 3.0)


def test_kl_vs_n_says_where_kl_is_exactly_zero_and_marks_partial_buckets():
    """Exact zeros before the first flush are named in the caption (a log axis cannot show
    them); the last octave, which the run covers in part, is drawn hollow."""
    df = _positions(("read:nvfp4/rec:fp32",), lambda pol, d, p: 0.0 if p < 15 else 1e-3 * (1 + d))
    fig = plots.plot_kl_vs_n(df)
    text = " ".join(t.get_text() for t in fig.texts)
    assert "KL exactly 0" in text and "N <= 15" in text and "hollow" in text
    hollow = [ln for ln in fig.axes[0].lines if ln.get_markerfacecolor() == "none"]
    assert hollow and hollow[0].get_xdata()[0] > 32  # the bucket of N in [32, 40]
    plt.close(fig)


def test_top1_bands_stay_within_0_and_1():
    df = _positions(("shared:nvfp4+sr",), lambda pol, d, p: 1e-3)
    df["top1_agree"] = (np.arange(len(df)) % 3) != 0  # noisy agreement, wide CI over 3 docs
    fig = plots.plot_top1_agreement(df)
    for coll in fig.axes[0].collections:
        for path in coll.get_paths():
            y = path.vertices[:, 1]
            assert y.max() <= 1.0 + 1e-12 and y.min() >= 0.0
    plt.close(fig)


def test_nonfinite_panel_says_so_when_nothing_is_non_finite():
    df = _positions(("shared:nvfp4+sr", "eager:fp8e4m3"), lambda pol, d, p: 1e-3)
    fig = plots.plot_nonfinite(df)
    assert "no non-finite values: 6 sequences of 2 policies" in fig.axes[0].texts[0].get_text()
    plt.close(fig)
