"""``benchmarks/decode.py --tiny`` (issue 15's decode benchmark) runs on CPU under the Triton
interpreter, writes the JSON the issue specifies, and its in-run correctness checks pass.

One subprocess (the command CI would run), about 15 s on the shared 2-core machine.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"fp32_amortised_vs_fla", "nvfp4_amortised_vs_fla", "nvfp4_step_vs_fp32_step",
                "flush_vs_step", "verify_T8_vs_step"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode") / "decode_tiny.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    # one batch (2, the larger of --tiny's default 1,2: the schema and checks are per batch,
    # and the summary reads the largest)
    p = subprocess.run([sys.executable, "benchmarks/decode.py", "--tiny", "--batches", "2",
                        "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


def test_top_level_schema(result):
    for key in ("command", "device", "versions", "fla", "window_L", "verify_T", "batches",
                "policies", "device_copy", "models", "summary", "checks_passed"):
        assert key in result, key
    assert "benchmarks/decode.py" in result["command"] and "--tiny" in result["command"]
    assert {"python", "torch", "triton", "fla"} <= set(result["versions"])
    assert result["device_copy"]["GBps"] > 0 and result["device_copy"]["copy_exact"]
    # no CUDA here: fla is skipped with its reason recorded
    assert result["fla"]["available"] is False and result["fla"]["skip_reason"]
    assert set(result["policies"]) == {"fp32", "nvfp4"}
    assert result["policies"]["nvfp4"] == "read:nvfp4/rec:fp16+sr"


def test_timings_per_shape(result):
    L, T = result["window_L"], result["verify_T"]
    assert set(result["models"]) == {"gdn", "mamba2"}
    for name, shapes in result["models"].items():
        assert set(shapes) == {f"B{b}" for b in result["batches"]}
        for key, s in shapes.items():
            assert "error" not in s, (name, key, s.get("error"))
            base = s["baselines"]
            assert base["fla_step"] is None
            for b in ("read_only_fp32", "eager_fp32_triton"):
                assert base[b]["median_us"] > 0 and base[b]["bytes"] > 0
            for pol in ("fp32", "nvfp4"):
                p = s["policies"][pol]
                assert set(p["step"]) == {f"h{h}" for h in range(L - 1)}
                assert set(p["verify"]) == {f"h{h}" for h in range(L - T + 1)}
                for r in [*p["step"].values(), *p["verify"].values(), p["flush"]]:
                    assert r["median_us"] > 0 and r["bytes"] > 0 and r["GBps"] > 0
                    assert r["pool"] >= 2
                steps = [r["median_us"] for r in p["step"].values()]
                assert p["amortised_us"] == pytest.approx(
                    (sum(steps) + p["flush"]["median_us"]) / L)
            # the nvfp4 read copy is smaller than the FP32 state and than the fp16 anchor
            assert s["policies"]["nvfp4"]["read_copy_bytes"] < s["policies"]["nvfp4"]["anchor_bytes"]
            assert s["policies"]["fp32"]["read_copy_bytes"] == s["state_fp32_bytes"]


def test_checks_passed(result):
    assert result["checks_passed"] is True
    for shapes in result["models"].values():
        for s in shapes.values():
            chk = s["checks"]
            assert chk["read_only_fp32"]["passed"]
            for pol in ("fp32", "nvfp4"):
                c = chk[pol]
                assert c["step"] and all(v["passed"] for v in c["step"].values())
                assert c["verify"] and all(v["passed"] for v in c["verify"].values())
                assert any(v["drafts_on_flush_slot"] > 0 for v in c["verify"].values())
                f = c["flush"]
                assert f["passed"], f
                for k in ("anchor_value_bits_vs_cast_of_kernel_S",
                          "read_value_bits_vs_cast_of_kernel_S",
                          "anchor_stored_bytes_vs_cast_of_kernel_S",
                          "read_stored_bytes_vs_cast_of_kernel_S",
                          "timed_variant_anchor_vs_store_variant",
                          "timed_variant_read_vs_store_variant"):
                    assert f[k] == 0, k


def test_summary(result):
    summ = result["summary"]
    assert "emulation_vs_plain_fla_max" in summ
    for name in ("gdn", "mamba2"):
        assert SUMMARY_KEYS <= set(summ[name])
        assert summ[name]["fp32_amortised_vs_fla"] is None  # fla missing
        assert summ[name]["nvfp4_amortised_vs_fla"] is None
        for k in ("nvfp4_step_vs_fp32_step", "flush_vs_step", "verify_T8_vs_step"):
            assert summ[name][k] > 0
        assert set(summ["by_batch"][name]) == set(result["models"][name])


def _bench_module(name: str):
    """Import ``benchmarks/<name>.py`` in this process; ``sys.path`` and the environment are
    as before afterwards (``decode.py`` sets ``REPLAYSSM_BACKEND`` where unset)."""
    env = dict(os.environ)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
        os.environ.clear()
        os.environ.update(env)


def _decode_main(argv):
    """``benchmarks/decode.py``'s main in this process (for the options that time nothing)."""
    return _bench_module("decode").main(argv)


