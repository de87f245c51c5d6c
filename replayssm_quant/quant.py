"""Quantizers: fake quantisation (``quantize``) and real packed storage (``pack``).

This module is the plain torch reference. The Triton kernels in
``replayssm_quant.kernels.quant`` implement the same arithmetic in the same order and are
tested against it bit for bit (``tests/test_quant_kernels.py``). DESIGN.md section 4 is
the contract; every format constant comes from :mod:`replayssm_quant.formats`.

Layout: ``x`` has shape ``[..., M, K]``. The last two dims form one matrix (one state matrix
of one sequence and head); matrix-scaled formats keep one FP32 scale per matrix; block
scales run along the last dim K (the key axis: d_state for Mamba-2, d_k for GDN). A row
length that the block does not divide is padded with zeros to whole blocks; no scale is
ever shared across rows.

Arithmetic, per element, after scaling ``y = x / s`` (IEEE correctly rounded division):

* ``e = max(floor(log2|y|), emin)`` read from the FP32 exponent bits, quantum
  ``q = 2^(e - mbits)``, ``m = |y| / q`` (exact: q is a power of two);
* RTN: ``n = round_half_even(m)``; SR: ``n = floor(m) + [r < frac(m) * 2^32]`` with ``r``
  32 Philox bits keyed by (seed, stream, element) (:mod:`replayssm_quant.philox`);
* ``v = min(n * q, max)`` (a carry into the next binade is kept; saturation at max),
  sign restored with copysign (so -0.0 stays -0.0, SR of 0 is 0);
* dequantised value ``v * s`` (exact for every format here: element grids have at most
  4 significant bits and scales are powers of two or FP32 numbers whose product with such
  a value is formed once, identically, in both the fake and the packed path).

Scale rules (scales themselves always use RTN, never SR):

* fp8e4m3 / fp8e5m2: ``s = amax / FMAX`` per matrix (amax over finite |x|; s = 1 if it is 0).
* nvfp4: ``s_g = amax / (448 * 6)`` per matrix; per block of 16,
  ``s_b = E4M3_RTN(block_amax / (s_g * 6))``, element scale ``s_b * s_g``. Because ``s_b``
  is rounded to nearest, ``6 * s_b`` may be below the block amax: the largest element then
  clips to +-6 (E2M1 max). Example: block amax 3.1875, ``s_g`` = 1 -> 0.53125 is a tie ->
  ``s_b = 0.5``, 3.1875 / 0.5 = 6.375 -> 6. SR never exceeds 6 (saturation after rounding).
  A block whose ``s_b`` underflows to 0 (all zeros, or tiny beside the matrix amax) gives
  exact zeros with the elements' signs, never NaN.
* mxfp8 / mxfp4 (OCP MX v1.0 section 6.3): per block of 32,
  ``X = 2^clamp(floor(log2 block_amax) - emax_elem, -127, 127)`` with the exponent read from
  the bits; block_amax = 0 gives code 0 (2^-127) and zeros.

Non-finite values: see :mod:`replayssm_quant.formats` (NaN stays NaN; scaled formats turn
a block holding a non-finite value into a NaN block, stored through the scale's NaN code).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import backend as B
from . import formats as F
from .formats import QuantSpec, parse_spec
from .packed import (PackedTensor, _as_float32, _e2m1_encode, _e8m0_decode, _fp8_encode,
                     _pack_nibbles, _pow2)
from .philox import _check_stream, check_seed, random_bits_matrix, stream_keys_to

__all__ = [
    "quantize",
    "pack",
    "PackedTensor",
    "round_to_grid",
    "quantize_reference",
    "pack_reference",
    "BACKENDS",
]

BACKENDS = tuple(b.value for b in B.Backend)  # accepted ``backend=`` values (backend.Backend)


# ----------------------------------------------------------------------------------------
# element grids
# ----------------------------------------------------------------------------------------


def _float_exponent(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for finite float32 a > 0, from the exponent bits (-127 for subnormals,
    which every caller clamps to a larger emin)."""
    return ((a.view(torch.int32) >> 23) & 0xFF) - 127


