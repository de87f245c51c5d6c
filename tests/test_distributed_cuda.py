"""Issue 16 on CUDA (skipped without it): torchrun with NCCL and ``--device-map auto`` give
the tables of the plain single-GPU run bit for bit; the lm-eval adapter under HFLM's
``parallelize=True`` and ``accelerate launch`` data parallelism gives the single-device scores.

Run on a GPU machine: ``python -m pytest tests/test_distributed_cuda.py -v`` (one GPU runs the
first three tests; two or four GPUs the rest). The large-model check is
``benchmarks/distributed_check.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayssm_quant.evals.kl import main

from test_kl_distributed import _assert_same_tables, _env, _launcher

REPO = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
cuda = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
four_gpus = pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA GPUs")

ARGS = ["--model", "tiny-gdn", "-N", "256", "--max-docs", "2", "--segment-len", "128",
        "--policies", "shared:nvfp4+sr", "eager:fp8e4m3", "read:nvfp4/rec:fp16+sr",
        "--seeds", "0", "1", "--stepwise-check", "16", "--no-progress", "--state-error", "--device", "cuda",
        "--dist-timeout", "10"]


def _torchrun(nproc: int, out: Path, *extra):
    r = subprocess.run(_launcher(nproc) + ARGS + ["-o", str(out), *extra], capture_output=True,
                       text=True, timeout=900, env=_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The oracle: the sweep in one plain process on cuda:0."""
    out = tmp_path_factory.mktemp("cuda_plain") / "run"
    assert main(ARGS + ["-o", str(out)]) == 0
    return out


@cuda
def test_torchrun_one_gpu_equals_plain_run(plain, tmp_path):
    man = _torchrun(1, tmp_path / "tr1")
    _assert_same_tables(plain, tmp_path / "tr1")
    assert man["world_size"] == 1 and man["distributed"]["ranks"][0]["device"] == "cuda:0"


@cuda
def test_device_map_auto_equals_plain_run(plain, tmp_path):
    out = tmp_path / "devmap"
    assert main(ARGS + ["-o", str(out), "--device-map", "auto"]) == 0
    _assert_same_tables(plain, out)
    man = json.loads((out / "manifest.json").read_text())
    assert man["distributed"]["memory_plan"][0]["devices"] == [f"cuda:{i}" for i in range(GPUS)]


@cuda
def test_lm_eval_parallelize_true_equals_one_gpu():
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from replayssm_quant.evals.lm_eval_adapter import ReplaySSMLM

    reqs = [("In the beginning God created the heaven and the earth.", " And the earth was void"),
            ("And God said, Let there be light:", " and there was light.")]

    def ll(lm):
        return [r[0] for r in lm.loglikelihood(
            [Instance("loglikelihood", {}, q, i) for i, q in enumerate(reqs)], disable_tqdm=True)]

    kw = dict(pretrained="tiny-gdn", state="shared:nvfp4+sr", window=4, batch_size=2)
    assert ll(ReplaySSMLM(**kw, parallelize=True)) == ll(ReplaySSMLM(**kw, device="cuda:0"))


@two_gpus
def test_two_nccl_ranks_equal_plain_run(plain, tmp_path):
    man = _torchrun(2, tmp_path / "tr2")
    _assert_same_tables(plain, tmp_path / "tr2")
    assert [r["device"] for r in man["distributed"]["ranks"]] == ["cuda:0", "cuda:1"]


@four_gpus
def test_two_ranks_each_sharding_over_two_gpus(plain, tmp_path):
    man = _torchrun(2, tmp_path / "tr2dm", "--device-map", "auto")
    _assert_same_tables(plain, tmp_path / "tr2dm")
    plans = man["distributed"]["memory_plan"]
    assert [p["devices"] for p in plans] == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]


@two_gpus
def test_lm_eval_accelerate_launch_two_gpus_equals_one(tmp_path):
    pytest.importorskip("accelerate")

    def run(nproc, out):
        launch = ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                   "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no",
                   "--dynamo_backend", "no", "-m"] if nproc > 1 else [sys.executable, "-m"])
        cmd = launch + ["replayssm_quant.evals.lm_eval_adapter", "--model", "replayssm",
                        "--model_args", "pretrained=tiny-gdn,state=shared:nvfp4+sr,window=8",
                        "--tasks", "kjv_longctx_mc", "--include_path", str(REPO / "evals" / "tasks"),
                        "--limit", "8", "--output_path", str(out), "--log_samples",
                        "--metadata", json.dumps({"context_chars": 1200})]
        env = dict(_env(), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        samples = sorted(out.rglob("samples_*.jsonl"))
        assert samples
        rows = [json.loads(x) for f in samples for x in f.read_text().splitlines()]
        return {row["doc_id"]: row["resps"] for row in rows}

    assert run(2, tmp_path / "dp2") == run(1, tmp_path / "dp1")

