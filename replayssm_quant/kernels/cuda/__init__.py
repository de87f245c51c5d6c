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
_SRC = [Path(__file__).with_name("gdn_step.cpp"), Path(__file__).with_name("gdn_step.cu")]
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
            _EXT = load(name="replayssm_cuda_gdn_step", sources=[str(p) for p in _SRC],
                        extra_cuda_cflags=["-O3", "-std=c++17"], verbose=False)
        except Exception as err:  # noqa: BLE001  (any build failure is reported the same way)
            _ERROR = (f"{ENV}: could not build the CUDA kernels ({_SRC[1].name}): "
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


def _check_operands(read, ring, q, k, v, g, beta, h):
    """ValueError naming the first operand of a step call that the CUDA kernel cannot take."""
    if not isinstance(read, torch.Tensor) or read.dim() != 4:
        raise ValueError(f"gdn_f32_step: read must be a [B, H, V, K] tensor, got "
                         f"{getattr(read, 'shape', type(read).__name__)}")
    B, H, V, K = (int(x) for x in read.shape)
    if K != 128 or V not in (64, 128):
        raise ValueError(f"gdn_f32_step: read is [B, H, V, K] = {tuple(read.shape)}; the CUDA "
                         f"kernel takes K = 128 and V in (64, 128)")
    missing = [n for n in ("la", "beta", "v", "uR", "k") if n not in ring]
    if missing:
        raise ValueError(f"gdn_f32_step: ring lacks {missing}")
    CAP = int(ring["la"].shape[1]) if ring["la"].dim() == 3 else -1
    G = int(ring["k"].shape[2]) if ring["k"].dim() == 4 else -1
    if not 1 <= CAP <= 32:
        raise ValueError(f"gdn_f32_step: ring la must be [B, CAP, H] with 1 <= CAP <= 32, got "
                         f"{tuple(ring['la'].shape)}")
    if G < 1 or H % G:
        raise ValueError(f"gdn_f32_step: ring k must be [B, CAP, G, K] with G dividing H = {H}, "
                         f"got {tuple(ring['k'].shape)}")
    want = {"read": (read, (B, H, V, K)), "ring la": (ring["la"], (B, CAP, H)),
            "ring beta": (ring["beta"], (B, CAP, H)), "ring v": (ring["v"], (B, CAP, H, V)),
            "ring uR": (ring["uR"], (B, CAP, H, V)), "ring k": (ring["k"], (B, CAP, G, K)),
            "q": (q, (B, G, K)), "k": (k, (B, G, K)), "v": (v, (B, H, V)), "g": (g, (B, H)),
            "beta": (beta, (B, H))}
    for name, (t, shape) in want.items():
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            raise ValueError(f"gdn_f32_step: {name} has shape "
                             f"{tuple(getattr(t, 'shape', ()))}, expected {shape}")
        if t.dtype != torch.float32:
            raise ValueError(f"gdn_f32_step: {name} has dtype {t.dtype}, expected torch.float32")
        if t.device != read.device:
            raise ValueError(f"gdn_f32_step: {name} is on {t.device}, expected {read.device}")
        if not t.is_contiguous():
            raise ValueError(f"gdn_f32_step: {name} must be contiguous")
    if (not isinstance(h, torch.Tensor) or tuple(h.shape) != (B,) or h.device != read.device
            or h.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"gdn_f32_step: h must be an int64 or int32 [{B}] tensor on "
                         f"{read.device}, got {getattr(h, 'dtype', type(h).__name__)} "
                         f"{tuple(getattr(h, 'shape', ()))}")
    if read.device.type != "cuda":
        raise ValueError(f"gdn_f32_step: the operands are on {read.device}, expected a CUDA "
                         f"device")


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

    Raises ValueError naming an operand of the wrong shape, dtype, device or layout;
    RuntimeError where the extension cannot be built."""
    _check_operands(read, ring, q, k, v, g, beta, h)
    ext = build()
    # REPLAYSSM_CUDA_STEP_VARIANT: an experiment's knob (gdn_step.cu, VAR), 0 by default
    variant = int(os.environ.get("REPLAYSSM_CUDA_STEP_VARIANT", "0") or 0)
    return ext.gdn_f32_step(read, ring["la"], ring["beta"], ring["v"], ring["uR"], ring["k"],
                            q, k, v, g, beta, h.to(torch.int64), variant)
