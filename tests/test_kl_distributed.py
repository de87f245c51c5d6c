"""``replayssm-kl`` on several processes (issue 16): the cells sharded over gloo ranks started
by torchrun give the tables of one process bit for bit, and a run stopped or killed after some
cells resumes with another world size to the same tables. CPU, 2 processes, tiny-gdn.

Oracle: the same command in one plain process (no launcher), every column of
``positions.parquet``, ``stepwise.parquet`` and ``summary.csv`` compared exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from replayssm_quant.evals.kl import main
from replayssm_quant.evals.kl import dist as D

# 2 documents x 64 tokens, 3 policies x 2 seeds, stepwise check on the first 8 positions, the
# state error at N, two segments per document: 6 cells per document, 5 of them computed (eager:fp8e4m3 draws no
# random bits, so its two seeds share one computed cell): 10 (document, computed cell) pairs
def _args(docs: int = 2) -> list:
    return ["--model", "tiny-gdn", "-N", "64", "--max-docs", str(docs), "--segment-len", "32",
            "--policies", "shared:nvfp4+sr", "eager:fp8e4m3", "read:nvfp4/rec:fp16+sr",
            "--seeds", "0", "1", "--stepwise-check", "8", "--state-error", "--no-progress",
            "--dist-timeout", "3"]


ARGS = _args()
TABLES = ("positions.parquet", "stepwise.parquet", "summary.csv", "buckets.parquet",
          "state_error.parquet")
LAUNCH_TIMEOUT = 180


def _launcher(nproc: int) -> list:
    """torchrun (``python -m torch.distributed.run``) on a free port, running the installed
    ``replayssm-kl`` script (``--no-python``) or, without it, the module."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "--max-restarts", "0"]
    script = Path(sys.executable).parent / "replayssm-kl"
    return cmd + (["--no-python", str(script)] if script.exists() else ["-m", "replayssm_quant.evals.kl"])


def _env():
    env = dict(os.environ)
    for k in D.LAUNCH_VARS:  # a launcher of the test session must not leak into the ranks
        env.pop(k, None)
    return env


