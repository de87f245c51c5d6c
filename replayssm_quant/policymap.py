"""Policy maps: state policies per layer, per head range or per decay bucket (issue 18).

A policy map assigns a :class:`~replayssm_quant.policy.StatePolicy` to every head of every SSM
layer. It is accepted wherever a policy string is (``replayssm-kl --policies``,
``state_policy(model, ...)``, lm-eval ``state=``) as a JSON file, a JSON object, or a compact
string, and parsed here, once, where it enters (:func:`parse_state_arg`); the adapters resolve
it against the model's layers (:meth:`PolicyMap.resolve`) into one configuration per layer.

JSON form (every key but ``default`` optional)::

    {"default": "read:nvfp4/rec:fp32",
     "layers": {"3": "shared:fp16", "0-1": "fp32"},          # layer index or inclusive range
     "heads":  {"4": {"0-1": "fp32", "2": "shared:bf16"}},   # layer -> head index/range
     "decay":  [{"min_decay": 0.99, "max_decay": 1.0, "policy": "read:fp8e4m3/rec:fp32"}],
     "name": "a label", "meta": {...}}                        # free-form, ignored

Compact form (no commas or spaces, so it fits lm-eval ``model_args`` and needs no shell quoting)::

    map:DEFAULT[@RULE...]     RULE := L<layers>=P | L<layers>H<heads>=P | D<min>[-<max>]=P

e.g. ``map:read:nvfp4/rec:fp32@L3=shared:fp16@L4H0-1=fp32@D0.99=read:fp8e4m3/rec:fp32``.
``str(map)`` is this canonical compact text (rules sorted), which parses back to an equal map.

Resolution, per head of each SSM layer, first match wins:

1. a ``heads`` rule naming the layer and head;
2. a ``layers`` rule naming the layer (the whole layer);
3. a ``decay`` bucket ``[min_decay, max_decay)`` containing the head's *mean decay*
   (``max_decay`` 1.0 includes 1.0);
4. ``default``.

Mean decay of a head: the mean over calibration tokens of its per-token decay
``a_t = exp(dt_t * A)`` (Mamba-2) or ``alpha_t = exp(g_t)`` (GDN), the ``mean`` column of
``docs/models/<model>-stats.json`` (all held-out KJV tokens, ``scripts/model_card_stats.py``).
Decays come from the run, not from the map (:func:`load_decay_stats`): the embedded models
carry theirs (``decay_stats.json`` beside the weights); for other models measure them with
:func:`replayssm_quant.adapters.measure_head_decay` or ``replayssm-attribute`` and pass the
file (``--decay-stats``, ``decay_stats=``).

Heads are the state's head axis: Mamba-2 heads, GDN *value* heads. All heads of a layer share
its flush schedule (one window L per layer); a layer cannot mix ``eager:`` and other kinds.

Errors name the bad value and what was expected: bad JSON, unknown keys, bad policies (with
where they sit), malformed or overlapping ranges, overlapping decay buckets, and, at
resolution, layers that are not SSM layers and head indices beyond a layer's heads.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .policy import GRAMMAR, HeadPolicy, StatePolicy

__all__ = ["IndexRange", "DecayRule", "PolicyMap", "parse_state_arg", "load_decay_stats",
           "MAP_PREFIX", "MAP_GRAMMAR", "JSON_KEYS"]

MAP_PREFIX = "map:"
JSON_KEYS = ("default", "layers", "heads", "decay", "name", "meta")
MAP_GRAMMAR = (
    "a policy map is a JSON file (*.json), a JSON object with keys "
    f"{', '.join(JSON_KEYS)} ('default' required), or the compact string "
    "'map:DEFAULT@L<layers>=P@L<layers>H<heads>=P@D<min>[-<max>]=P' "
    "(layers/heads: an index or an inclusive range 'a-b'; decay bounds in [0, 1]); "
    "policies: " + GRAMMAR
)

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_NUM = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e-?\d+)?"
_DECAY = re.compile(rf"^d({_NUM})(?:-({_NUM}))?$")
_LAYER_RULE = re.compile(r"^l(\d+(?:-\d+)?)(?:h(\d+(?:-\d+)?))?$")


@dataclass(frozen=True, order=True)
class IndexRange:
    """An inclusive range of layer or head indices ``lo..hi``; ``str`` gives ``"3"`` or ``"0-7"``."""

    lo: int
    hi: int

    def __post_init__(self):
        if not (isinstance(self.lo, int) and isinstance(self.hi, int)) or self.lo < 0 or self.hi < self.lo:
            raise ValueError(f"bad index range {self.lo!r}-{self.hi!r}: expected 0 <= lo <= hi")

    @classmethod
    def parse(cls, text, what: str = "index") -> "IndexRange":
        """``"3"``, ``"0-7"`` (or an int) -> range; ValueError naming the text otherwise."""
        if isinstance(text, int) and not isinstance(text, bool):
            text = str(text)
        m = _RANGE.match(text.strip()) if isinstance(text, str) else None
        if not m:
            raise ValueError(f"bad {what} {text!r}: expected an index like '3' or an inclusive "
                             "range like '0-7'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"bad {what} {text!r}: the range end {hi} is below its start {lo}")
        return cls(lo, hi)

    def __contains__(self, i: int) -> bool:
        return self.lo <= i <= self.hi

    def overlaps(self, other: "IndexRange") -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}-{self.hi}"


@dataclass(frozen=True)
class DecayRule:
    """Heads whose mean decay lies in ``[min_decay, max_decay)`` get ``policy``
    (``max_decay`` None: no upper bound; 1.0 includes 1.0, the largest decay there is)."""

    min_decay: float
    max_decay: float | None
    policy: StatePolicy

    def __post_init__(self):
        lo, hi = self.min_decay, self.max_decay
        if not (isinstance(lo, (int, float)) and math.isfinite(lo) and 0.0 <= lo <= 1.0):
            raise ValueError(f"bad decay bucket: min_decay must be a number in [0, 1], got {lo!r}")
        if hi is not None and not (isinstance(hi, (int, float)) and math.isfinite(hi) and lo < hi <= 1.0):
            raise ValueError(f"bad decay bucket: max_decay must be a number in (min_decay, 1] = "
                             f"({lo}, 1], got {hi!r}")
        object.__setattr__(self, "min_decay", float(lo))
        object.__setattr__(self, "max_decay", None if hi is None else float(hi))

    @property
    def upper(self) -> float:
        return math.inf if self.max_decay is None or self.max_decay == 1.0 else self.max_decay

    def contains(self, decay: float) -> bool:
        """``min_decay <= decay < max_decay`` (no upper bound for None or 1.0)."""
        return self.min_decay <= decay < self.upper

    def overlaps(self, other: "DecayRule") -> bool:
        return self.min_decay < other.upper and other.min_decay < self.upper

    def key(self) -> str:
        """The compact key ``d<min>[-<max>]``."""
        return f"D{self.min_decay!r}" + ("" if self.max_decay is None else f"-{self.max_decay!r}")


def _policy(text, where: str) -> StatePolicy:
    try:
        return StatePolicy.parse(text)
    except ValueError as e:
        raise ValueError(f"bad policy at {where}: {e}") from None


@dataclass(frozen=True)
class PolicyMap:
    """A parsed policy map (module docstring). Build it with :meth:`parse` / :meth:`from_dict` /
    :func:`parse_state_arg`; resolve it against a model with :meth:`resolve`.

    Attributes:
        default: the policy of every head no rule names.
        layers: ``((IndexRange, StatePolicy), ...)``, sorted, non-overlapping.
        heads: ``((layers IndexRange, heads IndexRange, StatePolicy), ...)``, sorted; no
            (layer, head) named twice.
        decay: ``(DecayRule, ...)``, sorted by ``min_decay``, non-overlapping.
        name: an optional label (not part of the canonical text or of equality).

    Raises:
        ValueError: overlapping layer ranges, head ranges or decay buckets (naming both).
    """

    default: StatePolicy
    layers: tuple = ()
    heads: tuple = ()
    decay: tuple = ()
    name: str | None = None

    def __post_init__(self):
        if not isinstance(self.default, StatePolicy):
            raise TypeError(f"PolicyMap.default must be a parsed StatePolicy, got {self.default!r}")
        layers = tuple(sorted(self.layers, key=lambda r: r[0]))
        heads = tuple(sorted(self.heads, key=lambda r: (r[0], r[1])))
        decay = tuple(sorted(self.decay, key=lambda r: (r.min_decay, r.upper)))
        for (a, _), (b, _) in zip(layers, layers[1:]):
            if a.overlaps(b):
                raise ValueError(f"policy map: layer ranges {a} and {b} overlap; name each layer once")
        for i, (la, ha, _) in enumerate(heads):
            for lb, hb, _ in heads[i + 1:]:
                if la.overlaps(lb) and ha.overlaps(hb):
                    raise ValueError(f"policy map: head ranges overlap: layers {la} heads {ha} and "
                                     f"layers {lb} heads {hb}; name each (layer, head) once")
        for a, b in zip(decay, decay[1:]):
            if a.overlaps(b):
                raise ValueError(f"policy map: decay buckets {a.key()[1:]} and {b.key()[1:]} "
                                 "overlap; give each decay one bucket")
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "decay", decay)

    def __eq__(self, other):
        return isinstance(other, PolicyMap) and str(self) == str(other)

    def __hash__(self):
        return hash(str(self))

    def __repr__(self) -> str:
        return f"PolicyMap({str(self)!r}" + ("" if self.name is None else f", name={self.name!r}") + ")"

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, obj, *, source: str = "policy map") -> "PolicyMap":
        """Parse the JSON object form (module docstring).

        Raises:
            ValueError: naming the bad key or value, where it sits and what was expected.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(obj).__name__}; {MAP_GRAMMAR}")
        unknown = [k for k in obj if k not in JSON_KEYS]
        if unknown:
            raise ValueError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                             f"expected {', '.join(JSON_KEYS)}")
        if "default" not in obj:
            raise ValueError(f"{source}: missing 'default' (the policy of every head no rule "
                             "names), e.g. {\"default\": \"read:nvfp4/rec:fp32\"}")
        default = _policy(obj["default"], f"{source} 'default'")
        layers = []
        lay = obj.get("layers", {})
        if not isinstance(lay, dict):
            raise ValueError(f"{source}: 'layers' must be an object {{\"3\": POLICY, \"0-1\": POLICY}}, "
                             f"got {lay!r}")
        for k, v in lay.items():
            layers.append((IndexRange.parse(k, f"layer index in {source} 'layers'"),
                           _policy(v, f"{source} 'layers' {k!r}")))
        heads = []
        hd = obj.get("heads", {})
        if not isinstance(hd, dict):
            raise ValueError(f"{source}: 'heads' must be an object {{\"3\": {{\"0-7\": POLICY}}}}, got {hd!r}")
        for k, inner in hd.items():
            lr = IndexRange.parse(k, f"layer index in {source} 'heads'")
            if not isinstance(inner, dict) or not inner:
                raise ValueError(f"{source}: 'heads' {k!r} must be a non-empty object of head "
                                 f"ranges {{\"0-7\": POLICY}}, got {inner!r}")
            for hk, v in inner.items():
                heads.append((lr, IndexRange.parse(hk, f"head index in {source} 'heads' {k!r}"),
                              _policy(v, f"{source} 'heads' {k!r} {hk!r}")))
        decay = []
        dc = obj.get("decay", [])
        if not isinstance(dc, list):
            raise ValueError(f"{source}: 'decay' must be a list of {{\"min_decay\": x, \"max_decay\": y, "
                             f"\"policy\": P}}, got {dc!r}")
        for i, r in enumerate(dc):
            if not isinstance(r, dict) or "policy" not in r or "min_decay" not in r or \
                    set(r) - {"min_decay", "max_decay", "policy"}:
                raise ValueError(f"{source}: 'decay'[{i}] must be {{\"min_decay\": x, \"max_decay\": y "
                                 f"(optional), \"policy\": P}}, got {r!r}")
            decay.append(DecayRule(r["min_decay"], r.get("max_decay"),
                                   _policy(r["policy"], f"{source} 'decay'[{i}]")))
        name = obj.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{source}: 'name' must be a string, got {name!r}")
        return cls(default, tuple(layers), tuple(heads), tuple(decay), name)

    @classmethod
    def parse_compact(cls, text: str) -> "PolicyMap":
        """Parse ``map:DEFAULT@RULE...`` (module docstring; case-insensitive).

        Raises:
            ValueError: naming the bad rule and giving the grammar; where a file name (a
                ``.json`` name or an existing file) stands for the default policy, saying
                that a map file is given by its path alone, without ``map:``.
        """
        s = text.strip()
        if not s.lower().startswith(MAP_PREFIX):
            raise ValueError(f"bad policy map {text!r}: expected it to start with {MAP_PREFIX!r}; {MAP_GRAMMAR}")
        if "," in s or any(c.isspace() for c in s):
            raise ValueError(f"bad policy map {text!r}: no commas or spaces allowed; {MAP_GRAMMAR}")
        parts = s[len(MAP_PREFIX):].split("@")
        try:
            default = _policy(parts[0], f"{text!r} (default)")
        except ValueError:
            if parts[0].lower().endswith(".json") or os.path.isfile(parts[0]):
                raise ValueError(f"bad policy map {text!r}: {parts[0]!r} is a file name, not a "
                                 f"policy; a policy map file is given by its path alone, "
                                 f"without {MAP_PREFIX!r} (here {parts[0]!r})") from None
            raise
        layers, heads, decay = [], [], []
        for rule in parts[1:]:
            key, eq, pol = rule.partition("=")
            if not eq:
                raise ValueError(f"bad rule {rule!r} in policy map {text!r}: expected KEY=POLICY; {MAP_GRAMMAR}")
            typed, key = key, key.lower()
            p = _policy(pol, f"rule {rule!r} of {text!r}")
            m = _LAYER_RULE.match(key)
            if m:
                lr = IndexRange.parse(m.group(1), f"layer range in rule {rule!r}")
                if m.group(2) is None:
                    layers.append((lr, p))
                else:
                    heads.append((lr, IndexRange.parse(m.group(2), f"head range in rule {rule!r}"), p))
                continue
            m = _DECAY.match(key)
            if m:
                decay.append(DecayRule(float(m.group(1)), None if m.group(2) is None else float(m.group(2)), p))
                continue
            raise ValueError(f"bad rule key {typed!r} in policy map {text!r}: expected L<layers>, "
                             f"L<layers>H<heads> or D<min>[-<max>]; {MAP_GRAMMAR}")
        return cls(default, tuple(layers), tuple(heads), tuple(decay))

    # ------------------------------------------------------------------ text
    def __str__(self) -> str:
        rules = [f"L{r}={p}" for r, p in self.layers]
        rules += [f"L{lr}H{hr}={p}" for lr, hr, p in self.heads]
        rules += [f"{d.key()}={d.policy}" for d in self.decay]
        return MAP_PREFIX + "@".join([str(self.default), *rules])

    @property
    def canonical(self) -> str:
        """The canonical compact text, ``str(self)`` (parses back to an equal map)."""
        return str(self)

    def to_dict(self) -> dict:
        """The JSON object form (``from_dict(to_dict())`` equals ``self``)."""
        out = {"default": str(self.default)}
        if self.name is not None:
            out["name"] = self.name
        if self.layers:
            out["layers"] = {str(r): str(p) for r, p in self.layers}
        if self.heads:
            hd: dict = {}
            for lr, hr, p in self.heads:
                hd.setdefault(str(lr), {})[str(hr)] = str(p)
            out["heads"] = hd
        if self.decay:
            out["decay"] = [{"min_decay": d.min_decay, **({} if d.max_decay is None else
                                                           {"max_decay": d.max_decay}),
                             "policy": str(d.policy)} for d in self.decay]
        return out

    @property
    def is_uniform(self) -> bool:
        """No rules: every head gets ``default``."""
        return not (self.layers or self.heads or self.decay)

    @property
    def uses_sr(self) -> bool:
        """Some policy of the map draws random bits (whether or not a head resolves to it)."""
        return any(p.uses_sr for p in self.policies())

    @property
    def single_checkpoint(self) -> bool:
        """Every policy of the map keeps one checkpoint (R is A everywhere)."""
        return all(p.single_checkpoint for p in self.policies())

    @property
    def uses_decay(self) -> bool:
        """Some rule needs head decays to resolve."""
        return bool(self.decay)

    def policies(self) -> list[StatePolicy]:
        """Every policy the map names (default first, no repeats)."""
        out = [self.default]
        for p in [p for _, p in self.layers] + [p for _, _, p in self.heads] + [d.policy for d in self.decay]:
            if p not in out:
                out.append(p)
        return out

    # ------------------------------------------------------------------ resolution
    def head_policies(self, ssm_heads, decay=None) -> dict[int, list[StatePolicy]]:
        """The :class:`StatePolicy` of every head of every SSM layer (module docstring,
        "Resolution").

        Args:
            ssm_heads: ``{layer index: number of heads}`` of the model's SSM layers.
            decay: ``{layer index: per-head mean decays}`` (floats in [0, 1]); needed only when
                the map has decay buckets (see :func:`load_decay_stats`).

        Returns:
            ``{layer: [StatePolicy per head]}`` for every layer of ``ssm_heads``.

        Raises:
            ValueError: a layer index or range naming no SSM layer / past the last one (the
                message lists the SSM layers), a head index beyond a layer's heads, decay buckets
                without decays, or decays of the wrong length.
        """
        ssm = {int(i): int(h) for i, h in dict(ssm_heads).items()}
        if not ssm:
            raise ValueError("the model has no SSM layers to resolve a policy map against")
        names = ", ".join(f"{i} ({h} heads)" for i, h in sorted(ssm.items()))
        last = max(ssm)

        def layers_of(r: IndexRange, what: str) -> list[int]:
            if r.lo == r.hi and r.lo not in ssm:
                raise ValueError(f"policy map {what} names layer {r.lo}, which is not an SSM layer of "
                                 f"this model; SSM layers: {names}")
            if r.hi > last:
                raise ValueError(f"policy map {what} range {r} goes past the last SSM layer {last}; "
                                 f"SSM layers: {names}")
            got = [i for i in sorted(ssm) if i in r]
            if not got:
                raise ValueError(f"policy map {what} range {r} holds no SSM layer; SSM layers: {names}")
            return got

        if self.decay:
            if decay is None:
                raise ValueError("policy map has decay buckets but no head decays were given: pass "
                                 "decay_stats (a JSON file as written by replayssm-attribute, or "
                                 "docs/models/<model>-stats.json), or measure them with "
                                 "replayssm_quant.adapters.measure_head_decay")
            try:
                decay = {int(i): [float(x) for x in v] for i, v in dict(decay).items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"head decays must map layer indices to lists of floats in "
                                 f"[0, 1] ({e})") from None
            for i, h in ssm.items():
                if i not in decay or len(decay[i]) != h:
                    got = "none" if i not in decay else f"{len(decay[i])}"
                    raise ValueError(f"head decays for layer {i}: expected {h} values (one per head), "
                                     f"got {got}; the decay stats do not match this model")
                for hd, d in enumerate(decay[i]):
                    if not (0.0 <= d <= 1.0):  # NaN too: it would match no bucket silently
                        raise ValueError(f"head decays: layer {i} head {hd} has mean decay {d}, "
                                         "expected a value in [0, 1]")
        out: dict[int, list[StatePolicy]] = {}
        layer_rule: dict[int, StatePolicy] = {}
        for r, p in self.layers:
            for i in layers_of(r, "'layers' entry"):
                layer_rule[i] = p
        head_rule: dict[tuple[int, int], StatePolicy] = {}
        for lr, hr, p in self.heads:
            for i in layers_of(lr, "'heads' entry"):
                if hr.hi >= ssm[i]:
                    raise ValueError(f"policy map 'heads' names heads {hr} of layer {i}, which has "
                                     f"{ssm[i]} heads (0-{ssm[i] - 1})")
                for h in range(hr.lo, hr.hi + 1):
                    head_rule[(i, h)] = p
        for i, H in sorted(ssm.items()):
            pols = []
            for h in range(H):
                p = head_rule.get((i, h)) or layer_rule.get(i)
                if p is None:
                    for d in self.decay:
                        if d.contains(decay[i][h]):
                            p = d.policy
                            break
                pols.append(p or self.default)
            out[i] = pols
        return out

    def resolve(self, ssm_heads, decay=None) -> dict:
        """Per-layer policies: ``{layer: StatePolicy | HeadPolicy}`` -- the plain policy where
        all of a layer's heads agree (so a map that overrides nothing runs exactly the uniform
        code path), else a :class:`~replayssm_quant.policy.HeadPolicy` of head groups.

        Arguments and errors as :meth:`head_policies`; also ValueError for a layer that mixes
        ``eager:`` and non-eager heads (naming the layer).
        """
        out = {}
        for i, pols in self.head_policies(ssm_heads, decay).items():
            try:
                out[i] = HeadPolicy.from_heads(pols)
            except ValueError as e:
                raise ValueError(f"policy map, layer {i}: {e}") from None
        return out


