"""Packed storage of a quantised tensor (:class:`PackedTensor`) and the element codecs.

A leaf module: it imports nothing of the package but :mod:`replayssm_quant.formats`, so the
torch reference quantizer (:mod:`replayssm_quant.quant`), the replay references and the Triton
kernels can all use the one storage type without importing each other
(``docs/architecture.md``).

Codes (DESIGN.md section 4): fp32 / bf16 / fp16 store values; fp8 and mxfp8 one uint8 code
per element (torch's float8 bit patterns); nvfp4 / mxfp4 two E2M1 codes per byte, element 2i in
the low nibble; block scales are E4M3 codes (nvfp4) or E8M0 codes (mx, 0xFF = NaN); matrix
scales are FP32. ``PackedTensor.dequantize`` gives exactly the values of
:func:`replayssm_quant.quant.quantize`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import formats as F
from .capabilities import available_device
from .formats import QuantSpec

__all__ = ["PackedTensor"]


# ----------------------------------------------------------------------------------------
# codes
# ----------------------------------------------------------------------------------------


_F32_MAX = torch.finfo(torch.float32).max


def _as_float32(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32, the working precision of every cast (DESIGN.md section 4). A finite
    float64 value beyond float32's range saturates to +-float32 max (float32's own cast would
    give inf, and then an fp16 cast inf and a matrix- or block-scaled one NaN for the whole
    matrix, where DESIGN.md asks overflow to saturate); inf and NaN stay as they are. Other
    dtypes convert exactly."""
    if x.dtype != torch.float64:
        return x.to(torch.float32)
    big = x.isfinite() & (x.abs() > _F32_MAX)
    if bool(big.any()):
        x = torch.where(big, x.sign() * _F32_MAX, x)
    return x.to(torch.float32)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2^e as float32 for integer tensor e in [-149, 127], built from the bits."""
    e = e.to(torch.int32)
    normal = ((e + 127).clamp(min=1) << 23).view(torch.float32)
    sub = (torch.ones_like(e) << (e + 149).clamp(0, 22)).view(torch.float32)
    return torch.where(e >= -126, normal, sub)


_E2M1_LUT = torch.tensor(list(F.E2M1_VALUES) + [-v for v in F.E2M1_VALUES], dtype=torch.float32)


def _e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 grid values (NaN allowed, encoded as 0) -> uint8 codes 0..15 (sign in bit 3)."""
    mag = torch.nan_to_num(v.abs(), nan=0.0)
    idx = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
    sign = torch.signbit(v) & ~torch.isnan(v)
    return idx | (sign.to(torch.uint8) << 3)


@functools.lru_cache(maxsize=None)
def _e2m1_lut(device: torch.device) -> torch.Tensor:
    """The E2M1 table on ``device``, copied there once (a copy from pageable host memory on
    every decode made the host wait for the GPU)."""
    return _E2M1_LUT.to(device)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return _e2m1_lut(codes.device)[codes.long()]


def _fp8_encode(v: torch.Tensor, grid: F.FloatGrid) -> torch.Tensor:
    dt = torch.float8_e4m3fn if grid is F.E4M3 else torch.float8_e5m2
    return v.to(dt).view(torch.uint8)


