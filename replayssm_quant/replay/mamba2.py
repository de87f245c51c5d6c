"""ReplaySSM state of one Mamba-2 layer (DESIGN.md section 3).

Layout (Hugging Face Mamba-2 / fla conventions): state ``[B, H, P, N]`` (head dim P x d_state
N, "value x key"; nvfp4 blocks run along N). Inputs are post-activation: ``x [B, H, P]``,
``dt [B, H]`` after softplus (+ dt_bias, no clamp on the decode path), ``A [H]`` negative
(``-exp(A_log)``), grouped ``B, C [B, G, N]`` (head h uses group ``h // (H // G)``), ``D [H]``.
A buffer record is ``(la = dt * A, v = dt * x, k = B)``; ``y = S C + D x``.
"""

from __future__ import annotations

import torch

from .. import backend as B
from ..checkpoints import Checkpoints
from . import core
from ._state import ReplayStateBase, _check_int, check_one_T, check_tensor


def mamba2_records(x, dt, A, B):
    """Records of tokens: ``(la = dt * A, v = dt * x, k = B)``; works for one token
    (``x [B, H, P]``) or a run (``x [B, J, H, P]``)."""
    return dt * A, dt[..., None] * x, B


def mamba2_flush(anchor, la, v, k, policy, *, seed: int, layer: int, sequence_ids, flush_index,
                 length=None, store: bool = False) -> core.FlushResult:
    """Flush of Mamba-2 records (the one flush routine; see :func:`core.flush`).

    Args:
        anchor: dequantised A ``[B, H, P, N]``.
        la: ``[B, J, H]``; v: ``[B, J, H, P]``; k: grouped ``[B, J, G, N]``.
        length: int64 ``[B]`` committed records per sequence (slots beyond are ignored), or
            None (all J).
    """
    la, v = core.mask_records(length, la, v)
    k = core.expand_heads(k, anchor.shape[1], 2)
    return core.flush(anchor, la, v, k, policy, seed=seed, layer=layer,
                      sequence_ids=sequence_ids, flush_index=flush_index, store=store)


def mamba2_step_output(read, la, v, k, q, length) -> torch.Tensor:
    """Output-only step reference for Mamba-2 (what a step kernel must match):
    ``y = gamma_{1:h} (R q) + V (m * (K^T q))`` for the token in slot ``h - 1``, never forming S
    (no ``D x``; a token that fills the window reads the flushed state instead, see ``step``).

    Args: ``read [B, H, P, N]``; records ``la [B, J, H]``, ``v [B, J, H, P]``, grouped
    ``k [B, J, G, N]`` with the new token appended; grouped ``q [B, G, N]``; ``length`` int64
    ``[B]`` = h including the new token (``J = max(h)``). Returns ``[B, H, P]``.
    """
    H = read.shape[1]
    la, v = core.mask_records(length, la, v)
    return core.step_output(read, la, v, core.expand_heads(k, H, 2), core.expand_heads(q, H, 1))


def mamba2_verify(read, anchor, la, v, k, q, start, window: int) -> torch.Tensor:
    """Verify reference for Mamba-2 (what a verify kernel must match): outputs ``S q`` of the
    ``T`` drafts at slots ``start..start+T-1`` (no ``D x``), from R plus the buffer in
    output-only form; a draft on slot ``window`` (the flush slot) reads the flushed state,
    i.e. the same form from A.

    Args: ``read, anchor [B, H, P, N]``; records ``la [B, J, H]``, ``v [B, J, H, P]``, grouped
    ``k [B, J, G, N]`` (committed records then drafts; ``J >= max(start) + T``);
    grouped ``q [B, T, G, N]``; ``start`` int64 ``[B]``. Returns ``[B, T, H, P]``.
    """
    H, T = read.shape[1], q.shape[1]
    la, v = core.mask_records(start + T, la, v)
    k = core.expand_heads(k, H, 2)
    q = core.expand_heads(q, H, 2)
    y = core.draft_outputs(read, la, v, k, q, start)
    at_flush = start + T == window
    if T > 0 and bool(at_flush.any()):
        yA = core.draft_outputs(anchor, la, v, k, q, start)
        y[at_flush, T - 1] = yA[at_flush, T - 1]
    return y


