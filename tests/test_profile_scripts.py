"""``benchmarks/kernel_profile.py --tiny`` and ``benchmarks/emulation_profile.py --tiny`` (issue
15's profiling helpers) run on CPU under the Triton interpreter, write their JSON, and refuse bad
arguments with the option named."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")


def _run(script, *args):
    return subprocess.run([sys.executable, f"benchmarks/{script}", "--tiny", *args], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=300)


def test_kernel_profile_tiny(tmp_path):
    out = tmp_path / "kp.json"
    p = _run("kernel_profile.py", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    ops = {f"{m}/{pol}/{op}" for m in ("gdn", "mamba2") for pol in ("fp32", "nvfp4")
           for op in ("step", "flush", "verify")}
    assert set(r["launched_in_order"]) == ops and r["calls_each"] == 2 and r["batch"] == 2


def test_op_kernels_tiny(tmp_path):
    """``benchmarks/op_kernels.py --tiny --models gdn``: every (policy, operation) of the
    model asked for runs (on the interpreter: no kernel times) and is written, and no other
    model (Mamba-2's operations are the same ``decode.py`` calls, run by
    ``test_decode_bench``; both models took 48 s of CI); a bad model is refused by name."""
    out = tmp_path / "ok.json"
    p = _run("op_kernels.py", "--models", "gdn", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["ops"]) == {f"gdn/{pol}/{op}" for pol in ("fp32", "nvfp4")
                             for op in ("flush", "step_h7", "verify_h0")}
    assert r["B"] == 2
    p = _run("op_kernels.py", "--models", "gdn,rwkv", "--out", str(out))
    assert p.returncode != 0 and "--models takes a comma list" in p.stderr and "rwkv" in p.stderr


def test_cstream_tiny(tmp_path):
    """``benchmarks/cstream.py --tiny``: every form of verify's ``C X`` computes the product
    (against float64; under the interpreter the TF32 passes are FP32, so all agree to FP32
    rounding) and the rows are written."""
    out = tmp_path / "cs.json"
    p = _run("cstream.py", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["form"] for r in rows} == {"read", "dot", "split3", "tdot"}
    for r in rows:
        assert "error" not in r, r
        if r["form"] != "read":
            assert r["rel_fro"] < 1e-6 and r["max_err_vs_absprod"] < 1e-6, r


@pytest.mark.slow  # 34 s under the interpreter (2026-12-02); the script runs on the device each pass
def test_emulation_profile_tiny(tmp_path):
    out = tmp_path / "ep.json"
    p = _run("emulation_profile.py", "--reps", "1", "--policies", "fp32",
             "read:nvfp4/rec:fp16+sr", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["policies"]) == {"fp32", "read:nvfp4/rec:fp16+sr"}
    assert all(e["median_us"] > 0 and len(e["runs_us"]) == 1 for e in r["policies"].values())


@pytest.mark.parametrize("script,args,match", [
    ("kernel_profile.py", ["--calls", "0"], "--calls"),
    ("kernel_profile.py", ["--ops", "bogus"], "--ops"),
    ("emulation_profile.py", ["--reps", "0"], "--reps"),
    ("emulation_profile.py", ["--policies", "bogus"], "bad state policy 'bogus'")])
def test_profile_scripts_refuse_bad_arguments(tmp_path, script, args, match):
    p = _run(script, "--out", str(tmp_path / "x.json"), *args)
    assert p.returncode == 2 and match in p.stderr, p.stderr[-2000:]


@pytest.mark.slow  # 33 s; the script's --check-batch path stays in test_chain_tune_check_batch_tiny
def test_chain_tune_tiny(tmp_path):
    """``benchmarks/chain_tune.py --tiny``: the asked cases (GDN), with and without
    ``prefetch`` (the same bits) and both ``exchange`` settings (which only a split launch on
    a GPU uses: here the rows only show the script runs them)."""
    out = tmp_path / "ct.json"
    p = _run("chain_tune.py", "--reps", "1", "--models", "gdn", "--cases", "shared:nvfp4+sr",
             "rec:fp32", "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["model"], r["case"], r["prefetch"], r["exchange"]) for r in rows} == {
        ("gdn", c, pf, ex) for c in ("shared:nvfp4+sr", "rec:fp32")
        for pf in (False, True) for ex in ("counter", "slots")}
    assert all(r["same_bits"] and r["median_us"] > 0 for r in rows)


def test_chain_tune_check_batch_tiny(tmp_path):
    """``chain_tune.py --check-batch 2`` (the GPU check that a register cap chosen by batch
    size changes no bit) runs and reports per-sequence mismatch counts; a batch of 1 is
    refused."""
    out = tmp_path / "cb.json"
    p = _run("chain_tune.py", "--check-batch", "2", "--models", "gdn", "--cases", "rec:fp16+sr",
             "--out", str(out))
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = json.loads(out.read_text())["check_batch"]
    assert row["batch"] == 2 and row["mismatch"] == [0, 0] and len(row["maxnreg"]) == 2
    p = _run("chain_tune.py", "--check-batch", "1", "--out", str(out))
    assert p.returncode == 2 and "--check-batch" in p.stderr


@pytest.mark.slow  # 46 s of ptxas on 2 cores (2026-12-02)
def test_sass_static_compiles_for_sm90_without_a_gpu():
    """``benchmarks/sass_static.py`` compiles a flush for sm_90 on this CPU machine and reports
    registers and static SASS from Triton's bundled tools (skipped where the wheel has none);
    the nvfp4 step also for sm_80 (``--sm 80``: no sm_89 instruction in the defaults)."""
    import triton

    bins = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not all((bins / t).exists() for t in ("nvdisasm", "cuobjdump", "ptxas")):
        pytest.skip("this Triton wheel ships no CUDA tools")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "benchmarks/sass_static.py", "--model", "mamba2",
                        "--policy", "fp32", "--op", "flush", "--top", "3"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    head = [ln for ln in p.stdout.splitlines() if ln.startswith("launch 0: _flush_kernel:")]
    assert len(head) == 1 and "'REG'" in head[0]
    assert int(head[0].split()[3]) > 100  # static SASS instructions of the flush
    # the nvfp4 step's read pass (the lean kernel's integer-dot form, the default) with
    # either E2M1 decoder (--e2m1): the lookup is CUDA's default (inline PTX), the integer
    # decoder the interpreter's; different code
    counts = {}
    for dec in ("lookup", "integer"):
        p = subprocess.run([sys.executable, "benchmarks/sass_static.py", "--model", "mamba2",
                            "--policy", "nvfp4", "--op", "step", "--top", "40", "--e2m1", dec],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        heads = [ln for ln in p.stdout.splitlines()
                 if ln.startswith("launch ") and ": _nvfp4_read_kernel:" in ln]
        assert heads, p.stdout[-2000:]
        counts[dec] = int(heads[0].split(": _nvfp4_read_kernel:")[1].split()[0])
    assert counts["lookup"] != counts["integer"], counts  # the option reaches the compile
    # both models' nvfp4 step compile for an A100 (sm_80) too: the integer-dot read pass's
    # hardware E4M3 conversion needs sm_89, so it must not be asked for there
    for model in ("mamba2", "gdn"):
        p = subprocess.run([sys.executable, "benchmarks/sass_static.py", "--model", model,
                            "--policy", "nvfp4", "--op", "step", "--top", "3", "--sm", "80"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, (model, p.stderr[-3000:])
        assert ": _nvfp4_read_kernel:" in p.stdout, p.stdout[-2000:]
    # a quantizer kernel (--quant-spec): the fp16 SR path, and refusals
    q = subprocess.run([sys.executable, "benchmarks/sass_static.py", "--quant-spec", "fp16+sr",
                        "--top", "3"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert q.returncode == 0, q.stderr[-3000:]
    head = [ln for ln in q.stdout.splitlines() if ln.startswith("launch 0: _unscaled_kernel:")]
    assert len(head) == 1 and int(head[0].split()[3]) > 100


@pytest.mark.parametrize("args,word", [(["--top", "0"], "--top"), (["--policy", "bogus"], "bogus"),
                                       (["--e2m1", "bogus"], "bogus"),
                                       (["--quant-spec", "fp32"], "fp32"),
                                       (["--quant-spec", "nvfp9"], "nvfp9"),
                                       (["--sm", "50"], "--sm")])
def test_sass_static_refuses_bad_arguments(args, word):
    """``benchmarks/sass_static.py`` refuses a bad argument with exit code 2 and a message naming
    it, before compiling anything (no traceback)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    bad = subprocess.run([sys.executable, "benchmarks/sass_static.py", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and word in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_philox_bench_refuses_without_cuda(tmp_path):
    """``benchmarks/philox_bench.py`` times CUDA kernels only: without a GPU it exits with a
    message naming what it needs (run on CPU-only machines: CI)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "benchmarks/philox_bench.py", "--out",
                        str(tmp_path / "p.json")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and "CUDA" in p.stderr
    assert not (tmp_path / "p.json").exists()


def test_replay_rmse_table_refuses_bad_arguments_and_runs(capsys):
    """``scripts/replay_rmse_table.py`` (docs/replay.md's drift table): a bad count or policy is
    a usage error naming the option and value (exit 2, no traceback); a tiny run prints the
    table row of each policy with finite RMSEs."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("replay_rmse_table",
                                                  ROOT / "scripts" / "replay_rmse_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for args, want in ((["--steps", "0"], "--steps: expected an integer >= 1, got 0"),
                       (["--window", "-2"], "--window: expected an integer >= 1, got -2"),
                       (["--seeds", "-1"], "--seeds: expected an integer >= 0, got -1"),
                       (["--policies", "nvfp5"], "bad state policy 'nvfp5'")):
        with pytest.raises(SystemExit) as e:
            mod.main(args)
        assert e.value.code == 2 and want in capsys.readouterr().err
    assert mod.main(["--seeds", "0", "--steps", "8", "--window", "4", "--models", "gdn",
                     "--policies", "shared:fp16"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| gdn |")]
    assert len(rows) == 1 and "`shared:fp16`" in rows[0]
    assert all(float(x) < 1e-2 for x in rows[0].strip("| ").split(" | ")[3:])


def test_step_latency_cuda_set_runs_its_triton_cases_on_cpu(tmp_path):
    """``step_latency.py --set cuda`` on CPU: the Triton stand-ins it times the CUDA ones
    against run under the interpreter and pass their float64 checks; the CUDA ones (device
    only) are not listed."""
    out = tmp_path / "sl.json"
    p = _run("step_latency.py", "--set", "cuda", "--hs", "3", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bare", "read2", "epi", "epi_z"]
    assert all(r["check"]["passed"] for r in rows), rows


def test_flush_cuda_oracle_matches_the_shipped_fold():
    """``flush_cuda.reference`` (the float64 fold the CUDA stand-in is checked against on the
    device) against the shipped Triton fold of cached corrections, store-state form, on the
    tiny geometry (under the interpreter on CPU)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import flush_cuda as fc
        import flush_tma
        import flush_tune as ft
        import torch

        from replayssm_quant.policy import StatePolicy
        M = next(m for m in ft.geometries(True, True) if m.name == "gdn")
        pol = StatePolicy.parse("fp32")
        st = ft.make_set(M, torch.Generator(device=ft.DEV).manual_seed(5), pol)
        cfg, extra = flush_tma.launch(M, {})
        res, y = ft.run_flush(M, st, pol, ft.flush_kw(M), cfg, store_state=True,
                              dequantize=True, **extra)
        S, yr = fc.reference(st, 2)
        assert fc.err(res.state[:2], S) <= 1 and fc.err(y[:2].reshape(yr.shape), yr) <= 1
        # and it is not trivially satisfied: a fold without the corrections is far off
        S0, _ = fc.reference(dict(st, u=torch.zeros_like(st["u"])), 2)
        assert fc.err(res.state[:2], S0) > 10
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_flush_cuda_and_step_variants_refuse(tmp_path):
    """``flush_cuda.py`` times CUDA launches only (without a GPU: a message naming it);
    ``step_variants.py --variants`` names unknown variants."""
    import torch

    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    bad = subprocess.run([sys.executable, "benchmarks/step_variants.py", "--out",
                          str(tmp_path / "s.json"), "--variants", "default,nope"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown ['nope']" in bad.stderr, bad.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    p = subprocess.run([sys.executable, "benchmarks/flush_cuda.py", "--out",
                        str(tmp_path / "f.json")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode != 0 and "run it on the device" in p.stderr
    assert not (tmp_path / "f.json").exists()


def test_cuda_stand_in_sources_inline_their_shared_header():
    """``benchmarks/_cuda_ext.source``: each CUDA stand-in gets ``warp.cuh``'s text in place of
    its include (so the extension's build hash follows the header), and nothing of it twice."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _cuda_ext
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    header = (ROOT / "benchmarks" / "cuda" / "warp.cuh").read_text()
    for name in ("step_standin.cu", "fold_standin.cu"):
        raw = (ROOT / "benchmarks" / "cuda" / name).read_text()
        assert raw.count('#include "warp.cuh"') == 1
        src = _cuda_ext.source(name)
        assert '#include "warp.cuh"' not in src and src.count(header) == 1
        assert src.count("void rs(float* v, int lane)") == 1


def _verify_inputs(B, H, G, V, K, J, T, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    d = torch.float64
    la = torch.log(0.9 + 0.0999 * torch.rand(B, J, H, generator=g, dtype=d))
    k = torch.nn.functional.normalize(torch.randn(B, J, G, K, generator=g, dtype=d), dim=-1)
    return dict(R=torch.randn(B, H, V, K, generator=g, dtype=d) * 0.3, la=la,
                beta=torch.sigmoid(torch.randn(B, J, H, generator=g, dtype=d)),
                v=torch.randn(B, J, H, V, generator=g, dtype=d), k=k,
                q=torch.randn(B, T, G, K, generator=g, dtype=d),
                uk=torch.randn(B, J, H, V, generator=g, dtype=d) * 0.1)


def test_verify_cuda_refuses_bad_inputs(tmp_path):
    """``verify_cuda.check_args`` names the input it refuses (the kernel's host code checks
    nothing: a failed check there took the process down in the forty-first pass); the script
    without a GPU says where to run it."""
    import torch
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import verify_cuda as vc
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    x = {n: t.float() for n, t in _verify_inputs(2, 4, 2, 128, 128, 16, 8).items()}
    start = torch.zeros(2, dtype=torch.int64)

    def refused(match, start=start, nw=4, pf=3, mb=0, **kw):
        with pytest.raises(ValueError, match=match):
            vc.check_args(*{**x, **kw}.values(), start, nw, pf, mb)

    refused(r"R must be \[B, H, 128, 128\], got \(2, 4, 64, 128\)", R=x["R"][:, :, :64])
    refused(r"v must be \(2, 16, 4, 128\) \(from R, la, k and q\), got \(2, 15, 4, 128\)",
            v=x["v"][:, :15])
    refused(r"T \(drafts\) must be in 1..8, got 9", q=torch.zeros(2, 9, 2, 128))
    refused(r"start must be in 0..J-T = 0..8, got \[0, 9\]", start=torch.tensor([0, 9]))
    refused(r"start must be int64 \[2\]", start=start.int())
    refused(r"pf must be one of \(2, 3, 4, 5, 6\) with nw=4, got 1", pf=1)
    refused(r"mb must be one of \(0, 2, 3, 4\) with nw=8, got 5", nw=8, pf=7, mb=5)
    refused(r"nw must be one of \(4, 8\), got 2", nw=2)
    with pytest.raises(ValueError, match="ep must be 0, 1 or 2, got 3"):
        vc.check_args(*x.values(), start, 4, 3, 0, 3)
    if not torch.cuda.is_available():
        refused(r"R must be a contiguous float32 CUDA tensor, got torch.float32, "
                r"contiguous=True, cpu")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run([sys.executable, "benchmarks/verify_cuda.py", "--out",
                            str(tmp_path / "v.json")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode != 0 and "run it on the device" in p.stderr
        assert not (tmp_path / "v.json").exists()


def test_cuda_kernels_ncu_summary_reads_ncu_csv(tmp_path):
    """``cuda_kernels_ncu.summarize``: ncu's ``--csv --page details`` rows (after the
    program's own output) matched to the driver's launches by ID order, each case's second
    launch kept, Duration converted from ncu's unit to us (and thousands separators read); an
    unknown unit and a launch-count mismatch are refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cuda_kernels_ncu as cn
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    labels = [c[0] for c in cn.cases() for _ in range(2)]
    assert len(labels) == 18 and labels[:2] == ["step_fp32_h0"] * 2
    lab = tmp_path / "labels.json"
    lab.write_text(json.dumps(labels))
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"\n')

    def write(unit="ns", n=len(labels)):
        rows = []
        for i in range(n):
            for m, u, v in (("Duration", unit, f"{1000 + 10 * i:,}"), ("DRAM Throughput", "%", "80.5"),
                            ("Registers Per Thread", "register/thread", "72")):
                rows.append(f'"{i}","1","python3","h","void k<{i}>(const float *)","1","7",'
                            f'"(128, 1, 1)","(8192, 1, 1)","0","9.0","S","{m}","{u}","{v}"\n')
        p = tmp_path / f"ncu_{unit}_{n}.csv"
        p.write_text("==PROF== Connected to process\nprogram output\n" + head + "".join(rows))
        return p

    res = cn.summarize(write(), lab)
    assert list(res) == list(dict.fromkeys(labels))
    assert res["step_fp32_h0"] == {"kernel": "void k<1>", "time_us": 1.01, "dram_pct": 80.5}
    assert res["flush_nvfp4_sr"]["time_us"] == pytest.approx(1.17)
    assert cn.summarize(write("msecond"), lab)["step_fp32_h0"]["time_us"] == pytest.approx(1.01e6)
    with pytest.raises(ValueError, match="Duration unit 'cycle'"):
        cn.summarize(write("cycle"), lab)
    with pytest.raises(ValueError, match="ncu profiled 17 launches, the driver made 18"):
        cn.summarize(write(n=17), lab)
