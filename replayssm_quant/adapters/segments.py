"""Teacher-forced calls of a (patched) model, one segment of a document at a time.

Hugging Face models differ in the name of the cache argument and output field
(``cache`` in transformers 5.24, ``past_key_values`` before) and not all of them derive
position ids from the cache on multi-token continuations (Bamba, for one, restarts at 0), so
segment calls pass explicit ``position_ids``.
"""

from __future__ import annotations

import inspect

import torch

from ..capabilities import torch_threads

__all__ = ["cache_of", "cache_kwarg", "forward_segment", "forward_each"]


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

    On CPU a one-token call with a cache runs on one intra-op thread: torch's CPU attention
    for a single query over the cached keys sums in an order that follows the thread count
    (last-bit differences in the embedded tiny-gdn's attention output at 1 vs 2 threads,
    2026-12-06), and a rounding decision downstream can flip on them. Longer calls were
    measured invariant (2 and 4 tokens over a cache, and whole segments).
    """
    B, T = input_ids.shape
    kw = dict(use_cache=True)
    if cache is not None:
        kw[cache_kwarg(model)] = cache
    if _has_attention(model):
        kw["position_ids"] = torch.arange(start, start + T, device=input_ids.device)[None].expand(B, -1)
    if logits_to_keep:
        kw["logits_to_keep"] = logits_to_keep
    with torch_threads(1 if T == 1 and cache is not None and input_ids.device.type == "cpu"
                       else None):
        out = model(input_ids, **kw)
    return out.logits, cache_of(out)


def forward_each(model, input_ids: torch.Tensor, caches=None, *, start: int = 0, handle=None,
                 sequence_ids=None):
    """:func:`forward_segment` for every row of ``input_ids [B, T]`` alone, each with its own
    cache: returns ``(logits [B, T, V], caches)`` with ``caches`` a list of B caches (pass it
    back for the next segment).

    Why: a batched forward is not batch-invariant on CPU or GPU. GEMM kernels and tiles are
    chosen by the number of rows ``B*T`` (a row in an edge tile is summed in another order),
    and some elementwise kernels (``softplus`` on CPU) compute a tensor's tail elements on a
    scalar path; a last-bit change can then flip a state rounding decision. Run alone, a
    document sees the same calls in any batch at any position (issue 12; docs/invariance.md).

    Args:
        caches: None (fresh) or the list returned by the previous call.
        handle: the :class:`~replayssm_quant.adapters.StatePolicyHandle` of a patched model,
            with ``sequence_ids``: one SR sequence id per row, set for that row's first call
            (fresh state); None keeps the handle's default (content-keyed ids).
    Raises:
        ValueError: ``caches`` or ``sequence_ids`` do not have one entry per row.
    """
    B = input_ids.shape[0]
    if caches is not None and len(caches) != B:
        raise ValueError(f"caches has {len(caches)} entries for a batch of {B} rows")
    if sequence_ids is not None and len(sequence_ids) != B:
        raise ValueError(f"sequence_ids has {len(sequence_ids)} entries for a batch of {B} rows")
    logits, out = [], []
    saved = handle.sequence_ids if handle is not None else None
    try:
        for b in range(B):
            if handle is not None and sequence_ids is not None:
                handle.sequence_ids = [int(sequence_ids[b])]
            lg, c = forward_segment(model, input_ids[b: b + 1], None if caches is None else caches[b],
                                    start=start)
            logits.append(lg)
            out.append(c)
    finally:
        if handle is not None:
            handle.sequence_ids = saved
    return torch.cat(logits), out
