"""The ``replayssm-kl`` runner end to end on a tiny random model (CPU, offline)."""

import json

import pandas as pd
import pytest

from replayssm_quant.evals.kl import COLUMNS, main

from conftest import KL_TEXT as TEXT


def _args(model_dir, data_file, out, *extra):
    return ["--model", model_dir, "--dataset", data_file, "--max-tokens", "24", "--segment-len",
            "10", "--prefill", "3", "--windows", "4", "--max-docs", "2", "--batch-size", "2",
            "--policies", "shared:nvfp4+sr", "eager:fp8e4m3", "-o", str(out), "--no-progress",
            *extra]


def test_run_outputs_and_resume(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(model_dir, data_file, out)) == 0
    pos = pd.read_parquet(out / "positions.parquet")
    assert tuple(pos.columns) == COLUMNS
    assert len(pos) == 2 * 2 * (24 - 3)  # docs x policies x reported positions
    assert pos["position"].min() == 3 and pos["position"].max() == 23
    assert (pos["kl"] >= 0).all() and not pos["nonfinite"].any()
    assert pos.groupby("policy")["kl"].mean().min() > 0
    summ = pd.read_csv(out / "summary.csv")
    for c in ("kl_mean", "kl_ci_lo", "kl_ci_hi", "kl_median", "kl_p90", "kl_p99", "kl_p999",
              "kl_max", "top1_agree", "nonfinite"):
        assert c in summ.columns
    man = json.loads((out / "manifest.json").read_text())
    assert man["cells_computed_this_run"] == 4 and man["model"]["model_type"] == "qwen3_5"
    assert "git_commit" in man and "versions" in man and "timings" in man
    text = capsys.readouterr().out
    assert "shared:nvfp4+sr" in text and "2 documents x 24 tokens" in text
    # resume: nothing recomputed, same table, and the summary line says so
    assert main(_args(model_dir, data_file, out)) == 0
    man2 = json.loads((out / "manifest.json").read_text())
    assert man2["cells_computed_this_run"] == 0
    assert "every cell already in the output, nothing recomputed" in capsys.readouterr().out
    pd.testing.assert_frame_equal(pd.read_parquet(out / "positions.parquet"), pos)
    # a partial resume (one cell's part lost, as after an interrupt) says what it reuses,
    # recomputes that cell alone, and gives the same table
    next(iter(sorted((out / "parts").glob("*.parquet")))).unlink()
    assert main(_args(model_dir, data_file, out)) == 0
    err = capsys.readouterr().err
    assert "replayssm-kl: resuming: 3 of 4 (document, cell) pairs are already done in " in err
    assert "; computing the other 1" in err
    assert json.loads((out / "manifest.json").read_text())["cells_computed_this_run"] == 1
    pd.testing.assert_frame_equal(pd.read_parquet(out / "positions.parquet"), pos)
    # batch composition does not change a document's rows (SR keyed by the document's tokens)
    out1 = tmp_path / "run1"
    assert main(_args(model_dir, data_file, out1, "--batch-size", "1")) == 0
    pos1 = pd.read_parquet(out1 / "positions.parquet")
    assert (pos1["kl"] - pos["kl"]).abs().max() < 1e-4