def test_resummarize_with_an_emulation_result(result, tmp_path, capsys):
    """``--resummarize``: no timing; the summary is recomputed from the stored timings (the
    same ratios) and the emulation item comes from the given kl_throughput JSON (its worst
    policy), or stays as stored without one; the result notes it was resummarized. Missing
    files are refused by name."""
    src = tmp_path / "decode.json"
    src.write_text(json.dumps(result))
    emu = tmp_path / "emu.json"
    emu.write_text(json.dumps({"command": "kl_throughput.py ...", "runs": [
        {"N": 64, "policies": {"fp32": {"vs_plain": 1.1}, "shared:nvfp4+sr": {"vs_plain": 1.4}}},
        {"N": 128, "policies": {"fp32": {"vs_plain": 1.2}}}]}))
    out = tmp_path / "re.json"
    _decode_main(["--resummarize", str(src), "--emulation", str(emu), "--out", str(out)])
    re = json.loads(out.read_text())
    assert re["summary"]["emulation_vs_plain_fla_max"] == 1.4
    assert re["summary"]["emulation"]["vs_plain"] == {"N64:fp32": 1.1, "N64:shared:nvfp4+sr": 1.4,
                                                      "N128:fp32": 1.2}
    for name in ("gdn", "mamba2"):
        assert re["summary"][name] == result["summary"][name]
    assert re["models"] == result["models"] and re["checks_passed"] == result["checks_passed"]
    assert re["resummarized"][-1]["from"] == str(src)
    for argv, msg in ((["--resummarize", str(tmp_path / "nope.json")], "--resummarize: no such file"),
                      (["--resummarize", str(src), "--emulation", str(tmp_path / "gone.json")],
                       "--emulation: no such file")):
        with pytest.raises(SystemExit) as e:
            _decode_main(argv + ["--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and Path(argv[-1]).name in err
    # without --emulation the stored emulation item is kept
    again = tmp_path / "again.json"
    _decode_main(["--resummarize", str(out), "--out", str(again)])
    kept = json.loads(again.read_text())["summary"]
    assert kept["emulation_vs_plain_fla_max"] == 1.4 and kept["emulation"] == re["summary"]["emulation"]


def test_best_of_graph_and_eager(result, tmp_path):
    """With ``--timing both`` every timed item carries its graph median and an ``"eager"``
    median; the summary's ratios then use, for each aggregate, the lower of its all-graph and
    its all-eager value ("best": no sum mixes the modes), and the pure graph and eager ratios
    are kept. Checked by resummarizing the tiny result with synthetic eager timings against
    ratios recomputed here by hand."""
    import copy
    res = copy.deepcopy(result)
    shape = res["models"]["mamba2"]["B2"]
    shape["baselines"]["fla_step"] = {"median_us": 300.0, "eager": {"median_us": 270.0}}
    L = shape["shape"]["L"]
    for pol in shape["policies"].values():
        for i, v in enumerate([*pol["step"].values(), *pol["verify"].values(), pol["flush"]]):
            v["eager"] = {"median_us": v["median_us"] * (0.5 if i % 2 else 2.0)}
    src = tmp_path / "both.json"
    src.write_text(json.dumps(res))
    out = tmp_path / "best.json"
    _decode_main(["--resummarize", str(src), "--out", str(out)])
    summ = json.loads(out.read_text())["summary"]

    def amortised(pol, pick):
        st = [pick(v) for v in pol["step"].values()]
        return (sum(st) + pick(pol["flush"])) / L

    p32 = shape["policies"]["fp32"]
    graph = amortised(p32, lambda v: v["median_us"])
    eager = amortised(p32, lambda v: v["eager"]["median_us"])
    mixed = amortised(p32, lambda v: min(v["median_us"], v["eager"]["median_us"]))
    assert mixed < min(graph, eager)  # the inputs tell a per-item minimum from the rule
    assert summ["mamba2"]["fp32_amortised_vs_fla"] == pytest.approx(270.0 / min(graph, eager))
    assert summ["graph"]["mamba2"]["fp32_amortised_vs_fla"] == pytest.approx(300.0 / graph)
    assert summ["eager"]["mamba2"]["fp32_amortised_vs_fla"] == pytest.approx(270.0 / eager)
    assert summ["by_batch"]["mamba2"]["B2"] == summ["mamba2"]
    assert summ["gdn"] == result["summary"]["gdn"]  # no eager timings there: as timed
    assert "gdn" not in summ["graph"]
    decode = _bench_module("decode")
    with pytest.raises(ValueError, match="'bogus'"):
        decode.timer(lambda i: None, 1, 1, 0, mode="bogus")


def test_decode_model_tiny(tmp_path):
    """``benchmarks/decode_model.py --tiny``: both model families, both decode modes, the
    window bookkeeping (one flush call per L = 4 calls) and the generate rates are recorded."""
    out = tmp_path / "decode_model.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("REPLAYSSM_BACKEND", None)
    p = subprocess.run([sys.executable, "benchmarks/decode_model.py", "--tiny", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["window_L"] == 4 and set(r["models"]) == {"qwen3_5", "nemotron_h"}
    assert r["backend"] == "auto"  # (the setting the patched runs saw, recorded)
    for m in r["models"].values():
        for mode in ("window", "serving"):
            s = m[f"fp32_{mode}_step"]
            assert s["calls"] == 4 and len(s["all_us"]) == 4  # one timed window after warm-up
            assert s["amortised_us"] == pytest.approx(sum(s["all_us"]) / 4)
            assert s["flush_median_us"] == s["all_us"][3]
        g = m["generate"]
        assert {"unpatched", "nvfp4_window", "nvfp4_serving"} <= set(g)
        assert all(v["new_tokens"] == 5 and v["tokens_per_s"] > 0 for v in g.values())
        assert all(v["peak_gib"] is None for v in g.values())  # (CUDA only)
    # generate alone: no step rows
    p = subprocess.run([sys.executable, "benchmarks/decode_model.py", "--tiny", "--skip-step",
                        "--models", "qwen3_5", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = json.loads(out.read_text())["models"]["qwen3_5"]
    assert set(m) == {"params", "generate"} and m["generate"]["nvfp4_serving"]["new_tokens"] == 5


def test_decode_model_shared_products_switch():
    """``decode_model.py --shared-products off`` sets ``shared_products`` to False in every
    records launch default that has the key (the steps' and Mamba-2's verify), and on sets it
    back; GDN's verify defaults, which never set it, are left alone."""
    decode_model = _bench_module("decode_model")
    from replayssm_quant.kernels.replay import records

    before = {n: dict(getattr(records, n)) for n in dir(records) if n.endswith("_CONFIG")}
    try:
        names = decode_model.set_shared_products(False)
        assert {"STEP_CONFIG", "GDN_STEP_BLOCKED_CONFIG", "GDN_STEP_FP4_CONFIG",
                "MAMBA2_STEP_FP4_CONFIG",
                "VERIFY_CONFIG", "MAMBA2_VERIFY_BLOCKED_CONFIG",
                "MAMBA2_VERIFY_WIDE_CONFIG"} <= set(names)
        assert "GDN_VERIFY_CONFIG" not in names
        assert all(getattr(records, n)["shared_products"] is False for n in names)
        assert decode_model.set_shared_products(True) == names
        assert all(getattr(records, n)["shared_products"] is True for n in names)
    finally:
        for n, d in before.items():
            getattr(records, n).clear()
            getattr(records, n).update(d)
    assert {n: getattr(records, n) for n in before} == before


def test_read_pass_overrides(monkeypatch):
    """``decode.py --read-pass CONFIG=BV,W,FORM`` (``apply_read_pass_overrides``): sets the
    named configuration's read pass (a records-work form also drops its ``lean_records``),
    returns what it set, and refuses a malformed specification, an unknown configuration
    and an unknown form by name."""
    decode = _bench_module("decode")
    recs = decode.kr.records
    for name in ("GDN_STEP_F32_CONFIG", "GDN_STEP_NVFP4_CONFIG"):
        monkeypatch.setattr(recs, name, dict(getattr(recs, name)))  # restored afterwards
    nv = recs.GDN_STEP_NVFP4_CONFIG
    assert "lean_records" in nv
    out = decode.apply_read_pass_overrides(["GDN_STEP_NVFP4_CONFIG=64,2,idot_one",
                                            "GDN_STEP_F32_CONFIG=16,1,lean"])
    assert recs.GDN_STEP_NVFP4_CONFIG["read_pass"] == (64, 2, "idot_one")
    assert "lean_records" not in recs.GDN_STEP_NVFP4_CONFIG
    assert out["GDN_STEP_NVFP4_CONFIG"]["read_pass"] == [64, 2, "idot_one"]
    assert recs.GDN_STEP_F32_CONFIG["read_pass"] == (16, 1, "lean")
    for bad, msg in (("GDN_STEP_F32_CONFIG=16,1", "takes CONFIG=BV,W,FORM"),
                     ("NOPE_CONFIG=16,1,lean", "'NOPE_CONFIG' is not a configuration"),
                     ("GDN_STEP_F32_CONFIG=a,1,lean", "BV and W must be ints"),
                     ("GDN_STEP_F32_CONFIG=16,1,leen", "form 'leen' is not one of")):
        with pytest.raises(ValueError, match=msg):
            decode.apply_read_pass_overrides([bad])


def test_flush_tma_overrides(monkeypatch):
    """``decode.py --flush-tma SOLVE,V,K,FORMAT=DEPTH`` (``apply_flush_tma_overrides``): sets
    or drops the key of ``replay.flush.FLUSH_ANCHOR_TMA`` that the flush's default reads
    (``flush_anchor_tma``), returns the table, and refuses bad specifications by name."""
    import torch

    decode = _bench_module("decode")
    fl = decode.kr.flush
    monkeypatch.setattr(fl, "FLUSH_ANCHOR_TMA", dict(fl.FLUSH_ANCHOR_TMA))  # restored after
    out = decode.apply_flush_tma_overrides(["0,128,128,fp32=2", "1,128,128,fp32=none",
                                            "1,128,128,fp16=3"])
    assert fl.FLUSH_ANCHOR_TMA == {(False, 128, 128, "fp32"): 2, (True, 128, 128, "fp16"): 3}
    assert out == {"0,128,128,fp32": 2, "1,128,128,fp16": 3}
    monkeypatch.setattr(fl, "_tma_capable", lambda t: True)  # what the default then reads
    assert fl.flush_anchor_tma(torch.zeros(1, 1, 128, 128), solve=False) == 2
    assert fl.flush_anchor_tma(torch.zeros(1, 1, 128, 128), solve=True) is None
    for bad, msg in (("0,128,128=2", "takes SOLVE,V,K,FORMAT=DEPTH"),
                     ("0,128,128,fp32", "takes SOLVE,V,K,FORMAT=DEPTH"),
                     ("2,128,128,fp32=2", "SOLVE must be 0 or 1, got '2'"),
                     ("0,a,128,fp32=2", "V and K must be ints"),
                     ("0,0,128,fp32=2", "V and K must be positive"),
                     ("0,128,128,nvfp4=2", "FORMAT must be fp32, fp16 or bf16"),
                     ("0,128,128,fp32=9", "DEPTH must be an int in \\[1, 8\\] or none, got '9'"),
                     ("0,128,128,fp32=x", "DEPTH must be an int")):
        with pytest.raises(ValueError, match=msg):
            decode.apply_flush_tma_overrides([bad])

