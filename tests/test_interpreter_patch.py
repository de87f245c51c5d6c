"""The test harness's Triton-interpreter speed-up (``tests/conftest.py``,
``_patch_language_once_per_launch``): a launch patches ``triton.language`` once, its nested
``@triton.jit`` helpers skip the repeat, the kernels compute what the torch oracle does, and
every launch (one that raises as well) leaves nothing behind.
"""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the patch applies under TRITON_INTERPRET=1 only", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _sum_of_squares_kernel(x_ptr, y_ptr, N: tl.constexpr, FAIL: tl.constexpr):
    i = tl.program_id(0)
    x = tl.load(x_ptr + i * N + tl.arange(0, N))
    s = tl.sum(_square(x), axis=0) + tl.sum(_square(x + 1.0), axis=0)
    tl.static_assert(not FAIL, "planted failure")
    tl.store(y_ptr + i, s + tl.sum(tl.zeros([N], tl.float32), axis=0))


def _original_calls(monkeypatch):
    """Count the upstream ``_patch_lang`` calls the conftest's wrapper makes."""
    wrapper = interpreter._patch_lang
    assert getattr(wrapper, "_once_per_launch", False), "the conftest's wrapper is not installed"
    cell = next(c for c in wrapper.__closure__
                if getattr(c.cell_contents, "__name__", "") == "_patch_lang")
    real, calls = cell.cell_contents, []

    def counted(fn):
        calls.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(cell, "cell_contents", counted)
    return calls


def _launches():
    cell = next(c for c in interpreter._patch_lang.__closure__
                if isinstance(c.cell_contents, list))
    return cell.cell_contents


def test_one_patch_per_launch_and_same_values(monkeypatch):
    calls = _original_calls(monkeypatch)
    x = torch.randn(3, 16, dtype=torch.float32)
    y = torch.empty(3)
    _sum_of_squares_kernel[(3,)](x, y, N=16, FAIL=False)
    want = (x.double() ** 2).sum(1) + ((x.double() + 1) ** 2).sum(1)
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    # the launch, then triton.language's own helpers (tl.sum, tl.zeros: they see tl.core)
    # once; _square and the later tl.sum calls of all three programs skip
    assert calls[0] == "_sum_of_squares_kernel" and len(calls) == 2, calls
    assert _launches() == []


def test_a_launch_that_raises_leaves_no_launch_open(monkeypatch):
    before = tl.program_id
    with pytest.raises(Exception, match="planted failure"):
        _sum_of_squares_kernel[(1,)](torch.zeros(1, 16), torch.empty(1), N=16, FAIL=True)
    assert _launches() == [] and tl.program_id is before
    y = torch.empty(1)
    _sum_of_squares_kernel[(1,)](torch.ones(1, 16), y, N=16, FAIL=False)
    assert float(y) == 16 * 1 + 16 * 4
