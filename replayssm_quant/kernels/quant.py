"""Triton kernels of the quantizers: fused amax, scale, rounding and packing.

Same arithmetic, in the same order, as the torch reference in :mod:`replayssm_quant.quant`
(read its module docstring first); ``tests/test_quant_kernels.py`` checks the two agree bit
for bit (values, NaN positions, -0.0, SR bits, packed bytes).

Kernels (one launch per call):

* ``_unscaled_kernel`` (bf16, fp16): one program per tile of elements.
* ``_matrix_kernel`` (fp8e4m3, fp8e5m2): one program per ``[M, K]`` matrix; a first loop
  over tiles takes the finite amax, a second one scales, rounds and writes.
* ``_nvfp4_kernel``: one program per matrix; amax loop, then a loop over tiles of
  "block rows" (one scaling block of 16 elements of one row each).
* ``_mx_kernel`` (mxfp8, mxfp4): one program per tile of block rows (32 elements each).
* ``_pair_kernel`` (:func:`pack_pair_triton`): NVFP4 as ``_nvfp4_kernel`` and, from the same
  loads, an unscaled copy (fp16, bf16) of the same matrix: the split flush's two casts.
* ``_pair_lean_kernel`` (:func:`pack_pair_triton` with ``form="lean"`` / ``"lean_rcp"``):
  the same bytes in fewer instructions per element (see its docstring: the exceptions
  below marked "lean" are its own).

Blocked formats hold a tile as two ``[R, block/2]`` halves, the even and the odd elements
of each block, so that two E2M1 codes go to one byte (element 2i in the low nibble) with no
reshuffle (lean: sixteen 1-D tensors, one per element of the block).

Rounding uses no floating-point arithmetic on the element, with one exception:
``_grid_code`` reads sign, exponent and significand from the FP32 bits and computes the code
of the target grid point with integer shifts (round half to even, or SR against 32 Philox
bits), which is the exact result the reference gets from its exact float steps; so do the
E2M1 RTN (``_e2m1_rtn_code``) and the fp16 / bf16 SR paths (``_f16_sr_code``,
``_bf16_sr_code``), except that SR onto fp16 below 2^-14 takes ``t = |y| 2^24``, ``floor(t)``
and ``ceil(frac(t) 2^32)`` in float32, each exact (see ``_f16_sr_code``). Lean: the E2M1
RTN code below 2 is read from ``2|y| + 1.5 * 2^23`` (one exact rounding,
``_e2m1_rtn_code_lean``) and the fp16 RTN code comes from the hardware conversion
(``_f16_rtn_signed``), each shown equal to the integer paths. Divisions use
``tl.math.div_rn`` (IEEE round-to-nearest, subnormals kept), except ``"lean_rcp"``'s
reciprocal division (``_div_by_rcp``: the same quotients where the E2M1 code reads them);
every other float operation (the scale products and the final ``value * scale``) is a single
IEEE multiplication, as in the reference.

GPU notes: non-FTZ ``div.rn.f32`` and ``mul.rn.f32`` are assumed (``_f16_sr_code`` multiplies
float32 subnormals by 2^24; its test's r = 0 draws would see them flushed); ``tl.philox`` reproduces
:func:`replayssm_quant.philox.random_bits` (key = seed, counter = (element >> 2, stream lo,
stream hi, 0), word element & 3). NaN handling does not rely on the default NaN semantics of
``tl.max``/``tl.maximum``: non-finite values are replaced by zero before every max and
tracked by a separate flag, except in the lean pair cast, whose block amax is
``tl.maximum(..., propagate_nan=ALL)`` (``max.NaN``: a NaN or inf result is the flag).
Written for Triton 3.6 and 3.9 (interpreter included).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import formats as F
from ..formats import QuantSpec, parse_spec
from ..philox import stream_keys_to
from ..packed import PackedTensor, _as_float32

__all__ = ["quantize_triton", "pack_triton", "pack_pair_triton", "pair_casts"]

# Tile sizes (elements per loop step; power-of-two)
_TILE = 2048  # unscaled and matrix-scaled kernels
_NV_ROWS = 128  # nvfp4: block rows per tile (x 16 elements)
_MX_ROWS = 64  # mx: block rows per program (x 32 elements)
_PAIR_ROWS, _PAIR_WARPS = 128, 4  # pack_pair_triton: block rows per tile, warps (H200:
# flush_parts_h200.json, docs/kernels-replay.md "Twenty-second pass"; the generic form's
# tile, the lean form's on shapes the split flush has not timed: flush.SPLIT_PAIR_TILES)
# pack_pair_triton's kernel: "generic" (the quantizer kernels' helpers), "lean" (the same
# bytes in fewer instructions) or "lean_rcp" (lean, and RTN NVFP4 elements divided by a
# reciprocal per block); docs/kernels-replay.md "Twenty-seventh pass". The module default
# stays "generic" (it handles every K); the split flush asks for "lean" (its cast_form
# "pair_lean", the default since the twenty-eighth pass, timed on the H200)
PAIR_FORMS = ("generic", "lean", "lean_rcp")
_PAIR_FORM = "generic"


# ----------------------------------------------------------------------------------------
# per-format constants handed to the kernels as one constexpr bundle
# ----------------------------------------------------------------------------------------


# NaN codes that torch's float32 conversions produce (the reference packs with them)
_BF16_NAN_CODE = 0xFFFF  # torch float32 -> bfloat16 gives 0xFFFF for NaN of either sign
_FP16_NAN_CODE, _FP16_NAN_CODE_NEG = F.FP16_NAN_CODE, F.FP16_NAN_CODE_NEG  # any payload
_E2M1_NAN_CODE = 0  # reference _e2m1_encode maps NaN to code 0 (E2M1 has no NaN)
# E4M3 / E5M2: torch float32 -> float8 gives 0x7F | sign for NaN (F.E4M3_NAN_CODE[_NEG])


class GridConsts(NamedTuple):
    """Code-level description of an element grid, handed to a kernel as ONE constexpr
    (``GRID``) and read by the jit helpers by field (``GRID.EMIN``); codes are
    ``sign | ((e - emin) << mbits) + n``. Built by :func:`_grid_consts`."""

    EMIN: int  # smallest normal exponent (subnormals share it)
    MBITS: int  # stored mantissa bits
    MAXCODE: int  # magnitude code of the largest finite value (saturation)
    SUBQ: float  # quantum of the subnormals, 2^(EMIN - MBITS)
    SIGN_SHIFT: int  # bit of the sign in a code
    HAS_INF: bool  # the grid has infinities (bf16, fp16, E5M2)
    NAN_POS: int  # code of +NaN (as torch's conversions produce it)
    NAN_NEG: int  # code of -NaN
    INF_POS: int  # code of +inf (NaN code where the grid has no inf)
    INF_NEG: int  # code of -inf


def _grid_consts(grid: F.FloatGrid) -> GridConsts:
    """The :class:`GridConsts` of ``grid``."""
    total = grid.ebits + grid.mbits
    maxcode = _magnitude_code(grid, grid.max)
    if grid is F.BF16:
        nan_pos, nan_neg = _BF16_NAN_CODE, _BF16_NAN_CODE
    elif grid is F.FP16:
        nan_pos, nan_neg = _FP16_NAN_CODE, _FP16_NAN_CODE_NEG
    elif grid is F.E2M1:
        nan_pos, nan_neg = _E2M1_NAN_CODE, _E2M1_NAN_CODE
    else:
        nan_pos, nan_neg = F.E4M3_NAN_CODE, F.E4M3_NAN_CODE_NEG
    if grid.has_inf:
        inf_pos = ((1 << grid.ebits) - 1) << grid.mbits
        inf_neg = inf_pos | (1 << total)
    else:  # inf -> (positive) NaN on grids without infinities
        inf_pos = inf_neg = nan_pos
    return GridConsts(
        EMIN=grid.emin,
        MBITS=grid.mbits,
        MAXCODE=maxcode,
        SUBQ=math.ldexp(1.0, grid.emin - grid.mbits),
        SIGN_SHIFT=total,
        HAS_INF=grid.has_inf,
        NAN_POS=nan_pos,
        NAN_NEG=nan_neg,
        INF_POS=inf_pos,
        INF_NEG=inf_neg,
    )


def _magnitude_code(grid: F.FloatGrid, v: float) -> int:
    m, e = math.frexp(v)  # v = m * 2^e, 0.5 <= m < 1
    e -= 1
    e = max(e, grid.emin)
    n = int(v / math.ldexp(1.0, e - grid.mbits))
    return ((e - grid.emin) << grid.mbits) + n


# Module constants reach the jit helpers as defaults of scalar constexpr parameters (the one way
# a jit function may read a plain module global, compiled and under TRITON_INTERPRET=1 alike;
# a NamedTuple works as a kernel argument but not as a default or global on Triton 3.6, and a
# tl.constexpr-wrapped one not under the 3.9 interpreter). E4M3 grid of the NVFP4 block scales:
(_E4M3_EMIN, _E4M3_MBITS, _E4M3_MAXCODE, _E4M3_SUBQ, _E4M3_SIGN_SHIFT, _E4M3_HAS_INF,
 _E4M3_NAN_POS, _E4M3_NAN_NEG, _E4M3_INF_POS, _E4M3_INF_NEG) = _grid_consts(F.E4M3)
assert _E4M3_MAXCODE == F.E4M3_MAX_CODE and _E4M3_SUBQ == F.E4M3_MIN_SUBNORMAL
assert _E4M3_NAN_POS == F.E4M3_NAN_CODE and _E4M3_NAN_NEG == F.E4M3_NAN_CODE_NEG
# binary32 bit layout
_FP32_MBITS = F.FP32_MBITS
_FP32_BIAS = F.FP32_EXP_BIAS
_FP32_EXP_MASK = F.FP32_EXP_MASK
_FP32_MANT_MASK = F.FP32_MANT_MASK
_FP32_EMIN = F.FP32_EMIN
_FP32_SUB_EXP = F.FP32_MIN_SUBNORMAL_EXP
_SR_BITS = F.SR_RANDOM_BITS


# ----------------------------------------------------------------------------------------
# jit helpers
# ----------------------------------------------------------------------------------------


@triton.jit
def _pow2(e, BIAS: tl.constexpr = _FP32_BIAS, MB: tl.constexpr = _FP32_MBITS,
          EMIN: tl.constexpr = _FP32_EMIN, SUB_EXP: tl.constexpr = _FP32_SUB_EXP):
    """Exact 2^e as float32 for int32 e in [-149, 127] (subnormals built from the bits)."""
    normal = tl.maximum(e + BIAS, 1) << MB
    sub = 1 << tl.minimum(tl.maximum(e - SUB_EXP, 0), MB - 1)
    return tl.where(e >= EMIN, normal, sub).to(tl.float32, bitcast=True)


@triton.jit
def _philox_wide(seed, c0, c1, c2, c3, ROUNDS: tl.constexpr = 10,
                 KEY_A: tl.constexpr = 0x9E3779B9, KEY_B: tl.constexpr = 0xBB67AE85,
                 ROUND_A: tl.constexpr = 0xD2511F53, ROUND_B: tl.constexpr = 0xCD9E8D57):
    """Philox-4x32-10 of uint32 counters ``(c0, c1, c2, c3)`` under the 64-bit key ``seed``:
    the same four words as ``tl.philox(seed, c0, c1, c2, c3)`` (Salmon et al., SC 2011;
    :func:`replayssm_quant.philox.philox4x32` is the torch reference), with each round's two
    products formed as one 32 x 32 -> 64-bit multiply (high word and low word from one
    ``IMAD.WIDE.U32`` on sm_90) instead of a separate high and low multiply. Static sm_90
    SASS of four calls per thread: 216 instructions against ``tl.philox``'s 296."""
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(ROUNDS):
        p0 = c0.to(tl.uint64) * ROUND_A
        p2 = c2.to(tl.uint64) * ROUND_B
        n0 = (p2 >> 32).to(tl.uint32) ^ c1 ^ k0
        n2 = (p0 >> 32).to(tl.uint32) ^ c3 ^ k1
        c1 = p2.to(tl.uint32)
        c3 = p0.to(tl.uint32)
        c0 = n0
        c2 = n2
        k0 = k0 + KEY_A
        k1 = k1 + KEY_B
    return c0, c1, c2, c3


