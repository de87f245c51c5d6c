"""Run real Hugging Face hybrid models under a ReplaySSM state policy.

``apply_state_policy(model, policy, window=16, seed=0)`` swaps the recurrent-state handling of
every SSM mixer of a transformers model for ReplaySSM state under ``policy`` (DESIGN.md
section 3), leaving weights, attention layers and the KV cache alone::

    from replayssm_quant.adapters import apply_state_policy, state_policy

    handle = apply_state_policy(model, "read:nvfp4/rec:fp16+sr", window=16, seed=0)
    model.generate(ids, max_new_tokens=64)          # step-by-step decoding
    out = model(prompt, use_cache=True)             # prefill: exact scan, cast as flush 0
    out = model(segment, past_key_values=out.past_key_values, use_cache=True)  # emulation
    handle.remove()

    with state_policy(model, "shared:nvfp4+sr"):    # the same as a context manager
        ...

What a call does, per SSM layer (the state lives on the layer's cache entry, next to the conv
state and the attention KV cache, so segments of a document carry it by passing the cache):

* first call on a cache (no state yet): ``prefill=True`` (default) runs the exact chunked
  scan in FP32 (float64 for a float64 model) and casts its final state as flush 0;
  ``prefill=False`` starts from the zero state and treats the call like any later call.
* later call with 1 token: one ReplaySSM step (flush at h == L).
* later call with T > 1 tokens: teacher-forced emulation window by window, equal to T steps.
* ``model.generate(use_cache=False)`` with ``prefill=True`` raises ``ValueError``: every token
  would be a fresh exact prefill, so the policy would never act (FP32-state decoding).

Conv states, projections, norms and the output projection are computed by the adapter in
plain torch with the mixer's own weights and norm modules (never the GPU-only fla /
causal_conv1d kernels that transformers may pick, so the CPU path works with fla installed).
Under ``fp32`` the patched model reproduces the unpatched model's logits (teacher-forced and
``generate``) to float reassociation.

Decisions of 2026-12-01 (issue 12; docs/adapters.md):

* **Sequence ids.** Stochastic-rounding streams are keyed by (seed, layer, sequence id, head,
  flush index, copy). ``handle.sequence_ids`` (one int in [0, 2^20) per batch row), when set,
  wins. Otherwise each row's id is derived from its own content on the first call of a fresh
  cache: :func:`sequence_id` (CRC-32 folded to 20 bits) of the row's unpadded ``input_ids``
  (positions where the 2-D ``attention_mask`` is 1), seen by a forward pre-hook on the patched
  model. The same request therefore draws the same bits alone or anywhere in a batch, left-
  or right-padded; identical rows draw identical bits. A first call that shows no token ids
  (``inputs_embeds``, or a call into a submodule that bypasses the patched model) under a
  policy with stochastic rounding raises ``ValueError`` asking for ``handle.sequence_ids``; RTN
  policies never draw bits and use id 0.
* **dt limit** (Mamba-2 family): one rule, :class:`DtLimit`, on every call (prefill, emulation,
  steps): ``"decode"`` (default; no clamp, the model's decode step) or ``"clamp"`` (the
  model's ``time_step_limit`` everywhere, as its chunked scan does). ``handle.dt_limit``;
  a cache keeps the rule its state was created with.
* **Padding.** On the first call of a fresh cache with ``prefill=True`` a padded position
  (2-D ``attention_mask`` 0, left or right padding) is a no-op for the row's state and its
  conv state ends on the row's last real inputs (:mod:`.conv`), so a padded row's prefill
  state, logits at real positions and later decode steps equal the row run alone. Later calls
  (teacher-forced emulation, and every call with ``prefill=False``) count tokens in windows of
  L for the whole batch, so a padded position would shift that row's flushes: a mask with
  padding there raises ``ValueError`` naming the rows.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import types
import zlib

import torch

from ..philox import STREAM_FIELDS, as_int
from ..config import GDNFold, LayerwiseConfig, StateConfig
from ..policy import StatePolicy
from ..policymap import PolicyMap, load_decay_stats, parse_state_arg
from ..capabilities import check_allocation
from ..replay.window import _check_window_matrices
from . import gdn as _gdn
from . import mamba2 as _mamba2
from .mamba2 import DtLimit
from .state import LayerState, prefill_scan, state_dims

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "StatePolicyHandle",
    "apply_state_policy",
    "state_policy",
    "find_ssm_mixers",
    "architecture_of",
    "LayerState",
    "DtLimit",
    "SEQ_ID_BITS",
    "sequence_id",
    "content_sequence_ids",
    "measure_head_decay",
    "DECAY_STATS_FILE",
]

#: File name of a model directory's per-head decay statistics (the embedded models carry one;
#: :mod:`replayssm_quant.policymap` "Mean decay"), used to resolve decay buckets of policy maps
#: when no ``decay_stats`` is given.
DECAY_STATS_FILE = "decay_stats.json"
#: how one-token calls run (``apply_state_policy(decode=...)``): the window form (default) or
#: the decode state objects and their kernels
DECODE_MODES = ("window", "serving")

#: model_type -> family. ``*_text`` variants (text-only configs of multimodal models) map to
#: the same entry.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "mamba2": "mamba2",
    "nemotron_h": "mamba2",
    "falcon_h1": "mamba2",
    "bamba": "mamba2",
    "granitemoehybrid": "mamba2",
    "zamba2": "mamba2",
    "qwen3_5": "gdn",
    "qwen3_5_moe": "gdn",
    "qwen3_next": "gdn",
    "olmo_hybrid": "gdn",
}

_STATE_ATTR = "replayssm"  # attribute of a cache layer holding its LayerState
_DT_ATTR = "replayssm_dt_limit"  # attribute of a cache layer: the DtLimit its state was made with
_ORIG_ATTR = "_replayssm_orig_forward"

#: Width of the sequence field of a stochastic-rounding stream key (philox.STREAM_FIELDS):
#: sequence ids are ints in [0, 2^SEQ_ID_BITS).
SEQ_ID_BITS: int = dict(STREAM_FIELDS)["sequence"]


def sequence_id(tokens) -> int:
    """Stable SR sequence id of one token row (DESIGN.md section 3, "Stochastic rounding
    randomness ... keyed by sequence"): CRC-32 of the tokens as little-endian int64 bytes,
    folded to :data:`SEQ_ID_BITS` (20) bits.

    Args:
        tokens: a sequence of ints or a 1-D integer tensor (the row's real tokens, no padding).

    Returns:
        an int in ``[0, 2^20)``; equal rows give equal ids, wherever they sit in a batch.
    """
    data = torch.as_tensor(list(tokens) if not isinstance(tokens, torch.Tensor) else tokens,
                           dtype=torch.int64).cpu().reshape(-1).numpy().astype("<i8").tobytes()
    return zlib.crc32(data) & ((1 << SEQ_ID_BITS) - 1)


def content_sequence_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Content-keyed SR sequence ids of a batch (the default when ``handle.sequence_ids`` is
    None; DESIGN.md section 3).

    Args:
        input_ids: integer ``[B, T]``.
        attention_mask: ``[B, T]`` (1 real token, 0 padding) or None (every position real).

    Returns:
        int64 ``[B]`` on the CPU: :func:`sequence_id` of each row's real tokens.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
    ids = input_ids.detach().cpu()
    mask = None
    if attention_mask is not None and attention_mask.dim() == 2:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match "
                             f"input_ids shape {tuple(input_ids.shape)}")
        mask = attention_mask.detach().cpu().bool()
    out = [sequence_id(row if mask is None else row[mask[b]]) for b, row in enumerate(ids)]
    return torch.tensor(out, dtype=torch.int64)


class UnsupportedArchitectureError(ValueError):
    """The model is not a supported hybrid architecture (or has no SSM layers)."""


def architecture_of(model) -> str:
    """The model's ``model_type`` with a ``_text`` suffix removed."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None) or type(model).__name__
    return mt[: -len("_text")] if mt.endswith("_text") else mt


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def find_ssm_mixers(model) -> list[tuple[str, torch.nn.Module, str]]:
    """``(module name, mixer, family)`` for every supported SSM mixer of ``model``.

    Raises:
        UnsupportedArchitectureError: unsupported ``model_type`` (the message lists the
            supported ones) or a supported one without SSM layers.
    """
    arch = architecture_of(model)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {arch!r} is not supported by replayssm_quant.adapters; supported "
            f"architectures (model_type): {_supported_list()}"
        )
    found = []
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls in _mamba2.MAMBA2_MIXERS:
            found.append((name, mod, "mamba2"))
        elif cls in _gdn.GDN_MIXERS:
            found.append((name, mod, "gdn"))
    if not found:
        raise UnsupportedArchitectureError(
            f"model of type {arch!r} has no SSM (Mamba-2 / Gated DeltaNet) layers to put under a "
            f"state policy; supported architectures: {_supported_list()}"
        )
    return found


class StatePolicyHandle:
    """What :func:`apply_state_policy` returns: the settings of a patched model.

    Attributes (may be changed between documents; a state already on a cache keeps the
    settings it was created with):
        config: the parsed :class:`~replayssm_quant.config.StateConfig` states are created
            with (change it with :meth:`set_policy`); ``policy``, ``seed`` and ``gdn_fold``
            read from it.
        window: the window L asked for (``config.window`` is 1 under ``eager:`` policies).
        prefill: see the module docstring.
        sequence_ids: None (default: content-keyed ids, :func:`content_sequence_ids`, of the
            first call on a fresh cache) or one int in [0, 2^20) per batch row, keying SR
            streams; explicit ids win.
        gdn_fold: :class:`~replayssm_quant.config.GDNFold` (``RECOMPUTE``, the DESIGN.md
            default, or ``CACHED``, the studied unstable variant).
        dt_limit: :class:`DtLimit` of the Mamba-2 family (``str(handle.dt_limit)`` is
            ``"decode"`` or ``"clamp"``, for run manifests); assign a member or its name.
        decay_stats: where the per-head mean decays of decay-bucket policy maps come from
            (None: the model directory's ``decay_stats.json`` if it has one).

    Under a policy map ``config`` is a :class:`~replayssm_quant.config.LayerwiseConfig`
    (one :class:`~replayssm_quant.config.StateConfig` per SSM layer, resolved once when the
    map is set) and ``policy`` the :class:`~replayssm_quant.policymap.PolicyMap`.
    """

    def __init__(self, model, policy, window, seed, prefill, gdn_fold, sequence_ids,
                 dt_limit="decode", decay_stats=None, decode="window"):
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        self.decode = decode
        self.model = model
        self.mixers = find_ssm_mixers(model)
        self.decay_stats = decay_stats
        self._decays = None  # loaded decay stats (cache)
        self._decay_recorder: dict | None = None  # measure_head_decay's accumulators
        self.config = self.build_config(policy, window=window, seed=seed, fold=gdn_fold)
        self.window = as_int(window)  # as asked for (config.window is 1 under eager policies)
        self._check_window_memory(self.config)
        if not isinstance(prefill, bool):  # bool("false") is True
            raise ValueError(f"prefill must be True or False, got {prefill!r}")
        self.prefill = prefill
        if decode == "serving":
            self._check_serving()
        self.sequence_ids = sequence_ids
        self.dt_limit = dt_limit
        self.active = False
        #: record per-head input statistics (decay, beta) in every new LayerState
        #: (``LayerState.input_stats``; ``replayssm-kl --state-error`` turns it on); off by
        #: default, since it adds small reductions to every call
        self.track_input_stats = False
        self._hooks: list = []
        #: (whether the instance had its own ``generate`` before the patch, that attribute)
        self._generate_prev: tuple | None = None
        self._generate_method = None  # the guarded generate this handle installed
        self._auto_ids: torch.Tensor | None = None  # content ids of the current fresh-cache call
        self._signature = inspect.signature(model.forward)

    def _check_window_memory(self, config) -> None:
        """Refuse, when a policy is applied (or switched to by :meth:`set_policy` /
        :meth:`use`), a window whose L x L decay and solve matrices would not fit the layer's
        device even for one sequence (the torch window form builds them for every window call,
        the CUDA chain for partial windows; docs/replay.md), naming L, instead of failing at
        the first forward call. Per layer: its own window (1 under ``eager:``), heads and
        device. ``decode="serving"`` steps from the exact prefill without the window form;
        there the decode state's record ring of one sequence is checked instead (its values
        alone: ``L x heads x value dim``, a lower bound, so nothing that fits is refused)."""
        for _, mixer, fam in self.mixers:
            L = int(config.for_layer(int(mixer.layer_idx)).window)
            param = next(mixer.parameters(), None)
            if L <= 1 or param is None or param.device.type == "meta":
                continue
            heads, V, _ = _family_module(fam).dims(mixer)
            dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
            if self.decode == "serving":
                check_allocation(L * heads * V * (torch.finfo(dtype).bits // 8), param.device,
                                 lambda: f"window={L}: the decode state's record ring of one "
                                         f"sequence ({L} slots x {heads} heads x {V} values)")
            else:
                _check_window_matrices(1, heads, L, dtype, param.device)

    def _check_serving(self) -> None:
        """``decode="serving"``: the decode state objects need the exact prefill (they step one
        token per call from it) and one policy per layer (a per-layer map is fine)."""
        if not self.prefill:
            raise ValueError("decode='serving' needs prefill=True: the decode state objects start "
                             "from the prompt's exact prefill and then step one token per call; "
                             "prefill=False (emulation from the zero state) needs decode='window'")
        for _, mixer, _fam in self.mixers:
            pol = self.config.for_layer(int(mixer.layer_idx)).policy
            if not isinstance(pol, StatePolicy):
                raise ValueError(f"decode='serving' takes one policy per layer, got {pol} on layer "
                                 f"{mixer.layer_idx} (a per-head or per-decay map); use "
                                 f"decode='window'")

    @property
    def sequence_ids(self) -> torch.Tensor | None:
        """None (content-keyed ids) or the int64 SR sequence ids of the batch rows."""
        return self._sequence_ids

    @sequence_ids.setter
    def sequence_ids(self, value) -> None:
        if value is None:
            self._sequence_ids = None
            return
        try:
            ids = torch.as_tensor(value).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            ids = None
        if ids is None or ids.is_floating_point() or ids.dtype == torch.bool:
            raise ValueError(f"sequence_ids must be ints in [0, 2^{SEQ_ID_BITS}), one per batch "
                             f"row, got {value!r}")
        ids = ids.to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 1 << SEQ_ID_BITS):
            raise ValueError(f"sequence_ids must be ints in [0, 2^{SEQ_ID_BITS}), got {ids.tolist()}")
        self._sequence_ids = ids

    @property
    def dt_limit(self) -> DtLimit:
        """The Mamba-2 time-step rule for states created from now on (:class:`DtLimit`)."""
        return self._dt_limit

    @dt_limit.setter
    def dt_limit(self, value) -> None:
        self._dt_limit = DtLimit.parse(value)

    def ssm_heads(self) -> dict[int, int]:
        """``{layer index: state heads}`` of the patched SSM layers (Mamba-2 heads, GDN value
        heads): what policy maps are resolved against."""
        return {int(m.layer_idx): _family_module(fam).dims(m)[0] for _, m, fam in self.mixers}

    def head_decays(self) -> dict[int, tuple[float, ...]] | None:
        """Per-head mean decays for decay buckets: :attr:`decay_stats` if set, else the model
        directory's ``decay_stats.json``, else None (loaded once)."""
        if self._decays is None:
            src = self.decay_stats
            if src is None:
                d = getattr(getattr(self.model, "config", None), "_name_or_path", "") or ""
                f = os.path.join(d, DECAY_STATS_FILE) if d and os.path.isdir(d) else None
                src = f if f and os.path.isfile(f) else None
            if src is not None:
                self._decays = load_decay_stats(src)
        return self._decays

    def build_config(self, policy, *, window=None, seed=None, fold=None):
        """Parse a state argument once (:func:`~replayssm_quant.policymap.parse_state_arg`:
        policy string, policy map file/string/dict, or parsed) into what :meth:`use` takes: a
        :class:`~replayssm_quant.config.StateConfig`, or for a map a
        :class:`~replayssm_quant.config.LayerwiseConfig` resolved against this model's SSM
        layers (:meth:`ssm_heads`, :meth:`head_decays`). Unset window/seed/fold keep the
        handle's.

        Raises:
            ValueError: a bad policy or map (naming the value), or a map naming layers/heads
                this model does not have.
        """
        window = self.window if window is None else window
        seed = self.config.seed if seed is None else seed
        fold = self.config.fold if fold is None else fold
        parsed = parse_state_arg(policy)
        if isinstance(parsed, StatePolicy):
            return StateConfig.build(parsed, window=window, seed=seed, fold=fold)
        per = parsed.resolve(self.ssm_heads(), self.head_decays() if parsed.uses_decay else None)
        default = StateConfig.build(parsed.default, window=window, seed=seed, fold=fold)
        layers = tuple((i, default if p == parsed.default else
                        StateConfig.build(p, window=window, seed=seed, fold=fold))
                       for i, p in sorted(per.items()))
        return LayerwiseConfig(parsed, default, layers, window)

    def set_policy(self, policy, *, window=None, seed=None) -> None:
        """Switch policy or policy map (and optionally window / seed) for states created from
        now on: the settings are parsed here, once, into :attr:`config`."""
        inherited = window is None
        window = self.window if inherited else window
        config = self.build_config(policy, window=window, seed=seed)
        try:
            self._check_window_memory(config)
        except ValueError as e:
            if not inherited:
                raise
            raise ValueError(f"{e} (the window set earlier, kept since set_policy() was given "
                             "none: pass window= to change it)") from None
        self.config = config
        self.window = as_int(window)

    def use(self, config) -> None:
        """Create states from now on with an already parsed ``config`` (a
        :class:`~replayssm_quant.config.StateConfig`, or a
        :class:`~replayssm_quant.config.LayerwiseConfig` from :meth:`build_config`; a runner
        that switches between cells parses each cell's settings once and switches with this)."""
        if not isinstance(config, (StateConfig, LayerwiseConfig)):
            raise TypeError(f"use() takes a StateConfig or LayerwiseConfig, got {type(config).__name__}; "
                            "use set_policy() for strings")
        self._check_window_memory(config)
        self.config = config
        self.window = config.window  # what a later set_policy() without a window keeps

    @property
    def policy(self) -> "StatePolicy | PolicyMap":
        """The parsed policy (or policy map) of states created from now on (``config.policy``)."""
        return self.config.policy

    @property
    def seed(self) -> int:
        """The SR seed of states created from now on (``config.seed``)."""
        return self.config.seed

    @property
    def gdn_fold(self) -> GDNFold:
        """What GDN flushes fold (``config.fold``, a :class:`~replayssm_quant.config.GDNFold`)."""
        return self.config.fold

    # ------------------------------------------------------------------ patching
    def _install(self) -> None:
        for _, mixer, family in self.mixers:
            if hasattr(mixer, _ORIG_ATTR):
                raise RuntimeError("a state policy is already applied to this model; remove it first")
        for _, mixer, family in self.mixers:
            fwd = types.MethodType(_make_forward(self, family), mixer)
            if _accelerate_hooked(mixer):
                # accelerate's hook (device_map / offload) wraps ``_old_forward``: replace that,
                # so the hook still moves inputs and loads offloaded weights around our forward
                setattr(mixer, _ORIG_ATTR, ("_old_forward", mixer.__dict__["_old_forward"]))
                mixer._old_forward = fwd
            else:
                setattr(mixer, _ORIG_ATTR, ("forward", mixer.__dict__.get("forward")))
                mixer.forward = fwd
        self._hooks = [
            self.model.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            self.model.register_forward_hook(self._post_forward, always_call=True),
        ]
        if callable(getattr(self.model, "generate", None)):
            # a method bound to the model (a deep copy of the model rebinds it to the copy), that
            # finds this handle through the model (copied along with it) and calls what the
            # model's generate was before
            self._generate_prev = ("generate" in self.model.__dict__,
                                   self.model.__dict__.get("generate"))
            self.model.__dict__[_HANDLE_ATTR] = self
            self._generate_method = types.MethodType(_guarded_generate, self.model)
            self.model.generate = self._generate_method
        self.active = True

    def remove(self) -> None:
        """Restore the original mixers (idempotent)."""
        for _, mixer, _ in self.mixers:
            if hasattr(mixer, _ORIG_ATTR):
                attr, orig = getattr(mixer, _ORIG_ATTR)
                delattr(mixer, _ORIG_ATTR)
                if orig is None:
                    mixer.__dict__.pop(attr, None)
                else:
                    setattr(mixer, attr, orig)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        prev = getattr(self, "_generate_prev", None)
        if prev is not None:  # put back what the instance had (usually nothing: the class's),
            # unless someone patched generate again after us: theirs stays
            if self.model.__dict__.get("generate") is self._generate_method:
                had, value = prev
                if had:
                    self.model.generate = value
                else:
                    self.model.__dict__.pop("generate", None)
            if self.model.__dict__.get(_HANDLE_ATTR) is self:
                del self.model.__dict__[_HANDLE_ATTR]
            self._generate_prev = self._generate_method = None
        self._auto_ids = None
        self.active = False

    def __enter__(self) -> "StatePolicyHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # ------------------------------------------------------------------ sequence ids
    def _pre_forward(self, module, args, kwargs):
        """Forward pre-hook of the patched model: on the first call of a fresh cache, derive
        content-keyed sequence ids from ``input_ids`` (and ``attention_mask``)."""
        self._auto_ids = None
        try:
            named = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        except TypeError:
            return None
        for p in self._signature.parameters.values():  # fold **kwargs into the named arguments
            if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(named.get(p.name), dict):
                named.update(named.pop(p.name))
        cache = named.get("cache")
        if cache is None:
            cache = named.get("past_key_values")
        if self._cache_has_state(cache):
            return None
        input_ids = named.get("input_ids")
        if (self.sequence_ids is None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2
                and input_ids.shape[1] > 0 and named.get("inputs_embeds") is None):
            self._auto_ids = content_sequence_ids(input_ids, named.get("attention_mask"))
        return None

    def _post_forward(self, module, args, output):
        self._auto_ids = None
        return None

    def _cache_has_state(self, cache) -> bool:
        if cache is None:
            return False
        layers = getattr(cache, "layers", None)
        if not layers:
            return False
        for _, mixer, _ in self.mixers:
            i = getattr(mixer, "layer_idx", None)
            if i is not None and i < len(layers) and _live_state(layers[i]) is not None:
                return True
        return False

    def _ids_for_new_state(self, batch: int, device) -> torch.Tensor:
        """Sequence ids ``[B]`` (int64) of a state created now: explicit ids, else the content
        ids of this call; without either, 0 for RTN policies and an error under SR."""
        if self.sequence_ids is not None:
            ids = self.sequence_ids
            if ids.numel() != batch:
                raise ValueError(f"handle.sequence_ids has {ids.numel()} entries for a batch of {batch}")
            return ids.to(device)
        if self._auto_ids is not None and self._auto_ids.numel() == batch:
            return self._auto_ids.to(device)
        if self.config.uses_sr:
            raise ValueError(
                f"policy {self.policy} uses stochastic rounding, whose random streams are keyed by "
                f"sequence id, and this first call on a fresh cache shows no input_ids to derive "
                f"content-keyed ids from (inputs_embeds, or a call into a submodule rather than the "
                f"model apply_state_policy was given); set handle.sequence_ids to one int in "
                f"[0, 2^{SEQ_ID_BITS}) per batch row ({batch} rows) before the call, e.g. "
                f"replayssm_quant.adapters.sequence_id(tokens) of each row")
        return torch.zeros(batch, dtype=torch.int64, device=device)

    # ------------------------------------------------------------------ inspection
    @staticmethod
    def states(cache) -> dict[int, LayerState]:
        """``{layer_idx: LayerState}`` held by ``cache``."""
        out = {}
        for i, layer in enumerate(getattr(cache, "layers", [])):
            st = getattr(layer, _STATE_ATTR, None)
            if st is not None:
                out[i] = st
        return out

    def __repr__(self) -> str:
        return (f"StatePolicyHandle(policy={self.policy}, window={self.window}, seed={self.seed}, "
                f"prefill={self.prefill}, dt_limit={self.dt_limit}, layers={len(self.mixers)}, "
                f"active={self.active})")


_HANDLE_ATTR = "_replayssm_handle"  # the model's applied StatePolicyHandle (for generate)


def _guarded_generate(model, *args, **kwargs):
    """``model.generate`` while a state policy is applied: refuses ``use_cache=False`` with the
    exact prefill, where every generated token would re-run the whole sequence as a fresh
    prefill (exact state, cast as flush 0 and never read), so the policy would never round a
    state that an output reads: silently FP32-state decoding. Otherwise the model's own
    ``generate``.

    Raises:
        ValueError: ``use_cache`` off (by keyword, a ``generation_config`` passed by keyword
            or position, or the model's own ``generation_config``) under ``prefill=True``.
    """
    handle = model.__dict__.get(_HANDLE_ATTR)
    had, value = getattr(handle, "_generate_prev", None) or (False, None)
    inner = value if had else types.MethodType(type(model).generate, model)
    if (handle is not None and handle.active and handle.prefill
            and not _generate_uses_cache(model, inner, args, kwargs)):
        raise ValueError(
            f"generate(use_cache=False) under state policy {handle.policy}: without a cache "
            f"every new token re-runs the whole sequence as an exact prefill, so the policy "
            f"never rounds a state an output reads (the tokens would be FP32-state decoding); "
            f"leave use_cache on (the default), or use prefill=False to emulate the whole "
            f"sequence under the policy on every call")
    return inner(*args, **kwargs)


def _generate_uses_cache(model, generate, args: tuple, kwargs: dict) -> bool:
    """Whether ``generate(*args, **kwargs)`` keeps a cache: ``use_cache`` as transformers
    resolves it (the call's keyword, else the ``generation_config`` passed by keyword or
    position, else the model's own ``generation_config``; on by default)."""
    if kwargs.get("use_cache") is not None:
        return bool(kwargs["use_cache"])
    try:
        named = inspect.signature(generate).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        named = kwargs
    for gc in (named.get("generation_config"), getattr(model, "generation_config", None)):
        flag = getattr(gc, "use_cache", None)
        if flag is not None:
            return bool(flag)
    return True


def _attach(entry, state: LayerState) -> None:
    """Put ``state`` on the cache layer ``entry`` and make the layer's batch operations carry
    it along: ``reorder_cache`` (beam search), ``batch_select_indices`` and
    ``batch_repeat_interleave`` apply the same row selection to the ReplaySSM state as to the
    conv state and KV cache; ``crop`` (speculative rollback of the cache) is refused, since a
    rounded anchor cannot be rolled back."""
    setattr(entry, _STATE_ATTR, state)
    if getattr(entry, "_replayssm_follows", False):
        return

    def follow(name, apply):
        orig = getattr(entry, name, None)
        if orig is None:
            return

        def wrapped(arg, *args, **kwargs):
            out = orig(arg, *args, **kwargs)
            st = getattr(entry, _STATE_ATTR, None)
            if st is not None:
                apply(st, arg)
            return out

        setattr(entry, name, wrapped)

    follow("reorder_cache", lambda st, idx: st.select_rows(idx))
    follow("batch_select_indices", lambda st, idx: st.select_rows(idx))
    follow("batch_repeat_interleave", lambda st, n: st.repeat_rows(n))
    if getattr(entry, "crop", None) is not None:
        def crop(*args, **kwargs):
            raise NotImplementedError(
                "crop() of a cache that carries ReplaySSM state: a rounded recurrence anchor "
                "cannot be rolled back (use the replay state objects' verify/commit for "
                "speculative decoding, replayssm_quant.replay)")
        entry.crop = crop
    entry._replayssm_follows = True


def _live_state(entry):
    """The LayerState on a cache layer, or None when the layer has no (current) state."""
    has_prev = getattr(entry, "has_previous_state", {0: False}).get(0, False)
    return getattr(entry, _STATE_ATTR, None) if has_prev else None


def _padded_rows(attention_mask) -> list[int]:
    """Rows of a 2-D mask with at least one padded position ([] for None / 4-D masks)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return []
    return (~attention_mask.bool()).any(dim=1).nonzero().flatten().tolist()


def _family_module(family: str):
    return _mamba2 if family == "mamba2" else _gdn


def _accelerate_hooked(module) -> bool:
    """True if accelerate (``device_map``, CPU/disk offload) wrapped ``module.forward``."""
    return hasattr(module, "_hf_hook") and "_old_forward" in module.__dict__


def _offloaded_weights(mixer):
    """A context in which every offloaded submodule of ``mixer`` holds its weights on its
    execution device: the replaced forward reads some weights directly (the conv kernel, the
    mixer's own parameters) rather than through a hooked module call. A no-op unless
    accelerate offloaded part of the mixer."""
    mods = [m for m in mixer.modules() if getattr(m, "_hf_hook", None) is not None
            and getattr(m._hf_hook, "offload", False)]
    if not mods:
        return contextlib.nullcontext()
    from accelerate.utils import align_module_device

    stack = contextlib.ExitStack()
    for m in mods:
        stack.enter_context(align_module_device(m))
    return stack


def _state_precision(device: torch.device):
    """A context in which the ReplaySSM state path runs at its own precision: autocast off on
    ``device``'s type where it is on (HFLM's ``mixed_precision_dtype``, a caller's
    ``torch.autocast``). The state policy decides the state's precision (DESIGN.md sections 3
    and 4: the recurrence in the working dtype, the copies in their formats); under autocast
    the torch path's products would otherwise run in bfloat16 / float16 and ``fp32`` would not
    be FP32-state decoding. The projections before it and the output path after it stay
    under the caller's autocast, as in the unpatched model."""
    try:
        on = torch.is_autocast_enabled(device.type)
    except (TypeError, RuntimeError, ValueError):  # a device type autocast does not know
        on = False
    if not on:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def _make_forward(handle: StatePolicyHandle, family: str):
    fam = _family_module(family)

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        with _offloaded_weights(self):
            return _forward(self, hidden_states, cache, attention_mask, **kwargs)

    def _forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("cache_params", None)
        layer_idx = self.layer_idx
        entry = None
        state = None
        if cache is not None:
            entry = cache.layers[layer_idx]
            state = _live_state(entry)
        fresh = state is None
        if hidden_states.dim() != 3 or 0 in hidden_states.shape[:2]:
            raise ValueError(f"layer {layer_idx}: hidden_states has shape "
                             f"{tuple(hidden_states.shape)}; a ReplaySSM layer needs [batch, T, "
                             f"hidden] with batch >= 1 and T >= 1 tokens")
        if not fresh and state.batch_size != hidden_states.shape[0]:
            raise ValueError(f"layer {layer_idx}: this call has batch {hidden_states.shape[0]} but "
                             f"the cache it continues holds the state of {state.batch_size} "
                             f"sequences; continue a cache with the same batch")
        exact_prefill = fresh and handle.prefill
        if not exact_prefill:
            rows = _padded_rows(attention_mask)
            if rows:
                raise ValueError(
                    f"attention_mask pads rows {rows} in a call that "
                    f"{'emulates from the zero state (prefill=False)' if fresh else 'continues a cache'} "
                    f"(layer {layer_idx}): ReplaySSM counts tokens in windows of L={handle.config.window} for "
                    f"the whole batch, so a padded position would shift that row's flushes. Padding is "
                    f"supported in the exact prefill only (first call on a fresh cache, prefill=True); "
                    f"run later segments unpadded (rows of equal length)")
        dt_limit = handle.dt_limit if fresh else getattr(entry, _DT_ATTR, handle.dt_limit)
        inp, ctx = fam.extract(self, hidden_states, cache, attention_mask, dt_limit=dt_limit)
        with _state_precision(hidden_states.device):  # the state path: no autocast
            o = _state_path(self, hidden_states, attention_mask, entry, state, fresh, inp,
                            dt_limit)
        return fam.output(self, ctx, o)

    def _state_path(self, hidden_states, attention_mask, entry, state, fresh, inp, dt_limit):
        """The recurrence of this call from the mixer's inputs: outputs ``[B, T, H, V]``."""
        layer_idx = self.layer_idx
        if handle._decay_recorder is not None:
            _record_decay(handle._decay_recorder, layer_idx, family, inp, attention_mask)
        Bsz, H, V, K = state_dims(family, inp)
        T = hidden_states.shape[1]
        if fresh:
            kw = dict(family=family, config=handle.config.for_layer(layer_idx), layer=layer_idx,
                      sequence_ids=handle._ids_for_new_state(Bsz, hidden_states.device),
                      track_stats=handle.track_input_stats,
                      serving=handle.decode == "serving")
            if entry is not None:
                setattr(entry, _DT_ATTR, dt_limit)
            if handle.prefill:
                o, S = prefill_scan(family, inp)
                if entry is not None:
                    _attach(entry, LayerState(S, **kw))
                return o
            wd = inp["v"].dtype if family == "gdn" else inp["x"].dtype
            state = LayerState(torch.zeros(Bsz, H, V, K, dtype=wd, device=hidden_states.device), **kw)
            if entry is not None:
                _attach(entry, state)
        elif state.batch_size != Bsz:
            raise ValueError(f"batch size changed from {state.batch_size} to {Bsz} on a cache "
                             f"that carries ReplaySSM state (layer {layer_idx})")
        return state.step(inp) if T == 1 else state.advance(inp)

    return forward


