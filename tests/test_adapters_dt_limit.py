"""One Mamba-2 dt-limit rule on every call (issue 12 item 9).

Hugging Face clamps dt to the mixer's ``time_step_limit`` in its chunked scan and not in its
single-token decode step. The adapter applies one rule (``dt_limit="decode"``: never clamp,
default; ``"clamp"``: always clamp) to prefill, emulation and steps. Every Mamba-2-family
architecture, float64, with an active limit set on every mixer (checked: the two oracles below
differ by far more than the tolerance).

Oracles: for ``clamp`` the unpatched model's chunked forward of the whole sequence; for
``decode`` the unpatched model's own token-by-token decode (its recurrent step ignores the
limit; only its first token goes through the chunked scan, so that one call runs with the
limit lifted). The unpatched model computes its SSM in float32, hence TOL_HF.
"""

import contextlib
import math

import pytest
import torch

from replayssm_quant.adapters import SUPPORTED_ARCHITECTURES, DtLimit, apply_state_policy
from replayssm_quant.adapters.segments import forward_segment
from replayssm_quant.adapters.tiny import TINY_ARCHITECTURES, TINY_VOCAB, tiny_model

ARCHS = [a for a in TINY_ARCHITECTURES if SUPPORTED_ARCHITECTURES[a] == "mamba2"]
LIMIT = (0.3, 1.0)  # tiny_model's dt = softplus(dt_raw + dt_bias) straddles both ends
N, L = 12, 4
TOL = 1e-5  # patched vs patched, float64 (HF's float32 norms and attention leave float32 ulps)
TOL_HF = 1e-4  # patched vs the unpatched model (float32 SSM inside)


def _ids(B, T, seed=0):
    return torch.randint(3, TINY_VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _mixers(model):
    return [m for m in model.modules() if hasattr(m, "time_step_limit") and hasattr(m, "dt_bias")]


@contextlib.contextmanager
def _limit(model, limit):
    mixers = _mixers(model)
    old = [m.time_step_limit for m in mixers]
    for m in mixers:
        m.time_step_limit = limit
    try:
        yield
    finally:
        for m, o in zip(mixers, old):
            m.time_step_limit = o


def _model(arch):
    model = tiny_model(arch, dtype=torch.float64)
    for m in _mixers(model):
        m.time_step_limit = LIMIT
    return model


def _segments(model, ids, cuts):
    """Logits of ``ids`` run as consecutive calls split at ``cuts`` (the first is the prefill)."""
    out, cache, a = [], None, 0
    for b in list(cuts) + [ids.shape[1]]:
        if b > a:
            lg, cache = forward_segment(model, ids[:, a:b], cache, start=a)
            out.append(lg)
            a = b
    return torch.cat(out, 1)


def _unpatched_decode(model, ids):
    """The unpatched model token by token: the first token through its chunked scan (limit
    lifted, as its decode step has none), then its recurrent decode step with the limit set."""
    with _limit(model, (0.0, math.inf)):
        lg, cache = forward_segment(model, ids[:, :1])
    out = [lg]
    for t in range(1, ids.shape[1]):
        lg, cache = forward_segment(model, ids[:, t:t + 1], cache, start=t)
        out.append(lg)
    return torch.cat(out, 1)


@pytest.mark.parametrize("rule", ["decode", "clamp"])
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_k_then_emulate_equals_emulate(arch, rule):
    """Prefill k + emulate N - k equals emulate N (zero state, no prefill) for every k, and
    prefill k + single steps equals them too: the same rule in prefill, emulation and step."""
    model = _model(arch)
    ids = _ids(2, N)
    with torch.no_grad():
        with apply_state_policy(model, "fp32", window=L, prefill=False, dt_limit=rule):
            ref = _segments(model, ids, [0])
        with apply_state_policy(model, "fp32", window=L, dt_limit=rule):
            for k in range(1, N):
                got = _segments(model, ids, [k])
                assert (got - ref).abs().max().item() <= TOL, k
            got = _segments(model, ids, range(5, N))  # prefill 5, then one token per call
            assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_rules_match_their_unpatched_oracles(arch):
    model = _model(arch)
    ids = _ids(2, N)
    with torch.no_grad():
        clamp_ref = model(ids).logits  # chunked scan: clamps
        decode_ref = _unpatched_decode(model, ids)  # recurrent step: no clamp
        assert (clamp_ref - decode_ref).abs().max().item() > 1e-2  # the limit is active
        cuts = (5, 7, 8, 9)  # prefill, an emulated segment, single steps, a final segment
        with apply_state_policy(model, "fp32", window=L) as h:  # default rule
            assert h.dt_limit is DtLimit.DECODE
            decode = _segments(model, ids, cuts)
        with apply_state_policy(model, "fp32", window=L, dt_limit="clamp") as h:
            lg, cache = forward_segment(model, ids[:, :5])
            h.dt_limit = "decode"  # a cache keeps the rule its state was created with
            rest = _segments_from(model, ids, cache, 5)
            clamp = torch.cat([lg, rest], 1)
    assert (decode - decode_ref).abs().max().item() <= TOL_HF
    assert (clamp - clamp_ref).abs().max().item() <= TOL_HF


def _segments_from(model, ids, cache, start):
    out = []
    for a, b in ((start, start + 2), (start + 2, start + 3), (start + 3, ids.shape[1])):
        lg, cache = forward_segment(model, ids[:, a:b], cache, start=a)
        out.append(lg)
    return torch.cat(out, 1)


@pytest.mark.parametrize("rule", ["decode", "clamp"])
def test_steps_equal_emulation_under_a_lossy_policy(rule):
    """Under SR casts the stepped and the emulated path still see the same dt (same rule)."""
    model = _model("nemotron_h")
    ids = _ids(2, 5 + 3 * L + 2)
    with torch.no_grad(), apply_state_policy(model, "shared:nvfp4+sr", window=L, seed=3,
                                             dt_limit=rule):
        em = _segments(model, ids, [5, 11])
        st = _segments(model, ids, range(5, ids.shape[1]))
    assert (em - st).abs().max().item() <= 1e-4


def test_dt_limit_names():
    model = tiny_model("mamba2")
    with pytest.raises(ValueError, match=r"dt_limit must be one of 'decode', 'clamp', got 'clip'"):
        apply_state_policy(model, "fp32", dt_limit="clip")
    with apply_state_policy(model, "fp32", dt_limit=" CLAMP ") as h:
        assert h.dt_limit is DtLimit.CLAMP and str(h.dt_limit) == "clamp"
        with pytest.raises(ValueError, match=r"got None"):
            h.dt_limit = None
        h.dt_limit = DtLimit.DECODE
        assert str(h.dt_limit) == "decode" and "dt_limit=decode" in repr(h)