@triton.jit
def _random_words(seed, call, st_lo, st_hi, WIDE: tl.constexpr = False):
    """The four uint32 output words of Philox calls ``call`` (any shape) of one stream:
    tl.philox(seed, call, stream lo, stream hi, 0) (:mod:`replayssm_quant.philox`); with
    ``WIDE`` the same words by :func:`_philox_wide`. ``seed`` may arrive as an int32 or
    int64 scalar, or as a constexpr (Triton specialises the value 1): it is widened by an
    addition to an int64 zero (a seed lies in [0, 2^63), so the uint64 bits are its value,
    as ``tl.philox`` reads it; ``tl.to_tensor`` is not in Triton 3.6)."""
    c0 = call.to(tl.uint32)
    if WIDE:
        s64 = (seed + tl.zeros([], tl.int64)).to(tl.uint64)
        return _philox_wide(s64, c0, st_lo + c0 * 0, st_hi + c0 * 0, c0 * 0)
    return tl.philox(seed, c0, st_lo + c0 * 0, st_hi + c0 * 0, c0 * 0)


@triton.jit
def _random_bits(seed, elem, st_lo, st_hi):
    """32 Philox bits (uint32) per element index ``elem`` (any shape): word ``elem & 3`` of
    call ``elem >> 2`` (:func:`replayssm_quant.philox.random_bits`). One call per element; the
    tiles of whole rows (:func:`_random_pairs` / :func:`_random_tile`), the unscaled and
    block-scaled kernels' aligned tiles (``ALIGNED4``) and the fp8 matrix kernel draw one call
    per four elements (the same words)."""
    e = elem.to(tl.uint32)  # indices below 2^32 (int32 at or above 2^31 too)
    r0, r1, r2, r3 = _random_words(seed, e >> 2, st_lo, st_hi)
    w = e & 3
    return tl.where(w < 2, tl.where(w == 0, r0, r1), tl.where(w == 2, r2, r3))


