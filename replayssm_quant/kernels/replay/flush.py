"""The flush kernel: reconstruct S from the anchor A and the committed records, then cast A and
R independently from the same unrounded S.

``_flush_kernel``, one program per (sequence, head) matrix: reconstruct
``S = gamma_{1:J} A + sum_j gamma_{j+1:J} w_j k_j^T`` tile by tile from the (dequantised in
kernel) anchor and the committed records, then round the same unrounded FP32 tile twice:
``A <- Q_rec(S)`` and ``R <- Q_read(S)``, writing packed codes and scales, with SR bits keyed by
:func:`replayssm_quant.checkpoints.checkpoint_streams` (copy bit 0 / 1). Formats with a matrix
scale (fp8, nvfp4) need the matrix amax before rounding: a first pass reconstructs the tiles for
the amax only, a second reconstructs them again (the same FP32 operations in the same order, so
the same values) and rounds. Optionally it writes S (the state objects read the flush token's
output from it) and/or the flush token's output S q. GDN corrections for the flush come from the
records kernel (:func:`~.records.gdn_corrections_kernel`, C = A, every row solved) in a launch
before; the folded values are then plain ``w`` as for Mamba-2.

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
from ...philox import stream_keys_to
from ...policy import require_policy
from .codec import (_K_MATRIX, _K_NVFP4, _alloc_copy, _as_stored, _cast_consts, _cast_store,
                    _check_supported, _decode_consts, _finite_abs, _kind, _load_stored,
                    _matrix_scale, _stored_args)
from .records import DEFAULT_WARPS, gdn_corrections_kernel

DEFAULT_BV_FLUSH = 32  # value rows per tile: the best timed on an H200 (docs/kernels-replay.md)


@triton.jit
def _reconstruct_tile(a_ptr, abs_ptr, ams_ptr, la_ptr, w_ptr, k_ptr, mat, b, h, g, rows, rmask,
                      n, total, H, G, V, J,
                      K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr, A: tl.constexpr):
    """Rows of ``S = gamma_{1:n} A + sum_{j<n} gamma_{j+1:n} w_j k_j^T`` as (even, odd); the
    stored anchor is decoded with ``A`` (its :class:`~.codec.DecodeConsts`)."""
    ae, ao = _load_stored(a_ptr, abs_ptr, ams_ptr, mat, rows, rmask, V, K, KH, BV, A)
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
        a_ptr, abs_ptr, ams_ptr,  # stored anchor (decoded with A)
        la_ptr, w_ptr, k_ptr, len_ptr,  # records [B,J,H], [B,J,H,V], [B,J,G,K]; length [B]
        sta_ptr, str_ptr, seed,  # stream keys [B*H] of the anchor / read casts
        oa_ptr, oabs_ptr, oams_ptr,  # new anchor: codes, block scales, matrix scale
        or_ptr, orbs_ptr, orms_ptr,  # new read copy
        s_ptr, q_ptr, y_ptr,  # S [B,H,V,K] (STORE_S); q [B,G,K] -> y = S q [B,H,V] (Q_OUT)
        H, G, V, J,
        K: tl.constexpr, KH: tl.constexpr, BV: tl.constexpr,
        TWO: tl.constexpr, STORE_S: tl.constexpr, Q_OUT: tl.constexpr,
        NEED_AMAX: tl.constexpr,
        A: tl.constexpr, CA: tl.constexpr, CR: tl.constexpr):
    # A: DecodeConsts of the stored anchor; CA, CR: CastConsts of the anchor and read casts
    mat = tl.program_id(0).to(tl.int64)
    b = mat // H
    h = mat - b * H
    g = h // (H // G)
    n = tl.load(len_ptr + b)
    total = tl.zeros([], tl.float32)
    for jj in range(0, n):
        total = total + tl.load(la_ptr + (b * J + jj) * H + h)
    kk = tl.arange(0, K)
    amax = tl.zeros([], tl.float32)
    if NEED_AMAX:
        for v0 in range(0, V, BV):
            rows = v0 + tl.arange(0, BV)
            rmask = rows < V
            se, so = _reconstruct_tile(a_ptr, abs_ptr, ams_ptr, la_ptr, w_ptr, k_ptr, mat, b, h,
                                       g, rows, rmask, n, total, H, G, V, J, K, KH, BV, A)
            fe = tl.where(rmask[:, None], _finite_abs(se), 0.0)
            fo = tl.where(rmask[:, None], _finite_abs(so), 0.0)
            amax = tl.maximum(amax, tl.maximum(tl.max(tl.max(fe, axis=1), axis=0),
                                               tl.max(tl.max(fo, axis=1), axis=0)))
    sa = _matrix_scale(amax, CA.KIND, CA.FMAX, CA.SCALE)
    sr = _matrix_scale(amax, CR.KIND, CR.FMAX, CR.SCALE)
    if Q_OUT:
        qv = tl.load(q_ptr + (b * G + g) * K + kk)
        qe, qo = tl.split(tl.reshape(qv, [KH, 2]))
    for v0 in range(0, V, BV):
        rows = v0 + tl.arange(0, BV)
        rmask = rows < V
        se, so = _reconstruct_tile(a_ptr, abs_ptr, ams_ptr, la_ptr, w_ptr, k_ptr, mat, b, h, g,
                                   rows, rmask, n, total, H, G, V, J, K, KH, BV, A)
        if STORE_S:
            x = tl.reshape(tl.join(se, so), [BV, K])
            tl.store(s_ptr + (mat * V + rows.to(tl.int64))[:, None] * K + kk[None, :], x,
                     mask=rmask[:, None])
        if Q_OUT:
            y = tl.sum(se * qe[None, :], axis=1) + tl.sum(so * qo[None, :], axis=1)
            tl.store(y_ptr + mat * V + rows, y, mask=rmask)
        _cast_store(se, so, rows, rmask, mat, V, sa, seed, sta_ptr, oa_ptr, oabs_ptr, K, KH, BV, CA)
        if TWO:
            _cast_store(se, so, rows, rmask, mat, V, sr, seed, str_ptr, or_ptr, orbs_ptr, K, KH,
                        BV, CR)
    if CA.MS:
        tl.store(oams_ptr + mat, sa)
    if TWO:
        if CR.MS:
            tl.store(orms_ptr + mat, sr)


# ----------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------


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
    policy = require_policy(policy)  # parsed at the edges
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
        A=_decode_consts(aspec), CA=_cast_consts(policy.rec),
        CR=_cast_consts(policy.read if two else policy.rec))
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
def mamba2_state_flush(anchor, recs: dict, length, policy, *, seed, layer, sequence_ids,
                       flush_index) -> FlushResult:
    """Kernel of :func:`replay.mamba2.mamba2_state_flush`: :func:`mamba2_flush_kernel`."""
    return mamba2_flush_kernel(anchor, recs["la"], recs["v"], recs["k"], length, policy,
                               seed=seed, layer=layer, sequence_ids=sequence_ids,
                               flush_index=flush_index)[0]


def gdn_state_flush(anchor, recs: dict, length, policy, *, seed, layer, sequence_ids,
                    flush_index, fold_cached_corrections: bool = False) -> FlushResult:
    """Kernel of :func:`replay.gdn.gdn_state_flush`: :func:`gdn_flush_kernel`."""
    return gdn_flush_kernel(anchor, recs["la"], recs["beta"], recs["v"], recs["k"], length,
                            policy, seed=seed, layer=layer, sequence_ids=sequence_ids,
                            flush_index=flush_index, u_cached=recs["uR"],
                            fold_cached_corrections=fold_cached_corrections)[0]
