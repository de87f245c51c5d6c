"""Bookkeeping shared by :class:`Mamba2ReplayState` and :class:`GDNReplayState`.

The model-specific parts (which records a token writes, how outputs and flush values are
formed) live in the subclasses; this base owns the checkpoints, the ring buffer, the
committed counts, the flush indices, the speculative ``verify``/``commit`` protocol and the
validation (every public method validates all of its inputs before it mutates anything).
"""

from __future__ import annotations

import math

import torch

from ..capabilities import allocation, available_device
from ..checkpoints import PREFILL_FLUSH_INDEX, Checkpoints, FlushResult
from ..config import GDNFold, StateConfig
from ..packed import PackedTensor
from ..philox import STREAM_FIELDS, as_int, check_seed, stream_key
from ..policy import StatePolicy
from .core import cast_checkpoints

_FLOAT_DTYPES = (torch.float32, torch.float64)


def _stored_nbytes(stored) -> int:
    if isinstance(stored, PackedTensor):
        return stored.nbytes
    return stored.numel() * stored.element_size()


def _select_stored(stored, idx: torch.Tensor):
    """``stored[idx]`` along the batch dim for a stored copy (plain tensor or PackedTensor)."""
    if isinstance(stored, PackedTensor):
        def take(a):
            return None if a is None else a[idx]

        return PackedTensor(stored.spec, torch.Size((len(idx),) + tuple(stored.shape[1:])),
                            take(stored.codes), take(stored.block_scales),
                            take(stored.matrix_scale))
    return stored[idx]


def _scatter_stored(dst, idx: torch.Tensor, src):
    """``dst[idx] = src`` for a stored copy (plain tensor or PackedTensor), out of place."""
    if isinstance(dst, PackedTensor):
        def put(a, b):
            if a is None:
                return None
            a = a.clone()
            a[idx] = b
            return a

        return PackedTensor(dst.spec, dst.shape, put(dst.codes, src.codes),
                            put(dst.block_scales, src.block_scales),
                            put(dst.matrix_scale, src.matrix_scale))
    out = dst.clone()
    out[idx] = src
    return out


def check_one_T(**drafts) -> None:
    """Raise ValueError when the draft inputs of a verify (``name=(tensor, rank)``, drafts on
    dim 1) disagree on T, naming each input's T (otherwise the shape check blames whichever
    input differs from the first one's T). Inputs that are not tensors of their rank are left
    to the shape check."""
    ts = {n: t.shape[1] for n, (t, rank) in drafts.items()
          if isinstance(t, torch.Tensor) and t.dim() == rank}
    if len(set(ts.values())) > 1:
        raise ValueError("verify() takes one T (drafts, dim 1) for every input, got "
                         + ", ".join(f"{n}: {T}" for n, T in ts.items()))


