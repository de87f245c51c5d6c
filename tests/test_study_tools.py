"""Tools the issue-14 study added to the runner and the report, each against an oracle.

* shared cells: an ``eager:`` cell at any L and an RTN cell at any seed are computed once; a
  run of that cell alone gives the same bits (so sharing is exact);
* the fp32 reference is the same whatever ``--windows`` holds (a cell's rows do not depend on
  the other cells of the run);
* ``--state-error``: the state the runner compares against is the one the adapters give when
  this test decodes the document itself, and the read copy's error is the format's cast
  error (``replayssm_quant.quantize``) of that state;
* ``LayerState.input_stats``: float64 means of the decays fed in;
* ``buckets.parquet``: every mean, interval, agreement and count of the report equals the one
  computed from ``positions.parquet``;
* ``rtn_sr_ratio`` and ``predicted_state_error`` against hand-computed values;
* ``replayssm-bin-by-length --length context``.
"""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

import replayssm_quant.adapters as adapters
import replayssm_quant.adapters.segments as segments
from replayssm_quant import quantize
from replayssm_quant.adapters.state import LayerState
from replayssm_quant.analysis import results as R
from replayssm_quant.analysis import theory
from replayssm_quant.analysis.plots import predicted_state_error
from replayssm_quant.config import StateConfig
from replayssm_quant.evals.kl import main
from replayssm_quant.evals.kl.metrics import bucket_sums, quarter_bucket


def _run(model_dir, data_file, out, *extra, policies=("eager:fp8e4m3", "shared:nvfp4")):
    args = ["--model", model_dir, "--dataset", data_file, "-N", "32", "--segment-len", "16",
            "--max-docs", "2", "--stepwise-check", "0", "--policies", *policies, "-o", str(out),
            "--no-progress", *extra]
    assert main(args) == 0
    return pd.read_parquet(out / "positions.parquet")


def _cell(df, policy, window, seed):
    g = df[(df.policy == policy) & (df.window == window) & (df.seed == seed)]
    return g.drop(columns=["policy", "window", "seed"]).sort_values(["doc", "position"]) \
        .reset_index(drop=True)


def test_shared_cells_equal_cells_run_alone(model_dir, data_file, tmp_path):
    both = _run(model_dir, data_file, tmp_path / "a", "--windows", "4", "16", "--seeds", "0", "1",
                policies=("eager:fp8e4m3", "shared:nvfp4", "shared:nvfp4+sr"))
    m = json.loads((tmp_path / "a" / "manifest.json").read_text())
    shared = m["shared_cells"]
    assert shared["eager:fp8e4m3 L=16 seed=1"] == "eager:fp8e4m3 L=1 seed=0"
    assert shared["shared:nvfp4 L=16 seed=1"] == "shared:nvfp4 L=16 seed=0"
    assert not any(k.startswith("shared:nvfp4+sr") for k in shared)  # SR seeds differ
    alone = _run(model_dir, data_file, tmp_path / "b", "--windows", "16", "--seeds", "1",
                 policies=("eager:fp8e4m3", "shared:nvfp4"))
    for pol in ("eager:fp8e4m3", "shared:nvfp4"):
        pd.testing.assert_frame_equal(_cell(both, pol, 16, 1), _cell(alone, pol, 16, 1))
    a, b = _cell(both, "shared:nvfp4+sr", 16, 0), _cell(both, "shared:nvfp4+sr", 16, 1)
    assert not np.array_equal(a["kl"].to_numpy(), b["kl"].to_numpy())


def test_reference_does_not_depend_on_other_windows(model_dir, data_file, tmp_path):
    one = _run(model_dir, data_file, tmp_path / "one", "--windows", "4",
               policies=("shared:nvfp4+sr", "fp32"))
    two = _run(model_dir, data_file, tmp_path / "two", "--windows", "16", "4",
               policies=("shared:nvfp4+sr", "fp32"))
    for pol in ("shared:nvfp4+sr", "fp32"):
        pd.testing.assert_frame_equal(_cell(one, pol, 4, 0), _cell(two, pol, 4, 0))
    # the fp32 policy at L = 1 is the reference itself
    ref = _run(model_dir, data_file, tmp_path / "ref", "--windows", "1", policies=("fp32",))
    assert (ref["kl"] == 0).all()


