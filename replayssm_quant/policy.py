"""State precision policies: one string per run, e.g. ``read:nvfp4/rec:fp16+sr``.

Grammar (DESIGN.md section 3; no commas, so a policy fits lm-eval ``model_args``)::

    policy := "fp32"                  reference: one FP32 checkpoint, no rounding
            | "shared:" F             one checkpoint in F for reads and updates
            | "eager:" F              conventional decoding: round the state after every token
            | "read:" F "/rec:" G     read copy R in F, recurrence anchor A in G
    F, G   := fp32 | bf16 | fp16 | fp8e4m3 | fp8e5m2 | nvfp4 | mxfp8 | mxfp4, optionally "+sr"

Parsing is case-insensitive and ignores surrounding whitespace. Canonicalisation (what
``str()`` gives back): lower case; ``shared:fp32`` and ``read:fp32/rec:fp32`` (with or without
``+sr``, which is a no-op on FP32) are the same computation as ``fp32`` and print as ``fp32``.
``eager:fp32`` stays distinct: it names the conventional step-by-step code path (identical
values up to float reassociation), which is useful as a cross-check.
"""

from __future__ import annotations

from dataclasses import dataclass

from .formats import FORMAT_NAMES, QuantSpec, SpecError, parse_spec, scale_modes_text

POLICY_KINDS = ("fp32", "shared", "eager", "separate")

GRAMMAR = (
    "expected one of: 'fp32' | 'shared:F' | 'eager:F' | 'read:F/rec:G', where F and G are "
    f"one of {', '.join(FORMAT_NAMES)}, optionally followed by '+sr' "
    f"and, for block-scaled formats, a scale mode ({scale_modes_text()}) "
    "(examples: 'shared:nvfp4+sr', 'read:nvfp4/rec:fp32', 'read:nvfp4/rec:fp16+sr', "
    "'shared:nvfp4+up+sr')"
)

_FP32 = QuantSpec("fp32")


