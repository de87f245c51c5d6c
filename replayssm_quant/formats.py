"""Format definitions: every limit of every state format lives here, as a named constant.

DESIGN.md section 4 is the contract. Sources:

* IEEE 754-2019 for binary16 (fp16) and the bfloat16 truncation of binary32.
* OCP 8-bit Floating Point Specification (OFP8) rev 1.0 for E4M3 ("FN": no infinities,
  max 448, NaN = S.1111.111) and E5M2 (IEEE-like, max 57344).
* OCP Microscaling Formats (MX) v1.0 for E2M1 (max 6, no inf/NaN), MXFP8/MXFP4
  (block of 32, E8M0 shared scale) and the scale rule X = 2^(floor(log2 amax) - emax_elem).
* NVIDIA NVFP4: E2M1 elements, one E4M3 scale per 16 consecutive elements and one FP32
  scale per tensor; here the "tensor" is one state matrix (sequence, head),
  s_g = amax / (E4M3_MAX * E2M1_MAX).

Saturation policy (documented choice, DESIGN.md section 4): finite values beyond the
largest finite value of a grid saturate to +-max (also for bf16/fp16, which IEEE would
round to inf); NaN stays NaN; +-inf stays +-inf on grids that have infinities (bf16,
fp16, fp8e5m2 unscaled) and becomes NaN on grids that have none (E4M3, E2M1). Scaled
formats compute their scales from the finite values only, and a non-finite value in a
scaling block makes that whole block NaN (the block scale is stored as the NaN code).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

__all__ = [
    "FloatGrid",
    "QuantSpec",
    "SpecError",
    "FORMATS",
    "FORMAT_NAMES",
    "parse_spec",
    "E4M3",
    "E5M2",
    "E2M1",
    "BF16",
    "FP16",
    "E4M3_MAX",
    "E5M2_MAX",
    "E2M1_MAX",
    "NVFP4_BLOCK",
    "MX_BLOCK",
    "E8M0_BIAS",
    "E8M0_NAN",
    "E8M0_MIN_EXP",
    "E8M0_MAX_EXP",
    "MXFP8_EMAX",
    "MXFP4_EMAX",
    "NVFP4_SCALE_DIVISOR",
    "E4M3_MAX_CODE",
    "E4M3_NAN_CODE_NEG",
    "E4M3_MIN_SUBNORMAL",
    "E2M1_MIN_SUBNORMAL",
    "FP32_EBITS",
    "FP32_MBITS",
    "FP32_EXP_BIAS",
    "FP32_EXP_MASK",
    "FP32_MANT_MASK",
    "FP32_EMIN",
    "FP32_MIN_SUBNORMAL_EXP",
    "E4M3_NAN_CODE",
    "FP16_NAN_CODE",
    "FP16_NAN_CODE_NEG",
    "SR_RANDOM_BITS",
    "SCALE_MODES",
    "MX_RCEIL_FRAC",
    "MX_EVEN_FRAC",
]


@dataclass(frozen=True)
class FloatGrid:
    """An unscaled sign-magnitude floating-point grid.

    ``emin`` is the exponent of the smallest normal number; the spacing (quantum) of the
    grid at a value with exponent ``e`` is ``2**(max(e, emin) - mbits)``, which also
    covers the subnormals.
    """

    name: str
    ebits: int
    mbits: int
    emin: int
    max: float
    has_inf: bool
    has_nan: bool

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, self.emin - self.mbits)


# OFP8 E4M3FN: bias 7, emin = 1 - 7 = -6, max = 1.75 * 2^8 = 448, NaN = 0x7F/0xFF, no inf.
E4M3 = FloatGrid("e4m3", 4, 3, -6, 448.0, has_inf=False, has_nan=True)
# OFP8 E5M2: bias 15, emin = -14, max = 1.75 * 2^15 = 57344, IEEE inf/NaN.
E5M2 = FloatGrid("e5m2", 5, 2, -14, 57344.0, has_inf=True, has_nan=True)
# OCP MX E2M1: bias 1, emin = 0, values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; no inf, no NaN.
E2M1 = FloatGrid("e2m1", 2, 1, 0, 6.0, has_inf=False, has_nan=False)
# bfloat16: binary32 exponent, 7 stored mantissa bits; max = (2 - 2^-7) * 2^127.
BF16 = FloatGrid("bf16", 8, 7, -126, float.fromhex("0x1.fe00000000000p+127"), True, True)
# IEEE binary16: emin = -14, max = 65504.
FP16 = FloatGrid("fp16", 5, 10, -14, 65504.0, has_inf=True, has_nan=True)

E4M3_MAX = E4M3.max  # 448: fp8e4m3 matrix scale maps amax -> 448; NVFP4 block-scale max
E5M2_MAX = E5M2.max  # 57344: fp8e5m2 matrix scale maps amax -> 57344
E2M1_MAX = E2M1.max  # 6: largest E2M1 magnitude
E4M3_NAN_CODE = 0x7F  # OFP8 E4M3FN NaN code (0xFF with the sign bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7, sign in bit 3

NVFP4_BLOCK = 16  # NVFP4: one E4M3 scale per 16 consecutive elements (along the key axis)
MX_BLOCK = 32  # OCP MX v1.0: one E8M0 scale per 32 elements
E8M0_BIAS = 127  # OCP MX v1.0: E8M0 scale = 2^(code - 127), codes 0..254
E8M0_NAN = 0xFF  # OCP MX v1.0: E8M0 code 0xFF is NaN
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
MXFP8_EMAX = 8  # exponent of the largest E4M3 normal (448 = 1.75 * 2^8), OCP MX Table 1
MXFP4_EMAX = 2  # exponent of the largest E2M1 normal (6 = 1.5 * 2^2), OCP MX Table 1

# Derived limits used by the kernels (kernels/quant.py, kernels/replay.py).
NVFP4_SCALE_DIVISOR = E4M3_MAX * E2M1_MAX  # 2688: NVFP4 matrix scale s_g = amax / (448 * 6)
E4M3_MAX_CODE = 0x7E  # OFP8 E4M3FN magnitude code of 448 (S.1111.110); 0x7F is NaN
E4M3_NAN_CODE_NEG = 0xFF  # E4M3_NAN_CODE with the sign bit (torch float32 -> float8 of -NaN)
# fp16 NaN codes, whatever the NaN's payload (the canonical quiet NaN with the sign kept, as
# torch's CPU float32 -> float16 gives for the canonical float32 NaN)
FP16_NAN_CODE, FP16_NAN_CODE_NEG = 0x7E00, 0xFE00
E4M3_MIN_SUBNORMAL = E4M3.min_subnormal  # 2^-9 = 0.001953125: E4M3 subnormal quantum
E2M1_MIN_SUBNORMAL = E2M1.min_subnormal  # 2^-1 = 0.5: E2M1 subnormal quantum

# IEEE 754 binary32 bit layout (sign | 8-bit exponent, bias 127 | 23-bit fraction): the
# kernels read exponents and significands from the FP32 bits.
FP32_EBITS = 8
FP32_MBITS = 23
FP32_EXP_BIAS = 127
FP32_EXP_MASK = 0xFF  # exponent field after >> FP32_MBITS
FP32_MANT_MASK = 0x7FFFFF  # fraction field
FP32_EMIN = -126  # exponent of the smallest normal
FP32_MIN_SUBNORMAL_EXP = -149  # smallest subnormal = 2^-149 = 2^(FP32_EMIN - FP32_MBITS)

# Stochastic rounding draws 32 uniform random bits per element (one 32-bit output word of a
# Philox-4x32-10 call; a call serves four consecutive elements, replayssm_quant.philox).
# After scaling, x = q * (n + f) with q the target quantum and 0 <= f < 1. An FP32 input
# with |x| >= q has at most 23 mantissa bits below q, and f is a multiple of 2^-23, so the
# round-up probability f is exact. (For E2M1, the normal range keeps 1 mantissa bit, so at
# most 22 bits lie below the grid; 32 >= 22.) For |x| < q * 2^-9 the probability is f
# rounded up to a multiple of 2^-32 (bias below 2^-32 q per element).
SR_RANDOM_BITS = 32


@dataclass(frozen=True)
class _FormatInfo:
    name: str
    element: FloatGrid | None  # None for fp32
    scaling: str  # "none" | "matrix" | "nvfp4" | "mx"
    block: int  # scaling block length along the last dim (0 if none)
    code_bits: int  # bits per stored element code
    description: str


FORMATS: dict[str, _FormatInfo] = {
    "fp32": _FormatInfo("fp32", None, "none", 0, 32, "IEEE binary32, the reference"),
    "bf16": _FormatInfo("bf16", BF16, "none", 0, 16, "bfloat16, saturating"),
    "fp16": _FormatInfo("fp16", FP16, "none", 0, 16, "IEEE binary16, saturating"),
    "fp8e4m3": _FormatInfo("fp8e4m3", E4M3, "matrix", 0, 8, "E4M3FN + FP32 scale per matrix"),
    "fp8e5m2": _FormatInfo("fp8e5m2", E5M2, "matrix", 0, 8, "E5M2 + FP32 scale per matrix"),
    "nvfp4": _FormatInfo(
        "nvfp4", E2M1, "nvfp4", NVFP4_BLOCK, 4, "E2M1 + E4M3 scale per 16 + FP32 per matrix"
    ),
    "mxfp8": _FormatInfo("mxfp8", E4M3, "mx", MX_BLOCK, 8, "E4M3 + E8M0 scale per 32"),
    "mxfp4": _FormatInfo("mxfp4", E2M1, "mx", MX_BLOCK, 4, "E2M1 + E8M0 scale per 32"),
}
FORMAT_NAMES: tuple[str, ...] = tuple(FORMATS)
SR_SUFFIX = "+sr"

# Scale modes (issue 18; docs/quantizers.md "Scale modes"): how a block scale is chosen, as a
# format suffix ("mxfp4+rceil", "nvfp4+up+sr"). The first name of each tuple is the default and
# is never printed; the others are the suffixes.
#   MX (OCP v1.0 E8M0 block scales), X = 2^(sexp), sexp clamped to [-127, 127]:
#     floor: sexp = floor(log2 amax) - emax_elem (OCP MX v1.0 section 6.3; the default);
#     rceil: sexp = ceil(log2(amax / max_elem)): the smallest power of two with
#            amax / X <= max_elem (cuBLAS "RCEIL" UE8M0 scaling; nothing clips);
#     even:  sexp = floor(log2(amax rounded half-up to mbits_elem mantissa bits)) - emax_elem
#            (torchao ScaleCalculationMode.EVEN: bumps the exponent only where the clipped
#            values would round to max_elem anyway).
#   NVFP4 (E4M3 block scales):
#     rn: s_b = E4M3_RTN(bamax / (s_g * 6)) (the default; may clip the block max to 6);
#     up: s_g and s_b rounded up so that no element of any block exceeds 6 after scaling
#         (no clipping, so stochastic rounding stays unbiased).
SCALE_MODES: dict[str, tuple[str, ...]] = {"mx": ("floor", "rceil", "even"), "nvfp4": ("rn", "up")}
# MX thresholds on the 23-bit FP32 fraction of a (normal) block amax m = 1.f:
#   rceil bumps the exponent where amax > M * 2^e, M the element max's significand
#   (E4M3 448 = 1.75 * 2^8, E2M1 6 = 1.5 * 2^2): f > (M - 1) * 2^23;
#   even bumps it where rounding m to mbits bits carries: f >= 2^23 - 2^(22 - mbits).
MX_RCEIL_FRAC = {"mxfp8": 0x600000, "mxfp4": 0x400000}
MX_EVEN_FRAC = {"mxfp8": 0x780000, "mxfp4": 0x600000}


@dataclass(frozen=True)
class QuantSpec:
    """A parsed format token: ``name`` in :data:`FORMAT_NAMES`, ``sr`` for stochastic rounding,
    ``scale`` the block-scale mode (:data:`SCALE_MODES`; ``""`` is the format's default).

    ``str(spec)`` gives the canonical token back (``"nvfp4+sr"``, ``"mxfp4+rceil+sr"``).
    """

    name: str
    sr: bool = False
    scale: str = ""

    def __post_init__(self):
        if self.name not in FORMATS:
            raise ValueError(
                f"unknown state format {self.name!r}; expected one of {', '.join(FORMAT_NAMES)}"
            )
        if not isinstance(self.sr, bool):  # a truthy "no" would turn SR on
            raise ValueError(f"QuantSpec sr must be a bool, got {self.sr!r}")
        if self.name == "fp32" and self.sr:  # FP32 values are stored unchanged: SR rounds nothing
            object.__setattr__(self, "sr", False)
        if self.scale:
            modes = SCALE_MODES.get(FORMATS[self.name].scaling, ())
            if self.scale not in modes[1:]:
                raise ValueError(f"format {self.name!r} has no scale mode {self.scale!r}; "
                                 f"{_scale_help()}")

    def __str__(self) -> str:
        return self.name + (f"+{self.scale}" if self.scale else "") + (SR_SUFFIX if self.sr else "")

    @property
    def scale_mode(self) -> str:
        """The scale mode by name, the default spelled out (``"floor"``, ``"rn"``, ...; ``""``
        for formats without block scales)."""
        modes = SCALE_MODES.get(self.info.scaling)
        return (self.scale or modes[0]) if modes else ""

    @property
    def info(self) -> _FormatInfo:
        return FORMATS[self.name]

    @property
    def is_identity(self) -> bool:
        """True for ``fp32`` (RTN or SR): FP32 values are stored unchanged."""
        return self.name == "fp32"


def _mode_names(modes: tuple[str, ...]) -> list[str]:
    """``["'+floor' (default)", "'+rceil'", ...]``: a format's scale modes as written in
    messages, the default (first) marked."""
    return [f"'+{m}'" + (" (default)" if i == 0 else "") for i, m in enumerate(modes)]


def scale_modes_text() -> str:
    """The scale modes of every block-scaled format, from :data:`SCALE_MODES`, for grammars:
    ``'+floor' (default), '+rceil' or '+even' for mxfp8/mxfp4; '+rn' (default) or '+up' for
    nvfp4``."""
    parts = []
    for scaling, modes in SCALE_MODES.items():
        names = "/".join(n for n in FORMAT_NAMES if FORMATS[n].scaling == scaling)
        ms = _mode_names(modes)
        parts.append(f"{', '.join(ms[:-1])} or {ms[-1]} for {names}")
    return "; ".join(parts)


def _scale_help() -> str:
    return ("scale modes: mxfp8/mxfp4 '+floor' (OCP, default), '+rceil', '+even'; "
            "nvfp4 '+rn' (default), '+up'")


class SpecError(ValueError):
    """A bad format spec; ``what`` is the message's first clause (what is wrong, without the
    list of accepted specs), for callers that print their own grammar (``StatePolicy``)."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what