def _torchrun(nproc: int, out: Path, *extra) -> subprocess.CompletedProcess:
    r = subprocess.run(_launcher(nproc) + ARGS + ["-o", str(out), *extra], capture_output=True,
                       text=True, timeout=LAUNCH_TIMEOUT, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _read(out: Path, name: str):
    return pd.read_csv(out / name) if name.endswith(".csv") else pd.read_parquet(out / name)


def _assert_same_tables(a: Path, b: Path) -> None:
    assert (a / "positions.parquet").exists()
    for name in TABLES:
        assert (a / name).exists() == (b / name).exists(), name
        if not (a / name).exists():  # e.g. state_error.parquet of a run without --state-error
            continue
        x, y = _read(a, name), _read(b, name)
        assert list(x.columns) == list(y.columns)
        pd.testing.assert_frame_equal(x, y, check_exact=True)  # every column, bit for bit


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The oracle: the sweep in one plain process."""
    out = tmp_path_factory.mktemp("single") / "run"
    assert main(ARGS + ["-o", str(out)]) == 0
    return out


def test_two_gloo_ranks_equal_one_process(single, tmp_path):
    out = tmp_path / "ranks2"
    r = _torchrun(2, out)
    _assert_same_tables(single, out)
    man = json.loads((out / "manifest.json").read_text())
    assert man["world_size"] == 2 and man["cells_computed_this_run"] == 10
    ranks = man["distributed"]["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1]
    assert [x["pairs"] for x in ranks] == [5, 5] and [x["references"] for x in ranks] == [1, 1]
    assert len(man["distributed"]["memory_plan"]) == 2
    assert "2 ranks" in r.stdout  # only rank 0 prints the summary
    assert r.stdout.count("replayssm-kl: 2 documents") == 1
    assert json.loads((single / "manifest.json").read_text())["world_size"] == 1


def test_accelerate_launch_equals_one_process(single, tmp_path):
    """``accelerate launch --multi_gpu`` starts the ranks through torch's elastic launcher
    (RANK, WORLD_SIZE, ... as torchrun); on CPU they form a gloo group."""
    pytest.importorskip("accelerate")
    with socket.socket() as s:  # a free port for the rendezvous (accelerate's default is 29500)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "acc"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port), "-m", "replayssm_quant.evals.kl", *ARGS, "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _assert_same_tables(single, out)
    assert json.loads((out / "manifest.json").read_text())["world_size"] == 2


def test_stopped_run_resumes_with_another_world_size(single, tmp_path, capsys):
    """One process stops after 5 of 10 cells (--max-cells); two ranks finish the other 5."""
    out = tmp_path / "resume"
    assert main(ARGS + ["-o", str(out), "--max-cells", "5"]) == 0
    assert "5 of 10 cells are done" in capsys.readouterr().out
    assert len(list((out / "parts").glob("*.parquet"))) == 5
    assert not (out / "positions.parquet").exists()  # tables only once every cell is done
    stopped = json.loads((out / "parts" / "invocations.jsonl").read_text())
    assert stopped["cells_computed"] == 5 and stopped["timings"]["total_s"] > 0
    _torchrun(2, out)
    man = json.loads((out / "manifest.json").read_text())
    assert man["cells_computed_this_run"] == 5 and man["world_size"] == 2
    # the stopped invocation's compute and command count in the final manifest
    assert len(man["commands"]) == 2
    assert man["timings"]["total_s"] > man["timings_this_invocation"]["total_s"]
    assert not (out / "parts" / "invocations.jsonl").exists()
    assert sum(x["pairs"] for x in man["distributed"]["ranks"]) == 5
    _assert_same_tables(single, out)


def test_killed_rank_loses_only_its_unfinished_cells(single, tmp_path):
    """Rank 1 of a 2-rank run is killed (SIGKILL) once some cell is written; the launcher stops
    rank 0; the finished part files stay, and one process resumes to the tables of the
    uninterrupted run."""
    psutil = pytest.importorskip("psutil")
    out = tmp_path / "killed"
    # 4 documents so that every rank has a second document still to run when the first is done
    args = _args(docs=4)
    proc = subprocess.Popen(_launcher(2) + args + ["-o", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), start_new_session=True)
    killed = None
    try:
        deadline = time.time() + LAUNCH_TIMEOUT
        while time.time() < deadline and proc.poll() is None:
            if list((out / "parts").glob("*.parquet")) if (out / "parts").exists() else []:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    try:
                        if child.environ().get("RANK") == "1":
                            child.send_signal(signal.SIGKILL)
                            killed = child.pid
                    except psutil.Error:
                        pass
                break
            time.sleep(0.02)
        proc.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    done = len(list((out / "parts").glob("*.parquet")))
    if killed is not None and done < 20:
        assert proc.returncode != 0  # the launcher reports the dead rank
        assert not (out / "positions.parquet").exists()
    # one process computes the rest; the oracle for 4 documents is the same command, uninterrupted
    assert main(args + ["-o", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert man["cells_computed_this_run"] == 20 - done and man["world_size"] == 1
    whole = tmp_path / "whole"
    shutil.copytree(single, whole)  # its 10 parts are the first two documents' cells
    assert main(args + ["-o", str(whole)]) == 0
    _assert_same_tables(whole, out)


def test_cells_in_passes_give_the_same_tables(single, tmp_path, capsys):
    """--cells-per-pass 4 runs each document's 5 computed cells in passes of 4 and 1 (the
    reference once per pass): the same tables. A budget that only passes of fewer cells fit is refused with the
    largest --cells-per-pass that fits."""
    import re

    from replayssm_quant.evals.kl import _check_args, build_parser, cell_plan, plan_ranks
    from replayssm_quant.evals.kl.memory import GIB, model_shape
    from replayssm_quant.models import load_model

    out = tmp_path / "passes"
    assert main(ARGS + ["-o", str(out), "--cells-per-pass", "4"]) == 0
    _assert_same_tables(single, out)
    assert json.loads((out / "manifest.json").read_text())["distributed"]["ranks"][0]["references"] == 4
    a = build_parser().parse_args(ARGS + ["-o", str(tmp_path / "plan")])
    cells = cell_plan(_check_args(a), a)[2]
    shape = model_shape(load_model("tiny-gdn", tokenizer=False)[0].config, "float32")
    todo = [(d, c) for d in range(2) for c in range(len(cells))]
    need = {}
    for g in (0, 2):
        a.cells_per_pass = g
        need[g] = plan_ranks(a, shape, cells, todo, D.Ranks())[0].total("cpu")
    assert need[2] < need[0]
    budget = (need[0] + need[2]) / 2 / GIB
    capsys.readouterr()
    assert main(ARGS + ["-o", str(tmp_path / "x"), "--dry-run", "--memory-budget", str(budget)]) == 2
    g = int(re.search(r"--cells-per-pass (\d) \(fits\)", capsys.readouterr().err).group(1))
    assert 2 <= g < 5
    assert main(ARGS + ["-o", str(tmp_path / "x"), "--dry-run", "--memory-budget", str(budget),
                        "--cells-per-pass", str(g)]) == 0


# ------------------------------------------------------------------ pieces without processes
def test_ranks_from_env_and_bad_values():
    assert D.ranks_from_env({}) == D.Ranks()
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert D.ranks_from_env(env) == D.Ranks(3, 4, 1, 2, True)
    for bad, words in ((dict(env, RANK="x"), "RANK='x' is not an integer"),
                       (dict(env, RANK="4"), "RANK=4 must be in [0, WORLD_SIZE) = [0, 4)"),
                       (dict(env, LOCAL_RANK="2"), "LOCAL_RANK=2 must be in"),
                       ({"WORLD_SIZE": "2", "RANK": "0"}, "MASTER_ADDR/MASTER_PORT"),
                       ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK is not set")):
        with pytest.raises(D.BadArgs, match=words.replace("[", r"\[").replace(")", r"\)")):
            D.ranks_from_env(bad)
    with pytest.raises(D.BadArgs, match="started by MPI .OMPI_COMM_WORLD_SIZE=2."):
        D.ranks_from_env({"OMPI_COMM_WORLD_SIZE": "2"})
    # --dry-run plans for WORLD_SIZE ranks from one process
    assert D.ranks_from_env({"WORLD_SIZE": "3"}, planning=True) == D.Ranks(0, 3, 0, 3, False)


def test_shard_is_contiguous_balanced_and_complete():
    pairs = [(d, c) for d in range(3) for c in range(5)]
    for w in (1, 2, 4, 7, 20):
        blocks = D.shard(pairs, w)
        assert len(blocks) == w and sum(blocks, []) == pairs
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
        # each document's cells sit in consecutive ranks: at most w - 1 extra references
        refs = sum(len({d for d, _ in b}) for b in blocks)
        assert refs <= 3 + w - 1


def test_gpu_groups_and_rank_devices():
    assert D.gpu_group(0, 2, 4) == [0, 1] and D.gpu_group(1, 2, 4) == [2, 3]
    assert D.gpu_group(1, 2, 5) == [2, 3]  # the fifth GPU stays unused
    assert D.gpu_group(0, 1, 1) == [0]
    with pytest.raises(D.BadArgs, match="needs at least 4 visible GPUs"):
        D.gpu_group(0, 4, 2)
    launched = D.Ranks(1, 2, 1, 2, True)
    assert D.rank_device("cpu", launched, 0) == "cpu"
    assert D.rank_device("cuda", launched, 2) == "cuda:1"
    assert D.rank_device("cuda:1", D.Ranks(), 2) == "cuda:1"
    with pytest.raises(D.BadArgs, match="names one GPU"):
        D.rank_device("cuda:0", launched, 2)
    with pytest.raises(D.BadArgs, match="2 ranks on this node but 1 visible GPUs"):
        D.rank_device("cuda", launched, 1)


# ------------------------------------------------------------------ memory plan, device map
SMALL = ["--model", "tiny-gdn", "-N", "32", "--max-docs", "2", "--policies", "shared:nvfp4+sr",
         "read:nvfp4/rec:fp32", "--stepwise-check", "4", "--no-progress"]


def test_dry_run_plans_every_rank(tmp_path, capsys, monkeypatch):
    """Under WORLD_SIZE=2 (as torchrun sets it) the dry run shows each rank's share and memory,
    per device, and the cache of each policy (one checkpoint for shared:, two for read:/rec:)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "dry"
    assert main(SMALL + ["-o", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "0 of 4 (document, cell) pairs already done" in text and "world size 2" in text
    assert "rank 0: cpu: 2 pairs over 1 document(s)" in text
    assert "rank 1: cpu: 2 pairs over 1 document(s)" in text
    assert "memory estimate per rank" in text and text.count(": fits") == 2
    lines = {ln.split()[0]: ln for ln in text.splitlines() if "state " in ln and " = " in ln}
    assert "shared:nvfp4+sr" in lines and "read:nvfp4/rec:fp32" in lines
    assert not out.exists()


def test_plan_that_does_not_fit_is_refused_before_any_compute(tmp_path, capsys):
    out = tmp_path / "nofit"
    for extra in (["--dry-run"], []):
        assert main(SMALL + ["-o", str(out), "--memory-budget", "0.2", *extra]) == 2
        err = capsys.readouterr().err
        assert "the plan does not fit: rank 0 needs about" in err and "budget is 204.8 MiB" in err
        assert "--device-map auto" in err and "\n" not in err.strip()
        assert not out.exists()


def test_window_far_past_the_documents_is_planned_and_refused(tmp_path, capsys):
    """Each window is padded to its full L, so a window of 100000 tokens over 32-token documents
    needs hundreds of GiB of [rows, H, L, L] products: the plan counts them and refuses before
    any compute (the run used to end in an allocator error after a dry run said it fits)."""
    out = tmp_path / "wide"
    base = ["--model", "tiny-gdn", "-N", "32", "--max-docs", "1", "--policies", "shared:nvfp4",
            "--stepwise-check", "0", "--no-progress", "-o", str(out), "--memory-budget", "64"]
    for extra in (["--dry-run"], []):
        assert main(base + ["--windows", "100000", *extra]) == 2
        err = capsys.readouterr().err
        assert "the plan does not fit" in err and "--windows" in err and "GiB" in err
        assert not out.exists()
    assert main(base + ["--windows", "4096", "--dry-run"]) == 0
    capsys.readouterr()


def test_memory_plan_of_a_finished_run_and_resume_state(tmp_path, capsys):
    """The manifest records every rank's plan and measured peak; a dry run over a finished
    directory reports nothing left to compute."""
    out = tmp_path / "run"
    assert main(SMALL + ["-o", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    plan = man["distributed"]["memory_plan"][0]
    assert plan["pairs"] == 4 and plan["live_caches"] == 3 and plan["total"]["cpu"] > plan["weights"]["cpu"]
    assert man["distributed"]["ranks"][0]["peak_memory"]["cpu"] > 0
    capsys.readouterr()
    assert main(SMALL + ["-o", str(out), "--dry-run"]) == 0
    assert "4 of 4 (document, cell) pairs already done" in capsys.readouterr().out


def test_device_map_auto_on_cpu_is_the_single_device_run(tmp_path):
    a, b = tmp_path / "plain", tmp_path / "devmap"
    assert main(SMALL + ["-o", str(a)]) == 0
    assert main(SMALL + ["-o", str(b), "--device-map", "auto"]) == 0
    _assert_same_tables(a, b)
    assert json.loads((b / "manifest.json").read_text())["distributed"]["device_map"] == "auto"


@pytest.mark.parametrize("bad,words", [
    (["--max-cells", "0"], "--max-cells must be > 0, got 0"),
    (["--cells-per-pass", "-1"], "--cells-per-pass must be >= 0 (0 = all cells in one pass), got -1"),
    (["--memory-budget", "0"], "--memory-budget must be finite and > 0 (GiB per device), got 0.0"),
    (["--memory-budget", "inf"], "--memory-budget must be finite and > 0 (GiB per device), got inf"),
    (["--dist-timeout", "-1"], "--dist-timeout must be > 0 minutes, got -1.0"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:I, got 'tpu'"),
])
def test_bad_distributed_arguments_exit_2(bad, words, tmp_path, capsys):
    assert main(SMALL + ["-o", str(tmp_path / "x"), *bad]) == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_ranks_with_other_arguments_are_refused_before_any_work(tmp_path):
    """Two ranks started with different settings into a new folder (no run_identity.json yet
    for them to check): refused by name on rank 0 (exit 2) before any cell, where before they
    computed other cells into the same tables. The wrapper adds --dtype float64 to rank 1."""
    wrap = tmp_path / "wrap.sh"
    base = _launcher(1)[_launcher(1).index("--max-restarts") + 2:]  # how to run replayssm-kl
    run = " ".join(base[1:] if base[0] == "--no-python" else [sys.executable] + base)
    wrap.write_text(f'#!/bin/sh\nif [ "$RANK" = 1 ]; then exec {run} "$@" --dtype float64; '
                    f'else exec {run} "$@"; fi\n')
    wrap.chmod(0o755)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "--no-python", str(wrap)]
    out = tmp_path / "mixed"
    r = subprocess.run(cmd + ARGS + ["-o", str(out)], capture_output=True, text=True,
                       timeout=LAUNCH_TIMEOUT, env=_env())
    assert r.returncode != 0
    assert "the ranks were started with different arguments or data (" in r.stderr
    assert "dtype: 'float32' on rank 0, 'float64' on rank 1" in r.stderr
    assert not list(out.glob("parts/*.parquet"))  # nothing computed


def test_fingerprint_names_what_differs(tmp_path):
    """_check_same_run on a fake two-rank group: equal fingerprints pass; a rank with other
    seeds, documents or --gdn-fold is named with the keys that differ."""
    from replayssm_quant.evals.kl import BadArgs, _check_same_run, build_parser

    class Group:
        def __init__(self, other):
            self.other = other

        def all_gather(self, obj):
            return [obj, self.other(obj)]

    a = build_parser().parse_args(SMALL + ["-o", str(tmp_path / "x")])
    cfg = type("Cfg", (), {"to_json_string": lambda self: "{}"})()
    cells = [("shared:nvfp4+sr", 4, 0)]
    docs = [{"id": "d0", "sha": "aa"}, {"id": "d1", "sha": "bb"}]
    _check_same_run(a, cfg, cells, docs, Group(lambda fp: dict(fp)))
    for change, key in ((lambda fp: {**fp, "cells": ["x"]}, "cells"),
                        (lambda fp: {**fp, "documents": fp["documents"][:1]}, "documents"),
                        (lambda fp: {**fp, "gdn_fold": "cached"}, "gdn_fold")):
        with pytest.raises(BadArgs, match=rf"\({key}: .* on rank 0, .* on rank 1\)"):
            _check_same_run(a, cfg, cells, docs, Group(change))


def test_bad_launcher_environment_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "two")
    assert main(SMALL + ["-o", str(tmp_path / "x")]) == 2
    assert "RANK='two' is not an integer" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    assert main(SMALL + ["-o", str(tmp_path / "x")]) == 2  # no MASTER_ADDR: not a launcher
    assert "start the ranks with torchrun or accelerate launch" in capsys.readouterr().err


def test_device_map_plan_splits_weights_over_a_rank_gpus():
    """The GPU placement of --device-map auto, computed on CPU from fake budgets: a rank with two
    GPUs gets the decoder layers split over both (accelerate's balanced map, the map the run
    loads with); budgets too small for the weights are refused, naming the offload."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from replayssm_quant.config import StateConfig
    from replayssm_quant.evals.kl.memory import GIB, model_shape, plan_rank
    from replayssm_quant.models import resolve_model_path

    shape = model_shape(AutoConfig.from_pretrained(resolve_model_path("tiny-gdn")), "float32")
    a = SimpleNamespace(max_tokens=64, prefill=0, segment_len=64, batch_size=1, stepwise_check=0)
    ref = StateConfig.build("fp32")
    cfgs = [StateConfig.build("shared:nvfp4+sr")]
    budget = {"cuda:0": 3 * GIB, "cuda:1": 3 * GIB}
    p = plan_rank(0, shape, a, [(0, 0)], cfgs, ref, ["cuda:0", "cuda:1"], budget, [0, 1])
    assert p.fits and set(p.device_map.values()) == {0, 1}
    assert sum(p.weights.values()) == shape.weights_bytes and min(p.weights.values()) > 0
    # room for a quarter of the weights on each GPU besides caches, logits and activations
    tight = {d: p.total(d) - p.weights[d] + shape.weights_bytes // 4 for d in budget}
    p = plan_rank(0, shape, a, [(0, 0)], cfgs, ref, ["cuda:0", "cuda:1"], tight, [0, 1])
    assert not p.fits and "do not fit on its 2 GPU(s) cuda:0,1" in p.why()


def test_output_dir_not_shared_by_every_rank_is_refused(tmp_path):
    """Rank 0 merges the part files every rank writes, so all ranks must see one --output-dir;
    a rank that does not see rank 0's probe file stops the run (exit 2) before any compute."""
    from transformers import AutoConfig

    from replayssm_quant.evals.kl import _check_shared_output, build_parser
    from replayssm_quant.models import resolve_model_path

    class TwoRanks:  # rank 0's view of a group whose rank 1 mounts another filesystem
        rank, world_size = 0, 2

        def broadcast(self, obj):
            return obj

        def all_gather(self, obj):
            return [obj, False if isinstance(obj, bool) else obj]

    a = build_parser().parse_args(["-o", str(tmp_path / "o")])
    cfg = AutoConfig.from_pretrained(resolve_model_path("tiny-gdn"))
    with pytest.raises(D.BadArgs, match=r"is not shared: ranks \[1\] do not see"):
        _check_shared_output(a, cfg, TwoRanks())
    assert not [f for f in (tmp_path / "o" / "parts").iterdir() if f.name.startswith(".rank0-probe")]


def test_run_without_a_memory_plan_warns_and_runs(tmp_path, capsys, monkeypatch):
    """A config the meta model cannot be built from leaves no memory plan: the run warns and
    goes on (loading is from_pretrained's business); --device-map auto on CUDA would need it."""
    import replayssm_quant.evals.kl as K

    def broken(cfg, dtype):
        raise RuntimeError("custom code")

    monkeypatch.setattr(K, "model_shape", broken)
    out = tmp_path / "noplan"
    assert main(SMALL + ["-o", str(out)]) == 0
    assert "warning: no memory plan" in capsys.readouterr().err
    man = json.loads((out / "manifest.json").read_text())
    assert man["model"]["params"] > 0 and man["distributed"]["memory_plan"] == []


@pytest.mark.slow  # 76 s on 2 cores (2026-12-02); the two-rank equality is also test_two_gloo_ranks_equal_one_process
def test_policy_map_cells_under_two_ranks_equal_one_process(tmp_path):
    """Policy-map cells (a per-layer rule and a per-head rule with a dual format) sharded over
    two gloo ranks give every table bit for bit as one plain process."""
    maps = ["map:shared:nvfp4+sr@L1=fp32",
            "map:shared:nvfp4+sr@L0H0-1=read:nvfp4/rec:fp16+sr@L4=eager:fp8e4m3"]
    args = ["--model", "tiny-gdn", "-N", "64", "--max-docs", "2", "--segment-len", "32",
            "--policies", *maps, "--seeds", "0", "1", "--state-error", "--no-progress",
            "--dist-timeout", "3"]
    one = tmp_path / "one"
    assert main(args + ["-o", str(one)]) == 0
    two = tmp_path / "two"
    r = subprocess.run(_launcher(2) + args + ["-o", str(two)], capture_output=True, text=True,
                       timeout=LAUNCH_TIMEOUT, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _assert_same_tables(one, two)
    pos = _read(one, "positions.parquet")
    assert pos["policy"].nunique() == 2  # both maps ran (and differ from each other)
    kl = pos.groupby("policy")["kl"].mean()
    assert kl.min() > 0 and kl.iloc[0] != kl.iloc[1]
