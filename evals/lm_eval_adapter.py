"""lm-evaluation-harness adapter: run lm-eval tasks with the SSM state under a ReplaySSM policy.

Usage (exactly lm_eval's command line, with our model registered)::

    replayssm-lm-eval --model replayssm \\
        --model_args pretrained=tiny-gdn,state=read:nvfp4/rec:fp16+sr,window=16,seed=0 \\
        --tasks kjv_longctx_mc --include_path evals/tasks --device cpu --limit 8

The model class subclasses lm-eval's ``HFLM`` and overrides only what the state semantics
need (DESIGN.md section 3):

* ``loglikelihood`` / ``loglikelihood_rolling``: HFLM batches and scores as usual; each row's
  context is prefilled exactly (the chunked scan in the model's precision, its final state
  cast as flush 0), and the continuation is run teacher-forced under the policy through the
  adapters' window-by-window emulation (``replayssm_quant.adapters``), which equals stepping
  through the continuation token by token.
* ``generate_until``: the prompt is prefilled exactly, then ``model.generate`` decodes step by
  step with ReplaySSM state under the policy. Rows are generated one at a time so left
  padding never enters the recurrent state.

Stochastic-rounding streams are keyed by a hash of each row's tokens (not its batch position),
so scores do not depend on batching and are reproducible for a fixed ``seed``.

lm-eval 0.4.13 has no plugin (entry-point) discovery of models, so ``replayssm-lm-eval``
imports this module (which registers ``replayssm``) and hands the command line to lm_eval.
``pyproject.toml`` also declares the ``lm_eval.models`` entry point for versions that scan it.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import torch

from replayssm_quant.adapters import sequence_id
from replayssm_quant.adapters.segments import forward_segment
from replayssm_quant.policy import StatePolicy

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without the eval extra
    raise ImportError(
        "evals.lm_eval_adapter needs lm-eval: pip install 'replayssm-quant[eval]'"
    ) from e

__all__ = ["ReplaySSMLM", "cli", "POLICY_GRAMMAR", "sequence_id", "check_model_args"]

POLICY_GRAMMAR = (
    "fp32 | shared:F | eager:F | read:F/rec:G, with F, G in "
    "{fp32, bf16, fp16, fp8e4m3, fp8e5m2, nvfp4, mxfp8, mxfp4}, each optionally followed by "
    "'+sr' (e.g. state=read:nvfp4/rec:fp16+sr)"
)


def _parse_policy(state) -> StatePolicy:
    try:
        return StatePolicy.parse(state)
    except ValueError as e:
        raise ValueError(f"bad model argument state={state!r}: {e}. Grammar: {POLICY_GRAMMAR}") from e


def _as_int(name: str, value, minimum: int) -> int:
    """An integer model argument (lm-eval passes strings), with a clear error."""
    try:
        if isinstance(value, bool) or isinstance(value, float):
            raise ValueError
        v = int(str(value).strip())
    except (TypeError, ValueError):
        raise ValueError(f"model argument {name} must be an integer >= {minimum}, got {value!r}") from None
    if v < minimum:
        raise ValueError(f"model argument {name} must be an integer >= {minimum}, got {value!r}")
    return v


@register_model("replayssm")
class ReplaySSMLM(HFLM):
    """HFLM with every SSM layer's state under a ReplaySSM precision policy.

    Model arguments (``--model_args``), parsed once at construction:
        pretrained: hub id, local directory, or an embedded name (``tiny-gdn``, ``tiny-mamba2``).
        state: policy string (``fp32`` default; grammar in :data:`POLICY_GRAMMAR`).
        window: flush window L (default 16). seed: SR seed (default 0).
        max_drafts: drafts T for speculative decoding studies (accepted and recorded; lm-eval's
            generate path decodes one token at a time, so it has no effect there).
        gdn_fold: ``recompute`` (default) or ``cached`` (the unstable variant, for study).
        every other argument: as HFLM (``device``, ``dtype``, ``batch_size``, ...).

    Raises:
        ValueError: bad ``state``/``window``/``seed``/``max_drafts`` (before the model loads).
    """

    def __init__(self, pretrained="tiny-gdn", state="fp32", window=16, seed=0, max_drafts=0,
                 gdn_fold="recompute", **kwargs):
        self.policy = _parse_policy(state)
        self.window = _as_int("window", window, 1)
        self.seed = _as_int("seed", seed, 0)
        self.max_drafts = _as_int("max_drafts", max_drafts, 0)
        if gdn_fold not in ("recompute", "cached"):
            raise ValueError(f"model argument gdn_fold must be 'recompute' or 'cached', got {gdn_fold!r}")
        if isinstance(pretrained, str) and not os.path.isdir(pretrained):
            from replayssm_quant.models import resolve_model_path

            pretrained = str(resolve_model_path(pretrained))
        if "device" not in kwargs or kwargs["device"] is None:
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        # lm-eval's logits cache shares one forward between requests whose tokens agree; under
        # a state policy the logits also depend on where the prefill ends, so it is off.
        kwargs["logits_cache"] = False
        super().__init__(pretrained=pretrained, **kwargs)

        from replayssm_quant.adapters import apply_state_policy

        self.handle = apply_state_policy(self.model, self.policy, window=self.window,
                                         seed=self.seed, gdn_fold=gdn_fold)
        self._prefill: dict[tuple, int] = {}
        self._lengths: list[int] = []

    # ------------------------------------------------------------------ bookkeeping
    def get_model_info(self) -> dict:
        info = super().get_model_info()
        info.update(replayssm_state=str(self.policy), replayssm_window=self.window,
                    replayssm_seed=self.seed, replayssm_max_drafts=self.max_drafts)
        return info

    def _row_input(self, context_enc, continuation_enc):
        """(input tokens, prefill length) of one request, as HFLM builds its row."""
        whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
        inp = whole[:-1]
        prefill = max(len(inp) - len(continuation_enc) + 1, 1)
        return tuple(inp), prefill

    # ------------------------------------------------------------------ loglikelihood
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        """HFLM's scoring, with the prefill length of every row made known to ``_model_call``.

        Requests whose input rows coincide but whose prefill differs are scored in separate
        rounds so that a row always identifies its prefill length.
        """
        rounds: list[list[int]] = []
        seen: list[dict] = []
        for i, (_, ctx, cont) in enumerate(requests):
            key, pre = self._row_input(ctx, cont)
            for r, table in enumerate(seen):
                if table.get(key, pre) == pre:
                    table[key] = pre
                    rounds[r].append(i)
                    break
            else:
                seen.append({key: pre})
                rounds.append([i])
        out: list = [None] * len(requests)
        for idx, table in zip(rounds, seen):
            self._prefill = table
            self._lengths = sorted({len(k) for k in table}, reverse=True)
            try:
                res = super()._loglikelihood_tokens([requests[i] for i in idx],
                                                    disable_tqdm=disable_tqdm, override_bs=override_bs)
            finally:
                self._prefill, self._lengths = {}, []
            for i, r in zip(idx, res):
                out[i] = r
        return out

    def _lookup(self, row: list[int]) -> tuple[int, int]:
        for n in self._lengths:
            pre = self._prefill.get(tuple(row[:n]))
            if pre is not None:
                return n, pre
        raise RuntimeError("internal error: a scored row has no registered prefill length")

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits ``[B, T, V]`` of right-padded rows: per row, exact prefill of its context, then
        the continuation teacher-forced under the policy (padding positions are left 0)."""
        if not self._prefill:  # e.g. HFLM's batch-size probe
            return super()._model_call(inps, attn_mask, labels)
        rows = inps.tolist()
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for b, row in enumerate(rows):
            groups[self._lookup(row)].append(b)
        logits = None
        with torch.no_grad():
            for (n, pre), idx in groups.items():
                ids = inps[idx, :n]
                self.handle.sequence_ids = [sequence_id(rows[b][:n]) for b in idx]
                first, cache = forward_segment(self.model, ids[:, :pre])  # exact prefill
                parts = [first]
                if n > pre:  # the continuation, teacher-forced under the policy
                    parts.append(forward_segment(self.model, ids[:, pre:n], cache, start=pre)[0])
                lg = torch.cat(parts, dim=1)
                if logits is None:
                    logits = lg.new_zeros(inps.shape[0], inps.shape[1], lg.shape[-1])
                logits[idx, :n] = lg
        self.handle.sequence_ids = None
        return logits

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
        for b in range(context.shape[0]):
            row = context[b: b + 1]
            if mask is not None:
                row = row[:, mask[b].bool()]
            self.handle.sequence_ids = [sequence_id(row[0].tolist())]
            gen = super()._model_generate(row, row.shape[1] + new_tokens, stop,
                                          **dict(generation_kwargs))
            outs.append(gen[0, row.shape[1]:])
        self.handle.sequence_ids = None
        width = max((o.numel() for o in outs), default=0)
        result = context.new_full((context.shape[0], context.shape[1] + width), pad)
        result[:, : context.shape[1]] = context
        for b, o in enumerate(outs):
            result[b, context.shape[1]: context.shape[1] + o.numel()] = o
        return result


