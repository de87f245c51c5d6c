"""The one backend seam: torch reference or Triton kernel, for every operation.

Modelled on flash-linear-attention's ``fla/ops/backends`` dispatch (STYLE.md, "One seam for the
backend"): one setting chooses the implementation, one registry maps each operation's torch
reference to its kernel, and callers never branch on the device or import kernels themselves.

Setting, in order of precedence:

1. ``backend=`` where the API has one (:func:`replayssm_quant.quantize`, :func:`~replayssm_quant.pack`,
   the state objects :class:`~replayssm_quant.Mamba2ReplayState` / :class:`~replayssm_quant.GDNReplayState`);
2. the environment variable ``REPLAYSSM_BACKEND`` = ``auto`` | ``torch`` | ``triton`` |
   ``cuda`` (:class:`Backend`), one setting for every operation;
3. the deprecated per-family variables (a :class:`DeprecationWarning` names the new one):
   ``REPLAYSSM_QUANT_BACKEND`` (quantizers), ``REPLAYSSM_REPLAY_BACKEND`` (state objects and
   the anchor chain), ``REPLAYSSM_ANCHOR_CHAIN`` (anchor chain; before the previous one);
4. ``auto``.

Operations come in families (:class:`OpFamily`) that share one decision rule
(:func:`use_kernels`): the quantizers run their kernels on CUDA tensors; the replay state objects
and the anchor chain run theirs on CUDA for float32 and a key dim that is a power of two >= 32
(:func:`replayssm_quant.capabilities.replay_kernels_supported`), the torch references otherwise.
``triton`` forces the kernels (a ValueError where they cannot run; on CPU they run under
``TRITON_INTERPRET=1``). ``cuda`` (opt-in) is ``triton`` on a CUDA device, except that an
operation with a CUDA C++ kernel (``_CUDA_KERNELS``: today GDN's verify, which covers the
single-checkpoint FP32 policy at DK = DV = 128, T <= 8, L <= 16; GDN's decode step, which
covers FP32 and NVFP4 read copies at DK = DV = 128 and rings of up to 32 slots; and GDN's flush,
which covers ``read:nvfp4/rec:fp16[+sr]`` at DK = DV = 128 and L <= 16; each hands every other
call to its Triton kernel) runs that one; the extension is built with nvcc at the first
call it covers.

Registry: a torch reference declares the operation it implements with :func:`reference`; the
kernel of each operation is named in ``_KERNELS`` and imported on first use (so CPU-only runs
never import Triton). :func:`select` / :func:`ops` swap a reference for its kernel when
:func:`use_kernels` says so; :data:`kernel_ops` gives kernel-only entry points
(``kernel_ops.anchor_chain``). Every kernel has the same signature as its reference.

This module imports only leaf modules at import time; it is the one place outside
``replayssm_quant.kernels`` that imports kernels (``docs/architecture.md``).
"""

from __future__ import annotations

import enum
import importlib
import os
import types
import warnings
from typing import Callable

import torch

from .capabilities import REPLAY_MIN_KEY_DIM, replay_kernels_supported, triton_interpreting

__all__ = ["Backend", "OpFamily", "ENV", "DEPRECATED_ENV", "parse_backend", "requested_backend",
           "implementation", "check_setting", "use_kernels", "reference", "select", "ops", "kernel", "kernel_ops",
           "triton_interpreting"]

ENV = "REPLAYSSM_BACKEND"


class Backend(str, enum.Enum):
    """Which implementation runs."""

    #: the Triton kernel where it runs (CUDA tensors; replay ops: float32 and a key dim that is
    #: a power of two >= 32), the torch reference everywhere else. The default.
    AUTO = "auto"
    #: the torch reference everywhere (any device, float32 or float64).
    TORCH = "torch"
    #: the Triton kernel, or a ValueError where it cannot run (on CPU only under
    #: ``TRITON_INTERPRET=1``, set before triton is imported).
    TRITON = "triton"
    #: as ``triton`` on a CUDA device (a ValueError elsewhere), with the CUDA C++ kernels of
    #: the operations that have one (``_CUDA_KERNELS``; built with nvcc at the first call one
    #: covers, a RuntimeError naming what is missing where it cannot be built). Opt-in.
    CUDA = "cuda"


class OpFamily(str, enum.Enum):
    """Groups of operations that share one decision rule (and one deprecated variable)."""

    #: ``quantize``, ``pack``: kernels on CUDA tensors (any shape and dtype).
    QUANT = "quant"
    #: the state objects' step, verify and flush: kernels on CUDA for supported shapes.
    REPLAY = "replay"
    #: the anchor-chain flush of the teacher-forced window form and of the adapters' step.
    CHAIN = "chain"


#: Old per-family variables, still read (with a DeprecationWarning) when ``REPLAYSSM_BACKEND``
#: is unset; the first one set wins.
DEPRECATED_ENV: dict[OpFamily, tuple[str, ...]] = {
    OpFamily.QUANT: ("REPLAYSSM_QUANT_BACKEND",),
    OpFamily.REPLAY: ("REPLAYSSM_REPLAY_BACKEND",),
    OpFamily.CHAIN: ("REPLAYSSM_ANCHOR_CHAIN", "REPLAYSSM_REPLAY_BACKEND"),
}