def check_tensor(name: str, t, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    """Raise ValueError unless ``t`` is a tensor of exactly ``shape``/``dtype``/``device``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, expected {dtype} (the state's dtype)")
    if t.device != device:
        raise ValueError(f"{name} is on device {t.device}, expected {device}")


def _check_int(name, value, lo, hi=None) -> int:
    """``value`` as an int in ``[lo, hi]`` (numpy integers taken as their int)."""
    v = as_int(value)
    if v is None:
        raise ValueError(f"{name} must be an int, got {value!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {v}")
    return v


def _acceptance_error(T: int, got) -> ValueError:
    return ValueError(f"accepted counts must be in [0, {T}] (the number of verified drafts), "
                      f"got {got}")


class ReplayStateBase:
    """Common part of the per-layer ReplaySSM state (see the subclasses for the model maths).

    Holds, per sequence of the batch: the recurrence anchor A and the read copy R (real
    storage: PackedTensor for quantised formats), a ring of capacity ``window + max_drafts``
    with the raw records since the last flush, the committed count h and the index of the
    next flush (the prefill / initial cast is flush 0).
    """

    _RING: dict  # name -> trailing shape, set by subclasses in __init__

    def __init__(self, policy, *, batch: int, heads: int, value_dim: int, key_dim: int,
                 window: int, max_drafts: int, seed: int, layer: int, sequence_ids,
                 dtype: torch.dtype, device, fold: GDNFold = GDNFold.RECOMPUTE) -> None:
        window = _check_int("window", window, 1)
        max_drafts = _check_int("max_drafts", max_drafts, 0)
        batch = _check_int("batch", batch, 1)
        seed = check_seed(seed)
        layer = _check_int("layer", layer, 0)
        # the edge: parse once (eager policies run with window 1: conventional decoding rounds
        # the state after every token)
        self.config = StateConfig.build(policy, window=window, seed=seed, fold=fold)
        self.policy = self.config.policy
        if not isinstance(self.policy, StatePolicy):
            raise ValueError(f"the decode state objects take one policy per layer, got the per-head "
                             f"policy {self.policy}; per-head policy maps run through the adapters' "
                             "window form (replayssm_quant.adapters)")
        window = self.config.window
        if max_drafts > window:
            raise ValueError(
                f"max_drafts={max_drafts} must be <= window={window}"
                + (" (eager policies run with window 1)" if self.policy.is_eager else "")
                + ": drafts must fit in one window to be verified in output-only form")
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        # as tensors report it, so the device checks below compare equal devices as equal
        self.device = available_device(device)
        self.dtype = dtype
        self.window = window
        self.max_drafts = max_drafts
        self.seed = seed
        self.layer = layer
        self.batch, self.heads, self.value_dim, self.key_dim = batch, heads, value_dim, key_dim
        if sequence_ids is None:
            sequence_ids = torch.arange(batch)
        sequence_ids = torch.as_tensor(sequence_ids)
        if sequence_ids.shape != (batch,) or sequence_ids.is_floating_point():
            raise ValueError(f"sequence_ids must be an integer tensor of shape ({batch},), "
                             f"got {tuple(sequence_ids.shape)} {sequence_ids.dtype}")
        # the SR stream key's fields (philox.STREAM_FIELDS), checked here under the
        # arguments' own names
        widths = dict(STREAM_FIELDS)
        self.heads = heads = _check_int("heads", heads, 1, 1 << widths["head"])
        _check_int("layer", layer, 0, (1 << widths["layer"]) - 1)
        if sequence_ids.numel() and (int(sequence_ids.min()) < 0
                                     or int(sequence_ids.max()) >= 1 << widths["sequence"]):
            raise ValueError(f"sequence_ids must be in [0, {1 << widths['sequence']}) (the SR "
                             f"stream key's {widths['sequence']}-bit field), got "
                             f"{int(sequence_ids.min())}..{int(sequence_ids.max())}")
        stream_key(layer=layer, sequence=sequence_ids, head=heads - 1)  # range check
        self.sequence_ids = sequence_ids.to(torch.int64).to(self.device)
        cap = window + max_drafts
        per_slot = sum(math.prod(shape) for shape in self._RING.values())
        with allocation(batch * cap * per_slot * torch.finfo(dtype).bits // 8, self.device,
                        lambda: f"window={window} + max_drafts={max_drafts}: a record ring of "
                                f"{batch} sequences x {cap} slots"):
            self._ring = {name: torch.zeros(batch, cap, *shape, dtype=dtype, device=self.device)
                          for name, shape in self._RING.items()}
        self._h = torch.zeros(batch, dtype=torch.int64, device=self.device)
        self._pending: int | None = None
        self._committed = False  # the last verify() has been committed (for commit's message)
        self._set_all(torch.zeros(self.state_shape, dtype=dtype, device=self.device))

    # ------------------------------------------------------------------ properties
    @property
    def state_shape(self) -> tuple:
        return (self.batch, self.heads, self.value_dim, self.key_dim)

    @property
    def anchor(self) -> torch.Tensor:
        """Dequantised recurrence anchor A ``[B, H, V, K]`` (working dtype; a copy)."""
        return self._A.clone()

    @property
    def read_copy(self) -> torch.Tensor:
        """Dequantised read copy R ``[B, H, V, K]`` (equals the anchor for single-checkpoint
        policies; a copy)."""
        return self._R.clone()

    @property
    def committed(self) -> torch.Tensor:
        """Committed records since the last flush, h per sequence (int64 ``[B]``, a copy)."""
        return self._h.clone()

    @property
    def flush_index(self) -> torch.Tensor:
        """Index the next flush of each sequence will use in its SR streams (int64 ``[B]``)."""
        return self._fi.clone()

    @property
    def pending_drafts(self) -> int | None:
        """Drafts of the last ``verify`` not yet committed: None when no ``verify`` awaits its
        ``commit``; an int ``T >= 0`` while one does (0 after ``verify`` with no drafts, which
        still needs ``commit(0)``)."""
        return self._pending

    @property
    def anchor_nbytes(self) -> int:
        """Real bytes of the stored anchor (codes + block scales + matrix scales)."""
        return _stored_nbytes(self._A_st)

    @property
    def read_nbytes(self) -> int:
        """Real bytes of the stored read copy; 0 for single-checkpoint policies (``fp32``,
        ``shared``, ``eager``), where reads use the anchor itself."""
        return 0 if self.policy.single_checkpoint else _stored_nbytes(self._R_st)

    @property
    def total_nbytes(self) -> int:
        return self.anchor_nbytes + self.read_nbytes

    # ------------------------------------------------------------------ checkpoints
    def _set_all(self, S: torch.Tensor) -> None:
        """Prefill semantics: cast A and R from S with flush index 0, empty the buffer."""
        fi = torch.full((self.batch,), PREFILL_FLUSH_INDEX, dtype=torch.int64, device=self.device)
        cps = cast_checkpoints(S, self.policy, seed=self.seed, layer=self.layer,
                               sequence_ids=self.sequence_ids, flush_index=fi, store=True)
        self._store(None, cps)
        self._fi = fi + 1
        self._h.zero_()
        self._pending = None
        self._committed = False
        for t in self._ring.values():
            t.zero_()

    def _checkpoints(self) -> Checkpoints:
        """The current checkpoints: dequantised A and R and their storage (what the step and
        verify operations read: the references the values, the kernels the storage)."""
        return Checkpoints(self._A, self._R, self._A_st, self._R_st)

    def _store(self, idx, cps: Checkpoints) -> None:
        if idx is None:
            self._A, self._R = cps.anchor, cps.read
            self._A_st, self._R_st = cps.anchor_stored, cps.read_stored
            return
        self._A = self._A.clone()
        self._A[idx] = cps.anchor
        self._A_st = _scatter_stored(self._A_st, idx, cps.anchor_stored)
        if self.policy.single_checkpoint:
            self._R, self._R_st = self._A, self._A_st
        else:
            self._R = self._R.clone()
            self._R[idx] = cps.read
            self._R_st = _scatter_stored(self._R_st, idx, cps.read_stored)

    def prefill(self, S: torch.Tensor) -> None:
        """Start every sequence from the exact state ``S [B, H, V, K]`` of a prompt (computed by
        the model's own scan in FP32): A and R are cast independently from it as flush 0,
        h = 0, the buffer is emptied and any pending drafts are dropped.

        Raises:
            ValueError: ``S`` not a tensor of :attr:`state_shape`, of the state's dtype and on
                its device (the message names the shape and dtype expected).
        """
        check_tensor("S", S, self.state_shape, self.dtype, self.device)
        self._set_all(S.clone())

    def _flush_seqs(self, mask: torch.Tensor):
        """Flush the sequences in ``mask`` that hold committed records.

        Returns ``(idx, FlushResult)`` (``idx`` None when every sequence flushed) or None.
        """
        mask = mask & (self._h > 0)
        if not bool(mask.any()):
            return None
        every = bool(mask.all())
        idx = None if every else mask.nonzero().squeeze(1)
        sel = (lambda t: t) if every else (lambda t: t[idx])  # noqa: E731
        length = sel(self._h)
        # the committed records, masked to each sequence's count, always over the window's
        # slots (committed h <= window): a shape of the batch's largest count would let one
        # sequence's flush (torch's summation order, the kernels' tiles) follow its batchmates
        J = self.window
        recs = {name: sel(t[:, :J]).contiguous() for name, t in self._ring.items()}
        # the kernels read the stored anchor (its packed bytes, as they do in step and verify);
        # the torch references its values
        if getattr(self, "_kernels", False):
            anchor = self._A_st if every else _select_stored(self._A_st, idx)
        else:
            anchor = sel(self._A)
        res = self._flush_records(anchor, recs, length, sel(self.sequence_ids), sel(self._fi))
        self._store(idx, res.checkpoints)
        if every:
            self._h.zero_()
            self._fi += 1
        else:
            self._h[idx] = 0
            self._fi[idx] += 1
        return idx, res

    def _flush_records(self, anchor, recs, length, sequence_ids, flush_index) -> FlushResult:
        """Family-specific flush of the committed records (the shared flush routine with the
        family's records); implemented by :class:`Mamba2ReplayState` and :class:`GDNReplayState`,
        this base class is never instantiated on its own."""
        raise NotImplementedError(f"{type(self).__name__} must implement _flush_records")

    def flush(self) -> None:
        """Fold the committed records of every sequence with h > 0 into new checkpoints now
        (sequences with h = 0 are left alone: re-casting an unchanged anchor would round it
        again). Raises ValueError while drafts are pending."""
        self._check_not_pending("flush")
        self._flush_seqs(torch.ones_like(self._h, dtype=torch.bool))

    # ------------------------------------------------------------------ ring / protocol helpers
    def _check_not_pending(self, what: str) -> None:
        if self._pending is not None:
            raise ValueError(f"{what}() called while a verify() of {self._pending} drafts is "
                             f"pending: call commit(accepted) first "
                             f"(0 <= accepted <= {self._pending})")

    def _check_drafts(self, T: int) -> None:
        if T > self.max_drafts:
            raise ValueError(f"verify() got {T} drafts, more than max_drafts={self.max_drafts}")

    def _write_drafts(self, recs: dict, T: int) -> torch.Tensor:
        """Write T draft records per sequence at slots h..h+T-1 (h unchanged); return slots."""
        pos = self._h[:, None] + torch.arange(T, device=self.device)[None, :]
        b = torch.arange(self.batch, device=self.device)[:, None]
        for name, t in recs.items():
            self._ring[name][b, pos] = t
        return pos

    def _begin_verify(self, T: int) -> None:
        """Early flush rule: a sequence with h + T > window folds its committed part first.
        Called by every verify(), which leaves T drafts pending (none committed yet)."""
        self._committed = False
        self._flush_seqs(self._h + T > self.window)

    def commit(self, accepted) -> None:
        """Accept the first ``accepted[b]`` drafts of sequence b (int, or int tensor ``[B]``).

        h += accepted; sequences that reach the window flush (folding only committed records;
        rejected drafts are never folded and are overwritten by the next append). Accepting 0
        leaves the checkpoints untouched and solves nothing.

        Raises:
            ValueError: no verify() pending, or a count outside [0, T] (state unchanged).
        """
        if self._pending is None:
            if self._committed:
                raise ValueError("commit() called twice: the last verify() was already "
                                 "committed (verify() new drafts first)")
            raise ValueError("commit() called before verify(): nothing to commit")
        T = self._pending
        n = as_int(accepted)  # int, numpy integers; not bool
        if n is not None:
            if not 0 <= n <= T:  # before torch.full, which cannot hold 2**63 and up
                raise _acceptance_error(T, n)
            a = torch.full((self.batch,), n, dtype=torch.int64, device=self.device)
        elif isinstance(accepted, torch.Tensor) and not accepted.is_floating_point() \
                and accepted.dtype != torch.bool:
            if accepted.shape not in ((), (self.batch,)):
                raise ValueError(f"accepted has shape {tuple(accepted.shape)}, expected "
                                 f"({self.batch},) or a scalar")
            a = accepted.to(device=self.device, dtype=torch.int64).expand(self.batch)
        else:
            raise ValueError(f"accepted must be an int or an integer tensor, got {accepted!r}")
        if bool((a < 0).any()) or bool((a > T).any()):
            raise _acceptance_error(T, a.tolist())
        self._pending = None
        self._committed = True
        self._h += a
        self._flush_seqs(self._h == self.window)