def apply_state_policy(model, policy="fp32", window: int = 16, seed: int = 0, *,
                       prefill: bool = True, gdn_fold: str = "recompute",
                       sequence_ids=None, dt_limit: "str | DtLimit" = "decode",
                       decay_stats=None, decode: str = "window") -> StatePolicyHandle:
    """Put every SSM mixer of ``model`` under ReplaySSM state with ``policy``.

    Args:
        model: a transformers model of a supported architecture (:data:`SUPPORTED_ARCHITECTURES`).
        policy: policy string or :class:`~replayssm_quant.policy.StatePolicy`
            (``fp32``, ``shared:F``, ``eager:F``, ``read:F/rec:G``), or a policy map: a JSON
            file path (``"map.json"``), a compact ``"map:..."`` string, a dict or a
            :class:`~replayssm_quant.policymap.PolicyMap` (per-layer / per-head / per-decay
            policies, resolved once here against the model's SSM layers).
        window: flush window L (``eager:`` policies use 1).
        seed: Philox key of stochastic rounding.
        prefill: first call on a cache runs the exact prefill scan (True) or emulates from
            the zero state (False).
        gdn_fold: ``"recompute"`` (DESIGN.md default) or ``"cached"``.
        sequence_ids: SR stream ids, one int in [0, 2^20) per batch row; default None:
            content-keyed (:func:`sequence_id` of each row's unpadded ``input_ids`` on the first
            call of a fresh cache; module docstring).
        dt_limit: Mamba-2 time-step rule on every call, :class:`DtLimit` or its name:
            ``"decode"`` (default: no clamp, the model's decode step) or ``"clamp"`` (the
            mixer's ``time_step_limit``, as the model's chunked scan). Recorded as
            ``handle.dt_limit``.
        decay_stats: per-head mean decays for a map's decay buckets: a JSON file path or
            dict (:func:`~replayssm_quant.policymap.load_decay_stats`); None: the model
            directory's ``decay_stats.json`` (the embedded models carry one).
        decode: how one-token calls (``generate``) run: ``"window"`` (default: the window form
            with one token, bit-identical to teacher-forced segments on every backend) or
            ``"serving"`` (the decode state objects and, on CUDA, their Triton kernels: packed
            read copy, record ring, one-kernel flush; same rounding rules and SR streams, a
            different summation order on CUDA; no teacher-forced calls after the prefill and
            no beam search; :mod:`.state` docstring).

    Returns:
        a :class:`StatePolicyHandle` (also a context manager that removes the patch on exit).

    Raises:
        UnsupportedArchitectureError: the model is not a supported hybrid (lists the
            supported architectures) or has no SSM layers.
        ValueError: bad policy, policy map, window, seed, dt_limit or decode (naming the
            value); a map naming layers or heads the model does not have, or decay buckets
            without decays; ``decode="serving"`` with ``prefill=False`` or with a per-head or
            per-decay map.

    Implements DESIGN.md section 3 (state semantics, prefill, teacher-forced emulation).
    """
    handle = StatePolicyHandle(model, policy, window, seed, prefill, gdn_fold, sequence_ids,
                               dt_limit, decay_stats, decode)
    handle._install()
    return handle


