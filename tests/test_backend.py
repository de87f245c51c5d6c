"""The backend seam (replayssm_quant/backend.py): one setting, REPLAYSSM_BACKEND, for every
operation; explicit ``backend=`` first; the old per-family variables still honoured with a
DeprecationWarning; bad values name themselves and the accepted ones."""

from __future__ import annotations

import warnings

import pytest
import torch

from replayssm_quant import GDNReplayState, Mamba2ReplayState, pack, quantize
from replayssm_quant import backend as B
from replayssm_quant.capabilities import triton_interpreting
from replayssm_quant.replay import gdn as G
from replayssm_quant.replay import mamba2 as M
from replayssm_quant.replay import window as W

OLD = ("REPLAYSSM_QUANT_BACKEND", "REPLAYSSM_REPLAY_BACKEND", "REPLAYSSM_ANCHOR_CHAIN")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (B.ENV, *OLD):
        monkeypatch.delenv(name, raising=False)


def test_default_is_auto_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fam in B.OpFamily:
            assert B.requested_backend(fam) is B.Backend.AUTO
        assert not B.use_kernels("quant", device="cpu")
        assert not B.use_kernels("replay", device="cpu", dtype=torch.float32, key_dim=32)


def test_backend_names_ignore_case_and_spaces(monkeypatch):
    """Backend names are read as policy strings are: any case, surrounding spaces ignored."""
    assert B.parse_backend("TRITON") is B.Backend.TRITON
    assert B.parse_backend(" Torch ") is B.Backend.TORCH
    monkeypatch.setenv(B.ENV, "TORCH")
    assert B.requested_backend("replay") is B.Backend.TORCH


@pytest.mark.parametrize("value", ["cudnn", "TRITN", "gpu"])
def test_bad_values_name_value_and_accepted(monkeypatch, value):
    with pytest.raises(ValueError, match=rf"backend={value!r} .*'auto', 'torch', 'triton', 'cuda'"):
        quantize(torch.zeros(2, 16), "nvfp4", backend=value)
    monkeypatch.setenv(B.ENV, value)
    with pytest.raises(ValueError,
                       match=rf"REPLAYSSM_BACKEND={value!r} .*'auto', 'torch', 'triton', 'cuda'"):
        quantize(torch.zeros(2, 16), "nvfp4")
    with pytest.raises(ValueError, match="REPLAYSSM_BACKEND"):
        Mamba2ReplayState("fp32", batch=1, heads=1, head_dim=4, d_state=32)


def test_explicit_argument_beats_the_environment(monkeypatch):
    monkeypatch.setenv(B.ENV, "triton")
    assert B.requested_backend("quant", "torch") is B.Backend.TORCH
    assert B.requested_backend("quant", B.Backend.TORCH) is B.Backend.TORCH
    assert B.requested_backend("quant", "") is B.Backend.TRITON  # "" defers, as None
    st = GDNReplayState("fp32", batch=1, key_heads=1, value_heads=1, key_dim=32, value_dim=4,
                        backend="torch")
    assert not st._kernels and st._ops.step is G.gdn_state_step


@pytest.mark.parametrize("old, family", [("REPLAYSSM_QUANT_BACKEND", "quant"),
                                         ("REPLAYSSM_REPLAY_BACKEND", "replay"),
                                         ("REPLAYSSM_REPLAY_BACKEND", "chain"),
                                         ("REPLAYSSM_ANCHOR_CHAIN", "chain")])
