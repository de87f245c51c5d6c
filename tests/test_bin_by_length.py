"""Binning lm-eval samples by generation length (issue 6 docs tooling)."""

import json

import numpy as np
import pandas as pd
import pytest

from replayssm_quant.evals.bin_by_length import bin_by_length, load_samples, main


def _write_run(d, policy, lengths, values):
    d.mkdir(parents=True)
    (d / "results_x.json").write_text(json.dumps({"config": {"replayssm_state": policy,
                                                             "replayssm_window": 16}}))
    with open(d / "samples_mytask_2026-11-29T00.jsonl", "w") as f:
        for i, (n, v) in enumerate(zip(lengths, values)):
            f.write(json.dumps({"doc_id": i, "resps": [[" ".join(["w"] * n)]],
                                "metrics": ["exact_match"], "exact_match": v}) + "\n")


def test_bins_match_hand_computation(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 100, 200)
    values = rng.integers(0, 2, 200).astype(float)
    _write_run(tmp_path / "a", "shared:nvfp4", lengths, values)
    df = load_samples([tmp_path / "a"])
    assert set(df["run"]) == {"shared:nvfp4 L=16"} and set(df["task"]) == {"mytask"}
    out = bin_by_length(df, [0, 10, 50, 100])
    for lo, hi in ((0, 10), (10, 50), (50, 100)):
        sel = values[(lengths >= lo) & (lengths < hi)]
        row = out[out["bin"] == f"[{lo}, {hi})"].iloc[0]
        assert row["n"] == len(sel)
        assert row["mean"] == pytest.approx(sel.mean())
        assert row["sem"] == pytest.approx(sel.std(ddof=1) / np.sqrt(len(sel)))


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such"):
        load_samples([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="log_samples"):
        load_samples([tmp_path / "empty"])
    with pytest.raises(ValueError, match="increasing"):
        bin_by_length(pd.DataFrame(columns=["run", "task", "metric", "gen_len", "value"]), [5, 5])
    assert main([str(tmp_path / "missing")]) == 2


def test_foreign_json_files_in_the_tree(tmp_path, capsys):
    """A results_*.json that is not lm-eval's (a list; another tool's summary found by the
    recursive search) is skipped for the label; a samples file whose line is not a JSON object
    is an error naming the file and line."""
    _write_run(tmp_path / "a", "shared:nvfp4", [3, 4], [1.0, 0.0])
    (tmp_path / "a" / "sub").mkdir()
    (tmp_path / "a" / "sub" / "results_summary.json").write_text("[]")
    (tmp_path / "a" / "results_a.json").write_text('{"config": [1]}')
    df = load_samples([tmp_path / "a"])
    assert set(df["run"]) == {"shared:nvfp4 L=16"} and len(df) == 2
    for i, bad in enumerate(("not json", "[1, 2]")):
        d = tmp_path / f"bad{i}"
        d.mkdir()
        (d / "samples_t_2026.jsonl").write_text(json.dumps({"doc_id": 0}) + "\n" + bad + "\n")
        with pytest.raises(ValueError, match=r"samples_t_2026\.jsonl, line 2"):
            load_samples([d])
        assert main([str(d)]) == 2
        assert "line 2" in capsys.readouterr().err


def test_output_paths_and_empty_bins(tmp_path, capsys):
    """``-o``: a directory is refused in one line (exit 2, nothing computed); a CSV under
    missing directories is written (they are made, as replayssm-report does); bins that no
    sample falls in print a warning, not a silent empty table."""
    _write_run(tmp_path / "a", "shared:nvfp4", [3, 12, 40], [1.0, 0.0, 1.0])
    run = str(tmp_path / "a")
    assert main([run, "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    out = tmp_path / "new" / "dir" / "t.csv"
    assert main([run, "--bins", "0", "10", "100", "-o", str(out)]) == 0
    t = pd.read_csv(out)
    assert list(t["n"]) == [1, 2]
    capsys.readouterr()
    assert main([run, "--bins", "100", "200"]) == 0
    assert "warning: no sample falls in the bins [100, 200)" in capsys.readouterr().err


def test_samples_outside_the_bins_are_counted(tmp_path, capsys):
    """A sample beyond the last edge (or before the first) is left out of the table with a
    warning naming how many and the bins' range; one inside every bin gives no warning. A
    sample is counted once whatever its number of metrics."""
    _write_run(tmp_path / "a", "shared:nvfp4", [3, 12, 22], [1.0, 0.0, 1.0])
    run = str(tmp_path / "a")
    assert main([run, "--bins", "0", "21"]) == 0
    cap = capsys.readouterr()
    assert ("warning: 1 of 3 sample(s) fall outside the bins [0, 21) (length 22 words) and are "
            "left out of the table") in cap.err
    assert "no sample falls" not in cap.err and "[0, 21)" in cap.out
    assert main([run, "--bins", "5", "20"]) == 0
    assert "2 of 3 sample(s) fall outside the bins [5, 20) (length 3..22 words)" in capsys.readouterr().err
    assert main([run, "--bins", "0", "23"]) == 0
    assert "warning" not in capsys.readouterr().err
    df = load_samples([run])
    two = pd.concat([df, df.assign(metric="other")])  # two metrics per sample
    from replayssm_quant.evals.bin_by_length import outside_bins

    assert outside_bins(two, [0, 21]) == (1, 3, 22, 22)
    assert outside_bins(two, [0, 100]) == (0, 3, None, None)


def test_bad_bins_and_a_file_are_refused(tmp_path, capsys):
    """Negative, repeated or decreasing edges, or a single one, exit 2 naming the edges (no
    empty table); a file given as a run is named as not a directory."""
    _write_run(tmp_path / "a", "shared:nvfp4", [3, 12], [1.0, 0.0])
    run = str(tmp_path / "a")
    for bins in (["-1", "0"], ["-5", "10"], ["10", "5"], ["0", "0"], ["7"]):
        assert main([run, "--bins", *bins]) == 2
        cap = capsys.readouterr()
        assert cap.err.startswith("replayssm-bin-by-length: error: --bins: bins must be at least "
                                  "two increasing non-negative edges") and cap.out == ""
        assert f"got [{', '.join(bins)}]" in cap.err
    with pytest.raises(ValueError, match="non-negative"):
        bin_by_length(load_samples([run]), [-1, 0])
    f = tmp_path / "a" / "samples_mytask_2026-11-29T00.jsonl"
    assert main([str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f} is not a directory" in err and "holds no samples" not in err
    with pytest.raises(NotADirectoryError, match="not a directory"):
        load_samples([f])


def test_a_run_after_bins_is_named_as_a_bad_edge(tmp_path, capsys):
    """``--bins`` takes every word after it: a run directory given after the edges is refused
    as a non-integer edge with the way out, and the same call with the run first or after
    ``--`` runs."""
    _write_run(tmp_path / "a", "shared:nvfp4", [3, 12], [1.0, 0.0])
    run = str(tmp_path / "a")
    with pytest.raises(SystemExit) as e:
        main(["--bins", "0", "100", run])
    assert e.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"argument --bins: invalid length edge {run!r}: expected an integer" in err
    assert "before --bins, or end its list with --" in err
    assert main(["--bins", "0", "100", "--", run]) == 0
    assert main([run, "--bins", "0", "100"]) == 0


def test_bins_help_shows_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--bins EDGE [EDGE ...]" in out and "(default: 0 64 256 1024 4096 16384 1048576)" in out



def test_a_run_given_twice_or_nested_is_refused(tmp_path, capsys):
    """The same directory twice (however spelled), or one inside another, would count its
    samples twice (n doubled, the standard error shrunk by sqrt 2): refused, exit 2."""
    _write_run(tmp_path / "a", "shared:nvfp4", [3, 12, 40], [1.0, 0.0, 1.0])
    run = str(tmp_path / "a")
    with pytest.raises(ValueError, match="given twice"):
        load_samples([run, str(tmp_path / "x" / ".." / "a")])
    with pytest.raises(ValueError, match="lies inside"):
        load_samples([str(tmp_path), run])
    assert main([run, run]) == 2
    assert "given twice" in capsys.readouterr().err
    assert len(load_samples([run])) == 3  # once is fine


def test_output_under_a_file_is_refused_before_reading(tmp_path, capsys):
    """``-o`` below a plain file: exit 2 in one line naming the file, before any sample is
    read (a missing run directory is not reached)."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "t.csv"
    assert main([str(tmp_path / "missing"), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not a directory" in err and "afile" in err and "\n" not in err


def _lm_eval_run(folder, date, model, policy, seed, docs, value, task="mytask"):
    """One lm-eval run as lm-eval writes it: ``results_<date>.json`` and
    ``samples_<task>_<date>.jsonl`` in ``folder`` (lm-eval's ``<output_path>/<model>/``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"results_{date}.json").write_text(json.dumps({
        "model_name": model, "config": {"replayssm_state": policy, "replayssm_window": 16,
                                        "replayssm_seed": seed, "model_dtype": "torch.float32"}}))
    with open(folder / f"samples_{task}_{date}.jsonl", "w") as f:
        for i, h in enumerate(docs):
            f.write(json.dumps({"doc_id": i, "doc_hash": h, "resps": [["w w w"]],
                                "metrics": ["acc"], "acc": value}) + "\n")


def test_runs_of_one_policy_never_pool(tmp_path, capsys):
    """Two models under one policy get two labels, each samples file takes the label of the
    results JSON written with it (two policies in one lm-eval folder), and a run that scores
    a document twice (a rerun into the same folder) is refused, naming both files."""
    docs = ["h0", "h1", "h2"]
    _lm_eval_run(tmp_path / "g" / "tiny-gdn", "2026-12-06T01", "tiny-gdn", "fp32", 0, docs, 1.0)
    _lm_eval_run(tmp_path / "m" / "tiny-mamba2", "2026-12-06T02", "tiny-mamba2", "fp32", 0, docs,
                 0.0)
    df = load_samples([tmp_path / "g", tmp_path / "m"])
    runs = df.groupby("run")["value"].agg(["count", "mean"])
    assert runs.to_dict("index") == {"fp32 L=16 model=tiny-gdn": {"count": 3, "mean": 1.0},
                                     "fp32 L=16 model=tiny-mamba2": {"count": 3, "mean": 0.0}}
    t = bin_by_length(df, [0, 10], baseline="fp32 L=16 model=tiny-gdn")
    assert sorted(t["delta_mean"]) == [-1.0, 0.0]  # the baseline pairs with itself: 0

    mix = tmp_path / "mix" / "tiny-gdn"  # two policies written into one lm-eval folder
    _lm_eval_run(mix, "2026-12-06T03", "tiny-gdn", "fp32", 0, docs, 1.0)
    _lm_eval_run(mix, "2026-12-06T04", "tiny-gdn", "shared:nvfp4+sr", 0, docs, 0.5)
    df = load_samples([tmp_path / "mix"])
    assert df.groupby("run")["value"].mean().to_dict() == {"fp32 L=16": 1.0,
                                                           "shared:nvfp4+sr L=16": 0.5}
    seeds = tmp_path / "seeds" / "tiny-gdn"  # one policy, two SR seeds
    _lm_eval_run(seeds, "2026-12-06T05", "tiny-gdn", "shared:nvfp4+sr", 0, docs, 1.0)
    _lm_eval_run(seeds, "2026-12-06T06", "tiny-gdn", "shared:nvfp4+sr", 1, docs, 0.0)
    assert set(load_samples([tmp_path / "seeds"])["run"]) == {
        "shared:nvfp4+sr L=16 seed=0", "shared:nvfp4+sr L=16 seed=1"}

    # the same policy and settings in two folders (e.g. num_fewshot, which the label does not
    # name, differs): every run of that label is told apart by folder (a third folder of other
    # documents could pool with either, so it is named too)
    _lm_eval_run(tmp_path / "shot0" / "tiny-gdn", "2026-12-06T08", "tiny-gdn", "fp32", 0, docs,
                 1.0)
    _lm_eval_run(tmp_path / "shot5" / "tiny-gdn", "2026-12-06T09", "tiny-gdn", "fp32", 0, docs,
                 0.0)
    _lm_eval_run(tmp_path / "long" / "tiny-gdn", "2026-12-06T10", "tiny-gdn", "fp32", 0,
                 ["h7", "h8"], 0.5)
    df = load_samples([tmp_path / "shot0", tmp_path / "shot5", tmp_path / "long"])
    assert df.groupby("run")["value"].agg(["count", "mean"]).to_dict("index") == {
        f"fp32 L=16 [{tmp_path / 'shot0' / 'tiny-gdn'}]": {"count": 3, "mean": 1.0},
        f"fp32 L=16 [{tmp_path / 'shot5' / 'tiny-gdn'}]": {"count": 3, "mean": 0.0},
        f"fp32 L=16 [{tmp_path / 'long' / 'tiny-gdn'}]": {"count": 2, "mean": 0.5}}
    # without the clash, one policy at two context lengths (other documents) pools
    df = load_samples([tmp_path / "shot0", tmp_path / "long"])
    assert df.groupby("run")["value"].count().to_dict() == {"fp32 L=16": 5}

    # lm-eval's layout for --output_path <name>.json: <name>_<date>.json beside the samples
    js = tmp_path / "js"
    _lm_eval_run(js, "2026-12-06T11", "tiny-gdn", "fp32", 0, docs, 1.0)
    _lm_eval_run(js, "2026-12-06T12", "tiny-gdn", "shared:nvfp4+sr", 0, docs, 0.5)
    for date, name in (("2026-12-06T11", "fp32"), ("2026-12-06T12", "nvfp4")):
        (js / f"results_{date}.json").rename(js / f"{name}_{date}.json")
    assert load_samples([js]).groupby("run")["value"].mean().to_dict() == {
        "fp32 L=16": 1.0, "shared:nvfp4+sr L=16": 0.5}

    _lm_eval_run(mix, "2026-12-06T07", "tiny-gdn", "fp32", 0, docs, 0.0)  # a rerun of fp32
    with pytest.raises(ValueError, match=r"run 'fp32 L=16' scores document h0 of task "
                                         r"'mytask' in two files of one folder, .*T03.*T07"):
        load_samples([tmp_path / "mix"])
    assert main([str(tmp_path / "mix")]) == 2
    assert "scores document h0" in capsys.readouterr().err


def test_no_generation_samples_points_to_context(tmp_path, capsys):
    d = tmp_path / "ppl" / "tiny-gdn"
    d.mkdir(parents=True)
    (d / "results_2026-12-06T01.json").write_text(json.dumps({"config": {"replayssm_state": "fp32",
                                                                        "replayssm_window": 16}}))
    rec = {"doc_id": 0, "doc_hash": "h", "arguments": {"gen_args_0": {"arg_0": "a b c"}},
           "metrics": ["word_perplexity"], "word_perplexity": [-3.0, 3]}
    (d / "samples_ppl_2026-12-06T01.jsonl").write_text(json.dumps(rec) + "\n")
    assert main([str(tmp_path / "ppl")]) == 0
    err = capsys.readouterr().err
    assert "hold no generation samples" in err and "--length context" in err
    assert main([str(tmp_path / "ppl"), "--length", "context"]) == 0
    assert "nll_per_word" in capsys.readouterr().out


def test_settings_that_change_scores_split_labels(tmp_path):
    """Runs of one policy whose other settings change the scores (a model argument such as
    mixed_precision_dtype, the task's num_fewshot, gen_kwargs) get labels naming what
    differs, even where they score different documents and so would pool silently."""
    def run(folder, date, model_args, nshot, docs, value):
        folder.mkdir(parents=True)
        cfg = {"replayssm_state": "fp32", "replayssm_window": 16, "model_args": model_args}
        (folder / f"results_{date}.json").write_text(json.dumps(
            {"model_name": "tiny-gdn", "n-shot": {"mytask": nshot}, "config": cfg}))
        with open(folder / f"samples_mytask_{date}.jsonl", "w") as f:
            for i, h in enumerate(docs):
                f.write(json.dumps({"doc_id": i, "doc_hash": h, "resps": [["w"]],
                                    "metrics": ["acc"], "acc": value}) + "\n")

    run(tmp_path / "a" / "m", "T1", "pretrained=tiny-gdn,state=fp32,batch_size=4", 0,
        ["h0", "h1"], 1.0)
    run(tmp_path / "b" / "m", "T2", {"pretrained": "tiny-gdn", "state": "fp32",
                                     "mixed_precision_dtype": "bfloat16"}, 0, ["h2"], 0.0)
    run(tmp_path / "c" / "m", "T3", "pretrained=tiny-gdn,state=fp32", 1, ["h3"], 0.5)
    df = load_samples([tmp_path / "a", tmp_path / "b", tmp_path / "c"])
    assert df.groupby("run")["value"].mean().to_dict() == {
        "fp32 L=16 mixed_precision_dtype=None num_fewshot=0": 1.0,
        "fp32 L=16 mixed_precision_dtype=bfloat16 num_fewshot=0": 0.0,
        "fp32 L=16 mixed_precision_dtype=None num_fewshot=1": 0.5}
    # settings that change no score (batch_size) do not split a label
    assert set(load_samples([tmp_path / "a", tmp_path / "c"])["run"]) == {
        "fp32 L=16 num_fewshot=0", "fp32 L=16 num_fewshot=1"}