def test_document_order_does_not_change_numbers(model_dir, data_file, tmp_path, capsys):
    """The same document, policy and seed give the same bits whatever the corpus order: SR
    streams are keyed by the document's input tokens, not its index in the run. The corpus in
    reverse order gives every row of positions.parquet and stepwise.parquet and every number
    of summary.csv bit for bit; an output folder of the forward run resumed with the reversed
    corpus recomputes nothing and matches; a folder whose identity predates content keys (no
    ``sr_streams``) is refused."""
    import shutil

    import numpy as np

    docs = [json.loads(line) for line in open(data_file)]
    rev = tmp_path / "rev.jsonl"
    rev.write_text("\n".join(json.dumps(d) for d in reversed(docs)))
    pols = ["--policies", "shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr", "shared:fp8e4m3+sr"]
    extra = ["--max-docs", "3", "--stepwise-check", "6", *pols]
    fwd, bwd = tmp_path / "fwd", tmp_path / "bwd"
    assert main(_args(model_dir, data_file, fwd, *extra)) == 0
    assert main(_args(model_dir, str(rev), bwd, *extra)) == 0
    key = ["doc", "policy", "window", "seed", "position"]

    def rows(out, name):
        return (pd.read_parquet(out / name).sort_values(key).reset_index(drop=True))

    for name in ("positions.parquet", "stepwise.parquet"):
        a, b = rows(fwd, name), rows(bwd, name)
        assert len(a) == len(b) > 0 and set(a["doc"]) == {"d0", "d1", "d2"}
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    sa, sb = pd.read_csv(fwd / "summary.csv"), pd.read_csv(bwd / "summary.csv")
    pd.testing.assert_frame_equal(sa, sb, check_exact=True)
    # the SR policies really draw per document: documents differ
    p = rows(fwd, "positions.parquet")
    assert not np.array_equal(p.loc[p.doc == "d0", "kl"], p.loc[p.doc == "d1", "kl"])
    # resume the forward folder with the reversed corpus: nothing recomputed, same numbers
    res = tmp_path / "res"
    shutil.copytree(fwd, res)
    capsys.readouterr()
    assert main(_args(model_dir, str(rev), res, *extra)) == 0
    assert "nothing recomputed" in capsys.readouterr().out
    pd.testing.assert_frame_equal(rows(res, "positions.parquet"), rows(bwd, "positions.parquet"),
                                  check_exact=True)
    # a folder written before content keys: refused, naming the setting
    ident = json.loads((res / "run_identity.json").read_text())
    del ident["sr_streams"]
    (res / "run_identity.json").write_text(json.dumps(ident))
    assert main(_args(model_dir, str(rev), res, *extra)) == 2
    assert "the SR stream version: None there" in capsys.readouterr().err


def test_fp32_policy_gives_zero_kl(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "ref"
    args = _args(model_dir, data_file, out)
    args[args.index("shared:nvfp4+sr")] = "fp32"
    args = [a for a in args if a != "--no-progress"]
    assert main(args) == 0
    # stderr is not a terminal here: no progress bars, even without --no-progress
    err = capsys.readouterr().err
    assert "documents:" not in err and "cells:" not in err, err
    pos = pd.read_parquet(out / "positions.parquet")
    assert pos.loc[pos.policy == "fp32", "kl"].abs().max() < 1e-6


@pytest.mark.parametrize("bad", [
    ["--policies", "shared:fp7"],
    ["--max-tokens", "0"],
    ["--dataset", "/nonexistent/file.txt"],
    ["--windows", "0"],
    ["--prefill", "30"],
])
def test_bad_arguments_exit_2(model_dir, data_file, tmp_path, bad, capsys):
    args = _args(model_dir, data_file, tmp_path / "bad")
    for i in range(0, len(bad), 2):
        k = args.index(bad[i])
        args[k + 1] = bad[i + 1]
    assert main(args) == 2
    assert "error" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("bad", [["--seeds", str(2 ** 70)], ["env", "bogus"], ["env", "cuda"]])
def test_bad_seed_or_backend_exit_2_before_any_work(model_dir, data_file, tmp_path, bad, capsys,
                                                     monkeypatch):
    """A seed beyond Philox's key, a REPLAYSSM_BACKEND that names no backend, and one that
    cannot run on ``--device cpu`` (``cuda``) are refused up front (exit 2, the value named),
    not by a traceback after the output folder exists."""
    args = _args(model_dir, data_file, tmp_path / "bad")
    assert "--device" not in args  # the default, cpu
    if bad[0] == "env":
        monkeypatch.setenv("REPLAYSSM_BACKEND", bad[1])
    else:
        args += bad
    assert main(args) == 2
    err = capsys.readouterr().err
    want = {"bogus": ["'bogus' is not a backend"],
            "cuda": ["REPLAYSSM_BACKEND='cuda' needs a CUDA device, got cpu"]}.get(
        bad[1], ["2^63", str(2 ** 70)])
    assert all(w in err for w in want), err
    assert not (tmp_path / "bad").exists()


def test_model_without_ssm_layers_exit_2(data_file, tmp_path, capsys):
    import transformers as T

    d = tmp_path / "llama"
    T.LlamaForCausalLM(T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=4)).save_pretrained(d)
    assert main(["--model", str(d), "--dataset", data_file, "-o", str(tmp_path / "x")]) == 2
    assert "supported" in capsys.readouterr().err


