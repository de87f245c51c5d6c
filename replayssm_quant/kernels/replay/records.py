"""The records kernel: everything that reads a checkpoint plus buffer records in output-only
form -- decode step (with the ring append), verify, and the GDN correction solve.

``_records_kernel``, one program per (sequence, head, tile of ``BV`` value rows):

* outputs ``o_p = gamma_{1:p} (C q) + sum_{j<=p} gamma_{j+1:p} (k_j . q) w_j`` for ``TQ`` query
  positions ``p = os .. os + TQ - 1`` (decode step: ``TQ = 1``; verify: ``T``);
* (GDN) the unit lower-triangular solve for the corrections of rows ``ss .. n - 1``
  ``u_p = beta_p (v_p - gamma_{1:p} C k_p) - sum_{i<p} beta_p gamma_{i+1:p} (k_i . k_p) u_i``
  with the rows before ``ss`` taken from the ring (the cached read-path corrections) (step: one
  row against R; verify: T rows against R; flush: every row against the anchor A);
* (decode step) the append: the new record is written into the ring in the same launch.

Rows are separable along the value axis (``C k``, ``C q`` and every ``u``/``w`` are per value
row), so a program never needs another program's rows and S is never formed. The records of a
program (``la``, ``k`` of up to ``LP`` slots, ``w`` of its rows) are held in registers. C is held
as scaling blocks ``[BV, K / block, block]`` (FP4: the even and the odd element of each block in
two tensors, as the nibbles hold them) and each block's scale multiplies the block's partial dot
product, not every element (an output-only reassociation).

Torch references: :func:`replayssm_quant.replay.mamba2.mamba2_step_output`,
:func:`~replayssm_quant.replay.mamba2.mamba2_verify`,
:func:`replayssm_quant.replay.gdn.gdn_step_output`, :func:`~replayssm_quant.replay.gdn.gdn_verify`,
:func:`replayssm_quant.replay.core.solve_corrections`; the state-object entry points at the end
have the signatures of ``replay.mamba2.mamba2_state_*`` / ``replay.gdn.gdn_state_*``.
Tests: ``tests/test_replay_kernels.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import formats as F
from ...checkpoints import Checkpoints, length_mask
from .codec import (_check_supported, _decode_code, _decode_consts, _decode_e4m3, _e8m0_value,
                    _stored_args)

# Value rows per program of the records kernel (step/verify/solve; the flush kernel's tile is
# flush.DEFAULT_BV_FLUSH): the best of the configurations timed on an H200
# (docs/kernels-replay.md).
DEFAULT_BV = 64
DEFAULT_WARPS = 4
_PSEUDO_BLOCK = 32  # records kernel: block length of a C tile for formats without blocks
MIN_LP = 16  # smallest register tile of record slots


# ----------------------------------------------------------------------------------------
# records kernel: step / verify / GDN correction solve, output-only
# ----------------------------------------------------------------------------------------


@triton.jit
def _load_c_blocks(c_ptr, bs_ptr, ms_ptr, mat, rows, rmask, V,
                   K: tl.constexpr, NB: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
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
    if D.FP4:
        byte = tl.load(c_ptr + rowg[:, None, None] * (K // 2) + col[None, :, :], mask=m3,
                       other=0).to(tl.int32)
        xe = _decode_code(byte & 15, D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
        xo = _decode_code(byte >> 4, D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
    else:
        x = tl.load(c_ptr + rowg[:, None, None] * K + col[None, :, :], mask=m3, other=0)
        if D.KIND <= 1:
            xe = x.to(tl.float32)
        else:
            xe = _decode_code(x, D.EB, D.MB, D.EMIN, D.SUBQ, D.NANF)
        xo = xe
    m2 = rmask[:, None]
    if D.KIND <= 1:
        sc = tl.full([rows.shape[0], NB], 1.0, tl.float32)
    if D.KIND == 2:
        sc = tl.full([rows.shape[0], NB], 1.0, tl.float32) * tl.load(ms_ptr + mat)
    if D.KIND == 3:
        sbc = tl.load(bs_ptr + rowg[:, None] * NB + nb[None, :], mask=m2, other=0)
        sc = _decode_e4m3(sbc) * tl.load(ms_ptr + mat)
    if D.KIND == 4:
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
        C: tl.constexpr):  # C: the stored checkpoint's DecodeConsts
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

    xe, xo, sc = _load_c_blocks(c_ptr, cbs_ptr, cms_ptr, mat, rows, rmask, V, K, NB, W, C)

    # ---- GDN: solve rows ss..n-1 (forward substitution, one row at a time)
    if GDN:
        for p in range(ss, n):
            if D_REL:
                pd = p - ss
            else:
                pd = p
            kp_ptr = dk_ptr + ((b * TD + pd) * G + g) * K
            ck = _dot_blocks(xe, xo, sc, kp_ptr, NB, W, C.FP4)  # C k_p
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
        cq = _dot_blocks(xe, xo, sc, qp_ptr, NB, W, C.FP4)  # C q
        kq = tl.sum(kmat * tl.load(qp_ptr + kk)[None, :], axis=1)  # k_j . q
        cp = tl.sum(tl.where(idx == p, cvec, 0.0), axis=0)
        upto = idx <= p
        m = tl.where(upto, tl.exp(tl.where(upto, cp - cvec, 0.0)), 0.0)
        o = tl.exp(cp) * cq + tl.sum((m * kq)[:, None] * U, axis=0)
        tl.store(o_ptr + ((b * TQ + t) * H + h) * V + rows, o, mask=rmask)


# ----------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------


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
        num_warps=num_warps, C=_decode_consts(spec))
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


def gdn_state_step(cps: Checkpoints, ring: dict, h, q, k, v, g, beta):
    """Kernel of :func:`replay.gdn.gdn_state_step`: :func:`gdn_step_kernel`."""
    return gdn_step_kernel(cps.read_stored, ring, q, k, v, g, beta, h)


def gdn_state_verify(cps: Checkpoints, la, beta, v, k, q, u_known, start, window: int,
                     fold_cached_corrections: bool = False):
    """Kernel of :func:`replay.gdn.gdn_state_verify`: :func:`gdn_verify_kernel`."""
    return gdn_verify_kernel(cps.read_stored, cps.anchor_stored, la, beta, v, k, q, u_known,
                             start, window, fold_cached_corrections)
