"""Mamba2ReplayState against the references (issue 3 tests 1, 2, 3, 9)."""

import pytest

import _replay_common as C
from _replay_inputs import Model

M = Model("mamba2")


@pytest.mark.parametrize("L", [1, 5, 16, 64], ids=lambda L: f"L{L}")
def test_fp32_matches_float64_recurrence(L):
    C.check_fp32_matches_float64_recurrence(M, L)


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