def test_dry_run(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "dry"
    assert main(_args(model_dir, data_file, out, "--dry-run")) == 0
    text = capsys.readouterr().out
    assert "plan:" in text and "memory estimate" in text
    assert not out.exists()


def test_more_threads_than_cpus_gets_a_note(model_dir, data_file, tmp_path, capsys):
    """--threads beyond the machine's CPUs is allowed but noted (a new-user trial's 1000
    threads made a 0.5 s run take 29 s); within them, no note."""
    import os

    n = os.cpu_count() or 1
    out = tmp_path / "dry"
    assert main(_args(model_dir, data_file, out, "--dry-run", "--threads", str(n + 1))) == 0
    assert f"--threads {n + 1} is more than the {n} CPU(s) here" in capsys.readouterr().err
    assert main(_args(model_dir, data_file, out, "--dry-run", "--threads", str(n))) == 0
    assert "is more than the" not in capsys.readouterr().err


def test_resume_never_reuses_cells_of_other_settings(model_dir, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_args(model_dir, data_file, out)) == 0
    # other run settings in the same directory: refused before any compute
    args = _args(model_dir, data_file, out)
    args[args.index("--max-tokens") + 1] = "20"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--max-tokens (-N; --at-N of replayssm-plan): " in err and "another --output-dir" in err
    # other documents, same settings: their cells are computed, not taken from the old ones
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"id": f"o{i}", "text": TEXT[::-1][i * 5:]}) for i in range(2)))
    assert main(_args(model_dir, str(other), out)) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["cells_computed_this_run"] == 4
    pos = pd.read_parquet(out / "positions.parquet")
    assert set(pos["doc"]) == {"o0", "o1"}


def test_output_dir_that_is_a_file_exit_2(model_dir, data_file, tmp_path, capsys):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert main(_args(model_dir, data_file, f)) == 2
    assert "not a directory" in capsys.readouterr().err


def test_dt_limit_recorded_and_part_of_resume_identity(tmp_path):
    """``--dt-limit`` reaches the adapters (``handle.dt_limit``), is written to the manifest,
    and a resume with the other rule is refused before any compute (exit 2)."""
    out = tmp_path / "run"
    args = ["--model", "tiny-mamba2", "--max-docs", "1", "-N", "16", "--policies", "fp32",
            "--stepwise-check", "0", "--no-progress", "-o", str(out)]
    assert main(args + ["--dt-limit", "clamp"]) == 0
    assert json.loads((out / "manifest.json").read_text())["dt_limit"] == "clamp"
    assert main(args + ["--dt-limit", "decode"]) == 2


def test_check_output_dir_creates_nothing_and_names_the_problem(tmp_path, monkeypatch):
    """``check_output_dir``: an existing directory passes; a missing one (with missing
    parents) passes and is not left behind; a file, a path under a file, and a directory the
    file system refuses raise BadArgs naming the flag and the path."""
    from pathlib import Path

    from replayssm_quant.evals.kl import BadArgs, check_output_dir

    check_output_dir(tmp_path)
    deep = tmp_path / "a" / "b" / "c"
    check_output_dir(deep)
    assert not (tmp_path / "a").exists()
    f = tmp_path / "afile"
    f.write_text("x")
    for bad, why in ((f, "exists and is not a directory"), (f / "sub", "is not a directory")):
        with pytest.raises(BadArgs, match=why) as e:
            check_output_dir(bad, "-o")
        assert str(e.value).startswith(f"-o {str(bad)!r}")

    def refuse(self, *a, **k):  # a file system that refuses (e.g. /proc for root)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(BadArgs, match="cannot be created: Permission denied"):
        check_output_dir(tmp_path / "new")
    for empty in ("", "  "):  # (an unset $OUT): not the current directory by accident
        with pytest.raises(BadArgs, match=r"^-o is empty \(.*\); give a directory, or '\.'"):
            check_output_dir(empty, "-o")