# ------------------------------------------------------------------ state-object operations
# What Mamba2ReplayState calls, with the signatures of their kernels in
# replayssm_quant.kernels.replay (the backend seam swaps one for the other, once, at
# construction). ``cps`` holds the dequantised checkpoints (read here) and their storage (read
# by the kernels); ``ring`` is the state's ring of records, ``h`` its committed counts.
@B.reference("mamba2_state_step")
def mamba2_state_step(cps: Checkpoints, ring: dict, h, la, v, k, q) -> torch.Tensor:
    """Decode step: write the record ``(la [B,H], v [B,H,P], k [B,G,N])`` into ring slot
    ``h[b]`` (``h`` is not advanced) and return the output-only read of R plus the records
    (:func:`mamba2_step_output`, grouped ``q [B,G,N]``) ``[B, H, P]``."""
    b = torch.arange(h.shape[0], device=h.device)
    for name, t in (("la", la), ("v", v), ("k", k)):
        ring[name][b, h] = t
    # the whole ring, masked to h + 1 per sequence (never the batch's largest count)
    return mamba2_step_output(cps.read, ring["la"], ring["v"], ring["k"], q, h + 1)


@B.reference("mamba2_state_verify")
def mamba2_state_verify(cps: Checkpoints, la, v, k, q, start, window: int) -> torch.Tensor:
    """:func:`mamba2_verify` reading the checkpoints ``cps``."""
    return mamba2_verify(cps.read, cps.anchor, la, v, k, q, start, window)


@B.reference("mamba2_state_flush")
def mamba2_state_flush(anchor, recs: dict, length, policy, *, seed: int, layer: int,
                       sequence_ids, flush_index) -> core.FlushResult:
    """:func:`mamba2_flush` of the ring records ``recs`` (``la, v, k``) up to ``length``,
    storing the new checkpoints."""
    return mamba2_flush(anchor, recs["la"], recs["v"], recs["k"], policy, seed=seed, layer=layer,
                        sequence_ids=sequence_ids, flush_index=flush_index, length=length,
                        store=True)


