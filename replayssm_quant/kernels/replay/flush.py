"""The flush kernel: reconstruct S from the anchor A and the committed records, then cast A and
R independently from the same unrounded S.

``_flush_kernel``, programs over (sequence, head) matrices and tiles of ``BV`` value rows:
reconstruct ``S = gamma_{1:J} A + sum_j gamma_{j+1:J} w_j k_j^T`` tile by tile from the
(dequantised in kernel) anchor and the committed records, then round the same unrounded FP32
tile twice: ``A <- Q_rec(S)`` and ``R <- Q_read(S)``, writing packed codes and scales, with SR
bits keyed by :func:`replayssm_quant.checkpoints.checkpoint_streams` (copy bit 0 / 1).

* The records of a program (``la``, the decays, ``k [LP, K]`` as even/odd key columns) are
  loaded once; a tile's record sum is one FP32 FMA dot ``(W * m) [BV, LP] x K [LP, K/2]`` per
  key half (``input_precision="ieee"``: no TF32). The interpreter sums over the record slots
  in order; on the H200 the FMA dot's order follows the register layout, and 8 of 38 timed
  GDN launch configurations gave S, A and R that differ in last bits from the default of that
  sweep (``flush_tune_h200.json``). A configuration is fixed by the shapes, the policy and
  the model (:func:`flush_config`), never by the batch.
* Two other forms of that sum (``reconstruct``): ``"tf32x3"`` the same dots on tensor cores
  (three TF32 products of the split operands), and ``"rank1"`` one rank-1 update per slot on a
  ``[BV, K]`` tile in column order (:func:`_flush_tile_rank1`; no dot operand tiles, no
  even/odd split except for the block formats' casts). :func:`flush_config` picks the form
  per shape and policy from the H200 sweeps (docs/kernels-replay.md, "second pass").
  ``"dot_full"`` / ``"tf32x3_full"`` (thirteenth pass) are the dot forms on whole ``[BV, K]``
  tiles (:func:`_flush_tile_full`), now the defaults without a matrix scale.
* GDN (``SOLVE``): the corrections are solved in the same program, per tile of value rows (rows
  are separable): ``A k_p`` for every slot by one dot of the anchor tile with ``K^T`` (FP32
  FMA or tf32x3, as the form's fold),
  then forward substitution over the ``LP`` slots on ``[BV, LP]`` registers (or, with
  ``solve_form="inverse"``, one product with ``(I + CF)^{-1}``, inverted once per program);
  the solved corrections are written out (``FlushResult.w``) and folded.
* Formats with a matrix scale (fp8, nvfp4) need the matrix amax before rounding. With one tile
  per matrix (``BV >= V``, ``SINGLE``) it is taken from registers and S is reconstructed once.
  Otherwise, variant ``loop`` (one program walks the matrix's tiles) reconstructs the tiles
  twice, an amax pass and a cast pass; variant ``grid`` (a program per tile) launches twice,
  an amax launch (``PHASE`` 1: tile amax, ``atomic_max`` on the float32 bits; exact, so
  deterministic; GDN: the solved corrections are written) and a cast launch (``PHASE`` 2;
  GDN: folds the corrections of phase 1, no second solve). The two reconstructions are the same FP32
  operations in the same order, so the same values.
* Optionally it writes S (the state objects read the flush token's output from it) and/or the
  flush token's output S q.
* Split casts (``flush_kernel(split_casts=...)``, the default for matrix-scaled copies since
  2026-12-02): ``_flush_kernel`` runs as the ``fp32`` flush and writes S, then the quantizer
  kernels (``kernels/quant.py``) cast it to A and R with the same stream keys (built by
  ``_split_keys_kernel``), so the same bytes as the fused casts of that S: by default one
  ``pack_pair_triton`` launch for both copies where one is NVFP4 and the other fp32, fp16 or
  bf16, or for a single NVFP4 copy (``cast_form="pair"``, 2026-12-04), else one
  ``pack_triton`` per copy.

Torch reference: :func:`replayssm_quant.replay.core.flush` (``reconstruct`` +
``cast_checkpoints``), :func:`replayssm_quant.replay.mamba2.mamba2_flush`,
:func:`replayssm_quant.replay.gdn.gdn_flush`. The reconstruction adds in a different order than
``torch.matmul``, so S may differ in its last bit; the casts of a given S are bit-identical.
Tests: ``tests/test_replay_kernels.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...checkpoints import Checkpoints, FlushResult, checkpoint_streams, length_mask
from ...packed import PackedTensor
from ...philox import STREAM_FIELDS, STREAM_SHIFTS, stream_key, stream_keys_to
from ...policy import StatePolicy, require_policy
from ..quant import _PAIR_ROWS, _PAIR_WARPS, pack_pair_triton, pack_triton, pair_casts
from .codec import (_K_MATRIX, _K_NVFP4, _alloc_copy, _as_stored, _cast_consts, _cast_store,
                    _cast_store_full, _check_devices, _check_f32, _check_index, _check_records,
                    _load_full, _check_maxnreg, _check_supported, _decode_consts, _finite_abs,
                    _kind, _load_stored, _matrix_scale, _maxnreg_launch, _stored_args,
                    _assert_ranges, KERNELS_INTERPRETED)
from .records import _check_tile, _lp, _unit_upper_inverse

DEFAULT_BV_FLUSH = 32  # a flush_tune.py candidate (the first sweep's default); a call's: flush_config
DEFAULT_WARPS_FLUSH = 4
# "grid": one program per (matrix, tile of BV value rows); casts with a matrix scale (fp8,
# nvfp4) then take two launches (tile amax by atomic max, then reconstruct again and cast).
# "loop": one program per matrix walks its row tiles (with a matrix scale: an amax pass, then
# a cast pass). With block_v >= V both are the same single-tile kernel: the matrix amax comes
# from registers and S is reconstructed once.
FLUSH_VARIANTS = ("grid", "loop")
DEFAULT_VARIANT = "grid"
# How a tile folds its records: "dot" (FP32 FMA dots of [BV, LP] x [LP, K/2] operand tiles),
# "rank1" (one rank-1 update per record slot, in slot order; _flush_tile_rank1) or "tf32x3" (the
# dot form on tensor cores: three TF32 products of the split operands, about FP32 accuracy).
RECONSTRUCT_FORMS = ("dot", "rank1", "tf32x3", "dot_full", "tf32x3_full")
# "dot_full" / "tf32x3_full" (2026-12-02): the dot forms on one [BV, K] tile in column order
# (one dot with the whole keys [LP, K], no even/odd key halves; _flush_tile_full), loaded,
# cast and stored as the rank-1 form does
# How GDN's fused correction solve runs in the dot forms: "substitution" (one slot at a time on
# the [BV, LP] tile of each row tile) or "inverse" ((I + CF)^{-1} once per program on
# [LP, LP] scalars, then one product per row tile; the GDN default for V > 64 since 2026-12-02,
# see flush_config)
FLUSH_SOLVE_FORMS = ("substitution", "inverse")
# Triton's software-pipelining depth of every flush launch (its launch option ``num_stages``),
# Triton's default on the H200 (3), passed explicitly. 2026-12-02, thirteenth session
# (benchmarks/flush_stages.py, flush_stages_h200.json; CUDA-graph medians at B = 256, S not
# written): depth 1 was the fastest of 1-4 for the serving flush (GDN fold of cached
# corrections 410 -> 402 us, GDN fused solve tf32x3_full + inverse 949 -> 755 us, Mamba-2 fp32
# 712 -> 699 us), but in decode.py at depth 1 the nvfp4 flushes, whose split casts run the
# flush that writes S, were slower (GDN 1258 -> 1416 us, Mamba-2 1955 -> 2030 us), and depth 1
# changes the fused solve's last bits, so the S-writing and serving flushes must share one
# depth. Kept at 3.
FLUSH_NUM_STAGES = 3


def flush_config(V: int, need_amax: bool, gdn: bool = False,
                 slots: int = 16) -> tuple[str, int, int, str, str]:
    """Default launch ``(variant, block_v, num_warps, reconstruct, solve_form)`` of a flush:
    the fastest configuration of ``benchmarks/flush_tune.py`` on the H200 at B = 256 over four
    sweeps on 2026-12-01 (the last is benchmarks/results/flush_tune_h200.json; single runs move
    by 10-20%, so a form is the default only where it won in every sweep):

    * V <= 64 with a solve or a matrix scale (timed on Mamba-2's 64 x 128; a GDN layer with
      DV <= 64 takes the same): one 64-row tile, ``tf32x3`` products (``fp32`` 1.32 ms
      against 1.60 ms for the FP32 FMA dot in the same sweep; with a matrix-scaled copy
      (``read:nvfp4/rec:fp16+sr``) 8 warps, 4.38 against 4.75-4.81 ms);
    * V > 64 with a matrix scale and no correction solve (Mamba-2 with P > 64, untimed): the
      ``rank1`` form, ``loop`` 32 x 4 (the GDN choice before the inverse solve:
      matrix-scaled 3.85-4.53 ms against 4.59-5.02 ms for the best dot);
    * ``gdn`` with V > 64 (GDN 128 x 128; 2026-12-02, two sweeps,
      ``flush_tune_inverse_h200.json``): the FP32 FMA dot with the correction solve by the
      inverse of ``I + CF`` (``solve_form="inverse"``): ``fp32`` ``loop`` 64 x 4, 1.16 ms in
      both sweeps against 1.72 ms for the former default (loop 32 x 4, forward substitution;
      tf32x3 + inverse, one 128-row tile, 8 warps: 1.12 ms, within 4%, kept off then for the
      exact FP32 products); matrix-scaled one 128-row tile with 8 warps, 3.41 ms against 3.70 ms for
      the former ``rank1`` default. Since 2026-12-02 (thirteenth session) the ``fp32`` flush
      (and the fp32 flush of the split casts) takes the tf32x3 products on whole 16-row tiles
      with the inverse, ``loop`` 16 x 2 (``tf32x3_full`` + ``inverse``): 956 us in two sweeps
      against 1163 us for ``loop`` 64 x 4 FP32 dot (``flush_tune_full2_h200.json``,
      ``flush_tune_full3_h200.json``);
    * without a solve or a matrix scale (2026-12-02, thirteenth session; flush_tune
      ``--forms tf32x3,tf32x3_full,...``, ``flush_tune_fold_r{1,2}_h200.json``,
      ``flush_tune_m2_full_h200.json``): the tf32x3 products on whole ``[32, K]`` tiles, one
      program per matrix with 2 warps (``loop`` 32 x 2, ``tf32x3_full``). GDN's fold of cached
      corrections (what a single-checkpoint policy's flush runs, ``GDNFold.folds_cached``) at
      128 x 128: 427 us in two sweeps against 877 us for the former ``loop`` 32 x 4 FP32 dot
      and 474 us for the best tf32x3 on key halves; Mamba-2's ``fp32`` flush (and the fp32
      flush of its split casts) at 64 x 128: 720 against 826 us (one 64-row tile, tf32x3).
      Up to 16 record slots (the timed window: beyond, the ``[LP, K]`` keys held beside the
      tile on 2 warps are untimed), as before beyond; GDN with a solve beyond 16 slots keeps
      ``loop`` 32 x 4 with the FP32 dot.

    ``solve_form`` applies only to a GDN flush that solves its corrections (``beta`` given),
    and the inverse only up to 16 record ``slots`` (the timed window; its ``[LP, LP]``
    inverse per program grows with the square of the slots, untimed beyond).
    The choice depends only on the shapes, the policy and the model, never on the batch."""
    if not gdn and not need_amax and _lp(slots) <= 16:
        return "loop", 32, 2, "tf32x3_full", "substitution"
    if V <= 64:
        return "grid", 64, (8 if need_amax else 4), "tf32x3", "substitution"
    if gdn and _lp(slots) <= 16:
        if need_amax:
            return "grid", 128, 8, "dot", "inverse"
        return "loop", 16, 2, "tf32x3_full", "inverse"
    if need_amax:
        return "loop", 32, 4, "rank1", "substitution"
    return "loop", 32, 4, "dot", "substitution"


def flush_needs_amax(policy) -> bool:
    """Whether a flush under ``policy`` (a :class:`StatePolicy`) casts to a format with a
    matrix scale (fp8, nvfp4: the matrix amax is needed before rounding), which the default
    launch depends on (:func:`flush_config`)."""
    policy = require_policy(policy)
    specs = [policy.rec] + ([] if policy.single_checkpoint else [policy.read])
    return any(_kind(sp) in (_K_MATRIX, _K_NVFP4) for sp in specs)


def flush_splits_casts(policy) -> bool:
    """Whether :func:`flush_kernel` by default splits its casts from the reconstruction
    (``split_casts``): for policies with a matrix-scaled copy (:func:`flush_needs_amax`), whose
    fused flush needs the whole matrix in one tile (8 warps, up to 255 registers). Measured on
    the H200 for nvfp4 read copies (docs/kernels-replay.md, "Ninth pass"); an fp8 copy with a
    matrix scale takes the same rule, untimed."""
    return flush_needs_amax(policy)


def flush_launch(V: int, need_amax: bool, gdn: bool, slots: int, *, variant=None,
                 block_v=None, num_warps=None, reconstruct=None,
                 solve_form=None) -> tuple[str, int, int, str, str]:
    """The launch ``(variant, block_v, num_warps, reconstruct, solve_form)`` of a flush with
    ``V`` value rows and ``slots`` record slots (``gdn``: the corrections are solved in the
    kernel): the given options, the rest from :func:`flush_config`. The default solve form
    applies only where the fold form takes it (``reconstruct="rank1"`` solves slot by slot);
    without a solve (``gdn`` False) the solve form is returned as given and has no effect.

    Raises:
        ValueError: a non-positive or non-int ``V`` or ``slots``, a bad variant, reconstruct
            form, solve form, tile or warp count (naming the value and what was expected), or
            ``solve_form="inverse"`` with ``"rank1"``.
    """
    for name, x in (("V", V), ("slots", slots)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    dv, db, dw, dr, ds = flush_config(V, bool(need_amax), gdn=bool(gdn), slots=slots)
    variant = dv if variant is None else variant
    block_v = db if block_v is None else block_v
    num_warps = dw if num_warps is None else num_warps
    reconstruct = dr if reconstruct is None else reconstruct
    if solve_form is None:
        solve_form = ds if reconstruct != "rank1" else "substitution"
    if variant not in FLUSH_VARIANTS:
        raise ValueError(f"variant must be one of {FLUSH_VARIANTS}, got {variant!r}")
    if reconstruct not in RECONSTRUCT_FORMS:
        raise ValueError(f"reconstruct must be one of {RECONSTRUCT_FORMS}, got {reconstruct!r}")
    if solve_form not in FLUSH_SOLVE_FORMS:
        raise ValueError(f"solve_form must be one of {FLUSH_SOLVE_FORMS}, got {solve_form!r}")
    if solve_form == "inverse" and reconstruct == "rank1":
        raise ValueError("solve_form='inverse' needs a dot form of reconstruct ('dot', "
                         "'tf32x3', 'dot_full' or 'tf32x3_full'); reconstruct='rank1' solves "
                         "slot by slot in its fold")
    _check_tile(block_v, num_warps)
    return variant, block_v, num_warps, reconstruct, solve_form


@triton.jit
def _solve_tile(v, ak, bvec, ecp, cf, idx, n, BV: tl.constexpr, LP: tl.constexpr,
                PREC: tl.constexpr, INV: tl.constexpr):
    """GDN's corrections ``U [BV, LP]`` of a tile's value rows against the anchor (DESIGN.md
    section 3, "Flush"): ``rhs = beta_p (v_p - gamma_{1:p} (A k_p))`` from the values
    ``v [BV, LP]`` and ``ak = A k_p [BV, LP]``, then forward substitution over the ``n`` live
    slots with the coefficients ``cf`` (``[i, p]``, i < p), or, with ``INV``, one product with
    ``cf = (I + CF)^{-1}`` (rows at slots >= n: beta 0, so rhs 0 and u 0). Shared by the
    key-half and whole-tile dot forms (:func:`_flush_tile`, :func:`_flush_tile_full`)."""
    rhs = bvec[None, :] * (v - ecp[None, :] * ak)
    if INV:
        U = tl.dot(rhs, cf, input_precision=PREC)
    else:
        U = tl.zeros([BV, LP], tl.float32)
        for p in range(0, n):
            sel = idx == p
            coef = tl.sum(tl.where(sel[None, :], cf, 0.0), axis=1)  # [LP]: i < p
            r = tl.sum(tl.where(sel[None, :], rhs, 0.0), axis=1)
            u = r - tl.sum(U * coef[None, :], axis=1)
            U = tl.where(sel[None, :], u[:, None], U)
    return U


@triton.jit
def _store_corrections(u_ptr, wt, b, J, idx, h, H, V, rows, rmask):
    """Write a tile's solved corrections ``wt [BV, LP]`` (record slots along axis 1) into
    ``u [B, J, H, V]`` at slots < J (the solve leaves 0 at slots >= length)."""
    tl.store(u_ptr + ((b * J + idx) * H + h)[None, :] * V + rows[:, None], wt,
             mask=rmask[:, None] & (idx < J)[None, :])


@triton.jit
def _flush_tile(a_ptr, abs_ptr, ams_ptr, w_ptr, mat, b, h, rows, rmask, n, H, V, J,
                idx, live, m, eg, ecp, bvec, cf, ke, ko,
                K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
                SOLVE: tl.constexpr, A: tl.constexpr, PREC: tl.constexpr = "ieee",
                INV: tl.constexpr = False):
    """Rows ``rows`` of ``S = gamma_{1:n} A + (W * m) K`` as (even, odd) halves ``[BV, KH]``,
    and ``W [BV, LP]``, the folded values of these rows (record slots along axis 1).

    ``W`` is loaded from ``w_ptr`` (Mamba-2 v, folded cached corrections) or, with ``SOLVE``
    (GDN), solved here by forward substitution from ``v`` at ``w_ptr``:
    ``u_p = beta_p (v_p - gamma_{1:p} (A k_p)) - sum_{i<p} beta_p gamma_{i+1:p} (k_i . k_p) u_i``
    with ``A k_p`` for every slot from one FP32 dot (``cf``: the ``[i, p]`` coefficients,
    ``ecp``: ``gamma_{1:p}``). Both products over the record slots are FP32 FMA dots
    (``input_precision="ieee"``); their summation order follows the launch's register layout
    on the GPU (module docstring). ``INV``: ``cf`` holds ``(I + CF)^{-1}`` (the kernel's
    preamble) and the corrections are one product ``U = rhs (I + CF)^{-1}`` (the same formula,
    reassociated: last bits can differ from the substitution)."""
    ae, ao = _load_stored(a_ptr, abs_ptr, ams_ptr, mat, rows, rmask, V, K, KH, BV, A)
    wt = tl.load(w_ptr + ((b * J + idx) * H + h)[None, :] * V + rows[:, None],
                 mask=rmask[:, None] & live[None, :], other=0.0)  # [BV, LP]
    if SOLVE:
        ak = tl.dot(ao, tl.trans(ko), tl.dot(ae, tl.trans(ke), input_precision=PREC),
                    input_precision=PREC)  # [BV, LP]: A k_p
        wt = _solve_tile(wt, ak, bvec, ecp, cf, idx, n, BV, LP, PREC, INV)
    wm = wt * m[None, :]
    se = eg * ae + tl.dot(wm, ke, input_precision=PREC)
    so = eg * ao + tl.dot(wm, ko, input_precision=PREC)
    return se, so, wt


@triton.jit
def _flush_tile_full(a_ptr, abs_ptr, ams_ptr, w_ptr, mat, b, h, rows, rmask, n, H, V, J,
                     idx, live, m, eg, ecp, bvec, cf, kf,
                     K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
                     SOLVE: tl.constexpr, A: tl.constexpr, PREC: tl.constexpr = "ieee",
                     INV: tl.constexpr = False, a_desc=None, v0=0, TMA: tl.constexpr = False):
    """:func:`_flush_tile` on one ``[BV, K]`` tile in column order (``reconstruct="dot_full"``
    / ``"tf32x3_full"``): the same formulas with the whole keys ``kf [LP, K]`` in each dot
    instead of one dot per key half, so the anchor is loaded, and S cast and stored, as whole
    rows (``_load_full`` / ``_cast_store_full``, as the rank-1 form does). ``TMA``: an FP32,
    fp16 or bf16 anchor's rows ``v0..v0+BV-1`` (all within the matrix) come through the
    tensor descriptor ``a_desc`` over the anchor's values as ``[B*H*V, K]`` (the same values;
    in a loop over row tiles the compiler can issue the next tile's copy before this one is
    used). Returns
    ``(S [BV, K], W [BV, LP])``."""
    if TMA:  # float32, or an fp16 / bf16 anchor's values widened as _load_full does
        x = a_desc.load([(mat * V + v0).to(tl.int32), 0]).to(tl.float32)
    else:
        x = _load_full(a_ptr, abs_ptr, ams_ptr, mat, rows, rmask, V, K, KH, BV, A)
    wt = tl.load(w_ptr + ((b * J + idx) * H + h)[None, :] * V + rows[:, None],
                 mask=rmask[:, None] & live[None, :], other=0.0)  # [BV, LP]
    if SOLVE:
        ak = tl.dot(x, tl.trans(kf), input_precision=PREC)  # [BV, LP]: A k_p
        wt = _solve_tile(wt, ak, bvec, ecp, cf, idx, n, BV, LP, PREC, INV)
    wm = wt * m[None, :]
    return eg * x + tl.dot(wm, kf, input_precision=PREC), wt


@triton.jit
def _flush_tile_rank1(a_ptr, abs_ptr, ams_ptr, w_ptr, u_ptr, la_ptr, beta_ptr, k_ptr, mat, b, h,
                      g, rows, rmask, n, H, G, V, J, idx, total, eg, cf,
                      K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
                      SOLVE: tl.constexpr, STORE_U: tl.constexpr, A: tl.constexpr):
    """:func:`_flush_tile` as ``n`` rank-1 updates in slot order (``reconstruct="rank1"``), on
    one ``[BV, K]`` tile in column order: ``acc += (w_p gamma_{p+1:n}) k_p^T`` for
    ``p = 0 .. n-1``, then ``S = gamma_{1:n} A + acc``. Each record's ``w`` rows ``[BV]`` and
    key ``[K]`` are loaded as vectors in the layout of the tile, so no dot operand tile is
    held in registers and no even/odd split is shuffled through shared memory (the dot form:
    255 registers, spills and an L1-bound kernel on the H200, docs/kernels-replay.md).
    With ``SOLVE`` (GDN) slot ``p``'s correction is solved in the same pass, before it is
    folded: ``A k_p`` as a row reduction of the anchor tile, then
    ``u_p = beta_p (v_p - gamma_{1:p} A k_p) - sum_{i<p} cf[i, p] u_i`` (``cf`` as in
    :func:`_flush_tile`); ``STORE_U`` writes ``u_p`` (and 0 at slots ``n .. J-1``).
    The decay sums ``c_p = la_0 + .. + la_p`` are formed in the order of the kernel's
    preamble, so ``gamma`` has the same bits as in the dot form. The record sum runs in slot
    order whatever the launch; GDN's ``A k_p`` is a tree reduction whose order follows the tile
    layout, so GDN's corrections (and then S) can differ in last bits between launch
    configurations, as in the dot form. Returns S ``[BV, K]``."""
    x = _load_full(a_ptr, abs_ptr, ams_ptr, mat, rows, rmask, V, K, KH, BV, A)
    kk = tl.arange(0, K)
    acc = tl.zeros([BV, K], tl.float32)
    U = tl.zeros([BV, LP], tl.float32)
    c = tl.zeros([], tl.float32)
    for p in range(0, n):
        rec = (b * J + p) * H + h
        c = c + tl.load(la_ptr + rec)
        kp = tl.load(k_ptr + ((b * J + p) * G + g) * K + kk)
        wp = tl.load(w_ptr + rec * V + rows, mask=rmask, other=0.0)
        if SOLVE:
            ak = tl.sum(x * kp[None, :], axis=1)
            r = tl.load(beta_ptr + rec) * (wp - tl.exp(c) * ak)
            sel = idx == p
            coef = tl.sum(tl.where(sel[None, :], cf, 0.0), axis=1)  # [LP]: i < p
            wp = r - tl.sum(U * coef[None, :], axis=1)
            U = tl.where(sel[None, :], wp[:, None], U)
            if STORE_U:
                tl.store(u_ptr + rec * V + rows, wp, mask=rmask)
        acc += (wp * tl.exp(total - c))[:, None] * kp[None, :]
    if STORE_U:
        for p in range(n, J):
            tl.store(u_ptr + ((b * J + p) * H + h) * V + rows, tl.zeros([BV], tl.float32),
                     mask=rmask)
    return eg * x + acc


@triton.jit
def _tile_amax_full(x, rmask):
    return tl.max(tl.max(tl.where(rmask[:, None], _finite_abs(x), 0.0), axis=1), axis=0)


@triton.jit
def _tile_amax(se, so, rmask):
    fe = tl.where(rmask[:, None], _finite_abs(se), 0.0)
    fo = tl.where(rmask[:, None], _finite_abs(so), 0.0)
    return tl.maximum(tl.max(tl.max(fe, axis=1), axis=0), tl.max(tl.max(fo, axis=1), axis=0))


@triton.jit
def _packed_key(seq, fl, h, kbits, SH_HEAD: tl.constexpr, SH_SEQ: tl.constexpr,
                SH_FLUSH: tl.constexpr):
    """The anchor's stream key (copy bit 0; the read copy's is ``| 1``) of sequence id ``seq``,
    flush index ``fl`` and head ``h``, with the layer's bits ``kbits``: the packing of
    :func:`replayssm_quant.philox.stream_key` (shifts from ``STREAM_SHIFTS``)."""
    return (fl.to(tl.int64) << SH_FLUSH) | (seq.to(tl.int64) << SH_SEQ) | (h << SH_HEAD) | kbits


@triton.jit
def _flush_kernel(
        a_ptr, abs_ptr, ams_ptr,  # stored anchor (decoded with A)
        la_ptr, w_ptr, k_ptr, len_ptr,  # records [B,J,H], [B,J,H,V], [B,J,G,K]; length [B]
        beta_ptr, u_ptr,  # SOLVE (GDN): beta [B,J,H]; solved corrections out [B,J,H,V]
        sta_ptr, str_ptr, seed,  # stream keys [B*H] of the anchor / read casts (KEYS_IN:
        kbits,  # sequence ids [B] / flush indices [B], and the layer's key bits)
        oa_ptr, oabs_ptr, oams_ptr,  # new anchor: codes, block scales, matrix scale
        or_ptr, orbs_ptr, orms_ptr,  # new read copy
        s_ptr, q_ptr, y_ptr,  # S [B,H,V,K] (STORE_S); q [B,G,K] -> y = S q [B,H,V] (Q_OUT)
        amax_ptr,  # int32 [B*H]: float32 bits of the matrix amax (PHASE 1 max-es, PHASE 2 reads)
        H, G, V, J, a_desc,  # a_desc: TMA, the anchor values as [B*H*V, K] (else unused)
        K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
        TWO: tl.constexpr, STORE_S: tl.constexpr, Q_OUT: tl.constexpr,
        NEED_AMAX: tl.constexpr, SOLVE: tl.constexpr, LOOP: tl.constexpr,
        SINGLE: tl.constexpr, PHASE: tl.constexpr,
        A: tl.constexpr, CA: tl.constexpr, CR: tl.constexpr,
        RANK1: tl.constexpr = False, PREC: tl.constexpr = "ieee", INV: tl.constexpr = False,
        KEYS_IN: tl.constexpr = False, FULL: tl.constexpr = False,
        AMAX_OUT: tl.constexpr = False, STORE_W: tl.constexpr = True,
        TMA: tl.constexpr = False, LOOP_STAGES: tl.constexpr = None,
        SH_HEAD: tl.constexpr = 1, SH_SEQ: tl.constexpr = 19, SH_FLUSH: tl.constexpr = 39):
    # A: DecodeConsts of the stored anchor; CA, CR: CastConsts of the anchor and read casts.
    # LOOP: this program walks every row tile of its matrix (grid (B*H, 1)); else it takes
    # tile program_id(1). SINGLE: one tile covers the matrix (BV >= V). PHASE 0: everything;
    # 1: matrix amax only (atomic max); 2: casts with the amax of phase 1. AMAX_OUT (PHASE 0,
    # no matrix-scaled copy): also the finite amax of the S it writes, atomic max into amax_ptr.
    # STORE_W (PHASE 0 with SOLVE): write the solved corrections to u_ptr (FlushResult.w).
    # TMA: the anchor tiles (FP32, fp16, bf16) through the descriptor a_desc; LOOP_STAGES:
    # the cast pass's row-tile loop's pipeline depth (None: the launch's num_stages).
    mat = tl.program_id(0).to(tl.int64)
    vt = tl.program_id(1)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    n = tl.load(len_ptr + b)
    key_a = 0
    key_r = 0
    if KEYS_IN:  # the stream keys of philox.stream_key, packed here (no host work)
        kb = _packed_key(tl.load(sta_ptr + b), tl.load(str_ptr + b), h, kbits, SH_HEAD, SH_SEQ,
                         SH_FLUSH)
        key_a = kb  # copy bit 0: the anchor
        key_r = kb | 1  # copy bit 1: the read copy
    if LOOP:
        v_lo = 0
        v_hi = V
    else:
        v_lo = vt * BV
        v_hi = v_lo + 1

    # ---- the records of this (sequence, head), once per program
    idx = tl.arange(0, LP)
    live = idx < n
    la = tl.load(la_ptr + (b * J + idx) * H + h, mask=live, other=0.0)  # one vector load
    c = tl.zeros([LP], tl.float32)
    total = tl.zeros([], tl.float32)
    for jj in tl.static_range(LP):  # sequential sums c_p = sum_{j<=p} la_j (0 added past n)
        total = total + tl.sum(tl.where(idx == jj, la, 0.0), axis=0)
        c = tl.where(idx == jj, total, c)
    m = tl.where(live, tl.exp(total - c), 0.0)  # gamma_{j+1:n}
    eg = tl.exp(total)
    jh = tl.arange(0, KH)
    kbase = k_ptr + ((b * J + idx) * G + g)[:, None] * K + 2 * jh[None, :]
    ke = tl.load(kbase, mask=live[:, None], other=0.0)  # [LP, KH]: even / odd key columns
    ko = tl.load(kbase + 1, mask=live[:, None], other=0.0)
    kf = ke  # FULL: the whole keys [LP, K]
    if FULL:
        kf = tl.load(k_ptr + ((b * J + idx) * G + g)[:, None] * K + tl.arange(0, K)[None, :],
                     mask=live[:, None], other=0.0)
    if SOLVE:
        bvec = tl.load(beta_ptr + (b * J + idx) * H + h, mask=live, other=0.0)
        kk = tl.dot(ko, tl.trans(ko), tl.dot(ke, tl.trans(ke), input_precision="ieee"),
                    input_precision="ieee")  # [i, p]: k_i . k_p
        before = idx[:, None] < idx[None, :]
        cf = tl.where(before, (bvec[None, :] * tl.exp(tl.where(before, c[None, :] - c[:, None],
                                                               0.0))) * kk, 0.0)
        if INV:  # (I + CF)^{-1} once per program (records kernel's row recursion)
            cf = _unit_upper_inverse(cf, idx, n, LP, 1, 0, "ieee")
        ecp = tl.exp(c)
    else:
        bvec = m
        cf = m
        ecp = m
    if Q_OUT:
        qv = tl.load(q_ptr + (b * G + g) * K + tl.arange(0, K))
        qe, qo = tl.split(tl.reshape(qv, [KH, 2]))

    # ---- the matrix amax (formats with a matrix scale), unless one tile covers the matrix
    amax = tl.zeros([], tl.float32)
    if PHASE == 2:
        amax = tl.load(amax_ptr + mat).to(tl.float32, bitcast=True)
    if NEED_AMAX and (not SINGLE) and PHASE != 2:
        for v0 in range(v_lo, v_hi, BV):
            rows = v0 + tl.arange(0, BV)
            rmask = rows < V
            if RANK1:  # phase 1 stores the corrections, for phase 2 (and FlushResult.w)
                x = _flush_tile_rank1(a_ptr, abs_ptr, ams_ptr, w_ptr, u_ptr, la_ptr, beta_ptr,
                                      k_ptr, mat, b, h, g, rows, rmask, n, H, G, V, J, idx,
                                      total, eg, cf, K, KH, BV, LP, SOLVE,
                                      SOLVE and PHASE == 1, A)
                amax = tl.maximum(amax, _tile_amax_full(x, rmask))
            elif FULL:
                x, wt = _flush_tile_full(a_ptr, abs_ptr, ams_ptr, w_ptr, mat, b, h, rows, rmask,
                                         n, H, V, J, idx, live, m, eg, ecp, bvec, cf, kf,
                                         K, KH, BV, LP, SOLVE, A, PREC, INV, a_desc, v0, TMA)
                if SOLVE and PHASE == 1:  # the corrections, for phase 2 (and FlushResult.w)
                    _store_corrections(u_ptr, wt, b, J, idx, h, H, V, rows, rmask)
                amax = tl.maximum(amax, _tile_amax_full(x, rmask))
            else:
                se, so, wt = _flush_tile(a_ptr, abs_ptr, ams_ptr, w_ptr, mat, b, h, rows, rmask,
                                         n, H, V, J, idx, live, m, eg, ecp, bvec, cf, ke, ko,
                                         K, KH, BV, LP, SOLVE, A, PREC, INV)
                if SOLVE and PHASE == 1:  # the corrections, for phase 2 (and FlushResult.w)
                    _store_corrections(u_ptr, wt, b, J, idx, h, H, V, rows, rmask)
                amax = tl.maximum(amax, _tile_amax(se, so, rmask))
        if PHASE == 1:  # amax >= 0: its float32 bits order as int32
            tl.atomic_max(amax_ptr + mat, amax.to(tl.int32, bitcast=True))

    # ---- reconstruct, write S / y / corrections, cast A and R
    if PHASE != 1:
        out_amax = tl.zeros([], tl.float32)  # AMAX_OUT: the finite amax of this program's S
        for v0 in tl.range(v_lo, v_hi, BV, num_stages=LOOP_STAGES):
            rows = v0 + tl.arange(0, BV)
            rmask = rows < V
            if RANK1 or FULL:  # one [BV, K] tile in column order
                if FULL:
                    if SOLVE and PHASE == 2:  # fold the corrections phase 1 solved
                        x, wt = _flush_tile_full(a_ptr, abs_ptr, ams_ptr, u_ptr, mat, b, h, rows,
                                                 rmask, n, H, V, J, idx, live, m, eg, ecp, bvec,
                                                 cf, kf, K, KH, BV, LP, False, A, PREC, INV,
                                                 a_desc, v0, TMA)
                    else:
                        x, wt = _flush_tile_full(a_ptr, abs_ptr, ams_ptr, w_ptr, mat, b, h, rows,
                                                 rmask, n, H, V, J, idx, live, m, eg, ecp, bvec,
                                                 cf, kf, K, KH, BV, LP, SOLVE, A, PREC, INV,
                                                 a_desc, v0, TMA)
                    if SOLVE and PHASE == 0 and STORE_W:
                        _store_corrections(u_ptr, wt, b, J, idx, h, H, V, rows, rmask)
                elif SOLVE and PHASE == 2:  # fold the corrections phase 1 solved (the same bits)
                    x = _flush_tile_rank1(a_ptr, abs_ptr, ams_ptr, u_ptr, u_ptr, la_ptr,
                                          beta_ptr, k_ptr, mat, b, h, g, rows, rmask, n, H, G,
                                          V, J, idx, total, eg, cf, K, KH, BV, LP, False, False,
                                          A)
                else:
                    x = _flush_tile_rank1(a_ptr, abs_ptr, ams_ptr, w_ptr, u_ptr, la_ptr,
                                          beta_ptr, k_ptr, mat, b, h, g, rows, rmask, n, H, G,
                                          V, J, idx, total, eg, cf, K, KH, BV, LP, SOLVE,
                                          SOLVE and PHASE == 0 and STORE_W, A)
                if NEED_AMAX and SINGLE:
                    amax = _tile_amax_full(x, rmask)
                if AMAX_OUT:
                    out_amax = tl.maximum(out_amax, _tile_amax_full(x, rmask))
                sa = _matrix_scale(amax, CA.KIND, CA.FMAX, CA.SCALE)
                sr = _matrix_scale(amax, CR.KIND, CR.FMAX, CR.SCALE)
                if STORE_S:
                    kk2 = tl.arange(0, K)
                    tl.store(s_ptr + (mat * V + rows.to(tl.int64))[:, None] * K + kk2[None, :],
                             x, mask=rmask[:, None])
                if Q_OUT:
                    tl.store(y_ptr + mat * V + rows, tl.sum(x * qv[None, :], axis=1), mask=rmask)
                _cast_store_full(x, rows, rmask, mat, V, sa, seed, sta_ptr, oa_ptr, oabs_ptr, K,
                                 KH, BV, CA, key_a, KEYS_IN)
                if TWO:
                    _cast_store_full(x, rows, rmask, mat, V, sr, seed, str_ptr, or_ptr, orbs_ptr,
                                     K, KH, BV, CR, key_r, KEYS_IN)
            else:
                if SOLVE and PHASE == 2:  # fold the corrections phase 1 solved (the same bits)
                    se, so, wt = _flush_tile(a_ptr, abs_ptr, ams_ptr, u_ptr, mat, b, h, rows,
                                             rmask, n, H, V, J, idx, live, m, eg, ecp, bvec, cf,
                                             ke, ko, K, KH, BV, LP, False, A, PREC, INV)
                else:
                    se, so, wt = _flush_tile(a_ptr, abs_ptr, ams_ptr, w_ptr, mat, b, h, rows,
                                             rmask, n, H, V, J, idx, live, m, eg, ecp, bvec, cf,
                                             ke, ko, K, KH, BV, LP, SOLVE, A, PREC, INV)
                if SOLVE and PHASE == 0 and STORE_W:
                    _store_corrections(u_ptr, wt, b, J, idx, h, H, V, rows, rmask)
                if NEED_AMAX and SINGLE:
                    amax = _tile_amax(se, so, rmask)
                if AMAX_OUT:
                    out_amax = tl.maximum(out_amax, _tile_amax(se, so, rmask))
                sa = _matrix_scale(amax, CA.KIND, CA.FMAX, CA.SCALE)
                sr = _matrix_scale(amax, CR.KIND, CR.FMAX, CR.SCALE)
                if STORE_S:
                    x = tl.reshape(tl.join(se, so), [BV, K])
                    kk2 = tl.arange(0, K)
                    tl.store(s_ptr + (mat * V + rows.to(tl.int64))[:, None] * K + kk2[None, :], x,
                             mask=rmask[:, None])
                if Q_OUT:
                    y = tl.sum(se * qe[None, :], axis=1) + tl.sum(so * qo[None, :], axis=1)
                    tl.store(y_ptr + mat * V + rows, y, mask=rmask)
                _cast_store(se, so, rows, rmask, mat, V, sa, seed, sta_ptr, oa_ptr, oabs_ptr, K, KH,
                            BV, CA, key_a, KEYS_IN)
                if TWO:
                    _cast_store(se, so, rows, rmask, mat, V, sr, seed, str_ptr, or_ptr, orbs_ptr, K,
                                KH, BV, CR, key_r, KEYS_IN)
            if v0 == 0:  # the matrix scales, once
                if CA.MS:
                    tl.store(oams_ptr + mat, sa)
                if TWO:
                    if CR.MS:
                        tl.store(orms_ptr + mat, sr)
        if AMAX_OUT:  # out_amax >= 0: its float32 bits order as int32 (a max: order-free)
            tl.atomic_max(amax_ptr + mat, out_amax.to(tl.int32, bitcast=True))


# ----------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------


def flush_kernel(anchor, la, w, k, length, policy, *, seed: int, layer: int, sequence_ids,
                 flush_index, q=None, store_state: bool = True, block_v: int | None = None,
                 num_warps: int | None = None, variant: str | None = None,
                 beta=None, dequantize: bool = True, keys_in_kernel: bool | None = None,
                 reconstruct: str | None = None, solve_form: str | None = None,
                 split_casts: bool | None = None, cast_form: str | None = None,
                 maxnreg: int | None = None, flush_amax: bool | None = None,
                 amax_out: torch.Tensor | None = None, return_w: bool = True,
                 anchor_tma: bool | None = None, loop_stages: int | None = None):
    """Kernel of :func:`core.flush` (with the records masked to ``length``): reconstruct S from
    the stored anchor (PackedTensor or float32 ``[B, H, V, K]``) and the records
    ``la [B,J,H]``, ``w [B,J,H,V]``, grouped ``k [B,J,G,K]`` (slots ``< length[b]``), then
    ``A <- Q_rec(S)`` and ``R <- Q_read(S)`` independently in the same kernel (one cast for
    single-checkpoint policies), SR streams from :func:`checkpoint_streams`.

    With ``beta [B,J,H]`` (GDN) ``w`` holds the values ``v`` and the kernel first solves the
    corrections against the anchor (:func:`core.solve_corrections`, every live row) for each
    tile of value rows, then folds them; ``FlushResult.w`` is then the solved corrections
    ``[B, J, H, V]`` (zero at slots ``>= length``).

    ``block_v`` (value rows per tile, a power of two >= 16), ``num_warps`` and ``variant``
    (:data:`FLUSH_VARIANTS`) choose the launch; None takes :func:`flush_config`. On the
    interpreter and on exact inputs A and R do not depend on them; on the H200 the FP32
    dot's summation order follows the register layout, so some configurations give S (and
    then A, R) that differ in last bits (``flush_tune_h200.json``: 8 of 38 configurations,
    all GDN, whose fused correction solve is a dot).
    A given configuration is deterministic and independent of B and batch position.
    ``dequantize=False`` skips the wrapper's torch dequantisation of the new copies
    (``Checkpoints.anchor`` / ``.read`` are then None; the stored forms are returned).
    ``reconstruct`` (:data:`RECONSTRUCT_FORMS`) chooses how a tile folds the records:
    ``"dot"`` FP32 FMA dots (``input_precision="ieee"``); ``"rank1"`` one rank-1 update per
    slot in slot order (no dot operand tiles; :func:`_flush_tile_rank1`); ``"tf32x3"`` the dot
    form on tensor cores with split operands (error about 2^-21 relative per product instead of
    FP32's 2^-24; at B = 256 on the H200 S was within 4.8e-7 of the float32 torch reference,
    the FP32 dot within 9.5e-7: ``flush_tune_h200.json`` reference checks). A and R are always
    the casts of the kernel's own S, bit for bit.
    ``solve_form`` (:data:`FLUSH_SOLVE_FORMS`; GDN with ``beta`` and the dot forms only;
    default: :func:`flush_config`'s, ``"inverse"`` for V > 64, else ``"substitution"``; with
    ``reconstruct="rank1"`` always ``"substitution"``): ``"inverse"`` inverts the unit
    triangular system ``I + CF`` of the corrections (DESIGN.md section 3; ``CF[i, p] = beta_p
    gamma_{i+1:p} (k_i . k_p)``, ``i < p``) once per program on ``[LP, LP]`` scalars (the
    row recursion of the records kernel, :func:`records._unit_upper_inverse`) and forms every
    row tile's corrections as one product ``rhs (I + CF)^{-1}`` instead of ``length`` dependent
    steps per row tile; the same formula reassociated (S within the same tolerance of the
    reference; A and R the casts of the kernel's own S). On the H200 at B = 256 the GDN
    ``fp32`` flush takes 1.16 instead of 1.72 ms (``flush_tune_inverse_h200.json``).
    ``keys_in_kernel`` (default True) packs the SR stream keys inside the kernel from the
    sequence ids and flush indices: the keys of :func:`checkpoint_streams`, with no host work
    and no extra key launches (``layer`` and the head count are range-checked on the host, the
    per-sequence fields by one device-side assertion, ``torch._assert_async``, which raises at
    the next synchronisation on CUDA and at once on CPU). On the H200 the same A and R bytes
    (``flush_tune_h200.json``) and up to 0.5 ms less per B = 256 flush than the device-built
    keys. ``False`` takes the keys of :func:`checkpoint_streams`. Both apply to the fused
    casts; the split casts (below) ignore it.

    ``split_casts`` (default: :func:`flush_splits_casts`, True for policies with a
    matrix-scaled copy): the flush of the ``fp32`` policy writes S (its launch: the ``fp32``
    default of :func:`flush_config`, or the options given, which then apply to that flush),
    then the quantizer kernels cast it to A and R (``cast_form``, below) with the same stream
    keys (:func:`checkpoint_streams`), so the same bytes as the fused casts of that S. Each
    launch then holds fewer registers than the fused one (GDN nvfp4: 255 and a stack), at
    the cost of a float32 S in memory (B H V K x 4 bytes, 0.5 GiB at GDN's B = 256) and the
    casts' reads of it (``keys_in_kernel`` is ignored: the
    split's fp32 flush range-checks the per-sequence fields on the device, and
    :func:`_split_keys` builds the casts' keys in one launch). With an fp32 copy and
    ``store_state``, ``FlushResult.state`` is that copy's tensor (as in the torch
    reference). ``False`` forces the fused flush (what ``flush_tune.py`` tunes without
    ``--split-casts``).
    On the H200 at B = 256 (``flush_split_tile4_6fff29d_h200.json``,
    ``flush_policies_{fused,split}_cf42d3a_h200.json``; docs/kernels-replay.md "Ninth pass"),
    split against fused, GDN / Mamba-2, in us: ``read:nvfp4/rec:fp16+sr`` 1624 / 2116 against
    2635 / 2907, ``read:nvfp4/rec:fp16`` 1550 / 1954 against 2507 / 2728, but
    ``shared:fp16+sr`` 1429 / 1772 against 1375 / 1189; hence the default.

    ``cast_form`` (:data:`CAST_FORMS`; split casts only, else it must be None): how the split
    casts S. ``"pair"``: one launch of
    :func:`~replayssm_quant.kernels.quant.pack_pair_triton` writes both copies, casting each
    tile of S once it is loaded (after the matrix-amax pass); ``"pair_lean"`` (the default
    for an NVFP4 copy beside an fp32, fp16 or bf16 one, or alone, since the twenty-eighth
    pass: :func:`split_cast_form`) and ``"pair_lean_rcp"`` the same launch in its lean forms
    (``pack_pair_triton(form="lean")`` / ``"lean_rcp"``, the same bytes in fewer
    instructions). ``"separate"``: one
    :func:`~replayssm_quant.kernels.quant.pack_triton` per copy (the nvfp4 one makes its own
    amax pass over S). The same bytes either way (``test_flush_cast_forms_same_bytes``); on
    the H200 at B = 256 (``flush_parts_h200.json``, docs/kernels-replay.md, "Twenty-second
    pass") the pair form reads S twice (once from L2, in part) instead of three times.

    ``flush_amax`` (split casts in a pair form only; default :func:`split_flush_amax`): the
    split's ``fp32`` flush also takes each matrix's finite amax of the S it writes (a max per
    tile, then one integer ``atomic_max`` on the float32 bits per program: exact and
    order-free, so the same value in any launch, batch or order), and the pair cast takes it
    (``pack_pair_triton(matrix_amax=...)``) instead of its own amax pass over S: S is read
    once instead of twice. The same bytes (``test_flush_cast_forms_same_bytes``).
    ``amax_out`` (a contiguous int32 tensor ``[B * H]`` on the device, overwritten; flushes
    without a matrix-scaled copy and without split casts only): receives those float32 bits
    (what the split flush passes its ``fp32`` flush).

    ``maxnreg``: a per-thread register cap (None or an int in [16, 255]) for the flush
    kernel's launches, on CUDA only; it changes the register allocation, not the arithmetic.
    Default None: no cap, except that a split flush's fp32 flush takes
    :func:`split_flush_maxnreg`. Another value raises ValueError naming it.

    ``return_w`` (default True): ``FlushResult.w`` holds the folded values (GDN: the solved
    corrections, or the cached ones masked to ``length`` by :func:`gdn_flush_kernel`).
    ``False`` (a serving engine's flush, which never reads them): ``FlushResult.w`` is None,
    and a GDN solve does not write its corrections out (one ``[B, J, H, V]`` FP32 write
    less; the two-phase launch of a matrix-scaled copy on a grid of row tiles still keeps
    them between its phases). S, y and the copies are the same bits either way.

    ``anchor_tma`` (None, True or False; 2026-12-05, thirty-fifth pass): a float32 anchor's
    row tiles (or an fp16 / bf16 stored anchor's values, widened to float32 as the ordinary
    loads widen them) are loaded through a TMA tensor descriptor over the anchor viewed as
    ``[B * H * V, K]`` (``triton.tools.tensor_descriptor.TensorDescriptor``) instead of
    ordinary loads, so that in the ``loop`` variant the compiler's software pipeline can
    issue the next tile's copy into shared memory while a tile is folded (static sm_90 SASS
    at ba7376e, Triton 3.9, has the ordinary loads as ``LDG`` at the top of each iteration).
    The same values are loaded, but on CUDA the descriptor's tiles may reach the registers in
    another layout and the FP32 dot's summation order follows the layout, so S, y and the
    copies may differ from the ordinary loads' in last bits (on an H100,
    ``flush_tma_r3_2996ba7_h100.json``: GDN's correction solve gave the same bits, GDN's fold
    and Mamba-2's flush other bits); on the interpreter the same bits. The copies are always
    the casts of the launch's own S, and a given choice is fixed per shape, format and device,
    so results stay batch-invariant. Default None: for a flush that writes S alone (the
    ``fp32`` policy's flush, and the first launch of a split flush, which every policy with a
    matrix-scaled copy runs), :func:`flush_anchor_tma` (the descriptor with its pipeline
    depth where :data:`FLUSH_ANCHOR_TMA` has the key, at present GDN's correction solve
    against an FP32 anchor at 128 x 128, as under ``read:nvfp4/rec:fp32``, on a device of
    capability 9.0 or more: 905-933 -> 630-641 us at B = 256 on an H100, the same bits;
    flushes that cast in the kernel, e.g. ``read:bf16/rec:fp32``'s, are untimed with it and
    keep the ordinary loads; the launch's values
    are first 16-byte aligned by a copy if they are not; a launch option
    that the descriptor cannot take, a ``reconstruct`` form that is not whole-tile or a
    ``block_v`` not dividing V, leaves the ordinary loads, and so do 2^31 rows or more, B >=
    524288 with 32 heads of 128 rows, where the H100 gave the two the same bits), else the
    ordinary loads. With
    split casts it applies to the split's ``fp32`` flush (which reads the anchor). ``True``
    needs a float32 anchor tensor or an fp16 / bf16 stored one, whose storage starts on a
    16-byte boundary, a whole-tile form of ``reconstruct`` (``"dot_full"`` /
    ``"tf32x3_full"``), ``block_v`` dividing V, fewer than 2^31 rows, and a CUDA device of
    capability 9.0 or more (or the interpreter); refused by name otherwise.
    ``loop_stages`` (None or an int in [1, 8]; default None: the launch's ``num_stages``,
    :data:`FLUSH_NUM_STAGES`, or :func:`flush_anchor_tma`'s depth where the default takes the
    descriptor): the software-pipeline depth of the cast pass's loop over row tiles
    (``tl.range(..., num_stages=loop_stages)``), which with ``anchor_tma`` keeps
    ``loop_stages - 1`` tiles' copies in flight (static sm_90 SASS at 2 or 3, Triton 3.9:
    the copies of the next tiles issued before the wait; with the default, none). It changes
    the schedule, not the operations (the bits: as for ``anchor_tma``); it has no effect where
    a program has one row tile (``variant="grid"``, or ``block_v >= V``) and does not apply
    to the amax pass of a matrix-scaled copy; with split casts, to the split's ``fp32``
    flush. ``benchmarks/flush_tma.py`` times both.

    Raises ValueError for a bad option (naming it); the range of ``length`` and of the
    per-sequence key fields is checked on the device (one launch and one
    ``torch._assert_async``: RuntimeError at once on the CPU, at the next synchronisation
    on CUDA).

    Returns ``(FlushResult, y)``: ``FlushResult.state`` is S when ``store_state`` (else None),
    its checkpoints hold the stored copies (PackedTensor, or the float32 tensor for ``fp32``)
    and their dequantised values; ``y = S q [B, H, V]`` when ``q [B, G, K]`` is given."""
    policy = require_policy(policy)  # parsed at the edges
    if not isinstance(return_w, bool):
        raise ValueError(f"return_w must be True or False, got {return_w!r}")
    if anchor_tma is not None and not isinstance(anchor_tma, bool):
        raise ValueError(f"anchor_tma must be None, True or False, got {anchor_tma!r}")
    if loop_stages is not None and (isinstance(loop_stages, bool)
                                    or not isinstance(loop_stages, int)
                                    or not 1 <= loop_stages <= 8):
        raise ValueError(f"loop_stages must be None or an int in [1, 8], got {loop_stages!r}")
    maxnreg = _check_maxnreg("maxnreg", maxnreg)
    B, H, V, K = (int(x) for x in anchor.shape)
    two = not policy.single_checkpoint
    if split_casts is None:
        split_casts = flush_splits_casts(policy)
    splits = split_casts and not (policy.rec.is_identity
                                  and (not two or policy.read.is_identity))
    if flush_amax is not None and not isinstance(flush_amax, bool):
        raise ValueError(f"flush_amax must be None, True or False, got {flush_amax!r}")
    if splits and amax_out is not None:
        raise ValueError(f"amax_out applies to a flush without split casts; {policy} splits "
                         f"its casts (pass split_casts=False or amax_out=None)")
    if splits:
        form = split_cast_form(policy, cast_form)
        if flush_amax is None:
            flush_amax = form in _PAIR_CAST_FORMS and split_flush_amax(policy)
        if flush_amax and form not in _PAIR_CAST_FORMS:
            raise ValueError(f"flush_amax=True needs a pair cast form {tuple(_PAIR_CAST_FORMS)}"
                             f", got cast_form={form!r}")
        return _split_flush(anchor, la, w, k, length, policy, seed=seed, layer=layer,
                            sequence_ids=sequence_ids, flush_index=flush_index, q=q,
                            store_state=store_state, block_v=block_v, num_warps=num_warps,
                            variant=variant, beta=beta, dequantize=dequantize,
                            keys_in_kernel=keys_in_kernel, reconstruct=reconstruct,
                            solve_form=solve_form, cast_form=form, flush_amax=flush_amax,
                            return_w=return_w, anchor_tma=anchor_tma,
                            loop_stages=loop_stages,
                            maxnreg=(split_flush_maxnreg(anchor, beta is not None)
                                     if maxnreg is None else maxnreg))
    if cast_form is not None:
        raise ValueError(f"cast_form={cast_form!r} applies to split casts only (this flush of "
                         f"{policy} does not split its casts); pass None")
    if flush_amax:
        raise ValueError(f"flush_amax=True applies to split casts only (this flush of {policy} "
                         f"does not split its casts)")
    need_amax = flush_needs_amax(policy)
    if amax_out is not None:
        if need_amax:
            raise ValueError(f"amax_out applies to a flush without a matrix-scaled copy; "
                             f"{policy} has one (its matrix amax is internal)")
        if not (isinstance(amax_out, torch.Tensor) and amax_out.dtype == torch.int32
                and tuple(amax_out.shape) == (B * H,) and amax_out.device == w.device
                and amax_out.is_contiguous()):
            got = (f"dtype {amax_out.dtype}, shape {tuple(amax_out.shape)}, device "
                   f"{amax_out.device}, contiguous {amax_out.is_contiguous()}"
                   if isinstance(amax_out, torch.Tensor) else type(amax_out).__name__)
            raise ValueError(f"amax_out must be a contiguous int32 tensor of shape "
                             f"({B * H},) on {w.device}, got {got}")
    (a, abs_, ams), aspec = _stored_args(anchor)
    _check_supported(K, w.dtype)
    where = "flush_kernel"
    J, G = _check_records(where, la, w, k, beta, B, H, V, K, w_name="w (v)")
    variant, block_v, num_warps, reconstruct, solve_form = flush_launch(
        V, need_amax, beta is not None, J, variant=variant, block_v=block_v,
        num_warps=num_warps, reconstruct=reconstruct, solve_form=solve_form)
    if anchor_tma is None:  # the default: FLUSH_ANCHOR_TMA where its launch can take it,
        # for a flush that writes S alone (the fp32 policy's, the split flush's first launch)
        fp32_only = policy.single_checkpoint and policy.rec.is_identity
        depth = flush_anchor_tma(anchor, beta is not None) if fp32_only else None
        anchor_tma = depth is not None and _anchor_tma_refusal(
            anchor, a, reconstruct, block_v, V, B * H * V, address=False) is None
        if anchor_tma:
            if loop_stages is None:
                loop_stages = depth
            if a.data_ptr() % 16:  # the same loads at any address (a is contiguous)
                a = a.clone()
    if anchor_tma:
        refusal = _anchor_tma_refusal(anchor, a, reconstruct, block_v, V, B * H * V)
        if refusal is not None:
            raise ValueError(refusal)
    tma = anchor_tma and B * H * V > 0  # an empty batch launches nothing to load
    if q is not None:
        _check_f32(where, "q", q, (B, G, K))
    _check_index(where, "length", length, B)
    _check_index(where, "sequence_ids", sequence_ids, B)
    _check_index(where, "flush_index", flush_index, B, allow_scalar=True)
    # (sequence_ids and flush_index may stay on the host: the key code moves them)
    _check_devices(where, anchor=anchor, la=la, w=w, k=k, beta=beta, q=q, length=length)
    # device-side checks: one range-check launch and one assertion (no host sync)
    checks = [(length, 0, J)]
    msg = f"{where}: length must be in [0, J = {J}] (the record slots)"
    dev = w.device
    if keys_in_kernel is None:
        keys_in_kernel = True
    if keys_in_kernel:
        sa, sr, kbits, key_consts = _key_fields(layer, sequence_ids, flush_index, B, H, dev)
        key_consts["KEYS_IN"] = True
        width = dict(STREAM_FIELDS)  # the per-sequence fields: 0 <= x < 2^w
        checks += [(sa, 0, 2 ** width["sequence"] - 1), (sr, 0, 2 ** width["flush"] - 1)]
        msg += (f", sequence_ids in [0, 2^{width['sequence']}) and flush_index in "
                f"[0, 2^{width['flush']})")
    else:
        sa, sr = checkpoint_streams(layer=layer, sequence_ids=sequence_ids, heads=H,
                                    flush_index=flush_index)
        kbits, key_consts = 0, {}
    _assert_ranges(msg, *checks)
    shape = (B, H, V, K)
    bufa = _alloc_copy(policy.rec, shape, dev)
    bufr = _alloc_copy(policy.read, shape, dev) if two else bufa
    S = torch.empty(shape, dtype=torch.float32, device=dev) if store_state else bufa[0]
    y = torch.empty(B, H, V, dtype=torch.float32, device=dev) if q is not None else bufa[0]
    qq = q.contiguous() if q is not None else bufa[0]
    solve = beta is not None
    single = block_v >= V
    loop = variant == "loop"
    two_phase = need_amax and not loop and not single  # phase 2 reads phase 1's corrections
    # the kernel writes every slot (0 at >= length) where it stores the corrections
    u = torch.empty_like(w) if solve and (return_w or two_phase) else w
    if J == 0:  # no records: S = A; keep shapes valid for the kernel
        la = torch.zeros(B, 1, H, dtype=torch.float32, device=dev)
        w = torch.zeros(B, 1, H, V, dtype=torch.float32, device=dev)
        k = torch.zeros(B, 1, G, K, dtype=torch.float32, device=dev)
        beta = torch.zeros(B, 1, H, dtype=torch.float32, device=dev) if solve else None
        length = torch.zeros_like(length)
        J = 1
    u_arg = (u if u.shape[1] == J else torch.empty_like(w)) if solve else w  # w: unused pointer
    tiles = 1 if (loop or single) else triton.cdiv(V, block_v)
    if amax_out is not None:
        amax = amax_out
        amax.zero_()
    else:
        amax = (torch.zeros(B * H, dtype=torch.int32, device=dev) if need_amax
                else torch.empty(1, dtype=torch.int32, device=dev))  # unused: no fill launch
    pick = lambda t, d: t if t is not None else d  # noqa: E731
    args = (a, abs_, ams, la.contiguous(), w.contiguous(), k.contiguous(), length,
            beta.contiguous() if solve else la, u_arg,
            stream_keys_to(sa.reshape(-1).contiguous(), dev),
            stream_keys_to(sr.reshape(-1).contiguous(), dev), int(seed), kbits,
            bufa[0], pick(bufa[1], bufa[0]), pick(bufa[2], bufa[0]),
            bufr[0], pick(bufr[1], bufr[0]), pick(bufr[2], bufr[0]),
            S, qq, y, amax, H, G, V, J, _anchor_desc(a, block_v, K) if tma else None)
    consts = dict(K=K, KH=K // 2, BV=block_v, LP=_lp(J), TWO=two, STORE_S=store_state,
                  Q_OUT=q is not None, NEED_AMAX=need_amax, SOLVE=solve, LOOP=loop,
                  SINGLE=single, RANK1=reconstruct == "rank1",
                  FULL=reconstruct.endswith("_full"),
                  PREC="tf32x3" if reconstruct.startswith("tf32x3") else "ieee",
                  num_warps=num_warps,
                  INV=solve and solve_form == "inverse", num_stages=FLUSH_NUM_STAGES,
                  A=_decode_consts(aspec), AMAX_OUT=amax_out is not None,
                  STORE_W=solve and return_w, TMA=tma, LOOP_STAGES=loop_stages,
                  CA=_cast_consts(policy.rec), CR=_cast_consts(policy.read if two else policy.rec),
                  **key_consts)
    cap = _maxnreg_launch(maxnreg)
    if two_phase:  # grid: amax launch, then the cast launch
        _flush_kernel[(B * H, tiles)](*args, PHASE=1, **consts, **cap)
        _flush_kernel[(B * H, tiles)](*args, PHASE=2, **consts, **cap)
    else:
        _flush_kernel[(B * H, tiles)](*args, PHASE=0, **consts, **cap)
    if solve and return_w and u_arg is not u:
        u.zero_()  # J == 0
    a_st = _as_stored(policy.rec, shape, bufa)
    r_st = _as_stored(policy.read, shape, bufr) if two else a_st
    cps = _checkpoints(a_st, r_st, two, dequantize)
    res = FlushResult(S if store_state else None, cps,
                      (u if solve else w) if return_w else None)
    return res, (y if q is not None else None)


def _anchor_tma_refusal(anchor, a, reconstruct: str, block_v: int, V: int, rows: int,
                        address: bool = True) -> str | None:
    """Why a TMA descriptor cannot load the anchor's tiles in this launch (the message of
    :func:`flush_kernel`'s refusal of ``anchor_tma=True``, naming what is wrong), or None;
    ``address=False`` leaves out the storage's alignment (the default path copies a
    misaligned anchor instead)."""
    plain = (isinstance(anchor, PackedTensor) and anchor.block_scales is None
             and anchor.matrix_scale is None
             and a.dtype in (torch.float32, torch.float16, torch.bfloat16))
    if not (plain or (isinstance(anchor, torch.Tensor) and anchor.dtype == torch.float32)):
        return (f"anchor_tma needs an anchor of fp32, fp16 or bf16 values without scales, "
                f"got {anchor.spec if isinstance(anchor, PackedTensor) else anchor.dtype}")
    if not reconstruct.endswith("_full"):
        return (f"anchor_tma needs a whole-tile form of reconstruct ('dot_full' or "
                f"'tf32x3_full'), got {reconstruct!r}")
    if V % block_v:
        return f"anchor_tma needs block_v dividing V: {block_v} does not divide V = {V}"
    if rows >= 2 ** 31:
        return f"anchor_tma addresses rows with int32: B * H * V = {rows} >= 2^31"
    if address and a.data_ptr() % 16:
        return (f"anchor_tma needs the anchor's storage on a 16-byte boundary, got address "
                f"{a.data_ptr():#x} (a view at an odd offset; pass a copy)")
    if a.is_cuda and not KERNELS_INTERPRETED and not _tma_capable(a):
        return (f"anchor_tma needs a CUDA device of capability 9.0 or more (TMA), got "
                f"{torch.cuda.get_device_capability(a.device)}")
    return None


def _anchor_desc(a, block_v: int, K: int):
    """A TMA tensor descriptor of the anchor's values ``a [B, H, V, K]`` (float32, float16 or
    bfloat16) viewed as ``[B*H*V, K]``, blocks of ``[block_v, K]``."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor.from_tensor(a.reshape(-1, K), [block_v, K])