@pytest.mark.parametrize("tool", ["kl", "attribute", "plan"])
def test_empty_output_dir_exit_2_and_writes_nothing(tool, tmp_path, monkeypatch, capsys):
    """``-o ''`` (an unset variable in ``-o "$OUT"``) is refused in one line by every tool
    that writes a run directory, and nothing is written into the current directory."""
    import importlib

    monkeypatch.chdir(tmp_path)
    mod = importlib.import_module(f"replayssm_quant.evals.{tool}")
    extra = {"kl": [], "attribute": [], "plan": ["--budget", "4.5"]}[tool]
    assert mod.main(["--model", "tiny-gdn", "-N", "16", "--max-docs", "1", "--no-progress",
                     *extra, "-o", ""]) == 2
    assert "--output-dir is empty ('')" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_interrupt_before_compute_exits_130_in_one_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the arguments, model config or documents load: exit 130 and one line, no
    traceback (an interrupt during the cells keeps the finished ones and says so)."""
    import replayssm_quant.evals.kl as kl

    def interrupted(a):
        raise KeyboardInterrupt

    monkeypatch.setattr(kl, "_check_args", interrupted)
    assert kl.main(["--model", "tiny-gdn", "-o", str(tmp_path / "o")]) == 130
    assert capsys.readouterr().err.strip() == ("replayssm-kl: interrupted before any cell of "
                                               "this invocation ran")


def test_sigterm_is_handled_as_an_interrupt(tmp_path, monkeypatch, capsys):
    """SIGTERM (kill, timeout, a batch system's pre-emption) inside ``interrupt_on_sigterm``
    raises ``Terminated`` (a KeyboardInterrupt) where it arrives, and the earlier handler is
    back afterwards; a run that is terminated during its cells exits 143 with the resume
    hint, as Ctrl-C exits 130."""
    import os
    import signal

    import replayssm_quant.evals.kl as kl

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(kl.Terminated):
        with kl.interrupt_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # (the handler runs between bytecodes)
                pass
    assert signal.getsignal(signal.SIGTERM) is before
    assert kl.interrupt_exit(kl.Terminated()) == (143, "terminated (SIGTERM)")
    assert kl.interrupt_exit(KeyboardInterrupt()) == (130, "interrupted")

    def terminated(*args, **kw):  # a real SIGTERM during the cells: main's handler raises
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
        raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.setattr(kl, "run", terminated)
    out = tmp_path / "o"
    assert kl.main(["--model", "tiny-gdn", "-N", "8", "--max-docs", "1", "--no-progress",
                    "-o", str(out)]) == 143
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("replayssm-kl: terminated (SIGTERM); 0 finished cells are saved in ")
    assert err.endswith("run the same command again to resume")
    assert signal.getsignal(signal.SIGTERM) is before


def test_output_dir_under_a_file_exit_2(tmp_path, capsys):
    """An --output-dir that cannot be created is refused in one line before any compute."""
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["--model", "tiny-gdn", "-N", "8", "--max-docs", "1", "--no-progress",
                 "-o", str(f / "sub")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_resume_keeps_timings_and_drops_a_stale_stepwise_table(tmp_path):
    """A resume that computes nothing keeps the compute times of the run that produced the
    tables (they add up), and a resume with --stepwise-check 0 removes the earlier
    stepwise.parquet, which would describe another setting."""
    out = tmp_path / "run"
    args = ["--model", "tiny-mamba2", "--max-docs", "1", "-N", "16", "--policies", "fp32",
            "--no-progress", "-o", str(out)]
    assert main(args + ["--stepwise-check", "4"]) == 0
    first = json.loads((out / "manifest.json").read_text())
    assert (out / "stepwise.parquet").exists()
    assert main(args + ["--stepwise-check", "0"]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["cells_computed_this_run"] == 0 and not (out / "stepwise.parquet").exists()
    assert man["timings"]["policies_s"]["fp32"] >= first["timings"]["policies_s"]["fp32"] > 0
    assert len(man["commands"]) == 2


def test_resume_that_computes_only_stepwise_parts_says_so(tmp_path, capsys):
    """A resume whose KL cells are all done but whose stepwise check is new (another K)
    computes the stepwise parts alone, and its summary line and manifest say what it
    computed instead of "nothing recomputed"."""
    out = tmp_path / "run"
    args = ["--model", "tiny-mamba2", "--max-docs", "1", "-N", "16", "--policies",
            "shared:fp16", "--windows", "4", "--no-progress", "-o", str(out)]
    assert main(args + ["--stepwise-check", "4"]) == 0
    capsys.readouterr()
    assert main(args + ["--stepwise-check", "6"]) == 0
    printed = capsys.readouterr().out
    assert "every KL cell already in the output; computed 1 stepwise-check part" in printed
    assert "nothing recomputed" not in printed
    man = json.loads((out / "manifest.json").read_text())
    assert man["cells_computed_this_run"] == 0 and man["stepwise_parts_computed_this_run"] == 1
    assert main(args + ["--stepwise-check", "6"]) == 0
    assert "nothing recomputed" in capsys.readouterr().out


def test_window_beyond_the_document_warns(capsys, tmp_path):
    """A window of at least --max-tokens without --prefill flushes nowhere in a document (the
    read copy stays the exact cast of the zero initial state): the run says so on stderr for
    those windows only, and not when a prefill casts the state first."""
    from replayssm_quant.evals.kl import _check_args, build_parser

    out = str(tmp_path / "o")
    _check_args(build_parser().parse_args(["-N", "8", "--windows", "4", "8", "16", "-o", out]))
    err = capsys.readouterr().err
    assert "warning: --windows 8 16 >= --max-tokens 8 without --prefill" in err, err
    assert "> 4 x --max-tokens" not in err  # 16 is not far beyond
    _check_args(build_parser().parse_args(["-N", "8", "--windows", "32", "33", "64", "-o", out]))
    err = capsys.readouterr().err  # the cost warning names the windows far beyond N only
    assert "warning: --windows 33 64 > 4 x --max-tokens" in err and "(L / 8)^2" in err, err
    _check_args(build_parser().parse_args(["-N", "8", "--windows", "4", "-o", out]))
    _check_args(build_parser().parse_args(["-N", "8", "--windows", "16", "--prefill", "2",
                                           "-o", out]))
    assert "warning" not in capsys.readouterr().err


def test_shared_sr_sequence_ids_are_reported(model_dir, data_file, tmp_path, capsys, monkeypatch):
    """Documents whose 20-bit SR ids collide are named in the manifest and a note on stderr
    (their roundings draw the same bits); distinct ids: an empty record and no note."""
    import replayssm_quant.adapters as adapters
    from replayssm_quant.evals.kl.run import shared_sequence_ids

    assert shared_sequence_ids([3, 5, 3, 9, 5], list("abcde")) == {3: ["a", "c"], 5: ["b", "e"]}
    assert shared_sequence_ids([1, 2], ["a", "b"]) == {}
    out = tmp_path / "distinct"
    assert main(_args(model_dir, data_file, out)) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["sr_sequence_ids"] == {"bits": adapters.SEQ_ID_BITS, "shared": {}}
    assert "share an SR sequence id" not in capsys.readouterr().err
    monkeypatch.setattr(adapters, "sequence_id", lambda tokens: 7)  # every document collides
    out = tmp_path / "shared"
    assert main(_args(model_dir, data_file, out)) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert list(man["sr_sequence_ids"]["shared"]) == ["7"]
    assert man["sr_sequence_ids"]["shared"]["7"] == man["data"]["documents"]
    assert "2 of 2 documents share an SR sequence id" in capsys.readouterr().err


def test_fewer_documents_than_max_docs_noted(tmp_path, data_file, capsys):
    """--max-docs above what the dataset holds runs what there is and says so on stderr
    (the plan's count alone was easy to miss)."""
    out = tmp_path / "run"
    assert main(["--model", "tiny-mamba2", "--dataset", data_file, "--max-docs", "50", "-N", "16",
                 "--policies", "fp32", "--stepwise-check", "0", "--no-progress",
                 "-o", str(out)]) == 0
    err = capsys.readouterr().err
    n = len(json.loads((out / "manifest.json").read_text())["data"]["documents"])
    assert 1 <= n < 50
    assert f"note: --max-docs 50, but the dataset holds {n} document(s) of 17 tokens" in err, err


def test_damaged_part_file_is_named_and_exits_2(tmp_path, capsys):
    """A part file cut short (a disk error, a copy gone wrong) stops the rerun with one line
    naming it and exit code 2, not a traceback; deleting it recomputes that cell to the same
    table."""
    out = tmp_path / "run"
    args = ["--model", "tiny-mamba2", "--max-docs", "1", "-N", "16", "--policies",
            "shared:fp16", "--windows", "4", "--stepwise-check", "0", "--no-progress",
            "-o", str(out)]
    assert main(args) == 0
    table = pd.read_parquet(out / "positions.parquet")
    (part,) = (out / "parts").glob("*.parquet")
    part.write_bytes(part.read_bytes()[:100])
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"part file {part} cannot be read" in err and "delete it and rerun" in err
    part.unlink()
    assert main(args) == 0
    pd.testing.assert_frame_equal(pd.read_parquet(out / "positions.parquet"), table)


def test_part_copied_over_another_is_named(tmp_path, capsys):
    """A part file copied over another cell's by hand (the same positions, so the position
    check passes) is named with exit code 2: each part records the cell it was written for."""
    out = tmp_path / "run"
    args = ["--model", "tiny-mamba2", "--max-docs", "1", "-N", "16", "--policies",
            "shared:fp16", "shared:nvfp4", "--windows", "4", "--stepwise-check", "0",
            "--no-progress", "-o", str(out)]
    assert main(args) == 0
    a, b = sorted((out / "parts").glob("*.parquet"))
    b.write_bytes(a.read_bytes())
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"part file {b} was written for another cell ({a.stem})" in err, err


def test_state_error_names_the_windows_the_segment_does_not_divide(tmp_path, capsys):
    """--state-error needs --segment-len a multiple of every window; the message names the
    windows it is not a multiple of, under their own flag."""
    assert main(["--model", "tiny-gdn", "-N", "64", "--max-docs", "1", "--segment-len", "24",
                 "--windows", "4", "16", "32", "--state-error", "--no-progress",
                 "-o", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "24 is not a multiple of --windows 16 32" in err, err


def test_max_cells_ledger_counted_once(tmp_path, capsys):
    """A --max-cells invocation's compute counts in the final manifest once: also when its
    ledger line survives the manifest (a crash between the two), and not when a later
    invocation recomputed every cell."""
    out = tmp_path / "run"
    args = ["--model", "tiny-mamba2", "--max-docs", "1", "-N", "16", "--policies",
            "shared:fp16", "eager:fp8e4m3", "--windows", "4", "--stepwise-check", "0",
            "--no-progress", "-o", str(out)]
    assert main(args + ["--max-cells", "1"]) == 0
    ledger = out / "parts" / "invocations.jsonl"
    line = ledger.read_text()
    assert main(args) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert len(man["commands"]) == 2 and len(man["invocations_counted"]) == 1
    ledger.write_text(line)  # as if the run had crashed before removing it
    assert main(args) == 0
    again = json.loads((out / "manifest.json").read_text())
    assert again["invocations_counted"] == man["invocations_counted"]
    assert len(again["commands"]) == 3  # this rerun's own command, not the ledger's again
    assert again["timings"]["policies_s"] == man["timings"]["policies_s"]  # nothing twice
    capsys.readouterr()


def test_summary_clips_the_kl_interval_at_zero():
    """``summary.csv``'s normal interval over positions: KL >= 0, so a lower bound below 0 (few,
    spread positions) is clipped; the mean, the upper bound and NaN (one position) are not
    touched. Checked against the interval computed here from the rows."""
    import math

    import numpy as np

    from replayssm_quant.evals.kl.metrics import summarize

    kl = np.array([1e-6, 1e-2, 2e-6, 5e-6, 3e-2])  # bucket 2 (positions 3-6): wide interval
    df = pd.DataFrame({"position": [3, 4, 5, 6, 0], "kl": kl, "policy": "p", "window": 16,
                       "top1_agree": True, "nonfinite": False, "nonfinite_ref": False,
                       "nonfinite_policy": False})
    s = summarize(df).set_index("bucket")
    v = kl[:4]
    half = 1.96 * v.std(ddof=1) / math.sqrt(4)
    assert v.mean() - half < 0  # the unclipped bound
    assert s.loc[2, "kl_ci_lo"] == 0.0
    assert s.loc[2, "kl_mean"] == pytest.approx(v.mean(), rel=1e-12)
    assert s.loc[2, "kl_ci_hi"] == pytest.approx(v.mean() + half, rel=1e-12)
    assert math.isnan(s.loc[0, "kl_ci_lo"])  # one position: no interval


def test_unreachable_hub_id_hints_at_offline_mode(monkeypatch, tmp_path):
    """A hub id whose config cannot be loaded: the message names it and, unless
    HF_HUB_OFFLINE=1 is already set, says that setting it fails at once (the hub client
    otherwise retries for about 26 s offline; found by a new-user trial). A local path or an
    embedded name gets no such hint."""
    import transformers

    from replayssm_quant.evals import kl

    def refuse(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co'")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(kl.BadArgs, match=r"cannot load model config 'org/model': We couldn't "
                                         r"connect.*HF_HUB_OFFLINE=1 makes this fail at once"):
        kl._load_config("org/model")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(kl.BadArgs) as e:
        kl._load_config("org/model")
    assert "HF_HUB_OFFLINE" not in str(e.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(kl.BadArgs) as e:
        kl._load_config(str(tmp_path))
    assert "HF_HUB_OFFLINE" not in str(e.value)
    # nor a typo of an embedded name, or a missing path (not hub ids: resolve_model_path says so)
    for bad, why in (("tiny-gdm", "did you mean 'tiny-gdn'"),
                     (str(tmp_path / "missing"), "model path does not exist")):
        with pytest.raises(kl.BadArgs, match=why) as e:
            kl._load_config(bad)
        assert "HF_HUB_OFFLINE" not in str(e.value) and "a hub id;" not in str(e.value)


def test_rerun_with_other_policies_says_earlier_cells_are_not_in_the_tables(
        model_dir, data_file, tmp_path, capsys):
    """A rerun into the same folder with other --policies keeps the earlier cells' parts but
    tables only this command's cells; the runner says how many other pieces parts/ holds (a
    new-user trial saw an earlier policy drop out of summary.csv without a word)."""
    out = tmp_path / "run"
    base = [a for a in _args(model_dir, data_file, out)
            if a not in ("--policies", "shared:nvfp4+sr", "eager:fp8e4m3")]
    assert main(base + ["--policies", "shared:fp16"]) == 0
    assert "not asked for by this command" not in capsys.readouterr().err
    assert main(base + ["--policies", "shared:fp8e4m3"]) == 0
    err = capsys.readouterr().err
    assert "also holds 2 finished (document, cell) piece(s)" in err, err
    assert set(pd.read_csv(out / "summary.csv")["policy"]) == {"shared:fp8e4m3"}
    assert main(base + ["--policies", "shared:fp16", "shared:fp8e4m3"]) == 0  # both: no note
    assert "not asked for by this command" not in capsys.readouterr().err