def _read_json_file(path: str, what: str):
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file {path!r} not found (expected a JSON file)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {path!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise ValueError(f"cannot read {what} file {path!r}: {e}") from None


def parse_state_arg(value) -> "StatePolicy | PolicyMap":
    """Parse a state argument where it enters: a policy string, a policy map (compact
    ``map:...`` string, JSON text ``{...}``, path to a ``.json`` file, or a dict), or an
    already parsed StatePolicy / PolicyMap (returned as is).

    A map file's ``name`` defaults to the file's stem.

    Raises:
        ValueError: naming the bad value and the grammar (policy grammar for plain strings,
            :data:`MAP_GRAMMAR` for maps).
    """
    if isinstance(value, (StatePolicy, PolicyMap)):
        return value
    if isinstance(value, dict):
        return PolicyMap.from_dict(value)
    if not isinstance(value, (str, os.PathLike)):
        return StatePolicy.parse(value)  # raises with the grammar
    text = os.fspath(value).strip()
    if text.lower().startswith(MAP_PREFIX):
        return PolicyMap.parse_compact(text)
    if text.startswith(("{", "[")):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"bad policy map JSON {text[:80]!r}: {e}; {MAP_GRAMMAR}") from None
        return PolicyMap.from_dict(obj)
    if text.lower().endswith(".json") or isinstance(value, os.PathLike):
        obj = _read_json_file(text, "policy map")
        m = PolicyMap.from_dict(obj, source=f"policy map {text!r}")
        if m.name is None:
            m = PolicyMap(m.default, m.layers, m.heads, m.decay, Path(text).stem)
        return m
    return StatePolicy.parse(text)


