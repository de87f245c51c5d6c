"""Patched models under ``fp32`` reproduce the unpatched models (issue 4, "What correct means").

Every supported architecture, tiny random config, CPU, float32: the teacher-forced forward
(one call; and a prefill followed by emulated segments), and greedy ``generate`` (prefill then
ReplaySSM steps) match the unpatched model's logits to 1e-4.
"""

import pytest
import torch

from replayssm_quant.adapters import (
    SUPPORTED_ARCHITECTURES,
    UnsupportedArchitectureError,
    apply_state_policy,
    state_policy,
)
from replayssm_quant.adapters.segments import forward_segment
from replayssm_quant.adapters.tiny import TINY_ARCHITECTURES, TINY_VOCAB, tiny_model

TOL = 1e-4


def _ids(B, T, seed=0):
    return torch.randint(3, TINY_VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_fp32_policy_matches_unpatched(arch):
    model = tiny_model(arch)
    ids = _ids(2, 29)
    gen_kw = dict(max_new_tokens=6, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        ref = model(ids).logits
        gref = model.generate(ids[:, :5], **gen_kw)
        with apply_state_policy(model, "fp32", window=4):
            full = model(ids).logits
            parts, cache = [], None
            for a, b in ((0, 6), (6, 17), (17, 18), (18, 29)):  # prefill, segments, one step
                lg, cache = forward_segment(model, ids[:, a:b], cache, start=a)
                parts.append(lg)
            seg = torch.cat(parts, 1)
            gen = model.generate(ids[:, :5], **gen_kw)
    assert (full - ref).abs().max().item() <= TOL
    assert (seg - ref).abs().max().item() <= TOL
    assert torch.equal(gen.sequences, gref.sequences)
    for a, b in zip(gen.logits, gref.logits):
        assert (a - b).abs().max().item() <= TOL


def test_policy_changes_logits_and_remove_restores():
    """Sanity of the tests above: a low-precision policy moves the logits well beyond the
    tolerance (the SSM path matters in the tiny models), and removing the patch restores."""
    model = tiny_model("qwen3_5")
    ids = _ids(1, 24)
    with torch.no_grad():
        ref = model(ids).logits
        with state_policy(model, "shared:fp8e4m3", window=4):
            lg0, c = forward_segment(model, ids[:, :4])
            lg1, _ = forward_segment(model, ids[:, 4:], c, start=4)
        after = model(ids).logits
    assert (torch.cat([lg0, lg1], 1) - ref).abs().max().item() > 100 * TOL
    assert torch.equal(after, ref)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_unsupported_architecture_lists_supported():
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    model = T.LlamaForCausalLM(cfg)
    with pytest.raises(UnsupportedArchitectureError) as e:
        apply_state_policy(model, "fp32")
    msg = str(e.value)
    assert "'llama'" in msg
    for arch in ("mamba2", "nemotron_h", "falcon_h1", "bamba", "granitemoehybrid", "zamba2",
                 "qwen3_5", "qwen3_next", "olmo_hybrid"):
        assert arch in msg and arch in SUPPORTED_ARCHITECTURES


def test_bad_arguments():
    model = tiny_model("mamba2")
    with pytest.raises(ValueError, match="bad state policy"):
        apply_state_policy(model, "shared:fp7")
    with pytest.raises(ValueError, match="window"):
        apply_state_policy(model, "fp32", window=0)
    for bad in ("false", None, 0):  # bool("false") would be True
        with pytest.raises(ValueError, match="prefill must be True or False"):
            apply_state_policy(model, "fp32", prefill=bad)
    h = apply_state_policy(model, "fp32")
    with pytest.raises(RuntimeError, match="already applied"):
        apply_state_policy(model, "fp32")
    h.remove()
    h.remove()  # idempotent


@pytest.mark.parametrize("arch", ["mamba2", "qwen3_5"])
def test_empty_calls_and_another_batch_are_refused(arch):
    """A call with no tokens, and a call that continues a cache with another batch, are refused
    in one line naming the shapes (they failed deep inside torch or transformers' cache)."""
    model = tiny_model(arch)
    h = apply_state_policy(model, "shared:nvfp4", window=4)
    try:
        with pytest.raises(ValueError, match=r"needs \[batch, T, hidden\] with batch >= 1 and T >= 1"):
            forward_segment(model, _ids(2, 0))
        _, cache = forward_segment(model, _ids(2, 6))
        with pytest.raises(ValueError, match="this call has batch 3 but the cache it continues "
                                             "holds the state of 2 sequences"):
            forward_segment(model, _ids(3, 2), cache, start=6)
        forward_segment(model, _ids(2, 2), cache, start=6)  # the same batch goes on
    finally:
        h.remove()