def _model_args(argv: list[str]) -> tuple[str | None, str | None]:
    """The ``--model`` and ``--model_args`` values of an lm_eval command line."""
    vals: dict[str, str | None] = {"--model": None, "--model_args": None}
    for i, tok in enumerate(argv):
        for flag in vals:
            if tok == flag and i + 1 < len(argv):
                vals[flag] = argv[i + 1]
            elif tok.startswith(flag + "="):
                vals[flag] = tok[len(flag) + 1:]
    return vals["--model"], vals["--model_args"]


def check_model_args(model_args: str | None) -> None:
    """Validate the ReplaySSM model arguments of a ``--model_args`` string before lm-eval runs.

    Raises:
        ValueError: a bad ``state``, ``window``, ``seed``, ``max_drafts`` or ``gdn_fold``.
    """
    if not model_args:
        return
    s = model_args.strip()
    if s.startswith("{"):
        import json

        kv = {k: str(v) for k, v in json.loads(s).items()}
    else:
        kv = dict(p.split("=", 1) for p in s.split(",") if "=" in p)
    if "state" in kv:
        _parse_policy(kv["state"])
    for name, minimum in (("window", 1), ("seed", 0), ("max_drafts", 0)):
        if name in kv:
            _as_int(name, kv[name], minimum)
    if kv.get("gdn_fold", "recompute") not in ("recompute", "cached"):
        raise ValueError(f"model argument gdn_fold must be 'recompute' or 'cached', got {kv['gdn_fold']!r}")


def cli(argv: list[str] | None = None) -> int:
    """``replayssm-lm-eval``: lm_eval's command line with the ``replayssm`` model registered.

    Bad ReplaySSM model arguments (``--model replayssm --model_args state=...``) are reported
    in one line with exit code 2 before lm-eval starts.
    """
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    model, margs = _model_args(sys.argv[1:])
    if model == "replayssm":
        try:
            check_model_args(margs)
        except ValueError as e:
            print(f"replayssm-lm-eval: error: {e}", file=sys.stderr)
            return 2
    cli_evaluate()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(cli())
