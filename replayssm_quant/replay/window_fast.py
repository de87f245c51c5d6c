"""Batched teacher-forced emulation: full windows of a segment at once, and the exact prefill
scan. The readable per-window reference is :mod:`.window`; these functions give the same
results (same casts and SR bits; outputs up to float reassociation on the kernel path, bit for
bit on the torch path, where they *are* the window form).

The window module runs one window per call (the readable reference of the window form, and
the torch path). On the kernel path (CUDA, float32) the functions below compute the full
windows of a segment with only the inherently sequential part left sequential, the anchor
recurrence across windows,
    S_{w+1} = reconstruct(A_w, records_w),   A_{w+1} = Q_rec(S_{w+1}),
as one launch of the anchor-chain kernel (kernels/replay ``anchor_chain``), the same
kernel the window form's flush calls (``flush_window``), so a layer given identical inputs
rounds identically on both. That launch also writes every output: for single-checkpoint
policies (R is A) from the anchor, for dual policies from the read copy R_w = Q_read(S_w),
which the kernel casts each window from the same unrounded S (GDN: with the read-path
corrections solved against R). Casts use the same stream keys as core.cast_checkpoints (one
key per (layer, sequence, head, flush, copy)), so SR bits are identical. The exact prefill
scan (``exact_scan``) computes the outputs of all windows in batched products
(intra-window causal sums, decayed state terms; ``_outputs``) with the "WY" form of a
window step:
  Mamba-2: S_{w+1} = gamma_w S_w + P_w,             P_w = sum_j m_j v_j k_j^T
  GDN:     S_{w+1} = S_w G_w + P_w,  G_w = gamma_w I - K^T diag(beta gamma_{1:j}) T^-T diag(m) K,
           P_w = (beta v)^T T^-T diag(m) K, with T the unit lower-triangular correction system
           (DESIGN.md: u_j + sum_{i<j} beta_j gamma_{i+1:j} (k_i.k_j) u_i = beta_j (v_j - gamma_{1:j} A k_j)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backend import kernel_ops as kr  # kernel entry points, through the backend seam
from ..config import StateConfig
from . import core
from .mamba2 import mamba2_records
from .window import (WindowCarry, gdn_emulate, gdn_window, mamba2_emulate, mamba2_window,
                     torch_path)

__all__ = ["mamba2_emulate_fast", "gdn_emulate_fast", "exact_scan", "GROUP_ELEMENTS"]

GROUP_ELEMENTS = 1 << 24  # bound on the elements of a per-group stacked tensor (memory)


@dataclass
class _Prep:
    """Anchor-independent quantities of ``n`` windows of length ``L`` (one group)."""

    cc: torch.Tensor  # [B, n, H, L] cumsum of log decays inside each window
    gtot: torch.Tensor  # [B, n, H] log decay of the whole window
    K: torch.Tensor  # [B, n, H, L, K]
    Qm: torch.Tensor  # [B, n, H, L, K]
    D: torch.Tensor  # [B, n, H, L, L] gamma_{j+1:t} for j <= t, else 0
    Wt: torch.Tensor | None  # Mamba-2: v^T [B, n, H, V, L]
    BVt: torch.Tensor | None  # GDN: (beta v)^T T^-T  [B, n, H, V, L]
    BG: torch.Tensor | None  # GDN: beta_j gamma_{1:j} [B, n, H, L]
    TinvT: torch.Tensor | None  # GDN: T^-T [B, n, H, L, L]
    G: torch.Tensor | None  # GDN: [B, n, H, K, K] (wy only)
    P: torch.Tensor | None  # [B, n, H, V, K] (wy only)


def _prep(la, k, q, v, beta, L: int, wy: bool = True) -> _Prep:
    """``la [B, n*L, H]``, ``k, q [B, n*L, H, K]`` (head-expanded), ``v [B, n*L, H, V]``,
    ``beta [B, n*L, H]`` (GDN) or None (Mamba-2: the written value is v). ``wy``: also the
    WY-form step (``G``, ``P``) of the exact-anchor recurrence (``_advance_state``)."""
    Bz, T, H = la.shape
    n = T // L
    cc = la.reshape(Bz, n, L, H).cumsum(2).permute(0, 1, 3, 2)  # [B, n, H, L]
    gtot = cc[..., -1]
    K = k.reshape(Bz, n, L, H, -1).permute(0, 1, 3, 2, 4)
    Qm = q.reshape(Bz, n, L, H, -1).permute(0, 1, 3, 2, 4)
    Vt = v.reshape(Bz, n, L, H, -1).permute(0, 1, 3, 4, 2)  # [B, n, H, V, L]
    causal = torch.ones(L, L, dtype=torch.bool, device=la.device).tril()
    neg_inf = torch.full((), float("-inf"), dtype=la.dtype, device=la.device)  # no host copy
    D = torch.exp(torch.where(causal, cc[..., :, None] - cc[..., None, :], neg_inf))
    m = torch.exp(gtot[..., None] - cc)  # gamma_{j+1:L}, [B, n, H, L]
    mK = m[..., None] * K
    if beta is None:
        P = torch.matmul(Vt, mK) if wy else None
        return _Prep(cc, gtot, K, Qm, D, Vt, None, None, None, None, P)
    be = beta.reshape(Bz, n, L, H).permute(0, 1, 3, 2)  # [B, n, H, L]
    kk = torch.matmul(K, K.transpose(-1, -2))  # [.., j, i] = k_j . k_i
    eye = torch.eye(L, dtype=la.dtype, device=la.device)
    Tm = eye + (be[..., :, None] * D * kk).tril(-1)
    TinvT = torch.linalg.solve_triangular(Tm, eye.expand_as(Tm), upper=False,
                                          unitriangular=True).transpose(-1, -2)
    BVt = torch.matmul(be[..., None, :] * Vt, TinvT)
    BG = be * torch.exp(cc)
    if not wy:
        return _Prep(cc, gtot, K, Qm, D, None, BVt, BG, TinvT, None, None)
    P = torch.matmul(BVt, mK)
    G = torch.exp(gtot)[..., None, None] * torch.eye(K.shape[-1], dtype=la.dtype, device=la.device) \
        - torch.matmul(K.transpose(-1, -2) * BG[..., None, :], torch.matmul(TinvT, mK))
    return _Prep(cc, gtot, K, Qm, D, None, BVt, BG, TinvT, G, P)


def _advance_state(C: torch.Tensor, p: _Prep, w: int) -> torch.Tensor:
    """Unrounded state after window ``w`` from the state ``C [B, H, V, K]`` before it."""
    if p.G is None:
        return torch.exp(p.gtot[:, w])[..., None, None] * C + p.P[:, w]
    return torch.matmul(C, p.G[:, w]) + p.P[:, w]


def _written(p: _Prep, R: torch.Tensor) -> torch.Tensor:
    """Values written by the records of every window when read from ``R [B, n, H, V, K]``:
    Mamba-2 v^T; GDN the corrections solved against R, ``u^T = (beta v)^T T^-T -
    (R K^T diag(beta gamma_{1:j})) T^-T``. Returns ``[B, n, H, V, L]``."""
    if p.BVt is None:
        return p.Wt
    RK = torch.matmul(R, p.K.transpose(-1, -2))  # [B, n, H, V, L]
    return p.BVt - torch.matmul(RK * p.BG[..., None, :], p.TinvT)


def _outputs(p: _Prep, R: torch.Tensor) -> torch.Tensor:
    """Outputs ``[B, n, H, V, L]`` of every position of every window read from ``R_w``
    plus the window's records: ``gamma_{1:t} (R q_t) + sum_{j<=t} gamma_{j+1:t} (k_j.q_t) w_j``."""
    Wt = _written(p, R)
    RQ = torch.matmul(R, p.Qm.transpose(-1, -2))  # [B, n, H, V, L]
    QK = torch.matmul(p.Qm, p.K.transpose(-1, -2)) * p.D  # [t, j]
    return torch.exp(p.cc)[..., None, :] * RQ + torch.matmul(Wt, QK.transpose(-1, -2))


