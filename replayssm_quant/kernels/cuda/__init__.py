"""CUDA C++ kernels beside the Triton ones (issue 15, forty-first pass, 2026-12-06).

One kernel so far: GDN's decode step from an FP32 read copy (``gdn_step.cu``), what
:func:`replayssm_quant.kernels.replay.gdn_step_kernel` computes for an FP32 read copy, in one
launch instead of the Triton path's two (the products with the ring keys, then the read pass
with the records work). It is built on first use by ``torch.utils.cpp_extension.load`` (nvcc
and ninja needed, as on the lent device image; about a minute, then cached in
``TORCH_EXTENSIONS_DIR``).

The setting ``REPLAYSSM_CUDA_KERNELS`` chooses whether the step takes it:

* ``off`` (default): never; the Triton step runs.
* ``on``: always where the call fits it (an FP32 ``torch.Tensor`` read copy on a CUDA device,
  K = 128, V in {64, 128}, a ring of at most 32 slots, contiguous float32 operands, no
  launch option given to ``gdn_step_kernel``); a build failure is raised.
* ``auto``: as ``on``, but a build failure is warned about once and the Triton step runs.

The two paths agree to FP32 rounding, not bit for bit (different summation orders), so the
setting is part of what makes a run's bits: keep it fixed across runs you compare. Each path on
its own gives the same bits whatever the batch (tests/test_cuda_kernels.py). Under
``TRITON_INTERPRET=1`` and on CPU tensors the CUDA kernel never runs.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import torch

ENV = "REPLAYSSM_CUDA_KERNELS"
MODES = ("off", "on", "auto")
_SRC = Path(__file__).with_name("gdn_step.cu")
_LOCK = threading.Lock()
_EXT = None
_ERROR: "str | None" = None


def mode() -> str:
    """The setting of ``REPLAYSSM_CUDA_KERNELS`` (``off`` when unset or empty). Raises
    ValueError naming the value and the accepted ones."""
    value = os.environ.get(ENV, "").strip().lower() or "off"
    if value not in MODES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: expected one of {', '.join(MODES)}")
    return value


def build():
    """The compiled extension (built once per process). Raises RuntimeError with the build's
    error where it cannot be built (no nvcc, no ninja, a compiler error)."""
    global _EXT, _ERROR
    with _LOCK:
        if _EXT is not None:
            return _EXT
        if _ERROR is not None:
            raise RuntimeError(_ERROR)
        try:
            from torch.utils.cpp_extension import load
            _EXT = load(name="replayssm_cuda_gdn_step", sources=[str(_SRC)],
                        extra_cuda_cflags=["-O3", "-std=c++17"], verbose=False)
        except Exception as err:  # noqa: BLE001  (any build failure is reported the same way)
            _ERROR = (f"{ENV}: could not build the CUDA kernels ({_SRC.name}): "
                      f"{type(err).__name__}: {str(err)[-500:]}")
            raise RuntimeError(_ERROR) from err
        return _EXT


def _fits(read, ring, q, k, v, g, beta, h) -> bool:
    """Whether a GDN step call has what the CUDA kernel takes (else the Triton step runs)."""
    if not isinstance(read, torch.Tensor) or read.dtype != torch.float32 or read.dim() != 4:
        return False
    if read.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    B, H, V, K = read.shape
    CAP = ring["la"].shape[1]
    if K != 128 or V not in (64, 128) or not 1 <= CAP <= 32:
        return False
    tensors = [read, q, k, v, g, beta] + [ring[n] for n in ("la", "beta", "v", "uR", "k")]
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.device != read.device
           for t in tensors):
        return False
    return h.dtype in (torch.int64, torch.int32) and h.device == read.device and h.dim() == 1


def use_gdn_step(read, ring, q, k, v, g, beta, h) -> bool:
    """Whether :func:`gdn_step_kernel` should run the CUDA kernel for this call: the setting
    is ``on`` or ``auto``, the call fits, and (``auto``) the extension builds."""
    m = mode()
    if m == "off" or not _fits(read, ring, q, k, v, g, beta, h):
        return False
    if m == "on":
        build()
        return True
    try:
        build()
    except RuntimeError as err:
        if not getattr(use_gdn_step, "_warned", False):
            use_gdn_step._warned = True
            warnings.warn(f"{err}; the Triton step runs instead", RuntimeWarning, stacklevel=3)
        return False
    return True


def gdn_f32_step(read, ring: dict, q, k, v, g, beta, h) -> torch.Tensor:
    """GDN decode step from an FP32 read copy in one CUDA launch (``gdn_step.cu``; the
    formula of :func:`replayssm_quant.replay.gdn.gdn_step_output` plus the ring append, paper
    Sec. 3's output-only step).

    Args: ``read`` float32 ``[B, H, V, K]`` (K = 128, V in {64, 128}); ``ring`` dict of
    ``la, beta [B, CAP, H]``, ``v, uR [B, CAP, H, V]``, ``k [B, CAP, G, K]`` (CAP <= 32; updated
    in place: the new record and its correction at slot ``h[b]``); ``q, k [B, G, K]``; ``v [B,
    H, V]``; ``g`` (log decay), ``beta [B, H]``; ``h`` integer ``[B]``, the new row's slot, in
    ``[0, CAP)`` (a sequence outside it gets NaN outputs and no ring write). All float32,
    contiguous, on one CUDA device. Returns ``o [B, H, V]`` float32.

    Raises RuntimeError (from the extension) naming a shape, dtype or device mismatch, or
    where the extension cannot be built."""
    ext = build()
    return ext.gdn_f32_step(read, ring["la"], ring["beta"], ring["v"], ring["uR"], ring["k"],
                            q, k, v, g, beta, h.to(torch.int64))
