"""ReplaySSM state of one Gated DeltaNet layer (DESIGN.md section 3).

Layout (fla conventions for inputs; DESIGN.md's "value x key" for the state): state
``[B, HV, DV, DK]`` so that ``o = S q`` and nvfp4 blocks run along d_k (fla keeps
``[B, H, K, V]``: transpose at that boundary). Inputs are post-activation:
``q, k [B, HK, DK]`` (L2-normalised; q also scaled by DK^-1/2), ``v [B, HV, DV]``,
``g [B, HV]`` log decay (alpha = exp(g)), ``beta [B, HV]``; value head h uses key head
``h // (HV // HK)`` (fla's ``repeat_interleave``). A buffer record is ``(g, beta, v, k)`` plus
the cached read-path correction ``uR`` used for outputs.

Corrections. Non-flush outputs use corrections computed against the read path
(R plus earlier read-path corrections). At a flush the corrections are recomputed against the
anchor by a unit lower-triangular solve (:func:`core.solve_corrections`), so read-path
rounding never reaches A. :attr:`~replayssm_quant.config.GDNFold.CACHED` (the state's
``fold_cached_corrections=True``) instead folds the cached read-path corrections into A (no
solve); it lets read rounding into the recurrence and is offered only to study that
instability. Under a single-checkpoint policy (``fp32``, ``shared:F``, ``eager:F``) R is A,
so the cached corrections already solve the anchor system, and the decode state on the Triton
kernels folds them (:meth:`~replayssm_quant.config.GDNFold.folds_cached`); on the torch path
it re-solves, as the window form does. The references below take the fold they are given.
"""

from __future__ import annotations

import torch

from .. import backend as B
from ..checkpoints import Checkpoints
from ..config import GDNFold
from . import core
from ._state import ReplayStateBase, _check_int, check_one_T, check_tensor


def gdn_flush(anchor, la, beta, v, k, policy, *, seed: int, layer: int, sequence_ids,
              flush_index, length=None, u_cached=None, fold: GDNFold = GDNFold.RECOMPUTE,
              store: bool = False) -> core.FlushResult:
    """Flush of GDN records (the one flush routine; see :func:`core.flush`).

    Args:
        anchor: dequantised A ``[B, HV, DV, DK]``.
        la, beta: ``[B, J, HV]``; v: ``[B, J, HV, DV]``; k: grouped ``[B, J, HK, DK]``.
        length: int64 ``[B]`` committed records per sequence, or None (all J).
        policy: a parsed :class:`~replayssm_quant.policy.StatePolicy`.
        u_cached: ``[B, J, HV, DV]`` read-path corrections; folded with
            ``fold=GDNFold.CACHED`` (default :attr:`GDNFold.RECOMPUTE`: re-solved against A).

    Returns a :class:`core.FlushResult` whose ``w`` holds the corrections that were folded.
    """
    k = core.expand_heads(k, anchor.shape[1], 2)
    if GDNFold.parse(fold) is GDNFold.CACHED:
        if u_cached is None:
            raise ValueError("fold=GDNFold.CACHED needs u_cached")
        la, w = core.mask_records(length, la, u_cached)
    else:
        la, beta, v = core.mask_records(length, la, beta, v)
        w = core.solve_corrections(anchor, la, beta, v, k)
    return core.flush(anchor, la, w, k, policy, seed=seed, layer=layer,
                      sequence_ids=sequence_ids, flush_index=flush_index, store=store)


def gdn_step_output(read, la, beta, v, k, q, u_known, length):
    """Output-only step reference for GDN (what a step kernel must match): solve the new
    token's read-path correction (row ``h - 1``; earlier rows are the cached ones)
    ``u_h = beta_h (v_h - gamma_{1:h} R k_h - sum_{i<h} gamma_{i+1:h} (k_i . k_h) u_i)``, then
    ``o = gamma_{1:h} (R q) + U (m * (K^T q))``, never forming S (a token that fills the window
    reads the flushed state instead, see ``step``).

    Args: ``read [B, HV, DV, DK]``; records ``la, beta [B, J, HV]``, ``v [B, J, HV, DV]``,
    grouped ``k [B, J, HK, DK]`` with the new token appended; grouped ``q [B, HK, DK]``;
    ``u_known [B, J, HV, DV]`` cached corrections; ``length`` int64 ``[B]`` = h including the
    new token. Returns ``(o [B, HV, DV], uR [B, J, HV, DV])``.
    """
    HV = read.shape[1]
    la, beta, v = core.mask_records(length, la, beta, v)
    k = core.expand_heads(k, HV, 2)
    uR = core.solve_corrections(read, la, beta, v, k, start=length - 1, u_known=u_known)
    return core.step_output(read, la, uR, k, core.expand_heads(q, HV, 1)), uR


