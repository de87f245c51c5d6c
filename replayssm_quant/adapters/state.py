"""Per-layer ReplaySSM state of a patched model: prefill, stepping and teacher-forced windows.

A :class:`LayerState` holds, for one SSM layer and a batch of sequences, an issue-3
:class:`~replayssm_quant.replay.window.WindowCarry` (dequantised anchor A and read copy R
``[B, H, V, K]`` in "value x key" orientation, the records since the last flush and the next
flush index) plus the settings that key it (policy, window L, seed, layer, sequence ids). It
lives on the Hugging Face cache layer of its mixer (attribute ``replayssm``), next to the conv
state and the attention KV cache, so a document processed in segments carries everything from
one call to the next by passing the same cache object.

Entry points (all built on :mod:`replayssm_quant.replay`; the flush is always
:func:`~replayssm_quant.replay.window.flush_window` -- the anchor-chain kernel on CUDA
(every ``rec`` format; fp32 is the exact recurrence), else
:func:`~replayssm_quant.replay.mamba2.mamba2_flush` / :func:`~replayssm_quant.replay.gdn.gdn_flush`
-- and the batched teacher-forced form takes the
same dispatch decision, so a layer given identical inputs rounds identically):

* :func:`prefill_scan`: the exact chunked scan in the working precision (no rounding) that a
  prompt runs through; its final state is cast as flush 0 (``window.initial_carry``).
* :meth:`LayerState.step`: one token, DESIGN.md "Step": append; at h == L flush and read the
  token's output from the unrounded flushed state; else the output-only read of R plus the
  buffer (GDN: the window's read-path corrections solved against R first). It is the window
  form (``window.mamba2_window`` / ``window.gdn_window``) with one
  token.
* :meth:`LayerState.advance`: T tokens teacher-forced with ``window_fast.mamba2_emulate_fast``
  / ``window_fast.gdn_emulate_fast`` (window by window; equal to T steps). On the torch path a
  sequence's results are bit-identical for any batch and any cut into calls
  (``window`` module, "Invariance").

Inputs are post-activation, as the issue-3 state objects take them: Mamba-2 ``x [B, T, H, P]``,
``dt [B, T, H]`` (after softplus), ``A [H]``, grouped ``B, C [B, T, G, N]``; GDN grouped
``q, k [B, T, HK, DK]`` (normalised, q scaled), ``v [B, T, HV, DV]``, ``g, beta [B, T, HV]``.
Outputs exclude the Mamba-2 D skip (the mixer adds it).

**Serving decode** (``apply_state_policy(..., decode="serving")``, issue 15): one-token calls
run through the decode state objects (:class:`~replayssm_quant.replay.mamba2.Mamba2ReplayState`,
:class:`~replayssm_quant.replay.gdn.GDNReplayState`) and, on CUDA, their Triton kernels: the
stored read copy is read in its packed format (NVFP4 nibbles and scales, not FP32 values), the
records live in a ring, a flush is one kernel. The rounding rules and SR streams are the same,
and on the torch path the checkpoints are bit-identical to the window form's; on CUDA the flush
kernel sums S in another order than the anchor-chain kernel (``window`` module docstring), so
stepping is a different, equally valid realisation and no longer bit-equal to teacher forcing.
The state starts from the prefill as usual; teacher-forced calls (T > 1) after it and batch
reordering (beam search) raise ``ValueError`` in this mode.
"""

from __future__ import annotations

import torch

from ..config import Family, StateConfig
from ..policy import StatePolicy
from ..replay import core
from ..replay import window as W
from ..replay import window_fast as WF
from ..replay.mamba2 import mamba2_records

__all__ = ["LayerState", "prefill_scan", "PREFILL_CHUNK"]

PREFILL_CHUNK = 64  # chunk length of the exact prefill scan (any length gives the same values)


def _expanded(family: str, inp: dict):
    """Head-expanded records ``(la, v, k, q, beta)`` of a run of tokens."""
    if family == "mamba2":
        H = inp["x"].shape[2]
        la, v, k = mamba2_records(inp["x"], inp["dt"], inp["A"], inp["B"])
        return la, v, core.expand_heads(k, H, 2), core.expand_heads(inp["C"], H, 2), None
    HV = inp["v"].shape[2]
    return (inp["g"], inp["v"], core.expand_heads(inp["k"], HV, 2),
            core.expand_heads(inp["q"], HV, 2), inp["beta"])


def state_dims(family: str, inp: dict) -> tuple[int, int, int, int]:
    """(B, H, V, K) of the state the inputs write."""
    if family == "mamba2":
        Bz, _, H, P = inp["x"].shape
        return Bz, H, P, inp["B"].shape[-1]
    Bz, _, HV, DV = inp["v"].shape
    return Bz, HV, DV, inp["k"].shape[-1]


def prefill_scan(family: str, inp: dict, chunk: int = PREFILL_CHUNK):
    """Exact (unrounded) chunked scan of a prompt from the zero state.

    Returns ``(outputs [B, T, H, V], final state [B, H, V, K])``; outputs are ``S_t q_t``.
    """
    la, v, k, q, beta = _expanded(family, inp)
    Bz, H, V, K = state_dims(family, inp)
    return WF.exact_scan(v.new_zeros(Bz, H, V, K), la, k, q, v, beta, chunk=chunk)


