"""Per-layer ReplaySSM state of a patched model: prefill, stepping and teacher-forced windows.

One :class:`LayerState` holds, for one SSM layer and a batch of sequences, the dequantised
recurrence anchor A and read copy R ``[B, H, V, K]`` ("value x key"), a ring of the records
committed since the last flush (capacity ``window``), the committed count ``h``, the flush
counter and the sequence ids that key the stochastic-rounding streams. It lives on the
Hugging Face cache layer of its mixer (attribute ``replayssm``), next to the conv state and
the attention KV cache, so a document processed in segments carries everything from one
call to the next by passing the same cache object.

Three entry points, all built on the issue-3 reference functions in
:mod:`replayssm_quant.replay.core` (``flush`` is THE flush routine; both the stepping path and
the window path call it with the same records, so a layer given identical inputs rounds
identically):

* :func:`prefill_scan`: the exact chunked scan in the working precision (no rounding) that a
  prompt runs through; its final state is cast as flush 0 (DESIGN.md, "Prefill").
* :meth:`LayerState.step`: one token, DESIGN.md "Step": append, flush at h == L (the token's
  output is read from the unrounded flushed state), else the output-only read from R plus the
  buffer.
* :meth:`LayerState.advance`: T tokens teacher-forced, window by window: inside a window the
  outputs are the intra-window causal sum plus the decayed read-copy term; at each boundary
  the anchor passes through the flush routine (both casts). Equal to T calls of ``step`` up to
  float reassociation.

GDN (DESIGN.md section 3): non-flush outputs use corrections u solved against the read path
(R plus earlier read-path corrections); at a flush the corrections are re-solved against A from
the raw records, so read-path rounding never reaches A. ``gdn_fold="cached"`` selects the
studied-but-unstable variant that folds the cached read-path corrections instead.

Records are head-expanded (grouped B/C and grouped q/k repeated to the value heads):
``la [B, J, H]`` log decay (Mamba-2 ``dt * A``; GDN ``g``), ``v [B, J, H, V]`` (Mamba-2:
``dt * x``, the value written; GDN: the raw value), ``k [B, J, H, K]``, GDN ``beta [B, J, H]``;
queries ``q [B, T, H, K]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..replay import core

__all__ = ["Records", "LayerState", "prefill_scan", "PREFILL_CHUNK", "GDN_FOLDS"]

PREFILL_CHUNK = 64  # chunk length of the exact prefill scan (any length gives the same values)
GDN_FOLDS = ("recompute", "cached")  # DESIGN.md: recompute against A (default) / cached read-path


@dataclass
class Records:
    """Post-activation inputs of T tokens (see the module docstring for shapes)."""

    la: torch.Tensor
    v: torch.Tensor
    k: torch.Tensor
    q: torch.Tensor
    beta: torch.Tensor | None = None  # GDN only

    @property
    def length(self) -> int:
        return self.la.shape[1]

    def slice(self, a: int, b: int) -> "Records":
        return Records(self.la[:, a:b], self.v[:, a:b], self.k[:, a:b], self.q[:, a:b],
                       None if self.beta is None else self.beta[:, a:b])


def prefill_scan(rec: Records, initial: torch.Tensor | None = None,
                 chunk: int = PREFILL_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (unrounded) chunked scan of ``rec`` from ``initial`` (zeros if None).

    Returns ``(outputs [B, T, H, V], final state [B, H, V, K])``; outputs are ``S_t q_t``
    (Mamba-2 without the D skip, which the mixer adds).
    """
    B, T, H = rec.la.shape
    V, K = rec.v.shape[-1], rec.k.shape[-1]
    S = initial if initial is not None else rec.v.new_zeros(B, H, V, K)
    outs = []
    for a in range(0, T, chunk):
        r = rec.slice(a, min(T, a + chunk))
        w = r.v if r.beta is None else core.solve_corrections(S, r.la, r.beta, r.v, r.k)
        outs.append(core.window_outputs(S, r.la, w, r.k, r.q))
        S = core.reconstruct(S, r.la, w, r.k)
    out = torch.cat(outs, 1) if outs else rec.v.new_zeros(B, 0, H, V)
    return out, S


