"""``apply_state_policy(decode="serving")``: one-token calls through the decode state objects.

Oracle: the default window form (itself checked against step-by-step recurrences and the
unpatched model elsewhere). On the torch path (CPU) the state objects' flush casts the same
unrounded S with the same SR streams, so after greedy ``generate`` with two flushes the first
SSM layer's checkpoints (identical inputs) are bit-identical, later layers see inputs that
differ by float reassociation, and the logits agree to float reassociation;
``fp32`` serving reproduces the unpatched model. Bad uses raise clear errors.
"""

import importlib.util

import pytest
import torch

from replayssm_quant.adapters import apply_state_policy, state_policy
from replayssm_quant.adapters.tiny import TINY_VOCAB, tiny_model

TOL = 1e-4
# With fla installed, transformers hands the *unpatched* GDN model's CPU tensors to fla's
# Triton kernels, which need CUDA tensors (seen on the device machine, 2026-12-06): the
# comparison with the unpatched model is then not runnable on a CPU model. The patched model
# never calls fla (docs/adapters.md), so the serving/window comparison still runs.
FLA_ROUTES_CPU_GDN = importlib.util.find_spec("fla") is not None
GEN = dict(max_new_tokens=11, do_sample=False, output_logits=True, return_dict_in_generate=True)


def _ids(B, T, seed=0):
    return torch.randint(3, TINY_VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def _states(cache):
    out = []
    for layer in cache.layers:
        st = getattr(layer, "replayssm", None)
        if st is not None:
            out.append(st)
    return out


def _generate_both(model, policy, ids, window):
    """Greedy ``generate`` under ``policy`` in both decode modes: ``{mode: output}``."""
    runs = {}
    with torch.no_grad():
        for mode in ("window", "serving"):
            with state_policy(model, policy, window=window, decode=mode):
                runs[mode] = model.generate(ids, **GEN)
    return runs


def _same_generation(a, b):
    """The same greedy tokens, and logits within TOL at every step."""
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert (x - y).abs().max().item() <= TOL


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
@pytest.mark.parametrize("policy", ["read:nvfp4/rec:fp16+sr", "shared:fp8e4m3", "fp32"])
def test_serving_equals_window_form(arch, policy):
    model = tiny_model(arch)
    ids = _ids(2, 6)
    runs = _generate_both(model, policy, ids, 4)
    w, s = runs["window"], runs["serving"]
    _same_generation(w, s)
    if policy == "fp32" and not (arch == "qwen3_5" and FLA_ROUTES_CPU_GDN):
        with torch.no_grad():
            ref = model.generate(ids, **GEN)
        _same_generation(s, ref)
    # after 11 steps at L = 4: two flushes, h = 2, and really the serving objects
    sw, ss = _states(w.past_key_values), _states(s.past_key_values)
    assert len(sw) >= 2 and len(sw) == len(ss)
    for a, b in zip(sw, ss):
        assert not a.serving and b.serving and b._obj is not None
        assert a.flushes == b.flushes == 2 and a.h == b.h == 2
    # first SSM layer: identical inputs, so bit-identical checkpoints
    assert torch.equal(sw[0].anchor, ss[0].anchor)
    assert torch.equal(sw[0].read, ss[0].read)


def test_serving_checkpoints_before_the_first_step_are_the_prefill_casts():
    """Reading a serving state's checkpoints right after the prefill gives the flush-0 casts,
    the same as the window form's, and stepping afterwards still works."""
    model = tiny_model("qwen3_5")
    ids = _ids(2, 6)
    outs = {}
    with torch.no_grad():
        for mode in ("window", "serving"):
            with state_policy(model, "read:nvfp4/rec:fp16+sr", window=4, decode=mode):
                out = model(ids, use_cache=True)
                sts = _states(out.past_key_values)
                outs[mode] = [(st.anchor.clone(), st.read.clone(), st.flushes, st.h) for st in sts]
                nxt = out.logits[:, -1:].argmax(-1)
                model(nxt, past_key_values=out.past_key_values, use_cache=True)
                assert all(st.h == 1 for st in sts)
    for (a, r, f, h), (a2, r2, f2, h2) in zip(outs["window"], outs["serving"], strict=True):
        assert torch.equal(a, a2) and torch.equal(r, r2) and f == f2 == 0 and h == h2 == 0


def test_serving_refuses_teacher_forcing_and_beam_search():
    model = tiny_model("qwen3_5")
    ids = _ids(1, 8)
    with torch.no_grad(), state_policy(model, "shared:nvfp4+sr", window=4, decode="serving"):
        out = model(ids[:, :4], use_cache=True)
        with pytest.raises(ValueError, match="decode='window'"):
            model(ids[:, 4:], past_key_values=out.past_key_values, use_cache=True)
        with pytest.raises(ValueError, match="decode='window'"):
            model.generate(ids[:, :4], max_new_tokens=3, num_beams=2, do_sample=False)


def test_bad_decode_mode():
    model = tiny_model("qwen3_5")
    with pytest.raises(ValueError, match="decode must be one of"):
        apply_state_policy(model, "fp32", decode="kernels")


def test_serving_per_layer_map_and_refusals_at_apply():
    """A per-layer map runs in serving mode and equals the window form; a per-head map and
    prefill=False are refused by apply_state_policy itself, naming the remedy."""
    model = tiny_model("nemotron_h")
    ids = _ids(2, 5)
    runs = _generate_both(model, "map:fp32@L3=shared:nvfp4+sr", ids, 3)
    _same_generation(runs["window"], runs["serving"])
    q = tiny_model("qwen3_5")
    with pytest.raises(ValueError, match="per-head or per-decay"):
        apply_state_policy(q, "map:fp32@L2H0-1=shared:fp8e4m3", decode="serving")
    with pytest.raises(ValueError, match="prefill=True"):
        apply_state_policy(q, "fp32", decode="serving", prefill=False)
