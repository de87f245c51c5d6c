"""What the Triton kernels accept, and whether Triton runs interpreted (no triton import).

A leaf module (``docs/architecture.md``): the backend seam (:mod:`replayssm_quant.backend`)
reads it to decide torch versus Triton without loading Triton, and the kernels read it to
check their own inputs, so the rule is written once.
"""

from __future__ import annotations

import os

import torch

__all__ = ["TRITON_INTERPRET_ENV", "triton_interpreting", "REPLAY_MIN_KEY_DIM",
           "replay_kernels_supported", "available_device"]

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