def _checkpoints(a_st, r_st, two: bool, dequantize: bool) -> Checkpoints:
    """The new stored copies and, with ``dequantize``, their torch dequantised values (the
    float32 tensor itself for an fp32 copy; one copy for a single-checkpoint policy)."""
    def deq(st):
        if not dequantize:
            return None
        return st if isinstance(st, torch.Tensor) else st.dequantize()

    a_val = deq(a_st)
    return Checkpoints(a_val, deq(r_st) if two else a_val, a_st, r_st)


_FP32_POLICY = StatePolicy.parse("fp32")


@triton.jit
def _split_keys_kernel(seq_ptr, fl_ptr, ka_ptr, kr_ptr, kbits, n, H, BLOCK: tl.constexpr,
                       SH_HEAD: tl.constexpr, SH_SEQ: tl.constexpr, SH_FLUSH: tl.constexpr):
    """Stream keys of the two casts of a split flush, ``[B * H]`` each: the keys
    :func:`checkpoint_streams` builds (the packing of ``_flush_kernel``'s ``KEYS_IN``), in one
    launch (the device build takes about 25; the host build a device-to-host copy, which a
    CUDA graph cannot capture)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    b = i // H
    h = i - b * H
    kb = _packed_key(tl.load(seq_ptr + b, mask=m, other=0), tl.load(fl_ptr + b, mask=m, other=0),
                     h, kbits, SH_HEAD, SH_SEQ, SH_FLUSH)
    tl.store(ka_ptr + i, kb, mask=m)  # copy bit 0: the anchor
    tl.store(kr_ptr + i, kb | 1, mask=m)  # copy bit 1: the read copy


def _key_fields(layer: int, sequence_ids, flush_index, B: int, H: int, dev):
    """Host side of the in-kernel stream keys: range-checks the host fields (layer, heads) and
    returns ``(sequence ids [B], flush indices [B], layer bits, key constexprs)`` as int64 on
    ``dev`` (a single flush index broadcast); the per-sequence fields are range-checked by the
    caller, on the device."""
    stream_key(layer=layer, head=H - 1)  # host range check of the host fields
    sh = STREAM_SHIFTS
    sa = sequence_ids.to(device=dev, dtype=torch.int64).reshape(-1).contiguous()
    sr = torch.as_tensor(flush_index, dtype=torch.int64, device=dev).reshape(-1)
    sr = sr.expand(B).contiguous() if sr.numel() == 1 else sr.contiguous()
    consts = dict(SH_HEAD=sh["head"], SH_SEQ=sh["sequence"], SH_FLUSH=sh["flush"])
    return sa, sr, int(layer) << sh["layer"], consts


def _split_keys(layer: int, sequence_ids, flush_index, B: int, H: int, dev):
    """``(anchor keys, read keys)`` int64 ``[B, H]`` of :func:`checkpoint_streams` by
    :func:`_split_keys_kernel`. The per-sequence fields must already be range-checked (the
    split flush's fp32 flush checks them on the device, ``keys_in_kernel``)."""
    sa, sr, kbits, consts = _key_fields(layer, sequence_ids, flush_index, B, H, dev)
    if sa.numel() != B or sr.numel() != B:
        raise ValueError(f"_split_keys: sequence_ids and flush_index need B = {B} elements "
                         f"(flush_index may be one), got {sa.numel()} and {sr.numel()}")
    ka = torch.empty(B, H, dtype=torch.int64, device=dev)
    kr = torch.empty_like(ka)
    n, block = B * H, 1024
    if n:
        _split_keys_kernel[(triton.cdiv(n, block),)](sa, sr, ka, kr, kbits, n, H, BLOCK=block,
                                                     **consts)
    return ka, kr


# flush_kernel(cast_form=...): how a split flush casts S. "pair_lean" / "pair_lean_rcp" are
# "pair" with pack_pair_triton(form="lean" / "lean_rcp"): the same bytes in fewer
# instructions per element (docs/kernels-replay.md, "Twenty-seventh pass"); "pair_lean" the
# default since the twenty-eighth pass (timed on the H200)
CAST_FORMS = ("pair", "pair_lean", "pair_lean_rcp", "separate")
_PAIR_CAST_FORMS = {"pair": "generic", "pair_lean": "lean", "pair_lean_rcp": "lean_rcp"}


def split_cast_form(policy, cast_form: str | None = None) -> str:
    """The cast form of a split flush under ``policy`` (:data:`CAST_FORMS`): ``cast_form``,
    checked, or by default ``"pair_lean"`` where the policy has an NVFP4 copy beside an fp32
    or unscaled one (fp16, bf16), or a single-checkpoint NVFP4 copy (cast as the pair (fp32,
    nvfp4): the NVFP4 cast alone), else ``"separate"``. On the H200 at B = 256
    (``flush_parts_h200.json``) the pair form's split flush took 1157 / 1750 us (GDN /
    Mamba-2) against 1245 / 1921 for ``read:nvfp4/rec:fp16+sr``, and 1301 / 1335 against
    1304 / 1383 for ``read:nvfp4/rec:fp32``; the lean pair form
    (``flush_parts_lean_rtn_2397684_h200.json``) 1019.3 / 1396.1 against the pair form's
    1126.1 / 1622.6 for ``read:nvfp4/rec:fp16``, 1280.2 / 1300.2 against 1297.6 / 1332.3 for
    ``read:nvfp4/rec:fp32`` (``"pair_lean_rcp"``: 1020.6 / 1380.7 and 1284.6 / 1298.9);
    for ``read:nvfp4/rec:fp16+sr`` (``flush_parts_lean_sr_9cd1d53_h200.json``) 1074.5 /
    1487.6 against 1156.4 / 1682.8, and 1018.6 / 1399.6 with :func:`split_flush_amax`.

    Raises:
        ValueError: a ``cast_form`` not in :data:`CAST_FORMS`, or a pair form (``"pair"``,
            ``"pair_lean"``, ``"pair_lean_rcp"``) for a policy whose copies it cannot cast
            (naming both)."""
    policy = require_policy(policy)
    if cast_form is not None and cast_form not in CAST_FORMS:
        raise ValueError(f"cast_form must be one of {CAST_FORMS} or None, got {cast_form!r}")
    ok = _pair_roles(policy) is not None
    if cast_form is None:
        return "pair_lean" if ok else "separate"
    if cast_form in _PAIR_CAST_FORMS and not ok:
        raise ValueError(f"cast_form={cast_form!r} casts an NVFP4 copy beside an fp32 or "
                         f"unscaled one (or a single NVFP4 copy); {policy} has "
                         f"rec={policy.rec}, read={policy.read}")
    return cast_form


def _pair_roles(policy):
    """``(plain spec, scaled spec, scaled is the read copy)`` of a policy the pair form casts,
    else None."""
    if policy.single_checkpoint:
        return (_FP32_POLICY.rec, policy.rec, False) if pair_casts("fp32", policy.rec) else None
    if pair_casts(policy.rec, policy.read):
        return policy.rec, policy.read, True
    if pair_casts(policy.read, policy.rec):
        return policy.read, policy.rec, False
    return None


def split_flush_amax(policy) -> bool:
    """Default ``flush_amax`` of a split flush in a pair form under ``policy``: True where the
    pair's plain copy is fp16 or bf16, False where it is fp32 (``read:nvfp4/rec:fp32``, and a
    single NVFP4 copy, cast as the pair (fp32, nvfp4)). On the H200 at B = 256
    (``flush_parts_lean_rtn_2397684_h200.json``, docs/kernels-replay.md "Twenty-eighth
    pass"), GDN / Mamba-2 split flushes in the lean pair form, without and with the amax from
    the fp32 flush: ``read:nvfp4/rec:fp16`` 1019.3 / 1396.1 -> 972.9 / 1311.6 us, but
    ``read:nvfp4/rec:fp32`` 1280.2 / 1300.2 -> 1269.9 / 1337.0 (Mamba-2 loses: its fp32 flush,
    which then is the anchor's own cast, pays for the amax). False for a policy the pair
    form does not cast."""
    roles = _pair_roles(require_policy(policy))
    return roles is not None and not roles[0].is_identity


# The split flush's fp32 flush with a register cap (2026-12-04, twenty-third session,
# benchmarks/flush_maxnreg.py, flush_maxnreg_h200.json / flush_maxnreg_r2_h200.json, H200,
# B = 256): Mamba-2's geometry (V = 64, K = 128, no correction solve) reading an fp16 anchor,
# the whole read:nvfp4/rec:fp16+sr flush 1752.9 -> 1690.8 us at 168 registers (1753.5 /
# 1752.7 -> 1689.9 / 1689.1 in a second run; 160: 1693.7, 176: no gain). GDN's lost (1161.9
# -> 1196.0 at 168) and the fp32 policy's flushes lose at every cap. Twenty-fourth session
# (flush_maxnreg_anchors_h200.json): Mamba-2 reading a bf16 anchor (read:nvfp4/rec:bf16+sr)
# 1664.8 / 1664.7 -> 1599.4 / 1603.6 us at 168 (224, 192: no gain; 128: 1738.0); an fp32
# anchor (read:nvfp4/rec:fp32) loses at every cap (1336.7 -> 1370.3 at 168), and so do GDN's
# with either anchor (bf16 1125.1 -> 1151.7, fp32 1302.5 -> 1792.0 at 168). Other anchors and
# geometries are untimed: no cap.
SPLIT_FLUSH_MAXNREG = {(False, 64, 128, "fp16"): 168, (False, 64, 128, "bf16"): 168}

# The anchor's row tiles through a TMA descriptor by default (flush_kernel(anchor_tma=None)),
# keyed by (GDN's correction solve, V, K, the anchor's storage format): the row-tile loop's
# pipeline depth (loop_stages); only for flushes that write S alone (the fp32 policy's, a split
# flush's first launch). 2026-12-05, thirty-sixth session (flush_tma_2996ba7_h100.json and
# flush_tma_r3_2996ba7_h100.json, one H100, B = 256, five rounds in two calls): GDN's
# correction solve against an FP32 anchor (the split flush of read:nvfp4/rec:fp32 and of
# every read:F/rec:fp32 policy with a matrix-scaled F; the fp32 policy's own flush folds the
# cached corrections instead and is not keyed) 904.9-932.5 -> 629.7-641.1 us with the same
# bits at depth 2 (without the descriptor, depth 1: 761-773 us, other bits). Not keyed: GDN's
# fold (410.5-411.3 -> 409.4-410.0 us, other bits: at the copy's rate on the H100, untimed on
# the H200), the fp16-anchor solve of the split nvfp4 flush (the whole flush 1057-1069 ->
# 1051-1057 at depth None, 1118-1121 at depth 2), Mamba-2's nvfp4 split flush (1437-1456 ->
# 1475-1481) and Mamba-2 fp32 (792-900 us across configs, up to 91 within one: inconclusive).
# Untimed on the H200.
FLUSH_ANCHOR_TMA = {(True, 128, 128, "fp32"): 2}


# The lean pair cast's tile (block rows of 16 elements per tile, warps) in a split flush, by
# the matrix shape (V, K), from SPLIT_PAIR_TILES_FROM matrices (B H) up; pack_pair_triton's
# default (128, 4) elsewhere. The bytes do not depend on it, so neither does a choice by the
# batch. 2026-12-05 (twenty-ninth session; flush_parts_tiles_64ee084_h200.json and
# flush_parts_inline_0681585_h200.json, H200, B = 256, read:nvfp4/rec:fp16+sr, the cast with
# the given amax alone, two runs): Mamba-2's 64 x 128 on 32 x 1 738.4 / 739.1 us against
# 769.5 / 764.8 at 128 x 4 (the whole split flush 1387.1 against 1406.7); GDN's 128 x 128 on
# 256 x 8 384.9 / 384.6 against 391.9 / 391.3 (split flush 1014.0 against 1028.8). Timed at
# B = 256 only (32768 / 8192 matrices). At B = 1 Mamba-2's 32 x 1 tile leaves 128 one-warp
# programs for 132 SMs: decode.py's nvfp4 flush took 59.8 / 60.2 us against 40.5 at 128 x 4
# (decode_h200.json at bfde448 against b523287's run), hence the threshold; B = 64 was
# unchanged (392.7 / 393.5 against 392.2 us).
SPLIT_PAIR_TILES: dict = {(64, 128): (32, 1), (128, 128): (256, 8)}
SPLIT_PAIR_TILES_FROM = 8192


def split_pair_tile(V: int, K: int, matrices: int) -> tuple[int, int]:
    """``(rows, num_warps)`` of a split flush's lean pair cast on ``matrices`` ``[V, K]``
    matrices: :data:`SPLIT_PAIR_TILES` from :data:`SPLIT_PAIR_TILES_FROM` matrices up, else
    ``pack_pair_triton``'s default. The stored bytes do not depend on it."""
    if int(matrices) >= SPLIT_PAIR_TILES_FROM:
        return SPLIT_PAIR_TILES.get((int(V), int(K)), (_PAIR_ROWS, _PAIR_WARPS))
    return _PAIR_ROWS, _PAIR_WARPS


def split_flush_maxnreg(anchor, solve: bool) -> int | None:
    """Default register cap of a split flush's fp32 flush (:data:`SPLIT_FLUSH_MAXNREG`): keyed
    by (GDN's correction solve, V, K, the anchor's storage format); None (no cap) where the
    key was not timed. ``anchor``: the stored anchor ``[B, H, V, K]`` (a float32 tensor or a
    PackedTensor)."""
    return SPLIT_FLUSH_MAXNREG.get(_anchor_key(anchor, solve))


def _anchor_key(anchor, solve: bool) -> tuple[bool, int, int, str]:
    """The key of :data:`SPLIT_FLUSH_MAXNREG` and :data:`FLUSH_ANCHOR_TMA`: (GDN's correction
    solve, V, K, the stored anchor's format)."""
    fmt = anchor.spec.name if isinstance(anchor, PackedTensor) else "fp32"
    return bool(solve), int(anchor.shape[-2]), int(anchor.shape[-1]), fmt


def flush_anchor_tma(anchor, solve: bool) -> int | None:
    """Default of ``flush_kernel(anchor_tma=None)``: the pipeline depth of the row-tile loop
    (:data:`FLUSH_ANCHOR_TMA`) where the flush's anchor tiles go through a TMA descriptor by
    default, else None (ordinary loads). Keyed by (GDN's correction solve, V, K, the anchor's
    storage format); only for an anchor on a CUDA device of capability 9.0 or more (never on
    the interpreter, where the kernels' CPU tests run the ordinary loads unless asked). The
    key depends on the shape, format and device only, never on the batch or the memory
    address, so neither does the choice. ``anchor``: the stored anchor ``[B, H, V, K]`` (a
    float32 tensor or a PackedTensor)."""
    if not _tma_capable(anchor.codes if isinstance(anchor, PackedTensor) else anchor):
        return None
    return FLUSH_ANCHOR_TMA.get(_anchor_key(anchor, solve))


def _tma_capable(t: torch.Tensor) -> bool:
    """Whether the default launch may load ``t`` through a TMA descriptor: a tensor on a CUDA
    device of capability 9.0 or more, the kernels compiled (not interpreted)."""
    return (t.is_cuda and not KERNELS_INTERPRETED
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def _split_flush(anchor, la, w, k, length, policy, *, seed, layer, sequence_ids, flush_index,
                 q, store_state, dequantize, cast_form, flush_amax, **launch):
    """``flush_kernel(split_casts=True)``: the ``fp32`` flush, then the two casts of its S,
    by one :func:`~replayssm_quant.kernels.quant.pack_pair_triton` launch
    (``cast_form="pair"``; ``"pair_lean"`` / ``"pair_lean_rcp"``: its ``form="lean"`` /
    ``"lean_rcp"``) or by one
    :func:`~replayssm_quant.kernels.quant.pack_triton` per copy (``"separate"``); stream
    keys of :func:`checkpoint_streams`, copy 0 for A and 1 for R, built by
    :func:`_split_keys`. ``flush_amax``: the fp32 flush also writes each matrix's amax
    (``amax_out``) and the pair cast takes it (``matrix_amax``) instead of its amax pass."""
    B, H = int(anchor.shape[0]), int(anchor.shape[1])
    launch["keys_in_kernel"] = True  # the fp32 flush then range-checks the per-sequence fields
    amax = torch.empty(B * H, dtype=torch.int32, device=w.device) if flush_amax else None
    res, y = flush_kernel(anchor, la, w, k, length, _FP32_POLICY, seed=seed, layer=layer,
                          sequence_ids=sequence_ids, flush_index=flush_index, q=q,
                          store_state=False, dequantize=False, amax_out=amax, **launch)
    S = res.checkpoints.anchor_stored
    sa, sr = _split_keys(layer, sequence_ids, flush_index, B, H, S.device)
    two = not policy.single_checkpoint
    if cast_form in _PAIR_CAST_FORMS:
        plain, scaled, scaled_is_read = _pair_roles(policy)
        kp, ks = (sa, sr) if scaled_is_read else (sr, sa)
        form = _PAIR_CAST_FORMS[cast_form]
        rows, nw = ((_PAIR_ROWS, _PAIR_WARPS) if form == "generic"
                    else split_pair_tile(*S.shape[-2:], B * H))
        p_st, s_st = pack_pair_triton(
            S, plain, scaled, seed=int(seed), plain_stream=kp, scaled_stream=ks,
            form=form, rows=rows, num_warps=nw,
            matrix_amax=amax.view(torch.float32).view(B, H) if flush_amax else None)
        if not two:
            a_st = r_st = s_st
        elif scaled_is_read:
            a_st, r_st = p_st, s_st
        else:
            a_st, r_st = s_st, p_st
    else:
        def cast(spec, keys):
            return S if spec.is_identity else pack_triton(S, spec, seed=int(seed), stream=keys)

        a_st = cast(policy.rec, sa)
        r_st = cast(policy.read, sr) if two else a_st
    cps = _checkpoints(a_st, r_st, two, dequantize)
    return FlushResult(S if store_state else None, cps, res.w), y


def mamba2_flush_kernel(anchor, la, v, k, length, policy, *, seed, layer, sequence_ids,
                        flush_index, q=None, store_state: bool = True,
                        block_v: int | None = None, num_warps: int | None = None,
                        variant: str | None = None, dequantize: bool = True,
                        keys_in_kernel: bool | None = None, reconstruct: str | None = None,
                        solve_form: str | None = None, split_casts: bool | None = None,
                        cast_form: str | None = None, maxnreg: int | None = None,
                        flush_amax: bool | None = None, return_w: bool = True,
                        anchor_tma: bool | None = None, loop_stages: int | None = None):
    """Kernel of :func:`replay.mamba2.mamba2_flush` (records ``la [B,J,H]``, ``v [B,J,H,P]``,
    grouped ``k [B,J,G,N]``, ``length`` int64 ``[B]``). Returns ``(FlushResult, y)``;
    options as :func:`flush_kernel`'s (``return_w=False``: ``FlushResult.w`` is None)."""
    return flush_kernel(anchor, la, v, k, length, policy, seed=seed, layer=layer,
                        sequence_ids=sequence_ids, flush_index=flush_index, q=q,
                        store_state=store_state, block_v=block_v, num_warps=num_warps,
                        variant=variant, dequantize=dequantize, keys_in_kernel=keys_in_kernel,
                        reconstruct=reconstruct, solve_form=solve_form,
                        split_casts=split_casts, cast_form=cast_form, maxnreg=maxnreg,
                        flush_amax=flush_amax, return_w=return_w, anchor_tma=anchor_tma,
                        loop_stages=loop_stages)


def gdn_flush_kernel(anchor, la, beta, v, k, length, policy, *, seed, layer, sequence_ids,
                     flush_index, u_cached=None, fold_cached_corrections: bool = False, q=None,
                     store_state: bool = True, block_v: int | None = None,
                     num_warps: int | None = None, variant: str | None = None,
                     dequantize: bool = True, keys_in_kernel: bool | None = None,
                     reconstruct: str | None = None, solve_form: str | None = None,
                     split_casts: bool | None = None, cast_form: str | None = None,
                     maxnreg: int | None = None, flush_amax: bool | None = None,
                     return_w: bool = True, anchor_tma: bool | None = None,
                     loop_stages: int | None = None):
    """Kernel of :func:`replay.gdn.gdn_flush`: the corrections are re-solved against the
    stored anchor inside the flush kernel (each tile of value rows solves its own rows:
    ``A k_p`` by one dot (FP32 FMA or tf32x3: ``reconstruct``), then forward substitution
    over the record slots, or one product with ``(I + CF)^{-1}``: ``solve_form``, by default
    the inverse for more than 64 value rows and up to 16 slots, :func:`flush_config`), or the
    cached ones are folded (``fold_cached_corrections``; what a single-checkpoint policy's
    decode state runs, :meth:`~replayssm_quant.config.GDNFold.folds_cached`). ``FlushResult.w`` holds the folded
    corrections ``[B, J, HV, DV]`` (the cached ones zeroed at slots ``>= length``; the
    kernel itself folds only slots ``< length``, so with ``return_w=False``, a serving
    engine's flush, ``FlushResult.w`` is None and the cached corrections are passed as they
    are: no masked copy of them, a ``[B, J, HV, DV]`` read and write fewer, and the same S,
    y and copies). Returns ``(FlushResult, y)``."""
    if not isinstance(return_w, bool):
        raise ValueError(f"return_w must be True or False, got {return_w!r}")
    kw = dict(seed=seed, layer=layer, sequence_ids=sequence_ids, flush_index=flush_index, q=q,
              store_state=store_state, block_v=block_v, num_warps=num_warps, variant=variant,
              dequantize=dequantize, keys_in_kernel=keys_in_kernel, reconstruct=reconstruct,
              solve_form=solve_form, split_casts=split_casts, cast_form=cast_form,
              maxnreg=maxnreg, flush_amax=flush_amax, return_w=return_w, anchor_tma=anchor_tma,
              loop_stages=loop_stages)
    if fold_cached_corrections:
        if u_cached is None:
            raise ValueError("fold_cached_corrections=True needs u_cached")
        _check_devices("gdn_flush_kernel", anchor=anchor, la=la, beta=beta, v=v, k=k,
                       length=length, u_cached=u_cached)
        if not return_w:  # the kernel reads slots < length only
            return flush_kernel(anchor, la, u_cached, k, length, policy, **kw)
        live = length_mask(length, la.shape[1])
        u = torch.where(live[:, :, None, None], u_cached, torch.zeros((), dtype=v.dtype,
                                                                      device=v.device))
        return flush_kernel(anchor, la, u, k, length, policy, **kw)
    return flush_kernel(anchor, la, v, k, length, policy, beta=beta, **kw)


# ---------------------------------------------------------------- state-object entry points
# The kernels of the state objects' operations, with the signatures of their torch references
# (replay/mamba2.py, replay/gdn.py: ``mamba2_state_step`` ...); the backend seam
# (replayssm_quant/backend.py) swaps one for the other. They read the stored checkpoints.
def mamba2_state_flush(anchor, recs: dict, length, policy, *, seed, layer, sequence_ids,
                       flush_index) -> FlushResult:
    """Kernel of :func:`replay.mamba2.mamba2_state_flush`: :func:`mamba2_flush_kernel`, with
    ``return_w=False`` (``FlushResult.w`` None: the state objects read the state and the
    checkpoints only)."""
    return mamba2_flush_kernel(anchor, recs["la"], recs["v"], recs["k"], length, policy,
                               seed=seed, layer=layer, sequence_ids=sequence_ids,
                               flush_index=flush_index, return_w=False)[0]


def gdn_state_flush(anchor, recs: dict, length, policy, *, seed, layer, sequence_ids,
                    flush_index, fold_cached_corrections: bool = False) -> FlushResult:
    """Kernel of :func:`replay.gdn.gdn_state_flush`: :func:`gdn_flush_kernel`, with
    ``return_w=False`` (``FlushResult.w`` None: the state objects read the state and the
    checkpoints only; the cached corrections are then folded without a masked copy)."""
    return gdn_flush_kernel(anchor, recs["la"], recs["beta"], recs["v"], recs["k"], length,
                            policy, seed=seed, layer=layer, sequence_ids=sequence_ids,
                            flush_index=flush_index, u_cached=recs["uR"],
                            fold_cached_corrections=fold_cached_corrections,
                            return_w=False)[0]
