"""The anchor chain: the anchor recurrence of a run of windows in one launch, for the
teacher-forced window form and the adapters' step flush.

Torch reference: :func:`replayssm_quant.replay.core.solve_corrections` +
:func:`~replayssm_quant.replay.core.reconstruct` + :func:`~replayssm_quant.replay.core.cast_state`
window after window (:mod:`replayssm_quant.replay.window`); outputs as
:func:`~replayssm_quant.replay.core.window_outputs`. Tests: ``tests/test_emulation_kernels.py``;
design and measurements: ``docs/kl-throughput.md``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...formats import parse_spec
from ...philox import as_int, stream_keys_to
from .codec import (KERNELS_INTERPRETED, _K_MATRIX, _K_NVFP4, _alloc_copy, _as_stored,
                    _cast_consts, _cast_store,
                    _check_supported, _decode_consts, _dequant_tile, _finite_abs, _kind,
                    _load_copy, _load_stored, _matrix_scale, _maxnreg_launch, _split_halves,
                    _typed_codes)

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
# of a matrix only exchange one number per window (SPLIT): each publishes its tile's amax
# (the float bits + 1, all non-negative) in its own word of the (matrix, window) and spins
# until none of the NT words is 0 ("slots", where NT is a power of two), or adds it to one
# word by an integer atomic max, arrives on a counter and spins on the count ("counter", the
# first form, any NT). Programs take logical ids from a ticket counter in the order they
# start, so the tiles of a matrix are always co-resident or waiting behind finished ones (no
# deadlock for any grid size once NT programs fit). Without
# SPLIT (under the Triton interpreter, which runs programs one after another; for a matrix of
# one tile; for more tiles than SMs) one program per matrix loops over the same tiles, twice
# where an amax is needed.
# A program that owns its rows for the whole chain (SPLIT, or a single tile) keeps the anchor
# in registers: the next window's A is decoded from the codes it just stored (_dequant_tile,
# the same integer decode and FP32 multiplications as _load_copy, which equals
# PackedTensor.dequantize); a program looping over several tiles reads it back from memory.
# Optionally (OUT) the program also writes the window's outputs for its rows: position t < L
# reads the previous read copy plus the records, gamma_{1:t} (R q_t) + sum_{j<=t}
# gamma_{j+1:t} (k_j . q_t) w_j (core.window_outputs), and the flush token reads S q_L. For a
# single-checkpoint policy R is the anchor (GDN: the corrections against R = A are the
# flush's); for a dual policy (DUAL) each window also casts R <- Q_read(S) from the same S
# with the read stream keys, keeps it like A, and solves GDN's read-path corrections against
# it in the same slot loop.
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
                 K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, P: tl.constexpr):
    """Rows of the anchor before window ``w`` read from memory: the FP32 start (w = 0) or
    the packed anchor of window w - 1 (slot ``pmat``, decoded with ``P``)."""
    if w == 0:
        ae, ao = _load_copy(a0_ptr, a0_ptr, a0_ptr, mat0, rows, rmask, V, K, KH, BV)  # FP32
    else:
        ae, ao = _load_stored(ap_ptr, apbs_ptr, apms_ptr, pmat, rows, rmask, V, K, KH, BV, P)
    return ae, ao


@triton.jit
def _slot_rows(k_ptr, v_ptr, q_ptr, r, rows, rmask, V, K: tl.constexpr, KH: tl.constexpr,
               OUT: tl.constexpr):
    """A record slot's rows at token-head index ``r``: k as (even, odd) ``[KH]``, v at the
    value rows ``rows``, and with OUT q as (even, odd) (without, k's halves stand in)."""
    j = tl.arange(0, KH)
    ke = tl.load(k_ptr + r * K + 2 * j)
    ko = tl.load(k_ptr + r * K + 2 * j + 1)
    vr = tl.load(v_ptr + r * V + rows, mask=rmask, other=0.0)
    if OUT:
        qe = tl.load(q_ptr + r * K + 2 * j)
        qo = tl.load(q_ptr + r * K + 2 * j + 1)
    else:
        qe = ke
        qo = ko
    return ke, ko, vr, qe, qo


@triton.jit
def _chain_tile(ae, ao, re_, ro_, rows, rmask,
                la_ptr, k_ptr, v_ptr, beta_ptr, q_ptr, o_ptr, b, h, t0, H, V, T, L,
                K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
                GDN: tl.constexpr, OUT: tl.constexpr, PF: tl.constexpr, DUAL: tl.constexpr):
    """Rows ``rows`` of the unrounded S after the window starting at token ``t0``, from these
    rows of the previous anchor ``(ae, ao)``, as (even, odd) [BV, KH]; with OUT, also stores
    the window's outputs of these rows at ``o_ptr``, read from the previous anchor, or with
    DUAL from the previous read copy ``(re_, ro_)`` (GDN: with the read-path corrections,
    solved against R as the anchor path's are against A; core.window_outputs with R).

    One pass over the window's records p = 0 .. L-1: (GDN) the correction u_p of these rows
    against the previous anchor, then ``S += gamma_{p+1:L} w_p k_p^T`` (S starts at
    ``gamma_{1:L} A``), then (OUT) the output of position p. A slot's record rows (k, v, q:
    :func:`_slot_rows`) are loaded at the top of its iteration; the corrections are kept
    transposed ``[BV, LP]`` for the coupling sums. ``PF``: record p + 1's rows are loaded at
    the top of iteration p instead and carried into the next, so their memory latency overlaps
    slot p's arithmetic (the loop is a serial chain; without it each slot waits for its own
    loads). Same values, same arithmetic."""
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
    if DUAL and GDN:  # the read path's corrections (solved against R)
        WtR = tl.zeros([BV, LP], tl.float32)
    if PF:  # slot 0's rows; slot p + 1's are issued in iteration p
        r0 = ((b * T + t0) * H + h).to(tl.int64)
        kpe, kpo, vp, qpe, qpo = _slot_rows(k_ptr, v_ptr, q_ptr, r0, rows, rmask, V, K, KH, OUT)
    for p in range(0, L):
        sel = idx == p
        rp = ((b * T + t0 + p) * H + h).to(tl.int64)
        if PF:  # next slot's rows (the last slot reloads its own: always in range)
            rn = ((b * T + t0 + tl.minimum(p + 1, L - 1)) * H + h).to(tl.int64)
            kne, kno, vn, qne, qno = _slot_rows(k_ptr, v_ptr, q_ptr, rn, rows, rmask, V, K, KH,
                                                OUT)
        else:
            kpe, kpo, vp, qpe, qpo = _slot_rows(k_ptr, v_ptr, q_ptr, rp, rows, rmask, V, K, KH,
                                                OUT)
        cp = tl.sum(tl.where(sel, cvec, 0.0), axis=0)
        if GDN:
            bp = tl.sum(tl.where(sel, bt, 0.0), axis=0)
            ak = tl.sum(ae * kpe[None, :] + ao * kpo[None, :], axis=1)  # A k_p
            kkp = tl.sum(kme * kpe[None, :] + kmo * kpo[None, :], axis=1)
            before = idx < p
            coef = tl.where(before, (bp * tl.exp(tl.where(before, cp - cvec, 0.0))) * kkp, 0.0)
            wp = bp * (vp - tl.exp(cp) * ak) - tl.sum(Wt * coef[None, :], axis=1)
            if DUAL and OUT:  # the same solve against R
                akr = tl.sum(re_ * kpe[None, :] + ro_ * kpo[None, :], axis=1)  # R k_p
                wpr = bp * (vp - tl.exp(cp) * akr) - tl.sum(WtR * coef[None, :], axis=1)
                WtR = tl.where(sel[None, :], wpr[:, None], WtR)
        else:
            wp = vp
        Wt = tl.where(sel[None, :], wp[:, None], Wt)
        mw = tl.exp(total - cp) * wp
        se += mw[:, None] * kpe[None, :]
        so += mw[:, None] * kpo[None, :]
        if OUT:
            if p < L - 1:  # reads the previous read copy (R = A unless DUAL), records to p
                if DUAL:
                    aq = tl.sum(re_ * qpe[None, :] + ro_ * qpo[None, :], axis=1)
                else:
                    aq = tl.sum(ae * qpe[None, :] + ao * qpo[None, :], axis=1)
                kq = tl.sum(kme * qpe[None, :] + kmo * qpo[None, :], axis=1)
                upto = idx <= p
                co = tl.where(upto, tl.exp(tl.where(upto, cp - cvec, 0.0)) * kq, 0.0)
                if DUAL and GDN:
                    o = tl.exp(cp) * aq + tl.sum(WtR * co[None, :], axis=1)
                else:
                    o = tl.exp(cp) * aq + tl.sum(Wt * co[None, :], axis=1)
                tl.store(o_ptr + rp * V + rows, o, mask=rmask)
        if PF:
            kpe, kpo, vp, qpe, qpo = kne, kno, vn, qne, qno
    if OUT:  # the flush token reads the unrounded S
        rl = ((b * T + t0 + L - 1) * H + h).to(tl.int64)
        qle = tl.load(q_ptr + rl * K + 2 * j)
        qlo = tl.load(q_ptr + rl * K + 2 * j + 1)
        o = tl.sum(se * qle[None, :] + so * qlo[None, :], axis=1)
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


@triton.jit
def _matrix_amax_slots(part, sync_ptr, base, tile, NT: tl.constexpr):
    """Max of the NT programs' ``part`` (non-negative, finite) for one (matrix, window), with
    no fence: each program publishes ``bits(part) + 1`` in its own word
    ``sync_ptr[base + tile]`` (0 = not yet arrived) and polls the NT words until none is 0.
    The value and its arrival are one word, so no ordering between two writes is needed (the
    counter form, :func:`_matrix_amax`, orders the max before the arrival with a release
    fence, which also waits for the program's earlier output and state stores)."""
    tl.atomic_xchg(sync_ptr + base + tile, part.to(tl.int32, bitcast=True) + 1, sem="relaxed")
    ts = base + tl.arange(0, NT)
    got = tl.atomic_add(sync_ptr + ts, 0, sem="relaxed")
    while tl.min(got, axis=0) == 0:
        got = tl.atomic_add(sync_ptr + ts, 0, sem="relaxed")
    return (tl.max(got, axis=0) - 1).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["seed", "H", "V", "T", "L", "NW", "NSLOT"])