def _exact_log2_floor(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for finite float32 a > 0, exact also for FP32 subnormals (MX scales)."""
    _, e = torch.frexp(a)
    return e - 1


def round_to_grid(
    y: torch.Tensor, grid: F.FloatGrid, rbits: torch.Tensor | None = None
) -> torch.Tensor:
    """Round float32 ``y`` onto the unscaled grid ``grid`` (RTN, or SR if ``rbits`` given).

    Args:
        y: float32 tensor, any shape.
        grid: element grid from :mod:`replayssm_quant.formats`.
        rbits: int64 tensor of 32-bit random integers broadcastable to ``y`` (SR), or None
            for round-half-to-even.

    Returns:
        float32 tensor of grid values (saturated at +-grid.max; NaN stays NaN; +-inf stays
        +-inf if the grid has infinities, else NaN).
    """
    if y.dtype != torch.float32:
        raise ValueError(f"round_to_grid expects float32, got {y.dtype}")
    a = y.abs()
    finite = torch.isfinite(y)
    a_f = torch.where(finite, a, torch.zeros_like(a))
    e = _float_exponent(a_f).clamp(min=grid.emin)
    q = _pow2(e - grid.mbits)
    m = a_f / q  # exact
    if rbits is None:
        n = torch.round(m)  # half to even
    else:
        fl = torch.floor(m)
        frac = (m - fl).double()
        up = rbits.double() < frac * 4294967296.0
        n = fl + up.to(torch.float32)
    v = torch.clamp(n * q, max=grid.max)
    v = torch.copysign(v, y)
    if grid.has_inf:
        v = torch.where(torch.isinf(y), y, v)
    else:
        v = torch.where(torch.isinf(y), torch.full_like(y, float("nan")), v)
    return torch.where(torch.isnan(y), y, v)


def _round_up_to_grid(y: torch.Tensor, grid: F.FloatGrid) -> torch.Tensor:
    """Finite float32 ``y >= 0`` rounded UP onto ``grid`` (ceil), saturating at ``grid.max``."""
    e = _float_exponent(y).clamp(min=grid.emin)
    q = _pow2(e - grid.mbits)
    return torch.clamp(torch.ceil(y / q) * q, max=grid.max)  # y / q exact


def _nvfp4_global_up(amax: torch.Tensor, s_g: torch.Tensor) -> torch.Tensor:
    """NVFP4 ``+up`` matrix scale: ``s_g = amax / 2688`` moved up by one FP32 ulp, twice at
    most, while ``amax / (448 * s_g) > 6`` (in FP32 arithmetic, as the element path divides),
    so a block whose E4M3 scale saturates at 448 never clips."""
    six = _const(amax, F.E2M1_MAX)
    for _ in range(2):
        over = amax / (s_g * _const(s_g, F.E4M3_MAX)) > six
        s_g = torch.where(over, torch.nextafter(s_g, torch.full_like(s_g, float("inf"))), s_g)
    return s_g


def _nvfp4_block_up(bamax: torch.Tensor, s_b: torch.Tensor, s_g: torch.Tensor) -> torch.Tensor:
    """NVFP4 ``+up`` block scales: ``s_b = E4M3_RU(enc)`` moved to the next E4M3 value where
    the block amax would still exceed 6 after scaling (``bamax / (s_b * s_g) > 6`` in FP32, a
    rounding-level case; one step of >= 6 % always suffices) and ``s_b`` is below 448."""
    clip = (bamax / (s_b * s_g) > _const(bamax, F.E2M1_MAX)) & (s_b > 0) & (s_b < F.E4M3_MAX)
    e = _float_exponent(torch.where(s_b > 0, s_b, torch.ones_like(s_b))).clamp(min=F.E4M3.emin)
    return torch.where(clip, s_b + _pow2(e - F.E4M3.mbits), s_b)


# ----------------------------------------------------------------------------------------
# reference quantisation
# ----------------------------------------------------------------------------------------


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() < 2:
        raise ValueError(
            f"x must have shape [..., M, K] (at least 2 dims: one matrix), got shape "
            f"{tuple(x.shape)}"
        )
    if x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"x must have non-empty matrix dims [M, K], got shape {tuple(x.shape)}")
    if x.device.type == "meta":
        raise ValueError("x is on device 'meta', which holds no values (torch's meta device); "
                         "quantise a tensor on cpu or cuda")


def _sr_bits(spec: QuantSpec, x: torch.Tensor, seed: int, stream) -> torch.Tensor | None:
    """Per-element Philox bits for SR: stream broadcast to x.shape[:-2] (one key per matrix)."""
    if not spec.sr:
        return None
    lead = x.shape[:-2]
    stream = stream_keys_to(stream, x.device)  # ValueError for keys that are not integers
    try:
        stream = torch.broadcast_to(stream, lead)
    except RuntimeError:
        raise ValueError(
            f"stream of shape {tuple(stream.shape)} does not broadcast to the leading dims "
            f"{tuple(lead)} of x {tuple(x.shape)}"
        ) from None
    return random_bits_matrix(seed, stream, x.shape[-2], x.shape[-1])


def _pad_blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    k = t.shape[-1]
    pad = (-k) % block
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))  # zeros: padding is initialised
    return t


def _const(like: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` as a float32 tensor of ``like``'s shape and device. Dividing by it is an IEEE
    division on every device (torch on CUDA turns division by a Python or CPU scalar into a
    multiplication by its rounded reciprocal, which rounds twice)."""
    return torch.full_like(like, value, dtype=torch.float32)


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))


