"""lm-evaluation-harness adapter: run lm-eval tasks with the SSM state under a ReplaySSM policy.

Usage (exactly lm_eval's command line, with our model registered)::

    replayssm-lm-eval --model replayssm \\
        --model_args pretrained=tiny-gdn,state=read:nvfp4/rec:fp16+sr,window=16,seed=0 \\
        --tasks kjv_longctx_mc --include_path evals/tasks --device cpu --limit 8

The model class subclasses lm-eval's ``HFLM`` and overrides only what the state semantics
need (DESIGN.md section 3):

* ``_loglikelihood_tokens`` (used by ``loglikelihood`` and ``loglikelihood_rolling``) queues,
  in the order HFLM batches its rows, each row's true length and prefill length (taken from
  the request, never guessed from the padded row); ``_model_call`` takes one batch's entries
  and, row by row (identical rows once), prefills the context exactly (the chunked scan in
  the model's precision, its final state cast as flush 0) and runs the continuation
  teacher-forced under the policy through the adapters' window-by-window emulation
  (``replayssm_quant.adapters``), which equals stepping through it token by token. HFLM's
  right padding never enters the state, and a row's logits never depend on its batch.
* ``_detect_batch_size`` (``batch_size=auto``): HFLM's probe, its test rows scored through the
  same policy path.
* ``generate_until``: the prompt is prefilled exactly, then ``model.generate`` decodes step by
  step with ReplaySSM state under the policy. Rows are generated one at a time so left
  padding never enters the recurrent state.

Log-probabilities are FP32 ``log_softmax`` of the logits by default (HFLM's ``softmax_dtype``
set to ``float32``), whatever the model's dtype. Stochastic-rounding streams are keyed by a
hash of each row's own request tokens (not its batch position or padding), so per-request
scores do not depend on batching and are reproducible for a fixed ``seed``. Unknown model
arguments are refused before the model loads (:func:`accepted_model_args`).

Model and data parallelism are HFLM's own: ``parallelize=True`` (optionally ``device_map``,
``max_memory_per_gpu``, ``max_cpu_memory``, ``offload_folder``) loads the model with
accelerate's ``device_map``, and ``accelerate launch`` on several GPUs splits the requests over
processes. The adapter adds no rank-dependent state (SR streams are keyed by each row's
tokens), and when accelerate hooks a mixer (CPU/disk offload) the policy forward runs inside
the hook, with the offloaded weights loaded (docs/distributed.md).

lm-eval 0.4.13 has no plugin (entry-point) discovery of models, so ``replayssm-lm-eval``
imports this module (which registers ``replayssm``) and hands the command line to lm_eval.
``pyproject.toml`` also declares the ``lm_eval.models`` entry point for versions that scan it.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import textwrap
from collections import defaultdict, deque
from pathlib import Path
from typing import NamedTuple

import torch

from replayssm_quant.adapters import sequence_id
from replayssm_quant.adapters.segments import forward_segment
from replayssm_quant.config import GDNFold
from replayssm_quant.outpaths import output_dir_problem
from replayssm_quant.philox import SEED_LIMIT
from replayssm_quant.policy import GRAMMAR, StatePolicy
from replayssm_quant.policymap import PolicyMap, load_decay_stats, parse_state_arg

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.utils import Collator
except ImportError as e:  # pragma: no cover - exercised only without the eval extra
    raise ImportError(
        "replayssm_quant.evals.lm_eval_adapter needs lm-eval: pip install 'replayssm-quant[eval]'"
    ) from e

__all__ = ["ReplaySSMLM", "ModelArgumentError", "cli", "POLICY_GRAMMAR", "sequence_id", "check_model_args",
           "accepted_model_args"]

POLICY_GRAMMAR = GRAMMAR  # the policy grammar text, written once in replayssm_quant.policy


def _parse_policy(state) -> "StatePolicy | PolicyMap":
    """The ``state`` model argument: a policy string or a policy map (``state=map.json`` or a
    compact ``map:...`` string; :mod:`replayssm_quant.policymap`)."""
    try:
        return parse_state_arg(state)
    except ValueError as e:  # the message names the string and gives the grammar
        raise ValueError(f"bad model argument state={state!r}: {e}") from e


def _check_drafts(max_drafts: int, window: int, policy) -> None:
    """``max_drafts`` as the decode state objects take it (docs/replay.md, decision 7):
    ``0 <= T <= L``, and ``T <= 1`` under an eager policy (window 1) or a policy map that
    puts any layer under one."""
    # a policy map's eager layers run with window 1 too (PolicyMap.policies: every policy named)
    eager = (policy.is_eager if isinstance(policy, StatePolicy)
             else any(p.is_eager for p in policy.policies()))
    limit = 1 if eager else window
    if max_drafts > limit:
        raise ValueError(
            f"model argument max_drafts={max_drafts} must be <= window={limit}"
            + (" (eager policies run with window 1)" if eager else "")
            + ": drafts must fit in one window to be verified (docs/replay.md, decision 7)")


def _as_int(name: str, value, minimum: int, maximum: int | None = None) -> int:
    """An integer model argument (lm-eval passes strings), with a clear error."""
    # lm-eval's argument parser turns "-3" into -3.0 (a positive "3" into 3): show such values
    # as the user typed them; "16.0" or "1e3" stay floats in the message
    neg = isinstance(value, float) and value.is_integer() and value < 0
    shown = repr(int(value)) if neg else repr(value)
    rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    try:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError
        v = int(str(value).strip())
    except (TypeError, ValueError):
        raise ValueError(f"model argument {name} must be an integer {rng}, got {shown}") from None
    if v < minimum or (maximum is not None and v > maximum):
        raise ValueError(f"model argument {name} must be an integer {rng}, got {shown}")
    return v


#: the torch dtypes a model or its log-softmax runs in; HFLM reads a string ``s`` as
#: ``getattr(torch, s)``, so their aliases (``half``, ``float``, ``double``) work too
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")


def _check_dtype(name: str, value, auto: bool) -> None:
    """``dtype`` (``auto`` too) or ``softmax_dtype``: None, one of :data:`MODEL_DTYPES` or
    a name HFLM resolves to one (``getattr(torch, s)``: ``bfloat16``, ``half``, ...)."""
    if value is None or value in MODEL_DTYPES:
        return
    if isinstance(value, str) and ((auto and value == "auto")
                                   or getattr(torch, value, None) in MODEL_DTYPES):
        return
    names = ", ".join((("auto",) if auto else ()) + DTYPE_NAMES)
    raise ValueError(f"model argument {name} must be one of {names} (a torch dtype name, as "
                     f"HFLM reads it: getattr(torch, name)), got {value!r}")


def _check_batch_size(value, where: str) -> None:
    """A batch size as lm-eval takes it: a positive integer, ``auto`` or ``auto:N`` (N >= 1).
    HFLM itself takes 0 and runs."""
    text = str(value).strip()
    if text.startswith("auto"):
        tail = text[len("auto"):]
        ok = not tail or (tail.startswith(":") and tail[1:].isdigit() and int(tail[1:]) >= 1)
    else:
        try:
            ok = not isinstance(value, (bool, float)) and int(text) >= 1
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(f"{where} {value!r}: expected a positive integer, 'auto' or 'auto:N' "
                         "(N >= 1)")


class _Row(NamedTuple):
    """One loglikelihood row as HFLM builds it: its input tokens without padding, and how many
    of them are prefilled exactly (the rest run under the policy)."""

    tokens: tuple[int, ...]
    prefill: int


def _hflm_row_order(request) -> tuple:
    """The sort key HFLM's ``_loglikelihood_tokens`` hands its ``Collator`` (lm-eval 0.4.x):
    longest ``context + continuation`` first, ties broken by the tokens (rows with the same
    tokens keep their request order: both sorts are stable). ``_model_call`` checks every row
    it receives against the queue built with it, so a different order in a later lm-eval
    stops the run with an error instead of mis-scoring."""
    toks = request[1] + request[2]
    return -len(toks), tuple(toks)


class ModelArgumentError(ValueError):
    """A ReplaySSM model argument that only the loaded model can refuse (a policy map's
    layers or heads, decay statistics of another model); ``replayssm-lm-eval`` reports it in
    one line with exit code 2."""


@register_model("replayssm")
class ReplaySSMLM(HFLM):
    """HFLM with every SSM layer's state under a ReplaySSM precision policy.

    Model arguments (``--model_args``), parsed once at construction:
        pretrained: hub id, local directory, or an embedded name (``tiny-gdn``, ``tiny-mamba2``).
        state: policy string (``fp32`` default; grammar in :data:`POLICY_GRAMMAR`) or a policy
            map: ``state=map.json`` or a compact ``map:...`` string (per layer / head / decay
            bucket; :mod:`replayssm_quant.policymap`).
        decay_stats: JSON file of per-head mean decays for a map's decay buckets (default: the
            model directory's ``decay_stats.json``).
        window: flush window L (default 16). seed: SR seed (default 0).
        max_drafts: drafts T for speculative decoding studies, ``0 <= T <= window`` (``<= 1``
            under an eager policy), as the decode state objects take it; recorded in the model
            info. lm-eval's generate path decodes one token at a time, so it changes no
            result.
        gdn_fold: ``recompute`` (default) or ``cached`` (the unstable variant, for study).
        dt_limit: Mamba-2 ``time_step_limit`` rule, ``decode`` (default: no clamp, as the decode
            step and serving) or ``clamp`` (as the chunked scan); docs/adapters.md.
        softmax_dtype: as HFLM, but defaults to ``float32``: log-probabilities are FP32
            ``log_softmax`` of the logits whatever the model's ``dtype``.
        every other named argument of HFLM (``device``, ``dtype``, ``batch_size``,
            ``parallelize``, ``max_memory_per_gpu``, ...) and ``device_map`` (with
            ``parallelize=True``); the full list is :func:`accepted_model_args`.

    Raises:
        ValueError: an unknown argument, or a bad ``state``/``window``/``seed``/``max_drafts``/
            ``gdn_fold``/``dt_limit``/``device_map``, HFLM's ``dtype``/``softmax_dtype``/
            ``max_length``/``max_batch_size``/``batch_size``, a ``pretrained`` directory
            without ``config.json``, or ``logits_cache=True`` (all before the model loads).
        ModelArgumentError: (a ValueError) the policy does not fit the loaded model, e.g. a
            policy map naming a layer that is not an SSM layer, or a window whose L x L
            matrices cannot fit the model's device for one sequence.
    """

    def __init__(self, pretrained="tiny-gdn", state="fp32", window=16, seed=0, max_drafts=0,
                 gdn_fold="recompute", dt_limit="decode", decay_stats=None, **kwargs):
        _refuse_unknown(kwargs)
        self.policy = _parse_policy(state)
        self.decay_stats = _check_decay_stats(decay_stats)
        self.window = _as_int("window", window, 1)
        self.seed = _as_int("seed", seed, 0, SEED_LIMIT - 1)
        self.max_drafts = _as_int("max_drafts", max_drafts, 0)
        _check_drafts(self.max_drafts, self.window, self.policy)
        _check_gdn_fold(gdn_fold)
        self.dt_limit = _check_dt_limit(dt_limit)
        # lm-eval's logits cache shares one forward between requests whose tokens agree; under
        # a state policy the logits also depend on where the prefill ends, so it stays off.
        _check_logits_cache(kwargs.get("logits_cache", False))
        _check_device_map(kwargs.get("device_map"))
        _check_hflm_args(kwargs)
        pretrained = _check_pretrained(pretrained)
        if "device" not in kwargs or kwargs["device"] is None:
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        kwargs["logits_cache"] = False
        kwargs.setdefault("softmax_dtype", "float32")
        self._rows: deque[_Row] | None = None  # scored rows queued in HFLM's batch order
        super().__init__(pretrained=pretrained, **kwargs)

        from replayssm_quant.adapters import apply_state_policy

        try:
            self.handle = apply_state_policy(self.model, self.policy, window=self.window,
                                             seed=self.seed, gdn_fold=gdn_fold,
                                             dt_limit=self.dt_limit, decay_stats=self.decay_stats)
        except ValueError as e:  # e.g. a policy map naming a layer the model does not have
            raise ModelArgumentError(f"model arguments do not fit {pretrained!r}: {e}") from e

    # ------------------------------------------------------------------ bookkeeping
    def get_model_info(self) -> dict:
        """HFLM's model info plus the state policy, window, seed, drafts, dt limit and the
        log-softmax dtype (``softmax_dtype``, whose default here is float32, not HFLM's None)."""
        info = super().get_model_info()
        info.update(replayssm_state=str(self.policy), replayssm_window=self.window,
                    replayssm_seed=self.seed, replayssm_max_drafts=self.max_drafts,
                    replayssm_dt_limit=str(self.dt_limit),
                    # the adapter's default (float32) differs from HFLM's (None)
                    replayssm_softmax_dtype=str(self.softmax_dtype))
        return info

    def _row(self, context_enc, continuation_enc) -> _Row:
        """The row HFLM builds for one request (left-truncated to ``max_length``) and its
        prefill length: the context, i.e. everything before the first continuation logit."""
        inp = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):][:-1]
        return _Row(tuple(inp), max(len(inp) - len(continuation_enc) + 1, 1))

    # ------------------------------------------------------------------ loglikelihood
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """HFLM's scoring, with every row's length and prefill length queued for
        ``_model_call`` in the order HFLM batches the rows (its ``Collator`` order)."""
        ordered = next(iter(Collator(requests, sort_fn=_hflm_row_order)
                            .get_batched(n=len(requests))), [])
        self._rows = deque(self._row(ctx, cont) for _, ctx, cont in ordered)
        try:
            res = super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm,
                                                override_bs=override_bs)
            unscored = len(self._rows)
        finally:
            self._rows = None
        if unscored:
            raise RuntimeError(f"internal error: lm-eval scored {len(requests) - unscored} of "
                               f"{len(requests)} loglikelihood rows through _model_call")
        return res

    def _detect_batch_size(self, requests=None, pos: int = 0):
        """HFLM's batch-size probe (``batch_size=auto``). Its test rows never consume the
        queue of scored rows; ``_model_call`` runs them through the policy path."""
        queued, self._rows = self._rows, None
        try:
            return super()._detect_batch_size(requests, pos)
        finally:
            self._rows = queued

    def _take_rows(self, inps: torch.Tensor) -> list[_Row]:
        """The next ``B`` queued rows, checked against the batch HFLM built from them."""
        B, W = inps.shape
        if len(self._rows) < B:
            raise RuntimeError(f"internal error: a batch of {B} rows but {len(self._rows)} "
                               "queued loglikelihood rows")
        rows = [self._rows.popleft() for _ in range(B)]
        got = inps.tolist()
        for b, r in enumerate(rows):
            n = len(r.tokens)
            if n > W or tuple(got[b][:n]) != r.tokens:
                raise RuntimeError(
                    f"internal error: row {b} of a batch of {B} is not the request queued for "
                    "it; this lm-eval version batches loglikelihood rows in another order "
                    "than replayssm_quant.evals.lm_eval_adapter expects")
        return rows

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of HFLM's right-padded rows: per row, exact prefill of its
        context, then the continuation teacher-forced under the policy; positions past a row's
        end are 0 and never enter the state.

        Each distinct row runs on its own (batch of 1, its own length), and identical rows
        (same tokens, same prefill) share one run, so a row's logits are bit-identical whatever
        else is in the batch: batched float GEMMs are not batch-invariant even in the
        unpatched model (CPU and GPU BLAS choose kernels by the number of rows).

        Inside ``_loglikelihood_tokens`` each row's length and prefill come from the queue.
        Otherwise (HFLM's batch-size probe, a direct call) every row is taken as full width
        with a one-token prefill, so all of it runs under the policy."""
        if self._rows is None:
            rows = [_Row(tuple(r), 1) for r in inps.tolist()]
        else:
            rows = self._take_rows(inps)
        where: dict[_Row, list[int]] = defaultdict(list)
        for b, r in enumerate(rows):
            where[r].append(b)
        logits = None
        for r, idx in where.items():
            lg = self._row_logits(inps[idx[0]: idx[0] + 1, : len(r.tokens)], r.prefill)
            if logits is None:
                logits = lg.new_zeros(inps.shape[0], inps.shape[1], lg.shape[-1])
            logits[idx, : len(r.tokens)] = lg[0]
        return logits

    def _row_logits(self, ids: torch.Tensor, prefill: int) -> torch.Tensor:
        """Logits ``[1, n, V]`` of one row ``ids [1, n]``: exact prefill of ``ids[:, :prefill]``,
        the rest teacher-forced under the policy; SR streams keyed by the row's tokens."""
        autocast = torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                  enabled=self.mixed_precision_dtype is not None)  # as HFLM
        self.handle.sequence_ids = [sequence_id(ids[0].tolist())]
        try:
            with torch.no_grad(), autocast:
                first, cache = forward_segment(self.model, ids[:, :prefill])  # exact prefill
                if ids.shape[1] == prefill:
                    return first
                rest = forward_segment(self.model, ids[:, prefill:], cache, start=prefill)[0]
                return torch.cat([first, rest], dim=1)
        finally:
            self.handle.sequence_ids = None

    # ------------------------------------------------------------------ generation
    def _model_generate(self, context, max_length: int, stop, **generation_kwargs):
        """Per row: strip left padding, prefill exactly, decode step by step under the policy;
        rows are re-assembled as ``[padded context | new tokens | pad]`` as HFLM expects."""
        mask = generation_kwargs.pop("attention_mask", None)
        new_tokens = max_length - context.shape[1]
        pad = self.tokenizer.pad_token_id
        if pad is None:
            pad = self.tokenizer.eos_token_id or 0
        outs = []
        try:
            for b in range(context.shape[0]):
                row = context[b: b + 1]
                if mask is not None:
                    row = row[:, mask[b].bool()]
                self.handle.sequence_ids = [sequence_id(row[0].tolist())]
                gen = super()._model_generate(row, row.shape[1] + new_tokens, stop,
                                              **dict(generation_kwargs))
                outs.append(gen[0, row.shape[1]:])
        finally:
            self.handle.sequence_ids = None
        width = max((o.numel() for o in outs), default=0)
        result = context.new_full((context.shape[0], context.shape[1] + width), pad)
        result[:, : context.shape[1]] = context
        for b, o in enumerate(outs):
            result[b, context.shape[1]: context.shape[1] + o.numel()] = o
        return result


