"""Issue 16 on one GPU: ``replayssm-kl`` under torchrun and with ``--device-map auto``.

One command (about 6-8 minutes on one H200; needs ~45 GB of free disk under --workdir):

    python benchmarks/distributed_check.py --out benchmarks/results/distributed_h200.json

(a) **torchrun with 1 GPU equals the plain run**: the embedded tiny-gdn, 2 documents x 2048
    tokens, 3 policies x 2 seeds, stepwise check of 16 positions, ``--state-error``, run by ``replayssm-kl
    --device cuda`` and by ``torchrun --nproc-per-node 1 --no-python replayssm-kl --device
    cuda`` (NCCL process group); every column of positions.parquet, stepwise.parquet,
    summary.csv, buckets.parquet and state_error.parquet compared bit for bit.
(b) **a model larger than half the GPU in FP32**: a random-weight qwen3_5 of about 20 B
    parameters (hidden 5120, 48 layers: 81 GB in FP32, more than half of the H200's 141 GB),
    built on the GPU from a config with a fixed seed and saved once as a BF16 checkpoint
    (40 GB). Then, N = 8192 tokens of one KJV document (bytes as tokens), the fp32 reference
    and the policies ``read:nvfp4/rec:fp32 shared:nvfp4+sr``, L = 16, segments of 2048:

    * ``devmap_fp32``: ``--device-map auto --dtype float32`` (accelerate places the FP32
      weights; the plan, checked before loading, is in the manifest);
    * ``unsharded_fp32``: ``--dtype float32`` without a device map: the same weights (the
      BF16 checkpoint is exact in FP32) loaded as one model;
    * ``unsharded_bf16``: ``--dtype bfloat16``: the same weights, BF16 compute.

    Acceptance: ``devmap_fp32`` equals ``unsharded_fp32`` to the FP32 tolerance of the
    reference path (``FP32_TOL``: |delta| of nll_ref and nll <= 1e-4 nats, of kl and dp_ref <=
    1e-5; bit-identical is expected on one GPU). ``devmap_fp32`` against ``unsharded_bf16``
    is reported (per-column differences, each policy's kl_mean in both): BF16 compute
    moves the logits far more than the FP32 tolerance, so it is informational.
    Also: the dry run of ``devmap_fp32`` (its memory plan) and a plan that cannot fit
    (``--memory-budget`` below the weights) refused with exit code 2 before loading anything.

``--tiny`` runs the same steps at toy size on any device (a 4-layer qwen3_5, N = 64), in a few
seconds on CPU (gloo instead of NCCL): tests/test_distributed_check.py runs it in CI.
JSON: every run's command, wall time, exit code, memory plan and measured peak, its cost
(``cost``: compute seconds, mean seconds per cell, cells/hour per device: the numbers of
docs/distributed.md's H200 table), and the comparisons; ``pass`` is true when (a) and (b)'s
acceptance hold. ``--skip unsharded_bf16`` saves about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TABLES = ("positions.parquet", "stepwise.parquet", "summary.csv", "buckets.parquet",
          "state_error.parquet")
#: FP32 tolerance of the reference path (the fp32-policy path agrees with the unpatched FP32
#: model to 1.5e-6..3.3e-5 in the logits, docs/kl-runner.md): per position, nats
FP32_TOL = {"nll_ref": 1e-4, "nll": 1e-4, "kl": 1e-5, "dp_ref": 1e-5}
BIG = {"hidden": 5120, "layers": 48}
TINY = {"hidden": 256, "layers": 4}


def qwen3_5_config(hidden: int, layers: int, vocab: int):
    """A qwen3_5 text config shaped like benchmarks/kl_throughput.py's random model (3 GDN
    layers per full-attention layer, 128-wide heads, MLP 3x hidden, tied embeddings)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128), num_key_value_heads=max(1, hidden // 512),
        head_dim=128 if hidden >= 128 else hidden, linear_num_key_heads=max(1, hidden // 128),
        linear_num_value_heads=max(1, hidden // 64), linear_key_head_dim=128 if hidden >= 128 else 32,
        linear_value_head_dim=128 if hidden >= 128 else 32, linear_conv_kernel_dim=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=65536, tie_word_embeddings=True, initializer_range=0.02)


def build_model_dir(path: Path, hidden: int, layers: int, vocab: int, device: str) -> dict:
    """Random weights (seed 0, initialised on ``device``), saved as a BF16 checkpoint in
    ``path`` (reused when it already holds this config)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = qwen3_5_config(hidden, layers, vocab)
    marker = path / "distributed_check.json"
    want = {"hidden": hidden, "layers": layers, "vocab": vocab, "dtype": "bfloat16", "seed": 0}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return dict(want, reused=True, seconds=0.0)
    t0 = time.time()
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    marker.write_text(json.dumps(want))
    return dict(want, reused=False, params=params, seconds=time.time() - t0)


def cli(args: list, *, launcher: list | None = None, in_process: bool = False,
        timeout: int = 900) -> tuple[list, int, str, str]:
    """``replayssm-kl args`` in this process, as a subprocess, or under ``launcher``:
    ``(command, exit code, stdout, stderr)``."""
    cmd = (launcher or [sys.executable, "-m", "replayssm_quant.evals.kl"]) + list(args)
    if in_process and launcher is None:
        import contextlib
        import io

        from replayssm_quant.evals.kl import main

        o, e = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
            rc = main(list(args))
        return cmd, rc, o.getvalue(), e.getvalue()
    env = {k: v for k, v in os.environ.items() if k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return cmd, r.returncode, r.stdout, r.stderr


def kl(args: list, out: Path, **kw) -> dict:
    """One ``replayssm-kl`` run into ``out`` (:func:`cli`), with its manifest's essentials."""
    t0 = time.time()
    cmd, rc, so, se = cli(list(args) + ["-o", str(out)], **kw)
    tail = so[-4000:] + se[-4000:]
    res = {"command": " ".join(map(str, cmd)), "rc": rc, "wall_s": time.time() - t0}
    man = out / "manifest.json"
    if rc == 0 and man.exists():
        m = json.loads(man.read_text())
        t = m.get("timings_this_invocation") or {}
        compute = t.get("reference_s", 0.0) + sum(t.get("policies_s", {}).values()) + t.get("stepwise_s", 0.0)
        n = m.get("cells_computed_this_run") or 0
        gpus = max(1, sum(len(p["devices"]) for p in m["distributed"]["memory_plan"]))
        res["cost"] = {"cells": n, "compute_s": compute, "load_s": t.get("load_s"),
                       "cell_s_mean": sum(t.get("policies_s", {}).values()) / n if n else None,
                       "reference_s": t.get("reference_s"),
                       "cells_per_hour_per_device": 3600 * n / compute / gpus if compute else None}
        res.update(world_size=m.get("world_size"), timings=m.get("timings_this_invocation"),
                   memory_plan=m["distributed"]["memory_plan"],
                   peak_memory=[r.get("peak_memory") for r in m["distributed"]["ranks"]],
                   devices=[r.get("device") for r in m["distributed"]["ranks"]],
                   params=m["model"]["params"])
    else:
        res["output_tail"] = tail
    return res


def compare(a: Path, b: Path, tol: dict | None = None) -> dict:
    """Column-by-column comparison of two output directories: values whose bits differ (NaN
    equal to NaN), max |difference| of float columns, and whether every difference is within
    ``tol`` (per column; columns not in ``tol`` must be identical)."""
    import numpy as np
    import pandas as pd

    out, identical, within = {}, True, True
    for name in TABLES:
        fa, fb = a / name, b / name
        if not fa.exists() and not fb.exists():
            continue
        read = pd.read_csv if name.endswith(".csv") else pd.read_parquet
        x, y = read(fa), read(fb)
        if list(x.columns) != list(y.columns) or len(x) != len(y):
            out[name] = {"shape": [list(x.shape), list(y.shape)]}
            identical = within = False
            continue
        cols = {}
        for c in x.columns:
            u, v = x[c].to_numpy(), y[c].to_numpy()
            if u.dtype.kind == "f":
                same = (u == v) | (np.isnan(u) & np.isnan(v))
                diff = np.abs(u.astype(np.float64) - v.astype(np.float64))
                mx = float(np.nanmax(diff)) if np.isfinite(diff).any() else 0.0
                cols[c] = {"differing": int((~same).sum()), "max_abs_diff": mx,
                           "mean_abs_diff": float(np.nanmean(diff)) if diff.size else 0.0}
                ok = not (~same).any() or (tol is not None and c in tol and mx <= tol[c])
            else:
                n = int((u != v).sum())
                cols[c] = {"differing": n}
                ok = n == 0
            identical &= cols[c]["differing"] == 0
            within &= ok
        out[name] = {"rows": len(x), "columns": cols}
    return {"identical": identical, "within_tolerance": within, "tables": out}


def policy_means(d: Path) -> dict:
    """Mean KL and top-1 agreement per policy of a run (positions.parquet)."""
    import pandas as pd

    p = pd.read_parquet(d / "positions.parquet")
    fin = p[~p["nonfinite"]]
    return {pol: {"kl_mean": float(fin.loc[fin["policy"] == pol, "kl"].mean()),
                  "top1_agree": float(g["top1_agree"].mean())}
            for pol, g in p.groupby("policy")}


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--workdir", default="/tmp/replayssm-distributed-check",
                   help="model checkpoint and run outputs (the 20 B model needs ~45 GB)")
    p.add_argument("--tiny", action="store_true", help="toy sizes, for CI (any device)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--N", type=int, default=None, help="tokens of the large-model runs (default 8192)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size of the large model (5120)")
    p.add_argument("--layers", type=int, default=None, help="layers of the large model (48)")
    p.add_argument("--skip", nargs="*", default=[], choices=("torchrun", "unsharded_fp32", "unsharded_bf16"),
                   help="leave out parts (time)")
    a = p.parse_args(argv)
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {dev}: CUDA is not available")
    size = TINY if a.tiny else BIG
    hidden, layers = a.hidden or size["hidden"], a.layers or size["layers"]
    N = a.N or (64 if a.tiny else 8192)
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "tiny": a.tiny, "device": dev,
           "gpu": torch.cuda.get_device_name(0) if dev.startswith("cuda") else platform.processor() or "cpu",
           "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if dev.startswith("cuda") else None,
           "torch": torch.__version__, "fp32_tolerance": FP32_TOL, "runs": {}}

    def save():
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        res["total_s"] = time.time() - t_start
        Path(a.out).write_text(json.dumps(res, indent=2, default=str))

    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    script = Path(sys.executable).parent / "replayssm-kl"
    launcher += ["--no-python", str(script)] if script.exists() else ["-m", "replayssm_quant.evals.kl"]
    inproc = a.tiny  # toy runs in this process (fast); GPU runs in their own processes

    # ------------------------------------------------------------------ (a) torchrun, 1 GPU
    ok_a = True
    if "torchrun" not in a.skip:
        small = ["--model", "tiny-gdn", "-N", "64" if a.tiny else "2048", "--max-docs", "2",
                 "--policies", "shared:nvfp4+sr", "eager:fp8e4m3", "read:nvfp4/rec:fp16+sr",
                 "--seeds", "0", "1", "--stepwise-check", "8" if a.tiny else "16", "--state-error",
                 "--no-progress", "--device", dev]
        for d in ("a_plain", "a_torchrun1"):
            shutil.rmtree(work / d, ignore_errors=True)
        res["runs"]["a_plain"] = kl(small, work / "a_plain", in_process=inproc)
        res["runs"]["a_torchrun1"] = kl(small, work / "a_torchrun1", launcher=launcher)
        cmp_a = compare(work / "a_plain", work / "a_torchrun1")
        ok_a = res["runs"]["a_plain"]["rc"] == 0 and res["runs"]["a_torchrun1"]["rc"] == 0 \
            and cmp_a["identical"]
        res["a_torchrun_1gpu_vs_plain"] = {"pass": ok_a, **cmp_a}
        print(f"(a) torchrun 1 process vs plain: identical={cmp_a['identical']}", flush=True)
        save()

    # ------------------------------------------------------------------ (b) large model
    mdir = work / f"qwen3_5-h{hidden}-l{layers}-bf16"
    res["model"] = build_model_dir(mdir, hidden, layers, 32000 if not a.tiny else 4096, dev)
    print(f"(b) model {mdir}: {res['model']}", flush=True)
    save()
    big = ["--model", str(mdir), "-N", str(N), "--max-docs", "1", "--segment-len",
           str(min(2048, N)), "--policies", "read:nvfp4/rec:fp32", "shared:nvfp4+sr",
           "--windows", "16", "--stepwise-check", "0", "--no-progress", "--device", dev]
    devmap = big + ["--dtype", "float32", "--device-map", "auto"]
    _, rc, so, se = cli(devmap + ["--dry-run", "-o", str(work / "b_dry")], in_process=inproc)
    res["dry_run_devmap_fp32"] = {"rc": rc, "stdout": so[-6000:], "stderr": se[-2000:]}
    from replayssm_quant.evals.kl.memory import GIB, model_shape
    from transformers import AutoConfig

    weights = model_shape(AutoConfig.from_pretrained(mdir), "float32").weights_bytes
    res["weights_fp32_bytes"] = weights
    if dev.startswith("cuda"):
        res["weights_fp32_over_gpu_memory"] = weights / res["gpu_memory_bytes"]
    budget = f"{weights / 2 / GIB:.3f}"  # half the weights: cannot fit
    shutil.rmtree(work / "b_refused", ignore_errors=True)
    _, rc, _, se = cli(devmap + ["--memory-budget", budget, "-o", str(work / "b_refused")],
                       in_process=inproc)
    res["refused_plan"] = {"memory_budget_gib": float(budget), "rc": rc, "stderr": se[-2000:],
                           "wrote_nothing": not (work / "b_refused").exists()}
    ok_refused = rc == 2 and not (work / "b_refused").exists()
    save()
    runs = {"devmap_fp32": devmap, "unsharded_fp32": big + ["--dtype", "float32"],
            "unsharded_bf16": big + ["--dtype", "bfloat16"]}
    for name, args in runs.items():
        if name in a.skip:
            continue
        shutil.rmtree(work / f"b_{name}", ignore_errors=True)
        res["runs"][name] = kl(args, work / f"b_{name}", in_process=inproc)
        print(f"    {name}: rc {res['runs'][name]['rc']}, {res['runs'][name]['wall_s']:.1f} s", flush=True)
        save()
    ok_b = res["runs"]["devmap_fp32"]["rc"] == 0
    if "unsharded_fp32" in res["runs"]:
        c = compare(work / "b_devmap_fp32", work / "b_unsharded_fp32", FP32_TOL)
        ok_b &= res["runs"]["unsharded_fp32"]["rc"] == 0 and c["within_tolerance"]
        res["b_devmap_fp32_vs_unsharded_fp32"] = {"pass": ok_b, **c}
        print(f"(b) devmap FP32 vs unsharded FP32 (same weights): identical={c['identical']}, "
              f"within FP32 tolerance={c['within_tolerance']}", flush=True)
    if "unsharded_bf16" in res["runs"] and res["runs"]["unsharded_bf16"]["rc"] == 0 and ok_b:
        c = compare(work / "b_devmap_fp32", work / "b_unsharded_bf16", FP32_TOL)
        res["b_devmap_fp32_vs_unsharded_bf16"] = {
            "informational": "BF16 compute of the same weights; expected outside the FP32 tolerance",
            "policy_means_devmap_fp32": policy_means(work / "b_devmap_fp32"),
            "policy_means_unsharded_bf16": policy_means(work / "b_unsharded_bf16"), **c}
        print(f"(b) devmap FP32 vs unsharded BF16: within FP32 tolerance={c['within_tolerance']} "
              f"(informational)", flush=True)
    res["b_refused_plan_pass"] = ok_refused
    res["pass"] = bool(ok_a and ok_b and ok_refused)
    save()
    print(f"pass={res['pass']}  ({res['total_s']:.0f} s)  -> {a.out}", flush=True)
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