def _group_size(Bz: int, H: int, V: int, K: int, L: int) -> int:
    per_window = Bz * H * (3 * V * K + K * K + 4 * L * (V + K))
    return max(1, GROUP_ELEMENTS // per_window)


@core.per_sequence  # every sequence alone on CPU (window module, "Invariance")
def exact_scan(S0: torch.Tensor, la, k, q, v, beta=None, *, chunk: int = 64):
    """Exact (unrounded) chunked scan from state ``S0 [B, H, V, K]``: outputs ``S_t q_t``
    ``[B, T, H, V]`` and the final state. Head-expanded inputs as :func:`_prep`; ``beta`` None
    for Mamba-2 (written value v), else GDN. The prefill of a prompt (DESIGN.md "Prefill")."""
    Bz, T, H = la.shape
    V, K = S0.shape[-2:]
    outs, S, t = [], S0, 0
    while t < T:
        L = min(chunk, T - t)
        n = min((T - t) // L, _group_size(Bz, H, V, K, L))
        s = slice(t, t + n * L)
        p = _prep(la[:, s], k[:, s], q[:, s], v[:, s], None if beta is None else beta[:, s], L)
        states = [S]
        for w in range(n):
            states.append(_advance_state(states[-1], p, w))
        o = _outputs(p, torch.stack(states[:-1], 1))
        outs.append(o.permute(0, 1, 4, 2, 3).reshape(Bz, n * L, H, V))
        S = states[-1]
        t += n * L
    return (torch.cat(outs, 1) if outs else v.new_zeros(Bz, 0, H, V)), S


def _stream_keys(layer, ids, H, flush, copy):
    """Stream keys ``[B, n, H]`` (as core.checkpoint_streams, for n flushes at once)."""
    from ..philox import stream_key

    key = stream_key(layer=layer, sequence=ids.to(torch.int64).cpu()[:, None, None],
                     head=torch.arange(H, dtype=torch.int64)[None, None, :],
                     flush=flush.to(torch.int64).cpu()[:, :, None], copy=copy)
    return key


def _block(carry: WindowCarry, la, k, q, v, beta, *, config: StateConfig):
    """Full windows on the kernel path (``carry.h == 0``, length a multiple of L) in one
    anchor-chain launch: the anchor recurrence, each window's read cast (dual policies: from
    the same unrounded S, with the read stream keys) and every output, written per program
    (so no output depends on the batch or the number of windows). Returns
    ``(o [B, T, H, V], carry)``.

    (Until 2026-12-01 dual policies ran the chain over groups of windows and then the read
    casts and outputs of a group as batched torch products; on CUDA those outputs changed in
    the last bits with the group size, which followed the free device memory: 5-72% of a
    4096-token segment's outputs differed between groups of 256, 37, 3 and 1 windows,
    ``benchmarks/results/grouping_h200.json``.)"""
    Bz, T, H = la.shape
    policy, L, seed = config.policy, config.window, config.seed
    layer, ids = carry.layer, carry.sequence_ids
    A, R, fi = carry.anchor, carry.read, carry.flush_index
    n = T // L
    flush = fi[:, None] + torch.arange(n, device=fi.device)[None, :]
    keys = _stream_keys(layer, ids, H, flush, core.ANCHOR_COPY)
    if policy.single_checkpoint:  # R is A
        res = kr.anchor_chain(A, la, k, v, beta, policy.rec, L=L, seed=seed, streams=keys, q=q,
                              store_states=False, all_anchors=False)
        A = res.anchors[:, 0].contiguous()
        return res.outputs, WindowCarry(A, A, {}, fi + n, ids, layer)
    res = kr.anchor_chain(A, la, k, v, beta, policy.rec, L=L, seed=seed, streams=keys, q=q,
                          store_states=False, all_anchors=False, read_spec=policy.read, read=R,
                          read_streams=_stream_keys(layer, ids, H, flush, core.READ_COPY))
    return res.outputs, WindowCarry(res.anchors[:, 0].contiguous(), res.reads[:, 0].contiguous(),
                                    {}, fi + n, ids, layer)


def _split(h: int, T: int, L: int) -> tuple[int, int]:
    """(tokens that complete the current partial window, tokens in full windows after it)."""
    head = min((L - h) % L, T)
    return head, (T - head) // L * L


def mamba2_emulate_fast(carry: WindowCarry, x, dt, A, B, C, D=None, *, config: StateConfig):
    """:func:`~.window.mamba2_emulate` with the full windows batched on the kernel path (same
    arguments and results, up to float reassociation; same casts and SR bits): the partial
    window at each end runs through :func:`~.window.mamba2_window`, the full windows in between
    through the anchor-chain kernel. On the torch path it is :func:`~.window.mamba2_emulate`
    (window module, "Invariance")."""
    if torch_path(carry.anchor, policy=config.policy):
        return mamba2_emulate(carry, x, dt, A, B, C, D, config=config)
    L = config.window
    T = x.shape[1]
    head, full = _split(carry.h, T, L)
    ys = []
    if head:
        y, carry = mamba2_window(carry, x[:, :head], dt[:, :head], A, B[:, :head], C[:, :head], D,
                                 config=config)
        ys.append(y)
    if full:
        s = slice(head, head + full)
        H = x.shape[2]
        la, v, k = mamba2_records(x[:, s], dt[:, s], A, B[:, s])
        y, carry = _block(carry, la, core.expand_heads(k, H, 2), core.expand_heads(C[:, s], H, 2), v,
                          None, config=config)
        if D is not None:
            y = y + D[:, None] * x[:, s]
        ys.append(y)
    if head + full < T:
        s = slice(head + full, T)
        y, carry = mamba2_window(carry, x[:, s], dt[:, s], A, B[:, s], C[:, s], D, config=config)
        ys.append(y)
    return (torch.cat(ys, 1) if ys else x.new_zeros(x.shape)), carry


def gdn_emulate_fast(carry: WindowCarry, q, k, v, g, beta, *, config: StateConfig):
    """GDN counterpart of :func:`mamba2_emulate_fast`. The cached-fold variant (anchor built
    from the read-path corrections, so every read cast is sequential) runs
    :func:`~.window.gdn_emulate`."""
    if torch_path(carry.anchor, config.fold, config.policy):
        return gdn_emulate(carry, q, k, v, g, beta, config=config)
    L = config.window
    T, HV = v.shape[1], v.shape[2]
    head, full = _split(carry.h, T, L)
    os_ = []
    if head:
        o, carry = gdn_window(carry, q[:, :head], k[:, :head], v[:, :head], g[:, :head],
                              beta[:, :head], config=config)
        os_.append(o)
    if full:
        s = slice(head, head + full)
        o, carry = _block(carry, g[:, s], core.expand_heads(k[:, s], HV, 2),
                          core.expand_heads(q[:, s], HV, 2), v[:, s], beta[:, s], config=config)
        os_.append(o)
    if head + full < T:
        s = slice(head + full, T)
        o, carry = gdn_window(carry, q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], config=config)
        os_.append(o)
    return (torch.cat(os_, 1) if os_ else v.new_zeros(v.shape)), carry