def parse_spec(spec: "str | QuantSpec") -> QuantSpec:
    """Parse a format token such as ``"nvfp4"``, ``"fp8e4m3+sr"``, ``"mxfp4+rceil+sr"``
    (DESIGN.md section 3; scale modes: :data:`SCALE_MODES`, in any order with ``+sr``; the
    default mode's name is accepted and dropped from the canonical form, as is ``+sr`` on
    ``fp32``, which stores its values unchanged).

    Raises:
        ValueError: naming the bad token and listing the accepted ones (:class:`SpecError`
            for a string that is not a spec).
    """
    if isinstance(spec, QuantSpec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"format spec must be a string, got {type(spec).__name__} {spec!r}")
    token = spec.strip().lower()
    name, *suffixes = token.split("+")
    expected = (f"expected one of {', '.join(FORMAT_NAMES)}, optionally followed by "
                f"'{SR_SUFFIX}' (stochastic rounding; RTN is the default) and, for block-scaled "
                f"formats, a scale mode ({_scale_help()})")
    head = f"bad format spec {spec!r}"
    if name not in FORMATS:
        # a family name ('fp8', 'fp4', 'e4m3'): every format that holds it; else the closest
        close = ([f for f in FORMAT_NAMES if len(name) >= 2 and name in f]
                 or difflib.get_close_matches(name, FORMAT_NAMES, n=1))
        hint = (f" (did you mean {close[0]!r}?)" if len(close) == 1 else
                f" (did you mean one of {', '.join(map(repr, close))}?)" if close else "")
        what = f"{head}: unknown format {name!r}{hint}"
        raise SpecError(f"{what}; {expected}", what)

    def why(what: str) -> SpecError:  # a SpecError saying what is wrong, then the grammar
        what = f"{head}: {what}"
        return SpecError(f"{what}; {expected}", what)

    if len(set(suffixes)) != len(suffixes):
        raise why("a suffix repeats")
    sr, scale = False, ""
    modes = SCALE_MODES.get(FORMATS[name].scaling, ())
    for suf in suffixes:
        if suf == "sr":
            sr = True
        elif suf in modes and not scale:
            scale = "" if suf == modes[0] else suf
        elif suf in modes:
            raise why("more than one scale mode")
        elif not modes and any(suf in m for m in SCALE_MODES.values()):
            raise why(f"{name} has no block scales, so no scale mode ('+{suf}')")
        elif modes:
            raise why(f"'+{suf}' is not a scale mode of {name} (its modes: "
                      + ", ".join(_mode_names(modes)) + ")")
        else:
            raise why(f"unknown suffix '+{suf}'")
    return QuantSpec(name, sr, scale)  # ('+sr' on fp32 is dropped there)
