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

from .formats import FORMAT_NAMES, QuantSpec, parse_spec

POLICY_KINDS = ("fp32", "shared", "eager", "separate")

GRAMMAR = (
    "expected one of: 'fp32' | 'shared:F' | 'eager:F' | 'read:F/rec:G', where F and G are "
    f"one of {', '.join(FORMAT_NAMES)}, optionally followed by '+sr' "
    "(examples: 'shared:nvfp4+sr', 'read:nvfp4/rec:fp32', 'read:nvfp4/rec:fp16+sr')"
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
            except ValueError as e:
                raise ValueError(f"bad state policy {s!r}: {e}; {GRAMMAR}") from None

        if "," in text or not text:
            raise ValueError(f"bad state policy {s!r}; {GRAMMAR}")
        if text == "fp32":
            return cls("fp32", _FP32, _FP32)
        head, sep, rest = text.partition(":")
        if not sep:
            raise ValueError(f"bad state policy {s!r}; {GRAMMAR}")
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
                raise ValueError(f"bad state policy {s!r}; {GRAMMAR}")
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