#: Keys of HFLM's ``**kwargs`` that HFLM itself reads (not only forwards to
#: ``from_pretrained``): ``device_map`` picks accelerate's placement under ``parallelize=True``.
HFLM_KWARGS = ("device_map",)
#: ``device_map`` values for ``parallelize=True`` (accelerate's placement strategies).
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def accepted_model_args() -> tuple[str, ...]:
    """Names of the model arguments ``replayssm`` accepts, sorted: its own (``state``,
    ``window``, ``seed``, ``max_drafts``, ``gdn_fold``, ``pretrained``), every named
    parameter of the installed lm-eval's ``HFLM.__init__``, read from its signature, and the
    keys of HFLM's ``**kwargs`` that HFLM reads itself (:data:`HFLM_KWARGS`: ``device_map``,
    with ``parallelize=True``); other ``**kwargs``, which HFLM would pass on to
    ``from_pretrained``, are not accepted."""
    names = set(HFLM_KWARGS)
    for fn in (ReplaySSMLM.__init__, HFLM.__init__):
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return tuple(sorted(names))


def _refuse_unknown(args) -> None:
    accepted = accepted_model_args()
    unknown = [k for k in args if k not in accepted]
    if unknown:
        bad = ", ".join(f"{k}={args[k]!r}" for k in unknown)
        raise ValueError(f"unknown model argument {bad}; replayssm accepts: {', '.join(accepted)}")