def _chain_kernel(
        a0_ptr,  # starting anchor, dequantised FP32 [B, H, V, K]
        la_ptr, k_ptr, v_ptr, beta_ptr,  # records [B,T,H], [B,T,H,K] (expanded), [B,T,H,V], [B,T,H]
        q_ptr, o_ptr,  # OUT: queries [B, T, H, K] (expanded), outputs [B, T, H, V]
        st_ptr, seed,  # anchor stream keys [B, NW, H]
        oa_ptr, oabs_ptr, oams_ptr,  # anchors in NSLOT slots, packed [B, NSLOT, H, V, .]
        ap_ptr,  # the same codes as typed for decoding (bf16 / fp16 view for half formats)
        s_ptr,  # STORE_S: unrounded S of every window [B, NW, H, V, K]
        sync_ptr,  # SPLIT: int32: ticket, then per window (amax bits, arrivals) (XCH 0) or the
        # NT tiles' amax bits + 1 (XCH 1)
        r0_ptr, rst_ptr,  # DUAL: starting read copy (FP32 [B, H, V, K]), read stream keys
        or_ptr, orbs_ptr, orms_ptr, rp_ptr,  # DUAL: read copies in 2 slots (as oa_ptr ..)
        H, V, T, L, NW, NSLOT,
        K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, LP: tl.constexpr,
        NT: tl.constexpr, GDN: tl.constexpr, OUT: tl.constexpr, STORE_S: tl.constexpr,
        SPLIT: tl.constexpr, NEED_AMAX: tl.constexpr, PF: tl.constexpr, XCH: tl.constexpr,
        P: tl.constexpr, CA: tl.constexpr, DUAL: tl.constexpr, PR: tl.constexpr,
        CR: tl.constexpr):
    # P: DecodeConsts of the stored anchors; CA: CastConsts of the anchor cast; DUAL (dual
    # policies, with OUT): the read copy R <- Q_read(S) is cast from the same unrounded S
    # each window (CR; stream keys rst_ptr; stored in 2 slots, decoded with PR) and the
    # outputs of the next window read it
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
                              K, KH, BV, P)
        if DUAL:
            re_, ro_ = _load_copy(r0_ptr, r0_ptr, r0_ptr, mat0, rows, rmask, V, K, KH, BV)
        else:
            re_, ro_ = ae, ao
        for w in range(0, NW):
            smat = (b * NW + w) * H + h  # S and stream key index of this window
            amat = (b * NSLOT + w % NSLOT) * H + h  # anchor slot written
            se, so = _chain_tile(ae, ao, re_, ro_, rows, rmask, la_ptr, k_ptr, v_ptr, beta_ptr,
                                 q_ptr, o_ptr, b, h, w * L, H, V, T, L, K, KH, BV, LP, GDN, OUT,
                                 PF, DUAL)
            amax = tl.zeros([], tl.float32)
            if NEED_AMAX:
                if SPLIT:
                    if XCH == 1:
                        amax = _matrix_amax_slots(_tile_amax(se, so, rmask), sync_ptr,
                                                  1 + (mat0 * NW + w) * NT, tile, NT)
                    else:
                        amax = _matrix_amax(_tile_amax(se, so, rmask), sync_ptr,
                                            1 + 2 * (mat0 * NW + w), NT)
                else:
                    amax = _tile_amax(se, so, rmask)
            sa = _matrix_scale(amax, CA.KIND, CA.FMAX, CA.SCALE)
            if STORE_S:
                x = tl.reshape(tl.join(se, so), [BV, K])
                tl.store(s_ptr + (smat * V + rows.to(tl.int64))[:, None] * K + kk[None, :], x,
                         mask=rmask[:, None])
            # _cast_store reads the stream key at st_ptr[mat] for the matrix it stores: shift
            # the base so that the store slot amat finds this window's key smat
            ce, co, sbc = _cast_store(se, so, rows, rmask, amat, V, sa, seed,
                                      st_ptr + (smat - amat), oa_ptr, oabs_ptr, K, KH, BV, CA)
            if CA.MS:
                tl.store(oams_ptr + amat, sa)  # every tile of the matrix stores the same value
            if DUAL:  # R <- Q_read(S): the same S and matrix amax, the read stream keys
                rmat = (b * 2 + w % 2) * H + h
                sr = _matrix_scale(amax, CR.KIND, CR.FMAX, CR.SCALE)
                cre, cro, rbc = _cast_store(se, so, rows, rmask, rmat, V, sr, seed,
                                            rst_ptr + (smat - rmat), or_ptr, orbs_ptr, K, KH,
                                            BV, CR)
                if CR.MS:
                    tl.store(orms_ptr + rmat, sr)
                re_, ro_ = _dequant_tile(cre, cro, rbc, sr, BV, KH, PR)
            ae, ao = _dequant_tile(ce, co, sbc, sa, BV, KH, P)
            if not DUAL:
                re_, ro_ = ae, ao
    else:  # one program loops over the row tiles of its matrix (interpreter, tests)
        for w in range(0, NW):
            smat = (b * NW + w) * H + h
            amat = (b * NSLOT + w % NSLOT) * H + h
            pmat = (b * NSLOT + (w + NSLOT - 1) % NSLOT) * H + h  # slot of the previous anchor
            rmat = (b * 2 + w % 2) * H + h  # DUAL: read slot written
            prmat = (b * 2 + (w + 1) % 2) * H + h  # DUAL: slot of the previous read copy
            amax = tl.zeros([], tl.float32)
            if NEED_AMAX:  # first pass: the tiles for the amax only
                for v0 in range(0, V, BV):
                    rows = v0 + tl.arange(0, BV)
                    rmask = rows < V
                    ae, ao = _prev_anchor(a0_ptr, ap_ptr, oabs_ptr, oams_ptr, w, mat0, pmat, rows,
                                          rmask, V, K, KH, BV, P)
                    se, so = _chain_tile(ae, ao, ae, ao, rows, rmask, la_ptr, k_ptr, v_ptr,
                                         beta_ptr, q_ptr, o_ptr, b, h, w * L, H, V, T, L, K, KH,
                                         BV, LP, GDN, False, PF, False)
                    amax = tl.maximum(amax, _tile_amax(se, so, rmask))
            sa = _matrix_scale(amax, CA.KIND, CA.FMAX, CA.SCALE)
            sr = _matrix_scale(amax, CR.KIND, CR.FMAX, CR.SCALE)
            for v0 in range(0, V, BV):
                rows = v0 + tl.arange(0, BV)
                rmask = rows < V
                ae, ao = _prev_anchor(a0_ptr, ap_ptr, oabs_ptr, oams_ptr, w, mat0, pmat, rows,
                                      rmask, V, K, KH, BV, P)
                if DUAL:
                    re_, ro_ = _prev_anchor(r0_ptr, rp_ptr, orbs_ptr, orms_ptr, w, mat0, prmat,
                                            rows, rmask, V, K, KH, BV, PR)
                else:
                    re_, ro_ = ae, ao
                se, so = _chain_tile(ae, ao, re_, ro_, rows, rmask, la_ptr, k_ptr, v_ptr,
                                     beta_ptr, q_ptr, o_ptr, b, h, w * L, H, V, T, L, K, KH, BV,
                                     LP, GDN, OUT, PF, DUAL)
                if STORE_S:
                    x = tl.reshape(tl.join(se, so), [BV, K])
                    tl.store(s_ptr + (smat * V + rows.to(tl.int64))[:, None] * K + kk[None, :],
                             x, mask=rmask[:, None])
                _cast_store(se, so, rows, rmask, amat, V, sa, seed, st_ptr + (smat - amat),
                            oa_ptr, oabs_ptr, K, KH, BV, CA)
                if DUAL:
                    _cast_store(se, so, rows, rmask, rmat, V, sr, seed, rst_ptr + (smat - rmat),
                                or_ptr, orbs_ptr, K, KH, BV, CR)
            if CA.MS:
                tl.store(oams_ptr + amat, sa)
            if DUAL and CR.MS:
                tl.store(orms_ptr + rmat, sr)
            tl.debug_barrier()  # the next window reads this window's anchor (other threads' rows)