def _states_after(model, ids, policy, window):
    """{layer: LayerState} after decoding ``ids [1, T]`` in one call under ``policy``."""
    with adapters.state_policy(model, policy, window=window, seed=0, prefill=False,
                               sequence_ids=[0]) as h, torch.no_grad():
        h.track_input_stats = True
        _, cache = segments.forward_segment(model, ids)
        return h.states(cache)


def test_state_error_against_adapters_and_quantize(model_dir, data_file, tmp_path):
    out = tmp_path / "se"
    _run(model_dir, data_file, out, "--windows", "4", "--state-error",
         policies=("read:nvfp4/rec:fp32", "shared:nvfp4"))
    se = pd.read_parquet(out / "state_error.parquet")
    assert sorted(se["position"].unique()) == [16, 32]  # powers of two and N
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    # the runner's first document, as the runner tokenised it (spy-free: its manifest)
    from replayssm_quant.evals.kl.documents import load_tokenization, make_documents
    from replayssm_quant.evals.kl import _load_config, _load_docs, build_parser

    a = build_parser().parse_args(["--model", model_dir, "--dataset", data_file, "-N", "32"])
    cfg_path, cfg, _ = _load_config(a.model)
    tokz = load_tokenization(cfg_path, cfg.vocab_size, "auto")
    doc = make_documents(_load_docs(a), tokz, 33, 1)[0]
    ids = torch.tensor([doc["ids"][:32]])
    ref = _states_after(model, ids, "fp32", 1)
    sep = _states_after(model, ids, "read:nvfp4/rec:fp32", 4)
    rows = se[(se["doc"] == doc["id"]) & (se["position"] == 32)
              & (se["policy"] == "read:nvfp4/rec:fp32")]
    first = min(ref)
    S = ref[first].anchor.double()[0]
    cast = quantize(sep[first].anchor, "nvfp4").double()[0]  # the read copy: the anchor's cast
    want = ((cast - S).flatten(1).norm(dim=1) / S.flatten(1).norm(dim=1)).numpy()
    got = rows[rows["layer"] == first].sort_values("head")
    np.testing.assert_allclose(got["err_read"].to_numpy(), want, rtol=1e-4)
    # the first layer's anchor sees the reference's inputs: fp32 recurrence, float32 noise only
    assert got["err_anchor"].max() < 1e-5
    stats = ref[first].input_stats()
    np.testing.assert_allclose(got["decay"].to_numpy(), stats["decay"][0].numpy(), rtol=1e-12)