class LayerState:
    """ReplaySSM state of one SSM layer for a batch (see the module docstring).

    Args:
        S: unrounded starting state ``[B, H, V, K]`` (a prefill's final state, or zeros), cast
            as flush 0.
        track_stats: record the per-head input statistics of :meth:`input_stats`.
        family: :class:`~replayssm_quant.config.Family` (or ``"mamba2"`` / ``"gdn"``).
        config: the parsed :class:`~replayssm_quant.config.StateConfig`.
        layer: layer index; sequence_ids: int64 ``[B]`` (both key the SR streams).
    """

    def __init__(self, S, *, family, config: StateConfig, layer: int, sequence_ids,
                 track_stats: bool = False, serving: bool = False):
        self.family = Family.parse(family)
        self.config = config
        self.serving = bool(serving)
        # serving decode: the decode state object, built at the first step (it needs the
        # inputs' group count); until then the starting state S
        self._obj = None
        self._S0 = S if self.serving else None
        self._layer = int(layer)
        self._ids = sequence_ids
        self.carry = None if self.serving else W.initial_carry(
            S, config, layer=int(layer), sequence_ids=sequence_ids)
        B, H = S.shape[:2]
        # input statistics of the tokens run through advance/step (not the prefill), when
        # tracked: sums over tokens per (row, head), float64; see input_stats()
        self._track = bool(track_stats)
        self._stats = torch.zeros(3, B, H, dtype=torch.float64, device=S.device)
        self._tokens = 0

    @property
    def batch_size(self) -> int:
        if self.serving:
            return self._S0.shape[0] if self._obj is None else self._obj.batch
        return self.carry.anchor.shape[0]

    @property
    def h(self) -> int:
        if self.serving:
            return 0 if self._obj is None else int(self._obj.committed[0])
        return self.carry.h

    @property
    def anchor(self) -> torch.Tensor:
        """Dequantised anchor A ``[B, H, V, K]``."""
        if self.serving:
            return self._prefill_carry().anchor if self._obj is None else self._obj.anchor
        return self.carry.anchor

    @property
    def read(self) -> torch.Tensor:
        """Dequantised read copy R ``[B, H, V, K]``."""
        if self.serving:
            return self._prefill_carry().read if self._obj is None else self._obj.read_copy
        return self.carry.read

    @property
    def flushes(self) -> int:
        """Flushes done since the prefill (the next flush index minus 1)."""
        if self.serving:
            return 0 if self._obj is None else int(self._obj.flush_index[0]) - 1
        return int(self.carry.flush_index[0]) - 1

    @property
    def window(self) -> int:
        """The window L this layer runs with (``config.window``)."""
        return self.config.window

    @property
    def policy(self):
        """The parsed policy (``config.policy``)."""
        return self.config.policy

    @property
    def sequence_ids(self) -> torch.Tensor:
        """int64 ``[B]`` SR sequence ids of the batch rows (host)."""
        if self.serving:
            return self._serving_ids().cpu()
        return self.carry.sequence_ids

    @property
    def layer(self) -> int:
        """The layer index keying the SR streams."""
        return self._layer

    # ------------------------------------------------------------------ serving decode
    def _serving_ids(self) -> torch.Tensor:
        ids = self._ids
        B = self.batch_size
        if ids is None:
            return torch.arange(B, dtype=torch.int64)
        return torch.as_tensor(ids, dtype=torch.int64).reshape(-1).cpu()

    def _prefill_carry(self):
        """Serving mode before the first step: the checkpoints of the starting state (flush 0,
        the casts the decode state object makes at its first step)."""
        return W.initial_carry(self._S0, self.config, layer=self._layer,
                               sequence_ids=self._ids)

    def _serving_obj(self, groups: int):
        """The decode state object of serving mode, built from the starting state at the first
        step (``groups``: Mamba-2 B/C groups or GDN key heads of the inputs)."""
        if self._obj is not None:
            return self._obj
        from ..replay.gdn import GDNReplayState
        from ..replay.mamba2 import Mamba2ReplayState

        S = self._S0
        B, H, V, K = S.shape
        cfg = self.config
        pol = cfg.policy
        if not isinstance(pol, StatePolicy):
            raise ValueError(f"decode='serving' takes one policy per layer, got the policy map "
                             f"{pol} on layer {self._layer}; use decode='window'")
        common = dict(window=self.window, seed=cfg.seed, layer=self._layer,
                      sequence_ids=self._serving_ids(), dtype=S.dtype, device=S.device)
        # eager policies: the state objects set window 1 themselves from the policy
        if self.family is Family.MAMBA2:
            obj = Mamba2ReplayState(pol, batch=B, heads=H, head_dim=V, d_state=K,
                                    groups=groups, **common)
        else:
            obj = GDNReplayState(pol, batch=B, key_heads=groups, value_heads=H, key_dim=K,
                                 value_dim=V, fold_cached_corrections=cfg.fold_cached, **common)
        obj.prefill(S)
        self._obj, self._S0 = obj, None
        return obj

    def _serving_step(self, inp: dict) -> torch.Tensor:
        if self.family is Family.MAMBA2:
            obj = self._serving_obj(inp["B"].shape[2])
            y = obj.step(inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0],
                         inp["C"][:, 0])
        else:
            obj = self._serving_obj(inp["k"].shape[2])
            y = obj.step(inp["q"][:, 0], inp["k"][:, 0], inp["v"][:, 0], inp["g"][:, 0],
                         inp["beta"][:, 0])
        return y[:, None]

    # ------------------------------------------------------------------ batch rows
    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` (int64 ``[B']``, any order, repeats allowed) of the whole
        state (checkpoints, buffer, flush indices, sequence ids): beam search's
        ``reorder_cache`` and a cache's ``batch_select_indices`` call this through the cache
        layer, so every row's ReplaySSM state follows its hypothesis."""
        if self.serving:
            raise ValueError("decode='serving' does not reorder or select batch rows (beam "
                             "search, batch selection); use decode='window'")
        rows = torch.as_tensor(rows, dtype=torch.int64)
        self.carry = self.carry.select(rows)
        self._stats = self._stats.index_select(1, rows.to(self._stats.device))

    def repeat_rows(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (``batch_repeat_interleave``)."""
        self.select_rows(torch.arange(self.batch_size).repeat_interleave(int(repeats)))

    # ------------------------------------------------------------------ input statistics
    def _record_stats(self, inp: dict) -> None:
        """Add the per-token decays of ``inp`` to the running sums (no effect on the state)."""
        if not self._track:
            return
        if self.family is Family.MAMBA2:
            log_a = inp["dt"].double() * inp["A"].double()  # [B, T, H]: log decay dt * A
            beta = torch.ones_like(log_a)
        else:
            log_a, beta = inp["g"].double(), inp["beta"].double()  # [B, T, HV]
        self._stats += torch.stack([log_a.exp().sum(1), log_a.sum(1), beta.sum(1)])
        self._tokens += log_a.shape[1]

    def input_stats(self) -> dict:
        """Per (row, head) means over the tokens run through :meth:`advance` / :meth:`step`
        since this state was created (prefill tokens excluded): ``decay`` = mean of the
        per-token decay alpha_t (Mamba-2 ``exp(dt_t A)``, GDN ``exp(g_t)``; DESIGN.md section 2),
        ``log_decay`` = mean of log alpha_t, ``beta`` = mean GDN write strength (1 for Mamba-2),
        each float64 ``[B, H]`` on the state's device, and ``tokens`` (int). NaN before any
        token, and when the state was built without ``track_stats`` (the adapters' handle:
        ``track_input_stats = True``)."""
        n = self._tokens if self._tokens else float("nan")
        d, lg, b = (self._stats / n).unbind(0)
        return {"decay": d, "log_decay": lg, "beta": b, "tokens": self._tokens}

    # ------------------------------------------------------------------ teacher-forced
    def advance(self, inp: dict) -> torch.Tensor:
        """T tokens teacher-forced (``window_fast.*_emulate_fast``: the window form; on the
        kernel path the full windows batched through the anchor-chain kernel): outputs
        ``[B, T, H, V]``, equal to T steps."""
        if self.serving:
            raise ValueError(f"decode='serving' steps one token per call after the prefill, got "
                             f"{inp['v' if self.family is Family.GDN else 'x'].shape[1]} tokens "
                             f"(layer {self._layer}); teacher-forced segments need "
                             f"decode='window'")
        self._record_stats(inp)
        if self.family is Family.MAMBA2:
            y, self.carry = WF.mamba2_emulate_fast(self.carry, inp["x"], inp["dt"], inp["A"],
                                                   inp["B"], inp["C"], None, config=self.config)
        else:
            y, self.carry = WF.gdn_emulate_fast(self.carry, inp["q"], inp["k"], inp["v"], inp["g"],
                                                inp["beta"], config=self.config)
        return y

    # ------------------------------------------------------------------ stepping
    def step(self, inp: dict) -> torch.Tensor:
        """One token per sequence (inputs with T = 1): output ``[B, 1, H, V]``. DESIGN.md
        "Step": append the record; at h == L flush and read the output from the unrounded
        flushed state, else the output-only read of R plus the buffer (GDN: the window's
        read-path corrections solved against R first; the rows of earlier tokens come out as
        they were cached). It is the window form with one token, so stepping and teacher-forced segments of any length
        give the same bits (``window`` module, "Invariance")."""
        self._record_stats(inp)
        if self.serving:
            return self._serving_step(inp)
        if self.family is Family.MAMBA2:
            y, self.carry = W.mamba2_window(self.carry, inp["x"], inp["dt"], inp["A"], inp["B"],
                                            inp["C"], None, config=self.config)
        else:
            y, self.carry = W.gdn_window(self.carry, inp["q"], inp["k"], inp["v"], inp["g"],
                                         inp["beta"], config=self.config)
        return y
