"""Teacher-forced calls of a (patched) model, one segment of a document at a time.

Hugging Face models differ in the name of the cache argument and output field
(``cache`` in transformers 5.24, ``past_key_values`` before) and not all of them derive
position ids from the cache on multi-token continuations (Bamba, for one, restarts at 0), so
segment calls pass explicit ``position_ids``.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["cache_of", "cache_kwarg", "forward_segment"]


def cache_kwarg(model) -> str:
    """Name of ``model``'s cache argument: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (earlier releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(output):
    """The cache object returned by a forward call (``cache`` or ``past_key_values``)."""
    c = getattr(output, "cache", None)
    if c is None:
        c = getattr(output, "past_key_values", None)
    return c


def _has_attention(model) -> bool:
    return getattr(model.config, "model_type", "") != "mamba2"


def forward_segment(model, input_ids: torch.Tensor, cache=None, *, start: int = 0,
                    logits_to_keep: int = 0):
    """Run ``input_ids [B, T]`` (positions ``start .. start+T-1`` of the documents) through
    ``model`` continuing from ``cache``; returns ``(logits [B, T, V], cache)``.
    """
    B, T = input_ids.shape
    kw = dict(use_cache=True)
    if cache is not None:
        kw[cache_kwarg(model)] = cache
    if _has_attention(model):
        kw["position_ids"] = torch.arange(start, start + T, device=input_ids.device)[None].expand(B, -1)
    if logits_to_keep:
        kw["logits_to_keep"] = logits_to_keep
    out = model(input_ids, **kw)
    return out.logits, cache_of(out)
