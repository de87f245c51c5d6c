"""Both embedded models run through every state policy (issue 5): every format as a shared
checkpoint (RTN and SR), as the conventional eager baseline, and as a read copy over an FP32
recurrence anchor, plus mixed separate policies. Each run prefills exactly, then emulates two
windows teacher-forced, then decodes steps; logits must stay finite and close to FP32-state
decoding (mean KL bounded), and the two decoding modes must agree with each other."""

import pytest
import torch

from replayssm_quant import FORMAT_NAMES
from replayssm_quant.adapters import state_policy
from replayssm_quant.adapters.segments import forward_segment
from replayssm_quant.models import EMBEDDED_MODELS, load_model

TEXT = ("Now after the death of Moses the servant of the LORD it came to pass, that the LORD spake "
        "unto Joshua the son of Nun, Moses' minister, saying, Moses my servant is dead; now therefore "
        "arise, go over this Jordan, thou, and all this people.")
POLICIES = ([f"shared:{f}" for f in FORMAT_NAMES] + [f"shared:{f}+sr" for f in FORMAT_NAMES[1:]]
            + [f"eager:{f}" for f in FORMAT_NAMES[1:]] + [f"read:{f}/rec:fp32" for f in FORMAT_NAMES[1:]]
            + ["read:nvfp4/rec:fp16+sr", "read:fp8e4m3/rec:fp8e4m3+sr", "read:mxfp4+sr/rec:bf16"])
WINDOW = 4


def _run(model, ids, policy):
    """Logits of the last 2*WINDOW+2 positions: prefill, teacher-forced segment, 2 steps."""
    pre, seg = ids[:, :-(2 * WINDOW + 2)], ids[:, -(2 * WINDOW + 2):-2]
    with state_policy(model, policy, window=WINDOW, seed=0), torch.no_grad():
        logits, cache = forward_segment(model, pre)  # exact prefill
        parts = [logits[:, -1:]]
        logits, cache = forward_segment(model, seg, cache, start=pre.shape[1])  # teacher-forced
        parts.append(logits)
        for t in range(2):  # steps
            pos = ids.shape[1] - 2 + t
            logits, cache = forward_segment(model, ids[:, pos:pos + 1], cache, start=pos)
            parts.append(logits)
    return torch.cat(parts, 1)[:, :-1].double()


@pytest.fixture(scope="module", params=sorted(EMBEDDED_MODELS))
def model_ids(request):
    model, tok = load_model(request.param)
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :40]
    return model, ids, _run(model, ids, "fp32")


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_runs(model_ids, policy):
    model, ids, ref = model_ids
    got = _run(model, ids, policy)
    assert got.shape == ref.shape and torch.isfinite(got).all(), policy
    kl = (ref.softmax(-1) * (ref.log_softmax(-1) - got.log_softmax(-1))).sum(-1)
    assert kl.mean().item() < 0.5, (policy, kl.mean().item())
    if policy in ("shared:fp32",):
        assert kl.abs().max().item() < 1e-6
