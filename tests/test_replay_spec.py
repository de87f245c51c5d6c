"""Speculative decoding: verify / commit (issue 3 tests 4 and 5), both models."""

import pytest
import torch

from replayssm_quant.replay import core

from _replay_inputs import Model, bslice, rel_err

MODELS = [Model("mamba2"), Model("gdn")]
IDS = ["mamba2", "gdn"]

# accepted drafts per round (rows: sequences), T = 3: 0, 1, 2 and 3 each occur at least twice,
# and flushes (early and at h = L) happen at different rounds for different sequences.
ACCEPT = torch.tensor([[0, 1, 2, 3, 0, 3, 1],
                       [3, 3, 3, 3, 3, 3, 3],
                       [1, 0, 2, 2, 1, 3, 0],
                       [2, 3, 0, 1, 3, 2, 2]])


@pytest.mark.parametrize("M", MODELS, ids=IDS)
@pytest.mark.parametrize("policy", ["fp32", "read:nvfp4+sr/rec:fp16+sr", "shared:fp8e4m3+sr"])
def test_spec_equals_stepwise_of_accepted(M, policy):
    """Outputs and checkpoints of verify/commit equal stepwise decoding of only the accepted
    tokens (each sequence alone, flushing where the early-flush rule flushed), float64."""
    L, T = 5, 3
    B, R = ACCEPT.shape
    inp = M.inputs(B=B, T=R * T, seed=12)
    kw = dict(seed=2, layer=1)
    st = M.state(inp, policy, window=L, max_drafts=T, **kw)
    refs = [M.state(bslice(inp, slice(b, b + 1)), policy, window=L, sequence_ids=[b], **kw)
            for b in range(B)]
    h = [0] * B
    for r in range(R):
        drafts = slice(r * T, (r + 1) * T)
        y = st.verify(*M.tok(inp, drafts))
        assert y.shape[1] == T
        st.commit(ACCEPT[:, r])
        for b in range(B):
            if h[b] + T > L:
                refs[b].flush()
                h[b] = 0
            for i in range(int(ACCEPT[b, r])):
                t = r * T + i
                y_ref = refs[b].step(*M.tok(inp, t, b=slice(b, b + 1)))
                assert rel_err(y[b, i], y_ref[0]) < 1e-12, (b, r, i)
                h[b] = (h[b] + 1) % L
            if policy == "fp32":  # nothing rounds: the two paths differ by reassociation only
                assert rel_err(st.anchor[b], refs[b].anchor[0]) < 1e-13, (b, r)
            else:  # rounding absorbs reassociation: same flush inputs, same bits (float64)
                assert torch.equal(st.anchor[b], refs[b].anchor[0]), (b, r)
                assert torch.equal(st.read_copy[b], refs[b].read_copy[0]), (b, r)
            assert int(st.committed[b]) == h[b] == int(refs[b].committed[0])
            assert int(st.flush_index[b]) == int(refs[b].flush_index[0])
    assert len(set(st.flush_index.tolist())) > 1  # sequences flushed at different times


@pytest.mark.parametrize("M", MODELS, ids=IDS)
def test_spec_fp32_matches_recurrence(M):
    """Under fp32, verify/commit outputs equal the float64 recurrence of the accepted tokens."""
    L, T = 5, 3
    B, R = ACCEPT.shape
    inp = M.inputs(B=B, T=R * T, seed=13)
    st = M.state(inp, "fp32", window=L, max_drafts=T)
    outs = [[] for _ in range(B)]
    toks = [[] for _ in range(B)]
    for r in range(R):
        y = st.verify(*M.tok(inp, slice(r * T, (r + 1) * T)))
        st.commit(ACCEPT[:, r])
        for b in range(B):
            for i in range(int(ACCEPT[b, r])):
                outs[b].append(y[b, i])
                toks[b].append(r * T + i)
    for b in range(B):
        sub = bslice(inp, slice(b, b + 1))
        idx = torch.tensor(toks[b])
        sub = {n: (t[:, idx] if t.dim() > 1 else t) for n, t in sub.items()}
        y_ref, _ = M.recurrent(sub)
        assert rel_err(torch.stack(outs[b]), y_ref[0]) < 1e-12