CHAIN_TILE_ELEMENTS = 2048  # elements of a program's row tile: BV = 2048 // K rows
CHAIN_WARPS = 4
# prefetch (_chain_tile ``PF``) by default where it was faster on the H200
# (benchmarks/results/chain_tune_launch_h200.json, B = 1, 4096 tokens: GDN fp32 with outputs
# 8.2 -> 5.6 ms, Mamba-2 nvfp4 with outputs 17.2 -> 12.2 ms), i.e. GDN or with outputs; not
# Mamba-2 without outputs (2.65 -> 2.99 ms)
CHAIN_PREFETCH = None  # None: as above; True / False: always / never
# matrix amax of split tiles: "slots" (a word per tile, no fence; its poll is a tl.arange over
# the NT tiles, so NT must be a power of two) or "counter" (any NT). None: "slots" where NT is
# a power of two, else "counter". Timed equal (chain_tune_launch_h200.json).
CHAIN_EXCHANGE = None
EXCHANGES = ("slots", "counter")


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Registers per SM (every NVIDIA GPU from sm_50 on) and the smallest per-thread register cap
# the split launch is given to fit its programs into one wave (below it, spills would cost more
# than they save: not measured, a guess; see resident_maxnreg).
SM_REGISTERS = 65536
CHAIN_MIN_MAXNREG = 128