def load_decay_stats(stats) -> dict[int, tuple[float, ...]]:
    """Per-head mean decays ``{layer: (decay of head 0, head 1, ...)}`` from ``stats``: a path
    to a JSON file or its parsed object, either ``{"decays": [{"layer": i, "head": h, "mean":
    d}, ...]}`` (``docs/models/<model>-stats.json``, ``replayssm-attribute``'s ``decay.json``)
    or ``{"<layer>": [d, ...]}``; or such a dict already parsed.

    Raises:
        ValueError: unreadable file, another layout, missing or repeated heads, or a decay
            outside [0, 1] (naming it).
    """
    src = "decay stats"
    if isinstance(stats, (str, os.PathLike)):
        src = f"decay stats {os.fspath(stats)!r}"
        stats = _read_json_file(os.fspath(stats), "decay stats")
    if isinstance(stats, dict) and "decays" in stats:
        rows = stats["decays"]
        per: dict[int, dict[int, float]] = {}
        try:
            for r in rows:
                li, h, d = int(r["layer"]), int(r["head"]), float(r["mean"])
                if h in per.setdefault(li, {}):
                    raise ValueError(f"{src}: layer {li} head {h} appears twice")
                per[li][h] = d
        except (KeyError, TypeError) as e:
            raise ValueError(f"{src}: every entry of 'decays' needs 'layer', 'head' and 'mean' ({e})") from None
        except ValueError as e:
            if str(e).startswith(src):
                raise
            raise ValueError(f"{src}: an entry of 'decays' is not numbers ({e})") from None
        out = {}
        for li, hs in per.items():
            if sorted(hs) != list(range(len(hs))):
                raise ValueError(f"{src}: layer {li} has heads {sorted(hs)}, expected 0..{len(hs) - 1}")
            out[li] = tuple(hs[h] for h in range(len(hs)))
    elif isinstance(stats, dict):
        try:
            out = {int(k): tuple(float(x) for x in v) for k, v in stats.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{src}: expected {{\"decays\": [{{\"layer\", \"head\", \"mean\"}}]}} or "
                             f"{{\"<layer>\": [decays]}}, got keys {list(stats)[:5]}") from None
    else:
        raise ValueError(f"{src}: expected a JSON object, got {type(stats).__name__}")
    for li, v in out.items():
        for h, d in enumerate(v):
            if not (0.0 <= d <= 1.0):
                raise ValueError(f"{src}: layer {li} head {h} has mean decay {d}, expected a value in [0, 1]")
    return out