def test_input_stats_are_float64_means_of_the_decays():
    torch.manual_seed(0)
    B, H, HK, DK, DV, T = 2, 4, 2, 8, 8, 11
    st = LayerState(torch.zeros(B, H, DV, DK), family="gdn",
                    config=StateConfig.build("shared:nvfp4", window=4), layer=0,
                    sequence_ids=torch.arange(B), track_stats=True)
    g = -torch.rand(B, T, H) * 0.5
    beta = torch.rand(B, T, H)
    unit = torch.nn.functional.normalize(torch.randn(B, T, HK, DK), dim=-1)
    inp = dict(q=unit, k=unit, v=torch.randn(B, T, H, DV), g=g, beta=beta)
    st.advance({k: v[:, :7] for k, v in inp.items()})
    st.step({k: v[:, 7:8] for k, v in inp.items()})
    st.advance({k: v[:, 8:] for k, v in inp.items()})
    s = st.input_stats()
    assert s["tokens"] == T
    np.testing.assert_allclose(s["decay"].numpy(), g.double().exp().mean(1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(s["log_decay"].numpy(), g.double().mean(1).numpy(), rtol=1e-12)
    np.testing.assert_allclose(s["beta"].numpy(), beta.double().mean(1).numpy(), rtol=1e-12)
    st.select_rows(torch.tensor([1, 1]))
    assert torch.equal(st.input_stats()["decay"][0], s["decay"][1])
    off = LayerState(torch.zeros(B, H, DV, DK), family="gdn",
                     config=StateConfig.build("shared:nvfp4", window=4), layer=0,
                     sequence_ids=torch.arange(B))  # not tracked: NaN, no work per call
    off.advance({k: v[:, :7] for k, v in inp.items()})
    assert off.input_stats()["tokens"] == 0 and off.input_stats()["decay"].isnan().all()


def test_quarter_buckets_are_exact():
    pos = np.arange(0, 300000)
    q = quarter_bucket(pos)
    n = pos + 1
    assert (2.0 ** (q / 4) <= n).all() and (n < 2.0 ** ((q + 1) / 4)).all()
    assert np.array_equal(q // 4, np.frexp(n.astype(float))[1] - 1)  # octaves


def _synthetic_positions(rng):
    rows, rows_rtn = [], {}
    for doc in ("a", "b", "c"):
        for pol, sr in (("shared:nvfp4", False), ("shared:nvfp4+sr", True)):
            for seed in (0, 1):
                kl = rng.gamma(0.5, 1e-3, size=200) * (1.0 if sr else 0.5)
                if not sr and seed == 1:  # RTN: the same bits for every seed
                    kl = rows_rtn[doc]
                if not sr and seed == 0:
                    rows_rtn[doc] = kl
                nf = np.zeros(200, bool)
                if doc == "b" and sr:
                    nf[150:160] = True
                rows.append(pd.DataFrame({
                    "doc": doc, "position": np.arange(200), "policy": pol, "window": 16,
                    "seed": seed, "kl": np.where(nf, np.nan, kl),
                    "top1_agree": rng.random(200) > 0.1, "dp_ref": 0.0, "nll_ref": 1.0,
                    "nll": 1.0, "nonfinite": nf, "nonfinite_ref": False,
                    "nonfinite_policy": nf}))
    return pd.concat(rows, ignore_index=True)


@pytest.mark.parametrize("unit", ["doc", "sequence"])
def test_buckets_give_the_positions_statistics(unit):
    pos = R.validate_positions(_synthetic_positions(np.random.default_rng(1)))
    pb = R.validate_positions(R.positions_from_buckets(bucket_sums(pos)))
    for metric in ("kl", "top1_agree"):
        a = R.kl_by_position(pos.assign(top1_agree=pos["top1_agree"].astype(float)),
                             metric=metric, unit=unit)
        b = R.kl_by_position(pb, metric=metric, unit=unit)
        for c in ("mean", "ci_lo", "ci_hi"):
            np.testing.assert_allclose(a[c], b[c], rtol=1e-12, atol=1e-18)
        for c in ("docs", "count", "nonfinite", "bucket", "partial"):
            assert (a[c].to_numpy() == b[c].to_numpy()).all(), c
    sa, sb = R.summarize(pos, unit=unit), R.summarize(pb, unit=unit)
    for c in ("kl_mean", "kl_ci_lo", "kl_ci_hi", "kl_max", "top1_agree", "nonfinite_frac"):
        np.testing.assert_allclose(sa[c], sb[c], rtol=1e-12)
    assert (sa["positions"] == sb["positions"]).all() and (sa["nonfinite"] == sb["nonfinite"]).all()
    assert sb["kl_p99"].isna().all()  # percentiles are not kept in buckets


def test_sequence_unit_counts_rtn_once_per_document():
    pos = R.validate_positions(_synthetic_positions(np.random.default_rng(2)))
    agg = R.kl_by_position(pos, unit="sequence")
    assert set(agg.loc[agg.policy == "shared:nvfp4", "docs"]) == {3}
    assert set(agg.loc[agg.policy == "shared:nvfp4+sr", "docs"]) == {6}
    with pytest.raises(ValueError, match="unit"):
        R.kl_by_position(pos, unit="seed")


def test_rtn_sr_ratio_is_the_ratio_of_bucket_means():
    pos = R.validate_positions(_synthetic_positions(np.random.default_rng(3)))
    r = R.rtn_sr_ratio(pos)
    agg = R.kl_by_position(pos)
    for row in r.itertuples():
        sr = agg[(agg.policy == "shared:nvfp4+sr") & (agg.bucket == row.bucket)]["mean"].item()
        rtn = agg[(agg.policy == "shared:nvfp4") & (agg.bucket == row.bucket)]["mean"].item()
        assert row.ratio == pytest.approx(rtn / sr, rel=1e-12)
    assert R.rtn_sr_ratio(pos[pos.policy == "shared:nvfp4"]).empty


def test_ratios_are_empty_below_the_noise_floor():
    """A bucket whose mean KL is float32 noise (below KL_NOISE_FLOOR) has no meaningful ratio
    to another: rtn_sr_ratio and shared_separate_ratio leave it NaN there and keep the others;
    path_noise leaves path_to_effect and mean_rel_diff NaN for a cell with no effect."""
    pos = R.validate_positions(_synthetic_positions(np.random.default_rng(4)))
    early = pos["position"] < 8  # buckets 0..3: the first 8 positions
    pos.loc[early & (pos.policy == "shared:nvfp4"), "kl"] = 1e-13
    r = R.rtn_sr_ratio(pos)
    assert r.loc[r.n_mid < 8, "ratio"].isna().all() and len(r.loc[r.n_mid < 8])
    assert r.loc[r.n_mid >= 8, "ratio"].notna().all() and len(r.loc[r.n_mid >= 8])
    sep = pos[pos.policy == "shared:nvfp4+sr"].assign(policy="read:nvfp4/rec:fp16")
    sh = R.shared_separate_ratio(pd.concat([pos[pos.policy == "shared:nvfp4"], sep]))
    assert sh.loc[sh.n_mid < 8, "ratio"].isna().all() and sh.loc[sh.n_mid >= 8, "ratio"].notna().all()
    step = pd.DataFrame({"doc": "a", "position": np.arange(4), "policy": ["p"] * 2 + ["q"] * 2,
                         "window": 16, "seed": 0, "kl": [1e-13, 1e-13, 1e-3, 1e-3],
                         "kl_step": [1e-13, 2e-13, 1e-3, 2e-3], "kl_path": 1e-12,
                         "kl_path_ref": 1e-12, "top1_path_agree": True, "nonfinite": False})
    noise = R.path_noise(step).set_index("policy")
    assert np.isnan(noise.loc["p", "path_to_effect"]) and np.isnan(noise.loc["p", "mean_rel_diff"])
    assert noise.loc["q", "path_to_effect"] == pytest.approx(1e-9)
    assert noise.loc["q", "mean_rel_diff"] == pytest.approx(1e-3 / 1.5e-3 - 1)


def test_report_notes_cells_without_effect_and_plots_say_why():
    """The report's path-noise section lists a cell whose checked positions show no effect
    (instead of flagging its path noise as 270 % of an effect of 1e-13 nats), flags a real
    one, and a ratio figure whose every pair is below the floor names that reason."""
    from replayssm_quant.analysis import plots
    from replayssm_quant.analysis.report import _path_noise_section

    noise = pd.DataFrame({"run": "r", "policy": ["p", "q"], "window": 16,
                          "path_kl_mean": [3e-13, 5e-4], "kl_mean": [1e-13, 1e-3],
                          "kl_step_mean": [1e-13, 1e-3], "path_to_effect": [np.nan, 0.5],
                          "mean_rel_diff": [np.nan, 0.0]})
    text = "\n".join(_path_noise_section(noise))
    assert "No policy effect above float32 noise** in the checked positions for: `p` L=16" in text
    assert "Path noise above 10% of the policy's KL** for: `q` L=16 (r: 50%)" in text
    pos = R.validate_positions(_synthetic_positions(np.random.default_rng(5)))
    pos["kl"] = np.where(pos["nonfinite"], np.nan, 1e-12)
    with pytest.raises(ValueError, match="every paired bucket's mean KL is below 1e-09"):
        plots.plot_rtn_vs_sr(pos)


def test_report_reads_a_run_kept_as_buckets(tmp_path):
    pos = _synthetic_positions(np.random.default_rng(4))
    full, slim = tmp_path / "full", tmp_path / "slim"
    for d in (full, slim):
        d.mkdir()
    pos.to_parquet(full / "positions.parquet")
    bucket_sums(pos).to_parquet(slim / "buckets.parquet")
    a = R.kl_by_position(R.load_runs([full]).positions)
    runs = R.load_runs([slim])
    assert runs.bucket_only == ("slim",)
    np.testing.assert_allclose(a["mean"], R.kl_by_position(runs.positions)["mean"], rtol=1e-12)
    from replayssm_quant.analysis import report

    assert report.main([str(slim), "-o", str(tmp_path / "r" / "report.md"), "--ci-unit",
                        "sequence"]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "buckets.parquet" in text and "RTN / SR" in text
    assert (tmp_path / "r" / "report_figures" / "rtn_vs_sr.png").exists()


def test_predicted_state_error_is_the_driven_closed_form():
    x = np.random.default_rng(0).standard_normal((64, 16, 64))
    rho = theory.driven_sigma2(x, "nvfp4")[1]["rho"]
    la = np.log(np.array([0.5, 0.9, 0.999]))
    got = predicted_state_error(la, np.ones(3), "nvfp4", 4)
    np.testing.assert_allclose(got, np.sqrt(rho / (1 - np.exp(la) ** 8)), rtol=1e-12)
    a_rms = theory.gdn_effective_decay(np.exp(la), np.full(3, 0.5), 64)[1]
    got = predicted_state_error(la, np.full(3, 0.5), "nvfp4", 4, key_dim=64)
    np.testing.assert_allclose(got, np.sqrt(rho / (1 - a_rms ** 8)), rtol=1e-12)
    assert got[-1] > got[0]  # slow heads accumulate more


def test_bin_by_length_context(tmp_path):
    from replayssm_quant.evals.bin_by_length import bin_by_length, load_samples

    d = tmp_path / "run"
    d.mkdir()
    recs = [{"doc_id": i, "arguments": {"gen_args_0": {"arg_0": "w " * n, "arg_1": " x"}},
             "resps": [[["-1.0", "False"]]], "metrics": ["acc"], "acc": float(i % 2)}
            for i, n in enumerate((3, 5, 40, 41))]
    (d / "samples_task_2026.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    df = load_samples([d], length="context")
    assert df["gen_len"].tolist() == [3, 5, 40, 41]
    assert load_samples([d]).empty  # no generated text: nothing to bin by response
    t = bin_by_length(df, [0, 10, 100])
    assert t["n"].tolist() == [2, 2] and t["mean"].tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="length"):
        load_samples([d], length="prompt")
    assert math.isclose(t["sem"].iloc[0], 0.5)


def _samples(d, label_state, recs):
    d.mkdir(parents=True)
    (d / "results_x.json").write_text(json.dumps({"config": {"replayssm_state": label_state,
                                                             "replayssm_window": 16}}))
    (d / "samples_kjv_longctx_ppl_2026.jsonl").write_text("\n".join(json.dumps(r) for r in recs))


def test_bin_by_length_pairs_against_a_baseline(tmp_path):
    from replayssm_quant.evals.bin_by_length import bin_by_length, load_samples

    def recs(shift):
        return [{"doc_id": i, "doc_hash": f"h{i}", "arguments": {"gen_args_0": {"arg_0": "w " * n}},
                 "resps": [[-1.0]], "metrics": ["word_perplexity", "bits_per_byte"],
                 "word_perplexity": [-(2.0 + i + shift) * n, n], "bits_per_byte": [-0.5 * n, n]}
                for i, n in enumerate((10, 20, 30))]

    _samples(tmp_path / "a", "fp32", recs(0.0))
    _samples(tmp_path / "b", "shared:nvfp4", recs(0.25))
    df = load_samples([tmp_path / "a", tmp_path / "b"], length="context")
    wp = df[df.metric == "nll_per_word"]
    # a (log-likelihood, words) pair becomes nats per word; bits_per_byte in bits
    assert sorted(wp[wp.run == "fp32 L=16"]["value"]) == [2.0, 3.0, 4.0]
    assert df[df.metric == "bits_per_byte"]["value"].tolist() == pytest.approx([0.5 / math.log(2)] * 6)
    t = bin_by_length(df, [0, 100], baseline="fp32 L=16")
    row = t[(t.run == "shared:nvfp4 L=16") & (t.metric == "nll_per_word")].iloc[0]
    assert row["n_paired"] == 3 and row["delta_mean"] == pytest.approx(0.25)
    assert row["delta_sem"] == pytest.approx(0.0, abs=1e-12)  # the same shift on every item
    assert (t[t.run == "fp32 L=16"]["delta_mean"] == 0).all()
    with pytest.raises(ValueError, match="baseline"):
        bin_by_length(df, [0, 100], baseline="bf16")


def test_bin_by_length_response_counts_generations_only(tmp_path):
    from replayssm_quant.evals.bin_by_length import load_samples

    d = tmp_path / "run"
    d.mkdir()
    gen = {"doc_id": 0, "arguments": {"gen_args_0": {"arg_0": "ctx", "arg_1": {"until": ["\n"]}}},
           "resps": [["a b c"]], "metrics": ["first_word"], "first_word": 1.0}
    rolling = {"doc_id": 1, "arguments": {"gen_args_0": {"arg_0": "w w w w"}},
               "resps": [["-970.68"]], "metrics": ["word_perplexity"], "word_perplexity": [-8.0, 4]}
    (d / "samples_t_2026.jsonl").write_text("\n".join(json.dumps(r) for r in (gen, rolling)))
    df = load_samples([d])
    assert df["metric"].tolist() == ["first_word"] and df["gen_len"].tolist() == [3]
    df = load_samples([d], length="context")
    assert sorted(df["metric"]) == ["first_word", "nll_per_word"]
    assert df.loc[df.metric == "nll_per_word", "value"].item() == 2.0


def test_report_from_buckets_prefers_the_bucket_table(tmp_path):
    """``--from-buckets``: a run holding both tables is read from buckets.parquet (bucket-only),
    with the same bucket means and intervals as from its positions; without the flag the
    positions are read."""
    pos = _synthetic_positions(np.random.default_rng(5))
    both = tmp_path / "both"
    both.mkdir()
    pos.to_parquet(both / "positions.parquet")
    bucket_sums(pos).to_parquet(both / "buckets.parquet")
    plain = R.load_runs([both])
    fast = R.load_runs([both], prefer_buckets=True)
    assert plain.bucket_only == () and fast.bucket_only == ("both",)
    assert len(fast.positions) < len(plain.positions)
    a, b = R.kl_by_position(plain.positions), R.kl_by_position(fast.positions)
    for c in ("mean", "ci_lo", "ci_hi"):
        np.testing.assert_allclose(a[c], b[c], rtol=1e-12)
    from replayssm_quant.analysis import report

    assert report.main([str(both), "-o", str(tmp_path / "r" / "report.md"),
                        "--from-buckets"]) == 0
    assert "buckets.parquet" in (tmp_path / "r" / "report.md").read_text()


def test_report_octave_footnote_is_the_runs_own_n(tmp_path):
    """The `*` footnote of the octave table says what the run's own last octave holds (a run
    of N = 20 tokens: N = 16..20, 5 of the octave's 16 positions; N = 16: N = 16 only), not
    another run length's."""
    from replayssm_quant.analysis import report

    for n, note in ((20, "`16+*` holds N = 16..20, 5 of the octave's 16 positions"),
                    (16, "`16+*` holds N = 16 only, 1 of the octave's 16 positions")):
        run = R.write_synthetic_run(tmp_path / f"n{n}", policies=("shared:nvfp4+sr",),
                                    windows=(1,), n_tokens=n, docs=2)
        out = tmp_path / f"r{n}" / "report.md"
        assert report.main([str(run), "-o", str(out)]) == 0
        text = out.read_text()
        assert "| 16+* |" in text.split("## Mean KL per position octave")[1].split("\n## ")[0]
        assert f"than the octave's width ({note})." in text
        assert "N = 1024" not in text


def test_report_refuses_a_run_directory_given_twice(tmp_path, capsys, monkeypatch):
    """The same directory twice (as typed, or spelled two ways) exits 2 naming it, writing
    nothing, instead of reporting one run as two (``run`` and ``run-2``); two different
    directories of the same name are two runs."""
    from replayssm_quant.analysis import report

    run = R.write_synthetic_run(tmp_path / "int512", policies=("shared:nvfp4+sr",), windows=(1,),
                                n_tokens=16, docs=1)
    out = tmp_path / "r" / "report.md"
    monkeypatch.chdir(tmp_path)
    assert report.main(["int512", "int512", "-o", str(out)]) == 2
    assert capsys.readouterr().err == ("replayssm-report: error: run directory 'int512' is given "
                                       "twice; give each run directory once\n")
    assert report.main(["int512", "./int512/", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "run directories 'int512' and './int512/' are the same directory" in err
    assert str(run.resolve()) in err and not out.parent.exists()
    other = R.write_synthetic_run(tmp_path / "b" / "int512", policies=("shared:nvfp4+sr",),
                                  windows=(1,), n_tokens=16, docs=1)
    assert report.main(["int512", str(other), "-o", str(out)]) == 0
    assert "| int512-2 |" in out.read_text()


def test_summary_top1_counts_nonfinite_and_report_notes_them(tmp_path):
    """A policy that diverges on some positions must not score higher: summarize's top-1
    agreement counts non-finite positions as disagreement (as the runner's summary does),
    computed here directly from the rows; the report clips a negative CI bound at 0 (KL >=
    0) and names the cell with non-finite positions under its summary table."""
    from replayssm_quant.analysis import report

    run = R.write_synthetic_run(tmp_path / "run", policies=("shared:nvfp4+sr",), windows=(16,),
                                n_tokens=64, docs=2)
    pos = pd.read_parquet(run / "positions.parquet")
    docs = sorted(pos["doc"].unique())
    pos["kl"] = np.where(pos["doc"] == docs[0], 1e-6, 1e-2)  # t interval over 2 docs: lo < 0
    pos["top1_agree"] = True
    bad = (pos["doc"] == docs[1]) & (pos["position"] >= 48)
    pos.loc[bad, ["kl", "nonfinite"]] = [np.nan, True]
    pos.to_parquet(run / "positions.parquet", index=False)

    s = R.summarize(R.validate_positions(pos)).iloc[0]
    assert s["top1_agree"] == pytest.approx(1.0 - bad.sum() / len(pos))  # 112 / 128
    assert s["kl_ci_lo"] < 0 and s["nonfinite"] == bad.sum() == 16

    out = tmp_path / "rep" / "report.md"
    out.parent.mkdir()
    assert report.main([str(run), "-o", str(out)]) == 0
    summary = out.read_text().split("## Summary per policy and window")[1].split("\n## ")[0]
    assert "its lower bound is clipped at 0 (KL >= 0) in 1 row(s)" in summary
    assert "**Non-finite logits** in `shared:nvfp4+sr` L = 16 (16 positions, 12.5%)" in summary
    table = [line for line in summary.splitlines() if line.startswith("|")]
    col = [c.strip() for c in table[0].strip("|").split("|")].index("kl_ci_lo")
    lows = [float(row.strip("|").split("|")[col]) for row in table[2:]]
    assert lows and min(lows) == 0.0  # clipped, not negative