@dataclass(frozen=True)
class StatePolicy:
    """A parsed state precision policy.

    Attributes:
        kind: ``"fp32"``, ``"shared"``, ``"eager"`` or ``"separate"``.
        read: format of the read copy R (for ``shared``/``eager``/``fp32`` the read copy *is*
            the anchor, so ``read == rec``).
        rec: format of the recurrence anchor A.
    """

    kind: str
    read: QuantSpec
    rec: QuantSpec

    def __post_init__(self):
        if self.kind not in POLICY_KINDS:
            raise ValueError(f"policy kind {self.kind!r} not one of {POLICY_KINDS}")
        if self.kind != "separate" and self.read != self.rec:
            raise ValueError(f"policy kind {self.kind!r} needs read == rec, got {self.read}, {self.rec}")

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, s: "str | StatePolicy") -> "StatePolicy":
        """Parse a policy string (see the module docstring for the grammar).

        Raises:
            ValueError: naming the bad string and listing the grammar.
        """
        if isinstance(s, StatePolicy):
            return s
        if not isinstance(s, str):
            raise ValueError(f"state policy must be a string, got {type(s).__name__} {s!r}; {GRAMMAR}")
        text = s.strip().lower()

        def spec(token: str) -> QuantSpec:
            try:
                return parse_spec(token)
            except SpecError as e:  # what is wrong; GRAMMAR lists the formats once
                raise ValueError(f"bad state policy {s!r}: {e.what}; {GRAMMAR}") from None

        if "," in text or not text:
            raise ValueError(f"bad state policy {s!r}; {GRAMMAR}")
        if text == "fp32":
            return cls("fp32", _FP32, _FP32)
        head, sep, rest = text.partition(":")
        if not sep:
            raise ValueError(f"bad state policy {s!r}; {GRAMMAR}")
        if head == "map":  # (policymap.MAP_PREFIX; this module is below policymap)
            raise ValueError(f"bad state policy {s!r}: a policy map ('map:...') sets the "
                             "policies of a whole model's layers and heads (state_policy, "
                             "replayssm-kl --policies); one layer's state takes one policy, "
                             f"e.g. 'read:nvfp4/rec:fp32'; {GRAMMAR}")
        if head not in ("shared", "eager", "read"):
            raise ValueError(f"bad state policy {s!r}: unknown kind {head + ':'!r} (the kinds "
                             f"are 'shared:', 'eager:' and 'read:', or 'fp32' alone); {GRAMMAR}")
        if head in ("shared", "eager"):
            if "/" in rest or ":" in rest:
                raise ValueError(f"bad state policy {s!r}; {GRAMMAR}")
            f = spec(rest)
            if head == "shared" and f.is_identity:
                return cls("fp32", _FP32, _FP32)
            return cls(head, f, f)
        if head == "read":
            read_tok, sep2, rec_part = rest.partition("/")
            if not sep2 or not rec_part.startswith("rec:"):
                spec(read_tok)  # an unknown read format first: the more specific reason
                raise ValueError(f"bad state policy {s!r}: 'read:F' needs the anchor's format "
                                 f"after it, 'read:F/rec:G' (e.g. 'read:{read_tok}/rec:fp32'); "
                                 f"{GRAMMAR}")
            f, g = spec(read_tok), spec(rec_part[len("rec:"):])
            if f.is_identity and g.is_identity:
                return cls("fp32", _FP32, _FP32)
            return cls("separate", f, g)
        raise ValueError(f"bad state policy {s!r}; {GRAMMAR}")

    def __str__(self) -> str:
        if self.kind == "fp32":
            return "fp32"
        if self.kind in ("shared", "eager"):
            return f"{self.kind}:{self.rec}"
        return f"read:{self.read}/rec:{self.rec}"

    # ------------------------------------------------------------------ helpers
    @property
    def canonical(self) -> str:
        """The canonical string, ``str(self)``."""
        return str(self)

    @property
    def single_checkpoint(self) -> bool:
        """True when R is the anchor itself (``fp32``, ``shared``, ``eager``): one cast per flush."""
        return self.kind != "separate"

    @property
    def is_eager(self) -> bool:
        """Conventional decoding: the state objects force window L = 1."""
        return self.kind == "eager"

    @property
    def uses_sr(self) -> bool:
        """Whether a cast under this policy draws random bits (a rounded copy with ``+sr``);
        if not, the seed changes nothing."""
        return any(spec.sr and not spec.is_identity for spec in (self.read, self.rec))