_ACCEPTED = ", ".join(repr(b.value) for b in Backend)


def parse_backend(value, *, source: str = "backend") -> Backend:
    """``value`` (a :class:`Backend` or its string, in any case and with surrounding spaces, as
    policy strings are read) as a :class:`Backend`.

    Raises:
        ValueError: naming ``source`` (the argument or variable), the value and the accepted ones.
    """
    if isinstance(value, Backend):
        return value
    try:
        return Backend(value.strip().lower() if isinstance(value, str) else value)
    except ValueError:
        raise ValueError(f"{source}={value!r} is not a backend: use one of {_ACCEPTED}") from None


def requested_backend(family, backend=None) -> Backend:
    """The backend asked for by ``backend`` (per call; None or "" defer), ``REPLAYSSM_BACKEND``
    or, deprecated, the family's old variable (module docstring)."""
    family = OpFamily(family)
    if backend is not None and backend != "":
        return parse_backend(backend)
    value = os.environ.get(ENV) or None
    old = [(n, os.environ[n]) for n in DEPRECATED_ENV[family] if os.environ.get(n)]
    for name, _ in old:
        warnings.warn(f"{name} is deprecated: set {ENV}=auto|torch|triton|cuda (one setting for "
                      f"every operation)" + (f"; {ENV} is set and takes precedence" if value
                                             else ""), DeprecationWarning, stacklevel=3)
    if value is not None:
        return parse_backend(value, source=ENV)
    if old:
        return parse_backend(old[0][1], source=old[0][0])
    return Backend.AUTO


def _source(family: OpFamily, backend) -> str:
    """Where the backend setting of ``family`` comes from: ``backend`` (the argument),
    ``REPLAYSSM_BACKEND`` or a deprecated per-family variable (for error messages)."""
    if backend is not None and backend != "":
        return "backend"
    if os.environ.get(ENV):
        return ENV
    return next((n for n in DEPRECATED_ENV[family] if os.environ.get(n)), "backend")


def implementation(family, backend=None, *, device, dtype: torch.dtype | None = None,
                   key_dim: int | None = None) -> Backend:
    """What an operation of ``family`` on ``device`` (replay and chain: with ``dtype`` and key
    dim ``key_dim``) runs: ``Backend.TORCH`` (the reference), ``Backend.TRITON`` (its Triton
    kernel) or ``Backend.CUDA`` (the CUDA C++ kernel where the operation has one, its Triton
    kernel otherwise). Never ``AUTO``: it is resolved here.

    Raises:
        ValueError: a bad backend value or device, or ``triton`` / ``cuda`` where the kernels
            cannot run (naming the setting and what it needs).
    """
    family = OpFamily(family)
    b = requested_backend(family, backend)
    if b is Backend.TORCH:
        return b
    src = f"{_source(family, backend)}={b.value!r}"  # where the refused setting came from
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be a torch.device or a device string such as 'cpu' or "
                         f"'cuda:0', got {device!r} ({e})") from None
    on_cuda = device.type == "cuda"
    if b is Backend.CUDA and not on_cuda:
        raise ValueError(f"{src} needs a CUDA device, got {device} ('triton' runs the Triton "
                         "kernels on CPU under TRITON_INTERPRET=1)")
    if family is OpFamily.QUANT:
        if b is Backend.AUTO:
            return Backend.TRITON if on_cuda else Backend.TORCH
        if not on_cuda and not triton_interpreting():
            raise ValueError(
                f"{src} on a {device} tensor needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported, or use 'torch'")
        return b
    ok = replay_kernels_supported(key_dim, dtype)
    if b is Backend.AUTO:
        return Backend.TRITON if ok and on_cuda else Backend.TORCH
    if not ok:
        raise ValueError(f"{src} needs float32 and a key dim that is a power of two >= "
                         f"{REPLAY_MIN_KEY_DIM}, got {dtype} and key_dim={key_dim}")
    if not on_cuda and not triton_interpreting():
        raise ValueError(f"{src} needs a CUDA device (or TRITON_INTERPRET=1 on CPU), got "
                         f"{device}")
    return b