def _check_dt_limit(value):
    """The ``dt_limit`` model argument as the adapters' ``DtLimit``."""
    from replayssm_quant.adapters.mamba2 import DtLimit

    try:
        return DtLimit.parse(value)
    except ValueError as e:
        raise ValueError(f"model argument {e}") from None


def _check_gdn_fold(value) -> GDNFold:
    try:
        return GDNFold.parse(value)
    except ValueError as e:
        raise ValueError(f"model argument {e}") from None


def _check_device_map(value) -> None:
    if value is not None and value not in DEVICE_MAPS:
        raise ValueError(f"model argument device_map must be one of {', '.join(DEVICE_MAPS)} "
                         f"(accelerate's placement under parallelize=True), got {value!r}")


def _check_decay_stats(value):
    """The ``decay_stats`` model argument: None or a readable decay-stats JSON file."""
    if value is None:
        return None
    try:
        load_decay_stats(str(value))
    except ValueError as e:
        raise ValueError(f"model argument decay_stats={value!r}: {e}") from None
    return str(value)


def _check_logits_cache(value) -> None:
    if value not in (False, None):
        raise ValueError(f"model argument logits_cache must be False for replayssm (a policy's "
                         f"logits depend on where the prefill ends), got {value!r}")


def _check_hflm_args(kv: dict) -> None:
    """HFLM's own arguments that it would take and fail on late (a traceback from deep in
    torch or lm-eval) or ignore: ``dtype``, ``softmax_dtype``, ``max_length``, ``batch_size``,
    ``max_batch_size`` and ``backend`` (HFLM's model class, not the kernels')."""
    _check_dtype("dtype", kv.get("dtype"), auto=True)
    _check_dtype("softmax_dtype", kv.get("softmax_dtype"), auto=False)
    for name in ("max_length", "max_batch_size"):
        if kv.get(name) is not None:
            _as_int(name, kv[name], 1)
    if kv.get("batch_size") is not None:
        _check_batch_size(kv["batch_size"], "model argument batch_size")
    backend = kv.get("backend")
    if backend is not None and backend not in HFLM_BACKENDS:
        raise ValueError(f"model argument backend={backend!r}: this is HFLM's model class, one "
                         f"of {', '.join(HFLM_BACKENDS)}; the kernels are chosen with the "
                         "environment variable REPLAYSSM_BACKEND=auto|torch|triton|cuda")