@dataclass
class _Parts:
    """Intermediate of the reference: element grid values and the scales."""

    elem: torch.Tensor  # float32 [..., M, Kp] values on the element grid (NaN possible)
    scale_eff: torch.Tensor | None  # float32, broadcastable to elem (None: unscaled)
    matrix_scale: torch.Tensor | None  # float32 [...]
    block_codes: torch.Tensor | None  # uint8 [..., M, Kp/block] (E4M3 or E8M0 codes)


def _parts(x: torch.Tensor, spec: QuantSpec, seed: int, stream) -> _Parts:
    info = spec.info
    x = _as_float32(x)
    rbits = _sr_bits(spec, x, seed, stream)
    grid = info.element
    if info.scaling == "none":
        return _Parts(round_to_grid(x, grid, rbits), None, None, None)
    if info.scaling == "matrix":
        amax = _finite_abs(x).amax(dim=(-2, -1))
        s = amax / _const(amax, grid.max)
        s = torch.where(s > 0, s, torch.ones_like(s))
        y = x / s[..., None, None]
        return _Parts(round_to_grid(y, grid, rbits), s[..., None, None], s, None)

    block = info.block
    k = x.shape[-1]
    xp = _pad_blocks(x, block)
    if rbits is not None:
        rbits = _pad_blocks(rbits, block)
    nb = xp.shape[-1] // block
    xb = xp.unflatten(-1, (nb, block))  # [..., M, nb, block]
    bamax = _finite_abs(xb).amax(dim=-1)  # [..., M, nb]
    bad = (~torch.isfinite(xb)).any(dim=-1)  # non-finite block -> NaN block
    nan = torch.tensor(float("nan"), device=x.device)

    if info.scaling == "nvfp4":
        up = spec.scale == "up"
        amax = _finite_abs(x).amax(dim=(-2, -1))
        s_g = amax / _const(amax, F.E4M3_MAX * F.E2M1_MAX)
        s_g = torch.where(s_g > 0, s_g, torch.ones_like(s_g))
        if up:
            s_g = _nvfp4_global_up(amax, s_g)
        enc = bamax / (s_g * _const(s_g, F.E2M1_MAX))[..., None, None]
        if up:
            s_b = _nvfp4_block_up(bamax, _round_up_to_grid(enc, F.E4M3), s_g[..., None, None])
        else:
            s_b = round_to_grid(enc, F.E4M3)  # RTN, saturating at 448
        s_b = torch.where(bad, nan, s_b)
        block_codes = _fp8_encode(s_b, F.E4M3)
        scale = s_b * s_g[..., None, None]  # [..., M, nb]; NaN for bad blocks
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # 0 and NaN -> 1
        y = xb / safe[..., None]
        elem = round_to_grid(y, grid, None if rbits is None else rbits.unflatten(-1, (nb, block)))
        # a block whose scale is 0 (all zeros, or below the smallest E4M3 scale) stores
        # zeros that keep each element's sign (E2M1 has a -0 code)
        elem = torch.where((scale > 0)[..., None], elem,
                           torch.copysign(torch.zeros_like(elem), y))
        elem = torch.where(bad[..., None], nan, elem)
        return _Parts(elem.flatten(-2), scale.repeat_interleave(block, -1), s_g, block_codes)

    # OCP MX
    emax = F.MXFP8_EMAX if grid is F.E4M3 else F.MXFP4_EMAX
    pos = bamax > 0
    e = _exact_log2_floor(torch.where(pos, bamax, torch.ones_like(bamax)))
    if spec.scale:  # rceil / even: one binade up where the fraction passes the threshold
        bits = bamax.view(torch.int32)
        frac = bits & F.FP32_MANT_MASK
        normal = ((bits >> F.FP32_MBITS) & F.FP32_EXP_MASK) > 0
        bump = frac > F.MX_RCEIL_FRAC[spec.name] if spec.scale == "rceil" \
            else frac >= F.MX_EVEN_FRAC[spec.name]
        e = e + (normal & bump).to(e.dtype)
    sexp = torch.where(pos, e - emax, torch.full_like(e, F.E8M0_MIN_EXP))
    sexp = sexp.clamp(F.E8M0_MIN_EXP, F.E8M0_MAX_EXP)
    block_codes = (sexp + F.E8M0_BIAS).to(torch.uint8)
    block_codes = torch.where(bad, torch.full_like(block_codes, F.E8M0_NAN), block_codes)
    scale = _e8m0_decode(block_codes)
    safe = torch.where(torch.isnan(scale), torch.ones_like(scale), scale)
    y = xb / safe[..., None]
    elem = round_to_grid(y, grid, None if rbits is None else rbits.unflatten(-1, (nb, block)))
    elem = torch.where(bad[..., None], nan, elem)
    del k
    return _Parts(elem.flatten(-2), scale.repeat_interleave(block, -1), None, block_codes)