class Mamba2ReplayState(ReplayStateBase):
    """Dual-checkpoint ReplaySSM state of one Mamba-2 layer, batched over sequences and heads.

    Args:
        policy: a :class:`~replayssm_quant.policy.StatePolicy` or its string, e.g.
            ``"read:nvfp4/rec:fp16+sr"``. ``eager:F`` runs conventional decoding (window 1).
        batch, heads, head_dim (P), d_state (N), groups (G, divides heads).
        window: L >= 1, tokens between flushes.
        max_drafts: T, 0 <= T <= L, most drafts one ``verify`` may take.
        seed, layer: SR stream keys (with sequence_ids, head, flush index, copy).
        sequence_ids: int ``[B]`` stable ids for the SR streams (default ``arange(B)``); give
            each sequence its own id so results do not depend on batch composition. Equal
            ids are allowed and give equal SR draws (rows whose rounding errors are then not
            independent; docs/replay.md, "SR streams").
        dtype: working dtype, float32 or float64. Stored states have FP32 precision at most
            (formats round in FP32); ``fp32`` keeps the working dtype.
        device: where the state lives; every input must be there.
        backend: ``"auto"`` (Triton kernels of :mod:`replayssm_quant.kernels.replay` for step,
            verify and flush on CUDA, float32, d_state a power of two >= 32), ``"torch"``
            (the references here), ``"triton"`` or ``"cuda"`` (the Triton kernels: Mamba-2 has
            no CUDA C++ kernel; a CUDA device is required); None defers to
            ``REPLAYSSM_BACKEND`` (:mod:`replayssm_quant.backend`).

    The state starts as zeros (cast as flush 0). See ``step``, ``verify``, ``commit``,
    ``flush``, ``prefill`` and the properties of
    :class:`~replayssm_quant.replay._state.ReplayStateBase`.

    Raises:
        ValueError: a bad policy, size, window, ``max_drafts``, seed, layer, sequence ids,
            dtype or backend (naming the value); a device this machine lacks or torch's
            ``"meta"`` device; a record ring (``batch x (window + max_drafts)`` slots) that
            cannot be allocated (naming the window and its size in GiB).
    """

    def __init__(self, policy, *, batch: int, heads: int, head_dim: int, d_state: int,
                 groups: int = 1, window: int = 16, max_drafts: int = 0, seed: int = 0,
                 layer: int = 0, sequence_ids=None, dtype=torch.float32, device="cpu",
                 backend: str | None = None):
        heads, head_dim, d_state, groups = (
            _check_int(name, val, 1) for name, val in (
                ("heads", heads), ("head_dim", head_dim), ("d_state", d_state),
                ("groups", groups)))
        self._kernels = B.use_kernels(B.OpFamily.REPLAY, backend, device=device, dtype=dtype,
                                      key_dim=d_state)
        self._ops = B.ops(self._kernels, step=mamba2_state_step, verify=mamba2_state_verify,
                          flush=mamba2_state_flush)  # torch references or their kernels
        if heads % groups:
            raise ValueError(f"groups={groups} must divide heads={heads}")
        self.groups = groups
        self._RING = {"la": (heads,), "v": (heads, head_dim), "k": (groups, d_state)}
        super().__init__(policy, batch=batch, heads=heads, value_dim=head_dim, key_dim=d_state,
                         window=window, max_drafts=max_drafts, seed=seed, layer=layer,
                         sequence_ids=sequence_ids, dtype=dtype, device=device)

    # ------------------------------------------------------------------ validation
    def _check_inputs(self, x, dt, A, B, C, D, T=None):
        Bz, H, P, N, G = self.batch, self.heads, self.value_dim, self.key_dim, self.groups
        lead = (Bz,) if T is None else (Bz, T)
        args = (self.dtype, self.device)
        check_tensor("x", x, lead + (H, P), *args)
        check_tensor("dt", dt, lead + (H,), *args)
        check_tensor("A", A, (H,), *args)
        check_tensor("B", B, lead + (G, N), *args)
        check_tensor("C", C, lead + (G, N), *args)
        if D is not None:
            check_tensor("D", D, (H,), *args)

    def _flush_records(self, anchor, recs, length, sequence_ids, flush_index):
        return self._ops.flush(anchor, recs, length, self.policy, seed=self.seed,
                               layer=self.layer, sequence_ids=sequence_ids,
                               flush_index=flush_index)

    # ------------------------------------------------------------------ decoding
    def step(self, x, dt, A, B, C, D=None) -> torch.Tensor:
        """Decode one token per sequence; returns ``y [B, H, P]`` (including ``D x``).

        Appends the record; a sequence reaching h = L flushes and reads its output from the
        unrounded flushed state, the others read R plus the buffer in output-only form.

        Inputs (the state's dtype and device): ``x [B, H, P]``, ``dt [B, H]`` (the step
        size: the records are ``la = dt A``, ``v = dt x``, ``k = B``), ``A [H]``,
        ``B, C [B, G, N]``, ``D [H]`` or None.

        Raises:
            ValueError: drafts pending (call :meth:`commit` first); an input that is not a
                tensor of the documented shape, of the state's dtype (float32 or float64, the
                working precision it was built with) or on its device (the message names the
                argument, its shape and the expected one).
        """
        self._check_not_pending("step")
        self._check_inputs(x, dt, A, B, C, D)
        la, v, k = mamba2_records(x, dt, A, B)
        q = core.expand_heads(C, self.heads, 1)
        y = self._ops.step(self._checkpoints(), self._ring, self._h, la, v, k, C)  # + append
        self._h += 1
        flushed = self._flush_seqs(self._h == self.window)
        if flushed is not None:
            idx, res = flushed
            if idx is None:
                y = core.matvec(res.state, q)
            else:
                y[idx] = core.matvec(res.state, q[idx])
        if D is not None:
            y = y + D[:, None] * x
        return y

    def verify(self, x, dt, A, B, C, D=None) -> torch.Tensor:
        """Outputs of T drafts per sequence (``x [B, T, H, P]``, ``dt [B, T, H]``,
        ``B, C [B, T, G, N]``) in output-only form, without materialising any state.

        Sequences with h + T > L flush their committed part first. Drafts are written after
        the h committed records; a draft landing on slot L reads the flushed state's value
        (from A), as stepwise decoding would. Call :meth:`commit` next.
        Returns ``y [B, T, H, P]``.

        Raises:
            ValueError: drafts pending (call :meth:`commit` first); T above the
                ``max_drafts`` the state was built with; an input that is not a tensor of the
                documented shape (one T for all), of the state's dtype (float32 or float64,
                the working precision it was built with) or on its device (the message names
                the argument, its shape and the expected one).
        """
        self._check_not_pending("verify")
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"verify() x must be [B, T, H, P], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
        check_one_T(x=(x, 4), dt=(dt, 3), B=(B, 4), C=(C, 4))
        T = x.shape[1]
        self._check_drafts(T)
        self._check_inputs(x, dt, A, B, C, D, T=T)
        self._begin_verify(T)
        la, v, k = mamba2_records(x, dt, A, B)
        self._write_drafts({"la": la, "v": v, "k": k}, T)
        self._pending = T
        J = self.window  # committed + drafts <= window after the early flush; a fixed shape
        r = self._ring
        y = self._ops.verify(self._checkpoints(), r["la"][:, :J], r["v"][:, :J], r["k"][:, :J],
                             C, self._h, self.window)
        if D is not None:
            y = y + D[:, None] * x
        return y
