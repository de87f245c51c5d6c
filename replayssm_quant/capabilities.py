"""What the Triton kernels accept, and whether Triton runs interpreted (no triton import).

A leaf module (``docs/architecture.md``): the backend seam (:mod:`replayssm_quant.backend`)
reads it to decide torch versus Triton without loading Triton, and the kernels read it to
check their own inputs, so the rule is written once.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable

import torch

__all__ = ["TRITON_INTERPRET_ENV", "triton_interpreting", "REPLAY_MIN_KEY_DIM",
           "replay_kernels_supported", "available_device", "device_memory_bytes",
           "allocation", "check_allocation", "is_allocation_error", "torch_threads"]

TRITON_INTERPRET_ENV = "TRITON_INTERPRET"  # Triton's own switch for its interpreter
REPLAY_MIN_KEY_DIM = 32  # replay kernels: whole nvfp4 (16) and mx (32) blocks along the key axis


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels run on CPU, one
    program after another). Set it before triton is imported."""
    return os.environ.get(TRITON_INTERPRET_ENV, "0") not in ("", "0")


def replay_kernels_supported(key_dim: int, dtype: torch.dtype) -> bool:
    """Shapes and dtypes the replay kernels handle: float32, the key dim a power of two
    >= :data:`REPLAY_MIN_KEY_DIM` (any value dim)."""
    return (dtype == torch.float32 and key_dim >= REPLAY_MIN_KEY_DIM
            and (key_dim & (key_dim - 1)) == 0)


def available_device(device) -> torch.device:
    """``device`` as tensors report it ("cuda" becomes "cuda:0", the current device), so that
    equal devices compare equal.

    Raises:
        ValueError: a device this torch build or machine lacks ("cuda" on a CPU-only build, a
            GPU index beyond the machine's, an unknown name), or ``"meta"`` (tensors there hold
            no values, and a state's checkpoints and records must), naming it.
    """
    try:
        dev = torch.empty(0, device=device).device
    except (AssertionError, RuntimeError) as e:
        raise ValueError(f"device {device!r} is not available in this torch build or on "
                         f"this machine ({e})") from None
    if dev.type == "meta":
        raise ValueError(f"device {device!r} holds no values (torch's meta device); a state "
                         f"needs a device with memory, e.g. 'cpu' or 'cuda'")
    return dev


@functools.lru_cache(maxsize=None)
def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` in bytes: the machine's physical memory for the CPU
    (``os.sysconf``), the card's for CUDA (``torch.cuda.get_device_properties``); None where
    it cannot be read (then nothing is refused on its account)."""
    try:
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None
    return None


@contextlib.contextmanager
def allocation(nbytes: int, device: torch.device, what: "Callable[[], str]"):
    """Context for an allocation of ``nbytes`` on ``device``: refused before it is attempted
    when it is larger than all of the device's memory, and an allocator's failure inside the
    block raised as ``ValueError`` naming ``what`` too.

    Such an allocation fails with an allocator message that names no argument, or, where the
    system grants memory lazily (Linux overcommit), can get the process killed while it writes
    the zeros (seen for a record ring of a 10^9-token window). The check cannot see what
    other processes or a cgroup limit leave free: it refuses only what no run could hold.

    Args:
        nbytes: the allocation's size in bytes.
        device: where it would live.
        what: returns the argument that set the size and what it allocates, for the message
            (e.g. ``"window=100000 + max_drafts=0: a record ring of 2 sequences x 100000
            slots"``); called only to raise, so a hot path formats nothing.

    Raises:
        ValueError: ``nbytes`` exceeds the device's total memory (naming ``what`` and both
            sizes in GiB), or the allocator failed inside the block (``what``, the size and
            the allocator's first line). Other errors pass through unchanged.
    """
    check_allocation(nbytes, device, what)
    try:
        yield
    except RuntimeError as e:
        if not is_allocation_error(e):
            raise
        raise ValueError(f"{what()} ({nbytes / 2**30:.3g} GiB) could not be allocated on "
                         f"{device} ({str(e).splitlines()[0][:200]})") from e


def check_allocation(nbytes: int, device: torch.device, what: "Callable[[], str]") -> None:
    """The check of :func:`allocation` alone, for memory that is allocated elsewhere later.

    Raises:
        ValueError: ``nbytes`` exceeds the device's total memory, naming ``what()`` and both
            sizes in GiB.
    """
    total = device_memory_bytes(device)
    if total is not None and nbytes > total:
        raise ValueError(f"{what()} needs {nbytes / 2**30:.3g} GiB on {device}, more than its "
                         f"{total / 2**30:.3g} GiB of memory")


def is_allocation_error(e: BaseException) -> bool:
    """Whether ``e`` is an allocator's failure (CUDA's ``OutOfMemoryError``, the CPU
    allocator's "can't allocate memory"), not another ``RuntimeError`` such as a sticky CUDA
    error of an earlier kernel."""
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(e, oom):
        return True
    text = str(e)
    return "can't allocate memory" in text or "out of memory" in text.lower()


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` torch intra-op CPU threads (``torch.set_num_threads``), the
    caller's count restored after, also on an exception; ``None`` leaves the count alone.
    (Results do not depend on it: the toolkit's CPU paths are batch- and thread-invariant,
    ``tests/test_invariance.py``; small tensors run faster on one thread than on a pool.)"""
    if n is None:  # (the adapters' per-token forward passes here: no calls at all)
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
