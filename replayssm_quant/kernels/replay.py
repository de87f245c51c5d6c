"""Triton kernels of the ReplaySSM layer: decode step, verify, GDN correction solve, flush.

Each kernel has its torch reference in :mod:`replayssm_quant.replay` (``core.py``, ``mamba2.py``,
``gdn.py``); this module only re-states the maths where the kernel's order of operations
matters. ``tests/test_replay_kernels.py`` compares every kernel with its reference; the
design, the numbers measured on an H200 and the command are in ``docs/kernels-replay.md``.

Two kernels do all the work:

* ``_records_kernel`` -- everything that reads a checkpoint C plus buffer records in
  *output-only* form, one program per (sequence, head, tile of ``BV`` value rows):

  - outputs ``o_p = gamma_{1:p} (C q) + sum_{j<=p} gamma_{j+1:p} (k_j . q) w_j`` for
    ``TQ`` query positions ``p = os .. os + TQ - 1`` (decode step: ``TQ = 1``; verify: ``T``);
  - (GDN) the unit lower-triangular solve for the corrections of rows ``ss .. n - 1``
    ``u_p = beta_p (v_p - gamma_{1:p} C k_p) - sum_{i<p} beta_p gamma_{i+1:p} (k_i . k_p) u_i``
    with the rows before ``ss`` taken from the ring (the cached read-path corrections), i.e.
    :func:`core.solve_corrections` (step: one row against R; verify: T rows against R; flush:
    every row against the anchor A);
  - (decode step) the append: the new record is written into the ring in the same launch.

  Rows are separable along the value axis (``C k``, ``C q`` and every ``u``/``w`` are per value
  row), so a program never needs another program's rows and S is never formed. The records of
  a program (``la``, ``k`` of up to ``LP`` slots, ``w`` of its rows) are held in registers.
  C is held as scaling blocks ``[BV, K / block, block]`` (FP4: the even and the odd element of
  each block in two tensors, as the nibbles hold them) and each block's scale multiplies the
  block's partial dot product, not every element (an output-only reassociation).

* ``_flush_kernel`` -- one program per (sequence, head) matrix: reconstruct
  ``S = gamma_{1:J} A + sum_j gamma_{j+1:J} w_j k_j^T`` tile by tile from the (dequantised in
  kernel) anchor and the committed records, then round the same unrounded FP32 tile twice:
  ``A <- Q_rec(S)`` and ``R <- Q_read(S)``, writing packed codes and scales, with SR bits keyed
  by :func:`checkpoint_streams` (copy bit 0 / 1), exactly as :func:`core.cast_checkpoints`.
  Formats with a matrix scale (fp8, nvfp4) need the matrix amax before rounding: a first pass
  reconstructs the tiles for the amax only, a second reconstructs them again (the same FP32
  operations in the same order, so the same values) and rounds. Optionally it writes S (the
  state objects read the flush token's output from it) and/or the flush token's output S q.
  GDN corrections for the flush come from ``_records_kernel`` (C = A, every row solved) in a
  launch before; the folded values are then plain ``w`` as for Mamba-2.

A third kernel, ``_chain_kernel`` (:func:`anchor_chain`, end of this module), runs the anchor
recurrence of many windows in one launch for the adapters and the teacher-forced emulation
(``replay/window.py``): per window the GDN corrections against A, the reconstruction, the
anchor cast and (single-checkpoint policies) every output, one program per tile of value rows
with the matrix amax exchanged through atomics; see the comment block there and
docs/kl-throughput.md.

Stored copies are read in their real layout (:class:`~replayssm_quant.quant.PackedTensor`):
fp32 / bf16 / fp16 values, fp8 codes + FP32 matrix scale, nvfp4 nibbles + E4M3 block scales +
FP32 matrix scale, mx codes + E8M0 block scales, and decoded in registers to exactly the values
``PackedTensor.dequantize`` gives (integer decode of the codes, one IEEE multiplication by the
scale). The flush kernel holds key-axis tiles as two halves, the even and the odd elements,
which is how FP4 bytes hold them (element 2i in the low nibble); 8-bit and wider formats are
loaded contiguously and split in registers (on the H200 this measured 2x faster for the flush
than two strided accesses; see docs/kernels-replay.md).

Rounding uses the jit helpers of :mod:`replayssm_quant.kernels.quant` (integer-exact code
computation, ``div_rn`` divisions, ``tl.philox`` SR bits), so a flush kernel cast is bit-identical
to :func:`replayssm_quant.quant.pack_reference` of the same FP32 S. The reconstruction itself
adds in a different order than ``torch.matmul`` (so S may differ in its last bit from
:func:`core.reconstruct`); see the tests for how bit-exactness is checked.

Limits (the wrappers raise ValueError otherwise; the state objects then keep the torch path):
float32 only; the key dim K a power of two >= 32 (whole nvfp4/mx blocks); any value dim.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import formats as F
from ..capabilities import replay_kernels_supported, triton_interpreting
from ..checkpoints import Checkpoints, FlushResult, checkpoint_streams, length_mask
from ..formats import QuantSpec, parse_spec
from ..packed import PackedTensor
from ..philox import stream_keys_to
from ..policy import StatePolicy
from .quant import (_amax_scale, _block_scale, _e8m0_value, _finite_abs, _grid_consts,
                    _grid_value, _quant, _random_bits, _stream_words)

__all__ = [
    "records_outputs",
    "mamba2_step_kernel",
    "gdn_step_kernel",
    "mamba2_verify_kernel",
    "gdn_verify_kernel",
    "gdn_corrections_kernel",
    "flush_kernel",
    "mamba2_flush_kernel",
    "gdn_flush_kernel",
    "kernels_supported",
]

# Format kinds (constexpr KIND of a stored copy / of a cast)
_K_FLOAT = 0  # fp32 values (identity)
_K_HALF = 1  # bf16 / fp16 values (stored as torch.bfloat16 / torch.float16)
_K_MATRIX = 2  # fp8e4m3 / fp8e5m2 codes + FP32 scale per matrix
_K_NVFP4 = 3  # E2M1 nibbles + E4M3 scale per 16 + FP32 scale per matrix
_K_MX = 4  # E4M3 / E2M1 codes + E8M0 scale per 32

# Value rows per program of the records kernel (step/verify/solve) and per tile of the flush
# kernel: the best of the configurations timed on an H200 (docs/kernels-replay.md).
DEFAULT_BV = 64
DEFAULT_BV_FLUSH = 32
DEFAULT_WARPS = 4
_PSEUDO_BLOCK = 32  # records kernel: block length of a C tile for formats without blocks
MIN_LP = 16  # smallest register tile of record slots

# NaN rule of a decoded minifloat (constexpr NANF of ``_decode_code``)
_NANF_NONE = 0  # E2M1: no NaN
_NANF_E4M3 = 1  # OFP8 E4M3FN: magnitude code 0x7F (all ones) is NaN, no inf
_NANF_IEEE = 2  # E5M2: all-ones exponent is inf (zero mantissa) or NaN

# Decode constexprs of an FP32 copy (KIND _K_FLOAT; only KIND is read)
_FP32_EB = F.FP32_EBITS
_FP32_MB = F.FP32_MBITS
_FP32_EMIN = F.FP32_EMIN
_FP32_DECODE = dict(KIND=_K_FLOAT, FP4=False, EB=_FP32_EB, MB=_FP32_MB, EMIN=_FP32_EMIN,
                    SUBQ=1.0, NANF=_NANF_NONE)
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


def _decode_consts(spec, prefix: str) -> dict:
    """constexprs that decode a stored copy of format ``spec`` (see ``_load_copy``)."""
    spec = parse_spec(spec)
    kind = _kind(spec)
    grid = spec.info.element
    d = dict(_FP32_DECODE, KIND=kind)
    if kind in (_K_MATRIX, _K_NVFP4, _K_MX):
        nanf = _NANF_NONE if grid is F.E2M1 else (_NANF_E4M3 if grid is F.E4M3 else _NANF_IEEE)
        d.update(FP4=grid is F.E2M1, EB=grid.ebits, MB=grid.mbits, EMIN=grid.emin,
                 SUBQ=grid.min_subnormal, NANF=nanf)
    return {prefix + k: v for k, v in d.items()}


def _cast_consts(spec, prefix: str) -> dict:
    """constexprs of a cast to ``spec`` (see ``_cast_store``)."""
    spec = parse_spec(spec)
    kind = _kind(spec)
    grid = spec.info.element
    if grid is None:
        g = _grid_consts(F.FP16)  # unused (identity)
    else:
        g = _grid_consts(grid)
    d = dict(KIND=kind, FP4=grid is F.E2M1, SR=spec.sr, FMAX=(grid.max if grid else 1.0),
             EMAX=(F.MXFP8_EMAX if grid is F.E4M3 else F.MXFP4_EMAX),
             BLK=(spec.info.block or 1), MS=kind in (_K_MATRIX, _K_NVFP4), **g)
    return {prefix + k: v for k, v in d.items()}


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
def _matrix_scale(amax, KIND: tl.constexpr, FMAX: tl.constexpr,
                  GDIV: tl.constexpr = F.NVFP4_SCALE_DIVISOR):
    """fp8: s = amax / FMAX; nvfp4: s_g = amax / (448 * 6); 1 where that is 0 (reference
    ``quant._parts``)."""
    if KIND == 3:
        s = _amax_scale(amax, GDIV)
    else:
        s = _amax_scale(amax, FMAX)
    return s


@triton.jit
def _cast_store(xe, xo, rows, rmask, mat, V, s_mat, seed, st_ptr, out_ptr, bs_ptr,
                K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr,
                KIND: tl.constexpr, FP4: tl.constexpr, SR: tl.constexpr, FMAX: tl.constexpr,
                EMAX: tl.constexpr, BLK: tl.constexpr,
                EMIN: tl.constexpr, MBITS: tl.constexpr, MAXCODE: tl.constexpr,
                SUBQ: tl.constexpr, SIGN_SHIFT: tl.constexpr, HAS_INF: tl.constexpr,
                NAN_POS: tl.constexpr, NAN_NEG: tl.constexpr, INF_POS: tl.constexpr,
                INF_NEG: tl.constexpr):
    """Round the unrounded FP32 rows (even/odd halves [BV, KH]) of one matrix to a format and
    store the packed codes (and block scale codes); same steps as ``quant._parts`` /
    ``kernels.quant._block_rows``. ``s_mat``: the matrix scale (fp8: s; nvfp4: s_g).

    Returns what was stored, for ``_dequant_tile``: ``(even, odd, block scale codes)``:
    fp32 values (KIND 0), element codes [BV, KH] (1, 2) or [BV, NB, BLK // 2] (3, 4; the
    block scale codes [BV, NB]; 0 where the format has none)."""
    j = tl.arange(0, KH)
    kk = tl.arange(0, K)
    rowg = mat * V + rows.to(tl.int64)
    m2 = rmask[:, None]
    if KIND == 0:
        x = tl.reshape(tl.join(xe, xo), [BV, K])
        tl.store(out_ptr + rowg[:, None] * K + kk[None, :], x, mask=m2)
        r0, r1, r2 = xe, xo, 0
    else:
        if SR:
            lo, hi = _stream_words(tl.load(st_ptr + mat))
            eidx = rows[:, None] * K + 2 * j[None, :]
            re = _random_bits(seed, eidx, lo, hi)
            ro = _random_bits(seed, eidx + 1, lo, hi)
        else:
            re = 0
            ro = 0
        if KIND <= 2:  # one code per element: half formats (bit patterns), fp8 (matrix scale)
            ye = xe
            yo = xo
            if KIND == 2:
                ye = tl.where(xe != xe, xe, tl.math.div_rn(xe, tl.broadcast_to(s_mat, [BV, KH])))
                yo = tl.where(xo != xo, xo, tl.math.div_rn(xo, tl.broadcast_to(s_mat, [BV, KH])))
            _, ce = _quant(ye, re, SR, EMIN, MBITS, MAXCODE, SUBQ, SIGN_SHIFT, HAS_INF,
                           NAN_POS, NAN_NEG, INF_POS, INF_NEG)
            _, co = _quant(yo, ro, SR, EMIN, MBITS, MAXCODE, SUBQ, SIGN_SHIFT, HAS_INF,
                           NAN_POS, NAN_NEG, INF_POS, INF_NEG)
            c = tl.reshape(tl.join(ce, co), [BV, K])
            if KIND == 1:
                tl.store(out_ptr + rowg[:, None] * K + kk[None, :], c.to(tl.int16), mask=m2)
            else:
                tl.store(out_ptr + rowg[:, None] * K + kk[None, :], c.to(tl.uint8), mask=m2)
            r0, r1, r2 = ce, co, 0
        if KIND >= 3:
            NB: tl.constexpr = K // BLK
            HB: tl.constexpr = BLK // 2
            xe3 = tl.reshape(xe, [BV, NB, HB])
            xo3 = tl.reshape(xo, [BV, NB, HB])
            bamax = tl.maximum(tl.max(_finite_abs(xe3), axis=2), tl.max(_finite_abs(xo3), axis=2))
            fin = tl.minimum(tl.min((tl.abs(xe3) < float("inf")).to(tl.int32), axis=2),
                             tl.min((tl.abs(xo3) < float("inf")).to(tl.int32), axis=2))
            bad = fin < 1  # a NaN or inf in the block
            _, safe, ok, sb_code = _block_scale(bamax, bad, s_mat, KIND == 3, EMAX)
            safe3 = tl.broadcast_to(safe[:, :, None], [BV, NB, HB])
            ye = tl.math.div_rn(xe3, safe3)
            yo = tl.math.div_rn(xo3, safe3)
            if SR:
                re = tl.reshape(re, [BV, NB, HB])
                ro = tl.reshape(ro, [BV, NB, HB])
            _, ce = _quant(ye, re, SR, EMIN, MBITS, MAXCODE, SUBQ, SIGN_SHIFT, HAS_INF,
                           NAN_POS, NAN_NEG, INF_POS, INF_NEG)
            _, co = _quant(yo, ro, SR, EMIN, MBITS, MAXCODE, SUBQ, SIGN_SHIFT, HAS_INF,
                           NAN_POS, NAN_NEG, INF_POS, INF_NEG)
            if KIND == 3:
                ce = tl.where(ok[:, :, None], ce, 0)  # also the bad blocks: E2M1 NaN is 0
                co = tl.where(ok[:, :, None], co, 0)
            else:
                ce = tl.where(bad[:, :, None], NAN_POS, ce)
                co = tl.where(bad[:, :, None], NAN_POS, co)
            nbi = tl.arange(0, NB)
            tl.store(bs_ptr + rowg[:, None] * NB + nbi[None, :], sb_code.to(tl.uint8), mask=m2)
            if FP4:
                byte = tl.reshape((ce | (co << 4)).to(tl.uint8), [BV, KH])
                tl.store(out_ptr + rowg[:, None] * KH + j[None, :], byte, mask=m2)
            else:
                c = tl.reshape(tl.join(ce, co), [BV, K]).to(tl.uint8)
                tl.store(out_ptr + rowg[:, None] * K + kk[None, :], c, mask=m2)
            r0, r1, r2 = ce, co, sb_code
    return r0, r1, r2


@triton.jit
def _dequant_tile(ce, co, sbc, s_mat, BV: tl.constexpr, KH: tl.constexpr,
                  KIND: tl.constexpr, FP4: tl.constexpr, EB: tl.constexpr, MB: tl.constexpr,
                  EMIN: tl.constexpr, SUBQ: tl.constexpr, NANF: tl.constexpr,
                  BF16: tl.constexpr):
    """The values ``_load_copy`` would read back from what ``_cast_store`` just stored
    (its return value; ``s_mat`` the matrix scale it stored): the same integer decode and
    the same FP32 multiplications, without the round trip through memory. (even, odd) [BV, KH]."""
    if KIND == 0:
        e = ce
        o = co
    if KIND == 1:
        if BF16:
            e = ce.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
            o = co.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        else:
            e = ce.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            o = co.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    if KIND == 2:
        e = _decode_code(ce.to(tl.uint8), EB, MB, EMIN, SUBQ, NANF) * s_mat
        o = _decode_code(co.to(tl.uint8), EB, MB, EMIN, SUBQ, NANF) * s_mat
    if KIND >= 3:
        if FP4:  # the byte as stored: even element in the low nibble
            byte = (ce | (co << 4)).to(tl.uint8).to(tl.int32)
            e3 = _decode_code(byte & 15, EB, MB, EMIN, SUBQ, NANF)
            o3 = _decode_code(byte >> 4, EB, MB, EMIN, SUBQ, NANF)
        else:
            e3 = _decode_code(ce.to(tl.uint8), EB, MB, EMIN, SUBQ, NANF)
            o3 = _decode_code(co.to(tl.uint8), EB, MB, EMIN, SUBQ, NANF)
        if KIND == 3:
            scale = _decode_e4m3(sbc.to(tl.uint8)) * s_mat
        else:
            scale = _e8m0_value(sbc.to(tl.uint8).to(tl.int32))
        e = tl.reshape(e3 * scale[:, :, None], [BV, KH])
        o = tl.reshape(o3 * scale[:, :, None], [BV, KH])
    return e, o


# ----------------------------------------------------------------------------------------
# records kernel: step / verify / GDN correction solve, output-only
# ----------------------------------------------------------------------------------------


@triton.jit
def _load_c_blocks(c_ptr, bs_ptr, ms_ptr, mat, rows, rmask, V,
                   K: tl.constexpr, NB: tl.constexpr, W: tl.constexpr,
                   KIND: tl.constexpr, FP4: tl.constexpr, EB: tl.constexpr, MB: tl.constexpr,
                   EMIN: tl.constexpr, SUBQ: tl.constexpr, NANF: tl.constexpr):
    """Rows of a stored copy as blocks: element values ``[BV, NB, W]`` before scaling (FP4:
    the even and the odd elements of each block, W = block / 2; otherwise the whole block,
    ``xo`` unused) and the scale of each block ``[BV, NB]`` (1 for fp32/bf16/fp16; the matrix
    scale for fp8; ``s_b * s_g`` for nvfp4; the E8M0 scale for mx). ``value = elem * scale``
    is the dequantised value; the records kernel applies the scale after the dot product
    over the block (outputs only: a reassociation)."""
    nb = tl.arange(0, NB)
    jj = tl.arange(0, W)
    rowg = mat * V + rows.to(tl.int64)
    m3 = rmask[:, None, None]
    col = nb[:, None] * W + jj[None, :]  # [NB, W]
    if FP4:
        byte = tl.load(c_ptr + rowg[:, None, None] * (K // 2) + col[None, :, :], mask=m3,
                       other=0).to(tl.int32)
        xe = _decode_code(byte & 15, EB, MB, EMIN, SUBQ, NANF)
        xo = _decode_code(byte >> 4, EB, MB, EMIN, SUBQ, NANF)
    else:
        x = tl.load(c_ptr + rowg[:, None, None] * K + col[None, :, :], mask=m3, other=0)
        if KIND <= 1:
            xe = x.to(tl.float32)
        else:
            xe = _decode_code(x, EB, MB, EMIN, SUBQ, NANF)
        xo = xe
    m2 = rmask[:, None]
    if KIND <= 1:
        sc = tl.full([rows.shape[0], NB], 1.0, tl.float32)
    if KIND == 2:
        sc = tl.full([rows.shape[0], NB], 1.0, tl.float32) * tl.load(ms_ptr + mat)
    if KIND == 3:
        sbc = tl.load(bs_ptr + rowg[:, None] * NB + nb[None, :], mask=m2, other=0)
        sc = _decode_e4m3(sbc) * tl.load(ms_ptr + mat)
    if KIND == 4:
        e8 = tl.load(bs_ptr + rowg[:, None] * NB + nb[None, :], mask=m2, other=0).to(tl.int32)
        sc = _e8m0_value(e8)
    return xe, xo, sc


@triton.jit
def _dot_blocks(xe, xo, sc, v_ptr, NB: tl.constexpr, W: tl.constexpr, FP4: tl.constexpr):
    """``C v`` for C as returned by ``_load_c_blocks`` and a K-vector at ``v_ptr``: [BV]."""
    nb = tl.arange(0, NB)
    jj = tl.arange(0, W)
    col = nb[:, None] * W + jj[None, :]
    if FP4:
        ve = tl.load(v_ptr + 2 * col)
        vo = tl.load(v_ptr + 2 * col + 1)
        part = tl.sum(xe * ve[None, :, :], axis=2) + tl.sum(xo * vo[None, :, :], axis=2)
    else:
        part = tl.sum(xe * tl.load(v_ptr + col)[None, :, :], axis=2)
    return tl.sum(part * sc, axis=1)


@triton.jit
def _records_kernel(
        c_ptr, cbs_ptr, cms_ptr,  # checkpoint C (stored)
        rla_ptr, rk_ptr, rw_ptr,  # ring: la [B,CAP,H], k [B,CAP,G,K], w [B,CAP,H,V] (rows < ss)
        dla_ptr, dk_ptr, dv_ptr, dbeta_ptr,  # rows >= ss: [B,TD,H], [B,TD,G,K], [B,TD,H,V], [B,TD,H]
        q_ptr, o_ptr,  # q [B,TQ,G,K], o [B,TQ,H,V]
        ss_ptr, n_ptr, os_ptr,  # int64 [B]: first solved/draft row, rows, first output position
        wout_ptr,  # [B,WCAP,H,V]: solved rows ss..n-1 (WRITE_W)
        ala_ptr, ak_ptr, av_ptr, abeta_ptr,  # ring outputs of the append (APPEND)
        H, G, V, CAP, TD, TQ, WCAP,
        K: tl.constexpr, NB: tl.constexpr, W: tl.constexpr, BV: tl.constexpr,
        LP: tl.constexpr,
        GDN: tl.constexpr, D_REL: tl.constexpr, WRITE_W: tl.constexpr, APPEND: tl.constexpr,
        C_KIND: tl.constexpr, C_FP4: tl.constexpr, C_EB: tl.constexpr, C_MB: tl.constexpr,
        C_EMIN: tl.constexpr, C_SUBQ: tl.constexpr, C_NANF: tl.constexpr):
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    rows = vt * BV + tl.arange(0, BV)
    rmask = rows < V
    ss = tl.load(ss_ptr + b)
    n = tl.load(n_ptr + b)
    o0 = tl.load(os_ptr + b)
    idx = tl.arange(0, LP).to(tl.int64)
    kk = tl.arange(0, K)

    # ---- records of this (sequence, head): la, k of every slot, w of this program's rows
    ring = idx < ss
    drf = (idx >= ss) & (idx < n)
    if D_REL:
        di = idx - ss  # draft tensors hold rows ss.. at index 0..
    else:
        di = idx  # draft tensors are indexed by slot
    di = tl.where(drf, di, 0)
    ri = tl.where(ring, idx, 0)
    la = tl.where(ring, tl.load(rla_ptr + (b * CAP + ri) * H + h, mask=ring, other=0.0),
                  tl.load(dla_ptr + (b * TD + di) * H + h, mask=drf, other=0.0))
    cvec = tl.cumsum(la, axis=0)  # c_p = sum_{j<=p} la_j
    kr = tl.load(rk_ptr + ((b * CAP + ri) * G + g)[:, None] * K + kk[None, :],
                 mask=ring[:, None], other=0.0)
    kd = tl.load(dk_ptr + ((b * TD + di) * G + g)[:, None] * K + kk[None, :],
                 mask=drf[:, None], other=0.0)
    kmat = kr + kd  # [LP, K] (disjoint masks)
    m2 = ring[:, None] & rmask[None, :]
    U = tl.load(rw_ptr + ((b * CAP + ri) * H + h)[:, None] * V + rows[None, :], mask=m2,
                other=0.0)
    if not GDN:  # Mamba-2: w = v for the draft rows too
        md = drf[:, None] & rmask[None, :]
        U += tl.load(dv_ptr + ((b * TD + di) * H + h)[:, None] * V + rows[None, :], mask=md,
                     other=0.0)

    xe, xo, sc = _load_c_blocks(c_ptr, cbs_ptr, cms_ptr, mat, rows, rmask, V, K, NB, W,
                                C_KIND, C_FP4, C_EB, C_MB, C_EMIN, C_SUBQ, C_NANF)

    # ---- GDN: solve rows ss..n-1 (forward substitution, one row at a time)
    if GDN:
        beta = tl.load(dbeta_ptr + (b * TD + di) * H + h, mask=drf, other=0.0)
        for p in range(ss, n):
            if D_REL:
                pd = p - ss
            else:
                pd = p
            kp_ptr = dk_ptr + ((b * TD + pd) * G + g) * K
            ck = _dot_blocks(xe, xo, sc, kp_ptr, NB, W, C_FP4)  # C k_p
            kkp = tl.sum(kmat * tl.load(kp_ptr + kk)[None, :], axis=1)  # k_i . k_p
            sel = idx == p
            cp = tl.sum(tl.where(sel, cvec, 0.0), axis=0)
            bp = tl.load(dbeta_ptr + (b * TD + pd) * H + h)
            vp = tl.load(dv_ptr + ((b * TD + pd) * H + h) * V + rows, mask=rmask, other=0.0)
            before = idx < p
            coef = tl.where(before, (bp * tl.exp(tl.where(before, cp - cvec, 0.0))) * kkp, 0.0)
            u = bp * (vp - tl.exp(cp) * ck) - tl.sum(coef[:, None] * U, axis=0)
            U = tl.where(sel[:, None], u[None, :], U)
            if WRITE_W:
                tl.store(wout_ptr + ((b * WCAP + p) * H + h) * V + rows, u, mask=rmask)

    # ---- append the new records (decode step): slots ss..n-1 of the ring
    if APPEND:
        first_head = (h % (H // G)) == 0
        for p in range(ss, n):
            if D_REL:
                pd = p - ss
            else:
                pd = p
            vp = tl.load(dv_ptr + ((b * TD + pd) * H + h) * V + rows, mask=rmask, other=0.0)
            tl.store(av_ptr + ((b * CAP + p) * H + h) * V + rows, vp, mask=rmask)
            if vt == 0:
                tl.store(ala_ptr + (b * CAP + p) * H + h, tl.load(dla_ptr + (b * TD + pd) * H + h))
                if GDN:
                    tl.store(abeta_ptr + (b * CAP + p) * H + h,
                             tl.load(dbeta_ptr + (b * TD + pd) * H + h))
                if first_head:
                    kp = tl.load(dk_ptr + ((b * TD + pd) * G + g) * K + kk)
                    tl.store(ak_ptr + ((b * CAP + p) * G + g) * K + kk, kp)

    # ---- outputs at positions o0 .. o0 + TQ - 1
    for t in range(0, TQ):
        p = o0 + t
        qp_ptr = q_ptr + ((b * TQ + t) * G + g) * K
        cq = _dot_blocks(xe, xo, sc, qp_ptr, NB, W, C_FP4)  # C q
        kq = tl.sum(kmat * tl.load(qp_ptr + kk)[None, :], axis=1)  # k_j . q
        cp = tl.sum(tl.where(idx == p, cvec, 0.0), axis=0)
        upto = idx <= p
        m = tl.where(upto, tl.exp(tl.where(upto, cp - cvec, 0.0)), 0.0)
        o = tl.exp(cp) * cq + tl.sum((m * kq)[:, None] * U, axis=0)
        tl.store(o_ptr + ((b * TQ + t) * H + h) * V + rows, o, mask=rmask)


# ----------------------------------------------------------------------------------------
# flush kernel: reconstruct from A, cast A and R independently
# ----------------------------------------------------------------------------------------


@triton.jit
def _reconstruct_tile(a_ptr, abs_ptr, ams_ptr, la_ptr, w_ptr, k_ptr, mat, b, h, g, rows, rmask,
                      n, total, H, G, V, J,
                      K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr,
                      A_KIND: tl.constexpr, A_FP4: tl.constexpr, A_EB: tl.constexpr,
                      A_MB: tl.constexpr, A_EMIN: tl.constexpr, A_SUBQ: tl.constexpr,
                      A_NANF: tl.constexpr):
    """Rows of ``S = gamma_{1:n} A + sum_{j<n} gamma_{j+1:n} w_j k_j^T`` as (even, odd)."""
    ae, ao = _load_copy(a_ptr, abs_ptr, ams_ptr, mat, rows, rmask, V, K, KH, BV,
                        A_KIND, A_FP4, A_EB, A_MB, A_EMIN, A_SUBQ, A_NANF)
    kk = tl.arange(0, K)
    acc_e = tl.zeros([BV, KH], tl.float32)
    acc_o = tl.zeros([BV, KH], tl.float32)
    c = total * 0.0
    for jj in range(0, n):
        c = c + tl.load(la_ptr + (b * J + jj) * H + h)
        m = tl.exp(total - c)
        wj = tl.load(w_ptr + ((b * J + jj) * H + h) * V + rows, mask=rmask, other=0.0) * m
        kj = tl.load(k_ptr + ((b * J + jj) * G + g) * K + kk)
        kje, kjo = tl.split(tl.reshape(kj, [KH, 2]))
        acc_e += wj[:, None] * kje[None, :]
        acc_o += wj[:, None] * kjo[None, :]
    eg = tl.exp(total)
    return eg * ae + acc_e, eg * ao + acc_o


@triton.jit
def _flush_kernel(
        a_ptr, abs_ptr, ams_ptr,  # stored anchor (decoded with A_*)
        la_ptr, w_ptr, k_ptr, len_ptr,  # records [B,J,H], [B,J,H,V], [B,J,G,K]; length [B]
        sta_ptr, str_ptr, seed,  # stream keys [B*H] of the anchor / read casts
        oa_ptr, oabs_ptr, oams_ptr,  # new anchor: codes, block scales, matrix scale
        or_ptr, orbs_ptr, orms_ptr,  # new read copy
        s_ptr, q_ptr, y_ptr,  # S [B,H,V,K] (STORE_S); q [B,G,K] -> y = S q [B,H,V] (Q_OUT)
        H, G, V, J,
        K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr,
        TWO: tl.constexpr, STORE_S: tl.constexpr, Q_OUT: tl.constexpr,
        NEED_AMAX: tl.constexpr,
        A_KIND: tl.constexpr, A_FP4: tl.constexpr, A_EB: tl.constexpr, A_MB: tl.constexpr,
        A_EMIN: tl.constexpr, A_SUBQ: tl.constexpr, A_NANF: tl.constexpr,
        CA_KIND: tl.constexpr, CA_FP4: tl.constexpr, CA_SR: tl.constexpr,
        CA_FMAX: tl.constexpr, CA_EMAX: tl.constexpr, CA_BLK: tl.constexpr,
        CA_MS: tl.constexpr,
        CA_EMIN: tl.constexpr, CA_MBITS: tl.constexpr, CA_MAXCODE: tl.constexpr,
        CA_SUBQ: tl.constexpr, CA_SIGN_SHIFT: tl.constexpr, CA_HAS_INF: tl.constexpr,
        CA_NAN_POS: tl.constexpr, CA_NAN_NEG: tl.constexpr, CA_INF_POS: tl.constexpr,
        CA_INF_NEG: tl.constexpr,
        CR_KIND: tl.constexpr, CR_FP4: tl.constexpr, CR_SR: tl.constexpr,
        CR_FMAX: tl.constexpr, CR_EMAX: tl.constexpr, CR_BLK: tl.constexpr,
        CR_MS: tl.constexpr,
        CR_EMIN: tl.constexpr, CR_MBITS: tl.constexpr, CR_MAXCODE: tl.constexpr,
        CR_SUBQ: tl.constexpr, CR_SIGN_SHIFT: tl.constexpr, CR_HAS_INF: tl.constexpr,
        CR_NAN_POS: tl.constexpr, CR_NAN_NEG: tl.constexpr, CR_INF_POS: tl.constexpr,
        CR_INF_NEG: tl.constexpr):
    mat = tl.program_id(0).to(tl.int64)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    n = tl.load(len_ptr + b)
    total = tl.zeros([], tl.float32)
    for jj in range(0, n):
        total = total + tl.load(la_ptr + (b * J + jj) * H + h)
    kk = tl.arange(0, K)
    j = tl.arange(0, KH)
    amax = tl.zeros([], tl.float32)
    if NEED_AMAX:
        for v0 in range(0, V, BV):
            rows = v0 + tl.arange(0, BV)
            rmask = rows < V
            se, so = _reconstruct_tile(a_ptr, abs_ptr, ams_ptr, la_ptr, w_ptr, k_ptr, mat, b, h,
                                       g, rows, rmask, n, total, H, G, V, J, K, KH, BV,
                                       A_KIND, A_FP4, A_EB, A_MB, A_EMIN, A_SUBQ, A_NANF)
            fe = tl.where(rmask[:, None], _finite_abs(se), 0.0)
            fo = tl.where(rmask[:, None], _finite_abs(so), 0.0)
            amax = tl.maximum(amax, tl.maximum(tl.max(tl.max(fe, axis=1), axis=0),
                                               tl.max(tl.max(fo, axis=1), axis=0)))
    sa = _matrix_scale(amax, CA_KIND, CA_FMAX)
    sr = _matrix_scale(amax, CR_KIND, CR_FMAX)
    if Q_OUT:
        qv = tl.load(q_ptr + (b * G + g) * K + kk)
        qe, qo = tl.split(tl.reshape(qv, [KH, 2]))
    for v0 in range(0, V, BV):
        rows = v0 + tl.arange(0, BV)
        rmask = rows < V
        se, so = _reconstruct_tile(a_ptr, abs_ptr, ams_ptr, la_ptr, w_ptr, k_ptr, mat, b, h, g,
                                   rows, rmask, n, total, H, G, V, J, K, KH, BV,
                                   A_KIND, A_FP4, A_EB, A_MB, A_EMIN, A_SUBQ, A_NANF)
        if STORE_S:
            x = tl.reshape(tl.join(se, so), [BV, K])
            tl.store(s_ptr + (mat * V + rows.to(tl.int64))[:, None] * K + kk[None, :], x,
                     mask=rmask[:, None])
        if Q_OUT:
            y = tl.sum(se * qe[None, :], axis=1) + tl.sum(so * qo[None, :], axis=1)
            tl.store(y_ptr + mat * V + rows, y, mask=rmask)
        _cast_store(se, so, rows, rmask, mat, V, sa, seed, sta_ptr, oa_ptr, oabs_ptr, K, KH, BV,
                    CA_KIND, CA_FP4, CA_SR, CA_FMAX, CA_EMAX, CA_BLK, CA_EMIN, CA_MBITS, CA_MAXCODE,
                    CA_SUBQ, CA_SIGN_SHIFT, CA_HAS_INF, CA_NAN_POS, CA_NAN_NEG, CA_INF_POS,
                    CA_INF_NEG)
        if TWO:
            _cast_store(se, so, rows, rmask, mat, V, sr, seed, str_ptr, or_ptr, orbs_ptr, K, KH,
                        BV, CR_KIND, CR_FP4, CR_SR, CR_FMAX, CR_EMAX, CR_BLK, CR_EMIN, CR_MBITS,
                        CR_MAXCODE, CR_SUBQ, CR_SIGN_SHIFT, CR_HAS_INF, CR_NAN_POS, CR_NAN_NEG,
                        CR_INF_POS, CR_INF_NEG)
    if CA_MS:
        tl.store(oams_ptr + mat, sa)
    if TWO:
        if CR_MS:
            tl.store(orms_ptr + mat, sr)


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


def _stored_args(stored) -> tuple[tuple, QuantSpec]:
    """(pointer tensors, spec) of a stored copy: a PackedTensor or an FP32 tensor."""
    if isinstance(stored, PackedTensor):
        dummy = stored.codes
        return ((stored.codes, stored.block_scales if stored.block_scales is not None else dummy,
                 stored.matrix_scale if stored.matrix_scale is not None else dummy),
                stored.spec)
    if stored.dtype != torch.float32:
        raise ValueError(f"a stored FP32 copy must be float32, got {stored.dtype}")
    return (stored.contiguous(), stored, stored), parse_spec("fp32")


def _lp(cap: int) -> int:
    return max(MIN_LP, triton.next_power_of_2(cap))


def records_outputs(checkpoint, *, ring_la, ring_k, ring_w, q, start, rows, out_start,
                    draft=None, draft_relative: bool = True, gdn: bool = False,
                    w_out=None, append=None, block_v: int = DEFAULT_BV,
                    num_warps: int = DEFAULT_WARPS) -> torch.Tensor:
    """Launch ``_records_kernel`` (low-level; see the model-specific wrappers below).

    Args:
        checkpoint: stored C ``[B, H, V, K]`` (PackedTensor or float32 tensor).
        ring_la, ring_k, ring_w: ``[B, CAP, H]``, ``[B, CAP, G, K]``, ``[B, CAP, H, V]``: the
            records of slots ``< start[b]`` (w: Mamba-2 v, GDN cached corrections).
        q: ``[B, TQ, G, K]``; outputs at slots ``out_start[b] + t``.
        start, rows, out_start: int64 ``[B]``: rows ``start..rows-1`` come from ``draft``
            (GDN: their corrections are solved against C).
        draft: dict ``la [B,TD,H]``, ``k [B,TD,G,K]``, ``v [B,TD,H,V]``, ``beta [B,TD,H]``
            (GDN), indexed by ``slot - start`` (``draft_relative``) or by slot.
        w_out: ``[B, WCAP, H, V]`` receives the solved corrections of rows ``start..rows-1``.
        append: dict of ring tensors ``la, k, v, beta`` that receive the draft rows at their
            slots (decode step's append).
    Returns ``o [B, TQ, H, V]``.
    """
    (c, cbs, cms), spec = _stored_args(checkpoint)
    ring_la, ring_k, ring_w = ring_la.contiguous(), ring_k.contiguous(), ring_w.contiguous()
    for name, t in [("w_out", w_out)] + list((append or {}).items()):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel writes it in place)")
    B, CAP, G, K = ring_k.shape
    H = ring_la.shape[2]
    V = ring_w.shape[3]
    _check_supported(K, q.dtype)
    TQ = q.shape[1]
    if draft is None:
        draft = {"la": ring_la, "k": ring_k, "v": ring_w, "beta": ring_la}
        draft_relative = False
    TD = draft["la"].shape[1]
    beta = draft.get("beta", draft["la"])
    o = torch.empty(B, TQ, H, V, dtype=torch.float32, device=q.device)
    if TQ == 0:  # nothing to output: hand the kernel valid (unused) pointers
        q = ring_k
        o_arg = ring_k
    else:
        o_arg = o
    wo = w_out if w_out is not None else o_arg
    ap = append or {}
    a_la, a_k, a_v = ap.get("la", o_arg), ap.get("k", o_arg), ap.get("v", o_arg)
    a_beta = ap.get("beta", o_arg)
    grid = (B * H, triton.cdiv(V, block_v))
    fp4 = spec.info.element is F.E2M1
    blk = spec.info.block or _PSEUDO_BLOCK  # C is held as [BV, K / blk, blk] (FP4: 2 halves)
    _records_kernel[grid](
        c, cbs, cms, ring_la, ring_k, ring_w,
        draft["la"].contiguous(), draft["k"].contiguous(), draft["v"].contiguous(),
        beta.contiguous(), q.contiguous(), o_arg,
        start, rows, out_start, wo, a_la, a_k, a_v, a_beta,
        H, G, V, CAP, TD, TQ, wo.shape[1] if w_out is not None else 1,
        K=K, NB=K // blk, W=blk // 2 if fp4 else blk, BV=block_v, LP=_lp(max(CAP, TD)),
        GDN=gdn, D_REL=draft_relative, WRITE_W=w_out is not None, APPEND=append is not None,
        num_warps=num_warps, **_decode_consts(spec, "C_"))
    return o


# ---------------------------------------------------------------- decode step
def mamba2_step_kernel(read, ring: dict, la, v, k, q, h, *, block_v: int = DEFAULT_BV,
        num_warps: int = DEFAULT_WARPS):
    """Decode step of Mamba-2 (kernel of :func:`replay.mamba2.mamba2_step_output` plus the
    append): write the record ``(la [B,H], v [B,H,P], k [B,G,N])`` into ring slot ``h[b]``
    (ring dict ``la [B,CAP,H]``, ``v [B,CAP,H,P]``, ``k [B,CAP,G,N]``, updated in place) and
    return ``y = gamma_{1:h+1} (R q) + V (m * (K^T q))`` ``[B, H, P]`` (no ``D x``) from the
    stored read copy ``read`` and grouped ``q [B, G, N]``. ``h``: int64 ``[B]`` records before
    the append (the caller then does h += 1)."""
    draft = {"la": la[:, None], "k": k[:, None], "v": v[:, None]}
    y = records_outputs(read, ring_la=ring["la"], ring_k=ring["k"], ring_w=ring["v"],
                        q=q[:, None], start=h, rows=h + 1, out_start=h, draft=draft,
                        append={"la": ring["la"], "k": ring["k"], "v": ring["v"]},
                        block_v=block_v, num_warps=num_warps)
    return y[:, 0]


def gdn_step_kernel(read, ring: dict, q, k, v, g, beta, h, *, block_v: int = DEFAULT_BV,
        num_warps: int = DEFAULT_WARPS):
    """Decode step of GDN (kernel of :func:`replay.gdn.gdn_step_output` plus the append):
    write the record ``(g, beta [B,HV], v [B,HV,DV], k [B,HK,DK])`` into ring slot ``h[b]``,
    solve its read-path correction ``u_h = beta (v - gamma_{1:h} R k - sum_i gamma_{i+1:h}
    (k_i . k) u_i)`` against the stored read copy and the cached corrections, cache it in
    ``ring["uR"]`` and return ``o [B, HV, DV]`` in output-only form. Ring dict: ``la, beta
    [B,CAP,HV]``, ``v, uR [B,CAP,HV,DV]``, ``k [B,CAP,HK,DK]`` (updated in place)."""
    draft = {"la": g[:, None], "k": k[:, None], "v": v[:, None], "beta": beta[:, None]}
    o = records_outputs(read, ring_la=ring["la"], ring_k=ring["k"], ring_w=ring["uR"],
                        q=q[:, None], start=h, rows=h + 1, out_start=h, draft=draft, gdn=True,
                        w_out=ring["uR"],
                        append={"la": ring["la"], "k": ring["k"], "v": ring["v"],
                                "beta": ring["beta"]},
                        block_v=block_v, num_warps=num_warps)
    return o[:, 0]


# ---------------------------------------------------------------- verify
def mamba2_verify_kernel(read, anchor, la, v, k, q, start, window: int, *,
                         block_v: int = DEFAULT_BV):
    """Kernel of :func:`replay.mamba2.mamba2_verify` (same arguments, records already in the
    ring slices ``la [B,J,H]``, ``v [B,J,H,P]``, ``k [B,J,G,N]``; ``read``/``anchor`` stored).
    Returns ``y [B, T, H, P]``."""
    T = q.shape[1]
    B = q.shape[0]
    if T == 0:
        return q.new_zeros(B, 0, la.shape[2], v.shape[3])
    n = start + T
    kw = dict(ring_la=la, ring_k=k, ring_w=v, q=q, start=n, rows=n, out_start=start,
              block_v=block_v)
    y = records_outputs(read, **kw)
    at_flush = n == window
    if bool(at_flush.any()):
        yA = records_outputs(anchor, **kw)
        y[at_flush, T - 1] = yA[at_flush, T - 1]
    return y


def gdn_verify_kernel(read, anchor, la, beta, v, k, q, u_known, start, window: int,
                      fold_cached_corrections: bool = False, *, block_v: int = DEFAULT_BV):
    """Kernel of :func:`replay.gdn.gdn_verify`: one T x T solve (rows ``start..start+T-1``)
    against the stored read copy with the cached corrections ``u_known [B,J,HV,DV]`` before,
    then the T outputs; a draft on the flush slot reads the A path (every row re-solved
    against A, or the cached corrections with ``fold_cached_corrections``).
    Returns ``(o [B,T,HV,DV], uR [B,J,HV,DV])``."""
    T = q.shape[1]
    B, J = la.shape[:2]
    uR = u_known.clone()
    if T == 0:
        return q.new_zeros(B, 0, la.shape[2], v.shape[3]), uR
    n = start + T
    draft = {"la": la, "k": k, "v": v, "beta": beta}
    o = records_outputs(read, ring_la=la, ring_k=k, ring_w=u_known, q=q, start=start, rows=n,
                        out_start=start, draft=draft, draft_relative=False, gdn=True, w_out=uR,
                        block_v=block_v)
    uR = torch.where(length_mask(n, J)[:, :, None, None], uR, 0.0)
    at_flush = n == window
    if bool(at_flush.any()):
        if fold_cached_corrections:
            oA = records_outputs(anchor, ring_la=la, ring_k=k, ring_w=uR, q=q, start=n,
                                 rows=n, out_start=start, block_v=block_v)
        else:
            oA = records_outputs(anchor, ring_la=la, ring_k=k, ring_w=u_known, q=q,
                                 start=torch.zeros_like(start), rows=n, out_start=start,
                                 draft=draft, draft_relative=False, gdn=True, block_v=block_v)
        o[at_flush, T - 1] = oA[at_flush, T - 1]
    return o, uR


# ---------------------------------------------------------------- GDN flush corrections
def gdn_corrections_kernel(anchor, la, beta, v, k, length, *, block_v: int = DEFAULT_BV,
        num_warps: int = DEFAULT_WARPS):
    """Kernel of :func:`core.solve_corrections` for a flush: the corrections of rows
    ``0..length[b]-1`` against the stored anchor (records ``la, beta [B,J,HV]``,
    ``v [B,J,HV,DV]``, grouped ``k [B,J,HK,DK]``). Rows at or beyond ``length`` are zero.
    Returns ``u [B, J, HV, DV]``."""
    B, J, H = la.shape
    u = torch.zeros_like(v)
    if J == 0:
        return u
    q = v.new_zeros(B, 0, k.shape[2], k.shape[3])
    zero = torch.zeros_like(length)
    records_outputs(anchor, ring_la=la, ring_k=k, ring_w=u, q=q, start=zero, rows=length,
                    out_start=zero, draft={"la": la, "k": k, "v": v, "beta": beta},
                    draft_relative=False, gdn=True, w_out=u, block_v=block_v, num_warps=num_warps)
    return u


# ---------------------------------------------------------------- flush
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


def _as_stored(spec: QuantSpec, shape, bufs):
    codes, bs, ms = bufs
    if spec.is_identity:
        return codes
    if _kind(spec) == _K_HALF:
        codes = codes.view(torch.bfloat16 if spec.info.element is F.BF16 else torch.float16)
    return PackedTensor(spec, torch.Size(shape), codes, bs, ms)


def flush_kernel(anchor, la, w, k, length, policy, *, seed: int, layer: int, sequence_ids,
                 flush_index, q=None, store_state: bool = True, block_v: int = DEFAULT_BV_FLUSH,
                 num_warps: int = DEFAULT_WARPS):
    """Kernel of :func:`core.flush` (with the records masked to ``length``): reconstruct S from
    the stored anchor (PackedTensor or float32 ``[B, H, V, K]``) and the records
    ``la [B,J,H]``, ``w [B,J,H,V]``, grouped ``k [B,J,G,K]`` (slots ``< length[b]``), then
    ``A <- Q_rec(S)`` and ``R <- Q_read(S)`` independently in the same kernel (one cast for
    single-checkpoint policies), SR streams from :func:`checkpoint_streams`.

    Returns ``(FlushResult, y)``: ``FlushResult.state`` is S when ``store_state`` (else None),
    its checkpoints hold the stored copies (PackedTensor, or the float32 tensor for ``fp32``)
    and their dequantised values; ``y = S q [B, H, V]`` when ``q [B, G, K]`` is given."""
    policy = StatePolicy.parse(policy)
    (a, abs_, ams), aspec = _stored_args(anchor)
    B, H, V, K = (anchor.shape if isinstance(anchor, PackedTensor) else anchor.shape)
    B, H, V, K = int(B), int(H), int(V), int(K)
    _check_supported(K, w.dtype)
    J = la.shape[1]
    G = k.shape[2]
    dev = w.device
    sa, sr = checkpoint_streams(layer=layer, sequence_ids=sequence_ids, heads=H,
                                     flush_index=flush_index)
    two = not policy.single_checkpoint
    shape = (B, H, V, K)
    bufa = _alloc_copy(policy.rec, shape, dev)
    bufr = _alloc_copy(policy.read, shape, dev) if two else bufa
    S = torch.empty(shape, dtype=torch.float32, device=dev) if store_state else bufa[0]
    y = torch.empty(B, H, V, dtype=torch.float32, device=dev) if q is not None else bufa[0]
    qq = q.contiguous() if q is not None else bufa[0]
    if J == 0:  # no records: S = A; keep shapes valid for the kernel
        la = torch.zeros(B, 1, H, dtype=torch.float32, device=dev)
        w = torch.zeros(B, 1, H, V, dtype=torch.float32, device=dev)
        k = torch.zeros(B, 1, G, K, dtype=torch.float32, device=dev)
        length = torch.zeros_like(length)
        J = 1
    pick = lambda t, d: t if t is not None else d  # noqa: E731
    _flush_kernel[(B * H,)](
        a, abs_, ams, la.contiguous(), w.contiguous(), k.contiguous(), length,
        stream_keys_to(sa.reshape(-1).contiguous(), dev),
        stream_keys_to(sr.reshape(-1).contiguous(), dev), int(seed),
        bufa[0], pick(bufa[1], bufa[0]), pick(bufa[2], bufa[0]),
        bufr[0], pick(bufr[1], bufr[0]), pick(bufr[2], bufr[0]),
        S, qq, y, H, G, V, J,
        K=K, KH=K // 2, BV=block_v, TWO=two, STORE_S=store_state, Q_OUT=q is not None,
        NEED_AMAX=_kind(policy.rec) in (_K_MATRIX, _K_NVFP4)
        or (two and _kind(policy.read) in (_K_MATRIX, _K_NVFP4)), num_warps=num_warps,
        **_decode_consts(aspec, "A_"), **_cast_consts(policy.rec, "CA_"),
        **_cast_consts(policy.read if two else policy.rec, "CR_"))
    a_st = _as_stored(policy.rec, shape, bufa)
    r_st = _as_stored(policy.read, shape, bufr) if two else a_st

    def deq(st):
        return st if isinstance(st, torch.Tensor) else st.dequantize()

    a_val = deq(a_st)
    r_val = deq(r_st) if two else a_val
    cps = Checkpoints(a_val, r_val, a_st, r_st)
    res = FlushResult(S if store_state else None, cps, w)
    return res, (y if q is not None else None)


def mamba2_flush_kernel(anchor, la, v, k, length, policy, *, seed, layer, sequence_ids,
                        flush_index, q=None, store_state: bool = True,
                        block_v: int = DEFAULT_BV_FLUSH):
    """Kernel of :func:`replay.mamba2.mamba2_flush` (records ``la [B,J,H]``, ``v [B,J,H,P]``,
    grouped ``k [B,J,G,N]``, ``length`` int64 ``[B]``). Returns ``(FlushResult, y)``."""
    return flush_kernel(anchor, la, v, k, length, policy, seed=seed, layer=layer,
                        sequence_ids=sequence_ids, flush_index=flush_index, q=q,
                        store_state=store_state, block_v=block_v)


def gdn_flush_kernel(anchor, la, beta, v, k, length, policy, *, seed, layer, sequence_ids,
                     flush_index, u_cached=None, fold_cached_corrections: bool = False, q=None,
                     store_state: bool = True, block_v: int = DEFAULT_BV_FLUSH):
    """Kernel of :func:`replay.gdn.gdn_flush`: the corrections are re-solved against the
    stored anchor by :func:`gdn_corrections_kernel` (a launch before the flush kernel), or the
    cached ones are folded (``fold_cached_corrections``). ``FlushResult.w`` holds the folded
    corrections. Returns ``(FlushResult, y)``."""
    if fold_cached_corrections:
        if u_cached is None:
            raise ValueError("fold_cached_corrections=True needs u_cached")
        live = length_mask(length, la.shape[1])
        u = torch.where(live[:, :, None, None], u_cached, torch.zeros((), dtype=v.dtype,
                                                                      device=v.device))
    else:
        u = gdn_corrections_kernel(anchor, la, beta, v, k, length)
    return flush_kernel(anchor, la, u, k, length, policy, seed=seed, layer=layer,
                        sequence_ids=sequence_ids, flush_index=flush_index, q=q,
                        store_state=store_state, block_v=block_v)


# ---------------------------------------------------------------- state-object entry points
# The kernels of the state objects' operations, with the signatures of their torch references
# (replay/mamba2.py, replay/gdn.py: ``mamba2_state_step`` ...); the backend seam
# (replayssm_quant/backend.py) swaps one for the other. They read the stored checkpoints.
def mamba2_state_step(cps: Checkpoints, ring: dict, h, la, v, k, q):
    """Kernel of :func:`replay.mamba2.mamba2_state_step`: :func:`mamba2_step_kernel`."""
    return mamba2_step_kernel(cps.read_stored, ring, la, v, k, q, h)


def mamba2_state_verify(cps: Checkpoints, la, v, k, q, start, window: int):
    """Kernel of :func:`replay.mamba2.mamba2_state_verify`: :func:`mamba2_verify_kernel`."""
    return mamba2_verify_kernel(cps.read_stored, cps.anchor_stored, la, v, k, q, start, window)


def mamba2_state_flush(anchor, recs: dict, length, policy, *, seed, layer, sequence_ids,
                       flush_index) -> FlushResult:
    """Kernel of :func:`replay.mamba2.mamba2_state_flush`: :func:`mamba2_flush_kernel`."""
    return mamba2_flush_kernel(anchor, recs["la"], recs["v"], recs["k"], length, policy,
                               seed=seed, layer=layer, sequence_ids=sequence_ids,
                               flush_index=flush_index)[0]


def gdn_state_step(cps: Checkpoints, ring: dict, h, q, k, v, g, beta):
    """Kernel of :func:`replay.gdn.gdn_state_step`: :func:`gdn_step_kernel`."""
    return gdn_step_kernel(cps.read_stored, ring, q, k, v, g, beta, h)


def gdn_state_verify(cps: Checkpoints, la, beta, v, k, q, u_known, start, window: int,
                     fold_cached_corrections: bool = False):
    """Kernel of :func:`replay.gdn.gdn_state_verify`: :func:`gdn_verify_kernel`."""
    return gdn_verify_kernel(cps.read_stored, cps.anchor_stored, la, beta, v, k, q, u_known,
                             start, window, fold_cached_corrections)


def gdn_state_flush(anchor, recs: dict, length, policy, *, seed, layer, sequence_ids,
                    flush_index, fold_cached_corrections: bool = False) -> FlushResult:
    """Kernel of :func:`replay.gdn.gdn_state_flush`: :func:`gdn_flush_kernel`."""
    return gdn_flush_kernel(anchor, recs["la"], recs["beta"], recs["v"], recs["k"], length,
                            policy, seed=seed, layer=layer, sequence_ids=sequence_ids,
                            flush_index=flush_index, u_cached=recs["uR"],
                            fold_cached_corrections=fold_cached_corrections)[0]


# ----------------------------------------------------------------------------------------
# anchor chain: the anchor recurrence of a run of windows, one launch
# ----------------------------------------------------------------------------------------
# Each program owns a tile of BV value rows of one (sequence, head) matrix and loops over NW
# windows of L records each:
#   (GDN) u = corrections of the window solved against A (forward substitution; row-separable
#         along the value axis, as core.solve_corrections),
#   S = gamma_{1:L} A + sum_j gamma_{j+1:L} w_j k_j^T  (w = v for Mamba-2, u for GDN),
#   A <- Q_rec(S)  (stored packed, SR stream of that flush; the matrix amax over the whole S).
# Every step is row-separable except the matrix amax of fp8 / nvfp4 anchors, so the programs
# of a matrix only exchange one number per window: each adds its tile's amax to a per-(matrix,
# window) slot (integer atomic max of the float bits, all non-negative), arrives on a counter
# and spins until the matrix's NT tiles have arrived (SPLIT). Programs take logical ids from a
# ticket counter in the order they start, so the tiles of a matrix are always co-resident or
# waiting behind finished ones (no deadlock for any grid size once NT programs fit). Without
# SPLIT (under the Triton interpreter, which runs programs one after another; for a matrix of
# one tile; for more tiles than SMs) one program per matrix loops over the same tiles, twice
# where an amax is needed.
# A program that owns its rows for the whole chain (SPLIT, or a single tile) keeps the anchor
# in registers: the next window's A is decoded from the codes it just stored (_dequant_tile,
# the same integer decode and FP32 multiplications as _load_copy, which equals
# PackedTensor.dequantize); a program looping over several tiles reads it back from memory.
# Optionally (OUT, single-checkpoint policies, whose read copy is the anchor) the program also
# writes the window's outputs for its rows: position t < L reads the previous anchor plus the
# records, gamma_{1:t} (A q_t) + sum_{j<=t} gamma_{j+1:t} (k_j . q_t) w_j (core.window_outputs,
# GDN corrections against R = A are the flush's), and the flush token reads S q_L.
# This is THE flush arithmetic on the kernel path (every anchor format; an fp32 anchor is the
# exact recurrence, A = S): the adapters' step path calls it with NW = 1, the teacher-forced
# window form with every full window of a segment (the same binary: runtime ints are not
# specialised), so identical inputs round identically. Read copies of dual policies
# (R = Q_read(S)) are cast by the host from S.
# FP contraction is off for this kernel (enable_fp_fusion=False): which mul+add pairs the
# backend fuses into an FMA depends on the surrounding code, so with it on the variants
# (SPLIT or not, OUT or not, STORE_S or not) rounded S differently in the last bit (measured
# on the H200: up to most anchors of an fp8/nvfp4 chain differed). With it off the production
# variants agree bit for bit (step path, teacher-forced with and without outputs, any batch;
# checked on the H200). The one remaining order difference: a GPU reduction over a tile (A k,
# A q) follows the tile's register layout, which differs between an anchor carried in
# registers and one loaded from memory, so the one-program-per-matrix launch (tests, under the
# interpreter, where order is fixed) can differ in last bits from the split launch on the GPU
# (GDN with FP4 anchors; docs/kl-throughput.md).


@triton.jit
def _prev_anchor(a0_ptr, ap_ptr, apbs_ptr, apms_ptr, w, mat0, pmat, rows, rmask, V,
                 K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr,
                 P_KIND: tl.constexpr, P_FP4: tl.constexpr, P_EB: tl.constexpr,
                 P_MB: tl.constexpr, P_EMIN: tl.constexpr, P_SUBQ: tl.constexpr,
                 P_NANF: tl.constexpr):
    """Rows of the anchor before window ``w`` read from memory: the FP32 start (w = 0) or
    the packed anchor of window w - 1 (slot ``pmat``)."""
    if w == 0:
        ae, ao = _load_copy(a0_ptr, a0_ptr, a0_ptr, mat0, rows, rmask, V, K, KH, BV)  # FP32
    else:
        ae, ao = _load_copy(ap_ptr, apbs_ptr, apms_ptr, pmat, rows, rmask, V, K, KH, BV,
                            P_KIND, P_FP4, P_EB, P_MB, P_EMIN, P_SUBQ, P_NANF)
    return ae, ao


@triton.jit
def _chain_tile(ae, ao, rows, rmask,
                la_ptr, k_ptr, v_ptr, beta_ptr, q_ptr, o_ptr, b, h, t0, H, V, T, L,
                K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
                GDN: tl.constexpr, OUT: tl.constexpr):
    """Rows ``rows`` of the unrounded S after the window starting at token ``t0``, from these
    rows of the previous anchor ``(ae, ao)``, as (even, odd) [BV, KH]; with OUT, also stores
    the window's outputs of these rows at ``o_ptr``.

    One pass over the window's records p = 0 .. L-1: (GDN) the correction u_p of these rows
    against the previous anchor, then ``S += gamma_{p+1:L} w_p k_p^T`` (S starts at
    ``gamma_{1:L} A``), then (OUT) the output of position p. Record rows are loaded where
    they are used; the corrections are kept transposed ``[BV, LP]`` for the coupling sums."""
    idx = tl.arange(0, LP)
    live = idx < L
    tt = (b * T + t0 + idx).to(tl.int64)
    la = tl.load(la_ptr + tt * H + h, mask=live, other=0.0)
    cvec = tl.cumsum(la, axis=0)
    total = tl.sum(tl.where(idx == L - 1, cvec, 0.0), axis=0)
    j = tl.arange(0, KH)
    kk = tl.arange(0, K)
    eg = tl.exp(total)
    se = eg * ae
    so = eg * ao
    if GDN or OUT:
        kmat = tl.load(k_ptr + (tt * H + h)[:, None] * K + kk[None, :], mask=live[:, None],
                       other=0.0)
        kme, kmo = _split_halves(kmat, LP, KH)
    if GDN:
        bt = tl.load(beta_ptr + tt * H + h, mask=live, other=0.0)
    # written values of the records so far, transposed [BV, LP] (GDN: corrections; Mamba-2: v)
    Wt = tl.zeros([BV, LP], tl.float32)
    for p in range(0, L):
        sel = idx == p
        rp = ((b * T + t0 + p) * H + h).to(tl.int64)
        kpe = tl.load(k_ptr + rp * K + 2 * j)
        kpo = tl.load(k_ptr + rp * K + 2 * j + 1)
        vp = tl.load(v_ptr + rp * V + rows, mask=rmask, other=0.0)
        cp = tl.sum(tl.where(sel, cvec, 0.0), axis=0)
        if GDN:
            bp = tl.sum(tl.where(sel, bt, 0.0), axis=0)
            ak = tl.sum(ae * kpe[None, :], axis=1) + tl.sum(ao * kpo[None, :], axis=1)  # A k_p
            kkp = tl.sum(kme * kpe[None, :], axis=1) + tl.sum(kmo * kpo[None, :], axis=1)
            before = idx < p
            coef = tl.where(before, (bp * tl.exp(tl.where(before, cp - cvec, 0.0))) * kkp, 0.0)
            wp = bp * (vp - tl.exp(cp) * ak) - tl.sum(Wt * coef[None, :], axis=1)
        else:
            wp = vp
        Wt = tl.where(sel[None, :], wp[:, None], Wt)
        mw = tl.exp(total - cp) * wp
        se += mw[:, None] * kpe[None, :]
        so += mw[:, None] * kpo[None, :]
        if OUT:
            if p < L - 1:  # reads the previous anchor (R = A) and the records up to p
                qpe = tl.load(q_ptr + rp * K + 2 * j)
                qpo = tl.load(q_ptr + rp * K + 2 * j + 1)
                aq = tl.sum(ae * qpe[None, :], axis=1) + tl.sum(ao * qpo[None, :], axis=1)
                kq = tl.sum(kme * qpe[None, :], axis=1) + tl.sum(kmo * qpo[None, :], axis=1)
                upto = idx <= p
                co = tl.where(upto, tl.exp(tl.where(upto, cp - cvec, 0.0)) * kq, 0.0)
                o = tl.exp(cp) * aq + tl.sum(Wt * co[None, :], axis=1)
                tl.store(o_ptr + rp * V + rows, o, mask=rmask)
    if OUT:  # the flush token reads the unrounded S
        rl = ((b * T + t0 + L - 1) * H + h).to(tl.int64)
        qle = tl.load(q_ptr + rl * K + 2 * j)
        qlo = tl.load(q_ptr + rl * K + 2 * j + 1)
        o = tl.sum(se * qle[None, :], axis=1) + tl.sum(so * qlo[None, :], axis=1)
        tl.store(o_ptr + rl * V + rows, o, mask=rmask)
    return se, so


@triton.jit
def _tile_amax(se, so, rmask):
    fe = tl.where(rmask[:, None], _finite_abs(se), 0.0)
    fo = tl.where(rmask[:, None], _finite_abs(so), 0.0)
    return tl.maximum(tl.max(tl.max(fe, axis=1), axis=0), tl.max(tl.max(fo, axis=1), axis=0))


@triton.jit
def _matrix_amax(part, sync_ptr, slot, NT: tl.constexpr):
    """Max of the NT programs' ``part`` (non-negative) for one (matrix, window): atomic max of
    the float bits at ``sync_ptr[slot]``, arrival count at ``sync_ptr[slot + 1]``, spin."""
    tl.atomic_max(sync_ptr + slot, part.to(tl.int32, bitcast=True), sem="relaxed")
    seen = tl.atomic_add(sync_ptr + slot + 1, 1, sem="acq_rel") + 1
    while seen < NT:
        seen = tl.atomic_add(sync_ptr + slot + 1, 0, sem="acquire")
    # every max happened before its program's arrival (release); read it from L2
    return tl.load(sync_ptr + slot, cache_modifier=".cg").to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["seed", "H", "V", "T", "L", "NW", "NSLOT"])
def _chain_kernel(
        a0_ptr,  # starting anchor, dequantised FP32 [B, H, V, K]
        la_ptr, k_ptr, v_ptr, beta_ptr,  # records [B,T,H], [B,T,H,K] (expanded), [B,T,H,V], [B,T,H]
        q_ptr, o_ptr,  # OUT: queries [B, T, H, K] (expanded), outputs [B, T, H, V]
        st_ptr, seed,  # anchor stream keys [B, NW, H]
        oa_ptr, oabs_ptr, oams_ptr,  # anchors in NSLOT slots, packed [B, NSLOT, H, V, .]
        ap_ptr,  # the same codes as typed for decoding (bf16 / fp16 view for half formats)
        s_ptr,  # STORE_S: unrounded S of every window [B, NW, H, V, K]
        sync_ptr,  # SPLIT: int32 [1 + 2 B H NW]: ticket, then (amax bits, arrivals) per window
        H, V, T, L, NW, NSLOT,
        K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
        NT: tl.constexpr, GDN: tl.constexpr, OUT: tl.constexpr, STORE_S: tl.constexpr,
        SPLIT: tl.constexpr, NEED_AMAX: tl.constexpr,
        P_KIND: tl.constexpr, P_FP4: tl.constexpr, P_EB: tl.constexpr, P_MB: tl.constexpr,
        P_EMIN: tl.constexpr, P_SUBQ: tl.constexpr, P_NANF: tl.constexpr, P_BF16: tl.constexpr,
        CA_KIND: tl.constexpr, CA_FP4: tl.constexpr, CA_SR: tl.constexpr,
        CA_FMAX: tl.constexpr, CA_EMAX: tl.constexpr, CA_BLK: tl.constexpr,
        CA_MS: tl.constexpr,
        CA_EMIN: tl.constexpr, CA_MBITS: tl.constexpr, CA_MAXCODE: tl.constexpr,
        CA_SUBQ: tl.constexpr, CA_SIGN_SHIFT: tl.constexpr, CA_HAS_INF: tl.constexpr,
        CA_NAN_POS: tl.constexpr, CA_NAN_NEG: tl.constexpr, CA_INF_POS: tl.constexpr,
        CA_INF_NEG: tl.constexpr):
    if SPLIT:
        pid = tl.atomic_add(sync_ptr, 1)  # logical id in start order (see above)
        mat0 = (pid // NT).to(tl.int64)
        tile = pid % NT
    else:
        mat0 = tl.program_id(0).to(tl.int64)
        tile = 0
    b = mat0 // H
    h = mat0 - b * H
    kk = tl.arange(0, K)
    if SPLIT or NT == 1:  # this program owns its rows for the whole chain: A stays in registers
        rows = tile * BV + tl.arange(0, BV)
        rmask = rows < V
        ae, ao = _prev_anchor(a0_ptr, ap_ptr, oabs_ptr, oams_ptr, 0, mat0, mat0, rows, rmask, V,
                              K, KH, BV, P_KIND, P_FP4, P_EB, P_MB, P_EMIN, P_SUBQ, P_NANF)
        for w in range(0, NW):
            smat = (b * NW + w) * H + h  # S and stream key index of this window
            amat = (b * NSLOT + w % NSLOT) * H + h  # anchor slot written
            se, so = _chain_tile(ae, ao, rows, rmask, la_ptr, k_ptr, v_ptr, beta_ptr, q_ptr,
                                 o_ptr, b, h, w * L, H, V, T, L, K, KH, BV, LP, GDN, OUT)
            amax = tl.zeros([], tl.float32)
            if NEED_AMAX:
                if SPLIT:
                    amax = _matrix_amax(_tile_amax(se, so, rmask), sync_ptr,
                                        1 + 2 * (mat0 * NW + w), NT)
                else:
                    amax = _tile_amax(se, so, rmask)
            sa = _matrix_scale(amax, CA_KIND, CA_FMAX)
            if STORE_S:
                x = tl.reshape(tl.join(se, so), [BV, K])
                tl.store(s_ptr + (smat * V + rows.to(tl.int64))[:, None] * K + kk[None, :], x,
                         mask=rmask[:, None])
            # _cast_store reads the stream key at st_ptr[mat] for the matrix it stores: shift
            # the base so that the store slot amat finds this window's key smat
            ce, co, sbc = _cast_store(se, so, rows, rmask, amat, V, sa, seed,
                                      st_ptr + (smat - amat), oa_ptr, oabs_ptr, K, KH, BV,
                                      CA_KIND, CA_FP4, CA_SR, CA_FMAX, CA_EMAX, CA_BLK, CA_EMIN,
                                      CA_MBITS, CA_MAXCODE, CA_SUBQ, CA_SIGN_SHIFT, CA_HAS_INF,
                                      CA_NAN_POS, CA_NAN_NEG, CA_INF_POS, CA_INF_NEG)
            if CA_MS:
                tl.store(oams_ptr + amat, sa)  # every tile of the matrix stores the same value
            ae, ao = _dequant_tile(ce, co, sbc, sa, BV, KH, P_KIND, P_FP4, P_EB, P_MB, P_EMIN,
                                   P_SUBQ, P_NANF, P_BF16)
    else:  # one program loops over the row tiles of its matrix (interpreter, tests)
        for w in range(0, NW):
            smat = (b * NW + w) * H + h
            amat = (b * NSLOT + w % NSLOT) * H + h
            pmat = (b * NSLOT + (w + NSLOT - 1) % NSLOT) * H + h  # slot of the previous anchor
            amax = tl.zeros([], tl.float32)
            if NEED_AMAX:  # first pass: the tiles for the amax only
                for v0 in range(0, V, BV):
                    rows = v0 + tl.arange(0, BV)
                    rmask = rows < V
                    ae, ao = _prev_anchor(a0_ptr, ap_ptr, oabs_ptr, oams_ptr, w, mat0, pmat, rows,
                                          rmask, V, K, KH, BV, P_KIND, P_FP4, P_EB, P_MB, P_EMIN,
                                          P_SUBQ, P_NANF)
                    se, so = _chain_tile(ae, ao, rows, rmask, la_ptr, k_ptr, v_ptr, beta_ptr,
                                         q_ptr, o_ptr, b, h, w * L, H, V, T, L, K, KH, BV, LP,
                                         GDN, False)
                    amax = tl.maximum(amax, _tile_amax(se, so, rmask))
            sa = _matrix_scale(amax, CA_KIND, CA_FMAX)
            for v0 in range(0, V, BV):
                rows = v0 + tl.arange(0, BV)
                rmask = rows < V
                ae, ao = _prev_anchor(a0_ptr, ap_ptr, oabs_ptr, oams_ptr, w, mat0, pmat, rows,
                                      rmask, V, K, KH, BV, P_KIND, P_FP4, P_EB, P_MB, P_EMIN,
                                      P_SUBQ, P_NANF)
                se, so = _chain_tile(ae, ao, rows, rmask, la_ptr, k_ptr, v_ptr, beta_ptr, q_ptr,
                                     o_ptr, b, h, w * L, H, V, T, L, K, KH, BV, LP, GDN, OUT)
                if STORE_S:
                    x = tl.reshape(tl.join(se, so), [BV, K])
                    tl.store(s_ptr + (smat * V + rows.to(tl.int64))[:, None] * K + kk[None, :],
                             x, mask=rmask[:, None])
                _cast_store(se, so, rows, rmask, amat, V, sa, seed, st_ptr + (smat - amat),
                            oa_ptr, oabs_ptr, K, KH, BV, CA_KIND, CA_FP4, CA_SR, CA_FMAX,
                            CA_EMAX, CA_BLK, CA_EMIN, CA_MBITS, CA_MAXCODE, CA_SUBQ,
                            CA_SIGN_SHIFT, CA_HAS_INF, CA_NAN_POS, CA_NAN_NEG, CA_INF_POS,
                            CA_INF_NEG)
            if CA_MS:
                tl.store(oams_ptr + amat, sa)
            tl.debug_barrier()  # the next window reads this window's anchor (other threads' rows)


CHAIN_TILE_ELEMENTS = 2048  # elements of a program's row tile: BV = 2048 // K rows
CHAIN_WARPS = 4


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def chain_block_v(V: int, K: int) -> int:
    """Value rows per program of the anchor-chain kernel: a function of the matrix shape only,
    so that every call on a layer (any batch, any number of windows, step or teacher-forced)
    adds in the same order."""
    return max(1, min(triton.next_power_of_2(V), CHAIN_TILE_ELEMENTS // K))


class ChainResult(NamedTuple):
    """What :func:`anchor_chain` returns (see there for shapes)."""

    states: torch.Tensor | None
    anchors: torch.Tensor
    outputs: torch.Tensor | None


def anchor_chain(anchor, la, k, v, beta, spec, *, L: int, seed: int, streams, q=None,
                 store_states: bool = True, all_anchors: bool = True, split: bool | None = None,
                 block_v: int | None = None, num_warps: int = CHAIN_WARPS) -> ChainResult:
    """Anchor recurrence over ``NW = T // L`` full windows in one launch (DESIGN.md "Flush":
    reconstruct, then ``A <- Q_rec(S)``; GDN corrections re-solved against A). An ``fp32``
    ``spec`` is the exact recurrence (``A = S``, nothing rounds).

    Args:
        anchor: dequantised FP32 anchor ``[B, H, V, K]`` before the first window.
        la ``[B, T, H]``, head-expanded ``k [B, T, H, K]``, ``v [B, T, H, V]``, ``beta [B, T, H]``
        (GDN) or None (Mamba-2: the written value is v); float32.
        spec: the anchor format (``policy.rec``); streams: int64 ``[B, NW, H]`` anchor stream
        keys of the NW flushes (``checkpoint_streams`` copy 0; host or device).
        q: head-expanded queries ``[B, T, H, K]``: also return the outputs of every position for
            a single-checkpoint policy (read copy = anchor; ``core.window_outputs`` inside a
            window, ``S q`` at the flush token).
        store_states: return the unrounded S of every window.
        all_anchors: return the anchor of every window, else only the last one.
        split: one program per (matrix, row tile) with the matrix amax exchanged through
            atomics (default: on CUDA when a matrix has several tiles and they fit on the SMs;
            else one program per matrix, as the interpreter runs). The choice depends on
            (V, K) and the device only, so every call on a layer takes the same.
        block_v: value rows per tile (default :func:`chain_block_v`: tests only).

    Returns :class:`ChainResult` ``(states [B, NW, H, V, K] or None, anchors [B, NW or 1, H, V, K]
    dequantised FP32, outputs [B, T, H, V] or None)``.

    Raises:
        ValueError: L < 1 or T not a positive multiple of L, unsupported K or dtype, mismatched
            shapes, dtypes or devices, streams not integer ``[B, NW, H]``, ``block_v`` not a
            power of two, ``split`` under the Triton interpreter.
    """
    spec = parse_spec(spec)
    if anchor.dim() != 4:
        raise ValueError(f"anchor must be [B, H, V, K], got shape {list(anchor.shape)}")
    B, H, V, K = (int(d) for d in anchor.shape)
    _check_supported(K, anchor.dtype)
    if isinstance(L, bool) or not isinstance(L, int) or L < 1:
        raise ValueError(f"window L must be an int >= 1, got {L!r}")
    T = la.shape[1]
    NW = T // L
    if NW * L != T or NW < 1:
        raise ValueError(f"T={T} must be a positive multiple of L={L}")
    dev = anchor.device
    want = {"la": (B, T, H), "k": (B, T, H, K), "v": (B, T, H, V)}
    got = {"la": la, "k": k, "v": v}
    if beta is not None:
        want["beta"], got["beta"] = (B, T, H), beta
    if q is not None:
        want["q"], got["q"] = (B, T, H, K), q
    for n, shape in want.items():
        if tuple(got[n].shape) != shape or got[n].dtype != torch.float32:
            raise ValueError(f"{n} must be float32 {list(shape)} (B, H, V, K from the anchor, "
                             f"T from la), got {got[n].dtype} {list(got[n].shape)}")
        if got[n].device != dev:
            raise ValueError(f"{n} is on {got[n].device}, the anchor on {dev}")
    streams = torch.as_tensor(streams)
    if streams.is_floating_point() or streams.is_complex() or tuple(streams.shape) != (B, NW, H):
        raise ValueError(f"streams must be integer stream keys [B, NW, H] = {[B, NW, H]}, got "
                         f"{streams.dtype} {list(streams.shape)}")
    if block_v is not None and (block_v < 1 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    interp = triton_interpreting()
    bv = block_v or chain_block_v(V, K)
    nt = triton.cdiv(V, bv)
    if split is None:  # split only where tiles can wait for each other: all NT of a matrix
        split = not interp and nt > 1 and nt <= _sm_count(dev)  # resident (ticket order)
    split = bool(split)
    if split and interp:
        raise ValueError("split=True needs a GPU: the Triton interpreter runs programs one "
                         "after another, so tiles cannot wait for each other")
    gdn = beta is not None
    la, k, v = la.contiguous(), k.contiguous(), v.contiguous()
    beta = beta.contiguous() if gdn else la
    nslot = NW if all_anchors else min(NW, 2)
    bufs = _alloc_copy(spec, (B * nslot, H, V, K), dev)
    codes = bufs[0]
    ap = codes
    if _kind(spec) == _K_HALF:
        ap = codes.view(torch.bfloat16 if spec.info.element is F.BF16 else torch.float16)
    S = torch.empty(B, NW, H, V, K, dtype=torch.float32, device=dev) if store_states else None
    out = torch.empty(B, T, H, V, dtype=torch.float32, device=dev) if q is not None else None
    need_amax = _kind(spec) in (_K_MATRIX, _K_NVFP4)
    sync = torch.zeros(1 + (2 * B * H * NW if split and need_amax else 0), dtype=torch.int32,
                       device=dev)
    st = stream_keys_to(streams.reshape(-1).contiguous(), dev)
    pick = lambda t: t if t is not None else codes  # noqa: E731
    _chain_kernel[(B * H * (nt if split else 1),)](
        anchor.contiguous(), la, k, v, beta, pick(None if q is None else q.contiguous()),
        pick(out), st, int(seed), codes, pick(bufs[1]), pick(bufs[2]), ap, pick(S), sync,
        H, V, T, L, NW, nslot,
        K=K, KH=K // 2, BV=bv, LP=max(2, triton.next_power_of_2(L)), NT=nt, GDN=gdn,
        OUT=q is not None, STORE_S=store_states, SPLIT=split, NEED_AMAX=need_amax,
        num_warps=num_warps, P_BF16=spec.info.element is F.BF16, enable_fp_fusion=False,
        **_decode_consts(spec, "P_"), **_cast_consts(spec, "CA_"))
    if not all_anchors:  # dequantise the last slot only
        last = (NW - 1) % nslot
        bufs = tuple(None if t is None else t.reshape(B, nslot, *t.shape[1:])[:, last].contiguous()
                     for t in bufs)
        nslot = 1
    packed = _as_stored(spec, (B * nslot, H, V, K), bufs)
    A = packed if isinstance(packed, torch.Tensor) else packed.dequantize()
    A = A.to(torch.float32).reshape(B, nslot, H, V, K)
    return ChainResult(S, A, out)