#: HFLM's ``backend`` model argument (its model class; lm-eval asserts on anything else)
HFLM_BACKENDS = ("default", "causal", "seq2seq")


#: model arguments that lm-eval's command line always passes to the model itself (from
#: ``--batch_size``, default 1, and ``--device``): in ``--model_args`` they collide ("got
#: multiple values for keyword argument"); ``max_batch_size`` collides only where
#: ``--max_batch_size`` is given (lm-eval drops its None)
CLI_OWNED_ARGS = {"batch_size": "--batch_size", "device": "--device"}


def _model_args_dict(model_args) -> dict:
    """``--model_args`` as a dict: ``"k=v,k=v"`` (parsed as lm-eval parses it), a JSON
    object string, or a dict."""
    if isinstance(model_args, str):
        s = model_args.strip()
        if s.startswith("{"):
            import json

            return json.loads(s)
        from lm_eval.utils import simple_parse_args_string

        return simple_parse_args_string(s)
    return dict(model_args)


def check_model_args(model_args: str | dict | None, *, cli: bool = False,
                     cli_max_batch_size=None) -> None:
    """Validate ReplaySSM model arguments before lm-eval loads anything.

    Args:
        model_args: ``"key=value,key=value"`` or a JSON object string (as ``--model_args``
            takes them), a dict (as lm-eval's command line parses them), or None.

        cli: the arguments come from ``replayssm-lm-eval``'s command line, whose own
            ``--batch_size`` and ``--device`` reach the model too, so these keys in
            ``--model_args`` are refused (lm-eval would fail with "got multiple values for
            keyword argument"); so is ``max_batch_size`` where ``cli_max_batch_size`` (the
            command line's ``--max_batch_size``) is not None.

    Raises:
        ValueError: an unknown key (the message lists :func:`accepted_model_args`), or a bad
            ``state``, ``window``, ``seed`` (an int in [0, 2^63)), ``max_drafts`` (also: more
            than the window), ``gdn_fold``, ``logits_cache``, ``dtype``, ``softmax_dtype``,
            ``max_length``, ``batch_size`` or ``pretrained`` (also: a directory without
            ``config.json``).
    """
    if not model_args:
        return
    kv = _model_args_dict(model_args)
    _refuse_unknown(kv)
    if cli:
        flags = dict(CLI_OWNED_ARGS)
        if cli_max_batch_size is not None:
            flags["max_batch_size"] = "--max_batch_size"
        owned = [k for k in flags if k in kv]
        if owned:
            k = owned[0]
            raise ValueError(f"model argument {k}={kv[k]!r}: lm-eval's command line passes its "
                             f"own {flags[k]} to the model, so give {flags[k]} {kv[k]} instead "
                             f"of {k}= in --model_args")
    if "state" in kv:
        _parse_policy(kv["state"])
    ints = {name: _as_int(name, kv[name], lo, hi)
            for name, lo, hi in (("window", 1, None), ("seed", 0, SEED_LIMIT - 1),
                                 ("max_drafts", 0, None)) if name in kv}
    if "max_drafts" in ints:
        defaults = inspect.signature(ReplaySSMLM.__init__).parameters
        _check_drafts(ints["max_drafts"], ints.get("window", defaults["window"].default),
                      _parse_policy(kv.get("state", defaults["state"].default)))
    _check_gdn_fold(kv.get("gdn_fold", "recompute"))
    _check_dt_limit(kv.get("dt_limit", "decode"))
    _check_logits_cache(kv.get("logits_cache", False))
    _check_device_map(kv.get("device_map"))
    _check_decay_stats(kv.get("decay_stats"))
    _check_hflm_args(kv)
    if "pretrained" in kv:
        _check_pretrained(kv["pretrained"])


