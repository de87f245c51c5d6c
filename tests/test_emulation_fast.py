"""Batched teacher-forced emulation (window.*_emulate_fast, the adapters' path) equals the
window-by-window reference form and stepping token by token (float64: identical casts and
rounding decisions, outputs equal up to reassociation), and the batched exact scan equals the
conventional recurrence."""

import pytest
import torch

from replayssm_quant.policy import StatePolicy
from replayssm_quant.replay import core
from replayssm_quant.config import StateConfig
from replayssm_quant.replay import window as W
from replayssm_quant.replay import window_fast as WF

from _replay_inputs import Model, rel_err, run_steps, tslice

MODELS = {"mamba2": Model("mamba2"), "gdn": Model("gdn")}
POLICIES = ["fp32", "read:nvfp4/rec:fp32", "read:nvfp4+sr/rec:fp8e4m3+sr", "shared:nvfp4+sr",
            "read:nvfp4/rec:fp16+sr", "eager:fp8e4m3", "shared:mxfp4"]
SR_NAMES = ("x", "dt", "A", "B", "C", "D")


def _run(fn, M, carry, inp, **kw):
    if M.name == "mamba2":
        return fn[0](carry, *(inp[n] for n in SR_NAMES), **kw)
    return fn[1](carry, *(inp[n] for n in ("q", "k", "v", "g", "beta")), **kw)


FAST = (WF.mamba2_emulate_fast, WF.gdn_emulate_fast)
REF = (W.mamba2_emulate, W.gdn_emulate)


@pytest.mark.parametrize("name", ["mamba2", "gdn"])
@pytest.mark.parametrize("policy", POLICIES)
def test_fast_equals_reference_and_stepping(name, policy):
    """Segments of 7, 30 and 5 tokens with L = 5 (partial head, several full windows, partial
    tail): same anchors and read copies as the reference window form and as stepping (exactly
    where the anchor is rounded; to reassociation where it is exact), outputs to 1e-12."""
    M = MODELS[name]
    L, T = 5, 42
    ids = torch.tensor([7, 3])
    inp = M.inputs(B=2, T=T, seed=11)
    config = StateConfig.build(policy, window=L, seed=4)
    kw = dict(config=config)
    S0 = torch.randn(M.state_shape(inp), dtype=torch.float64)
    st = M.state(inp, policy, window=L, seed=4, layer=6, sequence_ids=ids)
    st.prefill(S0)
    cf = W.initial_carry(S0, config, layer=6, sequence_ids=ids)
    cr = W.initial_carry(S0, config, layer=6, sequence_ids=ids)
    pol = StatePolicy.parse(policy)
    done = 0
    for cut in (7, 37, T):
        seg = tslice(inp, slice(done, cut))
        yf, cf = _run(FAST, M, cf, seg, **kw)
        yr, cr = _run(REF, M, cr, seg, **kw)
        ys = run_steps(st, M.tok, inp, cut - done, t0=done)
        assert rel_err(yf, yr) < 1e-12 and rel_err(yf, ys) < 1e-12
        for a, b in ((cf.anchor, cr.anchor), (cf.anchor, st.anchor), (cf.read, st.read_copy)):
            if pol.rec.is_identity and (pol.read.is_identity or a is cf.anchor):
                assert rel_err(a, b) < 1e-13
            else:
                assert torch.equal(a, b)
        assert torch.equal(cf.flush_index, st.flush_index) and cf.h == int(st.committed[0])
        done = cut
    assert int(st.flush_index[0]) >= 8


@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_exact_scan_equals_recurrence(name):
    M = MODELS[name]
    inp = M.inputs(B=2, T=75, seed=3)
    S0 = torch.randn(M.state_shape(inp), dtype=torch.float64)
    from replayssm_quant.adapters.state import _expanded

    family = "mamba2" if name == "mamba2" else "gdn"
    la, v, k, q, beta = _expanded(family, inp)
    o, S = WF.exact_scan(S0, la, k, q, v, beta, chunk=16)
    # conventional recurrence, token by token
    R = S0
    outs = []
    for t in range(la.shape[1]):
        if beta is None:
            w = v[:, t]
        else:
            w = beta[:, t, :, None] * (v[:, t] - torch.exp(la[:, t])[..., None] * core.matvec(R, k[:, t]))
        R = torch.exp(la[:, t])[..., None, None] * R + w[..., None] * k[:, t, :, None, :]
        outs.append(core.matvec(R, q[:, t]))
    assert rel_err(o, torch.stack(outs, 1)) < 1e-12 and rel_err(S, R) < 1e-12