def _dequant(parts: _Parts, k: int) -> torch.Tensor:
    if parts.scale_eff is None:
        out = parts.elem
    else:
        out = parts.elem * parts.scale_eff
    return out[..., :k]


@B.reference("quantize")
def quantize_reference(x: torch.Tensor, spec, *, seed: int = 0, stream=0) -> torch.Tensor:
    """Torch reference of :func:`quantize` (runs on any device)."""
    spec = parse_spec(spec)
    _check_input(x)
    if spec.is_identity:
        return x if x.dtype in (torch.float32, torch.float64) else x.float()
    return _dequant(_parts(x, spec, seed, stream), x.shape[-1])


# ----------------------------------------------------------------------------------------
# packed storage (the type and its codecs: replayssm_quant.packed)
# ----------------------------------------------------------------------------------------


@B.reference("pack")
def pack_reference(x: torch.Tensor, spec, *, seed: int = 0, stream=0) -> PackedTensor:
    """Torch reference of :func:`pack`."""
    spec = parse_spec(spec)
    _check_input(x)
    info = spec.info
    shape = x.shape
    if info.scaling == "none":
        if spec.is_identity:
            return PackedTensor(spec, shape, _as_float32(x).clone())
        elem = _parts(x, spec, seed, stream).elem
        # NaN codes set here, whatever the NaN's payload and sign (torch's conversions pass
        # payload bits on in some cases: fp16 on x86 keeps their top bits), as the kernels
        # write them: bf16 0xFFFF (torch's CPU code for a NaN), fp16 0x7E00 | sign
        if info.element is F.BF16:
            dt, nan = torch.bfloat16, torch.full_like(elem, -1, dtype=torch.int16)  # 0xFFFF
        else:
            dt = torch.float16
            nan = torch.where(torch.signbit(elem), F.FP16_NAN_CODE_NEG - 0x10000,
                              F.FP16_NAN_CODE).to(torch.int16)
        codes = torch.where(torch.isnan(elem), nan, elem.to(dt).view(torch.int16))
        return PackedTensor(spec, shape, codes.view(dt))
    parts = _parts(x, spec, seed, stream)
    grid = info.element
    if grid is F.E2M1:
        codes = _pack_nibbles(_e2m1_encode(parts.elem))
    else:
        codes = _fp8_encode(parts.elem, grid)
    return PackedTensor(spec, shape, codes, parts.block_codes, parts.matrix_scale)