@pytest.mark.parametrize("M", MODELS, ids=IDS)
def test_early_flush_rule(M):
    L, T = 5, 3
    inp = M.inputs(B=2, T=12, seed=14)
    st = M.state(inp, "read:nvfp4/rec:fp16", window=L, max_drafts=T)
    for t in range(2):
        st.step(*M.tok(inp, t))
    fi = st.flush_index
    st.verify(*M.tok(inp, slice(2, 5)))  # h + T = 5 = L: no early flush
    assert st.committed.tolist() == [2, 2] and torch.equal(st.flush_index, fi)
    st.commit(1)  # h = 3
    a = st.anchor
    st.verify(*M.tok(inp, slice(5, 8)))  # h + T = 6 > L: the 3 committed records flush first
    assert st.committed.tolist() == [0, 0] and torch.equal(st.flush_index, fi + 1)
    assert not torch.equal(st.anchor, a)
    st.commit(3)  # h = 3 < L: no flush
    assert st.committed.tolist() == [3, 3] and torch.equal(st.flush_index, fi + 1)


@pytest.mark.parametrize("M", MODELS, ids=IDS)
@pytest.mark.parametrize("history", [0, 2], ids=["empty", "h2"])
def test_accept_zero_is_free(M, history, monkeypatch):
    """Accepting 0 leaves the checkpoints bit-identical and runs no solve (also with an empty
    history); the rejected drafts are overwritten by the next append."""
    L, T = 8, 3
    inp = M.inputs(B=2, T=12, seed=15)
    st = M.state(inp, "read:nvfp4+sr/rec:fp8e4m3+sr", window=L, max_drafts=T)
    S0 = torch.randn(M.state_shape(inp), dtype=torch.float64)
    st.prefill(S0)
    for t in range(history):
        st.step(*M.tok(inp, t))
    a, r, h, fi = st.anchor, st.read_copy, st.committed, st.flush_index
    st.verify(*M.tok(inp, slice(5, 8)))
    calls = []
    real = core.solve_corrections
    monkeypatch.setattr(core, "solve_corrections", lambda *a, **k: calls.append(1) or real(*a, **k))
    st.commit(0)
    assert calls == []
    assert torch.equal(st.anchor, a) and torch.equal(st.read_copy, r)
    assert torch.equal(st.committed, h) and torch.equal(st.flush_index, fi)
    # continuing equals a state that never saw the drafts
    ref = M.state(inp, "read:nvfp4+sr/rec:fp8e4m3+sr", window=L, max_drafts=T)
    ref.prefill(S0)
    for t in range(history):
        ref.step(*M.tok(inp, t))
    for t in range(history, history + 4):
        assert rel_err(st.step(*M.tok(inp, t)), ref.step(*M.tok(inp, t))) < 1e-12


@pytest.mark.parametrize("M", MODELS, ids=IDS)
@pytest.mark.parametrize("h,T", [(3, 4), (4, 4), (0, 1)], ids=["inside", "draft-at-L", "one"])
def test_verify_equals_materialised_states(M, h, T):
    """Test 5: output-only verification equals outputs read from materialised intermediate
    states: the recurrence run from R over the committed records and the drafts (a draft that
    lands on slot L reads the flushed state, i.e. the recurrence run from A)."""
    L = 8
    inp = M.inputs(B=2, T=h + T, seed=16)
    st = M.state(inp, "read:nvfp4/rec:fp16", window=L, max_drafts=4)
    st.prefill(torch.randn(M.state_shape(inp), dtype=torch.float64))
    for t in range(h):
        st.step(*M.tok(inp, t))
    A, R = st.anchor, st.read_copy
    y = st.verify(*M.tok(inp, slice(h, h + T)))
    y_R, _ = M.recurrent(inp, initial_state=R)
    y_A, _ = M.recurrent(inp, initial_state=A)
    want = y_R[:, h:h + T].clone()
    if h + T == L:
        want[:, -1] = y_A[:, -1]
    assert rel_err(y, want) < 1e-12
    assert rel_err(y_R[:, h:], y_A[:, h:]) > 1e-4  # R and A really differ here


@pytest.mark.parametrize("M", MODELS, ids=IDS)
def test_verify_limits(M):
    inp = M.inputs(B=2, T=6, seed=17)
    st = M.state(inp, "fp32", window=4, max_drafts=2)
    with pytest.raises(ValueError, match="3 drafts"):
        st.verify(*M.tok(inp, slice(0, 3)))
    with pytest.raises(ValueError, match="before verify"):
        st.commit(torch.tensor([0, 0]))
    st.verify(*M.tok(inp, slice(0, 2)))
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        st.commit(torch.tensor([0, 3]))
    st.commit(torch.tensor([2, 1]))
    with pytest.raises(ValueError, match="commit\\(\\) called twice"):
        st.commit(torch.tensor([0, 0]))
    assert st.committed.tolist() == [2, 1]
    y = st.verify(*M.tok(inp, slice(0, 0)))  # zero drafts: allowed, nothing to accept
    assert y.shape[1] == 0
    st.commit(0)
    with pytest.raises(ValueError, match="max_drafts"):
        M.state(inp, "eager:fp16", window=4, max_drafts=2)  # eager runs with window 1
