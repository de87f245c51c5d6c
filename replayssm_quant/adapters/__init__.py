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

Conv states, projections, norms and the output projection are computed by the adapter in
plain torch with the mixer's own weights and norm modules (never the GPU-only fla /
causal_conv1d kernels that transformers may pick, so the CPU path works with fla installed).
Under ``fp32`` the patched model reproduces the unpatched model's logits (teacher-forced and
``generate``) to float reassociation.

Stochastic-rounding streams are keyed by (seed, layer, sequence id, head, flush index, copy);
sequence ids default to the batch row; set ``handle.sequence_ids`` (one id per row, < 2^20)
before the first call so results do not depend on batch composition.
"""

from __future__ import annotations

import contextlib
import types

import torch

from ..policy import StatePolicy
from . import gdn as _gdn
from . import mamba2 as _mamba2
from .state import GDN_FOLDS, LayerState, prefill_scan, state_dims

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedArchitectureError",
    "StatePolicyHandle",
    "apply_state_policy",
    "state_policy",
    "find_ssm_mixers",
    "architecture_of",
    "LayerState",
]

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
_ORIG_ATTR = "_replayssm_orig_forward"


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
        policy: the :class:`~replayssm_quant.policy.StatePolicy`.
        window: L. seed: SR seed. prefill: see the module docstring.
        sequence_ids: None (batch rows) or one int per batch row, keying SR streams.
        gdn_fold: ``"recompute"`` (default, DESIGN.md) or ``"cached"`` (the studied unstable
            variant that folds cached read-path corrections).
    """

    def __init__(self, model, policy, window, seed, prefill, gdn_fold, sequence_ids):
        self.model = model
        self.mixers = find_ssm_mixers(model)
        self.set_policy(policy, window=window, seed=seed)
        self.prefill = bool(prefill)
        if gdn_fold not in GDN_FOLDS:
            raise ValueError(f"gdn_fold must be one of {GDN_FOLDS}, got {gdn_fold!r}")
        self.gdn_fold = gdn_fold
        self.sequence_ids = sequence_ids
        self.active = False

    def set_policy(self, policy, *, window=None, seed=None) -> None:
        """Switch policy (and optionally window / seed) for states created from now on."""
        self.policy = StatePolicy.parse(policy)
        if window is not None:
            if isinstance(window, bool) or int(window) != window or int(window) < 1:
                raise ValueError(f"window must be an int >= 1, got {window!r}")
            self.window = int(window)
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
            self.seed = seed

    # ------------------------------------------------------------------ patching
    def _install(self) -> None:
        for _, mixer, family in self.mixers:
            if hasattr(mixer, _ORIG_ATTR):
                raise RuntimeError("a state policy is already applied to this model; remove it first")
        for _, mixer, family in self.mixers:
            setattr(mixer, _ORIG_ATTR, mixer.__dict__.get("forward"))
            mixer.forward = types.MethodType(_make_forward(self, family), mixer)
        self.active = True

    def remove(self) -> None:
        """Restore the original mixers (idempotent)."""
        for _, mixer, _ in self.mixers:
            if hasattr(mixer, _ORIG_ATTR):
                orig = getattr(mixer, _ORIG_ATTR)
                delattr(mixer, _ORIG_ATTR)
                if orig is None:
                    mixer.__dict__.pop("forward", None)
                else:
                    mixer.forward = orig
        self.active = False

    def __enter__(self) -> "StatePolicyHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

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

    def _sequence_ids(self, batch: int, device) -> torch.Tensor:
        if self.sequence_ids is None:
            return torch.arange(batch, dtype=torch.int64, device=device)
        ids = torch.as_tensor(self.sequence_ids, dtype=torch.int64, device=device).reshape(-1)
        if ids.numel() != batch:
            raise ValueError(f"sequence_ids has {ids.numel()} entries for a batch of {batch}")
        return ids

    def __repr__(self) -> str:
        return (f"StatePolicyHandle(policy={self.policy}, window={self.window}, seed={self.seed}, "
                f"prefill={self.prefill}, layers={len(self.mixers)}, active={self.active})")


def _family_module(family: str):
    return _mamba2 if family == "mamba2" else _gdn


def _make_forward(handle: StatePolicyHandle, family: str):
    fam = _family_module(family)

    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is None:
            cache = kwargs.pop("cache_params", None)
        layer_idx = self.layer_idx
        entry = None
        state = None
        if cache is not None:
            entry = cache.layers[layer_idx]
            has_prev = getattr(entry, "has_previous_state", {0: False}).get(0, False)
            state = getattr(entry, _STATE_ATTR, None) if has_prev else None
        fresh = state is None
        inp, ctx = fam.extract(self, hidden_states, cache, attention_mask,
                               clamp_dt=fresh and handle.prefill)
        Bsz, H, V, K = state_dims(family, inp)
        T = hidden_states.shape[1]
        if fresh:
            kw = dict(family=family, policy=handle.policy, window=handle.window,
                      seed=handle.seed, layer=layer_idx,
                      sequence_ids=handle._sequence_ids(Bsz, hidden_states.device),
                      gdn_fold=handle.gdn_fold)
            if handle.prefill:
                o, S = prefill_scan(family, inp)
                if entry is not None:
                    setattr(entry, _STATE_ATTR, LayerState(S, **kw))
                return fam.output(self, ctx, o)
            wd = inp["v"].dtype if family == "gdn" else inp["x"].dtype
            state = LayerState(torch.zeros(Bsz, H, V, K, dtype=wd, device=hidden_states.device), **kw)
            if entry is not None:
                setattr(entry, _STATE_ATTR, state)
        elif state.batch_size != Bsz:
            raise ValueError(f"batch size changed from {state.batch_size} to {Bsz} on a cache "
                             f"that carries ReplaySSM state (layer {layer_idx})")
        o = state.step(inp) if T == 1 else state.advance(inp)
        return fam.output(self, ctx, o)

    return forward


def apply_state_policy(model, policy="fp32", window: int = 16, seed: int = 0, *,
                       prefill: bool = True, gdn_fold: str = "recompute",
                       sequence_ids=None) -> StatePolicyHandle:
    """Put every SSM mixer of ``model`` under ReplaySSM state with ``policy``.

    Args:
        model: a transformers model of a supported architecture (:data:`SUPPORTED_ARCHITECTURES`).
        policy: policy string or :class:`~replayssm_quant.policy.StatePolicy`
            (``fp32``, ``shared:F``, ``eager:F``, ``read:F/rec:G``).
        window: flush window L (``eager:`` policies use 1).
        seed: Philox key of stochastic rounding.
        prefill: first call on a cache runs the exact prefill scan (True) or emulates from
            the zero state (False).
        gdn_fold: ``"recompute"`` (DESIGN.md default) or ``"cached"``.
        sequence_ids: SR stream ids per batch row (default: the row index).

    Returns:
        a :class:`StatePolicyHandle` (also a context manager that removes the patch on exit).

    Raises:
        UnsupportedArchitectureError: the model is not a supported hybrid (lists the
            supported architectures) or has no SSM layers.
        ValueError: bad policy, window or seed.
    """
    handle = StatePolicyHandle(model, policy, window, seed, prefill, gdn_fold, sequence_ids)
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
