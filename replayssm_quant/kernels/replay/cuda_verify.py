"""GDN's verify of T <= 8 drafts as one CUDA C++ kernel on the tensor cores
(``gdn_verify.cu``), opt-in through the backend seam (``backend="cuda"``,
:mod:`replayssm_quant.backend`), with :func:`~.records.gdn_verify_kernel` (Triton) wherever it
does not apply.

What it computes: :func:`replayssm_quant.replay.gdn.gdn_verify` with the read copy as the
anchor and the cached corrections folded (``fold=CACHED``), which is what a decode state runs
under a single-checkpoint FP32 policy (``fp32``; :meth:`GDNFold.folds_cached`). In the
notation of DESIGN.md section 3 ("Verify") and the file's header, with ``c_j`` the masked
cumulative log decays of the ring's first ``n = start + T`` slots::

    u_p = beta_p (v_p - e^{c_p} R k_p) - sum_{j<p} beta_p e^{c_p - c_j} (k_j . k_p) u_j
    o_t = e^{c_p} R q_t + sum_{j<=p} e^{c_p - c_j} (k_j . q_t) u_j,         p = start + t

(slots ``j < start``: the cached corrections ``u_known``). The products with the state,
``Y = R [k_start..k_n-1 | q_0..q_T-1]``, run on ``mma.sync m16n8k8`` in 3xTF32 with FP32
accumulation (the Triton kernel's ``tf32x3`` accuracy class: both within ``1e-5 + 1e-5 |ref|``
of float64; since the fiftieth pass R's low TF32 part is truncated, not rounded, leaving out
less than ``2^-21 |R|`` an element against ``2^-22``); one CTA per (sequence, value head) at 64-102
registers, so 4-6 CTAs share an SM where the Triton kernel runs one program of 255 registers.
Every sum's order is fixed by the CTA's code: a sequence's bits do not depend on its batch,
position or neighbours (checked on the device by ``tests/test_cuda_verify.py`` and
``benchmarks/verify_cuda.py``). Issue 15, forty-second and forty-third passes
(``docs/kernels-replay.md``).

The decode state runs it in place (``out=u_known``): the corrections go straight into its
ring from each sequence's start on, with no copy back. The kernel itself asserts that the
drafts fit the ring (``0 <= start <= J - T``), so a covered call has no extra check launch.

Covered (:func:`unsupported` says why not, otherwise): a plain FP32 read copy that is the
anchor, ``fold_cached_corrections``, DK = DV = 128, 1 <= T <= 8, J <= 16 ring slots, CUDA
compute capability >= 8.0, the float4 operands (R, v, k, q, u_known) 16-byte aligned with
contiguous rows (a non-contiguous ``q`` is copied), the ring
tensors sharing one slot stride (a state's ring of ``window + max_drafts`` slots, of which the
first J are passed). Building needs nvcc and ninja (``torch.utils.cpp_extension``); the
extension is built at the first call the kernel covers, once per machine (torch caches it in
``TORCH_EXTENSIONS_DIR``), and loaded once per process.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

__all__ = ["SOURCE", "DIM", "T_MAX", "J_MAX", "LAUNCH", "LIBRARY_VARIANTS",
           "GDN_VERIFY_CUDA_CONFIG", "build", "unsupported", "gdn_verify_cuda",
           "gdn_state_verify_cuda", "decomposition"]

SOURCE = Path(__file__).resolve().parent / "gdn_verify.cu"
DIM, T_MAX, J_MAX = 128, 8, 16
MIN_CAPABILITY = (8, 0)  # mma.sync tf32, cp.async
#: every launch variant the kernel has (``benchmarks/verify_cuda.py`` builds them all):
#: warps ``nw`` -> units of R loaded ahead ``pf`` and CTAs per SM asked of ptxas ``mb``; the
#: epilogue's ring operands ``ep`` 0 (late into registers), 1 (early), 2 (cp.async to shared)
LAUNCH = {4: {"pf": (2, 3, 4, 5, 6), "mb": (0, 5, 6)},
          8: {"pf": (2, 3, 4, 5, 7), "mb": (0, 2, 3, 4)}}
#: the variants the library's build holds ``(nw, pf, mb, ep)`` (the host dispatch of
#: gdn_verify.cu without GDN_VERIFY_ALL_VARIANTS names the same ones)
LIBRARY_VARIANTS = ((8, 3, 0, 2), (4, 3, 0, 0), (8, 2, 4, 2))
#: the default launch: the fastest variant at the worst start (H100, B = 256: 283.3 us at
#: 744aff1, 278.9 at 9faf565, against 405.1 / 401.6 us for the Triton kernel;
#: docs/kernels-replay.md)
GDN_VERIFY_CUDA_CONFIG = {"nw": 8, "pf": 3, "mb": 0, "ep": 2}

#: the decode step's kernel, built into the same extension (:mod:`.cuda_step`)
STEP_SOURCE = Path(__file__).resolve().parent / "gdn_step.cu"
#: the flush's kernel (fp16 anchor, NVFP4 read copy), built into it too (:mod:`.cuda_flush`)
FLUSH_SOURCE = Path(__file__).resolve().parent / "gdn_flush.cu"

_DECL = ("void gdn_verify_cuda(torch::Tensor R, torch::Tensor la, torch::Tensor beta, "
         "torch::Tensor v, torch::Tensor k, torch::Tensor q, torch::Tensor uk, "
         "torch::Tensor start, torch::Tensor o, torch::Tensor uout, int64_t known, "
         "int64_t nw, int64_t pf, int64_t mb, int64_t ep);\n"
         "void gdn_step_cuda(torch::Tensor R, torch::Tensor codes, torch::Tensor bscale, "
         "torch::Tensor mscale, int64_t fmt, torch::Tensor rla, torch::Tensor rbeta, "
         "torch::Tensor rv, torch::Tensor rk, torch::Tensor ru, torch::Tensor q, "
         "torch::Tensor k, torch::Tensor v, torch::Tensor g, torch::Tensor beta, "
         "torch::Tensor h, torch::Tensor o, int64_t stage);\n"
         "void gdn_flush_cuda(torch::Tensor A, torch::Tensor la, torch::Tensor beta, "
         "torch::Tensor v, torch::Tensor k, torch::Tensor length, torch::Tensor q, "
         "torch::Tensor seq, torch::Tensor fl, torch::Tensor aout, torch::Tensor codes, "
         "torch::Tensor bscale, torch::Tensor mscale, torch::Tensor y, torch::Tensor S, "
         "torch::Tensor w, int64_t J, int64_t seed_lo, int64_t seed_hi, int64_t kbits, "
         "int64_t flags, int64_t variant);\n")


_BUILT: set[bool] = set()  # the builds this process holds (all_variants False / True)
_FUNCTIONS = ("gdn_verify_cuda", "gdn_step_cuda", "gdn_flush_cuda")


def binding_source() -> str:
    """The extension's C++ binding: the three host functions' declarations (``_DECL``) and
    their Python module (``TORCH_EXTENSION_NAME``, which torch's build defines). The kernels
    are three translation units of their own, which ninja compiles in parallel (one unit of
    all three took the first build past a 90 s timeout in the forty-seventh pass)."""
    defs = "".join(f'  m.def("{f}", &{f}, "{f}");\n' for f in _FUNCTIONS)
    return ("#include <torch/extension.h>\n" + _DECL +
            "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {\n" + defs + "}\n")


def _warn_if_locked(ce, name: str) -> None:
    """Warn (once, before the build waits) where torch's build lock of extension ``name`` is
    held. torch waits on that file without a word, forever where a build was interrupted
    (killed or Ctrl-C while nvcc ran) and left it behind; the warning names the file to
    delete. Nothing happens where the build directory cannot be found (a private torch
    helper, ``_get_build_directory``, that a later torch may rename)."""
    try:
        lock = Path(ce._get_build_directory(name, False)) / "lock"
        if not lock.exists():
            return
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lock.stat().st_mtime))
    except Exception:  # (the lock can vanish between the two calls; an unknown torch)
        return
    warnings.warn(f"the CUDA kernels' build lock {lock} exists (since {since}): another "
                  f"process is building them, or an earlier build was interrupted and left "
                  f"it; this process waits until the file is gone, so where no build is "
                  f"running, delete it", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=2)
def build(all_variants: bool = False):
    """The compiled extension (``torch.utils.cpp_extension.load`` of ``SOURCE``, the verify,
    ``STEP_SOURCE``, the decode step of :mod:`.cuda_step`, and ``FLUSH_SOURCE``, the flush of
    :mod:`.cuda_flush`, as three translation units that ninja compiles in parallel, plus
    :func:`binding_source`; for the visible GPUs' architectures), built on first use and
    cached for the process (torch keeps the build on disk, so later processes load it).
    ``all_variants``: every verify variant of :data:`LAUNCH` (about 100 instantiations, for
    the benchmark) instead of :data:`LIBRARY_VARIANTS`.

    Raises:
        RuntimeError: no CUDA device, one below compute capability 8.0, no nvcc (CUDA
            toolkit) or ninja, or a failed build; the message says what is missing and that
            ``backend="triton"`` runs without it.

    Warns (RuntimeWarning) before it waits where torch's build lock is held: another
    process builds, or an interrupted build left the lock (:func:`_warn_if_locked`).
    """
    fix = "; backend='triton' (REPLAYSSM_BACKEND=triton) runs the Triton kernels without them"
    if not torch.cuda.is_available():
        raise RuntimeError("the CUDA kernels (GDN verify, step and flush) need a CUDA device" + fix)
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        raise RuntimeError(f"the CUDA kernels (GDN verify, step and flush) need compute capability "
                           f">= 8.0 (mma.sync tf32, cp.async), got {cap[0]}.{cap[1]}" + fix)
    from torch.utils import cpp_extension as ce

    if ce.CUDA_HOME is None and shutil.which("nvcc") is None:
        raise RuntimeError("the CUDA kernels (GDN verify, step and flush) are built at first use and "
                           "need nvcc (a CUDA toolkit; set CUDA_HOME), found none" + fix)
    if not ce.is_ninja_available():
        raise RuntimeError("the CUDA kernels (GDN verify, step and flush) are built at first use and "
                           "need ninja (pip install ninja)" + fix)
    # (-ftz=false, nvcc's default, spelled out: the step's NVFP4 decode holds E2M1 0.5 and the
    # E4M3 subnormal scales as float32 subnormals)
    flags = ["-O3", "-std=c++17", "-ftz=false"] + (
        ["-DGDN_VERIFY_ALL_VARIANTS"] if all_variants else [])
    name = "replayssm_gdn_cuda" + ("_all" if all_variants else "")
    _warn_if_locked(ce, name)
    try:
        # the binding goes into torch's build directory of the extension (written where it
        # changed only: its content is part of torch's rebuild decision)
        try:
            where = Path(ce._get_build_directory(name, False))
        except AttributeError:  # (a private torch helper; a later torch may rename it)
            where = Path(tempfile.gettempdir()) / f"{name}_binding"
            where.mkdir(parents=True, exist_ok=True)
        bind = where / "replayssm_binding.cpp"
        text = binding_source()
        if not bind.exists() or bind.read_text() != text:
            bind.write_text(text)
        mod = ce.load(name, sources=[str(bind), str(SOURCE), str(STEP_SOURCE),
                                     str(FLUSH_SOURCE)],
                      extra_cuda_cflags=flags, verbose=False)
    except Exception as e:  # compiler and linker errors come as several exception types
        raise RuntimeError(f"building the CUDA kernels ({SOURCE.name}, {STEP_SOURCE.name}, "
                           f"{FLUSH_SOURCE.name}) "
                           f"failed: {e}" + fix) from e
    _BUILT.add(all_variants)
    return mod


def _ring_slots(t: torch.Tensor, per_slot: int) -> int | None:
    """The ring's slots per sequence (batch stride / slot size) when ``t [B, J, ...]`` has
    contiguous slots of ``per_slot`` elements and a batch stride of whole slots; else None."""
    if t.shape[0] == 0 or t.shape[1] == 0:
        return None
    inner = t[0, 0] if t.dim() > 2 else None
    if inner is not None and not inner.is_contiguous():
        return None
    if t.dim() >= 2 and t.shape[1] > 1 and t.stride(1) != per_slot:
        return None
    if t.shape[0] > 1 and t.stride(0) % per_slot:
        return None
    return t.stride(0) // per_slot if t.shape[0] > 1 else t.shape[1]


def unsupported(read, anchor, la, beta, v, k, q, u_known, start,
                fold_cached_corrections: bool = False, out=None) -> str | None:
    """Why :func:`gdn_verify_cuda` would hand this call to the Triton kernel, or None when the
    CUDA kernel covers it (module docstring). Arguments as :func:`gdn_verify_cuda`; never
    raises (inputs the kernels refuse are left to their checks, ``out`` to
    :func:`_check_out`)."""
    ts = {"read": read, "la": la, "beta": beta, "v": v, "k": k, "q": q, "u_known": u_known}
    if out is not None:
        ts["out"] = out
    bad = [n for n, t in ts.items() if type(t) is not torch.Tensor]
    if bad:
        return f"{bad[0]} is not a plain torch.Tensor (a packed read copy, or not a tensor)"
    if anchor is not read:
        return "the read copy is not the anchor (a dual policy)"
    if fold_cached_corrections is not True:
        return "fold_cached_corrections is off (the A path re-solves against the anchor)"
    if not isinstance(start, torch.Tensor) or start.dim() != 1 or start.dtype not in (
            torch.int32, torch.int64):
        return "start is not an integer [B] tensor"
    if any(t.dtype != torch.float32 for t in ts.values()):
        return "an input is not float32"
    if read.dim() != 4 or tuple(read.shape[2:]) != (DIM, DIM) or not read.is_contiguous():
        return f"the state is not a contiguous [B, H, {DIM}, {DIM}] tensor"
    if (la.dim(), beta.dim(), v.dim(), k.dim(), q.dim(), u_known.dim()) != (3, 3, 4, 4, 4, 4):
        return "a record or draft tensor has the wrong number of dimensions"
    B, H = read.shape[:2]
    J, G, T = la.shape[1], k.shape[2], q.shape[1]
    if B == 0 or J < T:
        return "an empty batch, or fewer ring slots than drafts"
    if not 1 <= T <= T_MAX:
        return f"T = {T} drafts (the kernel takes 1..{T_MAX})"
    if J > J_MAX:
        return f"J = {J} ring slots (the kernel takes at most {J_MAX})"
    if G < 1 or H % G or k.shape[3] != DIM or v.shape[3] != DIM or q.shape[3] != DIM:
        return "key or value dims other than 128, or key heads not dividing value heads"
    js = {n: _ring_slots(t, s) for n, t, s in (
        ("la", la, H), ("beta", beta, H), ("v", v, H * DIM), ("k", k, G * DIM),
        ("u_known", u_known, H * DIM))}
    if None in js.values() or len(set(js.values())) != 1 or next(iter(js.values())) < J:
        return "the ring tensors do not share one layout of contiguous slots"
    if out is not None:
        us = _ring_slots(out, H * DIM) if out.dim() == 4 else None
        if us is None or us < J:
            return "out does not have contiguous slots"
    if not q.is_contiguous():
        return "q is not contiguous"
    # float4 loads, cp.async
    return placement(read.device, (read, v, k, q, u_known), (*ts.values(), start))


def placement(device, aligned, tensors) -> str | None:
    """The placement rule the CUDA kernels share (:func:`unsupported` and
    :func:`.cuda_step.unsupported`): why not, or None when every tensor of ``aligned`` starts
    on a 16-byte boundary, every tensor of ``tensors`` is on ``device``, a CUDA device of
    compute capability >= 8.0."""
    if any(t.data_ptr() % 16 for t in aligned):
        return "an input does not start on a 16-byte boundary"
    if device.type != "cuda" or any(t.device != device for t in tensors):
        return "the inputs are not all on one CUDA device"
    if torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return "the device is below compute capability 8.0"
    return None


def _variant(nw, pf, mb, ep, all_variants: bool) -> tuple[int, int, int, int]:
    d = GDN_VERIFY_CUDA_CONFIG
    var = tuple(d[n] if x is None else x for n, x in zip(("nw", "pf", "mb", "ep"),
                                                         (nw, pf, mb, ep)))
    if all_variants:
        if var[0] in LAUNCH and var[1] in LAUNCH[var[0]]["pf"] and \
                var[2] in LAUNCH[var[0]]["mb"] and var[3] in (0, 1, 2):
            return var
        raise ValueError(f"gdn_verify_cuda: (nw, pf, mb, ep) = {var} is not a launch variant; "
                         f"nw in {tuple(LAUNCH)}, pf and mb by nw {LAUNCH}, ep in (0, 1, 2)")
    if var not in LIBRARY_VARIANTS:
        raise ValueError(f"gdn_verify_cuda: (nw, pf, mb, ep) = {var} is not one of the "
                         f"library's variants {LIBRARY_VARIANTS} (all_variants=True builds "
                         f"every one)")
    return var


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[first, last)`` a tensor's elements occupy."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements in the same order (address, shape,
    strides)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.device == b.device)


def _check_out(out, read, la, beta, v, k, q, u_known, start) -> None:
    """:func:`gdn_verify_cuda`'s ``out``: float32, ``u_known``'s shape and device,
    and either ``u_known`` itself (the same view: the in-place use) or overlapping no input
    (by byte span: a view sharing a buffer with an input, even without sharing an element,
    is refused).

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(u_known, torch.Tensor):
        return  # (the kernels' checks name it)
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"gdn_verify_cuda: out must be a tensor like u_known, got "
                         f"{type(out).__name__}")
    if out.requires_grad:
        raise ValueError("gdn_verify_cuda: out requires grad; the verify writes it in place "
                         "(pass a tensor that does not, e.g. under torch.no_grad())")
    if any(st == 0 and n > 1 for n, st in zip(out.shape, out.stride())):
        raise ValueError(f"gdn_verify_cuda: out has a dimension of stride 0 (an expanded view, "
                         f"strides {tuple(out.stride())}): its elements overlap one another")
    if out.dtype != torch.float32 or out.shape != u_known.shape or out.device != u_known.device:
        raise ValueError(f"gdn_verify_cuda: out must be float32 {tuple(u_known.shape)} on "
                         f"{u_known.device} (like u_known), got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    same = _same_view(out, u_known)
    o0, o1 = _span(out)
    for name, t in (("read", read), ("la", la), ("beta", beta), ("v", v), ("k", k), ("q", q),
                    ("u_known", u_known), ("start", start)):
        if name == "u_known" and same:
            continue
        if isinstance(t, torch.Tensor) and t.device == out.device:
            t0, t1 = _span(t)
            if o0 < t1 and t0 < o1:
                raise ValueError(f"gdn_verify_cuda: out overlaps {name} in memory; out must be "
                                 f"u_known itself (the same view) or memory of its own")


def gdn_verify_cuda(read, anchor, la, beta, v, k, q, u_known, start, window: int,
                    fold_cached_corrections: bool = False, *, out: torch.Tensor | None = None,
                    nw: int | None = None, pf: int | None = None, mb: int | None = None,
                    ep: int | None = None, all_variants: bool = False, fallback: bool = True):
    """:func:`~.records.gdn_verify_kernel` (same arguments and results) on the CUDA kernel
    where it applies (:func:`unsupported` is None), else on the Triton kernel.

    Shapes: ``read`` = ``anchor`` ``[B, H, 128, 128]`` FP32 (the stored copy), ``la, beta
    [B, J, H]``, ``v, u_known [B, J, H, 128]``, ``k [B, J, G, 128]`` (J <= 16 ring slots,
    committed then drafts; may be the first J slots of a longer ring), ``q [B, T, G, 128]``
    (T <= 8), ``start`` integer ``[B]`` with ``start + T <= J`` (asserted on the device, as the
    Triton path does). Returns ``(o [B, T, H, 128], uR [B, J, H, 128])`` float32: the drafts'
    outputs, and the corrections (the known ones before ``start``, the drafts' solved ones,
    zeros after). ``window`` is checked but not read (the flush-slot draft's A path is the R
    path here). ``nw, pf, mb, ep``: the launch variant (default
    :data:`GDN_VERIFY_CUDA_CONFIG`; with ``all_variants`` any of :data:`LAUNCH`).
    ``fallback=False``: raise instead of running the Triton kernel. A non-contiguous ``q`` is
    copied first.

    ``out`` (float32, ``u_known``'s shape and device): write the corrections there instead of into a
    fresh tensor, and return it as ``uR``. Only its slots ``start .. J-1`` of each sequence are
    written (the drafts' solved corrections, then zeros); its slots below ``start`` are left
    as they are. So ``out=u_known`` is the in-place form the decode state runs (its ring
    already holds the known corrections): it saves writing them, and the state's copy of
    ``uR`` back into the ring (64 MiB at GDN's B = 256). ``out`` must be ``u_known`` itself
    or overlap no input. On the Triton fallback the same slots are written, by a masked copy.

    Raises:
        ValueError: inputs the Triton kernel's checks refuse (naming them); an ``out`` of
            another dtype (float32 is required), shape or device than ``u_known``, or one
            overlapping an input other than as ``u_known`` itself; a launch variant not built;
            with ``fallback=False``, a call the CUDA kernel does not cover (naming why).
        RuntimeError: the extension cannot be built (:func:`build`); a start outside
            ``0 .. J - T`` (the kernel's device-side assertion, at the next synchronisation,
            after it prints the sequence and its start; the Triton path asserts the same in
            a launch of its own).
    """
    from .records import _check_verify, gdn_verify_kernel

    var = _variant(nw, pf, mb, ep, all_variants)  # (a variant not built is refused either way)
    if isinstance(q, torch.Tensor) and not q.is_contiguous():
        q = q.contiguous()  # the drafts' queries as a caller sliced them: 4 MiB at B = 256
    if out is not None:  # before anything is written to it
        _check_out(out, read, la, beta, v, k, q, u_known, start)
    why = unsupported(read, anchor, la, beta, v, k, q, u_known, start, fold_cached_corrections,
                      out)
    if why is not None:
        if not fallback:
            raise ValueError(f"gdn_verify_cuda: the CUDA kernel does not cover this call: {why}")
        o, u = gdn_verify_kernel(read, anchor, la, beta, v, k, q, u_known, start, window,
                                 fold_cached_corrections)  # (its checks: shapes, the range)
        if out is None:
            return o, u
        if _same_view(out, u_known):  # u holds u_known's bits below start: one plain copy
            out.copy_(u)
        else:
            drafts_on = (torch.arange(u.shape[1], device=u.device)
                         >= start.to(u.device)[:, None])[:, :, None, None]  # slots >= start
            torch.where(drafts_on, u, out, out=out)
        return o, out
    _check_verify("gdn_verify_cuda", read, anchor, la, v, k, q, start, window, beta=beta,
                  u_known=u_known, assert_range=False)  # shapes; the range: the kernel
    mod = build(all_variants)
    B, H, J, T = read.shape[0], read.shape[1], la.shape[1], q.shape[1]
    start = start.to(torch.int64).contiguous()
    o = torch.empty(B, T, H, DIM, dtype=torch.float32, device=read.device)
    u = torch.empty(B, J, H, DIM, dtype=torch.float32, device=read.device) if out is None \
        else out
    with torch.cuda.device(read.device):  # the launch takes the current device and stream
        mod.gdn_verify_cuda(read, la, beta, v, k, q, u_known, start, o, u, int(out is None),
                            *var)
    return o, u


def gdn_state_verify_cuda(cps, la, beta, v, k, q, u_known, start, window: int,
                          fold_cached_corrections: bool = False):
    """CUDA kernel of :func:`replay.gdn.gdn_state_verify` (the state objects' verify under
    ``backend="cuda"``): :func:`gdn_verify_cuda` on the stored checkpoints ``cps``. Its
    ``prepare`` (same arguments) builds the extension when this call is one the kernel covers:
    the state calls it before it changes anything, so that a failed build leaves it as it
    was. Unlike the reference and the Triton op, it changes an input: the corrections are
    written into ``u_known`` in place (``out=u_known``: the ring's slots from ``start`` on,
    the same values the other ops return there), and ``u_known`` is returned as ``uR``; the
    state then has nothing to copy back."""
    return gdn_verify_cuda(cps.read_stored, cps.anchor_stored, la, beta, v, k, q, u_known,
                           start, window, fold_cached_corrections, out=u_known)


def _prepare_state_verify(cps, la, beta, v, k, q, u_known, start, window: int,
                          fold_cached_corrections: bool = False) -> None:
    if False in _BUILT:  # the library's build is loaded
        return
    if isinstance(q, torch.Tensor) and not q.is_contiguous():
        q = q.contiguous()  # as gdn_verify_cuda does
    if unsupported(cps.read_stored, cps.anchor_stored, la, beta, v, k, q, u_known, start,
                   fold_cached_corrections) is None:
        build()


gdn_state_verify_cuda.prepare = _prepare_state_verify


def decomposition(R, la, beta, v, k, q, uk, start):
    """The CUDA kernel's decomposition of ``gdn_verify`` (fold=CACHED, anchor = read) in
    torch, in the inputs' dtype (any device): ``Y = R X`` with ``X = [the T drafts' keys |
    the T queries]``, the ring keys' products ``Z = K X``, the coefficient tables, then per
    value row the drafts' corrections by forward substitution and the outputs (formulas in
    the module docstring). Shapes as :func:`gdn_verify_cuda` (contiguous ring of J slots);
    returns ``(o [B, T, H, V], uR [B, J, H, V])``. The CPU oracle of what the kernel computes:
    ``tests/test_replay_kernels.py`` checks it against float64 ``gdn_verify``."""
    B, H = R.shape[:2]
    J, T, G = la.shape[1], q.shape[1], k.shape[2]
    gi = torch.arange(H, device=R.device) // (H // G)
    bi = torch.arange(B, device=R.device)[:, None]
    slots = torch.arange(J, device=R.device)
    pos = start[:, None] + torch.arange(T, device=R.device)[None]  # [B, T] draft slots
    n = start + T
    live = (slots[None] < n[:, None])[..., None]  # [B, J, 1]
    c = torch.where(live, la, 0.0).cumsum(1)  # [B, J, H]
    bet = torch.where(live, beta, 0.0)
    kh = k[:, :, gi]  # [B, J, H, K]
    X = torch.cat([kh[bi, pos], q[:, :, gi]], 1)  # [B, 2T, H, K]
    Y = torch.einsum("bhvk,bchk->bchv", R, X)  # [B, 2T, H, V]
    Z = torch.einsum("bjhk,bchk->bjch", kh, X)  # [B, J, 2T, H]
    cp = c[bi, pos]  # [B, T, H]
    dec = torch.exp(cp[:, :, None] - c[:, None])  # [B, T, J, H]: e^{c_p - c_j}
    committed = (slots[None] < start[:, None])[:, None, :, None]  # [B, 1, J, 1]
    ac = torch.where(committed, bet[bi, pos][:, :, None] * dec * Z[:, :, :T].transpose(1, 2), 0.0)
    bc = torch.where(committed, dec * Z[:, :, T:].transpose(1, 2), 0.0)
    uc = torch.where((slots[None] < start[:, None])[..., None, None], uk, 0.0)
    b0 = bi[:, 0]
    ud = []
    for i in range(T):
        acc = bet[b0, pos[:, i]][..., None] * (
            v[b0, pos[:, i]] - torch.exp(cp[:, i])[..., None] * Y[:, i])
        acc = acc - torch.einsum("bjh,bjhv->bhv", ac[:, i], uc)
        for i2 in range(i):
            p2 = pos[:, i2]
            a = bet[b0, pos[:, i]] * torch.exp(cp[:, i] - c[b0, p2]) * Z[b0, p2, i]
            acc = acc - a[..., None] * ud[i2]
        ud.append(acc)
    o = []
    for t in range(T):
        acc = torch.exp(cp[:, t])[..., None] * Y[:, T + t] + torch.einsum(
            "bjh,bjhv->bhv", bc[:, t], uc)
        for i in range(t + 1):
            p2 = pos[:, i]
            acc = acc + (torch.exp(cp[:, t] - c[b0, p2]) * Z[b0, p2, T + t])[..., None] * ud[i]
        o.append(acc)
    u = uc.clone()
    for i in range(T):
        u[b0, pos[:, i]] = ud[i]
    return torch.stack(o, 1), u
