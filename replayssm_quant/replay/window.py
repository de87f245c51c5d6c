"""Teacher-forced window form of ReplaySSM, for emulation over long documents.

With all tokens known, standard ReplaySSM decoding (DESIGN.md section 3) can be computed a
window at a time: inside a window, the outputs are the intra-window causal sum plus the
decayed read-copy term (GDN: with corrections solved against the read path); at the window
end the *same* flush routine as the state objects (:func:`~.mamba2.mamba2_flush`,
:func:`~.gdn.gdn_flush`) folds the records into the anchor and casts A and R independently,
with the same SR streams. On the torch path (CPU, float64, ``REPLAYSSM_BACKEND=torch``)
each sequence's outputs, anchors and read copies are bit-identical for any batch, batch
position and cut of the tokens into calls, one token per call included (the adapters' step
path is this form with one token; see "Invariance" below); stepping through
:class:`~.Mamba2ReplayState` / :class:`~.GDNReplayState` gives the same checkpoints bit for bit
(identical flush inputs) and the same outputs up to float reassociation. On CUDA the window
form and its batched full windows share the anchor-chain kernel (:func:`flush_window`), so
they round identically; the state objects' flush kernel applies the same rounding rules but
sums in another order, so its chain is a different, equally valid realisation.

A :class:`WindowCarry` holds what passes between windows and between segments of a long
document: the dequantised checkpoints, the records of the current partial window and the
next flush index. Window boundaries are counted from the last flush (prefill = flush 0), so a
segment may end mid-window and the next segment continues it.

Typical use for one layer (Mamba-2)::

    carry = initial_carry(S_prompt, policy, seed=seed, layer=layer_id, sequence_ids=ids)
    for segment in segments:                      # x [B, T, H, P], dt [B, T, H], ...
        y, carry = mamba2_emulate(carry, x, dt, A, B, C, D, policy=policy, window=L,
                                  seed=seed, layer=layer_id, sequence_ids=ids)

``eager:F`` runs with window 1 (conventional decoding), exactly like the state objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import backend as B
from ..backend import kernel_ops as kr  # kernel entry points, through the backend seam
from ..policy import StatePolicy
from . import core
from .gdn import gdn_flush
from .mamba2 import mamba2_flush, mamba2_records


@dataclass
class WindowCarry:
    """State carried across windows and segments (one layer, a batch of sequences).

    Attributes:
        anchor, read: dequantised A and R ``[B, H, V, K]`` (working dtype; ``read is anchor``
            for single-checkpoint policies).
        records: records since the last flush, each ``[B, h, ...]`` (Mamba-2: ``la, v, k``
            with grouped k; GDN: ``la, beta, v, k, uR``).
        flush_index: int64 ``[B]`` index of the next flush (SR streams), on the host.
    """

    anchor: torch.Tensor
    read: torch.Tensor
    records: dict = field(default_factory=dict)
    flush_index: torch.Tensor | None = None

    @property
    def h(self) -> int:
        """Committed records in the current window (same for every sequence)."""
        return next(iter(self.records.values())).shape[1] if self.records else 0


def _seq_ids(sequence_ids, batch):
    """Sequence ids as a host int64 ``[B]`` tensor: like the flush indices they only key SR
    streams, which are built on the host, so keeping them there spares a device
    synchronisation per flush."""
    ids = torch.arange(batch) if sequence_ids is None else torch.as_tensor(sequence_ids)
    return ids.to(torch.int64).cpu()


def effective_window(policy, window: int) -> int:
    """The window the state objects use: ``window``, or 1 for ``eager:F`` policies."""
    policy = StatePolicy.parse(policy)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    return 1 if policy.is_eager else window


def initial_carry(S: torch.Tensor, policy, *, seed: int = 0, layer: int = 0,
                  sequence_ids=None) -> WindowCarry:
    """Carry after a prefill with exact state ``S [B, H, V, K]`` (zeros for an empty prompt):
    A and R cast independently from S as flush 0, empty buffer (as ``prefill`` does)."""
    policy = StatePolicy.parse(policy)
    B = S.shape[0]
    ids = _seq_ids(sequence_ids, B)
    fi = torch.full((B,), core.PREFILL_FLUSH_INDEX, dtype=torch.int64)  # host bookkeeping
    cps = core.cast_checkpoints(S, policy, seed=seed, layer=layer, sequence_ids=ids, flush_index=fi)
    return WindowCarry(cps.anchor, cps.read, {}, fi + 1)


# ------------------------------------------------------------------------------ flush dispatch
CHAIN_ENV = "REPLAYSSM_ANCHOR_CHAIN"  # deprecated: the seam's REPLAYSSM_BACKEND (backend.py)


def chain_kernel_enabled(policy, anchor: torch.Tensor, fold_cached: bool = False) -> bool:
    """True when flushes run the anchor-chain kernel
    (:func:`replayssm_quant.kernels.replay.anchor_chain`, any ``rec`` format; fp32 is the exact
    recurrence): not the cached-fold variant, float32, key dim a power of two >= 32, on CUDA
    (``auto``) or forced with ``REPLAYSSM_BACKEND=triton`` (CPU: under
    ``TRITON_INTERPRET=1``); the decision is the backend seam's (:mod:`replayssm_quant.backend`,
    family ``chain``). Every flush of a layer (stepping and teacher-forced, batched or
    window by window) takes the same decision, so a layer given identical inputs rounds
    identically."""
    StatePolicy.parse(policy)
    if fold_cached:
        return False
    return B.use_kernels(B.OpFamily.CHAIN, None, device=anchor.device, dtype=anchor.dtype,
                         key_dim=anchor.shape[-1])


def flush_window(family: str, anchor, recs: dict, policy, *, seed: int, layer: int,
                 sequence_ids, flush_index, u_cached=None, fold_cached: bool = False):
    """The flush of one full window of records (every sequence at h == L), dispatched:
    the anchor-chain kernel with one window where :func:`chain_kernel_enabled`, else
    :func:`mamba2_flush` / :func:`gdn_flush`. ``recs``: ``la, v, k`` (grouped k) and GDN
    ``beta``. Returns ``(S, A, R)``: unrounded state and dequantised checkpoints."""
    policy = StatePolicy.parse(policy)
    J = recs["la"].shape[1]
    if chain_kernel_enabled(policy, anchor, fold_cached):
        H = anchor.shape[1]
        sa, sr = core.checkpoint_streams(layer=layer, sequence_ids=sequence_ids, heads=H,
                                         flush_index=flush_index)
        res = kr.anchor_chain(anchor, recs["la"], core.expand_heads(recs["k"], H, 2), recs["v"],
                              recs["beta"] if family == "gdn" else None, policy.rec, L=J,
                              seed=seed, streams=sa[:, None])
        S, A = res.states[:, 0], res.anchors[:, 0]
        if policy.single_checkpoint:
            return S, A, A
        return S, A, core.cast_state(S, policy.read, seed=seed, stream=sr)[0]
    length = torch.full((anchor.shape[0],), J, dtype=torch.int64, device=anchor.device)
    if family == "mamba2":
        res = mamba2_flush(anchor, recs["la"], recs["v"], recs["k"], policy, seed=seed,
                           layer=layer, sequence_ids=sequence_ids, flush_index=flush_index,
                           length=length)
    else:
        res = gdn_flush(anchor, recs["la"], recs["beta"], recs["v"], recs["k"], policy, seed=seed,
                        layer=layer, sequence_ids=sequence_ids, flush_index=flush_index,
                        length=length, u_cached=u_cached, fold_cached_corrections=fold_cached)
    return res.state, res.checkpoints.anchor, res.checkpoints.read


def _cat_records(carry: WindowCarry, new: dict) -> dict:
    if not carry.records:
        return {n: t.contiguous() for n, t in new.items()}
    return {n: torch.cat([carry.records[n], new[n]], 1) for n in new}


def _padded(t: torch.Tensor, L: int, at: int = 0) -> torch.Tensor:
    """A fresh zero tensor of ``L`` slots along dim 1 with ``t`` written at slots
    ``at .. at + t.shape[1] - 1``: a window's records (or queries) at the window's full length,
    so every window runs the same arithmetic on tensors of the same shape (see "Invariance")."""
    out = t.new_zeros(t.shape[0], L, *t.shape[2:])
    out[:, at: at + t.shape[1]] = t
    return out


def _check_fit(h0: int, W: int, L: int) -> None:
    if W < 1:
        raise ValueError(f"a window call needs at least one token, got {W}")
    if h0 + W > L:
        raise ValueError(f"{W} tokens after {h0} buffered records exceed the window {L}; "
                         "split the run (see mamba2_emulate / gdn_emulate)")


# ------------------------------------------------------------------------------ invariance
# Results must not depend on the batch a sequence shares, its position in it, or how a document
# is cut into segments (DESIGN.md section 3; issue 12). A last-bit difference in an unrounded
# state can put a value on the other side of a rounding boundary, and the flipped quantum then
# propagates through the anchor, so "equal up to reassociation" is not enough. On the torch
# path (CPU, float64, ``REPLAYSSM_BACKEND=torch``):
#   * every reduction of the references in ``core`` runs one sequence at a time
#     (``core.per_sequence``), so its calls have the same shapes and strides whatever batch
#     the sequence came in (BLAS picks kernels by shape and stride: a batched
#     ``[B, H, V, K] @ [B, H, K, 1]`` and the same row alone sum in different orders);
#   * the window form pads a window's records and queries to the full window L
#     (``_padded``), so a token's output, its read-path correction and the flush see tensors
#     of the same shape whether the window arrives whole, in pieces across segments, or one
#     token at a time (stepping is this form with one token): identical calls;
#   * full windows run through the same window routine (no batched multi-window form).
# So a sequence's outputs, anchors and read copies are bit-identical for any batch, batch
# position and segmentation (tests/test_invariance.py). On the kernel path (CUDA) the anchor
# chain runs one program per matrix, so its anchors do not depend on the batch either; the
# batched torch parts around it are checked on the device (docs/invariance.md).


def _torch_path(policy, anchor: torch.Tensor, fold_cached: bool = False) -> bool:
    """True where the window form runs in torch, window by window (see "Invariance")."""
    return not chain_kernel_enabled(policy, anchor, fold_cached)


# ------------------------------------------------------------------------------ Mamba-2
def mamba2_window(carry: WindowCarry, x, dt, A, B, C, D=None, *, policy, window: int,
                  seed: int = 0, layer: int = 0, sequence_ids=None):
    """Teacher-forced outputs of ``W`` tokens that fit in the current window
    (``carry.h + W <= L``), then, if the window is full, the flush.

    Args:
        carry: from :func:`initial_carry` or a previous call.
        x ``[B, W, H, P]``, dt ``[B, W, H]`` (after softplus), A ``[H]`` (negative),
        B, C ``[B, W, G, N]``, D ``[H]`` or None: post-activation inputs as for
        :meth:`Mamba2ReplayState.step`.
        policy, window, seed, layer, sequence_ids: as the state object's.

    Returns:
        ``(y [B, W, H, P], carry)``: tokens before the window end read R plus the buffer
        (:func:`core.window_outputs`); the token that fills the window reads the unrounded
        flushed state, after which A and R are recast by :func:`flush_window`. Each sequence's
        results are independent of the batch and of how the window is split into calls
        (see "Invariance").
    """
    policy = StatePolicy.parse(policy)
    L = effective_window(policy, window)
    H = x.shape[2]
    h0, W = carry.h, x.shape[1]
    _check_fit(h0, W, L)
    la, v, k = mamba2_records(x, dt, A, B)
    recs = _cat_records(carry, {"la": la, "v": v, "k": k})
    J = h0 + W
    Q = _padded(core.expand_heads(C, H, 2), L, at=h0)
    y = None
    if J < L or W > 1:  # some token reads R (else: only the flush token, from S)
        ke = core.expand_heads(_padded(recs["k"], L), H, 2)
        y = core.window_outputs(carry.read, _padded(recs["la"], L), _padded(recs["v"], L), ke,
                                Q)[:, h0:J]
    if J == L:
        ids = _seq_ids(sequence_ids, x.shape[0])
        S, An, Rn = flush_window("mamba2", carry.anchor, recs, policy, seed=seed, layer=layer,
                                 sequence_ids=ids, flush_index=carry.flush_index)
        last = core.matvec(S, Q[:, -1])  # the flush token reads the unrounded S
        if y is None:
            y = last[:, None]
        else:
            y[:, -1] = last
        carry = WindowCarry(An, Rn, {}, carry.flush_index + 1)
    else:
        carry = WindowCarry(carry.anchor, carry.read, recs, carry.flush_index)
    if D is not None:
        y = y + D[:, None] * x
    return y, carry


def mamba2_emulate(carry: WindowCarry, x, dt, A, B, C, D=None, *, policy, window: int,
                   seed: int = 0, layer: int = 0, sequence_ids=None):
    """Run ``T`` tokens (any length; a segment of a document) window by window with
    :func:`mamba2_window`; returns ``(y [B, T, H, P], carry)``."""
    L = effective_window(policy, window)
    ys, t, T = [], 0, x.shape[1]
    while t < T:
        n = min(L - carry.h, T - t)
        s = slice(t, t + n)
        y, carry = mamba2_window(carry, x[:, s], dt[:, s], A, B[:, s], C[:, s], D, policy=policy,
                                 window=L, seed=seed, layer=layer, sequence_ids=sequence_ids)
        ys.append(y)
        t += n
    return (torch.cat(ys, 1) if ys else x.new_zeros(x.shape)), carry


# ------------------------------------------------------------------------------ GDN
def gdn_window(carry: WindowCarry, q, k, v, g, beta, *, policy, window: int, seed: int = 0,
               layer: int = 0, sequence_ids=None, fold_cached_corrections: bool = False):
    """GDN counterpart of :func:`mamba2_window`.

    Inputs ``q, k [B, W, HK, DK]``, ``v [B, W, HV, DV]``, ``g, beta [B, W, HV]`` as for
    :meth:`GDNReplayState.step`. Read-path corrections of the new tokens are solved against
    R (one triangular solve of the window padded to L, :func:`core.solve_corrections`); at
    the window end the corrections are re-solved against A inside :func:`gdn_flush` (or, with
    ``fold_cached_corrections``, the cached ones are folded). Returns ``(o [B, W, HV, DV], carry)``.
    """
    policy = StatePolicy.parse(policy)
    L = effective_window(policy, window)
    Bz, W, HV = v.shape[0], v.shape[1], v.shape[2]
    h0 = carry.h
    _check_fit(h0, W, L)
    new = {"la": g, "beta": beta, "v": v, "k": k, "uR": torch.zeros_like(v)}
    recs = _cat_records(carry, new)
    J = h0 + W
    Q = _padded(core.expand_heads(q, HV, 2), L, at=h0)
    o = None
    if J < L or W > 1 or fold_cached_corrections:  # some token reads R (else: only the flush)
        P = {n: _padded(t, L) for n, t in recs.items()}
        ke = core.expand_heads(P["k"], HV, 2)
        # all rows of the padded window in one solve: the rows of earlier calls come out with
        # the same bits as when they were cached, and the new rows see exactly those
        uR = core.solve_corrections(carry.read, P["la"], P["beta"], P["v"], ke, stop=J)
        recs["uR"] = uR[:, :J]
        o = core.window_outputs(carry.read, P["la"], uR, ke, Q)[:, h0:J]
    if J == L:
        ids = _seq_ids(sequence_ids, Bz)
        S, An, Rn = flush_window("gdn", carry.anchor, recs, policy, seed=seed, layer=layer,
                                 sequence_ids=ids, flush_index=carry.flush_index,
                                 u_cached=recs["uR"], fold_cached=fold_cached_corrections)
        last = core.matvec(S, Q[:, -1])  # the flush token reads the unrounded S
        if o is None:
            o = last[:, None]
        else:
            o[:, -1] = last
        carry = WindowCarry(An, Rn, {}, carry.flush_index + 1)
    else:
        carry = WindowCarry(carry.anchor, carry.read, recs, carry.flush_index)
    return o, carry


def gdn_emulate(carry: WindowCarry, q, k, v, g, beta, *, policy, window: int, seed: int = 0,
                layer: int = 0, sequence_ids=None, fold_cached_corrections: bool = False):
    """Run ``T`` GDN tokens window by window with :func:`gdn_window`;
    returns ``(o [B, T, HV, DV], carry)``."""
    L = effective_window(policy, window)
    os_, t, T = [], 0, v.shape[1]
    while t < T:
        n = min(L - carry.h, T - t)
        s = slice(t, t + n)
        o, carry = gdn_window(carry, q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], policy=policy,
                              window=L, seed=seed, layer=layer, sequence_ids=sequence_ids,
                              fold_cached_corrections=fold_cached_corrections)
        os_.append(o)
        t += n
    return (torch.cat(os_, 1) if os_ else v.new_zeros(v.shape)), carry


# ------------------------------------------------------------------------------ batched form
# The functions above run one window per call (the readable reference of the window form, and
# the torch path). On the kernel path (CUDA, float32) the functions below compute the full
# windows of a segment with only the inherently sequential part left sequential, the anchor
# recurrence across windows,
#     S_{w+1} = reconstruct(A_w, records_w),   A_{w+1} = Q_rec(S_{w+1}),
# as one launch of the anchor-chain kernel (kernels/replay.py ``anchor_chain``), the same
# kernel the window form's flush calls (``flush_window``), so a layer given identical inputs
# rounds identically on both. For single-checkpoint policies (R is A) that launch also writes
# every output, so nothing else runs. For dual policies the read casts R_w = Q_read(S_w) never
# feed the anchor, so they are done in one batched cast after the recurrence, and the outputs
# of all windows (intra-window causal sums, decayed read-copy terms, GDN read-path corrections
# u^T = (beta v)^T T^-T - (R K^T diag(beta gamma_{1:j})) T^-T) come from one batched call.
# Casts use the same stream keys as core.cast_checkpoints (one key per (layer, sequence, head,
# flush, copy)), so SR bits are identical. The exact prefill scan (``exact_scan``) uses the
# same anchor-independent precomputation with the "WY" form of a window step:
#   Mamba-2: S_{w+1} = gamma_w S_w + P_w,             P_w = sum_j m_j v_j k_j^T
#   GDN:     S_{w+1} = S_w G_w + P_w,  G_w = gamma_w I - K^T diag(beta gamma_{1:j}) T^-T diag(m) K,
#            P_w = (beta v)^T T^-T diag(m) K, with T the unit lower-triangular correction system
#            (DESIGN.md: u_j + sum_{i<j} beta_j gamma_{i+1:j} (k_i.k_j) u_i = beta_j (v_j - gamma_{1:j} A k_j)).

GROUP_ELEMENTS = 1 << 24  # bound on the elements of a per-group stacked tensor (memory)
GROUP_ELEMENTS_CUDA = 1 << 26  # on CUDA: fewer, larger groups (launches), ~256 MB per tensor


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
    neg_inf = torch.tensor(float("-inf"), dtype=la.dtype, device=la.device)
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


def _group_size(Bz: int, H: int, V: int, K: int, L: int, device=None) -> int:
    per_window = Bz * H * (3 * V * K + K * K + 4 * L * (V + K))
    cap = GROUP_ELEMENTS_CUDA if device is not None and torch.device(device).type == "cuda" \
        else GROUP_ELEMENTS
    return max(1, cap // per_window)


def exact_scan(S0: torch.Tensor, la, k, q, v, beta=None, *, chunk: int = 64):
    """Exact (unrounded) chunked scan from state ``S0 [B, H, V, K]``: outputs ``S_t q_t``
    ``[B, T, H, V]`` and the final state. Head-expanded inputs as :func:`_prep`; ``beta`` None
    for Mamba-2 (written value v), else GDN. The prefill of a prompt (DESIGN.md "Prefill")."""
    Bz, T, H = la.shape
    V, K = S0.shape[-2:]
    if Bz > 1 and not S0.is_cuda:  # every sequence alone (see "Invariance")
        parts = [exact_scan(S0[b: b + 1], la[b: b + 1], k[b: b + 1], q[b: b + 1], v[b: b + 1],
                            None if beta is None else beta[b: b + 1], chunk=chunk)
                 for b in range(Bz)]
        return torch.cat([o for o, _ in parts]), torch.cat([S for _, S in parts])
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


def _block(carry: WindowCarry, la, k, q, v, beta, *, policy: StatePolicy, L: int, seed: int,
           layer: int, ids):
    """Full windows on the kernel path (``carry.h == 0``, length a multiple of L): the anchor
    recurrence of a group of windows in one anchor-chain launch, then the read casts and the
    outputs of every window batched. Returns ``(o [B, T, H, V], carry)``."""
    Bz, T, H = la.shape
    V, K = carry.anchor.shape[-2:]
    A, R, fi = carry.anchor, carry.read, carry.flush_index
    if policy.single_checkpoint:  # one launch: the anchor chain and every output (R is A)
        n = T // L
        flush = fi[:, None] + torch.arange(n, device=fi.device)[None, :]
        res = kr.anchor_chain(A, la, k, v, beta, policy.rec, L=L, seed=seed,
                              streams=_stream_keys(layer, ids, H, flush, core.ANCHOR_COPY), q=q,
                              store_states=False, all_anchors=False)
        A = res.anchors[:, 0].contiguous()
        return res.outputs, WindowCarry(A, A, {}, fi + n)
    outs, t = [], 0
    while t < T:
        n = min((T - t) // L, _group_size(Bz, H, V, K, L, A.device))
        s = slice(t, t + n * L)
        p = _prep(la[:, s], k[:, s], q[:, s], v[:, s], None if beta is None else beta[:, s], L,
                  wy=False)
        flush = fi[:, None] + torch.arange(n, device=fi.device)[None, :]  # [B, n]
        res = kr.anchor_chain(A, la[:, s], k[:, s], v[:, s], None if beta is None else beta[:, s],
                              policy.rec, L=L, seed=seed,
                              streams=_stream_keys(layer, ids, H, flush, core.ANCHOR_COPY),
                              all_anchors=False)
        Sst, A = res.states, res.anchors[:, 0].contiguous()  # Sst: [B, n, H, V, K] unrounded
        if policy.read.is_identity:
            Rst = Sst
        else:  # R never feeds the anchor, so all read casts of the group at once
            kread = _stream_keys(layer, ids, H, flush, core.READ_COPY)
            Rst = core.cast_state(Sst, policy.read, seed=seed, stream=kread)[0]
        Rin = torch.cat([R[:, None], Rst[:, :-1]], 1)  # R_w, read by window w
        o = _outputs(p, Rin)  # [B, n, H, V, L]
        o[..., -1] = torch.matmul(Sst, p.Qm[..., -1, :, None])[..., 0]  # flush token: unrounded S
        outs.append(o.permute(0, 1, 4, 2, 3).reshape(Bz, n * L, H, V))
        R = Rst[:, -1].contiguous()
        fi = fi + n
        t += n * L
    return torch.cat(outs, 1), WindowCarry(A, R, {}, fi)


def _split(h: int, T: int, L: int) -> tuple[int, int]:
    """(tokens that complete the current partial window, tokens in full windows after it)."""
    head = min((L - h) % L, T)
    return head, (T - head) // L * L


def mamba2_emulate_fast(carry: WindowCarry, x, dt, A, B, C, D=None, *, policy, window: int,
                        seed: int = 0, layer: int = 0, sequence_ids=None):
    """:func:`mamba2_emulate` with the full windows batched on the kernel path (same arguments
    and results, up to float reassociation; same casts and SR bits): the partial window at
    each end runs through :func:`mamba2_window`, the full windows in between through the
    anchor-chain kernel. On the torch path it is :func:`mamba2_emulate` (see "Invariance")."""
    policy = StatePolicy.parse(policy)
    L = effective_window(policy, window)
    kw = dict(policy=policy, window=L, seed=seed, layer=layer, sequence_ids=sequence_ids)
    if _torch_path(policy, carry.anchor):
        return mamba2_emulate(carry, x, dt, A, B, C, D, **kw)
    T = x.shape[1]
    head, full = _split(carry.h, T, L)
    ys = []
    if head:
        y, carry = mamba2_window(carry, x[:, :head], dt[:, :head], A, B[:, :head], C[:, :head], D,
                                 **kw)
        ys.append(y)
    if full:
        s = slice(head, head + full)
        H = x.shape[2]
        la, v, k = mamba2_records(x[:, s], dt[:, s], A, B[:, s])
        ids = _seq_ids(sequence_ids, x.shape[0])
        y, carry = _block(carry, la, core.expand_heads(k, H, 2), core.expand_heads(C[:, s], H, 2), v,
                          None, policy=policy, L=L, seed=seed, layer=layer, ids=ids)
        if D is not None:
            y = y + D[:, None] * x[:, s]
        ys.append(y)
    if head + full < T:
        s = slice(head + full, T)
        y, carry = mamba2_window(carry, x[:, s], dt[:, s], A, B[:, s], C[:, s], D, **kw)
        ys.append(y)
    return (torch.cat(ys, 1) if ys else x.new_zeros(x.shape)), carry


def gdn_emulate_fast(carry: WindowCarry, q, k, v, g, beta, *, policy, window: int, seed: int = 0,
                     layer: int = 0, sequence_ids=None, fold_cached_corrections: bool = False):
    """GDN counterpart of :func:`mamba2_emulate_fast`. The cached-fold variant (anchor built
    from the read-path corrections, so every read cast is sequential) runs :func:`gdn_emulate`."""
    policy = StatePolicy.parse(policy)
    L = effective_window(policy, window)
    kw = dict(policy=policy, window=L, seed=seed, layer=layer, sequence_ids=sequence_ids)
    if fold_cached_corrections or _torch_path(policy, carry.anchor):
        return gdn_emulate(carry, q, k, v, g, beta,
                           fold_cached_corrections=fold_cached_corrections, **kw)
    T, HV = v.shape[1], v.shape[2]
    head, full = _split(carry.h, T, L)
    os_ = []
    if head:
        o, carry = gdn_window(carry, q[:, :head], k[:, :head], v[:, :head], g[:, :head],
                              beta[:, :head], **kw)
        os_.append(o)
    if full:
        s = slice(head, head + full)
        ids = _seq_ids(sequence_ids, v.shape[0])
        o, carry = _block(carry, g[:, s], core.expand_heads(k[:, s], HV, 2),
                          core.expand_heads(q[:, s], HV, 2), v[:, s], beta[:, s], policy=policy,
                          L=L, seed=seed, layer=layer, ids=ids)
        os_.append(o)
    if head + full < T:
        s = slice(head + full, T)
        o, carry = gdn_window(carry, q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], **kw)
        os_.append(o)
    return (torch.cat(os_, 1) if os_ else v.new_zeros(v.shape)), carry