def _check_pretrained(pretrained) -> str:
    """``pretrained`` resolved as the model loader will (embedded name first, then a local
    directory, then a hub id ``org/name``: ``resolve_model_path``); a bad one is refused
    before anything loads, as is a local directory without ``config.json`` (not a
    transformers model folder)."""
    if not isinstance(pretrained, str):
        return pretrained
    from replayssm_quant.models import resolve_model_path

    try:
        return str(resolve_model_path(pretrained))
    except (ValueError, OSError) as e:
        raise ValueError(f"model argument pretrained={pretrained!r}: {e}") from None


def _cli_model_args(args) -> tuple[str | None, object]:
    """``model`` and ``model_args`` of a parsed lm-eval command line, as lm-eval's
    ``EvaluatorConfig.from_cli`` resolves them (command line over ``--config`` YAML)."""
    model, margs = getattr(args, "model", None), getattr(args, "model_args", None)
    if getattr(args, "config", None):
        from lm_eval.config.evaluate_config import EvaluatorConfig

        try:
            yaml_cfg = EvaluatorConfig.load_yaml_config(args.config)
        except (OSError, ValueError, TypeError):
            return model, margs  # lm-eval reports a bad config file itself
        model = model or yaml_cfg.get("model")
        margs = margs or yaml_cfg.get("model_args")
    return model, margs


