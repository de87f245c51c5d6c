"""Backend choice of the ReplaySSM state objects (kept free of triton imports, so that CPU-only
code paths never load Triton).

``backend`` is ``"auto"`` (Triton kernels of :mod:`replayssm_quant.kernels.replay` on CUDA when
the shape and dtype are supported, the torch references otherwise), ``"torch"`` or ``"triton"``
(kernels or a ValueError; on CPU only under ``TRITON_INTERPRET=1``). The environment variable
``REPLAYSSM_REPLAY_BACKEND`` sets the default.
"""

from __future__ import annotations

import os

import torch

REPLAY_BACKENDS = ("auto", "torch", "triton")
_ENV = "REPLAYSSM_REPLAY_BACKEND"


def _supported(key_dim: int, dtype: torch.dtype) -> bool:
    # same rule as kernels.replay.kernels_supported (float32; K a power of two >= 32)
    return dtype == torch.float32 and key_dim >= 32 and (key_dim & (key_dim - 1)) == 0


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's interpreter (kernels run on CPU, one
    program after another)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def replay_kernels_enabled(backend: str | None, device, dtype: torch.dtype, key_dim: int) -> bool:
    """True when the state object should call the Triton kernels."""
    b = backend or os.environ.get(_ENV, "auto")
    if b not in REPLAY_BACKENDS:
        raise ValueError(f"backend {b!r} not one of {REPLAY_BACKENDS}")
    if b == "torch":
        return False
    ok = _supported(key_dim, dtype)
    if b == "auto":
        return ok and torch.device(device).type == "cuda"
    if not ok:
        raise ValueError(f"backend='triton' needs float32 and a key dim that is a power of two "
                         f">= 32, got {dtype} and key_dim={key_dim}")
    if torch.device(device).type != "cuda" and not triton_interpreting():
        raise ValueError("backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    return True