@triton.jit
def _random_pairs(seed, rows, st_lo, st_hi, K: tl.constexpr, KH: tl.constexpr,
                  BV: tl.constexpr):
    """SR bits of rows ``rows`` ([BV]) of a ``[*, K]`` matrix as (even, odd) column halves
    ``[BV, KH]``: element ``(m, 2j)`` / ``(m, 2j + 1)`` of index ``e = m K + k`` gets word
    ``e & 3`` of call ``e >> 2``, one call per four elements where ``K % 4 == 0``."""
    if K % 4 == 0:
        i = tl.arange(0, KH // 2)
        r0, r1, r2, r3 = _random_words(seed, rows[:, None] * (K // 4) + i[None, :], st_lo, st_hi)
        re = tl.reshape(tl.join(r0, r2), [BV, KH])  # k = 4i + 2x: words 0, 2
        ro = tl.reshape(tl.join(r1, r3), [BV, KH])  # k = 4i + 2x + 1: words 1, 3
    else:
        j = tl.arange(0, KH)
        e = rows[:, None] * K + 2 * j[None, :]
        re = _random_bits(seed, e, st_lo, st_hi)
        ro = _random_bits(seed, e + 1, st_lo, st_hi)
    return re, ro


@triton.jit
def _random_tile(seed, rows, st_lo, st_hi, K: tl.constexpr, BV: tl.constexpr):
    """SR bits of rows ``rows`` ([BV]) of a ``[*, K]`` matrix as one ``[BV, K]`` tile in
    column order (the same bits as :func:`_random_pairs`)."""
    if K % 4 == 0:
        i = tl.arange(0, K // 4)
        r0, r1, r2, r3 = _random_words(seed, rows[:, None] * (K // 4) + i[None, :], st_lo, st_hi)
        # [BV, K/4, x, y] -> k = 4i + 2x + y takes word 2x + y
        r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BV, K])
    else:
        kk = tl.arange(0, K)
        r = _random_bits(seed, rows[:, None] * K + kk[None, :], st_lo, st_hi)
    return r


@triton.jit
def _stream_words(st):
    """(lo, hi) uint32 words of int64 stream keys."""
    lo = (st & 0xFFFFFFFF).to(tl.uint32)
    hi = ((st >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return lo, hi


@triton.jit
def _grid_split(bits, EMIN: tl.constexpr, MBITS: tl.constexpr, FMB: tl.constexpr = _FP32_MBITS,
                FBIAS: tl.constexpr = _FP32_BIAS, FEMIN: tl.constexpr = _FP32_EMIN,
                EXP_MASK: tl.constexpr = _FP32_EXP_MASK, MANT_MASK: tl.constexpr = _FP32_MANT_MASK):
    """Of finite float32 |y| (int32 bits): its 24-bit significand S, the grid exponent
    e = max(floor(log2|y|), emin) and the shift with m = |y| / 2^(e - mbits) = S >> shift."""
    ex = (bits >> FMB) & EXP_MASK
    mant = bits & MANT_MASK
    sub = ex == 0
    sig = tl.where(sub, mant, mant | (1 << FMB))
    ea = tl.where(sub, FEMIN, ex - FBIAS)
    e = tl.maximum(ea, EMIN)
    return sig, e, (FMB - MBITS) + (e - ea)


@triton.jit
def _grid_code(bits, r, SR: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
               MAXCODE: tl.constexpr, FMB: tl.constexpr = _FP32_MBITS,
               FBIAS: tl.constexpr = _FP32_BIAS, FEMIN: tl.constexpr = _FP32_EMIN,
               EXP_MASK: tl.constexpr = _FP32_EXP_MASK, MANT_MASK: tl.constexpr = _FP32_MANT_MASK,
               RBITS: tl.constexpr = _SR_BITS):
    """Saturated magnitude code of |y| rounded onto the grid (y finite, given as int32 bits).

    e = max(floor(log2|y|), emin), quantum q = 2^(e - mbits), m = |y| / q = S >> shift
    exactly (S the 24-bit significand); RTN rounds half to even, SR adds 1 when
    r < ceil(frac(m) * 2^32). The code of n * q is ((e - emin) << mbits) + n, which also
    covers subnormals and a carry into the next binade; min(code, MAXCODE) saturates.
    """
    sig, e, shift = _grid_split(bits, EMIN, MBITS, FMB, FBIAS, FEMIN, EXP_MASK, MANT_MASK)  # shift >= 13
    if SR:  # in 32-bit words: S < 2^24 and shift >= 13, so no product leaves them
        sc = tl.minimum(shift, 24)  # S >> 24 is 0: every shift from 24 up keeps fl = 0
        fl = sig >> sc
        rem = sig - (fl << sc)  # S mod 2^shift (all of S once shift >= 24)
        # frac(m) * 2^32 = rem * 2^(32 - shift); the threshold is its ceiling:
        # shift <= 32: rem << (32 - shift) < 2^32 exactly (rem < 2^min(shift, 24));
        # shift > 32: ceil(rem / 2^hs), hs = min(shift, 60) - 32 <= 28, so rem + 2^hs - 1
        # < 2^24 + 2^28 stays in an int32 (shifts beyond 60 give the same ceiling, 1 or 0)
        lo_sh = tl.maximum(RBITS - shift, 0)
        hs = tl.maximum(tl.minimum(shift, 60) - RBITS, 0)
        thr_lo = rem.to(tl.uint32) << lo_sh.to(tl.uint32)
        thr_hi = ((rem + (1 << hs) - 1) >> hs).to(tl.uint32)
        thr = tl.where(shift <= RBITS, thr_lo, thr_hi)
        up = r.to(tl.uint32) < thr
        n = fl + up.to(tl.int32)
    else:
        sh = tl.minimum(shift, 30)
        fl = sig >> sh
        rem = sig & ((1 << sh) - 1)
        half = 1 << (sh - 1)
        up = (rem > half) | ((rem == half) & ((fl & 1) == 1))
        n = fl + up.to(tl.int32)
    code = ((e - EMIN) << MBITS) + n
    return tl.minimum(code, MAXCODE)


@triton.jit
def _f16_sr_code(bits, r):
    """:func:`_grid_code` with SR onto the fp16 grid (EMIN -14, 10 mantissa bits, saturating
    at 65504) of finite float32 ``|y|`` (int32 bits; the sign is ignored), in fewer
    instructions (static sm_90 SASS of the fp16+sr unscaled kernel, a 2048-element tile: 1024
    against 1216 with ``_grid_code``, the RTN kernel 568; quantize of 134M elements on the
    H200: 0.29 against 0.40 ms). From 2^-14 up (shift 13): SR adds 1 when ``r < rem << 19``, i.e. when
    ``r >> 19 < rem`` (rem the 13 dropped bits), which is the carry of
    ``rem + 0x1FFF - (r >> 19)`` into bit 13, so the code is that sum's ``>> 13`` less the
    exponent bias difference (a carry into the exponent is the next binade's code, as in
    ``_grid_code``). Below 2^-14 (fp16 subnormals, quantum 2^-24): ``t = |y| 2^24`` exactly,
    ``n = floor(t)`` and SR adds 1 when ``r < ceil(frac(t) 2^32)``, the threshold of
    ``_grid_code`` (``frac(t) 2^32`` is exact in float32: t has at most 24 significant bits;
    for shifts beyond 60 both thresholds are 1 for a non-zero remainder). ``t``, ``frac(t)``
    and the threshold are normal floats even for float32 subnormal ``y`` (t >= 2^-125), so a
    flush-to-zero of subnormal operands in libdevice's floor and ceil does not apply. Equality
    with ``_grid_code`` is tested near every binade edge, tie and threshold
    (``test_fp16_bf16_sr_codes_match_generic``) and against the reference in the quantizer
    tests."""
    m = bits & 0x7FFFFFFF
    ru = r.to(tl.uint32)
    nrm = ((m + 0x1FFF - (ru >> 19).to(tl.int32)) >> 13) - (112 << 10)
    t = tl.minimum(m, 0x38800000).to(tl.float32, bitcast=True) * 16777216.0  # <= 1024
    fl = tl.floor(t)
    thr = tl.ceil((t - fl) * 4294967296.0).to(tl.uint32)
    sub = fl.to(tl.int32) + (ru < thr).to(tl.int32)
    return tl.minimum(tl.where(m < 0x38800000, sub, nrm), 0x7BFF)


@triton.jit
def _f16_sr_signed(bits, r, NAN: tl.constexpr = _FP16_NAN_CODE):
    """The signed fp16 code that :func:`_round` gives float32 ``y`` (int32 ``bits``, any
    value) with SR and draw ``r`` (``_quant(y, r, True, fp16)``'s code): finite values by
    :func:`_f16_sr_code` (saturating at 65504), +-inf to 0x7C00 / 0xFC00, NaN to 0x7E00 /
    0xFE00, the sign in bit 15 (-0 included). The same codes in fewer instructions than
    ``_round``'s NaN / inf / sign selects (the lean pair cast, :func:`_pair_lean_kernel`):
    ``_f16_sr_code`` reads only the magnitude bits, its result on a non-finite magnitude is
    replaced, and the sign is bit 31 moved to bit 15. Equality with ``_quant`` is tested on
    every special value, binade edge and threshold (``test_lean_cast_codes_match_generic``)."""
    m = bits & 0x7FFFFFFF
    code = _f16_sr_code(m, r)  # (a non-finite m wraps in int32; replaced below)
    special = tl.where(m == 0x7F800000, 0x7C00, NAN)
    code = tl.where(m >= 0x7F800000, special, code)
    return code | ((bits >> 16) & 0x8000)


@triton.jit
def _f16_rtn_signed(y, NAN: tl.constexpr = _FP16_NAN_CODE, FMAX: tl.constexpr = F.FP16.max):
    """The signed fp16 code that :func:`_round` gives float32 ``y`` with RTN
    (``_quant(y, 0, False, fp16)``'s code) by the hardware conversion (``cvt.rn.f16.f32``,
    round to nearest even, fp16 subnormals included) of ``y`` clamped to +-65504 when finite
    (the reference saturates; the conversion would give inf from 65520 up), +-inf kept, and
    NaN mapped to 0x7E00 / 0xFE00 (the conversion's NaN is 0x7FFF on CUDA). Equality with
    ``_quant`` is tested in ``test_lean_cast_codes_match_generic``."""
    fin = tl.abs(y) < float("inf")
    c = tl.where(fin, tl.minimum(tl.maximum(y, -FMAX), FMAX), y)
    code = c.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    sign = (y.to(tl.int32, bitcast=True) >> 16) & 0x8000
    return tl.where(y != y, NAN | sign, code)


@triton.jit
def _bf16_sr_code(bits, r):
    """:func:`_grid_code` with SR onto the bfloat16 grid of finite float32 ``|y|`` (int32
    bits): bfloat16 shares float32's exponent range (its subnormals are float32's), so the
    shift is always 16 and SR adds 1 when ``r >> 16 < rem`` (rem the 16 dropped bits): the
    carry of ``rem + 0xFFFF - (r >> 16)`` into bit 16. Saturates at the largest finite code.
    Static sm_90 SASS of the bf16+sr unscaled kernel: 856 instructions against 1216."""
    m = bits & 0x7FFFFFFF
    return tl.minimum((m + 0xFFFF - (r.to(tl.uint32) >> 16).to(tl.int32)) >> 16, 0x7F7F)


@triton.jit
def _grid_value(code, EMIN: tl.constexpr, MBITS: tl.constexpr, SUBQ: tl.constexpr,
                FMB: tl.constexpr = _FP32_MBITS, FEMIN: tl.constexpr = _FP32_EMIN):
    """Float32 magnitude of a (non-negative, finite) grid code."""
    if EMIN == FEMIN:  # bfloat16: float32 bits are the code shifted up by 16
        val = (code << (FMB - MBITS)).to(tl.float32, bitcast=True)
    else:
        be = code >> MBITS
        mt = code & ((1 << MBITS) - 1)
        nbits = ((be + (EMIN - FEMIN)) << FMB) | (mt << (FMB - MBITS))
        val = tl.where(be == 0, mt.to(tl.float32) * SUBQ, nbits.to(tl.float32, bitcast=True))
    return val


@triton.jit
def _round(y, r, SR: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
           MAXCODE: tl.constexpr, SUBQ: tl.constexpr, SIGN_SHIFT: tl.constexpr,
           HAS_INF: tl.constexpr, NAN_POS: tl.constexpr, NAN_NEG: tl.constexpr,
           INF_POS: tl.constexpr, INF_NEG: tl.constexpr):
    """Reference ``round_to_grid`` of float32 y: returns (value float32, code int32 with sign).
    The grid as scalar constexprs (the one place they are listed; see :func:`_quant`).

    NaN stays y (and gets the NaN code); +-inf stays +-inf on grids with infinities, else
    becomes NaN; finite values are rounded, saturated and get y's sign (copysign).
    """
    bits = y.to(tl.int32, bitcast=True)
    neg = bits < 0
    is_nan = y != y
    is_inf = tl.abs(y) == float("inf")
    finite = ~(is_nan | is_inf)
    if SR and EMIN == -14 and MBITS == 10 and MAXCODE == 0x7BFF:  # fp16
        code = _f16_sr_code(tl.where(finite, bits, 0), r)
        mag = code.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif SR and EMIN == -126 and MBITS == 7 and MAXCODE == 0x7F7F:  # bf16
        code = _bf16_sr_code(tl.where(finite, bits, 0), r)
        mag = _grid_value(code, EMIN, MBITS, SUBQ)
    else:
        code = _grid_code(tl.where(finite, bits, 0), r, SR, EMIN, MBITS, MAXCODE)
        mag = _grid_value(code, EMIN, MBITS, SUBQ)
    vbits = mag.to(tl.int32, bitcast=True) | tl.where(neg, -2147483648, 0)
    val = vbits.to(tl.float32, bitcast=True)
    if HAS_INF:
        val = tl.where(is_inf, y, val)
    else:
        val = tl.where(is_inf, float("nan"), val)
    val = tl.where(is_nan, y, val)
    code = code | tl.where(neg, 1 << SIGN_SHIFT, 0)
    code = tl.where(is_inf, tl.where(neg, INF_NEG, INF_POS), code)
    code = tl.where(is_nan, tl.where(neg, NAN_NEG, NAN_POS), code)
    return val, code


@triton.jit
def _quant(y, r, SR: tl.constexpr, G: tl.constexpr):
    """:func:`_round` onto the grid ``G`` (a :class:`GridConsts`, or any bundle with its
    fields): returns (value float32, code int32 with sign)."""
    return _round(y, r, SR, G.EMIN, G.MBITS, G.MAXCODE, G.SUBQ, G.SIGN_SHIFT, G.HAS_INF,
                  G.NAN_POS, G.NAN_NEG, G.INF_POS, G.INF_NEG)


@triton.jit
def _e2m1_code_from_1(m):
    """E2M1 RTN magnitude code of finite float32 ``|y| >= 1`` (int32 bits ``m``): the bits
    rounded to one mantissa bit, half to even, in integer arithmetic (``m + 0x1FFFFF + bit
    22`` carries into bit 22 exactly when the dropped bits exceed half, or equal it and bit
    22 is odd; a carry into the exponent is kept), whose ``>> 22`` is ``252 + code`` (1.0 ->
    2, 1.5 -> 3, 2 -> 4, ..., 6 -> 7), saturated at 7. Shared by :func:`_e2m1_rtn_code` and
    :func:`_e2m1_rtn_code_lean`."""
    return tl.minimum(((m + 0x1FFFFF + ((m >> 22) & 1)) >> 22) - 252, 7)


@triton.jit
def _e2m1_rtn_code(y):
    """Signed E2M1 code (int32, sign in bit 3) of finite float32 ``y`` rounded to nearest,
    ties to even, saturating at 6: the code :func:`_quant` gives on the E2M1 grid, in about
    half its instructions. Below 1 (E2M1's subnormal step 0.5) by comparing |y| with the
    midpoints 0.25 (``>``: a tie goes to the even code 0) and 0.75 (``>=``: to code 2); from 1
    up by :func:`_e2m1_code_from_1`. ``y`` must be finite (no NaN/inf codes here; callers mask such blocks). Equality
    with ``_quant`` is tested on every float32 in [0, 8] on the GPU and near every midpoint
    under the interpreter (``test_e2m1_rtn_code_matches_generic``)."""
    b = y.to(tl.int32, bitcast=True)
    m = b & 0x7FFFFFFF  # |y| (finite: below 0x7F800000, so the sum below stays in int32)
    a = m.to(tl.float32, bitcast=True)
    sub = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32)
    n = tl.where(a < 1.0, sub, _e2m1_code_from_1(m))
    return n | ((b >> 28) & 8)


@triton.jit
def _e2m1_rtn(y, EMIN: tl.constexpr = F.E2M1.emin, MBITS: tl.constexpr = F.E2M1.mbits,
              SUBQ: tl.constexpr = F.E2M1.min_subnormal):
    """``_quant`` of finite float32 ``y`` onto the E2M1 grid with RTN through
    :func:`_e2m1_rtn_code`: (value float32 with y's sign, zeros included; signed code). The
    sign is set in the bits, as ``_round`` does: Triton 3.6 lowers a float ``-x`` as
    ``0 - x``, which turns -0 into +0 on CUDA (the interpreter keeps -0)."""
    code = _e2m1_rtn_code(y)
    mag = _grid_value(code & 7, EMIN, MBITS, SUBQ)
    vbits = mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)
    return vbits.to(tl.float32, bitcast=True), code


@triton.jit
def _e2m1_rtn_code_lean(y):
    """:func:`_e2m1_rtn_code` (signed E2M1 code of finite float32 ``y``, RTN ties to even,
    saturating at 6) in fewer instructions, for the lean pair cast. Below 2 the E2M1 grid
    is fixed-point with step 0.5 (0, 0.5, 1, 1.5; 2 from 1.75 up), so the code is
    ``RNE(2 |y|)``, read from the float32 bits of ``2 |y| + 1.5 * 2^23`` (a sum in
    [2^23, 2^24), whose ulp is 1: its one rounding is the round to nearest even integer,
    exact whether the compiler fuses the product into an FMA or not). From 2 up,
    :func:`_e2m1_code_from_1`, as :func:`_e2m1_rtn_code`. Equality is tested on every float32 in
    [0, 8] on CUDA and near every midpoint under the interpreter
    (``test_lean_cast_codes_match_generic``)."""
    b = y.to(tl.int32, bitcast=True)
    m = b & 0x7FFFFFFF
    a = m.to(tl.float32, bitcast=True)
    low = (a * 2.0 + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
    n = tl.where(m < 0x40000000, low, _e2m1_code_from_1(m))
    return n | ((b >> 28) & 8)


@triton.jit
def _signed_zero(code):
    """+-0.0 (float32) with the sign of the signed E2M1 code ``code`` (sign in bit 3), set in
    the bits (Triton lowers ``-x`` as ``0 - x``, which loses -0 on CUDA)."""
    return ((code & 8) << 28).to(tl.float32, bitcast=True)


@triton.jit
def _finite_abs(x):
    a = tl.abs(x)
    return tl.where(a < float("inf"), a, 0.0)


@triton.jit
def _matrix_amax(x_ptr, base, MK, TILE: tl.constexpr):
    """Finite amax of the MK elements at ``x_ptr + base`` (tiles of TILE elements)."""
    cols = tl.arange(0, TILE)
    acc = tl.zeros([TILE], tl.float32)
    for start in range(0, MK, TILE):
        offs = start + cols
        x = tl.load(x_ptr + base + offs, mask=offs < MK, other=0.0)
        acc = tl.maximum(acc, _finite_abs(x))
    return tl.max(acc, axis=0)


@triton.jit
def _amax_scale(amax, DIV: tl.constexpr):
    """Matrix scale amax / DIV (fp8: DIV = the grid max; nvfp4: F.NVFP4_SCALE_DIVISOR);
    1 where that is 0 (reference ``quant._parts``)."""
    s = tl.math.div_rn(amax, tl.full([], DIV, tl.float32))
    return tl.where(s > 0, s, 1.0)


@triton.jit
def _e4m3_rtn(y, EMIN: tl.constexpr = _E4M3_EMIN, MBITS: tl.constexpr = _E4M3_MBITS,
              MAXCODE: tl.constexpr = _E4M3_MAXCODE, SUBQ: tl.constexpr = _E4M3_SUBQ,
              SIGN_SHIFT: tl.constexpr = _E4M3_SIGN_SHIFT, HAS_INF: tl.constexpr = _E4M3_HAS_INF,
              NAN_POS: tl.constexpr = _E4M3_NAN_POS, NAN_NEG: tl.constexpr = _E4M3_NAN_NEG,
              INF_POS: tl.constexpr = _E4M3_INF_POS, INF_NEG: tl.constexpr = _E4M3_INF_NEG):
    """``_round`` of y onto the E4M3 grid with RTN: (value, code)."""
    return _round(y, 0, False, EMIN, MBITS, MAXCODE, SUBQ, SIGN_SHIFT, HAS_INF, NAN_POS,
                  NAN_NEG, INF_POS, INF_NEG)


@triton.jit
def _e4m3_ru(y, EMIN: tl.constexpr = _E4M3_EMIN, MBITS: tl.constexpr = _E4M3_MBITS,
             MAXCODE: tl.constexpr = _E4M3_MAXCODE, SUBQ: tl.constexpr = _E4M3_SUBQ,
             FMB: tl.constexpr = _FP32_MBITS, FBIAS: tl.constexpr = _FP32_BIAS,
             FEMIN: tl.constexpr = _FP32_EMIN, EXP_MASK: tl.constexpr = _FP32_EXP_MASK,
             MANT_MASK: tl.constexpr = _FP32_MANT_MASK):
    """Finite float32 y >= 0 rounded UP onto the E4M3 grid (saturating at 448): (value,
    code); reference ``quant._round_up_to_grid``. Same code arithmetic as ``_grid_code``, with
    n = floor(m) + [frac(m) > 0]."""
    bits = y.to(tl.int32, bitcast=True)
    sig, e, shift = _grid_split(bits, EMIN, MBITS, FMB, FBIAS, FEMIN, EXP_MASK, MANT_MASK)
    sh = tl.minimum(shift, 30)
    fl = sig >> sh
    rem = sig & ((1 << sh) - 1)
    code = tl.minimum(((e - EMIN) << MBITS) + fl + (rem > 0).to(tl.int32), MAXCODE)
    return _grid_value(code, EMIN, MBITS, SUBQ), code


@triton.jit
def _nvfp4_global_up(amax, s, E4M3_MAX: tl.constexpr = F.E4M3_MAX,
                     E2M1_MAX: tl.constexpr = F.E2M1_MAX):
    """NVFP4 ``+up`` matrix scale (reference ``quant._nvfp4_global_up``): s moved up by one
    FP32 ulp (bits + 1; s > 0), twice at most, while amax / (448 s) > 6."""
    for _ in tl.static_range(2):
        over = tl.math.div_rn(amax, s * E4M3_MAX) > E2M1_MAX
        s = tl.where(over, (s.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True), s)
    return s


@triton.jit
def _nvfp4_matrix_scale(amax, GDIV: tl.constexpr, UP: tl.constexpr):
    """NVFP4 matrix scale s_g of a finite amax (reference ``quant._parts``): amax / (448 * 6)
    (``GDIV``), 1 where that is 0, moved up by :func:`_nvfp4_global_up` under ``UP``."""
    s_g = _amax_scale(amax, GDIV)
    if UP:
        s_g = _nvfp4_global_up(amax, s_g)
    return s_g


@triton.jit
def _pair_matrix_amax(x_ptr, amax_ptr, mat, M, K: tl.constexpr, TILE: tl.constexpr,
                      GIVEN_AMAX: tl.constexpr):
    """The pair casts' matrix amax of matrix ``mat``: read from ``amax_ptr`` (``GIVEN_AMAX``,
    :func:`pack_pair_triton`'s ``matrix_amax``) or by the amax pass, :func:`_matrix_amax`."""
    if GIVEN_AMAX:
        amax = tl.load(amax_ptr + mat)
    else:
        amax = _matrix_amax(x_ptr, mat * M * K, M * K, TILE)
    return amax


@triton.jit
def _e8m0_value(code, BIAS: tl.constexpr = F.E8M0_BIAS, NAN: tl.constexpr = F.E8M0_NAN):
    """Float32 value of E8M0 scale codes (int32): 2^(code - 127), NaN for code 0xFF."""
    return tl.where(code == NAN, float("nan"), _pow2(code - BIAS))


# Matrix scales s_g for which the lean pair cast (form "lean_rcp") divides by a reciprocal:
# every block divisor s_b s_g (s_b an E4M3 value in [2^-9, 448], or the divisor 1) then
# lies in [2^-95, 2^95]. (Written for _block_cast on 2026-12-04, 6e6c3f3, and measured 2-9%
# slower there; reverted in 6984b60; docs/kernels-replay.md "Twenty-third pass".)
RCP_MATRIX_SCALE_RANGE = (2.0 ** -86, 2.0 ** 86)


@triton.jit
def _div_by_rcp(x, b, y):
    """``div_rn(x, b)`` for float32 ``x`` and divisors ``b`` in [2^-95, 2^95] given with their
    correctly rounded reciprocals ``y = RN(1 / b)`` (broadcastable to ``x``), in one
    multiplication and four FMAs per element instead of an IEEE division sequence.

    With ``a = x`` (every step is odd in x, so take x >= 0): ``q0 = RN(a y)`` is within 2
    ulp of ``z = a / b``; one refinement ``q1 = RN(q0 + RN(a - b q0) y)`` is within
    1/2 ulp + 2^-22 ulp of z, so faithful; then
    Markstein's theorem (P. Markstein, IBM J. Res. Dev. 34(1), 1990; Muller et al.,
    *Handbook of Floating-Point Arithmetic*, division with an FMA: y within half an ulp of
    1/b and q1 within one ulp of a/b give an exact remainder ``r = a - b q1`` and
    ``RN(q1 + r y) = RN(a/b)``)
    makes ``q2 = RN(q1 + r y)`` the correctly rounded quotient, provided r neither
    overflows nor loses bits to underflow. With ``b >= 2^-95`` and ``z >= 2^-3`` the
    remainder's lattice ``2^(e_b + e_q - 46)`` is at least ``2^-145``, so r is exact, and
    ``b <= 2^95`` keeps y normal. Below 2^-3 the quotient may differ from ``div_rn`` in last
    bits (underflowed remainders) but stays below 2^-3 (1 + 2^-20), which is all that the
    E2M1 RTN code of an NVFP4 element depends on (its smallest threshold is 0.25; SR
    reads every bit, so SR casts keep ``div_rn``);
    an NVFP4 block's quotients are at most 9 (``s_b`` rounds ``amax / (6 s_g)`` to E4M3;
    blocks with scale 0 divide by 1, exactly). The sign bit of x is set in the result, as
    ``RN(x / b)`` has it: an exact zero remainder sum is +0 under RN (x = -0 would give
    +0), and a negative zero code is E2M1 code 8. Checked against ``div_rn`` bit for bit for z >= 2^-3
    (``tests/test_quant_kernels.py::test_div_by_rcp_matches_div_rn``,
    ``benchmarks/div_check.py`` on the GPU: every dividend of 36 360 divisors, 0 differences
    at 6e6c3f3). A review (2026-12-04) found no case where one refinement differed from
    ``div_rn`` (1.3e9 pairs, on the CPU); the second stays, as the proof needs it. NaN and
    inf x give NaN (callers overwrite such blocks)."""
    q = x * y
    r = tl.fma(-q, b, x)
    q = tl.fma(r, y, q)
    r = tl.fma(-q, b, x)
    q = tl.fma(r, y, q)
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # an exact zero sum is +0 under RN
    return (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _block_scale(bamax, bad, s_g, NV: tl.constexpr, EMAX: tl.constexpr,
                 MODE: tl.constexpr = 0, THR: tl.constexpr = 0,
                 E2M1_MAX: tl.constexpr = F.E2M1_MAX, E4M3_NAN: tl.constexpr = F.E4M3_NAN_CODE,
                 E4M3_MAXCODE: tl.constexpr = _E4M3_MAXCODE, E4M3_EMIN: tl.constexpr = _E4M3_EMIN,
                 E4M3_MBITS: tl.constexpr = _E4M3_MBITS, E4M3_SUBQ: tl.constexpr = _E4M3_SUBQ,
                 FMB: tl.constexpr = _FP32_MBITS, FBIAS: tl.constexpr = _FP32_BIAS,
                 EXP_MASK: tl.constexpr = _FP32_EXP_MASK,
                 MANT_MASK: tl.constexpr = _FP32_MANT_MASK, SUB_EXP: tl.constexpr = _FP32_SUB_EXP,
                 MIN_EXP: tl.constexpr = F.E8M0_MIN_EXP, MAX_EXP: tl.constexpr = F.E8M0_MAX_EXP,
                 E8M0_BIAS: tl.constexpr = F.E8M0_BIAS, E8M0_NAN: tl.constexpr = F.E8M0_NAN):
    """Scale of each scaling block from its finite amax ``bamax`` (any shape) and ``bad`` (a
    NaN or inf in the block); ``s_g`` is the NVFP4 matrix scale (unused for MX).

    NVFP4: s_b = E4M3_RTN(bamax / (s_g * 6)), element scale s_b * s_g, code the E4M3 code
    of s_b. OCP MX: X = 2^clamp(floor(log2 bamax) - EMAX, -127, 127), the exponent read from
    the bits, code the E8M0 code of X. Bad blocks get scale NaN and the NaN code.

    Scale modes (``MODE``, :data:`replayssm_quant.formats.SCALE_MODES`): NVFP4 1 = ``up``
    (s_b = E4M3_RU(enc), one E4M3 step more where bamax / (s_b s_g) > 6 and s_b < 448); MX
    1 = ``rceil`` (exponent + 1 where the FP32 fraction of a normal bamax > ``THR``), 2 =
    ``even`` (+ 1 where it is >= ``THR``).

    Returns ``(scale, safe, ok, code)``: ``safe`` is the divisor of the elements (1 where
    the scale is 0 or NaN); ``ok`` (NVFP4 only) marks scale > 0.
    """
    if NV:
        t = s_g * E2M1_MAX
        enc = tl.math.div_rn(bamax, tl.broadcast_to(t, bamax.shape))
        if MODE == 1:
            sb, code = _e4m3_ru(enc)
            clip = (tl.math.div_rn(bamax, sb * s_g) > E2M1_MAX) & (sb > 0) & (code < E4M3_MAXCODE)
            code = tl.where(clip, code + 1, code)
            sb = _grid_value(code, E4M3_EMIN, E4M3_MBITS, E4M3_SUBQ)
        else:
            sb, code = _e4m3_rtn(enc)
        sb = tl.where(bad, float("nan"), sb)
        code = tl.where(bad, E4M3_NAN, code)
        scale = sb * s_g
        safe = tl.where(scale > 0, scale, 1.0)
        ok = scale > 0
    else:
        abits = bamax.to(tl.int32, bitcast=True)
        aex = (abits >> FMB) & EXP_MASK
        # subnormal amax: its exponent is that of the fraction field read as an integer
        sub_e = (((abits & MANT_MASK).to(tl.float32).to(tl.int32, bitcast=True) >> FMB)
                 & EXP_MASK) - FBIAS + SUB_EXP
        e = tl.where(aex == 0, sub_e, aex - FBIAS)
        if MODE == 1:
            e = e + ((aex > 0) & ((abits & MANT_MASK) > THR)).to(tl.int32)
        if MODE == 2:
            e = e + ((aex > 0) & ((abits & MANT_MASK) >= THR)).to(tl.int32)
        sexp = tl.where(bamax > 0, e - EMAX, MIN_EXP)
        sexp = tl.minimum(tl.maximum(sexp, MIN_EXP), MAX_EXP)
        code = tl.where(bad, E8M0_NAN, sexp + E8M0_BIAS)
        scale = tl.where(bad, float("nan"), _pow2(sexp))
        safe = tl.where(bad, 1.0, scale)
        ok = ~bad
    return scale, safe, ok, code


# ----------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------


@triton.jit
def _unscaled_kernel(x_ptr, out_ptr, stream_ptr, seed, N, MK,
                     BLOCK: tl.constexpr, SR: tl.constexpr, PACK: tl.constexpr,
                     GRID: tl.constexpr, ALIGNED4: tl.constexpr = False):
    pid = tl.program_id(0)
    if SR and ALIGNED4:  # MK % 4 == 0: the four elements of a Philox call share a matrix
        # a [BLOCK / 4, 4] tile: row g holds elements 4g + w, which take word w of call g
        # (selected per column: no layout change of the words, unlike a join and reshape)
        e0 = (pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)) * 4
        w = tl.arange(0, 4)[None, :]
        offs = e0[:, None] + w
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        mat = e0 // MK
        st = tl.load(stream_ptr + mat, mask=e0 < N, other=0)
        lo, hi = _stream_words(st)
        r0, r1, r2, r3 = _random_words(seed, (e0 - mat * MK) >> 2, lo, hi)
        r = tl.where(w < 2, tl.where(w == 0, r0[:, None], r1[:, None]),
                     tl.where(w == 2, r2[:, None], r3[:, None]))
    elif SR:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        mat = offs // MK
        st = tl.load(stream_ptr + mat, mask=mask, other=0)
        lo, hi = _stream_words(st)
        r = _random_bits(seed, offs - mat * MK, lo, hi)
    else:
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        r = 0
    val, code = _quant(x, r, SR, GRID)
    if PACK:
        tl.store(out_ptr + offs, code.to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, val, mask=mask)


@triton.jit
def _matrix_kernel(x_ptr, out_ptr, scale_ptr, stream_ptr, seed, MK,
                   FMAX: tl.constexpr, BLOCK: tl.constexpr, SR: tl.constexpr,
                   PACK: tl.constexpr, GRID: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    base = b * MK
    cols = tl.arange(0, BLOCK)
    s = _amax_scale(_matrix_amax(x_ptr, base, MK, BLOCK), FMAX)
    if SR:
        lo, hi = _stream_words(tl.load(stream_ptr + b))
    for start in range(0, MK, BLOCK):
        offs = start + cols
        mask = offs < MK
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
        y = tl.where(x != x, x, tl.math.div_rn(x, tl.broadcast_to(s, [BLOCK])))
        if SR:  # one Philox call per four elements (start and BLOCK multiples of 4)
            r0, r1, r2, r3 = _random_words(seed, start // 4 + tl.arange(0, BLOCK // 4), lo, hi)
            r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])  # 4i + w: word w
        else:
            r = 0
        val, code = _quant(y, r, SR, GRID)
        if PACK:
            tl.store(out_ptr + base + offs, code.to(tl.uint8), mask=mask)
        else:
            tl.store(out_ptr + base + offs, val * s, mask=mask)
    if PACK:
        tl.store(scale_ptr + b, s)


@triton.jit
def _block_bits(seed, stream_ptr, b, m, blk, ke, ko, rvalid, K, HALF: tl.constexpr,
                ALIGNED4: tl.constexpr):
    """SR bits ``(re, ro)`` ([R, HALF] uint32) of the even / odd elements ``ke`` / ``ko`` of
    block rows (matrix ``b``, row ``m``, block ``blk``, each [R]) of a ``[M, K]`` matrix with
    the stream keys at ``stream_ptr``: element ``e = m K + k`` takes word ``e & 3`` of Philox
    call ``e >> 2``; with ``ALIGNED4`` (K and the block a multiple of 4: each call's four
    elements are in one block) one call serves four elements, else one call per element."""
    st = tl.load(stream_ptr + b, mask=rvalid, other=0)
    lo, hi = _stream_words(st)
    elem_row = m * K
    if ALIGNED4:  # k = 2j (+1) with j = 2i + x: element 4i + 2x (+1), word 2x (+1)
        i = tl.arange(0, HALF // 2)
        call = (elem_row + blk * (2 * HALF))[:, None] // 4 + i[None, :]
        r0, r1, r2, r3 = _random_words(seed, call, lo[:, None], hi[:, None])
        re = tl.reshape(tl.join(r0, r2), [call.shape[0], HALF])
        ro = tl.reshape(tl.join(r1, r3), [call.shape[0], HALF])
    else:
        re = _random_bits(seed, elem_row[:, None] + ke, lo[:, None], hi[:, None])
        ro = _random_bits(seed, elem_row[:, None] + ko, lo[:, None], hi[:, None])
    return re, ro


@triton.jit
def _block_rows(g, g_end, s_g, x_ptr, out_ptr, bscale_ptr, stream_ptr, seed, M, K, NB,
                NV: tl.constexpr, FP4: tl.constexpr, HALF: tl.constexpr, SR: tl.constexpr,
                PACK: tl.constexpr, EMAX: tl.constexpr, GRID: tl.constexpr,
                MODE: tl.constexpr = 0, THR: tl.constexpr = 0, ALIGNED4: tl.constexpr = False):
    """Quantise the block rows ``g`` ([R] int64 global indices, valid where g < g_end):
    block row g is scaling block ``blk`` of row ``m`` of matrix ``b``. ``s_g``: the NVFP4
    matrix scale. Loads the even / odd elements of each block, then :func:`_block_cast`."""
    rvalid = g < g_end
    mnb = M * NB
    b = g // mnb
    gl = g - b * mnb
    m = gl // NB
    blk = gl - m * NB
    j = tl.arange(0, HALF)
    ke = blk[:, None] * (2 * HALF) + 2 * j[None, :]  # even element of each pair
    ko = ke + 1
    row = (b * M + m) * K
    me = rvalid[:, None] & (ke < K)
    mo = rvalid[:, None] & (ko < K)
    xe = tl.load(x_ptr + row[:, None] + ke, mask=me, other=0.0)  # padding: zeros
    xo = tl.load(x_ptr + row[:, None] + ko, mask=mo, other=0.0)
    _block_cast(xe, xo, g, rvalid, b, m, blk, ke, ko, me, mo, row, s_g, out_ptr, bscale_ptr,
                stream_ptr, seed, M, K, NB, NV, FP4, HALF, SR, PACK, EMAX, GRID, MODE, THR,
                ALIGNED4)


@triton.jit
def _block_cast(xe, xo, g, rvalid, b, m, blk, ke, ko, me, mo, row, s_g, out_ptr, bscale_ptr,
                stream_ptr, seed, M, K, NB, NV: tl.constexpr, FP4: tl.constexpr,
                HALF: tl.constexpr, SR: tl.constexpr, PACK: tl.constexpr, EMAX: tl.constexpr,
                GRID: tl.constexpr, MODE: tl.constexpr, THR: tl.constexpr,
                ALIGNED4: tl.constexpr):
    """Scale, round and store block rows already loaded as even / odd halves ``xe`` / ``xo``
    ([R, HALF], zeros in the padding): block rows ``g`` (int64, global), of matrices ``b``
    (int64), rows ``m`` and blocks ``blk`` (int64 from :func:`_block_rows`; int32 from
    :func:`_pair_kernel`, which assumes M K < 2^31 per matrix, as the SR element index
    does), even / odd element columns ``ke`` / ``ko`` and their masks, row starts ``row``.

    SR bits: :func:`_block_bits`. E2M1 with RTN rounds by :func:`_e2m1_rtn` (same codes and
    values as :func:`_quant` for finite quotients; the blocks with a NaN or inf are
    overwritten below)."""
    j = tl.arange(0, HALF)
    bamax = tl.maximum(tl.max(_finite_abs(xe), axis=1), tl.max(_finite_abs(xo), axis=1))
    nonfin = (tl.abs(xe) < float("inf")).to(tl.int32) + (tl.abs(xo) < float("inf")).to(tl.int32)
    bad = tl.min(nonfin, axis=1) < 2  # a NaN or inf in the block
    nan = float("nan")
    scale, safe, ok, sb_code = _block_scale(bamax, bad, s_g, NV, EMAX, MODE, THR)

    if SR:
        re, ro = _block_bits(seed, stream_ptr, b, m, blk, ke, ko, rvalid, K, HALF, ALIGNED4)
    else:
        re = 0
        ro = 0
    ye = tl.math.div_rn(xe, tl.broadcast_to(safe[:, None], xe.shape))
    yo = tl.math.div_rn(xo, tl.broadcast_to(safe[:, None], xo.shape))
    if FP4 and not SR:
        ve, ce = _e2m1_rtn(ye)
        vo, co = _e2m1_rtn(yo)
    else:
        ve, ce = _quant(ye, re, SR, GRID)
        vo, co = _quant(yo, ro, SR, GRID)
    if NV:  # a block with scale 0 keeps only the signs (+-0); a bad block's codes are 0
        # (E2M1 has no NaN: its scale code marks it)
        ce = tl.where(ok[:, None], ce, tl.where(bad[:, None], 0, ce & 8))
        co = tl.where(ok[:, None], co, tl.where(bad[:, None], 0, co & 8))
        ve = tl.where(ok[:, None], ve, _signed_zero(ce))
        vo = tl.where(ok[:, None], vo, _signed_zero(co))
    else:
        bad_code = GRID.NAN_POS  # positive NaN: 0x7F for E4M3, 0 for E2M1
        ce = tl.where(bad[:, None], bad_code, ce)
        co = tl.where(bad[:, None], bad_code, co)
    ve = tl.where(bad[:, None], nan, ve)
    vo = tl.where(bad[:, None], nan, vo)

    if PACK:
        tl.store(bscale_ptr + g, sb_code.to(tl.uint8), mask=rvalid)
        rowp = (b * M + m) * (NB * 2 * HALF)  # padded row start, in elements
        if FP4:
            byte = (ce | (co << 4)).to(tl.uint8)
            tl.store(out_ptr + rowp[:, None] // 2 + blk[:, None] * HALF + j[None, :], byte,
                     mask=rvalid[:, None])
        else:
            tl.store(out_ptr + rowp[:, None] + ke, ce.to(tl.uint8), mask=rvalid[:, None])
            tl.store(out_ptr + rowp[:, None] + ko, co.to(tl.uint8), mask=rvalid[:, None])
    else:
        tl.store(out_ptr + row[:, None] + ke, ve * scale[:, None], mask=me)
        tl.store(out_ptr + row[:, None] + ko, vo * scale[:, None], mask=mo)


@triton.jit
def _nvfp4_kernel(x_ptr, out_ptr, bscale_ptr, mscale_ptr, stream_ptr, seed, M, K, NB,
                  ROWS: tl.constexpr, TILE: tl.constexpr, SR: tl.constexpr,
                  PACK: tl.constexpr, HALF: tl.constexpr, GDIV: tl.constexpr,
                  GRID: tl.constexpr, UP: tl.constexpr = False, ALIGNED4: tl.constexpr = False):
    b = tl.program_id(0).to(tl.int64)
    MK = M * K
    s_g = _nvfp4_matrix_scale(_matrix_amax(x_ptr, b * MK, MK, TILE), GDIV, UP)
    mnb = M * NB
    g0 = b * mnb
    for t in range(0, mnb, ROWS):
        g = g0 + t + tl.arange(0, ROWS)
        _block_rows(g, g0 + mnb, s_g, x_ptr, out_ptr, bscale_ptr, stream_ptr, seed, M, K, NB,
                    True, True, HALF, SR, PACK, 0, GRID, 1 if UP else 0, 0, ALIGNED4)
    if PACK:
        tl.store(mscale_ptr + b, s_g)


@triton.jit
def _pair_kernel(x_ptr, out_ptr, bscale_ptr, mscale_ptr, stream_ptr, p_ptr, p_stream_ptr, seed,
                 amax_ptr, M, K: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr,
                 TILE: tl.constexpr, SR: tl.constexpr, HALF: tl.constexpr, GDIV: tl.constexpr,
                 GRID: tl.constexpr, UP: tl.constexpr, ALIGNED4: tl.constexpr,
                 PLAIN: tl.constexpr, P_SR: tl.constexpr, P_GRID: tl.constexpr,
                 GIVEN_AMAX: tl.constexpr = False):
    """:func:`pack_pair_triton`: one program per matrix, as :func:`_nvfp4_kernel`: the
    matrix amax first (:func:`_matrix_amax`), then tiles of ``ROWS`` block rows (K and NB
    constexpr: the row and block of a block row without 64-bit divisions), each loaded once
    as even / odd halves (as :func:`_block_rows`). The unscaled copy (``PLAIN``) is cast on
    the halves (SR bits of its own stream by :func:`_block_bits`: element ``e = m K + k``
    takes word ``e & 3`` of call ``e >> 2``, as :func:`_unscaled_kernel`) and its codes
    joined back into a contiguous ``[ROWS, 2 HALF]`` tile for the store; then
    :func:`_block_cast` casts the halves to NVFP4 (the arithmetic of :func:`_nvfp4_kernel`).
    ``GIVEN_AMAX``: the matrix amax is read from ``amax_ptr`` (float32 ``[matrices]``) instead
    of the amax pass."""
    mat = tl.program_id(0).to(tl.int64)
    mnb = M * NB
    s_g = _nvfp4_matrix_scale(_pair_matrix_amax(x_ptr, amax_ptr, mat, M, K, TILE, GIVEN_AMAX),
                              GDIV, UP)
    t = tl.arange(0, 2 * HALF)
    j2 = 2 * tl.arange(0, HALF)
    for t0 in range(0, mnb, ROWS):
        gl = t0 + tl.arange(0, ROWS)  # block rows of this matrix (int32)
        rvalid = gl < mnb
        m = gl // NB
        blk = gl - m * NB
        b = mat + gl.to(tl.int64) * 0  # [ROWS]
        row = (mat * M + m) * K
        ke = blk[:, None] * (2 * HALF) + j2[None, :]  # even element of each pair
        ko = ke + 1
        me = rvalid[:, None] & (ke < K)
        mo = rvalid[:, None] & (ko < K)
        xe = tl.load(x_ptr + row[:, None] + ke, mask=me, other=0.0)  # padding: zeros
        xo = tl.load(x_ptr + row[:, None] + ko, mask=mo, other=0.0)
        if PLAIN:  # the unscaled copy (its own stream)
            if P_SR:
                pre, pro = _block_bits(seed, p_stream_ptr, b, m, blk, ke, ko, rvalid, K, HALF,
                                       ALIGNED4)
            else:
                pre = 0
                pro = 0
            _, pce = _quant(xe, pre, P_SR, P_GRID)
            _, pco = _quant(xo, pro, P_SR, P_GRID)
            kk = blk[:, None] * (2 * HALF) + t[None, :]
            pc = tl.reshape(tl.join(pce.to(tl.int16), pco.to(tl.int16)), [ROWS, 2 * HALF])
            tl.store(p_ptr + row[:, None] + kk, pc, mask=rvalid[:, None] & (kk < K))
        _block_cast(xe, xo, mat * mnb + gl, rvalid, b, m, blk, ke, ko, me, mo, row, s_g,
                    out_ptr, bscale_ptr, stream_ptr, seed, M, K, NB, True, True, HALF, SR,
                    True, 0, GRID, 1 if UP else 0, 0, ALIGNED4)
    tl.store(mscale_ptr + mat, s_g)


@triton.jit
def _plain_codes(x, r, P_SR: tl.constexpr, P_GRID: tl.constexpr):
    """Signed codes (int32, sign in bit 15) of float32 ``x`` cast to the unscaled grid
    ``P_GRID`` (fp16 or bf16) with SR draws ``r`` (``P_SR``) or RTN: fp16 by
    :func:`_f16_sr_signed` / :func:`_f16_rtn_signed`, bf16 by :func:`_quant` (the same codes
    as ``_quant`` in every case)."""
    if P_GRID.EMIN == -14 and P_GRID.MBITS == 10:  # fp16
        if P_SR:
            code = _f16_sr_signed(x.to(tl.int32, bitcast=True), r)
        else:
            code = _f16_rtn_signed(x)
    else:
        _, code = _quant(x, r, P_SR, P_GRID)
    return code


@triton.jit
def _load4(src, mask):
    """The four float32 elements ``src + w`` (w = 0..3) of Philox calls (zeros where
    ``mask`` is off: the padding of a tail block)."""
    return (tl.load(src, mask=mask, other=0.0), tl.load(src + 1, mask=mask, other=0.0),
            tl.load(src + 2, mask=mask, other=0.0), tl.load(src + 3, mask=mask, other=0.0))


@triton.jit
def _amax4(x0, x1, x2, x3):
    """Elementwise ``max |x_w|`` of four tensors, NaN where any is NaN (``max.NaN``: one
    instruction per element): where the result is finite it is the finite amax of
    :func:`_finite_abs`; a NaN or inf result marks a block with a NaN or inf (whose amax
    is not used: its scale is NaN)."""
    nan: tl.constexpr = tl.PropagateNan.ALL
    return tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1), propagate_nan=nan),
                      tl.maximum(tl.abs(x2), tl.abs(x3), propagate_nan=nan), propagate_nan=nan)


@triton.jit
def _finite_amax4(x0, x1, x2, x3):
    """Elementwise max of :func:`_finite_abs` of four tensors (NaN and inf count as 0, as in
    :func:`_matrix_amax`)."""
    return tl.maximum(tl.maximum(_finite_abs(x0), _finite_abs(x1)),
                      tl.maximum(_finite_abs(x2), _finite_abs(x3)))


@triton.jit
def _plain_word(x0, x1, x2, x3, seed, call, lo, hi, P_SR: tl.constexpr, P_GRID: tl.constexpr):
    """The unscaled copy's codes of the four elements ``4 call + w`` (``x_w``) of one Philox
    call, as one little-endian 64-bit word (element ``4 call`` in the low 16 bits)."""
    if P_SR:
        r0, r1, r2, r3 = _random_words(seed, call, lo, hi, True)
    else:
        r0 = 0
        r1 = 0
        r2 = 0
        r3 = 0
    w01 = _plain_codes(x0, r0, P_SR, P_GRID) | (_plain_codes(x1, r1, P_SR, P_GRID) << 16)
    w23 = _plain_codes(x2, r2, P_SR, P_GRID) | (_plain_codes(x3, r3, P_SR, P_GRID) << 16)
    return (w01.to(tl.uint32, bitcast=True).to(tl.uint64)
            | (w23.to(tl.uint32, bitcast=True).to(tl.uint64) << 32))


@triton.jit
def _nvfp4_nibbles(x0, x1, x2, x3, safe, rcp, seed, call, lo, hi, SR: tl.constexpr,
                   GRID: tl.constexpr, RCP: tl.constexpr):
    """The E2M1 codes of ``x_w / safe`` (``div_rn``, or with ``RCP`` :func:`_div_by_rcp` by
    ``rcp = RN(1 / safe)``; RTN by :func:`_e2m1_rtn_code_lean`, or SR with the words of Philox
    call ``call``) as one 16-bit value (uint64): byte 0 holds elements 0 (low nibble) and 1,
    byte 1 elements 2 and 3. For finite quotients only: a block with a NaN or inf can give
    negative codes, so the caller zeroes the whole block-row word of such blocks, and keeps
    only the sign bits of a block whose scale is 0 (``ok``, ``bad``)."""
    if RCP:
        y0 = _div_by_rcp(x0, safe, rcp)
        y1 = _div_by_rcp(x1, safe, rcp)
        y2 = _div_by_rcp(x2, safe, rcp)
        y3 = _div_by_rcp(x3, safe, rcp)
    else:
        y0 = tl.math.div_rn(x0, safe)
        y1 = tl.math.div_rn(x1, safe)
        y2 = tl.math.div_rn(x2, safe)
        y3 = tl.math.div_rn(x3, safe)
    if SR:
        r0, r1, r2, r3 = _random_words(seed, call, lo, hi, True)
        _, c0 = _quant(y0, r0, True, GRID)
        _, c1 = _quant(y1, r1, True, GRID)
        _, c2 = _quant(y2, r2, True, GRID)
        _, c3 = _quant(y3, r3, True, GRID)
    else:
        c0 = _e2m1_rtn_code_lean(y0)
        c1 = _e2m1_rtn_code_lean(y1)
        c2 = _e2m1_rtn_code_lean(y2)
        c3 = _e2m1_rtn_code_lean(y3)
    return ((c0 | (c1 << 4)) | ((c2 | (c3 << 4)) << 8)).to(tl.uint32, bitcast=True).to(tl.uint64)


@triton.jit
def _lean_rows(x_ptr, mat, gl, M, K: tl.constexpr, NB: tl.constexpr):
    """Load block rows ``gl`` ([ROWS] int32, of matrix ``mat``) for the lean pair cast: the
    sixteen ``[ROWS]`` tensors of the block's elements ``4 i + w`` (zeros in a tail block's
    padding and past the matrix's last block row), and the rows' validity, row, block,
    first element and row start (int64)."""
    rvalid = gl < M * NB
    m = gl // NB
    blk = gl - m * NB
    k = blk * 16  # the block's first element in its row
    row = (mat * M + m) * K  # int64
    src = x_ptr + row + k
    a0, a1, a2, a3 = _load4(src, rvalid & (k < K))  # padding: zeros
    b0, b1, b2, b3 = _load4(src + 4, rvalid & (k + 4 < K))
    c0, c1, c2, c3 = _load4(src + 8, rvalid & (k + 8 < K))
    d0, d1, d2, d3 = _load4(src + 12, rvalid & (k + 12 < K))
    return (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
            rvalid, m, blk, k, row)


@triton.jit
def _lean_cast_rows(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                    rvalid, m, blk, k, row, gl, out_ptr, bscale_ptr, p_ptr, seed, mat, s_g,
                    plo, phi, slo, shi, M, K: tl.constexpr, NB: tl.constexpr,
                    SR: tl.constexpr, GRID: tl.constexpr, UP: tl.constexpr,
                    PLAIN: tl.constexpr, P_SR: tl.constexpr, P_GRID: tl.constexpr,
                    RCP: tl.constexpr):
    """Cast and store loaded block rows (:func:`_lean_rows`) with the matrix scale ``s_g``:
    the plain copy's 64-bit words, the NVFP4 block scales and 64-bit nibble words (``RCP``:
    the elements divided by :func:`_div_by_rcp`)."""
    call = m * (K // 4) + blk * 4  # the block's first Philox call (e >> 2, e = m K + k)
    if PLAIN:
        pw = row // 4 + blk * 4  # the plain codes as 64-bit words, one per call
        tl.store(p_ptr + pw, _plain_word(a0, a1, a2, a3, seed, call, plo, phi, P_SR,
                                         P_GRID).to(tl.int64, bitcast=True),
                 mask=rvalid & (k < K))
        tl.store(p_ptr + pw + 1, _plain_word(b0, b1, b2, b3, seed, call + 1, plo, phi,
                                             P_SR, P_GRID).to(tl.int64, bitcast=True),
                 mask=rvalid & (k + 4 < K))
        tl.store(p_ptr + pw + 2, _plain_word(c0, c1, c2, c3, seed, call + 2, plo, phi,
                                             P_SR, P_GRID).to(tl.int64, bitcast=True),
                 mask=rvalid & (k + 8 < K))
        tl.store(p_ptr + pw + 3, _plain_word(d0, d1, d2, d3, seed, call + 3, plo, phi,
                                             P_SR, P_GRID).to(tl.int64, bitcast=True),
                 mask=rvalid & (k + 12 < K))
    nan: tl.constexpr = tl.PropagateNan.ALL
    bamax = tl.maximum(tl.maximum(_amax4(a0, a1, a2, a3), _amax4(b0, b1, b2, b3),
                                  propagate_nan=nan),
                       tl.maximum(_amax4(c0, c1, c2, c3), _amax4(d0, d1, d2, d3),
                                  propagate_nan=nan), propagate_nan=nan)
    bad = ~(bamax < float("inf"))  # a NaN or inf in the block
    _, safe, ok, sb_code = _block_scale(bamax, bad, s_g, True, 0, 1 if UP else 0, 0)
    if RCP:  # one correctly rounded reciprocal per block row
        rcp = tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
    else:
        rcp = safe
    nib = _nvfp4_nibbles(a0, a1, a2, a3, safe, rcp, seed, call, slo, shi, SR, GRID, RCP) \
        | (_nvfp4_nibbles(b0, b1, b2, b3, safe, rcp, seed, call + 1, slo, shi, SR, GRID,
                          RCP) << 16) \
        | (_nvfp4_nibbles(c0, c1, c2, c3, safe, rcp, seed, call + 2, slo, shi, SR, GRID,
                          RCP) << 32) \
        | (_nvfp4_nibbles(d0, d1, d2, d3, safe, rcp, seed, call + 3, slo, shi, SR, GRID,
                          RCP) << 48)
    # a block with scale 0 keeps only the codes' signs (+-0); a bad block's codes are 0 (E2M1
    # has no NaN: its scale code marks it)
    nib = tl.where(ok, nib, tl.where(bad, 0, ((nib >> 3) & 0x1111111111111111) << 3))
    tl.store(out_ptr + (mat * M + m) * NB + blk, nib.to(tl.int64, bitcast=True),
             mask=rvalid)  # a block row's 8 bytes: one 64-bit word
    tl.store(bscale_ptr + mat * (M * NB) + gl, sb_code.to(tl.uint8), mask=rvalid)


@triton.jit
def _pair_lean_tiles(x_ptr, out_ptr, bscale_ptr, p_ptr, seed, mat, s_g, plo, phi, slo, shi, M,
                     K: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, SR: tl.constexpr,
                     GRID: tl.constexpr, UP: tl.constexpr, PLAIN: tl.constexpr,
                     P_SR: tl.constexpr, P_GRID: tl.constexpr, RCP: tl.constexpr):
    """The tile loop of :func:`_pair_lean_kernel` over one matrix (``RCP``: the NVFP4
    elements divided by :func:`_div_by_rcp`, for RTN casts with ``s_g`` in
    :data:`RCP_MATRIX_SCALE_RANGE` only). Indices within a matrix are int32: ``M K`` and
    ``M NB`` below 2^31 (as the generic kernel and the SR element index assume)."""
    for t0 in range(0, M * NB, ROWS):
        gl = t0 + tl.arange(0, ROWS)  # block rows of this matrix (int32)
        (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
         rvalid, m, blk, k, row) = _lean_rows(x_ptr, mat, gl, M, K, NB)
        _lean_cast_rows(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                        rvalid, m, blk, k, row, gl, out_ptr, bscale_ptr, p_ptr, seed, mat, s_g,
                        plo, phi, slo, shi, M, K, NB, SR, GRID, UP, PLAIN, P_SR, P_GRID, RCP)


@triton.jit
def _pair_lean_kernel(x_ptr, out_ptr, bscale_ptr, mscale_ptr, stream_ptr, p_ptr, p_stream_ptr,
                      seed, amax_ptr, M, K: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr,
                      TILE: tl.constexpr, SR: tl.constexpr, GDIV: tl.constexpr,
                      GRID: tl.constexpr, UP: tl.constexpr, PLAIN: tl.constexpr,
                      P_SR: tl.constexpr, P_GRID: tl.constexpr, RCP_FORM: tl.constexpr,
                      SINGLE: tl.constexpr = False, GIVEN_AMAX: tl.constexpr = False,
                      RCP_LO: tl.constexpr = RCP_MATRIX_SCALE_RANGE[0],
                      RCP_HI: tl.constexpr = RCP_MATRIX_SCALE_RANGE[1]):
    """:func:`pack_pair_triton` with ``form="lean"`` (``"lean_rcp"``: ``RCP_FORM``): the
    bytes of :func:`_pair_kernel` in fewer instructions per element (NVFP4 blocks of 16,
    ``K % 4 == 0``). One program per matrix: the matrix amax pass, then tiles of ``ROWS``
    block rows (:func:`_pair_lean_tiles`) held as sixteen 1-D ``[ROWS]`` tensors, one per
    element of the block (``a_w``, ``b_w``, ``c_w``, ``d_w``: elements ``w``, ``4 + w``,
    ``8 + w``, ``12 + w``), so that a thread holds whole block rows (the block amax and
    scale are computed once per block row, with no reduction across threads) and

    * element ``4 i + w`` of the block takes word ``w`` of its Philox call (DESIGN.md
      section 3: the call ``(m K + k) >> 2``) as it comes (:func:`_random_words` by
      :func:`_philox_wide`; the stream keys of one matrix loaded once);
    * the plain copy's four codes of a call are one 64-bit word (``p_ptr`` as int64), and
      the NVFP4 copy's 16 nibbles of a block row one 64-bit word (``out_ptr`` as int64),
      stored without joining halves;
    * fp16 codes come from :func:`_plain_codes` and E2M1 RTN codes from
      :func:`_e2m1_rtn_code_lean`; the block scales (:func:`_block_scale`) and the
      division (``div_rn``) are those of :func:`_block_cast`;
    * with ``RCP_FORM`` (RTN casts, the matrix scale in :data:`RCP_MATRIX_SCALE_RANGE`, one
      test per matrix) the elements are divided by :func:`_div_by_rcp`: one reciprocal per
      block row and four FMAs per element, the same E2M1 codes;
    * with ``SINGLE`` (``ROWS`` covers the matrix's block rows) there is no amax pass: the
      one tile is loaded, its finite amax taken from the registers (:func:`_finite_amax4`,
      a max: order-free, the amax pass's value), and cast, so S is read once;
    * with ``GIVEN_AMAX`` (and not ``SINGLE``) the matrix amax is read from ``amax_ptr``
      (float32 ``[matrices]``) instead of the amax pass, so S is read once."""
    mat = tl.program_id(0).to(tl.int64)
    plo = 0
    phi = 0
    slo = 0
    shi = 0
    if PLAIN and P_SR:
        plo, phi = _stream_words(tl.load(p_stream_ptr + mat))
    if SR:
        slo, shi = _stream_words(tl.load(stream_ptr + mat))
    if SINGLE:  # one tile holds the matrix: its amax from the loaded tile, S read once
        gl = tl.arange(0, ROWS)
        (a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
         rvalid, m, blk, k, row) = _lean_rows(x_ptr, mat, gl, M, K, NB)
        fa = tl.maximum(tl.maximum(_finite_amax4(a0, a1, a2, a3), _finite_amax4(b0, b1, b2, b3)),
                        tl.maximum(_finite_amax4(c0, c1, c2, c3), _finite_amax4(d0, d1, d2, d3)))
        s_g = _nvfp4_matrix_scale(tl.max(fa, axis=0), GDIV, UP)
        if RCP_FORM and not SR and (s_g >= RCP_LO) & (s_g <= RCP_HI):
            _lean_cast_rows(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                            rvalid, m, blk, k, row, gl, out_ptr, bscale_ptr, p_ptr, seed, mat,
                            s_g, plo, phi, slo, shi, M, K, NB, SR, GRID, UP, PLAIN, P_SR,
                            P_GRID, True)
        else:
            _lean_cast_rows(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                            rvalid, m, blk, k, row, gl, out_ptr, bscale_ptr, p_ptr, seed, mat,
                            s_g, plo, phi, slo, shi, M, K, NB, SR, GRID, UP, PLAIN, P_SR,
                            P_GRID, False)
        tl.store(mscale_ptr + mat, s_g)
    else:
        s_g = _nvfp4_matrix_scale(
            _pair_matrix_amax(x_ptr, amax_ptr, mat, M, K, TILE, GIVEN_AMAX), GDIV, UP)
        if RCP_FORM and not SR and (s_g >= RCP_LO) & (s_g <= RCP_HI):  # one test per matrix
            _pair_lean_tiles(x_ptr, out_ptr, bscale_ptr, p_ptr, seed, mat, s_g, plo, phi, slo,
                             shi, M, K, NB, ROWS, SR, GRID, UP, PLAIN, P_SR, P_GRID, True)
        else:
            _pair_lean_tiles(x_ptr, out_ptr, bscale_ptr, p_ptr, seed, mat, s_g, plo, phi, slo,
                             shi, M, K, NB, ROWS, SR, GRID, UP, PLAIN, P_SR, P_GRID, False)
        tl.store(mscale_ptr + mat, s_g)


@triton.jit
def _mx_kernel(x_ptr, out_ptr, bscale_ptr, stream_ptr, seed, M, K, NB, G,
               ROWS: tl.constexpr, FP4: tl.constexpr, EMAX: tl.constexpr, SR: tl.constexpr,
               PACK: tl.constexpr, HALF: tl.constexpr, GRID: tl.constexpr,
               MODE: tl.constexpr = 0, THR: tl.constexpr = 0, ALIGNED4: tl.constexpr = False):
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    _block_rows(g, G, 1.0, x_ptr, out_ptr, bscale_ptr, stream_ptr, seed, M, K, NB,
                False, FP4, HALF, SR, PACK, EMAX, GRID, MODE, THR, ALIGNED4)


# ----------------------------------------------------------------------------------------
# host wrappers
# ----------------------------------------------------------------------------------------


def scale_consts(spec: QuantSpec) -> dict:
    """``MODE`` / ``THR`` constexprs of a spec's scale mode (``_block_scale``): NVFP4 ``up`` 1;
    MX ``rceil`` 1 and ``even`` 2 with the FP32-fraction threshold of the element grid
    (:data:`replayssm_quant.formats.MX_RCEIL_FRAC` / ``MX_EVEN_FRAC``); the defaults 0."""
    if spec.scale == "up":
        return {"MODE": 1, "THR": 0}
    if spec.scale == "rceil":
        return {"MODE": 1, "THR": F.MX_RCEIL_FRAC[spec.name]}
    if spec.scale == "even":
        return {"MODE": 2, "THR": F.MX_EVEN_FRAC[spec.name]}
    return {"MODE": 0, "THR": 0}


def _streams(spec: QuantSpec, x: torch.Tensor, stream) -> torch.Tensor:
    """int64 [B] stream keys (one per matrix), broadcast as in the reference (SR only)."""
    if not spec.sr:
        return torch.zeros(1, dtype=torch.int64, device=x.device)
    lead = x.shape[:-2]
    st = stream_keys_to(stream, x.device)
    try:
        st = torch.broadcast_to(st, lead)
    except RuntimeError:
        raise ValueError(
            f"stream of shape {tuple(st.shape)} does not broadcast to the leading dims "
            f"{tuple(lead)} of x {tuple(x.shape)}"
        ) from None
    st = st.reshape(-1).contiguous()
    if st.numel() == 0:
        st = torch.zeros(1, dtype=torch.int64, device=x.device)
    return st


def _check(x, spec) -> QuantSpec:
    spec = parse_spec(spec)
    if spec.is_identity:
        raise ValueError("fp32 is the identity format and has no kernel; use quantize()")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 2:
        raise ValueError(f"x must be a floating-point tensor [..., M, K], got {x!r:.80}")
    if x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"x must have non-empty matrix dims [M, K], got shape {tuple(x.shape)}")
    return spec


def _run(x: torch.Tensor, spec: QuantSpec, seed: int, stream, pack: bool):
    """Launch the kernel of ``spec``; returns (out or codes, block scales, matrix scale)."""
    info = spec.info
    grid = info.element
    lead = x.shape[:-2]
    m, k = x.shape[-2], x.shape[-1]
    bsz = math.prod(lead)
    xf = _as_float32(x).contiguous()  # same conversion as the reference (saturating float64)
    st = _streams(spec, x, stream)
    seed = int(seed)
    gc = _grid_consts(grid)  # the format's constexpr bundle: one kernel argument, GRID
    dev = x.device
    if info.scaling == "none":
        n = xf.numel()
        out = torch.empty(x.shape, dtype=torch.int16 if pack else torch.float32, device=dev)
        if n:
            _unscaled_kernel[(triton.cdiv(n, _TILE),)](
                xf, out, st, seed, n, m * k, BLOCK=_TILE, SR=spec.sr, PACK=pack, GRID=gc,
                ALIGNED4=(m * k) % 4 == 0 and _TILE % 4 == 0)
        return out, None, None
    if info.scaling == "matrix":
        if pack:
            out = torch.empty(x.shape, dtype=torch.uint8, device=dev)
        else:
            out = torch.empty(x.shape, dtype=torch.float32, device=dev)
        mscale = torch.empty(lead, dtype=torch.float32, device=dev)
        if bsz:
            _matrix_kernel[(bsz,)](
                xf, out, mscale, st, seed, m * k, FMAX=grid.max, BLOCK=_TILE, SR=spec.sr,
                PACK=pack, GRID=gc)
        return out, None, mscale
    block = info.block
    nb = triton.cdiv(k, block)
    kp = nb * block
    fp4 = grid is F.E2M1
    if pack:
        out = torch.empty((*lead, m, kp // 2 if fp4 else kp), dtype=torch.uint8, device=dev)
        bscale = torch.empty((*lead, m, nb), dtype=torch.uint8, device=dev)
    else:
        out = torch.empty(x.shape, dtype=torch.float32, device=dev)
        bscale = torch.empty(1, dtype=torch.uint8, device=dev)
    if info.scaling == "nvfp4":
        mscale = torch.empty(lead, dtype=torch.float32, device=dev)
        if bsz:
            _nvfp4_kernel[(bsz,)](
                xf, out, bscale, mscale, st, seed, m, k, nb, ROWS=_NV_ROWS, TILE=_TILE,
                SR=spec.sr, PACK=pack, HALF=block // 2, GDIV=F.NVFP4_SCALE_DIVISOR, GRID=gc,
                UP=spec.scale == "up", ALIGNED4=k % 4 == 0 and block % 4 == 0)
        return out, bscale, mscale
    g = bsz * m * nb
    emax = F.MXFP8_EMAX if grid is F.E4M3 else F.MXFP4_EMAX
    if g:
        _mx_kernel[(triton.cdiv(g, _MX_ROWS),)](
            xf, out, bscale, st, seed, m, k, nb, g, ROWS=_MX_ROWS, FP4=fp4, EMAX=emax,
            SR=spec.sr, PACK=pack, HALF=block // 2, GRID=gc, **scale_consts(spec),
            ALIGNED4=k % 4 == 0 and block % 4 == 0)
    return out, bscale, None


def quantize_triton(x: torch.Tensor, spec, *, seed: int = 0, stream=0) -> torch.Tensor:
    """Kernel version of :func:`replayssm_quant.quant.quantize_reference` (bit-identical).

    Args:
        x: float tensor ``[..., M, K]`` on CUDA (or on CPU under ``TRITON_INTERPRET=1``).
        spec: any non-fp32 format token or QuantSpec.
        seed: Philox key for SR, int in [0, 2^63).
        stream: int or int64 tensor broadcastable to ``x.shape[:-2]`` (SR stream keys).

    Returns:
        float32 tensor of x's shape.
    """
    spec = _check(x, spec)
    out, _, _ = _run(x, spec, seed, stream, pack=False)
    return out


def pack_triton(x: torch.Tensor, spec, *, seed: int = 0, stream=0) -> PackedTensor:
    """Kernel version of :func:`replayssm_quant.quant.pack_reference` (same bytes)."""
    spec = _check(x, spec)
    info = spec.info
    codes, bscale, mscale = _run(x, spec, seed, stream, pack=True)
    if info.scaling == "none":
        codes = codes.view(torch.bfloat16 if info.element is F.BF16 else torch.float16)
    return PackedTensor(spec, x.shape, codes, bscale, mscale)


def pair_casts(plain, scaled) -> bool:
    """Whether :func:`pack_pair_triton` casts to the specs ``(plain, scaled)``: ``scaled`` is
    NVFP4 and ``plain`` is fp32 (the identity: no cast) or unscaled (fp16, bf16; RTN or SR)."""
    plain, scaled = parse_spec(plain), parse_spec(scaled)
    return (scaled.info.scaling == "nvfp4"
            and (plain.is_identity or plain.info.scaling == "none"))


def pack_pair_triton(x: torch.Tensor, plain, scaled, *, seed: int = 0, plain_stream=0,
                     scaled_stream=0, rows: int = _PAIR_ROWS, num_warps: int = _PAIR_WARPS,
                     form: str | None = None, matrix_amax: torch.Tensor | None = None):
    """Two casts of one float32 tensor in one launch: the same bytes as
    ``(pack_triton(x, plain, stream=plain_stream), pack_triton(x, scaled,
    stream=scaled_stream))`` (:func:`replayssm_quant.quant.pack_reference` each), with each
    tile of ``x`` loaded once for both casts (after the NVFP4 matrix-amax pass, which reads
    the matrix once more, as :func:`pack_triton`'s does).

    The split flush's casts (:func:`replayssm_quant.kernels.replay.flush.flush_kernel`,
    ``cast_form="pair"``): the anchor and the read copy are cast independently from the same
    unrounded S (DESIGN.md section 3), each with its own SR stream.

    Args:
        x: float32 ``[..., M, K]`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), contiguous.
        plain: fp32 (returned as ``x`` itself) or an unscaled format (fp16, bf16, with
            ``+sr`` or not).
        scaled: an NVFP4 spec (``nvfp4``, ``nvfp4+sr``, ``nvfp4+up``...).
        seed: Philox key, int in [0, 2^63).
        plain_stream, scaled_stream: SR stream keys (int or int64 tensors broadcastable to
            ``x.shape[:-2]``), as :func:`pack_triton`'s ``stream``.
        rows, num_warps: block rows (16 elements each) per tile (a power of two) and warps;
            the bytes do not depend on them.
        form: the kernel, one of :data:`PAIR_FORMS` (None: the module default
            ``_PAIR_FORM``): ``"generic"`` :func:`_pair_kernel` (the quantizer kernels'
            helpers), ``"lean"`` :func:`_pair_lean_kernel` (the same bytes in fewer
            instructions per element) where ``K % 4 == 0``, else :func:`_pair_kernel`;
            ``"lean_rcp"`` the same, and an RTN NVFP4 copy divides its elements by one
            reciprocal per block (:func:`_div_by_rcp`) where its matrix scale lies in
            :data:`RCP_MATRIX_SCALE_RANGE` (with SR it is ``"lean"``). A matrix holds
            fewer than 2^31 elements (int32 indices, as the SR element index).
        matrix_amax: None (the kernel's own amax pass over each matrix), or float32
            ``x.shape[:-2]`` on ``x``'s device: each matrix's finite amax, the max of ``|x|``
            over its finite elements (0 where it has none), computed by the caller, e.g. the
            split flush's ``fp32`` flush as it writes S (``flush_kernel(amax_out=...)``), so
            that ``x`` is read once (the single-tile lean form takes it from its registers
            anyway). The bytes are
            :func:`~replayssm_quant.quant.pack_reference`'s only if it is that amax; it is
            not checked.

    Returns:
        ``(plain copy, scaled copy)``: PackedTensor each (the plain one ``x`` for fp32).

    Raises:
        ValueError: an unknown format token, specs :func:`pair_casts` refuses, ``x`` not a
            contiguous float32 ``[..., M, K]`` with non-empty matrix dims, ``rows`` not a
            power of two in [1, 1024], ``num_warps`` not one of 1, 2, 4, 8, 16, 32, ``form``
            not one of :data:`PAIR_FORMS`, a stream that does not broadcast to
            ``x.shape[:-2]``, a ``matrix_amax`` that is not a float32 tensor of shape
            ``x.shape[:-2]`` on ``x``'s device.
    """
    if form is None:
        form = _PAIR_FORM
    if form not in PAIR_FORMS:
        raise ValueError(f"form must be one of {PAIR_FORMS}, got {form!r}")
    plain, scaled = parse_spec(plain), parse_spec(scaled)
    if not pair_casts(plain, scaled):
        raise ValueError(f"pack_pair_triton casts to (fp32 or an unscaled format, nvfp4), got "
                         f"({str(plain)!r}, {str(scaled)!r})")
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.dim() < 2 \
            or not x.is_contiguous():
        got = (f"dtype {x.dtype}, shape {tuple(x.shape)}, contiguous {x.is_contiguous()}"
               if isinstance(x, torch.Tensor) else type(x).__name__)
        raise ValueError(f"x must be a contiguous float32 tensor [..., M, K], got {got}")
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= 1024 \
            or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two in [1, 1024], got {rows!r}")
    if isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, 32, got {num_warps!r}")
    _check(x, scaled)
    lead = x.shape[:-2]
    if matrix_amax is not None and not (
            isinstance(matrix_amax, torch.Tensor) and matrix_amax.dtype == torch.float32
            and tuple(matrix_amax.shape) == tuple(lead) and matrix_amax.device == x.device):
        got = (f"dtype {matrix_amax.dtype}, shape {tuple(matrix_amax.shape)}, device "
               f"{matrix_amax.device}" if isinstance(matrix_amax, torch.Tensor)
               else type(matrix_amax).__name__)
        raise ValueError(f"matrix_amax must be None or a float32 tensor of shape "
                         f"{tuple(lead)} (x.shape[:-2]) on {x.device}, got {got}")
    m, k = x.shape[-2], x.shape[-1]
    bsz = math.prod(lead)
    dev = x.device
    info = scaled.info
    block = info.block
    nb = triton.cdiv(k, block)
    codes = torch.empty((*lead, m, nb * block // 2), dtype=torch.uint8, device=dev)
    bscale = torch.empty((*lead, m, nb), dtype=torch.uint8, device=dev)
    mscale = torch.empty(lead, dtype=torch.float32, device=dev)
    st = _streams(scaled, x, scaled_stream)
    p_on = not plain.is_identity
    if p_on:
        pcodes = torch.empty(x.shape, dtype=torch.int16, device=dev)
        pst = _streams(plain, x, plain_stream)
        pgrid = _grid_consts(plain.info.element)
    else:
        pcodes, pst, pgrid = codes, st, None
    given = matrix_amax is not None
    amax_arg = matrix_amax.contiguous() if given else mscale
    if bsz and form in ("lean", "lean_rcp") and k % 4 == 0:
        assert block == 16  # NVFP4's scaling block
        _pair_lean_kernel[(bsz,)](
            x, codes.view(torch.int64), bscale, mscale, st,
            pcodes.view(torch.int64) if p_on else pcodes, pst, int(seed), amax_arg, m, K=k,
            NB=nb, ROWS=rows, TILE=_TILE, SR=scaled.sr, GDIV=F.NVFP4_SCALE_DIVISOR,
            GRID=_grid_consts(info.element), UP=scaled.scale == "up", PLAIN=p_on,
            P_SR=p_on and plain.sr, P_GRID=pgrid, RCP_FORM=form == "lean_rcp",
            SINGLE=rows >= m * nb, GIVEN_AMAX=given, num_warps=num_warps)
    elif bsz:
        _pair_kernel[(bsz,)](
            x, codes, bscale, mscale, st, pcodes, pst, int(seed), amax_arg, m, K=k, NB=nb,
            ROWS=rows, TILE=_TILE, SR=scaled.sr, HALF=block // 2, GDIV=F.NVFP4_SCALE_DIVISOR,
            GRID=_grid_consts(info.element), UP=scaled.scale == "up",
            ALIGNED4=k % 4 == 0 and block % 4 == 0, PLAIN=p_on, P_SR=p_on and plain.sr,
            P_GRID=pgrid, GIVEN_AMAX=given, num_warps=num_warps)
    out_s = PackedTensor(scaled, x.shape, codes, bscale, mscale)
    if not p_on:
        return x, out_s
    pview = pcodes.view(torch.bfloat16 if plain.info.element is F.BF16 else torch.float16)
    return PackedTensor(plain, x.shape, pview, None, None), out_s
