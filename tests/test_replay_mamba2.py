"""Mamba2ReplayState against the references (issue 3 tests 1, 2, 3, 9)."""

import pytest

import _replay_common as C
from _replay_inputs import Model

M = Model("mamba2")


@pytest.mark.parametrize("L", [1, 5, 16, 64], ids=lambda L: f"L{L}")
def test_fp32_matches_float64_recurrence(L):
    C.check_fp32_matches_float64_recurrence(M, L)


@pytest.mark.parametrize("total", [100.0, 1000.0])
def test_fp32_error_bound_large_decays(total):
    C.check_fp32_error_bound_large_decays(M, total)


def test_read_copy_is_independent_cast():
    C.check_read_copy_is_independent_cast(M)


def test_read_not_derived_from_anchor():
    C.check_read_not_derived_from_anchor(M)


def test_read_format_never_enters_anchor():
    C.check_read_format_never_enters_anchor(M)


@pytest.mark.parametrize("fmt", ["fp16+sr", "bf16", "fp8e4m3", "fp8e5m2+sr", "nvfp4+sr", "mxfp4"])
@pytest.mark.parametrize("with_prefill", [False, True], ids=["zero", "prefill"])
def test_shared_window1_is_eager(fmt, with_prefill):
    C.check_shared_window1_is_eager(M, fmt, with_prefill)


def test_packed_nbytes():
    C.check_packed_nbytes(M)


def test_bad_inputs_leave_state_unchanged():
    C.check_bad_inputs(M)


def test_float64_working_dtype():
    C.check_dtype_float64_keeps_fp32_exact(M)


def test_rmse_ordering_512_steps():
    C.check_rmse_ordering("mamba2")


def test_unavailable_device_is_a_value_error():
    """A device this torch build or machine lacks ("cuda" on a CPU-only build, a GPU index
    beyond the machine's) is refused as ValueError naming it, for both state classes."""
    import torch

    from replayssm_quant.replay import GDNReplayState, Mamba2ReplayState

    dev = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=f"device '{dev}' is not available"):
        Mamba2ReplayState("fp32", batch=1, heads=2, head_dim=4, d_state=8, device=dev,
                          backend="torch")
    with pytest.raises(ValueError, match=f"device '{dev}' is not available"):
        GDNReplayState("fp32", batch=1, key_heads=1, value_heads=2, key_dim=8, value_dim=4,
                       device=dev, backend="torch")


def test_stream_key_fields_are_named_as_arguments():
    """heads, layer and sequence_ids beyond the SR stream key's bit fields are refused under
    the argument's name and limit (they were reported as the key's field, heads as
    ``head=heads - 1``); the limits themselves pass."""
    from replayssm_quant.replay import Mamba2ReplayState

    kw = dict(batch=2, head_dim=4, d_state=8, backend="torch")
    Mamba2ReplayState("fp32", heads=1024, layer=255, sequence_ids=[0, 2 ** 20 - 1], **kw)
    for bad, msg in ((dict(heads=1025), "heads must be in [1, 1024], got 1025"),
                     (dict(heads=2, layer=256), "layer must be in [0, 255], got 256"),
                     (dict(heads=2, sequence_ids=[-1, 2]), "sequence_ids must be in [0, 1048576)"),
                     (dict(heads=2, sequence_ids=[0, 2 ** 20]), "20-bit field), got 0..1048576")):
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(")
                           .replace(")", r"\)")):
            Mamba2ReplayState("fp32", **bad, **kw)