def test_old_variables_still_work_with_a_deprecation_warning(monkeypatch, old, family):
    monkeypatch.setenv(old, "triton")
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: set REPLAYSSM_BACKEND"):
        assert B.requested_backend(family) is B.Backend.TRITON
    others = [f for f in B.OpFamily if old not in B.DEPRECATED_ENV[f]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fam in others:  # an old variable keeps its old scope
            assert B.requested_backend(fam) is B.Backend.AUTO
    monkeypatch.setenv(B.ENV, "torch")  # the new setting wins
    with pytest.warns(DeprecationWarning, match="REPLAYSSM_BACKEND is set and takes precedence"):
        assert B.requested_backend(family) is B.Backend.TORCH


def test_anchor_chain_variable_before_replay_variable(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_ANCHOR_CHAIN", "torch")
    monkeypatch.setenv("REPLAYSSM_REPLAY_BACKEND", "triton")
    with pytest.warns(DeprecationWarning):
        assert B.requested_backend("chain") is B.Backend.TORCH
    with pytest.warns(DeprecationWarning):
        assert B.requested_backend("replay") is B.Backend.TRITON


def test_bad_old_value_names_the_old_variable(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_QUANT_BACKEND", "cudnn")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError,
                                                         match="REPLAYSSM_QUANT_BACKEND='cudnn'"):
        quantize(torch.zeros(2, 16), "nvfp4")


def test_triton_where_kernels_cannot_run(monkeypatch):
    with pytest.raises(ValueError, match="power of two"):
        B.use_kernels("replay", "triton", device="cpu", dtype=torch.float64, key_dim=32)
    with pytest.raises(ValueError, match="power of two"):
        B.use_kernels("chain", "triton", device="cpu", dtype=torch.float32, key_dim=24)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"backend='triton' needs a CUDA device \(or "
                                         r"TRITON_INTERPRET=1 on CPU\), got cpu"):
        B.use_kernels("replay", "triton", device="cpu", dtype=torch.float32, key_dim=32)
    with pytest.raises(ValueError, match="backend='triton' on a cpu tensor needs the Triton "
                                         "interpreter: set TRITON_INTERPRET=1"):
        pack(torch.zeros(2, 16), "fp16", backend="triton")
    monkeypatch.setenv("REPLAYSSM_QUANT_BACKEND", "triton")  # deprecated: named as the source
    with pytest.warns(DeprecationWarning), pytest.raises(
            ValueError, match="REPLAYSSM_QUANT_BACKEND='triton' on a cpu tensor"):
        pack(torch.zeros(2, 16), "fp16")


def test_references_and_kernels_are_looked_up_once():
    st = Mamba2ReplayState("read:nvfp4/rec:fp16", batch=1, heads=1, head_dim=4, d_state=32)
    assert (st._ops.step, st._ops.verify, st._ops.flush) == (
        M.mamba2_state_step, M.mamba2_state_verify, M.mamba2_state_flush)
    anchor = torch.zeros(1, 1, 4, 32)
    assert not W.chain_kernel_enabled(anchor)
    with pytest.raises(ValueError, match="not declared"):
        B.select(lambda x: x, True)
    with pytest.raises(ValueError, match="no kernel operation"):
        B.kernel("nope")


@pytest.mark.skipif(not triton_interpreting(), reason="kernels on CPU need TRITON_INTERPRET=1")
def test_triton_selects_the_kernels(monkeypatch):
    from replayssm_quant.kernels import quant as kq
    from replayssm_quant.kernels import replay as kr

    monkeypatch.setenv(B.ENV, "triton")
    st = GDNReplayState("fp32", batch=1, key_heads=1, value_heads=1, key_dim=32, value_dim=4)
    assert st._kernels
    assert (st._ops.step, st._ops.verify, st._ops.flush) == (
        kr.gdn_state_step, kr.gdn_state_verify, kr.gdn_state_flush)
    assert W.chain_kernel_enabled(torch.zeros(1, 1, 4, 32))
    assert B.select(quantize.__globals__["quantize_reference"], True) is kq.quantize_triton
    assert B.kernel_ops.anchor_chain is kr.anchor_chain


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CPU device")
def test_cuda_backend_needs_a_cuda_device(monkeypatch):
    """``cuda`` (opt-in: the CUDA C++ kernels where an operation has one) is refused off a
    CUDA device, for every family and through the environment too, naming the device and the
    setting that runs there; it is never resolved to the torch path silently."""
    msg = r"needs a CUDA device, got cpu \('triton' runs the Triton kernels on CPU under"
    for fam in B.OpFamily:
        with pytest.raises(ValueError, match="backend='cuda' " + msg):
            B.implementation(fam, "cuda", device="cpu", dtype=torch.float32, key_dim=128)
    with pytest.raises(ValueError, match="backend='cuda' " + msg):
        GDNReplayState("fp32", batch=1, key_heads=1, value_heads=1, key_dim=128, value_dim=128,
                       backend="cuda")
    monkeypatch.setenv(B.ENV, "cuda")  # the message names the variable the setting came from
    with pytest.raises(ValueError, match="REPLAYSSM_BACKEND='cuda' " + msg):
        Mamba2ReplayState("fp32", batch=1, heads=1, head_dim=4, d_state=32)
    with pytest.raises(ValueError, match="REPLAYSSM_BACKEND='cuda' " + msg):
        quantize(torch.zeros(2, 16), "nvfp4")


def test_implementation_resolves_auto():
    """``implementation`` never returns ``auto``; ``select`` takes resolved values only (and
    the booleans of ``use_kernels``)."""
    for fam in B.OpFamily:
        for b in ("auto", "torch"):
            assert B.implementation(fam, b, device="cpu", dtype=torch.float32,
                                    key_dim=32) is B.Backend.TORCH
    assert B.implementation("replay", "auto", device="cpu", dtype=torch.float64,
                            key_dim=128) is B.Backend.TORCH
    ref = G.gdn_state_verify
    assert B.select(ref, B.Backend.TORCH) is ref and B.select(ref, False) is ref
    with pytest.raises(ValueError, match="resolved backend"):
        B.select(ref, B.Backend.AUTO)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal of the CUDA build")
def test_cuda_kernel_selection_without_a_gpu():
    """``kernel(op, cuda=True)``: an operation without a CUDA C++ kernel gets its Triton one,
    GDN's verify, step and flush their CUDA kernels (which build nothing until a call they cover, so
    selecting them needs no toolkit); the build without a GPU is a RuntimeError saying what is
    missing and what runs instead."""
    from replayssm_quant.kernels import replay as kr

    assert B.kernel("gdn_state_step", cuda=True) is kr.gdn_state_step_cuda
    assert B.select(G.gdn_state_step, B.Backend.CUDA) is kr.gdn_state_step_cuda
    assert B.kernel("gdn_state_step") is kr.gdn_state_step
    assert B.kernel("gdn_state_flush", cuda=True) is kr.gdn_state_flush_cuda
    assert B.kernel("gdn_state_flush") is kr.gdn_state_flush
    assert B.kernel("mamba2_state_flush", cuda=True) is kr.mamba2_state_flush
    assert B.kernel("mamba2_state_step", cuda=True) is kr.mamba2_state_step
    assert B.kernel("mamba2_state_verify", cuda=True) is kr.mamba2_state_verify
    assert B.select(M.mamba2_state_verify, B.Backend.CUDA) is kr.mamba2_state_verify
    assert B.select(G.gdn_state_verify, B.Backend.CUDA) is kr.gdn_state_verify_cuda
    assert B.kernel("gdn_state_verify") is kr.gdn_state_verify
    with pytest.raises(RuntimeError, match="need a CUDA device; backend='triton'"):
        kr.cuda_verify.build()


def test_torch_threads_sets_and_restores():
    """``capabilities.torch_threads(n)``: n intra-op threads inside, the caller's count after
    (also after an exception); None changes nothing (the one helper of the adapters' segment
    forward and the analysis simulation)."""
    from replayssm_quant.capabilities import torch_threads

    before = torch.get_num_threads()
    outer = 3 if before != 3 else 2
    torch.set_num_threads(outer)
    try:
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == outer
        with torch_threads(None):
            assert torch.get_num_threads() == outer
        with pytest.raises(KeyError):
            with torch_threads(1):
                raise KeyError("x")
        assert torch.get_num_threads() == outer
    finally:
        torch.set_num_threads(before)
