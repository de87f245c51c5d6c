"""Teacher-forced window form (replay/window.py) equals stepping token by token."""

import pytest
import torch

from replayssm_quant.config import StateConfig
from replayssm_quant.replay import window as W

from _replay_inputs import Model, rel_err, run_steps, tslice

MODELS = [Model("mamba2"), Model("gdn")]
IDS = ["mamba2", "gdn"]
POLICIES = ["fp32", "read:nvfp4+sr/rec:fp8e4m3+sr", "shared:nvfp4+sr",
            "read:nvfp4/rec:fp16+sr", "eager:fp8e4m3"]


def _emulate(M, carry, inp, **kw):
    if M.name == "mamba2":
        return W.mamba2_emulate(carry, *(inp[n] for n in ("x", "dt", "A", "B", "C", "D")), **kw)
    return W.gdn_emulate(carry, *(inp[n] for n in ("q", "k", "v", "g", "beta")), **kw)


@pytest.mark.parametrize("M,fold", [(MODELS[0], False), (MODELS[1], False), (MODELS[1], True)],
                         ids=["mamba2", "gdn", "gdn-cached-fold"])
@pytest.mark.parametrize("policy", POLICIES)
def test_window_form_equals_stepping(M, policy, fold):
    """float64, 3 windows plus a partial one across two segment boundaries (one mid-window):
    identical checkpoints and flush indices (same flush routine, same inputs) and outputs
    equal up to reassociation."""
    L, T = 5, 18
    inp = M.inputs(B=3, T=T, seed=20)
    extra = dict(fold_cached_corrections=True) if fold else {}
    config = StateConfig.build(policy, window=L, seed=4, fold="cached" if fold else "recompute")
    ids = torch.tensor([7, 3, 9])
    S0 = torch.randn(M.state_shape(inp), dtype=torch.float64)
    st = M.state(inp, policy, window=L, seed=4, layer=6, sequence_ids=ids, **extra)
    st.prefill(S0)
    carry = W.initial_carry(S0, config, layer=6, sequence_ids=ids)
    done = 0
    for cut in (7, 15, T):  # segments of 7, 8 and 3 tokens
        y, carry = _emulate(M, carry, tslice(inp, slice(done, cut)), config=config)
        y_step = run_steps(st, M.tok, inp, cut - done, t0=done)
        assert rel_err(y, y_step) < 1e-12
        if policy == "fp32" and fold:  # cached read-path corrections are summed in another
            # order (row by row vs one solve) and nothing rounds them away
            assert rel_err(carry.anchor, st.anchor) < 1e-13
        else:
            assert torch.equal(carry.anchor, st.anchor) and torch.equal(carry.read, st.read_copy)
        assert torch.equal(carry.flush_index, st.flush_index)
        assert carry.h == int(st.committed[0])
        done = cut


def test_window_errors():
    M = MODELS[0]
    inp = M.inputs(B=1, T=6)
    config = StateConfig.build("fp32", window=4)
    carry = W.initial_carry(torch.zeros(M.state_shape(inp), dtype=torch.float64), config)
    args = [inp[n] for n in ("x", "dt", "A", "B", "C", "D")]
    with pytest.raises(ValueError, match="exceed the window"):
        W.mamba2_window(carry, *args, config=config)
    with pytest.raises(ValueError, match="window must be an int >= 1, got 0"):
        StateConfig.build("fp32", window=0)
    assert StateConfig.build("eager:nvfp4", window=16).window == 1
    with pytest.raises(TypeError, match="parsed StatePolicy"):
        W.initial_carry(torch.zeros(M.state_shape(inp), dtype=torch.float64),
                        StateConfig("fp32", 4))
