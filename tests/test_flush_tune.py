"""``benchmarks/flush_tune.py --tiny`` (issue 15's flush tuning sweep) runs on CPU under the
Triton interpreter, times every candidate configuration, checks them and writes its JSON.

One subprocess on one (model, policy) pair (Mamba-2, the nvfp4 read / fp16+SR anchor policy:
the two-launch amax and the loop's two passes), about 80 s on the 2-core machine, so it is
marked slow (``python -m pytest -m slow``).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 80 s under the interpreter; the flush kernel's configurations are
# checked against the references in the default suite (test_replay_kernels.test_flush_configs)
def test_flush_tune_tiny(tmp_path):
    out = tmp_path / "flush_tune_tiny.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "benchmarks/flush_tune.py", "--tiny", "--models",
                        "mamba2", "--policies", "nvfp4", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert "--tiny" in r["command"] and not r["skipped"]
    pol = r["models"]["mamba2"]["policies"]["nvfp4"]
    assert pol["policy"] == "read:nvfp4/rec:fp16+sr"
    assert pol["reference_check"]["passed"], pol["reference_check"]
    assert pol["reference_check_rank1"]["passed"], pol["reference_check_rank1"]
    cfgs = pol["configs"]
    assert len(cfgs) >= 3 and {c["variant"] for c in cfgs} == {"grid", "loop"}
    assert {c["reconstruct"] for c in cfgs} == {"dot", "rank1", "tf32x3", "tf32x3_full"}
    assert pol["reference_check_tf32x3_full"]["passed"], pol["reference_check_tf32x3_full"]
    for c in cfgs:
        assert c["passed"] and c["median_us"] > 0, c
        assert c["reps"] >= 1 and c["pool"] >= 4
    assert cfgs[0]["anchor_bytes_differ"] == 0 and cfgs[0]["read_bytes_differ"] == 0
    assert pol["best"]["median_us"] > 0 and "median_us" in pol["default_with_dequantize"]
    assert pol["default_host_keys"]["same_bytes"] is True  # SR bits: keys packed in kernel


def test_flush_tune_forms_filter():
    """``--forms``: the default configuration (first, the reference of its form) and only the
    candidates of the forms asked for; GDN at V > 64 defaults to tf32x3 on whole tiles with
    the inverse solve (``flush_config``), which the candidate list names
    ``"tf32x3_full+inverse"``, and a flush without a solve (Mamba-2, or GDN folding cached
    corrections) to ``"tf32x3_full"``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import flush_tune
    finally:
        sys.path.pop(0)
    cands = flush_tune.candidates(128, False, False, True, ["tf32x3+inverse"])
    assert cands[0] == ("loop", 16, 2, "tf32x3_full+inverse")
    assert len(cands) > 1 and {c[3] for c in cands[1:]} == {"tf32x3+inverse"}
    assert flush_tune.candidates(128, False, False, False)[0] == ("loop", 32, 2, "tf32x3_full")
    full = flush_tune.candidates(128, False, False, True)
    assert set(flush_tune.FORMS) == {c[3] for c in full}


@pytest.mark.slow  # about 40 s under the interpreter
def test_flush_tune_split_casts_tiny(tmp_path):
    """``--split-casts``: the default configuration of the fp32 flush, then the quantizer
    kernels' casts; its reference check and the host-keys bytes hold, and the JSON says so."""
    out = tmp_path / "ft.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "benchmarks/flush_tune.py", "--tiny", "--models",
                        "mamba2", "--policies", "nvfp4", "--forms", "default",
                        "--split-casts", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    pol = r["models"]["mamba2"]["policies"]["nvfp4"]
    assert r["split_casts"] is True and len(pol["configs"]) == 1 and pol["configs"][0]["passed"]
    checks = [v for k, v in pol.items() if k.startswith("reference_check")]
    assert len(checks) == 1 and checks[0]["passed"], checks


def test_flush_tune_split_casts_refuses_jobs():
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "benchmarks/flush_tune.py", "--tiny", "--split-casts",
                        "--jobs", "3", "--out", "/tmp/unused.json"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--split-casts" in p.stderr and "--jobs 3" in p.stderr


def test_flush_parts_split_form_grammar():
    """``benchmarks/flush_parts.py --split-forms`` entries
    ``NAME[+amax][#RxW][^N][%VARIANT:BLOCK_V:WARPS]``: each option parsed into the launch it
    sets (``^0``: a cap of 255, no cap; the fp32 flush's reconstruct form kept), and bad
    entries refused by name: an unknown cast form, ``+amax`` off the pair forms, a tile off
    the lean forms, malformed or misordered options."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import flush_parts as fp
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    cfg = ("loop", 32, 2, "tf32x3_full")
    assert fp._split_form("pair_lean+amax", cfg) == ("pair_lean+amax", cfg, None, None)
    assert fp._split_form("pair_lean+amax#32x1^0%grid:64:4", cfg) == (
        "pair_lean+amax", ("grid", 64, 4, "tf32x3_full"), 255, (32, 1))
    assert fp._split_form("pair_lean_rcp#256x8^168", cfg) == (
        "pair_lean_rcp", cfg, 168, (256, 8))
    assert fp._split_form("separate%loop:16:4", cfg) == (
        "separate", ("loop", 16, 4, "tf32x3_full"), None, None)
    for bad, why in (("pair_inline", "unknown cast form 'pair_inline'"),
                     ("separate+amax", r"\+amax applies to the pair forms"),
                     ("pair#32x1", "#RxW applies to the lean pair forms"),
                     ("pair_lean#32x1+amax", "a malformed option"),
                     ("pair_lean^x", "a malformed option"),
                     ("pair_lean%loop:16", "a malformed option")):
        with pytest.raises(SystemExit, match=rf"entry '{re.escape(bad)}': {why}"):
            fp._split_form(bad, cfg)