@contextlib.contextmanager
def state_policy(model, policy="fp32", window: int = 16, seed: int = 0, **kwargs):
    """Context manager form of :func:`apply_state_policy`; restores the model on exit."""
    handle = apply_state_policy(model, policy, window, seed, **kwargs)
    try:
        yield handle
    finally:
        handle.remove()


# ------------------------------------------------------------------------------ head decays
def _record_decay(acc: dict, layer: int, family: str, inp: dict, attention_mask) -> None:
    """Add the per-token decays of one call to ``acc[layer] = [sum over tokens [H] (float64),
    token count]``; padded positions (2-D mask 0) are left out."""
    if family == "mamba2":
        a = torch.exp(inp["dt"].double() * inp["A"].double())  # [B, T, H]
    else:
        a = torch.exp(inp["g"].double())  # [B, T, HV]
    if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape == a.shape[:2]:
        keep = attention_mask.to(a.device).bool()
        a = a[keep]
    else:
        a = a.reshape(-1, a.shape[-1])
    s, n = acc.get(layer, (0.0, 0))
    acc[layer] = (s + a.sum(0).cpu(), n + a.shape[0])


def measure_head_decay(model, documents, *, dt_limit: "str | DtLimit" = "decode") -> dict[int, tuple[float, ...]]:
    """Per-head mean decay of every SSM layer on calibration text (the definition of
    :mod:`replayssm_quant.policymap`, "Mean decay"): the mean over all tokens of
    ``a_t = exp(dt_t A)`` (Mamba-2, ``dt`` under ``dt_limit``) or ``alpha_t = exp(g_t)`` (GDN).

    Args:
        model: an unpatched supported model (it is patched under ``fp32`` for the call and
            restored).
        documents: token id sequences (lists or 1-D/``[1, T]`` integer tensors); each runs
            through the model alone.
        dt_limit: Mamba-2 time-step rule (:class:`DtLimit`).

    Returns:
        ``{layer: (mean decay of head 0, ...)}``, floats in [0, 1]; write it as
        ``{"decays": [{"layer", "head", "mean"}]}`` to use it as ``decay_stats``.

    Raises:
        ValueError: no documents, or an empty one.
    """
    docs = [torch.as_tensor(d, dtype=torch.int64).reshape(-1) for d in documents]
    if not docs or any(d.numel() == 0 for d in docs):
        raise ValueError("measure_head_decay needs at least one non-empty document")
    dev = next(model.parameters()).device
    with state_policy(model, "fp32", dt_limit=dt_limit) as handle, torch.no_grad():
        handle._decay_recorder = {}
        for d in docs:
            model(d[None].to(dev), use_cache=False)
        acc = handle._decay_recorder
        handle._decay_recorder = None
    return {i: tuple(float(x) for x in (s / n)) for i, (s, n) in sorted(acc.items())}