# ----------------------------------------------------------------------------------------
# public API: the backend seam picks reference or kernel
# ----------------------------------------------------------------------------------------


def _use_kernels(x: torch.Tensor, backend) -> bool:
    """The seam's decision for a quantizer call on ``x`` (:mod:`replayssm_quant.backend`)."""
    return B.use_kernels(B.OpFamily.QUANT, backend, device=x.device)


def quantize(x: torch.Tensor, spec, *, seed: int = 0, stream=0, backend: str | None = None):
    """Fake-quantise ``x`` to the format ``spec`` and return the dequantised values.

    Implements DESIGN.md section 4 (formats, RTN, SR, saturation) for one state matrix per
    ``[M, K]`` slice.

    Args:
        x: float tensor ``[..., M, K]`` (float16/bfloat16/float32/float64; computed in float32,
            a finite float64 value beyond float32's range saturating to +-float32 max first).
        spec: format token (``fp32 bf16 fp16 fp8e4m3 fp8e5m2 nvfp4 mxfp8 mxfp4``, optional
            ``+sr``) or a :class:`~replayssm_quant.formats.QuantSpec`.
        seed: Philox key for SR, int in [0, 2^63).
        stream: int or int64 tensor broadcastable to ``x.shape[:-2]``: the 64-bit stream key
            of each matrix (see :func:`replayssm_quant.philox.stream_key`). Only SR uses it;
            the default 0 gives every matrix the same random bits, so pass distinct keys
            (e.g. ``stream_key(sequence=..., head=...)``) for independent rounding.
        backend: ``"torch"`` (reference), ``"triton"`` (kernels; CPU only under
            ``TRITON_INTERPRET=1``) or ``None``/``"auto"`` (kernels on CUDA, reference
            elsewhere); ``None`` defers to ``REPLAYSSM_BACKEND`` (:mod:`replayssm_quant.backend`).

    Returns:
        float32 tensor of x's shape (``fp32`` returns float32/float64 input unchanged).

    Raises:
        ValueError: bad spec, seed, stream (not integer keys: floats, bools and strings are
            refused, not truncated, even where RTN does not use them; or a shape that does not
            broadcast), x's shape (fewer than 2 dims, empty matrix), or x on the meta
            device (no values).
    """
    spec = parse_spec(spec)
    seed = check_seed(seed)
    stream = _check_stream(stream)  # int64 keys, not checked again by the casts
    _check_input(x)
    if spec.is_identity:
        return quantize_reference(x, spec)
    impl = B.select(quantize_reference, _use_kernels(x, backend))
    return impl(x, spec, seed=seed, stream=stream)


def pack(x: torch.Tensor, spec, *, seed: int = 0, stream=0, backend: str | None = None):
    """Quantise ``x`` and return its real packed storage as a :class:`PackedTensor`.

    Same arguments, values and errors as :func:`quantize`;
    ``pack(x, s).dequantize()`` equals ``quantize(x, s)`` bit for bit, except for ``fp32``
    on float64 input: ``quantize`` returns such input unchanged (the working precision of a
    float64 run is kept, as the state path's float64 equivalence runs need), while ``pack``
    stores float32, its storage format, so its values are rounded (and saturated) to float32.
    """
    spec = parse_spec(spec)
    seed = check_seed(seed)
    stream = _check_stream(stream)
    _check_input(x)
    kernels = not spec.is_identity and _use_kernels(x, backend)
    return B.select(pack_reference, kernels)(x, spec, seed=seed, stream=stream)