def cli(argv: list[str] | None = None) -> int:
    """``replayssm-lm-eval``: lm_eval's command line with the ``replayssm`` model registered.

    The command line is parsed by lm-eval's own parser (so ``--model_args`` takes the same
    forms: ``k=v,k=v``, ``k=v k=v`` or JSON); bad or unknown ReplaySSM model arguments are
    reported in one line with exit code 2 before anything loads.
    """
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.utils import setup_logging

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    setup_logging()  # as lm_eval.__main__.cli_evaluate, with the check between parse and run
    parser = HarnessCLI()
    _add_replayssm_help(parser)
    args = parser.parse_args()
    model, margs = _cli_model_args(args)
    try:
        if model == "replayssm":
            check_model_args(margs, cli=True,
                             cli_max_batch_size=getattr(args, "max_batch_size", None))
        check_run_args(args)
    except ValueError as e:
        print(f"replayssm-lm-eval: error: {e}", file=sys.stderr)
        return 2
    try:
        parser.execute(args)
    except KeyboardInterrupt:  # as replayssm-kl: one line, exit 130
        print("replayssm-lm-eval: interrupted (nothing saved: lm-eval writes its results "
              "when the whole evaluation ends)", file=sys.stderr)
        return 130
    except ModelArgumentError as e:  # found once the model has loaded
        print(f"replayssm-lm-eval: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        if str(e).startswith(TASK_ERROR_PREFIX):  # the kjv_* tasks' own refusals
            print(f"replayssm-lm-eval: error: {e}", file=sys.stderr)
            return 2
        if not str(e).startswith("Tasks not found"):
            raise
        print(f"replayssm-lm-eval: error: {e}{_tasks_hint(str(e))}", file=sys.stderr)
        return 2
    return 0


def replayssm_help() -> str:
    """The ``replayssm`` section of ``replayssm-lm-eval --help`` (and of ``run --help``):
    the model, its own arguments, an example, and where the package's tasks are."""
    from replayssm_quant.evals import TASKS_DIR

    return textwrap.dedent(f"""
        replayssm-lm-eval is lm-eval with the model "replayssm" registered: an HFLM whose
        Mamba-2 / Gated DeltaNet state runs under a ReplaySSM state policy.

        replayssm model arguments (--model replayssm --model_args k=v,k=v; besides HFLM's):
          pretrained=   embedded name (tiny-gdn: the default, tiny-mamba2), model
                        directory or hub id
          state=        state policy: fp32 (default) | shared:F | eager:F | read:F/rec:G,
                        or a policy map (docs/replay.md, docs/planner.md)
          window=       flush window L (default 16)
          seed=         stochastic-rounding seed (default 0)
          max_drafts=   drafts T for speculative decoding (default 0)
          gdn_fold=     recompute (default) | cached;   dt_limit=  decode (default) | clamp
          decay_stats=  per-head decays (JSON) for a policy map's decay buckets
          An unknown name is refused before anything loads, with the accepted list.

        example:
          replayssm-lm-eval --model replayssm \\
            --model_args pretrained=tiny-gdn,state=read:nvfp4/rec:fp32,window=16,seed=0 \\
            --tasks kjv_longctx_mc,kjv_longctx_gen --include_path {TASKS_DIR} --limit 8

        The kjv_* tasks need --include_path {TASKS_DIR} (in a checkout: evals/tasks).
        docs/lm-eval.md covers the paper's tasks and binning by generation length.""")


def _add_replayssm_help(parser) -> None:
    """Name the tool ``replayssm-lm-eval`` in lm-eval's help and add :func:`replayssm_help`
    to the top-level and ``run`` help (lm-eval's parser objects are private: where their
    names change, the help stays lm-eval's own)."""
    try:
        top, run = parser._parser, parser._subparsers.choices["run"]
    except (AttributeError, KeyError, TypeError):
        return
    top.prog = "replayssm-lm-eval"
    run.prog = "replayssm-lm-eval run"
    if isinstance(run.usage, str) and run.usage.startswith("lm-eval "):  # (its own usage line)
        run.usage = "replayssm-" + run.usage
    for p in (top, run):
        p.epilog = (p.epilog or "") + "\n" + replayssm_help()
        p.formatter_class = argparse.RawDescriptionHelpFormatter


def _tasks_hint(message: str) -> str:
    """A hint for lm-eval's "Tasks not found" error where the missing tasks are this
    package's (they need ``--include_path``)."""
    if "kjv_" not in message:
        return ""
    from replayssm_quant.evals import TASKS_DIR

    return (f"; this package's kjv_* tasks need --include_path {TASKS_DIR} (in a checkout: "
            "evals/tasks)")


#: how the kjv_* tasks' own errors start (evals/tasks/kjv_longctx/utils.py), reported in one
#: line with exit code 2
TASK_ERROR_PREFIX = "kjv_longctx:"
#: the options the package's kjv_* tasks read from ``--metadata`` (evals/tasks/kjv_longctx)
#: and their least values
KJV_OPTIONS = {"context_chars": 1, "n_items": 1, "n_words": 1, "item_seed": 0}


def _check_kjv_metadata(tasks, metadata) -> None:
    """Where the package's ``kjv_*`` tasks run: their ``--metadata`` options as integers of
    at least their least value (else the task code fails with a traceback after the model
    loads), and a warning naming keys that no kjv task and no model argument reads (lm-eval
    hands tasks their metadata merged with the model arguments, so other keys are allowed)."""
    if not isinstance(metadata, dict) or not tasks:
        return
    names = [str(t).strip() for t in (tasks if isinstance(tasks, (list, tuple))
                                      else str(tasks).split(","))]
    if not any(t.startswith("kjv_") for t in names):
        return
    for key, least in KJV_OPTIONS.items():
        if key in metadata:
            v = metadata[key]  # lm-eval's key=val form parses "-5" as -5.0; the tasks int() it
            try:
                n = None if isinstance(v, bool) or float(v) != int(float(v)) else int(float(v))
            except (TypeError, ValueError, OverflowError):
                n = None
            if n is None or n < least:
                shown = n if n is not None else repr(v)
                raise ValueError(f"--metadata {key}={shown}: the kjv_* tasks take an integer >= "
                                 f"{least}")
    unread = [k for k in metadata if k not in KJV_OPTIONS and k not in accepted_model_args()]
    if unread and all(t.startswith("kjv_") for t in names):  # other tasks may read them
        print(f"replayssm-lm-eval: warning: --metadata {', '.join(map(repr, unread))} is read by "
              f"no kjv_* task (they read {', '.join(KJV_OPTIONS)})", file=sys.stderr)


def check_run_args(args) -> None:
    """Refuse lm-eval command-line values that would otherwise fail late or pass silently,
    before anything loads: a ``--device`` torch cannot parse (lm-eval runs on the CPU with a
    warning), ``--device cuda...`` where torch has no CUDA device (HFLM asserts after the
    tokenizer loads), a ``--batch_size`` below 1 (HFLM takes 0 and runs), an
    ``--output_path`` that cannot be written (lm-eval logs that after the whole evaluation
    and exits 0 with nothing saved: a path ending in ``.json`` needs a writable folder, any
    other path is a folder, so not an existing file), a ``REPLAYSSM_BACKEND`` that names no
    backend or cannot run on the device (``cuda`` off a GPU), and, for the ``kjv_*`` tasks, a
    ``--metadata`` option that is not an integer of at least its least value.

    Args:
        args: the namespace of lm-eval's parser (``device``, ``batch_size``, ``output_path``,
            ``tasks``, ``metadata``; absent ones are skipped).

    Raises:
        ValueError: naming the flag, the value and what is expected.
    """
    device = getattr(args, "device", None)
    if device:
        try:
            dev = torch.device(str(device))
        except RuntimeError:
            dev = None
        # anything else HFLM logs as "Device not specified" and runs on the CPU
        if dev is None or dev.type not in ("cpu", "cuda", "mps") \
                or (dev.type == "cpu" and dev.index is not None):
            raise ValueError(f"--device {device!r}: expected cpu, cuda, cuda:N or mps (lm-eval "
                             "would run anything else on the CPU)")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available (torch "
                             f"{torch.__version__}); use --device cpu")
        mps = getattr(torch.backends, "mps", None)
        if dev.type == "mps" and not (mps is not None and mps.is_available()):
            raise ValueError(f"--device {device}: MPS is not available (torch "
                             f"{torch.__version__}); use --device cpu")
    from replayssm_quant.backend import check_setting

    # REPLAYSSM_BACKEND: a backend, and one that runs on the device (HFLM's default without
    # --device: cuda where available); otherwise a traceback at the first request
    check_setting(str(device) if device else "cuda" if torch.cuda.is_available() else "cpu")
    bs = getattr(args, "batch_size", None)
    if bs is not None:
        _check_batch_size(bs, "--batch_size")
    _check_kjv_metadata(getattr(args, "tasks", None), getattr(args, "metadata", None))
    out = getattr(args, "output_path", None)
    if out:
        # lm-eval writes <stem>_<date>.json beside a path ending in .json, and a folder of
        # results and samples at any other path (EvaluationTracker)
        if Path(out).suffix == ".json":  # written beside it: only its folder matters
            problem = output_dir_problem(Path(out).absolute().parent, "--output_path's folder")
        else:
            problem = output_dir_problem(out, "--output_path")
            if problem and Path(out).is_file():
                problem += (" (lm-eval writes a folder at a path that does not end in .json; "
                            "give a folder, or a file name ending in .json)")
        if problem:
            raise ValueError(problem)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli())
