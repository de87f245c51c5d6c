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
document: the dequantised checkpoints, the records of the current partial window, the next
flush index and the keys of the SR streams (layer, sequence ids). Window boundaries are
counted from the last flush (prefill = flush 0), so a segment may end mid-window and the next
segment continues it. Settings come in as one parsed :class:`~replayssm_quant.config.StateConfig`.

Typical use for one layer (Mamba-2)::

    config = StateConfig.build("read:nvfp4/rec:fp16+sr", window=16, seed=0)
    carry = initial_carry(S_prompt, config, layer=layer_id, sequence_ids=ids)
    for segment in segments:                      # x [B, T, H, P], dt [B, T, H], ...
        y, carry = mamba2_emulate(carry, x, dt, A, B, C, D, config=config)

``eager:F`` runs with window 1 (conventional decoding; ``StateConfig.build`` sets it), exactly
like the state objects. The batched form of full windows on the kernel path is
:mod:`.window_fast`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import backend as B
from ..backend import kernel_ops as kr  # kernel entry points, through the backend seam
from ..capabilities import allocation, check_allocation
from ..config import Family, GDNFold, StateConfig
from ..policy import HeadPolicy
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
        sequence_ids: int64 ``[B]`` SR sequence ids, on the host.
        layer: the layer index (SR streams).

    The SR stream keys of a flush come from ``(layer, sequence_ids, head, flush_index, copy)``
    (:func:`core.checkpoint_streams`), all of which the carry holds.
    """

    anchor: torch.Tensor
    read: torch.Tensor
    records: dict = field(default_factory=dict)
    flush_index: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None
    layer: int = 0

    def select(self, rows: torch.Tensor) -> "WindowCarry":
        """The carry of batch rows ``rows`` (int64 ``[B']``, any order, repeats allowed): what a
        cache reorder for beam search, or a batch selection, does to every row's state."""
        dev = rows.to(self.anchor.device)
        host = rows.cpu()
        a = self.anchor.index_select(0, dev)
        r = a if self.read is self.anchor else self.read.index_select(0, dev)
        recs = {n: t.index_select(0, dev) for n, t in self.records.items()}
        return WindowCarry(a, r, recs, self.flush_index.index_select(0, host),
                           self.sequence_ids.index_select(0, host), self.layer)

    def buffered(self, records: dict) -> "WindowCarry":
        """The carry after a call that did not complete the window: same checkpoints, the
        records since the last flush."""
        return WindowCarry(self.anchor, self.read, records, self.flush_index, self.sequence_ids,
                           self.layer)

    def flushed(self, anchor, read) -> "WindowCarry":
        """The carry after a flush: new checkpoints, empty buffer, next flush index."""
        return WindowCarry(anchor, read, {}, self.flush_index + 1, self.sequence_ids, self.layer)

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


def initial_carry(S: torch.Tensor, config: StateConfig, *, layer: int = 0,
                  sequence_ids=None) -> WindowCarry:
    """Carry after a prefill with exact state ``S [B, H, V, K]`` (zeros for an empty prompt):
    A and R cast independently from S as flush 0, empty buffer (as ``prefill`` does).

    Args:
        config: the parsed :class:`~replayssm_quant.config.StateConfig`.
        layer: layer index; sequence_ids: ``[B]`` ints (default: the batch rows) keying the SR
            streams of this layer's flushes.
    """
    B = S.shape[0]
    ids = _seq_ids(sequence_ids, B)
    fi = torch.full((B,), core.PREFILL_FLUSH_INDEX, dtype=torch.int64)  # host bookkeeping
    cps = core.cast_checkpoints(S, config.policy, seed=config.seed, layer=layer, sequence_ids=ids,
                                flush_index=fi)
    return WindowCarry(cps.anchor, cps.read, {}, fi + 1, ids, int(layer))


# ------------------------------------------------------------------------------ flush dispatch
CHAIN_ENV = "REPLAYSSM_ANCHOR_CHAIN"  # deprecated: the seam's REPLAYSSM_BACKEND (backend.py)


def chain_kernel_enabled(anchor: torch.Tensor, fold: GDNFold = GDNFold.RECOMPUTE,
                         policy=None) -> bool:
    """True when flushes run the anchor-chain kernel
    (:func:`replayssm_quant.kernels.replay.anchor_chain`, any ``rec`` format; fp32 is the exact
    recurrence): not the cached-fold variant, float32, key dim a power of two >= 32, on CUDA
    (``auto``) or forced with ``REPLAYSSM_BACKEND=triton`` (CPU: under
    ``TRITON_INTERPRET=1``); the decision is the backend seam's (:mod:`replayssm_quant.backend`,
    family ``chain``). Every flush of a layer (stepping and teacher-forced, batched or
    window by window) takes the same decision, so a layer given identical inputs rounds
    identically. A per-head policy (``policy`` a
    :class:`~replayssm_quant.policy.HeadPolicy`, one layer of a policy map) runs the torch path:
    the kernel casts one format per launch."""
    if fold is GDNFold.CACHED or isinstance(policy, HeadPolicy):
        return False
    return B.use_kernels(B.OpFamily.CHAIN, None, device=anchor.device, dtype=anchor.dtype,
                         key_dim=anchor.shape[-1])


def flush_window(family: Family, carry: WindowCarry, recs: dict, config: StateConfig,
                 u_cached=None):
    """The flush of one full window of records (every sequence at h == L), dispatched:
    the anchor-chain kernel with one window where :func:`chain_kernel_enabled`, else
    :func:`mamba2_flush` / :func:`gdn_flush`, from ``carry.anchor`` with the carry's stream
    keys. ``recs``: ``la, v, k`` (grouped k) and GDN ``beta``; ``u_cached``: the read-path
    corrections (folded by :attr:`GDNFold.CACHED`). Returns ``(S, A, R)``: unrounded state and
    dequantised checkpoints."""
    policy, seed, anchor = config.policy, config.seed, carry.anchor
    J = recs["la"].shape[1]
    if chain_kernel_enabled(anchor, config.fold, policy):
        H = anchor.shape[1]
        sa, sr = core.checkpoint_streams(layer=carry.layer, sequence_ids=carry.sequence_ids,
                                         heads=H, flush_index=carry.flush_index)
        res = kr.anchor_chain(anchor, recs["la"], core.expand_heads(recs["k"], H, 2), recs["v"],
                              recs["beta"] if family is Family.GDN else None, policy.rec, L=J,
                              seed=seed, streams=sa[:, None])
        S, A = res.states[:, 0], res.anchors[:, 0]
        if policy.single_checkpoint:
            return S, A, A
        return S, A, core.cast_state(S, policy.read, seed=seed, stream=sr)[0]
    length = torch.full((anchor.shape[0],), J, dtype=torch.int64, device=anchor.device)
    kw = dict(seed=seed, layer=carry.layer, sequence_ids=carry.sequence_ids,
              flush_index=carry.flush_index, length=length)
    if family is Family.MAMBA2:
        res = mamba2_flush(anchor, recs["la"], recs["v"], recs["k"], policy, **kw)
    else:
        res = gdn_flush(anchor, recs["la"], recs["beta"], recs["v"], recs["k"], policy,
                        u_cached=u_cached, fold=config.fold, **kw)
    return res.state, res.checkpoints.anchor, res.checkpoints.read


def _cat_records(carry: WindowCarry, new: dict) -> dict:
    if not carry.records:
        return {n: t.contiguous() for n, t in new.items()}
    return {n: torch.cat([carry.records[n], new[n]], 1) for n in new}


def _padded(t: torch.Tensor, L: int, at: int = 0) -> torch.Tensor:
    """A fresh zero tensor of ``L`` slots along dim 1 with ``t`` written at slots
    ``at .. at + t.shape[1] - 1``: a window's records (or queries) at the window's full length,
    so every window runs the same arithmetic on tensors of the same shape (see "Invariance")."""
    with allocation(t.shape[0] * L * math.prod(t.shape[2:]) * t.element_size(), t.device,
                    lambda: f"window L={L}: a window's records padded to L slots "
                            f"({tuple(t.shape)} -> L)"):
        out = t.new_zeros(t.shape[0], L, *t.shape[2:])
    out[:, at: at + t.shape[1]] = t
    return out


def _check_window_matrices(B: int, H: int, L: int, dtype: torch.dtype,
                           device: torch.device) -> None:
    """Refuse a window whose L x L decay and solve matrices (``core.window_outputs``,
    ``core.solve_corrections``: about four ``[B, L, L, H]`` tensors of ``dtype`` live at
    once) exceed ``device``'s memory, naming L, before any is built."""
    check_allocation(4 * B * H * L * L * (torch.finfo(dtype).bits // 8), device,
                     lambda: f"window L={L}: the window form's L x L decay and solve matrices "
                             f"({B} sequence(s) x {H} heads)")


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


def torch_path(anchor: torch.Tensor, fold: GDNFold = GDNFold.RECOMPUTE, policy=None) -> bool:
    """True where the window form runs in torch, window by window (see "Invariance")."""
    return not chain_kernel_enabled(anchor, fold, policy)


# ------------------------------------------------------------------------------ Mamba-2
def mamba2_window(carry: WindowCarry, x, dt, A, B, C, D=None, *, config: StateConfig):
    """Teacher-forced outputs of ``W`` tokens that fit in the current window
    (``carry.h + W <= L``), then, if the window is full, the flush.

    Args:
        carry: from :func:`initial_carry` or a previous call.
        x ``[B, W, H, P]``, dt ``[B, W, H]`` (after softplus), A ``[H]`` (negative),
        B, C ``[B, W, G, N]``, D ``[H]`` or None: post-activation inputs as for
        :meth:`Mamba2ReplayState.step`.
        config: the parsed :class:`~replayssm_quant.config.StateConfig` (L = ``config.window``).

    Returns:
        ``(y [B, W, H, P], carry)``: tokens before the window end read R plus the buffer
        (:func:`core.window_outputs`); the token that fills the window reads the unrounded
        flushed state, after which A and R are recast by :func:`flush_window`. Each sequence's
        results are independent of the batch and of how the window is split into calls
        (see "Invariance").
    """
    L = config.window
    H = x.shape[2]
    h0, W = carry.h, x.shape[1]
    _check_fit(h0, W, L)
    _check_window_matrices(x.shape[0], H, L, x.dtype, x.device)
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
        S, An, Rn = flush_window(Family.MAMBA2, carry, recs, config)
        last = core.matvec(S, Q[:, -1])  # the flush token reads the unrounded S
        if y is None:
            y = last[:, None]
        else:
            y[:, -1] = last
        carry = carry.flushed(An, Rn)
    else:
        carry = carry.buffered(recs)
    if D is not None:
        y = y + D[:, None] * x
    return y, carry


def mamba2_emulate(carry: WindowCarry, x, dt, A, B, C, D=None, *, config: StateConfig):
    """Run ``T`` tokens (any length; a segment of a document) window by window with
    :func:`mamba2_window`; returns ``(y [B, T, H, P], carry)``."""
    L = config.window
    ys, t, T = [], 0, x.shape[1]
    while t < T:
        n = min(L - carry.h, T - t)
        s = slice(t, t + n)
        y, carry = mamba2_window(carry, x[:, s], dt[:, s], A, B[:, s], C[:, s], D, config=config)
        ys.append(y)
        t += n
    return (torch.cat(ys, 1) if ys else x.new_zeros(x.shape)), carry


# ------------------------------------------------------------------------------ GDN
def gdn_window(carry: WindowCarry, q, k, v, g, beta, *, config: StateConfig):
    """GDN counterpart of :func:`mamba2_window`.

    Inputs ``q, k [B, W, HK, DK]``, ``v [B, W, HV, DV]``, ``g, beta [B, W, HV]`` as for
    :meth:`GDNReplayState.step`. Read-path corrections of the new tokens are solved against
    R (one triangular solve of the window padded to L, :func:`core.solve_corrections`); at
    the window end the corrections are re-solved against A inside :func:`gdn_flush` (or, with
    ``config.fold`` :attr:`~GDNFold.CACHED`, the cached ones are folded).
    Returns ``(o [B, W, HV, DV], carry)``.
    """
    L = config.window
    W, HV = v.shape[1], v.shape[2]
    h0 = carry.h
    _check_fit(h0, W, L)
    _check_window_matrices(v.shape[0], HV, L, v.dtype, v.device)
    new = {"la": g, "beta": beta, "v": v, "k": k, "uR": torch.zeros_like(v)}
    recs = _cat_records(carry, new)
    J = h0 + W
    Q = _padded(core.expand_heads(q, HV, 2), L, at=h0)
    o = None
    if J < L or W > 1 or config.fold_cached:  # some token reads R (else: only the flush)
        P = {n: _padded(recs[n], L) for n in ("la", "beta", "v", "k")}  # uR: re-solved below
        ke = core.expand_heads(P["k"], HV, 2)
        # all rows of the padded window in one solve: the rows of earlier calls come out with
        # the same bits as when they were cached, and the new rows see exactly those
        uR = core.solve_corrections(carry.read, P["la"], P["beta"], P["v"], ke, stop=J)
        recs["uR"] = uR[:, :J]
        o = core.window_outputs(carry.read, P["la"], uR, ke, Q)[:, h0:J]
    if J == L:
        S, An, Rn = flush_window(Family.GDN, carry, recs, config, u_cached=recs["uR"])
        last = core.matvec(S, Q[:, -1])  # the flush token reads the unrounded S
        if o is None:
            o = last[:, None]
        else:
            o[:, -1] = last
        carry = carry.flushed(An, Rn)
    else:
        carry = carry.buffered(recs)
    return o, carry


def gdn_emulate(carry: WindowCarry, q, k, v, g, beta, *, config: StateConfig):
    """Run ``T`` GDN tokens window by window with :func:`gdn_window`;
    returns ``(o [B, T, HV, DV], carry)``."""
    L = config.window
    os_, t, T = [], 0, v.shape[1]
    while t < T:
        n = min(L - carry.h, T - t)
        s = slice(t, t + n)
        o, carry = gdn_window(carry, q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], config=config)
        os_.append(o)
        t += n
    return (torch.cat(os_, 1) if os_ else v.new_zeros(v.shape)), carry