class LayerState:
    """ReplaySSM state of one SSM layer for a batch (see the module docstring).

    Args:
        anchor, read: dequantised A and R ``[B, H, V, K]`` in the working dtype.
        family: ``"mamba2"`` or ``"gdn"``.
        policy: :class:`~replayssm_quant.policy.StatePolicy`.
        window: L (forced to 1 for ``eager:`` policies).
        seed, layer: SR key parts; ``sequence_ids`` int64 ``[B]``.
        flush_index: index of the cast that produced A and R (prefill / initial zero = 0).
    """

    def __init__(self, anchor, read, *, family, policy, window, seed, layer, sequence_ids,
                 flush_index=core.PREFILL_FLUSH_INDEX, gdn_fold="recompute"):
        if family not in ("mamba2", "gdn"):
            raise ValueError(f"family must be 'mamba2' or 'gdn', got {family!r}")
        if gdn_fold not in GDN_FOLDS:
            raise ValueError(f"gdn_fold must be one of {GDN_FOLDS}, got {gdn_fold!r}")
        self.family = family
        self.policy = policy
        self.window = 1 if policy.is_eager else int(window)
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.seed = int(seed)
        self.layer = int(layer)
        self.sequence_ids = sequence_ids.to(torch.int64)
        self.gdn_fold = gdn_fold
        self.anchor = anchor
        self.read = read
        self.flush_index = int(flush_index)
        B, H, V, K = anchor.shape
        L = self.window
        z = dict(dtype=anchor.dtype, device=anchor.device)
        self.la = torch.zeros(B, L, H, **z)
        self.v = torch.zeros(B, L, H, V, **z)
        self.k = torch.zeros(B, L, H, K, **z)
        self.beta = torch.zeros(B, L, H, **z) if family == "gdn" else None
        self.u = torch.zeros(B, L, H, V, **z) if family == "gdn" else None  # read-path corrections
        self.h = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_state(cls, S: torch.Tensor, **kw) -> "LayerState":
        """Cast an unrounded state (a prefill's final state, or zeros) as flush 0."""
        cps = core.cast_checkpoints(S, kw["policy"], seed=kw["seed"], layer=kw["layer"],
                                    sequence_ids=kw["sequence_ids"],
                                    flush_index=torch.full_like(kw["sequence_ids"],
                                                                core.PREFILL_FLUSH_INDEX))
        return cls(cps.anchor, cps.read, **kw)

    @property
    def batch_size(self) -> int:
        return self.anchor.shape[0]

    @property
    def nbytes_estimate(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.anchor, self.read, self.la, self.v, self.k) if t is not None)

    # ------------------------------------------------------------------ internals
    def _write(self, rec: Records, a: int, n: int) -> None:
        h = self.h
        self.la[:, h:h + n] = rec.la[:, a:a + n]
        self.v[:, h:h + n] = rec.v[:, a:a + n]
        self.k[:, h:h + n] = rec.k[:, a:a + n]
        if self.beta is not None:
            self.beta[:, h:h + n] = rec.beta[:, a:a + n]

    def _read_values(self, J: int, start: int) -> torch.Tensor:
        """Values folded on the read path for records ``0..J-1`` (Mamba-2: v; GDN: the
        read-path corrections, solving rows ``start..J-1`` against R)."""
        if self.family == "mamba2":
            return self.v[:, :J]
        B = self.batch_size
        st = torch.full((B,), start, dtype=torch.int64, device=self.la.device)
        u = core.solve_corrections(self.read, self.la[:, :J], self.beta[:, :J], self.v[:, :J],
                                   self.k[:, :J], start=st, u_known=self.u)
        self.u[:, start:J] = u[:, start:J]
        return self.u[:, :J]

    def _flush(self) -> torch.Tensor:
        """Fold the L committed records into new checkpoints (THE flush routine); returns the
        unrounded reconstructed state."""
        L = self.window
        la, k = self.la[:, :L], self.k[:, :L]
        if self.family == "mamba2":
            w = self.v[:, :L]
        elif self.gdn_fold == "cached":
            w = self.u[:, :L]
        else:
            w = core.solve_corrections(self.anchor, la, self.beta[:, :L], self.v[:, :L], k)
        fi = torch.full_like(self.sequence_ids, self.flush_index + 1)
        res = core.flush(self.anchor, la, w, k, self.policy, seed=self.seed, layer=self.layer,
                         sequence_ids=self.sequence_ids, flush_index=fi)
        self.anchor, self.read = res.checkpoints.anchor, res.checkpoints.read
        self.flush_index += 1
        self.h = 0
        return res.state

    # ------------------------------------------------------------------ public
    def step(self, rec: Records) -> torch.Tensor:
        """One token (``rec`` of length 1): returns its output ``[B, 1, H, V]``."""
        if rec.length != 1:
            raise ValueError(f"step takes one token, got {rec.length}")
        h = self.h
        self._write(rec, 0, 1)
        J = h + 1
        w = self._read_values(J, h)
        q = rec.q[:, 0]
        if J == self.window:
            S = self._flush()
            return core.matvec(S, q)[:, None]
        self.h = J
        return core.step_output(self.read, self.la[:, :J], w, self.k[:, :J], q)[:, None]

    def advance(self, rec: Records) -> torch.Tensor:
        """T tokens teacher-forced, window by window: outputs ``[B, T, H, V]``."""
        T = rec.length
        outs = []
        pos = 0
        while pos < T:
            h = self.h
            n = min(self.window - h, T - pos)
            self._write(rec, pos, n)
            J = h + n
            w = self._read_values(J, h)
            q = rec.q.new_zeros(self.k[:, :J].shape)
            q[:, h:J] = rec.q[:, pos:pos + n]
            flush = J == self.window
            last = J - 1 if flush else J  # positions h..last-1 read R
            if last > h:
                o = core.window_outputs(self.read, self.la[:, :J], w, self.k[:, :J], q)
                outs.append(o[:, h:last])
            if flush:
                S = self._flush()
                outs.append(core.matvec(S, rec.q[:, pos + n - 1])[:, None])
            else:
                self.h = J
            pos += n
        return torch.cat(outs, 1)
