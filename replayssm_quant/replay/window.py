"""Teacher-forced window form of ReplaySSM, for emulation over long documents.

With all tokens known, standard ReplaySSM decoding (DESIGN.md section 3) can be computed a
window at a time: inside a window, the outputs are the intra-window causal sum plus the
decayed read-copy term (GDN: with corrections solved against the read path); at the window
end the *same* flush routine as the state objects (:func:`~.mamba2.mamba2_flush`,
:func:`~.gdn.gdn_flush`) folds the records into the anchor and casts A and R independently,
with the same SR streams. Stepping token by token through :class:`~.Mamba2ReplayState` /
:class:`~.GDNReplayState` and running these functions give the same checkpoints bit for bit
(identical flush inputs) and the same outputs up to float reassociation.

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
        flush_index: int64 ``[B]`` index of the next flush (SR streams).
    """

    anchor: torch.Tensor
    read: torch.Tensor
    records: dict = field(default_factory=dict)
    flush_index: torch.Tensor | None = None

    @property
    def h(self) -> int:
        """Committed records in the current window (same for every sequence)."""
        return next(iter(self.records.values())).shape[1] if self.records else 0


def _seq_ids(sequence_ids, batch, device):
    ids = torch.arange(batch) if sequence_ids is None else torch.as_tensor(sequence_ids)
    return ids.to(torch.int64).to(device)


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
    ids = _seq_ids(sequence_ids, B, S.device)
    fi = torch.full((B,), core.PREFILL_FLUSH_INDEX, dtype=torch.int64, device=S.device)
    cps = core.cast_checkpoints(S, policy, seed=seed, layer=layer, sequence_ids=ids, flush_index=fi)
    return WindowCarry(cps.anchor, cps.read, {}, fi + 1)


def _cat_records(carry: WindowCarry, new: dict) -> dict:
    if not carry.records:
        return {n: t.contiguous() for n, t in new.items()}
    return {n: torch.cat([carry.records[n], new[n]], 1) for n in new}


def _check_fit(h0: int, W: int, L: int) -> None:
    if W < 1:
        raise ValueError(f"a window call needs at least one token, got {W}")
    if h0 + W > L:
        raise ValueError(f"{W} tokens after {h0} buffered records exceed the window {L}; "
                         "split the run (see mamba2_emulate / gdn_emulate)")


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
        flushed state, after which A and R are recast by :func:`mamba2_flush`.
    """
    policy = StatePolicy.parse(policy)
    L = effective_window(policy, window)
    H = x.shape[2]
    h0, W = carry.h, x.shape[1]
    _check_fit(h0, W, L)
    la, v, k = mamba2_records(x, dt, A, B)
    recs = _cat_records(carry, {"la": la, "v": v, "k": k})
    J = h0 + W
    q = core.expand_heads(C, H, 2)
    Q = torch.cat([q.new_zeros(q.shape[0], h0, *q.shape[2:]), q], 1) if h0 else q
    ke = core.expand_heads(recs["k"], H, 2)
    y = core.window_outputs(carry.read, recs["la"], recs["v"], ke, Q)[:, h0:]
    if J == L:
        ids = _seq_ids(sequence_ids, x.shape[0], x.device)
        res = mamba2_flush(carry.anchor, recs["la"], recs["v"], recs["k"], policy, seed=seed,
                           layer=layer, sequence_ids=ids, flush_index=carry.flush_index,
                           length=torch.full_like(carry.flush_index, J))
        y[:, -1] = core.matvec(res.state, q[:, -1])
        carry = WindowCarry(res.checkpoints.anchor, res.checkpoints.read, {}, carry.flush_index + 1)
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
    R and the cached corrections (one W x W triangular solve); at the window end the
    corrections are re-solved against A inside :func:`gdn_flush` (or, with
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
    ke = core.expand_heads(recs["k"], HV, 2)
    start = torch.full((Bz,), h0, dtype=torch.int64, device=v.device)
    uR = core.solve_corrections(carry.read, recs["la"], recs["beta"], recs["v"], ke,
                                start=start, u_known=recs["uR"])
    recs["uR"] = uR
    qe = core.expand_heads(q, HV, 2)
    Q = torch.cat([qe.new_zeros(Bz, h0, *qe.shape[2:]), qe], 1) if h0 else qe
    o = core.window_outputs(carry.read, recs["la"], uR, ke, Q)[:, h0:]
    if J == L:
        ids = _seq_ids(sequence_ids, Bz, v.device)
        res = gdn_flush(carry.anchor, recs["la"], recs["beta"], recs["v"], recs["k"], policy,
                        seed=seed, layer=layer, sequence_ids=ids, flush_index=carry.flush_index,
                        length=torch.full_like(carry.flush_index, J), u_cached=uR,
                        fold_cached_corrections=fold_cached_corrections)
        o[:, -1] = core.matvec(res.state, qe[:, -1])
        carry = WindowCarry(res.checkpoints.anchor, res.checkpoints.read, {}, carry.flush_index + 1)
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