def check_setting(device=None) -> None:
    """Check the environment's backend setting for every family before any work (the command
    lines call this): ``REPLAYSSM_BACKEND`` (or a deprecated per-family variable) names a
    backend, and, with ``device``, can run there with float32 state and a supported key dim
    (``cuda`` off a GPU, ``triton`` on CPU without ``TRITON_INTERPRET=1`` cannot). Deprecation
    warnings are left to the first operation.

    Raises:
        ValueError: naming the variable, its value and what it needs.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for family in OpFamily:
            requested_backend(family)
            if device is not None:
                implementation(family, device=device, dtype=torch.float32, key_dim=128)


def use_kernels(family, backend=None, *, device, dtype: torch.dtype | None = None,
                key_dim: int | None = None) -> bool:
    """True when an operation of ``family`` on ``device`` (replay and chain: with ``dtype`` and
    key dim ``key_dim``) runs a kernel (:func:`implementation` is not ``TORCH``), False for
    the torch reference.

    Raises:
        ValueError: as :func:`implementation`.
    """
    return implementation(family, backend, device=device, dtype=dtype,
                          key_dim=key_dim) is not Backend.TORCH


# ------------------------------------------------------------------------------ registry
#: operation -> (kernel module under replayssm_quant.kernels, attribute). Each kernel takes the
#: arguments of the reference registered under the same name.
_KERNELS: dict[str, tuple[str, str]] = {
    "quantize": ("quant", "quantize_triton"),
    "pack": ("quant", "pack_triton"),
    "mamba2_state_step": ("replay", "mamba2_state_step"),
    "mamba2_state_verify": ("replay", "mamba2_state_verify"),
    "mamba2_state_flush": ("replay", "mamba2_state_flush"),
    "gdn_state_step": ("replay", "gdn_state_step"),
    "gdn_state_verify": ("replay", "gdn_state_verify"),
    "gdn_state_flush": ("replay", "gdn_state_flush"),
    "anchor_chain": ("replay", "anchor_chain"),  # kernel only: the window form calls it
}
#: operation -> (module of :mod:`replayssm_quant.kernels.replay`, attribute): the CUDA C++
#: kernels that ``Backend.CUDA`` runs instead of the Triton one. Each hands the calls it does
#: not cover to the Triton kernel, and compiles the extension at the first call it covers
#: (``cuda_verify.build()``, one extension for both: a RuntimeError naming what is missing,
#: nvcc or ninja). ``gdn_state_verify_cuda`` writes the corrections into its ``u_known``
#: argument (the state's ring) and returns it, where the reference returns a new tensor: the
#: state copies back only what is not already its ring.
_CUDA_KERNELS: dict[str, tuple[str, str]] = {
    "gdn_state_verify": ("cuda_verify", "gdn_state_verify_cuda"),
    "gdn_state_step": ("cuda_step", "gdn_state_step_cuda"),
    "gdn_state_flush": ("cuda_flush", "gdn_state_flush_cuda"),
}


def reference(op: str) -> Callable:
    """Decorator: declare a torch function the reference of kernel operation ``op``."""
    if op not in _KERNELS:
        raise ValueError(f"no kernel operation {op!r}; known: {sorted(_KERNELS)}")

    def register(fn):
        fn.backend_op = op
        return fn

    return register


def kernel(op: str, cuda: bool = False) -> Callable:
    """The Triton entry point of operation ``op`` (imports its kernel module on first use);
    with ``cuda``, its CUDA C++ kernel where it has one (``_CUDA_KERNELS``; built at its first
    covered call).

    Raises:
        ValueError: an unknown operation.
    """
    try:
        module, attr = _KERNELS[op]
    except KeyError:
        raise ValueError(f"no kernel operation {op!r}; known: {sorted(_KERNELS)}") from None
    if cuda and op in _CUDA_KERNELS:
        cmod, cattr = _CUDA_KERNELS[op]
        return getattr(importlib.import_module(f".kernels.replay.{cmod}", __package__), cattr)
    if module == "quant":
        from .kernels import quant as m
    else:
        from .kernels import replay as m
    return getattr(m, attr)


def select(ref: Callable, kernels: "bool | Backend") -> Callable:
    """``ref`` (a function declared with :func:`reference`), or its kernel when ``kernels``
    (True or ``Backend.TRITON``: the Triton kernel; ``Backend.CUDA``: the CUDA C++ kernel
    where the operation has one; False or ``Backend.TORCH``: ``ref``)."""
    op = getattr(ref, "backend_op", None)
    if op is None:
        raise ValueError(f"{getattr(ref, '__qualname__', ref)!r} is not declared as the "
                         "reference of a kernel operation (backend.reference)")
    if isinstance(kernels, Backend):
        if kernels is Backend.AUTO:
            raise ValueError("select() takes a resolved backend (backend.implementation), "
                             "not 'auto'")
        return ref if kernels is Backend.TORCH else kernel(op, cuda=kernels is Backend.CUDA)
    return kernel(op) if kernels else ref


def ops(kernels: "bool | Backend", **refs: Callable) -> types.SimpleNamespace:
    """A namespace of implementations, looked up once: ``ops(k, step=ref_step, ...).step`` is
    ``ref_step`` or its kernel (``kernels`` as :func:`select`)."""
    return types.SimpleNamespace(**{name: select(fn, kernels) for name, fn in refs.items()})


class _KernelOps:
    """Kernel entry points by operation name, imported on first use: ``kernel_ops.anchor_chain``
    (for callers that decided with :func:`use_kernels` and have no torch twin to swap)."""

    def __getattr__(self, op: str) -> Callable:
        if op.startswith("__"):
            raise AttributeError(op)
        return kernel(op)


kernel_ops = _KernelOps()