def gdn_verify(read, anchor, la, beta, v, k, q, u_known, start, window: int,
               fold: GDNFold = GDNFold.RECOMPUTE):
    """Verify reference for GDN (what a verify kernel must match): one T x T triangular solve
    for the drafts' read-path corrections (rows before ``start`` are the cached committed
    ones), then the drafts' outputs from R plus the buffer in output-only form; a draft on
    slot ``window`` reads the flushed state (corrections re-solved against A, or the cached
    ones with ``fold=GDNFold.CACHED``).

    Args: ``read, anchor [B, HV, DV, DK]``; records ``la, beta [B, J, HV]``,
    ``v [B, J, HV, DV]``, grouped ``k [B, J, HK, DK]``; grouped ``q [B, T, HK, DK]``;
    ``u_known [B, J, HV, DV]`` cached read-path corrections; ``start`` int64 ``[B]``.
    Returns ``(o [B, T, HV, DV], uR [B, J, HV, DV])`` (uR: the read-path corrections of all
    rows, for the buffer).
    """
    HV, T = read.shape[1], q.shape[1]
    la, beta, v = core.mask_records(start + T, la, beta, v)
    k = core.expand_heads(k, HV, 2)
    q = core.expand_heads(q, HV, 2)
    uR = core.solve_corrections(read, la, beta, v, k, start=start, u_known=u_known)
    o = core.draft_outputs(read, la, uR, k, q, start)
    at_flush = start + T == window
    if T > 0 and bool(at_flush.any()):
        uA = uR if GDNFold.parse(fold) is GDNFold.CACHED else \
            core.solve_corrections(anchor, la, beta, v, k)
        oA = core.draft_outputs(anchor, la, uA, k, q, start)
        o[at_flush, T - 1] = oA[at_flush, T - 1]
    return o, uR


# ------------------------------------------------------------------ state-object operations
# What GDNReplayState calls, with the signatures of their kernels in
# replayssm_quant.kernels.replay (the backend seam swaps one for the other, once, at
# construction); see replay/mamba2.py for ``cps``, ``ring`` and ``h``.
@B.reference("gdn_state_step")
def gdn_state_step(cps: Checkpoints, ring: dict, h, q, k, v, g, beta) -> torch.Tensor:
    """Decode step: write the record ``(g, beta [B,HV], v [B,HV,DV], k [B,HK,DK])`` into ring
    slot ``h[b]`` (``h`` is not advanced), solve and cache its read-path correction in
    ``ring["uR"]`` and return the output-only read ``o [B, HV, DV]`` (:func:`gdn_step_output`)."""
    b = torch.arange(h.shape[0], device=h.device)
    for name, t in (("la", g), ("beta", beta), ("v", v), ("k", k)):
        ring[name][b, h] = t
    # the whole ring, masked to h + 1 per sequence (never the batch's largest count: a shape
    # that followed the batchmates would change this sequence's sums)
    o, uR = gdn_step_output(cps.read, ring["la"], ring["beta"], ring["v"], ring["k"], q,
                            ring["uR"], h + 1)
    ring["uR"].copy_(uR)
    return o


@B.reference("gdn_state_verify")
def gdn_state_verify(cps: Checkpoints, la, beta, v, k, q, u_known, start, window: int,
                     fold_cached_corrections: bool = False):
    """:func:`gdn_verify` reading the checkpoints ``cps`` (the kernel boundary takes the fold
    mode as the kernel's flag)."""
    return gdn_verify(cps.read, cps.anchor, la, beta, v, k, q, u_known, start, window,
                      _fold(fold_cached_corrections))


@B.reference("gdn_state_flush")
def gdn_state_flush(anchor, recs: dict, length, policy, *, seed: int, layer: int, sequence_ids,
                    flush_index, fold_cached_corrections: bool = False) -> core.FlushResult:
    """:func:`gdn_flush` of the ring records ``recs`` (``la, beta, v, k, uR``) up to
    ``length``, storing the new checkpoints."""
    return gdn_flush(anchor, recs["la"], recs["beta"], recs["v"], recs["k"], policy, seed=seed,
                     layer=layer, sequence_ids=sequence_ids, flush_index=flush_index,
                     length=length, u_cached=recs["uR"], fold=_fold(fold_cached_corrections),
                     store=True)


def _fold(cached: bool) -> GDNFold:
    """The kernel flag ``fold_cached_corrections`` as the :class:`GDNFold` of the references."""
    return GDNFold.CACHED if cached else GDNFold.RECOMPUTE