@dataclass(frozen=True)
class HeadPolicy:
    """Per-head policies of ONE layer: contiguous head groups, each under its own
    :class:`StatePolicy`, sharing the layer's flush schedule (one window L per layer).

    Build it with :meth:`from_heads` (which returns a plain :class:`StatePolicy` when every head
    has the same one, so a uniform assignment runs exactly the uniform code path).

    Attributes:
        groups: ``((start, stop, policy), ...)``: half-open head ranges ``[start, stop)`` in
            order, covering heads ``0 .. heads - 1`` without gaps, at least two groups, no two
            neighbours with the same policy. Heads are the state's head axis (Mamba-2 heads;
            GDN *value* heads).

    Casts (``replay.core.cast_checkpoints``) round each group's slice of the ``[B, H, V, K]``
    state with its own formats and the same per-(layer, sequence, head, flush, copy) random
    streams as a uniform policy would use for those heads, so a head's stored values do not
    depend on the formats of the other heads.

    Raises:
        ValueError: groups that do not tile the heads, a single group, or a mix of ``eager:``
            and non-eager policies (eager runs with window 1, the others with the layer's L).
    """

    groups: tuple

    def __post_init__(self):
        groups = tuple((int(a), int(b), p) for a, b, p in self.groups)
        object.__setattr__(self, "groups", groups)
        if len(groups) < 2:
            raise ValueError(f"a HeadPolicy needs at least two head groups, got {len(groups)}; "
                             "use the StatePolicy itself for a uniform layer")
        at = 0
        for a, b, p in groups:
            if not isinstance(p, StatePolicy):
                raise TypeError(f"HeadPolicy groups hold parsed StatePolicy values, got "
                                f"{type(p).__name__} {p!r}")
            if a != at or b <= a:
                raise ValueError(f"HeadPolicy groups must tile the heads in order from 0, got "
                                 f"{[(a_, b_) for a_, b_, _ in groups]}")
            at = b
        if len({p.is_eager for _, _, p in groups}) > 1:
            desc = ", ".join(f"heads {a}-{b - 1}: {p}" for a, b, p in groups)
            raise ValueError(f"a layer cannot mix eager: and non-eager policies across its heads "
                             f"({desc}): all heads of a layer share one flush schedule (eager "
                             "runs with window 1); give the whole layer one kind")

    @classmethod
    def from_heads(cls, policies) -> "StatePolicy | HeadPolicy":
        """The layer policy of per-head :class:`StatePolicy` values (a sequence, head order):
        the policy itself when all are equal, else a :class:`HeadPolicy` of the runs of equal
        neighbours.

        Raises:
            ValueError: no heads, or an eager/non-eager mix (see the class docstring).
        """
        policies = [require_policy(p) for p in policies]
        if not policies:
            raise ValueError("a layer needs at least one head")
        if all(p == policies[0] for p in policies):
            return policies[0]
        groups, start = [], 0
        for h in range(1, len(policies) + 1):
            if h == len(policies) or policies[h] != policies[start]:
                groups.append((start, h, policies[start]))
                start = h
        return cls(tuple(groups))

    @property
    def kind(self) -> str:
        """``"heads"``."""
        return "heads"

    @property
    def heads(self) -> int:
        """Number of heads covered."""
        return self.groups[-1][1]

    def head_policies(self) -> list:
        """The :class:`StatePolicy` of every head, in order."""
        return [p for a, b, p in self.groups for _ in range(a, b)]

    @property
    def is_eager(self) -> bool:
        """All groups are ``eager:`` (mixes are refused at construction)."""
        return self.groups[0][2].is_eager

    @property
    def single_checkpoint(self) -> bool:
        """Every group keeps one checkpoint (R is A for the whole layer)."""
        return all(p.single_checkpoint for _, _, p in self.groups)

    @property
    def uses_sr(self) -> bool:
        """Some group draws random bits."""
        return any(p.uses_sr for _, _, p in self.groups)

    def __str__(self) -> str:
        return "heads[" + "|".join(f"{a if b == a + 1 else f'{a}-{b - 1}'}={p}"
                                   for a, b, p in self.groups) + "]"

    def __repr__(self) -> str:
        return f"HeadPolicy({self})"

    @property
    def canonical(self) -> str:
        """``str(self)``: ``heads[0-1=fp32|2=read:nvfp4/rec:fp32|3=shared:fp16]`` (a label;
        not parsed)."""
        return str(self)


def require_policy(policy) -> "StatePolicy":
    """``policy`` if it is a parsed :class:`~replayssm_quant.policy.StatePolicy`; inner
    functions never parse strings (``StatePolicy.parse`` / ``StateConfig.build`` at the edges).

    Raises:
        TypeError: naming what was passed and where to parse it.
    """
    if not isinstance(policy, StatePolicy):
        raise TypeError(f"expected a parsed StatePolicy, got {type(policy).__name__} {policy!r}; "
                        "parse it where it enters (StatePolicy.parse or StateConfig.build)")
    return policy


def require_layer_policy(policy) -> "StatePolicy | HeadPolicy":
    """``policy`` if it is a parsed :class:`StatePolicy` or :class:`HeadPolicy` (what one
    layer's casts accept; see :func:`require_policy`).

    Raises:
        TypeError: naming what was passed.
    """
    if not isinstance(policy, (StatePolicy, HeadPolicy)):
        raise TypeError(f"expected a parsed StatePolicy or HeadPolicy, got {type(policy).__name__} "
                        f"{policy!r}; parse it where it enters (StateConfig.build, or "
                        "replayssm_quant.policymap for per-layer/per-head maps)")
    return policy
