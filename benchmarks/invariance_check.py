"""Batch / segmentation invariance on a GPU (issue 12): the checks of tests/test_invariance.py
run on CUDA (the anchor-chain kernel path), reported as mismatch counts instead of asserted,
plus ``replayssm-kl`` on the embedded models with ``--batch-size 1`` and ``4``.

    python benchmarks/invariance_check.py --device cuda -o benchmarks/results/invariance_h200.json

Layer level: a ``LayerState`` (the adapters' per-layer state) in float32 on the device; for
each family and policy, 4 sequences batched vs each alone vs the batch permuted, and the same
tokens in one call vs calls of 7 vs one token per call. ``mismatch`` counts elements (outputs,
anchors, read copies) whose bits differ from the sequence run alone / in one call.
Runner level: every column of ``positions.parquet`` compared bit for bit.
Decode level (``decode="serving"``'s state objects, on CUDA their records and flush kernels;
the layer level above runs the window forms): ``tests/test_replay_kernels._decode_run`` --
prefill, 9 steps at L = 4 (two flushes), a verify of 2 drafts -- for 3 sequences batched,
reversed, and each alone; ``mismatch`` counts elements of the outputs, anchor and read copy
whose bits differ from the sequence alone. Added 2026-12-01 (the layer level did not reach
the decode step's kernels, so it could not check ``shared_products``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from _commit import code_commit, git_commit  # noqa: E402  (benchmarks/, the script's directory)
from test_invariance import FAMILIES, POLICIES, L, _inputs, _rows, _run  # noqa: E402

from replayssm_quant.policy import StatePolicy  # noqa: E402


def _count(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)).sum())


def layer_checks(device: str) -> list[dict]:
    rows = []
    for family in FAMILIES:
        for policy in POLICIES:
            T = 45
            inp = {n: t.to(device) for n, t in _inputs(family, 4, T, seed=1).items()}
            ids, cuts = [11, 5, 7, 2], (9, 40, T)
            y, st = _run(family, policy, inp, ids, cuts)
            perm = [2, 0, 3, 1]
            yp, stp = _run(family, policy, _rows(inp, perm), [ids[i] for i in perm], cuts)
            batch = position = 0
            for b in range(4):
                y1, st1 = _run(family, policy, _rows(inp, [b]), [ids[b]], cuts)
                p = perm.index(b)
                batch += _count(y[b], y1[0]) + _count(st.anchor[b], st1.anchor[0]) \
                    + _count(st.read[b], st1.read[0])
                position += _count(yp[p], y1[0]) + _count(stp.anchor[p], st1.anchor[0]) \
                    + _count(stp.read[p], st1.read[0])
            T2 = 5 + 3 * L + 6
            inp2 = {n: t.to(device) for n, t in _inputs(family, 2, T2, seed=2).items()}
            whole, sw = _run(family, policy, inp2, [3, 9], (T2,))
            sev, s7 = _run(family, policy, inp2, [3, 9], tuple(range(12, T2, 7)) + (T2,))
            stp1, s1 = _run(family, policy, inp2, [3, 9], tuple(range(6, T2 + 1)))
            rows.append(dict(family=family, policy=policy, batch_mismatch=batch,
                             position_mismatch=position,
                             segments7_output_mismatch=_count(whole, sev),
                             segments7_checkpoint_mismatch=_count(sw.anchor, s7.anchor)
                             + _count(sw.read, s7.read),
                             steps_output_mismatch=_count(whole, stp1),
                             steps_checkpoint_mismatch=_count(sw.anchor, s1.anchor)
                             + _count(sw.read, s1.read),
                             elements=int(y.numel() + 2 * st.anchor.numel()),
                             segmentation_outputs=int(whole.numel()),
                             segmentation_checkpoints=int(2 * sw.anchor.numel())))
            print(rows[-1], flush=True)
    return rows


DECODE_POLICIES = ("fp32", "read:nvfp4/rec:fp16+sr", "shared:fp8e4m3+sr", "shared:nvfp4")


def decode_checks(policies=DECODE_POLICIES) -> list[dict]:
    """Batch and position invariance of the decode state objects on their kernels (device:
    the test module's, CUDA unless TRITON_INTERPRET=1), for each of ``policies``."""
    from test_replay_kernels import _decode_run

    rows = []
    for family in FAMILIES:
        for policy in policies:
            full = _decode_run(family, policy, [0, 1, 2], "triton")
            rev = _decode_run(family, policy, [2, 1, 0], "triton")
            batch = position = elements = 0
            for i in range(3):
                alone = _decode_run(family, policy, [i], "triton")
                for a, f, r in zip(alone, full, rev, strict=True):
                    batch += _count(a[0], f[i])
                    position += _count(a[0], r[2 - i])
                    elements += a[0].numel()
            rows.append(dict(family=family, policy=policy, batch_mismatch=batch,
                             position_mismatch=position, elements=elements))
            print(rows[-1], flush=True)
    return rows


def runner_checks(device: str) -> list[dict]:
    import pandas as pd

    from replayssm_quant.evals.kl import main

    out = []
    keys = ["doc", "policy", "window", "seed", "position"]
    for model in ("tiny-gdn", "tiny-mamba2"):
        tables, times = [], []
        with tempfile.TemporaryDirectory() as d:
            for bs in (1, 4):
                t0 = time.time()
                main(["--model", model, "--max-docs", "4", "-N", "1024", "--windows", "16",
                      "--policies", "eager:fp8e4m3", "shared:nvfp4+sr", "read:nvfp4/rec:fp16+sr",
                      "read:nvfp4/rec:fp32", "--device", device, "--batch-size", str(bs),
                      "--stepwise-check", "16",
                      "--no-progress", "-o", f"{d}/bs{bs}"])
                times.append(time.time() - t0)
                t = pd.read_parquet(f"{d}/bs{bs}/positions.parquet")
                tables.append(t.sort_values(keys).reset_index(drop=True))
        a, b = tables
        diff = {c: int((a[c].values != b[c].values).sum()) for c in a.columns if c not in keys}
        out.append(dict(model=model, rows=len(a), differing_values=diff, wall_s=times))
        print(out[-1], flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("-o", "--output", default=None)
    p.add_argument("--layer-only", action="store_true",
                   help="skip the replayssm-kl comparison (the decode level still runs)")
    p.add_argument("--decode-only", action="store_true",
                   help="only the decode state objects' check (serving kernels; its device is "
                        "CUDA unless TRITON_INTERPRET=1, as in tests/test_replay_kernels.py)")
    p.add_argument("--decode-policies", nargs="+", default=list(DECODE_POLICIES),
                   help=f"the decode level's policies (default: {' '.join(DECODE_POLICIES)})")
    a = p.parse_args(argv)
    for pol in a.decode_policies:  # a bad policy string fails here, before any run
        StatePolicy.parse(pol)
    res = {
        "command": "invariance_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "code_commit": code_commit(),
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__,
        "decode_policies": a.decode_policies,
        "decode": decode_checks(a.decode_policies),
        "layer": [] if a.decode_only else layer_checks(a.device),
        "runner": [] if (a.layer_only or a.decode_only) else runner_checks(a.device),
    }
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))
    bad = sum(r["batch_mismatch"] + r["position_mismatch"] for r in res["decode"])
    print(f"decode level: {bad} elements differ between a sequence alone and in a batch "
          f"(batched or reversed), {len(res['decode'])} family x policy cases: "
          f"{'FAIL' if bad else 'ok'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
