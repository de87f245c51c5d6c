"""``benchmarks/distributed_check.py --tiny`` (the issue-16 GPU check at toy size, CPU/gloo):
it runs end to end, finds torchrun with 1 process equal to the plain run and the device-map run
equal to the unsharded FP32 run, refuses a plan below the weights, and writes its JSON."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_distributed_check_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("distributed_check", ROOT / "benchmarks" / "distributed_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "dc.json"
    assert mod.main(["--tiny", "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path / "w")]) == 0
    res = json.loads(out.read_text())
    assert res["pass"] and res["a_torchrun_1gpu_vs_plain"]["identical"]
    assert res["b_devmap_fp32_vs_unsharded_fp32"]["identical"]
    assert res["refused_plan"]["rc"] == 2 and res["refused_plan"]["wrote_nothing"]
    assert "memory estimate per rank" in res["dry_run_devmap_fp32"]["stdout"]
    assert res["runs"]["a_torchrun1"]["world_size"] == 1
    bf16 = res["b_devmap_fp32_vs_unsharded_bf16"]
    assert set(bf16["policy_means_unsharded_bf16"]) == {"read:nvfp4/rec:fp32", "shared:nvfp4+sr"}
    # a second call reuses the saved checkpoint
    assert mod.main(["--tiny", "--device", "cpu", "--out", str(out), "--workdir", str(tmp_path / "w"),
                     "--skip", "torchrun", "unsharded_bf16"]) == 0
    assert json.loads(out.read_text())["model"]["reused"]
