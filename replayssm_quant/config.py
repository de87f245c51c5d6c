"""The parsed state configuration, built once where settings enter and passed inward.

Settings arrive as strings and ints at the edges -- the ``replayssm-kl`` command line, lm-eval
``model_args``, :func:`~replayssm_quant.adapters.apply_state_policy` / ``state_policy``, the
state constructors -- and are parsed and validated there, once, into a frozen
:class:`StateConfig`. Everything further in (the window form, flushes, casts) takes the parsed
object and never re-parses a string (torchao's ``config.py`` pattern: modes are documented
enums, parsed where they enter).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from .philox import as_int, check_seed
from .policy import HeadPolicy, StatePolicy

__all__ = ["Family", "GDNFold", "StateConfig", "LayerwiseConfig", "check_window", "check_seed"]


class Family(str, Enum):
    """The recurrence a state belongs to (DESIGN.md section 3)."""

    #: Mamba-2 (SSD): scalar decay per head, ``S_t = a_t S_{t-1} + (dt_t x_t) B_t^T``; the
    #: written value of a record is ``v = dt x``.
    MAMBA2 = "mamba2"
    #: Gated DeltaNet: ``S_t = alpha_t S_{t-1} + u_t k_t^T`` with the correction
    #: ``u_t = beta_t (v_t - alpha_t S_{t-1} k_t)``; the written value is ``u``.
    GDN = "gdn"

    @classmethod
    def parse(cls, value) -> "Family":
        """``"mamba2"``/``"gdn"`` (or a member) -> member; ValueError naming the choices."""
        return _parse_enum(cls, value, "family")


class GDNFold(str, Enum):
    """What a GDN flush folds into the recurrence anchor (DESIGN.md section 3, "Flush")."""

    #: Re-solve the window's corrections against the anchor A from the raw records (the unit
    #: lower-triangular system), so read-path rounding never reaches A. The default.
    RECOMPUTE = "recompute"
    #: Fold the corrections cached on the read path (solved against R): read-copy rounding
    #: enters the anchor. Unstable; offered only to study that instability.
    CACHED = "cached"

    @classmethod
    def parse(cls, value) -> "GDNFold":
        """``"recompute"``/``"cached"`` (or a member) -> member; ValueError naming the choices."""
        return _parse_enum(cls, value, "gdn_fold")

    def folds_cached(self, policy, kernels: bool = True) -> bool:
        """Whether a decode state's flush (and the flush-slot draft of a verify) under
        ``policy`` folds the corrections cached on the read path instead of solving them
        again against the anchor.

        :attr:`CACHED`: always. :attr:`RECOMPUTE`: only on the decode kernels (``kernels``)
        and when the read copy is the anchor itself (``policy.single_checkpoint``: ``fp32``,
        ``shared:F``, ``eager:F``). Each cached correction was then solved, as its token came,
        against A plus the earlier cached ones: that is row ``j`` of the anchor system of
        DESIGN.md section 3 ("Flush"),
        ``u_j + sum_{i<j} beta_j gamma_{i+1:j} (k_i . k_j) u_i = beta_j (v_j - gamma_{1:j} A k_j)``,
        solved by forward substitution. Solving it again gives the same values up to float
        reassociation, and no read-path rounding can reach A because there is none, so the
        kernels' flush folds them (decision of 2026-12-02, docs/replay.md item 8). The torch
        path re-solves, as the teacher-forced window form does, so that stepping and teacher
        forcing give a layer the same bits there (DESIGN.md: one flush routine for both
        paths); on the kernels stepping already sums S in another order than the window form
        (docs/adapters.md, "Serving decode"). Dual policies (``read:F/rec:G``) always re-solve.
        ``policy``: a StatePolicy or HeadPolicy (per-head: only when every group is single)."""
        return self is GDNFold.CACHED or (bool(kernels) and bool(policy.single_checkpoint))


def _parse_enum(cls, value, name: str):
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


def check_window(window) -> int:
    """``window`` as an int >= 1 (a numpy integer is taken as its int; ValueError naming the
    value otherwise)."""
    w = as_int(window)
    if w is None or w < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    return w


@dataclass(frozen=True)
class StateConfig:
    """A parsed, validated state configuration (build it with :meth:`build`).

    Attributes:
        policy: the parsed :class:`~replayssm_quant.policy.StatePolicy`, or, for one layer of a
            per-head policy map, a :class:`~replayssm_quant.policy.HeadPolicy` (the adapters'
            window form casts its head groups separately; the decode state objects refuse it).
        window: the window L the state runs with: the requested one, or 1 for ``eager:``
            policies (conventional decoding rounds after every token).
        seed: Philox key of stochastic rounding.
        fold: :class:`GDNFold` (GDN layers only).
    """

    policy: StatePolicy
    window: int
    seed: int = 0
    fold: GDNFold = GDNFold.RECOMPUTE

    def __post_init__(self):
        if not isinstance(self.policy, (StatePolicy, HeadPolicy)):
            raise TypeError(f"StateConfig.policy must be a parsed StatePolicy or HeadPolicy, got "
                            f"{type(self.policy).__name__}; use StateConfig.build(...)")
        object.__setattr__(self, "window", check_window(self.window))  # numpy ints as int
        object.__setattr__(self, "seed", check_seed(self.seed))
        if self.policy.is_eager and self.window != 1:
            raise ValueError(f"an eager policy runs with window 1, got {self.window}; "
                             "use StateConfig.build(...)")
        if not isinstance(self.fold, GDNFold):
            raise TypeError(f"StateConfig.fold must be a GDNFold, got {self.fold!r}")

    @classmethod
    def build(cls, policy="fp32", window: int = 16, seed: int = 0,
              fold="recompute") -> "StateConfig":
        """Parse and validate the settings once.

        Args:
            policy: policy string (grammar: :mod:`replayssm_quant.policy`), StatePolicy or
                HeadPolicy (one layer's per-head policies; policy maps are resolved per layer
                by the adapters, :class:`LayerwiseConfig`).
            window: requested window L (int >= 1); ``eager:`` policies use 1.
            seed: int in [0, 2^63). fold: ``"recompute"``/``"cached"`` or a :class:`GDNFold`.

        Raises:
            ValueError: naming the bad value and what was expected.
        """
        pol = policy if isinstance(policy, HeadPolicy) else StatePolicy.parse(policy)
        window = check_window(window)
        return cls(pol, 1 if pol.is_eager else window, check_seed(seed), GDNFold.parse(fold))

    @property
    def fold_cached(self) -> bool:
        """True for the cached-fold variant (:attr:`GDNFold.CACHED`)."""
        return self.fold is GDNFold.CACHED

    @property
    def uses_sr(self) -> bool:
        """Whether a cast under this configuration draws random bits."""
        return self.policy.uses_sr

    def for_layer(self, layer: int) -> "StateConfig":
        """The configuration of layer ``layer``: this one (every layer shares it)."""
        return self


@dataclass(frozen=True)
class LayerwiseConfig:
    """Per-layer state configurations of one model under a policy map (built once, by the
    adapters, from a :class:`~replayssm_quant.policymap.PolicyMap` resolved against the model's
    SSM layers, head counts and head decays).

    Attributes:
        source: the :class:`~replayssm_quant.policymap.PolicyMap` it was resolved from (what
            ``handle.policy`` returns; ``str()`` gives its canonical text).
        default: the configuration of layers without an override (the map's default policy).
        layers: ``((layer, StateConfig), ...)`` for every SSM layer, ascending; each layer's
            window is the requested one, or 1 where the layer is ``eager:``.
        window: the window L asked for; seed, fold: shared by every layer.

    Raises:
        TypeError/ValueError: a layer config that is not a :class:`StateConfig`, repeated
            layers, or a layer whose seed/fold differ from the default's.
    """

    source: object
    default: StateConfig
    layers: tuple
    window: int

    def __post_init__(self):
        seen = set()
        for i, c in self.layers:
            if not isinstance(c, StateConfig):
                raise TypeError(f"layer {i}: expected a StateConfig, got {type(c).__name__}")
            if i in seen:
                raise ValueError(f"layer {i} appears twice in a LayerwiseConfig")
            if (c.seed, c.fold) != (self.default.seed, self.default.fold):
                raise ValueError(f"layer {i}: seed/fold differ from the default's")
            seen.add(i)
        object.__setattr__(self, "window", check_window(self.window))  # numpy ints as int

    def __repr__(self) -> str:
        per = ", ".join(f"{i}: {c.policy}" for i, c in self.layers)
        return f"LayerwiseConfig({self.source}, window={self.window}, seed={self.seed}, layers={{{per}}})"

    @property
    def policy(self):
        """The policy map (``source``)."""
        return self.source

    @property
    def seed(self) -> int:
        return self.default.seed

    @property
    def fold(self) -> GDNFold:
        return self.default.fold

    @property
    def fold_cached(self) -> bool:
        return self.default.fold_cached

    @property
    def uses_sr(self) -> bool:
        """Some layer's casts draw random bits."""
        return self.default.uses_sr or any(c.uses_sr for _, c in self.layers)

    def for_layer(self, layer: int) -> StateConfig:
        """The :class:`StateConfig` of layer ``layer``.

        Raises:
            ValueError: ``layer`` is not one of the layers the map was resolved for.
        """
        for i, c in self.layers:
            if i == layer:
                return c
        raise ValueError(f"layer {layer} is not an SSM layer this policy map was resolved for "
                         f"(layers {[i for i, _ in self.layers]})")