class GDNReplayState(ReplayStateBase):
    """Dual-checkpoint ReplaySSM state of one Gated DeltaNet layer.

    Args:
        policy, window, max_drafts, seed, layer, sequence_ids, dtype, device: as
            :class:`~replayssm_quant.replay.mamba2.Mamba2ReplayState`.
        batch, key_heads (HK), value_heads (HV, a multiple of HK), key_dim (DK), value_dim (DV).
        fold_cached_corrections: fold the cached read-path corrections at a flush instead of
            re-solving them against the anchor (not the default; see the module docstring).
            Under a single-checkpoint policy the state on the kernels folds them either way:
            R is A, so they are the anchor system's solution (:meth:`GDNFold.folds_cached`;
            the torch path re-solves, bit-identical to the window form).
        backend: ``"auto"`` (Triton kernels of :mod:`replayssm_quant.kernels.replay` for step,
            verify and flush on CUDA, float32, key_dim a power of two >= 32), ``"torch"``,
            ``"triton"`` or ``"cuda"`` (opt-in: as ``"triton"``, with verify on one CUDA C++
            kernel where it applies: a single-checkpoint FP32 policy, key and value dims 128,
            T <= 8, window <= 16; and the step on another: an FP32 or NVFP4 read copy, key
            and value dims 128, window + max_drafts <= 32; built with nvcc at the first call
            either covers, once per machine);
            None defers to ``REPLAYSSM_BACKEND`` (:mod:`replayssm_quant.backend`).

    Raises:
        ValueError: as :class:`~replayssm_quant.replay.mamba2.Mamba2ReplayState`, and
            ``key_heads`` not dividing ``value_heads``.
    """

    def __init__(self, policy, *, batch: int, key_heads: int, value_heads: int, key_dim: int,
                 value_dim: int, window: int = 16, max_drafts: int = 0, seed: int = 0,
                 layer: int = 0, sequence_ids=None, dtype=torch.float32, device="cpu",
                 fold_cached_corrections: bool = False, backend: str | None = None):
        key_heads, value_heads, key_dim, value_dim = (
            _check_int(name, val, 1) for name, val in (
                ("key_heads", key_heads), ("value_heads", value_heads), ("key_dim", key_dim),
                ("value_dim", value_dim)))
        impl = B.implementation(B.OpFamily.REPLAY, backend, device=device, dtype=dtype,
                                key_dim=key_dim)
        self._kernels = impl is not B.Backend.TORCH
        # torch references or their kernels (under "cuda", verify's CUDA C++ kernel)
        self._ops = B.ops(impl, step=gdn_state_step, verify=gdn_state_verify,
                          flush=gdn_state_flush)
        if value_heads % key_heads:
            raise ValueError(f"key_heads={key_heads} must divide value_heads={value_heads}")
        self.key_heads = key_heads
        if not isinstance(fold_cached_corrections, bool):  # bool("false") would be True
            raise ValueError(f"fold_cached_corrections must be True or False, got "
                             f"{fold_cached_corrections!r}")
        self.fold_cached_corrections = fold_cached_corrections
        fold = _fold(self.fold_cached_corrections)
        self._RING = {"la": (value_heads,), "beta": (value_heads,), "v": (value_heads, value_dim),
                      "k": (key_heads, key_dim), "uR": (value_heads, value_dim)}
        super().__init__(policy, batch=batch, heads=value_heads, value_dim=value_dim,
                         key_dim=key_dim, window=window, max_drafts=max_drafts, seed=seed,
                         layer=layer, sequence_ids=sequence_ids, dtype=dtype, device=device,
                         fold=fold)
        # what the flush and verify ops fold: on the kernels the cached corrections also under
        # RECOMPUTE when the read copy is the anchor (they were solved against it;
        # GDNFold.folds_cached); the torch path re-solves as the window form does
        self._fold_cached = fold.folds_cached(self.policy, kernels=self._kernels)
        self._flush_prepared = False

    # ------------------------------------------------------------------ validation
    def _check_inputs(self, q, k, v, g, beta, T=None):
        Bz, HK, HV, DK, DV = self.batch, self.key_heads, self.heads, self.key_dim, self.value_dim
        lead = (Bz,) if T is None else (Bz, T)
        args = (self.dtype, self.device)
        check_tensor("q", q, lead + (HK, DK), *args)
        check_tensor("k", k, lead + (HK, DK), *args)
        check_tensor("v", v, lead + (HV, DV), *args)
        check_tensor("g", g, lead + (HV,), *args)
        check_tensor("beta", beta, lead + (HV,), *args)

    def _prepare_flush(self) -> None:
        """Build the flush's kernel (``backend="cuda"``: :func:`.cuda_flush.gdn_state_flush_cuda`
        ``.prepare``, where it covers this state) at the first step or verify, before anything
        is written: a step that fills the window flushes after its record is appended, and a
        commit after its position moves, so a build failing there would leave the state
        half-updated. Once per state."""
        if self._flush_prepared:
            return
        prepare = getattr(self._ops.flush, "prepare", None)
        if prepare is not None:
            prepare(self.policy, key_dim=self.key_dim, value_dim=self.value_dim,
                    window=self.window, fold_cached_corrections=self._fold_cached)
        self._flush_prepared = True

    def _flush_records(self, anchor, recs, length, sequence_ids, flush_index):
        return self._ops.flush(anchor, recs, length, self.policy, seed=self.seed,
                               layer=self.layer, sequence_ids=sequence_ids,
                               flush_index=flush_index,
                               fold_cached_corrections=self._fold_cached)

    # ------------------------------------------------------------------ decoding
    def step(self, q, k, v, g, beta) -> torch.Tensor:
        """Decode one token per sequence; returns ``o [B, HV, DV]``.

        The token's read-path correction is solved against R plus the cached corrections and
        cached; a sequence reaching h = L flushes (corrections re-solved against A, or, on the
        kernels, the cached ones where R is A: :meth:`GDNFold.folds_cached`) and reads its
        output from the unrounded flushed state.

        Inputs (the state's dtype and device): ``q, k [B, HK, DK]``, ``v [B, HV, DV]``,
        ``g`` (log decay) and ``beta [B, HV]``.

        Raises:
            ValueError: drafts pending (call :meth:`commit` first); an input that is not a
                tensor of the documented shape, of the state's dtype (float32 or float64, the
                working precision it was built with) or on its device (the message names the
                argument, its shape and the expected one).
        """
        self._check_not_pending("step")
        self._check_inputs(q, k, v, g, beta)
        self._prepare_flush()
        qe = core.expand_heads(q, self.heads, 1)
        o = self._ops.step(self._checkpoints(), self._ring, self._h, q, k, v, g, beta)  # + append
        self._h += 1
        flushed = self._flush_seqs(self._h == self.window)
        if flushed is not None:
            idx, res = flushed
            if idx is None:
                o = core.matvec(res.state, qe)
            else:
                o[idx] = core.matvec(res.state, qe[idx])
        return o

    def verify(self, q, k, v, g, beta) -> torch.Tensor:
        """Outputs of T drafts per sequence (``q, k [B, T, HK, DK]``, ``v [B, T, HV, DV]``,
        ``g, beta [B, T, HV]``) in output-only form: one T x T triangular solve for the draft
        corrections against the read path, no state materialised.

        Sequences with h + T > L flush their committed part first; a draft landing on slot L
        reads the flushed state's value (corrections re-solved against A, or, on the kernels
        where R is A, the cached ones: :meth:`GDNFold.folds_cached`). Call :meth:`commit` next.
        Returns ``o [B, T, HV, DV]``.

        Raises:
            ValueError: drafts pending (call :meth:`commit` first); T above the
                ``max_drafts`` the state was built with; an input that is not a tensor of the
                documented shape (one T for all), of the state's dtype (float32 or float64,
                the working precision it was built with) or on its device (the message names
                the argument, its shape and the expected one).
            RuntimeError: ``backend="cuda"`` where the CUDA verify kernel applies but cannot
                be built (no nvcc or ninja; the message says which and that ``"triton"`` runs
                without it); the state is left unchanged.
        """
        self._check_not_pending("verify")
        self._prepare_flush()  # (commit() may flush)
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            raise ValueError(f"verify() v must be [B, T, HV, DV], got "
                             f"{tuple(v.shape) if isinstance(v, torch.Tensor) else type(v)}")
        check_one_T(q=(q, 4), k=(k, 4), v=(v, 4), g=(g, 3), beta=(beta, 3))
        T = v.shape[1]
        self._check_drafts(T)
        self._check_inputs(q, k, v, g, beta, T=T)
        J = self.window  # committed + drafts <= window after the early flush; a fixed shape
        r = self._ring

        def args():
            return (self._checkpoints(), r["la"][:, :J], r["beta"][:, :J], r["v"][:, :J],
                    r["k"][:, :J], q, r["uR"][:, :J], self._h, self.window, self._fold_cached)

        prepare = getattr(self._ops.verify, "prepare", None)
        if prepare is not None:  # a kernel built at its first covered call: before any change
            prepare(*args())
        self._begin_verify(T)
        self._write_drafts({"la": g, "beta": beta, "v": v, "k": k}, T)
        self._pending = T
        o, uR = self._ops.verify(*args())
        ring_uR = r["uR"][:, :J]
        if uR.data_ptr() != ring_uR.data_ptr() or uR.stride() != ring_uR.stride():
            ring_uR.copy_(uR)  # (the CUDA kernel writes the ring in place: nothing to copy)
        return o