def resident_maxnreg(programs: int, num_warps: int, sms: int) -> int | None:
    """Per-thread register cap (``maxnreg``) under which ``programs`` programs of
    ``num_warps`` warps are all resident on ``sms`` SMs at once, or None where they fit even
    at 255 registers a thread (the uncapped chain kernel uses up to 255: two programs of 4
    warps per SM, one of 8) or the cap would fall below :data:`CHAIN_MIN_MAXNREG`.

    Why: every program of a split chain lives for the whole chain (it carries its rows across
    all windows), so programs beyond the resident ones start only when earlier ones have
    finished the whole chain: a second wave doubles the time. The 3.4B random qwen3_5 (40
    value heads, 8 tiles each: 320 programs at B = 1, 132 SMs, 245 registers: 264 resident)
    ran its NVFP4 chain in 16.8 ms, the 32-head shape in 9.4 ms. A register cap changes no
    value (register allocation, not arithmetic)."""
    if sms <= 0:
        return None
    need = -(-programs // sms)
    if need <= max(1, SM_REGISTERS // (255 * 32 * num_warps)):  # fit even at 255 registers
        return None
    cap = SM_REGISTERS // (need * 32 * num_warps) // 8 * 8
    return min(cap, 255) if cap >= CHAIN_MIN_MAXNREG else None


def _sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (0 elsewhere)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


def _prefetch(prefetch, gdn: bool, out: bool) -> bool:
    if prefetch is None:
        prefetch = CHAIN_PREFETCH
    return (gdn or out) if prefetch is None else bool(prefetch)


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
    reads: torch.Tensor | None = None


def anchor_chain(anchor, la, k, v, beta, spec, *, L: int, seed: int, streams, q=None,
                 store_states: bool = True, all_anchors: bool = True, split: bool | None = None,
                 block_v: int | None = None, num_warps: int = CHAIN_WARPS,
                 prefetch: bool | None = None, exchange: str | None = None,
                 maxnreg: int | None | str = "auto", read_spec=None, read=None,
                 read_streams=None) -> ChainResult:
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
            window, ``S q`` at the flush token), or with ``read_spec`` read from the read copy.
        read_spec, read, read_streams: a dual policy's read copy (DESIGN.md "State"): its
            format (``policy.read``), the dequantised FP32 read copy ``[B, H, V, K]`` before
            the first window, and int64 ``[B, NW, H]`` read stream keys (``checkpoint_streams``
            copy 1). Each window's ``R <- Q_read(S)`` is cast in the kernel from the same
            unrounded S as the anchor, and the outputs (``q`` required) read R, GDN with the
            read-path corrections solved against R (``core.window_outputs`` of R; the
            torch path's ``window_fast._outputs``). The outputs of a window are computed
            by the program that owns its rows, so they do not depend on the batch or on how
            many windows a launch holds.
        store_states: return the unrounded S of every window.
        all_anchors: return the anchor of every window, else only the last one.
        split: one program per (matrix, row tile) with the matrix amax exchanged through
            atomics (default: on CUDA when a matrix has several tiles and they fit on the SMs;
            else one program per matrix, as the interpreter runs). The choice depends on
            (V, K) and the device only, so every call on a layer takes the same.
        block_v: value rows per tile (default :func:`chain_block_v`: tests only).
        num_warps, prefetch, exchange: launch options (default ``CHAIN_WARPS``,
            ``CHAIN_PREFETCH``: on for GDN or with ``q``, ``CHAIN_EXCHANGE``); ``prefetch``
            (None, True or False) loads each record's rows one slot ahead; ``exchange`` is how
            split tiles share the matrix amax of an fp8 / nvfp4 anchor (``"slots"``: a word
            per tile, no fence, for a power-of-two number of tiles; ``"counter"``: a max and
            an arrival count; None: slots where it applies). None changes a value (same
            arithmetic, and a max in any order; ``benchmarks/chain_tune.py`` checks the bytes
            on the device).
        maxnreg: register cap per thread on CUDA: ``"auto"`` (default) for a split launch
            :func:`resident_maxnreg`, so that all programs fit in one wave (no cap for a
            launch of one program per matrix); None for no cap; or an int, for any launch.
            Changes no value.

    Returns :class:`ChainResult` ``(states [B, NW, H, V, K] or None, anchors [B, NW or 1, H, V, K]
    dequantised FP32, outputs [B, T, H, V] or None, reads [B, 1, H, V, K] (the last read copy,
    dequantised FP32) or None)``.

    Raises:
        ValueError: L < 1 or T not a positive multiple of L, unsupported K or dtype, mismatched
            shapes, dtypes or devices, streams not integer ``[B, NW, H]``, ``block_v`` not a
            power of two, ``split`` under the Triton interpreter, an unknown ``exchange`` (or
            ``"slots"`` with a number of tiles that is not a power of two), a ``prefetch``
            that is not None or a bool, a bad ``maxnreg``; ``read_spec`` without ``q``,
            ``read`` or ``read_streams``, or those with the wrong shape, dtype or device.
    """
    spec = parse_spec(spec)
    if anchor.dim() != 4:
        raise ValueError(f"anchor must be [B, H, V, K], got shape {list(anchor.shape)}")
    B, H, V, K = (int(d) for d in anchor.shape)
    _check_supported(K, anchor.dtype)
    if as_int(L) is None or L < 1:
        raise ValueError(f"window L must be an int >= 1, got {L!r}")
    L = int(L)
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
    streams = _check_streams("streams", streams, B, NW, H)
    dual = read_spec is not None
    if dual:
        read_spec = parse_spec(read_spec)
        if q is None:
            raise ValueError("read_spec needs q: a dual policy's read copy is only read by the "
                             "outputs")
        if read is None or read_streams is None:
            raise ValueError("read_spec needs read (the FP32 read copy before the first "
                             "window) and read_streams (its stream keys)")
        if not isinstance(read, torch.Tensor):
            raise ValueError(f"read must be a float32 torch.Tensor {[B, H, V, K]}, got "
                             f"{type(read).__name__}")
        if tuple(read.shape) != (B, H, V, K) or read.dtype != torch.float32:
            raise ValueError(f"read must be float32 {[B, H, V, K]} like the anchor, got "
                             f"{read.dtype} {list(read.shape)}")
        if read.device != dev:
            raise ValueError(f"read is on {read.device}, the anchor on {dev}")
        read_streams = _check_streams("read_streams", read_streams, B, NW, H)
    elif read is not None or read_streams is not None:
        raise ValueError("read and read_streams are for a dual policy: give read_spec too")
    if block_v is not None and (block_v < 1 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    if exchange is None:
        exchange = CHAIN_EXCHANGE
    if exchange is not None and exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES} or None, got {exchange!r}")
    if prefetch is not None and not isinstance(prefetch, bool):
        raise ValueError(f"prefetch must be None, True or False, got {prefetch!r}")
    if not (maxnreg is None or maxnreg == "auto" or (
            isinstance(maxnreg, int) and not isinstance(maxnreg, bool) and 16 <= maxnreg <= 255)):
        raise ValueError(f"maxnreg must be 'auto', None or an int in [16, 255], got {maxnreg!r}")
    interp = KERNELS_INTERPRETED  # the mode the kernels were decorated in
    bv = block_v or chain_block_v(V, K)
    nt = triton.cdiv(V, bv)
    pow2 = nt & (nt - 1) == 0
    if exchange is None:
        exchange = "slots" if pow2 else "counter"
    elif exchange == "slots" and not pow2:
        raise ValueError(f"exchange='slots' needs a power-of-two number of row tiles per matrix, "
                         f"got {nt} (V={V}, {bv} rows per tile); use 'counter' or None")
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
    ap = _typed_codes(spec, codes)
    S = torch.empty(B, NW, H, V, K, dtype=torch.float32, device=dev) if store_states else None
    out = torch.empty(B, T, H, V, dtype=torch.float32, device=dev) if q is not None else None
    need_amax = _kind(spec) in (_K_MATRIX, _K_NVFP4) or (
        dual and _kind(read_spec) in (_K_MATRIX, _K_NVFP4))
    if dual:  # the read copies of the last two windows (the kernel reads the previous one)
        rbufs = _alloc_copy(read_spec, (B * 2, H, V, K), dev)
        rp = _typed_codes(read_spec, rbufs[0])
        rst = stream_keys_to(read_streams.reshape(-1).contiguous(), dev)
    per_window = nt if exchange == "slots" else 2
    sync = torch.zeros(1 + (per_window * B * H * NW if split and need_amax else 0),
                       dtype=torch.int32, device=dev)
    st = stream_keys_to(streams.reshape(-1).contiguous(), dev)
    pick = lambda t: t if t is not None else codes  # noqa: E731
    programs = B * H * (nt if split else 1)
    if maxnreg == "auto":
        maxnreg = resident_maxnreg(programs, num_warps, _sm_count(dev)) if split else None
    launch = _maxnreg_launch(maxnreg)
    _chain_kernel[(programs,)](
        anchor.contiguous(), la, k, v, beta, pick(None if q is None else q.contiguous()),
        pick(out), st, int(seed), codes, pick(bufs[1]), pick(bufs[2]), ap, pick(S), sync,
        read.contiguous() if dual else codes, rst if dual else st,
        rbufs[0] if dual else codes, pick(rbufs[1]) if dual else codes,
        pick(rbufs[2]) if dual else codes, rp if dual else codes,
        H, V, T, L, NW, nslot,
        K=K, KH=K // 2, BV=bv, LP=max(2, triton.next_power_of_2(L)), NT=nt, GDN=gdn,
        OUT=q is not None, STORE_S=store_states, SPLIT=split, NEED_AMAX=need_amax,
        PF=_prefetch(prefetch, gdn, q is not None),
        XCH=1 if exchange == "slots" else 0, num_warps=num_warps, **launch,
        enable_fp_fusion=False, P=_decode_consts(spec), CA=_cast_consts(spec), DUAL=dual,
        PR=_decode_consts(read_spec if dual else spec),
        CR=_cast_consts(read_spec if dual else spec))
    # every anchor slot, or the last window's only (slot (NW - 1) % nslot); the last read copy
    A = _dequantised(spec, bufs, (B, H, V, K), nslot, None if all_anchors else (NW - 1) % nslot)
    R = _dequantised(read_spec, rbufs, (B, H, V, K), 2, (NW - 1) % 2) if dual else None
    return ChainResult(S, A, out, R)


def _dequantised(spec, bufs, shape, nslot: int, last: int | None) -> torch.Tensor:
    """FP32 ``[B, nslot or 1, H, V, K]`` (``shape`` = (B, H, V, K)) of the copies the kernel
    stored in ``nslot`` slots per sequence (``bufs`` from ``_alloc_copy`` with leading dim
    ``B * nslot``): every slot, or only slot ``last``."""
    B, H, V, K = shape
    if last is not None:
        bufs = tuple(None if t is None else t.reshape(B, nslot, *t.shape[1:])[:, last].contiguous()
                     for t in bufs)
        nslot = 1
    packed = _as_stored(spec, (B * nslot, H, V, K), bufs)
    A = packed if isinstance(packed, torch.Tensor) else packed.dequantize()
    return A.to(torch.float32).reshape(B, nslot, H, V, K)


def _check_streams(name: str, streams, B: int, NW: int, H: int) -> torch.Tensor:
    streams = torch.as_tensor(streams)
    if streams.is_floating_point() or streams.is_complex() or streams.dtype == torch.bool \
            or tuple(streams.shape) != (B, NW, H):
        raise ValueError(f"{name} must be integer stream keys [B, NW, H] = {[B, NW, H]}, got "
                         f"{streams.dtype} {list(streams.shape)}")
    return streams
