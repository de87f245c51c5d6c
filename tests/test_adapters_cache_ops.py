"""Batch operations of a Hugging Face cache carry the ReplaySSM state along (beam search's
``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``) and a rollback
(``crop``) is refused. Oracle: the unpatched model's own beam search, and the state's rows
selected by hand."""

import pytest
import torch

from replayssm_quant.adapters import StatePolicyHandle, state_policy
from replayssm_quant.adapters.segments import forward_segment
from replayssm_quant.models import load_model


@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-gdn"])
def test_beam_search_under_fp32_equals_the_unpatched_model(name):
    """Under ``fp32`` the patched model is the model: its beam search (which reorders the cache
    after every step) returns the unpatched model's beams."""
    model, tok = load_model(name)
    ids = tok("And it came to pass, that the king", return_tensors="pt")
    kw = dict(num_beams=3, num_return_sequences=3, max_new_tokens=16, do_sample=False)
    with torch.no_grad():
        want = model.generate(**ids, **kw)
        with state_policy(model, "fp32", window=4):
            got = model.generate(**ids, **kw)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-gdn"])
def test_reorder_and_select_move_every_row_of_the_state(name):
    """After ``reorder_cache(idx)`` (mid-window, rounded SR policy) each layer's anchor, read
    copy, buffer, flush index and sequence ids are the old rows ``idx``; ``crop`` raises."""
    model, _ = load_model(name)
    ids = torch.randint(0, 200, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), state_policy(model, "read:nvfp4/rec:fp16+sr", window=4,
                                        sequence_ids=[5, 6, 7]):
        _, cache = forward_segment(model, ids[:, :5])
        _, cache = forward_segment(model, ids[:, 5:11], cache, start=5)  # h = 2 of 4
        before = {i: (st.anchor.clone(), st.read.clone(), st.carry.records["la"].clone(),
                      st.carry.flush_index.clone(), st.sequence_ids.clone())
                  for i, st in StatePolicyHandle.states(cache).items()}
        idx = torch.tensor([2, 0, 0])
        cache.reorder_cache(idx)
        states = StatePolicyHandle.states(cache)
        assert states.keys() == before.keys() and before
        for i, st in states.items():
            A, R, la, fi, sid = before[i]
            assert torch.equal(st.anchor, A[idx]) and torch.equal(st.read, R[idx])
            assert torch.equal(st.carry.records["la"], la[idx])
            assert torch.equal(st.carry.flush_index, fi[idx])
            assert st.sequence_ids.tolist() == [7, 5, 5]
        layer = next(iter(states))
        with pytest.raises(NotImplementedError, match="cannot be rolled back"):
            cache.layers[layer].crop(1)