def _fp8_decode(codes: torch.Tensor, grid: F.FloatGrid) -> torch.Tensor:
    dt = torch.float8_e4m3fn if grid is F.E4M3 else torch.float8_e5m2
    return codes.view(dt).to(torch.float32)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes (K even) -> [..., K/2] bytes, element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes -> float32 2^(code-127); 0xFF -> NaN (OCP MX v1.0 section 5.4)."""
    val = _pow2(codes.to(torch.int32) - F.E8M0_BIAS)
    return torch.where(codes == F.E8M0_NAN, torch.full_like(val, float("nan")), val)


# ----------------------------------------------------------------------------------------
# packed storage
# ----------------------------------------------------------------------------------------


# the stored element dtype of the unscaled formats (codes hold the values themselves)
_PLAIN_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class PackedTensor:
    """Real low-precision storage of a ``[..., M, K]`` tensor.

    Attributes:
        spec: the :class:`QuantSpec` used.
        shape: logical shape ``[..., M, K]``.
        codes: element codes. fp32: float32 values; bf16/fp16: bfloat16/float16 values;
            fp8 and mxfp8: uint8 codes ``[..., M, Kp]``; nvfp4/mxfp4: uint8 ``[..., M, Kp/2]``
            with two E2M1 codes per byte, element 2i in the low nibble. ``Kp`` is K padded to
            whole scaling blocks.
        block_scales: uint8 ``[..., M, Kp/block]``: E4M3 codes (nvfp4) or E8M0 codes (mx),
            else None.
        matrix_scale: float32 ``[...]`` (fp8 and nvfp4), else None.
    """

    spec: QuantSpec
    shape: torch.Size
    codes: torch.Tensor
    block_scales: torch.Tensor | None = None
    matrix_scale: torch.Tensor | None = None

    def __post_init__(self):
        """Check what the attributes above promise, so that a mismatched construction fails
        here, naming the field, rather than later inside a decoder.

        Raises:
            ValueError: ``spec`` not a :class:`QuantSpec` (a format string is parsed),
                ``codes`` not a tensor, its leading dims not ``shape``'s, an element dtype
                that is not the format's, or a missing block / matrix scale.
        """
        if isinstance(self.spec, str):
            self.spec = F.parse_spec(self.spec)
        if not isinstance(self.spec, QuantSpec):
            raise ValueError(f"PackedTensor spec must be a QuantSpec or a format string, got "
                             f"{self.spec!r}")
        if not isinstance(self.codes, torch.Tensor):
            raise ValueError(f"PackedTensor codes must be a tensor, got {type(self.codes).__name__}")
        self.shape = torch.Size(self.shape)
        if len(self.shape) < 1 or tuple(self.codes.shape[:-1]) != tuple(self.shape[:-1]):
            raise ValueError(f"PackedTensor codes of shape {tuple(self.codes.shape)} do not hold "
                             f"a {self.spec} tensor of shape {tuple(self.shape)} (the leading "
                             f"dims must agree)")
        info = self.spec.info
        want = (_PLAIN_DTYPES.get(self.spec.name, torch.float32) if info.scaling == "none"
                else torch.uint8)
        if self.codes.dtype != want:
            raise ValueError(f"PackedTensor codes of a {self.spec} tensor must be {want}, got "
                             f"{self.codes.dtype}")
        if info.scaling in ("nvfp4", "mx") and self.block_scales is None:
            raise ValueError(f"PackedTensor of {self.spec} needs block_scales")
        if info.scaling in ("matrix", "nvfp4") and self.matrix_scale is None:
            raise ValueError(f"PackedTensor of {self.spec} needs matrix_scale")

    @property
    def nbytes(self) -> int:
        """Bytes of real storage: codes + block scales + matrix scales."""
        n = self.codes.numel() * self.codes.element_size()
        for t in (self.block_scales, self.matrix_scale):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self) -> torch.Tensor:
        """Decode to float32 ``shape``; identical values to
        :func:`replayssm_quant.quant.quantize`."""
        info = self.spec.info
        k = self.shape[-1]
        if info.scaling == "none":
            return self.codes.to(torch.float32)
        grid = info.element
        if grid is F.E2M1:
            elem = _e2m1_decode(_unpack_nibbles(self.codes))
        else:
            elem = _fp8_decode(self.codes, grid)
        if info.scaling == "matrix":
            return elem * self.matrix_scale[..., None, None]
        block = info.block
        if info.scaling == "nvfp4":
            s_b = _fp8_decode(self.block_scales, F.E4M3)
            scale = s_b * self.matrix_scale[..., None, None]
            bad = torch.isnan(scale)
        else:
            scale = _e8m0_decode(self.block_scales)
            bad = torch.isnan(scale)
        elem = torch.where(bad.repeat_interleave(block, -1), float("nan"), elem)
        return (elem * scale.repeat_interleave(block, -1))[..., :k]

    def to(self, device) -> "PackedTensor":
        """The same storage on ``device`` (codes and scales moved; the values unchanged).

        Raises:
            ValueError: ``device`` is not a device this torch build or machine has, or is
                torch's ``"meta"`` device (no values to hold the codes).
        """
        device = available_device(device)
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedTensor(self.spec, self.shape, self.codes.to(device),
                            mv(self.block_scales), mv(self.matrix_scale))

    def __repr__(self) -> str:
        return (f"PackedTensor(spec={self.spec}, shape={tuple(self.shape)}, "
                f"nbytes={self.nbytes}, device={self.device})")
