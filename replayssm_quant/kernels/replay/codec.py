"""Stored copies in and out of registers: the format codec shared by the replay kernels.

Every replay kernel reads a stored checkpoint (:class:`~replayssm_quant.packed.PackedTensor` or an
FP32 tensor) and the flush and chain kernels write new ones. This module holds, written once:

* the format constants of a launch, built on the host from a
  :class:`~replayssm_quant.formats.QuantSpec` (``_decode_consts``: how to decode a stored copy;
  ``_cast_consts``: how to round and pack a new one);
* the jit helpers that decode a stored tile (``_load_copy``), round and store a tile
  (``_cast_store``), and decode what was just stored without a round trip (``_dequant_tile``);
* host helpers: the kernels' shape rule, a stored copy's pointer tensors, output buffers.

Torch reference: :meth:`replayssm_quant.packed.PackedTensor.dequantize` (decode) and
:func:`replayssm_quant.quant.pack_reference` (cast); rounding uses the jit helpers of
:mod:`replayssm_quant.kernels.quant`, so a cast here is bit-identical to the reference's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import formats as F
from ...capabilities import replay_kernels_supported, triton_interpreting
from ...formats import QuantSpec, parse_spec
from ...packed import PackedTensor
from ..quant import (_amax_scale, _block_scale, _e2m1_rtn, _e8m0_value, _finite_abs, _signed_zero,
                     _grid_consts, _grid_value, _nvfp4_matrix_scale, _quant, _random_pairs,
                     _random_tile, _stream_words, scale_consts)

# Format kinds (constexpr KIND of a stored copy / of a cast)
_K_FLOAT = 0  # fp32 values (identity)
_K_HALF = 1  # bf16 / fp16 values (stored as torch.bfloat16 / torch.float16)
_K_MATRIX = 2  # fp8e4m3 / fp8e5m2 codes + FP32 scale per matrix
_K_NVFP4 = 3  # E2M1 nibbles + E4M3 scale per 16 + FP32 scale per matrix
_K_MX = 4  # E4M3 / E2M1 codes + E8M0 scale per 32

# NaN rule of a decoded minifloat (constexpr NANF of ``_decode_code``)
_NANF_NONE = 0  # E2M1: no NaN
_NANF_E4M3 = 1  # OFP8 E4M3FN: magnitude code 0x7F (all ones) is NaN, no inf
_NANF_IEEE = 2  # E5M2: all-ones exponent is inf (zero mantissa) or NaN

# Decode constexprs of an FP32 copy (KIND _K_FLOAT; only KIND is read)
_FP32_EB = F.FP32_EBITS
_FP32_MB = F.FP32_MBITS
_FP32_EMIN = F.FP32_EMIN
# Scale blocks of the stored copies, and the E4M3 grid of the NVFP4 block scales (read by the
# jit helpers as constexpr defaults)
_NV_BLOCK = F.NVFP4_BLOCK
_MX_BLOCK = F.MX_BLOCK
_E4M3_EB = F.E4M3.ebits
_E4M3_MB = F.E4M3.mbits
_E4M3_EMIN = F.E4M3.emin
_E4M3_SUBQ = F.E4M3_MIN_SUBNORMAL


def _kind(spec: QuantSpec) -> int:
    info = spec.info
    if spec.is_identity:
        return _K_FLOAT
    return {"none": _K_HALF, "matrix": _K_MATRIX, "nvfp4": _K_NVFP4, "mx": _K_MX}[info.scaling]


# The format constants of a launch, written once: a kernel takes one constexpr bundle per stored
# copy it reads (DecodeConsts: ``C`` of the records kernel, ``A`` of the flush kernel, ``P`` of
# the chain kernel) and per cast it writes (CastConsts: ``CA`` anchor, ``CR`` read copy), and the
# jit helpers read them by field (``D.KIND``, ``C.SR``).
class DecodeConsts(NamedTuple):
    """How to decode a stored copy (``_load_stored``, ``records._c_rows`` / ``_c_blocks``,
    ``_dequant_tile``)."""

    KIND: int  # _K_FLOAT, _K_HALF, _K_MATRIX, _K_NVFP4, _K_MX
    FP4: bool  # two E2M1 codes per byte
    EB: int  # element exponent bits (minifloat codes)
    MB: int  # element mantissa bits
    EMIN: int  # element smallest normal exponent
    SUBQ: float  # element subnormal quantum
    NANF: int  # NaN rule of the element codes (_NANF_*)
    BF16: bool  # half-precision values are bfloat16 (else float16)
    LUT: bool = False  # E2M1 pairs by byte-permute table lookups (_e2m1_pairs_lut; CUDA only)
    HALF: bool = False  # E2M1 pairs as packed halves, times 2^-14 (_e2m1_pairs_half; CUDA only)


class CastConsts(NamedTuple):
    """How to round and pack a new copy (``_cast_store``): the cast's layout and the element
    grid's fields of :class:`~replayssm_quant.kernels.quant.GridConsts` (so the bundle is also
    the grid ``G`` of ``_quant``)."""

    KIND: int  # _K_FLOAT, _K_HALF, _K_MATRIX, _K_NVFP4, _K_MX
    FP4: bool  # two E2M1 codes per byte
    SR: bool  # stochastic rounding
    FMAX: float  # element grid max (fp8 matrix scale amax / FMAX)
    EMAX: int  # OCP MX element emax (E8M0 scale exponent)
    BLK: int  # scaling block (1 without blocks)
    MS: bool  # the format stores a matrix scale (fp8, nvfp4)
    SCALE: int  # scale mode (kernels.quant.scale_consts: nvfp4 up 1; mx rceil 1, even 2)
    THR: int  # its FP32-fraction threshold (mx)
    EMIN: int  # GridConsts fields of the element grid, from here on
    MBITS: int
    MAXCODE: int
    SUBQ: float
    SIGN_SHIFT: int
    HAS_INF: bool
    NAN_POS: int
    NAN_NEG: int
    INF_POS: int
    INF_NEG: int


def _decode_consts(spec) -> DecodeConsts:
    """The :class:`DecodeConsts` of a stored copy of format ``spec`` (see ``_load_copy``)."""
    spec = parse_spec(spec)
    kind = _kind(spec)
    grid = spec.info.element
    if kind in (_K_MATRIX, _K_NVFP4, _K_MX):
        nanf = _NANF_NONE if grid is F.E2M1 else (_NANF_E4M3 if grid is F.E4M3 else _NANF_IEEE)
        return DecodeConsts(KIND=kind, FP4=grid is F.E2M1, EB=grid.ebits, MB=grid.mbits,
                            EMIN=grid.emin, SUBQ=grid.min_subnormal, NANF=nanf, BF16=False)
    # FP32 / half values: only KIND (and BF16) are read
    return DecodeConsts(KIND=kind, FP4=False, EB=_FP32_EB, MB=_FP32_MB, EMIN=_FP32_EMIN,
                        SUBQ=1.0, NANF=_NANF_NONE, BF16=grid is F.BF16)


def _cast_consts(spec) -> CastConsts:
    """The :class:`CastConsts` of a cast to ``spec`` (see ``_cast_store``)."""
    spec = parse_spec(spec)
    kind = _kind(spec)
    grid = spec.info.element
    sc = scale_consts(spec)
    if grid is None:
        g = _grid_consts(F.FP16)  # unused (identity)
    else:
        g = _grid_consts(grid)
    return CastConsts(KIND=kind, FP4=grid is F.E2M1, SR=spec.sr,
                      FMAX=(grid.max if grid else 1.0),
                      EMAX=(F.MXFP8_EMAX if grid is F.E4M3 else F.MXFP4_EMAX),
                      BLK=(spec.info.block or 1), MS=kind in (_K_MATRIX, _K_NVFP4),
                      SCALE=sc["MODE"], THR=sc["THR"], **g._asdict())


# ----------------------------------------------------------------------------------------
# jit helpers: decode a stored tile, cast-and-store a tile
# ----------------------------------------------------------------------------------------


@triton.jit
def _decode_code(code, EB: tl.constexpr, MB: tl.constexpr, EMIN: tl.constexpr,
                 SUBQ: tl.constexpr, NANF: tl.constexpr):
    """Float32 value of sign|exponent|mantissa minifloat codes (E4M3, E5M2, E2M1): the same
    value torch's float8 conversion / the E2M1 table give (NANF: 0 none, 1 E4M3FN 0x7F,
    2 IEEE-style all-ones exponent)."""
    code = code.to(tl.int32)
    neg = ((code >> (EB + MB)) & 1) == 1
    mag = code & ((1 << (EB + MB)) - 1)
    val = _grid_value(mag, EMIN, MB, SUBQ)
    vbits = val.to(tl.int32, bitcast=True) | tl.where(neg, -2147483648, 0)
    val = vbits.to(tl.float32, bitcast=True)
    if NANF == 1:
        val = tl.where(mag == (1 << (EB + MB)) - 1, float("nan"), val)
    if NANF == 2:
        special = (mag >> MB) == (1 << EB) - 1
        inf = tl.where(neg, float("-inf"), float("inf"))
        val = tl.where(special, tl.where((mag & ((1 << MB) - 1)) == 0, inf, float("nan")), val)
    return val


@triton.jit
def _decode_e4m3(code, EB: tl.constexpr = _E4M3_EB, MB: tl.constexpr = _E4M3_MB,
                 EMIN: tl.constexpr = _E4M3_EMIN, SUBQ: tl.constexpr = _E4M3_SUBQ,
                 NANF: tl.constexpr = _NANF_E4M3):
    """Float32 value of E4M3 codes (the NVFP4 block scales)."""
    return _decode_code(code, EB, MB, EMIN, SUBQ, NANF)


@triton.jit
def _split_halves(x, R: tl.constexpr, KH: tl.constexpr):
    """[R, 2*KH] -> (even, odd) columns, each [R, KH]."""
    return tl.split(tl.reshape(x, [R, KH, 2]))


@triton.jit
def _load_copy(c_ptr, bs_ptr, ms_ptr, mat, rows, rmask, V,
               K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr,
               KIND: tl.constexpr = _K_FLOAT, FP4: tl.constexpr = False,
               EB: tl.constexpr = _FP32_EB, MB: tl.constexpr = _FP32_MB,
               EMIN: tl.constexpr = _FP32_EMIN, SUBQ: tl.constexpr = 1.0,
               NANF: tl.constexpr = _NANF_NONE,
               NV_BLOCK: tl.constexpr = _NV_BLOCK, MX_BLOCK: tl.constexpr = _MX_BLOCK):
    """Rows ``rows`` of matrix ``mat`` of a stored copy, dequantised: (even, odd) [BV, KH].
    The format constexprs default to an FP32 copy."""
    j = tl.arange(0, KH)
    rowg = mat * V + rows.to(tl.int64)
    m2 = rmask[:, None]
    if FP4:
        byte = tl.load(c_ptr + rowg[:, None] * KH + j[None, :], mask=m2, other=0).to(tl.int32)
        e = _decode_code(byte & 15, EB, MB, EMIN, SUBQ, NANF)
        o = _decode_code(byte >> 4, EB, MB, EMIN, SUBQ, NANF)
    else:
        kk = tl.arange(0, K)
        x = tl.load(c_ptr + rowg[:, None] * K + kk[None, :], mask=m2, other=0)
        if KIND <= 1:
            x = x.to(tl.float32)
        else:
            x = _decode_code(x, EB, MB, EMIN, SUBQ, NANF)
        e, o = _split_halves(x, BV, KH)
    if KIND == 2:
        s = tl.load(ms_ptr + mat)
        e = e * s
        o = o * s
    if KIND == 3:
        nb = K // NV_BLOCK
        sbc = tl.load(bs_ptr + rowg[:, None] * nb + (j // (NV_BLOCK // 2))[None, :], mask=m2,
                      other=0)
        sb = _decode_e4m3(sbc)
        scale = sb * tl.load(ms_ptr + mat)
        e = e * scale
        o = o * scale
    if KIND == 4:
        nb = K // MX_BLOCK
        sc = tl.load(bs_ptr + rowg[:, None] * nb + (j // (MX_BLOCK // 2))[None, :], mask=m2,
                     other=0)
        sc = sc.to(tl.int32)
        scale = _e8m0_value(sc)
        e = e * scale
        o = o * scale
    return e, o



@triton.jit
def _load_stored(c_ptr, bs_ptr, ms_ptr, mat, rows, rmask, V,
                 K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, D: tl.constexpr):
    """:func:`_load_copy` of a stored copy described by ``D`` (a :class:`DecodeConsts`)."""
    return _load_copy(c_ptr, bs_ptr, ms_ptr, mat, rows, rmask, V, K, KH, BV, D.KIND, D.FP4,
                      D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)

@triton.jit
def _matrix_scale(amax, KIND: tl.constexpr, FMAX: tl.constexpr, SCALE: tl.constexpr = 0,
                  GDIV: tl.constexpr = F.NVFP4_SCALE_DIVISOR):
    """fp8: s = amax / FMAX; nvfp4: s_g = amax / (448 * 6), moved up under the ``up`` scale
    mode (``SCALE`` 1); 1 where that is 0 (reference ``quant._parts``)."""
    if KIND == 3:
        s = _nvfp4_matrix_scale(amax, GDIV, SCALE == 1)
    else:
        s = _amax_scale(amax, FMAX)
    return s


@triton.jit
def _cast_store(xe, xo, rows, rmask, mat, V, s_mat, seed, st_ptr, out_ptr, bs_ptr,
                K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                key=0, KEYED: tl.constexpr = False):
    """Round the unrounded FP32 rows (even/odd halves [BV, KH]) of one matrix to a format and
    store the packed codes (and block scale codes); same steps as ``quant._parts`` /
    ``kernels.quant._block_rows``. ``C``: the cast (a :class:`CastConsts`); ``s_mat``: the
    matrix scale (fp8: s; nvfp4: s_g). The SR stream key is ``st_ptr[mat]``, or ``key`` (an
    int64 value) with ``KEYED``.

    Returns what was stored, for ``_dequant_tile``: ``(even, odd, block part)``: fp32 values
    (KIND 0); element codes [BV, KH] (1, 2; block part 0); NVFP4 (3): the element values on
    the E2M1 grid [BV, NB, BLK // 2] (+0.0 in blocks whose scale is 0 or NaN, as their code
    0 decodes) and the element scales s_b s_g [BV, NB] (NaN for a block with a NaN or inf),
    the operands ``_load_stored``'s decode multiplies; MX (4): element codes
    [BV, NB, BLK // 2] and the E8M0 block scale codes [BV, NB]."""
    j = tl.arange(0, KH)
    kk = tl.arange(0, K)
    rowg = mat * V + rows.to(tl.int64)
    m2 = rmask[:, None]
    if C.KIND == 0:
        x = tl.reshape(tl.join(xe, xo), [BV, K])
        tl.store(out_ptr + rowg[:, None] * K + kk[None, :], x, mask=m2)
        r0, r1, r2 = xe, xo, 0
    else:
        if C.SR:
            if KEYED:
                lo, hi = _stream_words(key)
            else:
                lo, hi = _stream_words(tl.load(st_ptr + mat))
            re, ro = _random_pairs(seed, rows, lo, hi, K, KH, BV)
        else:
            re = 0
            ro = 0
        if C.KIND <= 2:  # one code per element: half formats (bit patterns), fp8 (matrix scale)
            ye = xe
            yo = xo
            if C.KIND == 2:
                ye = tl.where(xe != xe, xe, tl.math.div_rn(xe, tl.broadcast_to(s_mat, [BV, KH])))
                yo = tl.where(xo != xo, xo, tl.math.div_rn(xo, tl.broadcast_to(s_mat, [BV, KH])))
            _, ce = _quant(ye, re, C.SR, C)
            _, co = _quant(yo, ro, C.SR, C)
            c = tl.reshape(tl.join(ce, co), [BV, K])
            if C.KIND == 1:
                tl.store(out_ptr + rowg[:, None] * K + kk[None, :], c.to(tl.int16), mask=m2)
            else:
                tl.store(out_ptr + rowg[:, None] * K + kk[None, :], c.to(tl.uint8), mask=m2)
            r0, r1, r2 = ce, co, 0
        if C.KIND >= 3:
            NB: tl.constexpr = K // C.BLK
            HB: tl.constexpr = C.BLK // 2
            xe3 = tl.reshape(xe, [BV, NB, HB])
            xo3 = tl.reshape(xo, [BV, NB, HB])
            bamax = tl.maximum(tl.max(_finite_abs(xe3), axis=2), tl.max(_finite_abs(xo3), axis=2))
            fin = tl.minimum(tl.min((tl.abs(xe3) < float("inf")).to(tl.int32), axis=2),
                             tl.min((tl.abs(xo3) < float("inf")).to(tl.int32), axis=2))
            bad = fin < 1  # a NaN or inf in the block
            scale, safe, ok, sb_code = _block_scale(bamax, bad, s_mat, C.KIND == 3, C.EMAX,
                                                    C.SCALE, C.THR)
            safe3 = tl.broadcast_to(safe[:, :, None], [BV, NB, HB])
            ye = tl.math.div_rn(xe3, safe3)
            yo = tl.math.div_rn(xo3, safe3)
            if C.SR:
                re = tl.reshape(re, [BV, NB, HB])
                ro = tl.reshape(ro, [BV, NB, HB])
            if C.KIND == 3 and not C.SR:  # in the blocks kept (ok) ye, yo are finite
                ve, ce = _e2m1_rtn(ye)
                vo, co = _e2m1_rtn(yo)
            else:
                ve, ce = _quant(ye, re, C.SR, C)
                vo, co = _quant(yo, ro, C.SR, C)
            if C.KIND == 3:
                # a block with scale 0 keeps only the signs (+-0); a bad block's codes are 0
                # (E2M1 has no NaN: its scale code marks it)
                ce = tl.where(ok[:, :, None], ce, tl.where(bad[:, :, None], 0, ce & 8))
                co = tl.where(ok[:, :, None], co, tl.where(bad[:, :, None], 0, co & 8))
            else:
                ce = tl.where(bad[:, :, None], C.NAN_POS, ce)
                co = tl.where(bad[:, :, None], C.NAN_POS, co)
            nbi = tl.arange(0, NB)
            tl.store(bs_ptr + rowg[:, None] * NB + nbi[None, :], sb_code.to(tl.uint8), mask=m2)
            if C.FP4:
                byte = tl.reshape((ce | (co << 4)).to(tl.uint8), [BV, KH])
                tl.store(out_ptr + rowg[:, None] * KH + j[None, :], byte, mask=m2)
            else:
                c = tl.reshape(tl.join(ce, co), [BV, K]).to(tl.uint8)
                tl.store(out_ptr + rowg[:, None] * K + kk[None, :], c, mask=m2)
            if C.KIND == 3:  # the values of the codes just stored (codes 0 / 8 are +-0.0)
                # and the element scale s_b s_g (NaN for a bad block), so no decode is needed
                r0 = tl.where(ok[:, :, None], ve, _signed_zero(ce))
                r1 = tl.where(ok[:, :, None], vo, _signed_zero(co))
                r2 = scale
            else:
                r0, r1, r2 = ce, co, sb_code
    return r0, r1, r2


@triton.jit
def _load_full(c_ptr, bs_ptr, ms_ptr, mat, rows, rmask, V, K: tl.constexpr, KH: tl.constexpr,
               BV: tl.constexpr, D: tl.constexpr):
    """Rows ``rows`` of a stored copy (``D``: its :class:`DecodeConsts`) as one dequantised
    tile ``[BV, K]`` in column order. FP32 and half copies are loaded as the tile (no even/odd
    split, so no shuffle of registers); other formats through :func:`_load_stored`, joined."""
    if D.KIND <= 1 and not D.FP4:
        kk = tl.arange(0, K)
        x = tl.load(c_ptr + (mat * V + rows.to(tl.int64))[:, None] * K + kk[None, :],
                    mask=rmask[:, None], other=0).to(tl.float32)
    else:
        xe, xo = _load_stored(c_ptr, bs_ptr, ms_ptr, mat, rows, rmask, V, K, KH, BV, D)
        x = tl.reshape(tl.join(xe, xo), [BV, K])
    return x


@triton.jit
def _cast_store_full(x, rows, rmask, mat, V, s_mat, seed, st_ptr, out_ptr, bs_ptr,
                     K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                     key=0, KEYED: tl.constexpr = False):
    """:func:`_cast_store` of a tile ``x [BV, K]`` in column order: the same codes and SR bits
    (element ``(row, col)`` draws the bits of index ``row * K + col`` either way). Formats with
    one code per element (fp32, half, fp8) are rounded and stored as the tile; block formats
    (nvfp4, mx) split it into the even/odd halves their nibbles and blocks need."""
    if C.KIND >= 3:
        xe, xo = _split_halves(x, BV, KH)
        _cast_store(xe, xo, rows, rmask, mat, V, s_mat, seed, st_ptr, out_ptr, bs_ptr, K, KH,
                    BV, C, key, KEYED)
    else:
        kk = tl.arange(0, K)
        off = (mat * V + rows.to(tl.int64))[:, None] * K + kk[None, :]
        m2 = rmask[:, None]
        if C.KIND == 0:
            tl.store(out_ptr + off, x, mask=m2)
        else:
            r = 0
            if C.SR:
                if KEYED:
                    lo, hi = _stream_words(key)
                else:
                    lo, hi = _stream_words(tl.load(st_ptr + mat))
                r = _random_tile(seed, rows, lo, hi, K, BV)
            y = x
            if C.KIND == 2:
                y = tl.where(x != x, x, tl.math.div_rn(x, tl.broadcast_to(s_mat, [BV, K])))
            _, c = _quant(y, r, C.SR, C)
            if C.KIND == 1:
                tl.store(out_ptr + off, c.to(tl.int16), mask=m2)
            else:
                tl.store(out_ptr + off, c.to(tl.uint8), mask=m2)


@triton.jit
def _dequant_tile(ce, co, sbc, s_mat, BV: tl.constexpr, KH: tl.constexpr, D: tl.constexpr):
    """The values ``_load_stored`` would read back (with ``D`` the copy's
    :class:`DecodeConsts`) from what ``_cast_store`` just stored (its return value; ``s_mat``
    the matrix scale it stored): the same integer decode and the same FP32 multiplications,
    without the round trip through memory; NVFP4 multiplies the element values by the element
    scales ``_cast_store`` returns (bit for bit the decoded codes times the decoded block scale
    times s_g, NaN blocks included). (even, odd) [BV, KH]."""
    if D.KIND == 0:
        e = ce
        o = co
    if D.KIND == 1:
        if D.BF16:
            e = ce.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
            o = co.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        else:
            e = ce.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            o = co.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if D.KIND == 2:
        e = _decode_code(ce.to(tl.uint8), D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF) * s_mat
        o = _decode_code(co.to(tl.uint8), D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF) * s_mat
    if D.KIND == 3:  # values and element scales (see _cast_store): the decode's product
        e = tl.reshape(ce * sbc[:, :, None], [BV, KH])
        o = tl.reshape(co * sbc[:, :, None], [BV, KH])
    if D.KIND == 4:
        if D.FP4:  # the byte as stored: even element in the low nibble
            byte = (ce | (co << 4)).to(tl.uint8).to(tl.int32)
            e3 = _decode_code(byte & 15, D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
            o3 = _decode_code(byte >> 4, D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
        else:
            e3 = _decode_code(ce.to(tl.uint8), D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
            o3 = _decode_code(co.to(tl.uint8), D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
        scale = _e8m0_value(sbc.to(tl.uint8).to(tl.int32))
        e = tl.reshape(e3 * scale[:, :, None], [BV, KH])
        o = tl.reshape(o3 * scale[:, :, None], [BV, KH])
    return e, o


# ----------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------


def kernels_supported(key_dim: int, dtype: torch.dtype) -> bool:
    """Shapes/dtypes the kernels handle: float32, key dim a power of two >= 32."""
    return replay_kernels_supported(key_dim, dtype)


def _check_supported(key_dim: int, dtype) -> None:
    if not kernels_supported(key_dim, dtype):
        raise ValueError(f"replay kernels need float32 and a key dim that is a power of two "
                         f">= 32, got {dtype} and K={key_dim}")


# Whether this package's kernels run under the Triton interpreter: triton.jit chooses when it
# decorates them (this module's import), so TRITON_INTERPRET set later does not apply to them.
KERNELS_INTERPRETED = triton_interpreting()


def _check_maxnreg(name: str, maxnreg):
    """``maxnreg`` if it is None or an int in [16, 255] (a per-thread register cap), else
    ValueError naming ``name`` and the value."""
    if maxnreg is None or (isinstance(maxnreg, int) and not isinstance(maxnreg, bool)
                           and 16 <= maxnreg <= 255):
        return maxnreg
    raise ValueError(f"{name} must be None or an int in [16, 255], got {maxnreg!r}")


def _maxnreg_launch(maxnreg: int | None) -> dict:
    """Launch keyword of a per-thread register cap (ptxas ``maxrregcount``), where one is
    given and the launch compiles for a GPU (the interpreter has no registers). A cap changes
    the register allocation only, never the arithmetic: the same bits."""
    return {} if maxnreg is None or KERNELS_INTERPRETED else {"maxnreg": maxnreg}


def _check_devices(where: str, **tensors) -> None:
    """Raise ValueError unless the named inputs are on one device and that device can run the
    Triton kernels: CUDA, or any device when they were decorated under the Triton interpreter
    (``TRITON_INTERPRET=1`` at import, :data:`KERNELS_INTERPRETED`). An input is a tensor, a
    PackedTensor (its codes, block scales and matrix scale) or a dict of tensors (a ring,
    named ``name['key']``); None and Python ints are skipped. Without this check Triton's own
    message for a CPU tensor names neither the input nor the fix (for a variable set after the
    import: "0 active drivers"). Called on every decode step, so the names are built only when
    something is wrong."""
    devs = set()
    for t in tensors.values():
        for x in _parts(t):
            devs.add(x.device)
    if len(devs) <= 1 and (KERNELS_INTERPRETED or not devs or next(iter(devs)).type == "cuda"):
        return
    items = [(f"{n}{sub}", x) for n, t in tensors.items() for sub, x in _named_parts(t)]
    first, t0 = items[0]
    dev = t0.device
    if dev.type != "cuda" and not KERNELS_INTERPRETED:
        late = ("; TRITON_INTERPRET is set now, but was not when the kernels were imported "
                "(set it in the shell)" if triton_interpreting() else "")
        raise ValueError(f"{where}: {first} is on {dev}; the replay kernels run on CUDA devices "
                         f"(or on the CPU under the Triton interpreter: TRITON_INTERPRET=1 set "
                         f"before replayssm_quant is imported){late}")
    for n, t in items[1:]:
        if t.device != dev:
            raise ValueError(f"{where}: {n} is on {t.device}, expected {dev} (the device of "
                             f"{first})")


def _named_parts(t) -> list:
    """``(suffix, tensor)`` of the tensors one input of :func:`_check_devices` holds."""
    if isinstance(t, PackedTensor):
        parts = [("", t.codes), (".block_scales", t.block_scales),
                 (".matrix_scale", t.matrix_scale)]
    elif isinstance(t, dict):
        parts = [(f"[{k!r}]", x) for k, x in t.items()]
    else:
        parts = [("", t)]
    return [(sub, x) for sub, x in parts if isinstance(x, torch.Tensor)]


def _parts(t):
    """The tensors one input of :func:`_check_devices` holds (no names: its fast path)."""
    if isinstance(t, torch.Tensor):
        return (t,)
    if isinstance(t, dict):
        return t.values()
    return [x for _, x in _named_parts(t)]


def _check_f32(where: str, name: str, t, shape) -> None:
    """Raise ValueError unless ``t`` is a float32 tensor of ``shape`` (the kernels index their
    inputs by the shapes derived from the state; a wrong extent would read out of bounds)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype != torch.float32:
        raise ValueError(f"{where}: {name} has dtype {t.dtype}, expected torch.float32")


def _check_records(where: str, la, w, k, beta, B: int, H: int, V: int, K: int,
                   w_name: str = "v") -> tuple[int, int]:
    """The buffered records of a flush or verify against the state ``[B, H, V, K]``: float32
    ``la [B,J,H]``, ``w [B,J,H,V]``, grouped ``k [B,J,G,K]`` with G dividing H, and (GDN)
    ``beta [B,J,H]``. Returns ``(J, G)``; raises ValueError naming the input."""
    if not isinstance(la, torch.Tensor) or la.dim() != 3:
        raise ValueError(f"{where}: la must be a [B, J, H] tensor, got "
                         f"{getattr(la, 'shape', type(la).__name__)}")
    J = la.shape[1]
    G = k.shape[2] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    if G < 1 or H % G:
        raise ValueError(f"{where}: k must be [B, J, G, K] with G dividing H = {H}, got "
                         f"{getattr(k, 'shape', type(k).__name__)}")
    for name, t, shape in (("la", la, (B, J, H)), (w_name, w, (B, J, H, V)),
                           ("k", k, (B, J, G, K))):
        _check_f32(where, name, t, shape)
    if beta is not None:
        _check_f32(where, "beta", beta, (B, J, H))
    return J, G


def _check_index(where: str, name: str, t, B: int, allow_scalar: bool = False) -> None:
    """Raise ValueError unless ``t`` is an integer tensor of ``B`` elements (or 1 element, or a
    Python int, with ``allow_scalar``)."""
    if allow_scalar and isinstance(t, int) and not isinstance(t, bool):
        return
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{where}: {name} must be an integer tensor of {B} elements, got "
                         f"{t if not isinstance(t, torch.Tensor) else t.dtype}")
    if t.numel() != B and not (allow_scalar and t.numel() == 1):
        raise ValueError(f"{where}: {name} has {t.numel()} elements, expected {B} (the batch)"
                         + (" or 1" if allow_scalar else ""))


@triton.jit
def _range_load(p, i, m, lo, hi, ON: tl.constexpr):
    """1 where element ``i`` of ``p`` lies outside ``[lo, hi]`` (0 where masked or not ``ON``)."""
    if ON:
        x = tl.load(p + i, mask=m, other=0).to(tl.int64)
        return (((x < lo) | (x > hi)) & m).to(tl.int32)
    return tl.zeros_like(i)


@triton.jit
def _range_check_kernel(ok_ptr, a_ptr, a_lo, a_hi, b_ptr, b_lo, b_hi, c_ptr, c_lo, c_hi, n,
                        NA: tl.constexpr, NB: tl.constexpr, NC: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One program: ``ok = all(a in [a_lo, a_hi]) and (b ...) and (c ...)`` over ``n``
    elements each (integers, compared as int64); stores the bool into ``ok_ptr``."""
    bad = tl.zeros([BLOCK], tl.int32)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        bad |= _range_load(a_ptr, i, m, a_lo, a_hi, NA)
        bad |= _range_load(b_ptr, i, m, b_lo, b_hi, NB)
        bad |= _range_load(c_ptr, i, m, c_lo, c_hi, NC)
    tl.store(ok_ptr, tl.max(bad, axis=0) == 0)


def _assert_ranges(msg: str, *checks) -> None:
    """Device-side range check of per-sequence integer tensors, without a host sync:
    ``checks`` are up to three ``(t, lo, hi)`` with ``t`` an integer tensor of ``n`` elements
    (the same ``n`` for all) on one device and ``lo <= t <= hi`` required element-wise (Python
    ints, within int64). One Triton launch forms the bool, then ``torch._assert_async(ok, msg)``
    raises RuntimeError with ``msg`` at once on the CPU (interpreter) and at the next
    synchronisation on CUDA (a device-side assertion). Two launches instead of one torch
    kernel per comparison and reduction (about 1-2 us each on the H100 at B = 256).

    Raises:
        ValueError: no checks or more than three, tensors of different sizes or devices, or
            ``lo > hi`` (naming them)."""
    if not 1 <= len(checks) <= 3:
        raise ValueError(f"_assert_ranges takes 1 to 3 (tensor, lo, hi) checks, got "
                         f"{len(checks)}")
    ts = [c[0].reshape(-1) for c in checks]
    n = ts[0].numel()
    dev = ts[0].device
    for (t, lo, hi), tt in zip(checks, ts, strict=True):
        if tt.numel() != n or tt.device != dev:
            raise ValueError(f"_assert_ranges: every tensor needs {n} elements on {dev}, got "
                             f"{tt.numel()} on {tt.device}")
        if int(lo) > int(hi):
            raise ValueError(f"_assert_ranges: empty range [{lo}, {hi}]")
    ok = torch.empty((), dtype=torch.bool, device=dev)
    args = []
    for j in range(3):
        if j < len(checks):
            args += [ts[j].contiguous(), int(checks[j][1]), int(checks[j][2])]
        else:
            args += [ts[0], 0, 0]
    _range_check_kernel[(1,)](ok, *args, n, NA=True, NB=len(checks) > 1, NC=len(checks) > 2,
                              BLOCK=256, num_warps=4)
    torch._assert_async(ok, msg)


def _stored_args(stored) -> tuple[tuple, QuantSpec]:
    """(pointer tensors, spec) of a stored copy: a PackedTensor or an FP32 tensor, each
    buffer contiguous (a copy where it is not: the kernels index the buffers as dense
    row-major arrays, so a strided view, such as codes transposed and back, would otherwise
    be read in the wrong order)."""
    if isinstance(stored, PackedTensor):
        codes = stored.codes.contiguous()
        bs = stored.block_scales.contiguous() if stored.block_scales is not None else codes
        ms = stored.matrix_scale.contiguous() if stored.matrix_scale is not None else codes
        return (codes, bs, ms), stored.spec
    if stored.dtype != torch.float32:
        raise ValueError(f"a stored FP32 copy must be float32, got {stored.dtype}")
    return (stored.contiguous(), stored, stored), parse_spec("fp32")


def _alloc_copy(spec: QuantSpec, shape, device):
    """Output buffers (codes, block scales, matrix scale) of a copy in ``spec``."""
    B, H, V, K = shape
    info = spec.info
    kind = _kind(spec)
    if kind == _K_FLOAT:
        return torch.empty(shape, dtype=torch.float32, device=device), None, None
    if kind == _K_HALF:
        return torch.empty(shape, dtype=torch.int16, device=device), None, None
    ms = torch.empty(B, H, dtype=torch.float32, device=device)
    if kind == _K_MATRIX:
        return torch.empty(shape, dtype=torch.uint8, device=device), None, ms
    fp4 = info.element is F.E2M1
    codes = torch.empty(B, H, V, K // 2 if fp4 else K, dtype=torch.uint8, device=device)
    bs = torch.empty(B, H, V, K // info.block, dtype=torch.uint8, device=device)
    return codes, bs, (ms if kind == _K_NVFP4 else None)


def _typed_codes(spec: QuantSpec, codes: torch.Tensor) -> torch.Tensor:
    """The codes buffer of a copy as its kernels decode it: half formats' int16 codes viewed
    as bf16 / fp16 (the same bytes), every other format as allocated."""
    if _kind(spec) == _K_HALF:
        return codes.view(torch.bfloat16 if spec.info.element is F.BF16 else torch.float16)
    return codes


def _as_stored(spec: QuantSpec, shape, bufs):
    codes, bs, ms = bufs
    if spec.is_identity:
        return codes
    return PackedTensor(spec, torch.Size(shape), _typed_codes(spec, codes), bs, ms)


# ----------------------------------------------------------------------------------------
# fast element decoders (the records kernel's hot loop; equal to ``_decode_code`` code by code,
# tests/test_replay_kernels.py::test_fast_decoders)
# ----------------------------------------------------------------------------------------


@triton.jit
def _e2m1_value(code):
    """Float32 value of E2M1 codes (low 4 bits of ``code``; the E2M1 table, sign bit 3): the
    magnitude m = code & 7 is 0.5 * m below 2 (zero, subnormal 0.5) and otherwise the float with
    bits ``(m << 22) + (126 << 23)`` (exponent m >> 1, mantissa m & 1). Integer ops only."""
    c = code.to(tl.int32)
    m = c & 7
    bits = tl.where(m >= 2, (m << 22) + (126 << 23), m * (126 << 23))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


# E2M1 by table lookup: the float32 bits of the eight E2M1 magnitudes m (0, 0.5, 1, 1.5, 2, 3,
# 4, 6) are ``HB[m] << 24 | NB[m] << 16`` (the low 16 bits are zero); ``prmt`` (byte permute)
# with the magnitudes as its selector nibbles looks up four bytes at once from an eight-byte
# table held in two registers.
_E2M1_HB = (0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40)  # bits 31..24 of the float32
_E2M1_NB = (0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0)  # bits 23..16


def _table_words(t) -> tuple[str, str]:
    lo = sum(b << (8 * i) for i, b in enumerate(t[:4]))
    hi = sum(b << (8 * i) for i, b in enumerate(t[4:]))
    return f"0x{lo:08X}", f"0x{hi:08X}"


_HB_LO, _HB_HI = _table_words(_E2M1_HB)
_NB_LO, _NB_HI = _table_words(_E2M1_NB)
# PTX for four bytes (eight codes) per invocation: $8 holds the bytes b0..b3 (b0 lowest), so its
# nibbles in order are the codes even0, odd0, even1, odd1 (bytes 0, 1: group a, the low 16 bits)
# and even2, odd2, even3, odd3 (bytes 2, 3: group b, the high 16 bits). Per group: the magnitude
# selectors (sign bits cleared), the two table lookups, the sign bytes (prmt's sign-replicate
# mode: a selector nibble with bit 3 set gives 0xFF from a 0x80 byte, else 0x80; bit 0 moved to
# bit 7 of each byte and or'ed into the high bytes), then the (NB, HB) byte pairs interleaved
# two codes per word and split into float32 words. Outputs: $0..$3 the even (low-nibble) codes
# of b0..b3, $4..$7 the odd (high-nibble) codes.
_E2M1_PAIRS_PTX = tl.constexpr(f"""{{
.reg .b32 w<2>, m<2>, h<2>, n<2>, s<2>, p<4>, thl, thh, tnl, tnh, t80;
mov.b32 thl, {_HB_LO};
mov.b32 thh, {_HB_HI};
mov.b32 tnl, {_NB_LO};
mov.b32 tnh, {_NB_HI};
mov.b32 t80, 0x80808080;
mov.b32 w0, $8;
shr.u32 w1, $8, 16;
and.b32 m0, w0, 0x7777;
and.b32 m1, w1, 0x7777;
prmt.b32 h0, thl, thh, m0;
prmt.b32 h1, thl, thh, m1;
prmt.b32 n0, tnl, tnh, m0;
prmt.b32 n1, tnl, tnh, m1;
prmt.b32 s0, t80, t80, w0;
prmt.b32 s1, t80, t80, w1;
shl.b32 s0, s0, 7;
shl.b32 s1, s1, 7;
and.b32 s0, s0, 0x80808080;
and.b32 s1, s1, 0x80808080;
or.b32 h0, h0, s0;
or.b32 h1, h1, s1;
prmt.b32 p0, n0, h0, 0x5140;
prmt.b32 p1, n0, h0, 0x7362;
prmt.b32 p2, n1, h1, 0x5140;
prmt.b32 p3, n1, h1, 0x7362;
shl.b32 $0, p0, 16;
shl.b32 $1, p1, 16;
shl.b32 $2, p2, 16;
shl.b32 $3, p3, 16;
and.b32 $4, p0, 0xFFFF0000;
and.b32 $5, p1, 0xFFFF0000;
and.b32 $6, p2, 0xFFFF0000;
and.b32 $7, p3, 0xFFFF0000;
}}""")


@triton.jit
def _e2m1_pairs_lut(byte):
    """Float32 values ``(even, odd)`` of packed E2M1 bytes (``byte``: uint8 codes, the low
    nibble the even element, as ``_c_blocks`` loads them): the same values, bit for bit, as
    ``_e2m1_value(byte)`` and ``_e2m1_value(byte >> 4)`` (signed zeros included;
    tests/test_replay_kernels.py::test_e2m1_pair_decoders and
    test_e2m1_lookup_same_bits_in_kernels on CUDA), by byte-permute table
    lookups four bytes per invocation (about 3 instructions per code instead of about 8).
    Inline PTX: CUDA only (the interpreter cannot run it; records_outputs then takes the
    integer decoder)."""
    tl.static_assert(byte.dtype == tl.uint8, "_e2m1_pairs_lut packs four uint8 bytes per register")
    return tl.inline_asm_elementwise(_E2M1_PAIRS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


# E2M1 as packed half precision: a code's magnitude bits (e1 e0 m) placed at bits 11..9 of a
# float16 and its sign at bit 15 give the float16 whose value is the E2M1 value times 2^-14,
# exactly (exponent field e, mantissa's top bit m: 2^(e-15) (1 + m/2) for e >= 1, and the
# subnormal m 2^-15 for e = 0). Two codes 16 bits apart in the packed word become one
# float16 pair with two shifts, one mask and one three-input logic op (lop3: (a & M) | c,
# truth table 0xEA), then two conversions to float32. $8 holds bytes b0..b3, so the nibbles
# at bit offsets o and o + 16 (o = 0, 4, 8, 12 within each half) are the codes (even0, even2),
# (odd0, odd2), (even1, even3), (odd1, odd3). Outputs: $0..$3 the even codes of b0..b3, $4..$7
# the odd codes, each the E2M1 value times 2^-14 as float32.
_E2M1_HALF_PAIRS = """\
mov.b32 mm, 0x0E000E00;
shl.b32 a0, {src}, 9;
shl.b32 a1, {src}, 5;
shl.b32 a2, {src}, 1;
shr.u32 a3, {src}, 3;
shl.b32 c0, {src}, 12;
shl.b32 c1, {src}, 8;
shl.b32 c2, {src}, 4;
and.b32 c0, c0, 0x80008000;
and.b32 c1, c1, 0x80008000;
and.b32 c2, c2, 0x80008000;
and.b32 c3, {src}, 0x80008000;
lop3.b32 r0, a0, mm, c0, 0xEA;
lop3.b32 r1, a1, mm, c1, 0xEA;
lop3.b32 r2, a2, mm, c2, 0xEA;
lop3.b32 r3, a3, mm, c3, 0xEA;
"""  # r0..r3: the code pairs of the word {src} (both half decoders)
_E2M1_HALF_PTX = tl.constexpr("{\n.reg .b32 a<4>, c<4>, r<4>, mm;\n.reg .b16 h<8>;\n"
                              + _E2M1_HALF_PAIRS.format(src="$8") + """\
mov.b32 {h0, h1}, r0;
mov.b32 {h2, h3}, r1;
mov.b32 {h4, h5}, r2;
mov.b32 {h6, h7}, r3;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $2, h1;
cvt.f32.f16 $4, h2;
cvt.f32.f16 $6, h3;
cvt.f32.f16 $1, h4;
cvt.f32.f16 $3, h5;
cvt.f32.f16 $5, h6;
cvt.f32.f16 $7, h7;
}""")
E2M1_HALF_SCALE = tl.constexpr(16384.0)  # 2^14: what _e2m1_pairs_half's values are to be multiplied by


@triton.jit
def _e2m1_pairs_half(byte):
    """Float32 values ``(even, odd)`` of packed E2M1 bytes times 2^-14 (``byte``: uint8 codes,
    the low nibble the even element, as ``_c_blocks`` loads them): the values of
    ``_e2m1_value(byte)`` and ``_e2m1_value(byte >> 4)`` times 2^-14 exactly (signed zeros
    included), by float16 pairs built with shifts and masks, about 2.9 instructions per code
    (``_e2m1_pairs_lut``: about 4.6). The caller folds 2^14 into the block scale (nvfp4's E4M3
    scale times 2^14 is exact); products and sums then scale exactly by 2^-14, so the results
    are those of the other decoders as long as no product falls below 2^-112 in magnitude.
    Inline PTX: CUDA only; ``tests/test_replay_kernels.py::test_e2m1_half_ptx_emulated``
    runs the PTX text through a Python emulation of its instructions for every byte."""
    tl.static_assert(byte.dtype == tl.uint8, "_e2m1_pairs_half packs four uint8 bytes per register")
    return tl.inline_asm_elementwise(_E2M1_HALF_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=4)


# The same codes as float16 pairs for tensor-core products (records_outputs(use_dot="f16x3")):
# the four lop3 results of _E2M1_HALF_PAIRS hold the code pairs (even0, even2), (odd0, odd2),
# (even1, even3), (odd1, odd3); two byte permutes per pair of words put them in element order.
# Outputs (two float16 per register, element 0 in the low half, as Triton packs them): $0 the
# even codes of b0, b1, $1 of b2, b3, $2 the odd codes of b0, b1, $3 of b2, b3; input $4.
_E2M1_HALF16_PTX = tl.constexpr("{\n.reg .b32 a<4>, c<4>, r<4>, mm;\n"
                                + _E2M1_HALF_PAIRS.format(src="$4") + """\
prmt.b32 $0, r0, r2, 0x5410;
prmt.b32 $1, r0, r2, 0x7632;
prmt.b32 $2, r1, r3, 0x5410;
prmt.b32 $3, r1, r3, 0x7632;
}""")


@triton.jit
def _e2m1_pairs_half16(byte):
    """Float16 values ``(even, odd)`` of packed E2M1 bytes times 2^-14 (``byte``: uint8 codes,
    the low nibble the even element): the float16 values whose float32 conversions
    ``_e2m1_pairs_half`` returns, exactly, without the conversion (about 2.4 instructions per
    code), for the float16 tensor-core products (``records._c_blocks_f16``). Inline PTX: CUDA
    only; ``tests/test_replay_kernels.py::test_e2m1_half_ptx_emulated`` runs its PTX through
    the emulation too."""
    tl.static_assert(byte.dtype == tl.uint8, "_e2m1_pairs_half16 packs four uint8 bytes per register")
    return tl.inline_asm_elementwise(_E2M1_HALF16_PTX, "=r,=r,=r,=r,r", [byte],
                                     dtype=(tl.float16, tl.float16), is_pure=True, pack=4)


# Eight E2M1 codes of a 32-bit word times eight float32 values per vector, summed (the lean
# nvfp4 read pass, records._nvfp4_read_kernel): the packed-half pairs of _E2M1_HALF_PAIRS
# (r0 = codes (0, 4) of the word, r1 = (1, 5), r2 = (2, 6), r3 = (3, 7), code k being nibble k,
# the low nibble of byte k // 2 for even k), converted to float32, then one FMA chain per
# vector in code order: out_c = sum_k value_k x_c[k], each value the E2M1 value times 2^-14.
# Inputs: $NC the word, then x_0[0..7], x_1[0..7], ...; outputs $0..$NC-1.
def _e2m1_dot8_text(nc: int) -> str:
    """The PTX of ``_e2m1_dot8`` for ``nc`` vectors (see the comment above)."""
    lines = ["{", ".reg .b32 a<4>, c<4>, r<4>, mm;", ".reg .b16 h<8>;", ".reg .f32 f<8>;",
             _E2M1_HALF_PAIRS.format(src=f"${nc}").rstrip("\n")]
    lines += [f"mov.b32 {{h{j}, h{j + 4}}}, r{j};" for j in range(4)]
    lines += [f"cvt.f32.f16 f{k}, h{k};" for k in range(8)]
    for c in range(nc):
        x0 = nc + 1 + 8 * c
        lines.append(f"mul.rn.f32 ${c}, f0, ${x0};")
        lines += [f"fma.rn.f32 ${c}, f{k}, ${x0 + k}, ${c};" for k in range(1, 8)]
    return "\n".join(lines + ["}"])


_E2M1_DOT8_1_PTX = tl.constexpr(_e2m1_dot8_text(1))
_E2M1_DOT8_2_PTX = tl.constexpr(_e2m1_dot8_text(2))


@triton.jit
def _e2m1_dot8_1(word, x0, x1, x2, x3, x4, x5, x6, x7):
    """``sum_k e_k x_k`` over the eight E2M1 codes of each int32 ``word`` (code k = nibble k,
    so code 0 is the low nibble of the word's first byte in memory), each ``e_k`` the code's
    value times 2^-14 (exact: the packed-half decoder of ``_e2m1_pairs_half``), float32
    products summed in code order by FMA. About 4 instructions per code. Inline PTX: CUDA
    only; ``tests/test_replay_kernels.py::test_e2m1_dot8_ptx_emulated`` runs its PTX
    through an emulation."""
    tl.static_assert(word.dtype == tl.int32, "_e2m1_dot8_1 takes int32 words of 8 codes")
    return tl.inline_asm_elementwise(_E2M1_DOT8_1_PTX, "=r,r" + ",r" * 8,
                                     [word, x0, x1, x2, x3, x4, x5, x6, x7],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _e2m1_dot8_2(word, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7):
    """``_e2m1_dot8_1`` for two vectors ``x`` and ``y`` at once (one decode): returns
    ``(sum_k e_k x_k, sum_k e_k y_k)``. About 5 instructions per code. Inline PTX: CUDA only."""
    tl.static_assert(word.dtype == tl.int32, "_e2m1_dot8_2 takes int32 words of 8 codes")
    return tl.inline_asm_elementwise(_E2M1_DOT8_2_PTX, "=r,=r,r" + ",r" * 16,
                                     [word, x0, x1, x2, x3, x4, x5, x6, x7,
                                      y0, y1, y2, y3, y4, y5, y6, y7],
                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


# E2M1 codes times integers, summed exactly (the integer-dot read pass,
# records._nvfp4_read_kernel with IDOT): each code's value times 2 is the integer 0, 1, 2, 3,
# 4, 6, 8 or 12 with its sign (s_k); each vector element is a 24-bit signed integer X = X0
# 2^16 + U1 2^8 + U2 held as three limbs, X0 a signed byte and U1, U2 unsigned bytes, four
# elements per 32-bit register (byte i the element of code i of the four). The byte permute
# (prmt, default mode) looks four codes up at once in the table of the doubled magnitudes
# (bytes 0, 1, 2, 3, 4, 6, 8, 12): a code with its sign bit set gives 0x00 (the selector's top
# bit replicates the picked byte's sign bit, 0), so one lookup with the word gives the
# positive codes' magnitudes P and one with the sign bits flipped the negative codes' N, and
# P + 0x80808080 - N (one three-input add; no byte borrows) holds the biased bytes t_k = 128 +
# s_k. Then per vector and limb one dp4a chain over the groups of four codes, and the limbs'
# sums combined as A0 2^16 + A1 2^8 + A2: sum_k t_k X_k = sum_k s_k X_k + 128 sum_k X_k
# modulo 2^32 (the caller takes away the second term per block of 16 codes, after which the
# sum, at most 16 x 12 x 2^22 = 2^29.6 in magnitude, is exact).
@triton.jit
def _idot4_int(word, sh: tl.constexpr, a, b, c):
    """``sum_{i<4} (2 e_i + 128) X_i`` modulo 2^32 for the four codes at nibbles ``sh/4 ..
    sh/4 + 3`` of ``word`` and the limb registers ``a`` (signed top bytes), ``b``, ``c``
    (unsigned bytes), in int32 Triton operations. The int32 wrap-around is intended (as
    dp4a's; the caller's bias subtraction makes the block's sum exact), so Triton's
    ``TRITON_DEBUG`` overflow checks would flag it."""
    acc = tl.zeros_like(word)
    for i in tl.static_range(4):
        code = (word >> (sh + 4 * i)) & 15
        t = (_e2m1_value(code) * 2.0).to(tl.int32) + 128  # 128 + (0, +-1, .., +-12): exact
        x = (((a << (24 - 8 * i)) >> 24) * 65536 + ((b >> (8 * i)) & 255) * 256
             + ((c >> (8 * i)) & 255))
        acc += t * x  # modulo 2^32, as dp4a's
    return acc


@triton.jit
def _e2m1_idot8_int(word, a0, a1, b0, b1, c0, c1):
    """``sum_k (2 e_k + 128) X_k`` modulo 2^32 (int32) over the eight E2M1 codes of each int32
    ``word`` (code k = nibble k) and the limbs ``a`` (signed top bytes of elements 0-3 and
    4-7), ``b``, ``c`` (unsigned middle and low bytes), in Triton operations (the
    interpreter, ``e2m1_decode="integer"``; ``_e2m1_idot16_int`` sums two)."""
    return _idot4_int(word, 0, a0, b0, c0) + _idot4_int(word, 16, a1, b1, c1)


# The PTX for a block of 16 codes (two words, $NC and $NC+1): the three limbs' dp4a chains
# run over the block's four groups of four codes each and are combined once per block by two
# multiply-adds (a form with one word per call shifted twice per word: 88 more static SASS
# instructions in Mamba-2's read pass). Inputs after the words: per vector c and limb l the
# four group registers (codes 0-3, 4-7 of the first word, 0-3, 4-7 of the second) at
# $(NC + 2 + 12 c + 4 l + g); outputs $0..$NC-1 (int32): sum_k (2 e_k + 128) X_k modulo 2^32
# over the 16 codes.
def _e2m1_idot16_text(nc: int) -> str:
    """The PTX of ``_e2m1_idot16`` for ``nc`` vectors (see the comment above)."""
    lines = ["{", ".reg .b32 t0, t1, fl, wn, wh, wnh, pl, nl, ph, nh, s<4>, a0, a1, a2, r;",
             "mov.b32 t0, 0x03020100;", "mov.b32 t1, 0x0C080604;", "mov.b32 fl, 0x80808080;"]
    for wi in range(2):
        w = f"${nc + wi}"
        lines += [f"xor.b32 wn, {w}, 0x88888888;", f"shr.u32 wh, {w}, 16;",
                  "shr.u32 wnh, wn, 16;",
                  f"prmt.b32 pl, t0, t1, {w};", "prmt.b32 nl, t0, t1, wn;",
                  "prmt.b32 ph, t0, t1, wh;", "prmt.b32 nh, t0, t1, wnh;",
                  f"add.u32 s{2 * wi}, pl, fl;", f"sub.u32 s{2 * wi}, s{2 * wi}, nl;",
                  f"add.u32 s{2 * wi + 1}, ph, fl;", f"sub.u32 s{2 * wi + 1}, s{2 * wi + 1}, nh;"]
    for c in range(nc):
        for limb in range(3):
            kind = "s32" if limb == 0 else "u32"
            regs = [f"${nc + 2 + 12 * c + 4 * limb + g}" for g in range(4)]
            lines.append(f"dp4a.u32.{kind} a{limb}, s0, {regs[0]}, 0;")
            lines += [f"dp4a.u32.{kind} a{limb}, s{g}, {regs[g]}, a{limb};" for g in (1, 2, 3)]
        lines += ["mad.lo.u32 r, a0, 256, a1;", f"mad.lo.u32 ${c}, r, 256, a2;"]
    return "\n".join(lines + ["}"])


_E2M1_IDOT16_1_PTX = tl.constexpr(_e2m1_idot16_text(1))
_E2M1_IDOT16_2_PTX = tl.constexpr(_e2m1_idot16_text(2))


@triton.jit
def _e2m1_idot16_1(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3):
    """``sum_k (2 e_k + 128) X_k`` modulo 2^32 (int32) over the 16 E2M1 codes of a scaling
    block held in the int32 words ``w0`` (codes 0-7) and ``w1`` (8-15), ``X_k`` the 24-bit
    integers of limbs ``a`` (signed top bytes), ``b``, ``c`` (unsigned middle and low
    bytes), four groups of four elements each (``a0`` elements 0-3, .., ``a3`` 12-15); the
    caller takes away ``128 sum_k X_k`` (the comments above). About 9 instructions per word
    for the decode and 6 dp4a per word and vector, plus 2 multiply-adds per block and vector.
    Inline PTX (prmt, dp4a): CUDA only; ``_e2m1_idot16_int`` is the same integer in Triton
    operations, and ``tests/test_replay_kernels.py::test_e2m1_idot16_ptx_emulated`` runs the
    PTX through an emulation."""
    tl.static_assert(w0.dtype == tl.int32, "_e2m1_idot16_1 takes int32 words of 8 codes")
    return tl.inline_asm_elementwise(_E2M1_IDOT16_1_PTX, "=r,r,r" + ",r" * 12,
                                     [w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _e2m1_idot16_2(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                   d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3):
    """``_e2m1_idot16_1`` for two vectors (limbs ``a, b, c`` and ``d, e, f``) at once (one
    decode): returns both int32 sums. Inline PTX: CUDA only."""
    tl.static_assert(w0.dtype == tl.int32, "_e2m1_idot16_2 takes int32 words of 8 codes")
    return tl.inline_asm_elementwise(_E2M1_IDOT16_2_PTX, "=r,=r,r,r" + ",r" * 24,
                                     [w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3,
                                      d0, d1, d2, d3, e0, e1, e2, e3, f0, f1, f2, f3],
                                     dtype=(tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _e2m1_idot16_int(w0, w1, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3):
    """``_e2m1_idot16_1`` without PTX (the interpreter, ``e2m1_decode="integer"``): the same
    integer modulo 2^32, so the same bits."""
    return (_e2m1_idot8_int(w0, a0, a1, b0, b1, c0, c1)
            + _e2m1_idot8_int(w1, a2, a3, b2, b3, c2, c3))


@triton.jit
def _e4m3_value(code):
    """Float32 value of OFP8 E4M3FN codes (low 8 bits; magnitude 0x7F is NaN, no inf): normal
    magnitudes m >= 8 have the float bits ``(m << 20) + (120 << 23)``, subnormals are
    ``m * 2^-9`` (m converted with the 2^23 magic-number add, no int-to-float instruction)."""
    c = code.to(tl.int32)
    m = c & 127
    nrm = ((m << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = ((m + 1258291200).to(tl.float32, bitcast=True) - 8388608.0) * 0.001953125
    val = tl.where(m >= 8, nrm, sub)
    val = (val.to(tl.int32, bitcast=True) | ((c & 128) << 24)).to(tl.float32, bitcast=True)
    return tl.where(m == 127, float("nan"), val)


@triton.jit
def _e4m3_value_f16(code):
    """``_e4m3_value`` by way of float16 (about half the integer operations): an E4M3FN code's
    magnitude bits placed at bits 13..7 of a float16 and its sign at bit 15 give the value
    times 2^-8 exactly (exponent field e: 2^(e - 15) (1 + m/8) for e >= 1, the subnormal
    (m/8) 2^-14 for e = 0), converted to float32 and times 2^8 (exact); magnitude 0x7F is
    NaN. The same values as ``_e4m3_value``, signed zeros included."""
    c = code.to(tl.int32)
    m = c & 127
    h = ((m << 7) | ((c & 128) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(m == 127, float("nan"), h.to(tl.float32) * 256.0)


# Four E4M3FN codes (the bytes of $4, byte i element i) to float32 by the hardware's
# conversion to float16 pairs (cvt.rn.f16x2.e4m3x2, sm_89 and later; exact: every E4M3 value,
# NaN included, is a float16), then each float16 to float32.
_E4M3X4_PTX = tl.constexpr("""{
.reg .b16 lo, hi, f0, f1, f2, f3;
.reg .b32 h01, h23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 h01, lo;
cvt.rn.f16x2.e4m3x2 h23, hi;
mov.b32 {f0, f1}, h01;
mov.b32 {f2, f3}, h23;
cvt.f32.f16 $0, f0;
cvt.f32.f16 $1, f1;
cvt.f32.f16 $2, f2;
cvt.f32.f16 $3, f3;
}""")


@triton.jit
def _e4m3_value_cvt(code):
    """``_e4m3_value`` of uint8 codes by the hardware conversion (inline PTX, CUDA sm_89+:
    four codes per invocation, about 2 instructions per code): the same values, NaN
    included. ``_e4m3_value_f16`` is the same values in Triton operations."""
    tl.static_assert(code.dtype == tl.uint8, "_e4m3_value_cvt packs four uint8 codes")
    return tl.inline_asm_elementwise(_E4M3X4_PTX, "=r,=r,=r,=r,r", [code], dtype=tl.float32,
                                     is_pure=True, pack=4)


@triton.jit
def _e5m2_value(code):
    """Float32 value of E5M2 codes (low 8 bits): the code is the high byte of the float16 with
    the same value (inf and NaN included), converted to float32."""
    c = code.to(tl.int32) & 255
    return (c << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
