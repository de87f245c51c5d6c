"""Model-generic bodies of the ReplaySSM acceptance tests (issue 3), called from
test_replay_mamba2.py and test_replay_gdn.py with a :class:`Model` handle."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from replayssm_quant import quantize, stream_key
from replayssm_quant.quant import PackedTensor

from _replay_inputs import rel_err, run_steps, same_snapshot, snapshot

FORMATS_READ = ["fp32", "fp16", "fp8e4m3", "nvfp4", "nvfp4+sr"]


def check_fp32_matches_float64_recurrence(M, L, T=64):
    """Test 1: under fp32 (float32 working dtype) the outputs equal the float64 stepwise
    recurrence to 1e-5 relative, grouped heads, batch 2; the anchor after the last flush too."""
    inp64 = M.inputs(T=T, seed=L)
    inp32 = {n: t.float() for n, t in inp64.items()}
    y_ref, S_ref = M.recurrent(inp64)
    st = M.state(inp32, "fp32", window=L)
    y = run_steps(st, M.tok, inp32, T)
    assert y.dtype == torch.float32
    assert rel_err(y.double(), y_ref) < 1e-5
    assert int(st.committed.max()) == T % L
    if T % L == 0:
        assert rel_err(st.anchor.double(), S_ref) < 1e-5
    assert st.read_nbytes == 0 and st.anchor_nbytes == 4 * S_ref.numel()


def window_decay_sum(M, inp, L):
    """The largest |sum of log decays| over a window of L records (float64): what the
    window forms' cumulative sums c = cumsum(la) reach before they are differenced."""
    la = inp["g"] if M.name == "gdn" else inp["dt"] * inp["A"]
    la = la.double()
    T = la.shape[1] // L * L
    return float(la[:, :T].reshape(la.shape[0], -1, L, la.shape[-1]).sum(2).abs().max())


def check_fp32_error_bound_large_decays(M, total, L=16):
    """The precision limit docs/replay.md ("Precision with large decays") states: under fp32
    in float32 the window forms difference cumulative log decays, so outputs carry a relative
    error of about an ulp of the window's largest |sum of log decays| (the float32 recurrence
    stays near 1e-7). Four tokens of window 1 get a decay of ``total / 4`` nats each; the error
    must stay within 1.5 ulp of that sum plus 1e-6."""
    import math

    inp = M.inputs(T=2 * L, seed=3)
    if M.name == "gdn":
        inp["g"][:, 5:9] = -total / 4
    else:
        inp["dt"][:, 5:9] = total / 4 / inp["A"].abs()
    c = window_decay_sum(M, inp, L)
    assert total <= c <= total + L  # the inserted decays dominate the window's sum
    y_ref, _ = M.recurrent(inp)
    inp32 = {n: t.float() for n, t in inp.items()}
    y = run_steps(M.state(inp32, "fp32", window=L), M.tok, inp32, 2 * L)
    ulp = 2.0 ** (math.floor(math.log2(c)) - 23)
    err = rel_err(y.double(), y_ref)
    assert err <= 1.5 * ulp + 1e-6, (err, ulp)
    return err


def check_read_copy_is_independent_cast(M, L=4, windows=3):
    """Test 2 (first half): with rec:fp32, R after the n-th flush equals Q_read(S_unrounded)
    bit for bit, where S_unrounded is the anchor of an fp32-policy run (rec:fp32 leaves the
    anchor exactly equal to it), drawn from the stream (layer, seq, head, flush n, copy 1)."""
    inp = M.inputs(T=L * windows, dtype=torch.float32, seed=1)
    read = "nvfp4+sr"
    st = M.state(inp, f"read:{read}/rec:fp32", window=L, seed=7, layer=5)
    ref = M.state(inp, "fp32", window=L)
    B, H = M.state_shape(inp)[:2]
    for n in range(1, windows + 1):
        for t in range((n - 1) * L, n * L):
            st.step(*M.tok(inp, t))
            ref.step(*M.tok(inp, t))
        S = ref.anchor
        assert torch.equal(st.anchor, S)
        stream = stream_key(layer=5, sequence=torch.arange(B)[:, None], head=torch.arange(H)[None],
                            flush=n, copy=1)
        assert torch.equal(st.read_copy, quantize(S, read, seed=7, stream=stream))
        # the stored copy is packed and decodes to the same values
        assert isinstance(st._R_st, PackedTensor) and torch.equal(st._R_st.dequantize(), st.read_copy)


def check_read_not_derived_from_anchor(M, L=4):
    """Test 2: with a quantised anchor, R = Q_read(S) differs from Q_read(dequantised A).
    S is the oracle's: the float64 step-by-step recurrence (``replayssm_quant.reference``)
    from the dequantised anchor over the window's tokens, not the flush routine under test
    (float64 throughout, so a last-bit difference of reassociation cannot flip a rounding)."""
    inp = M.inputs(T=L, dtype=torch.float64, seed=2)
    S0 = torch.randn(M.state_shape(inp), dtype=torch.float64)
    policy = "read:fp8e4m3/rec:fp16"
    st = M.state(inp, policy, window=L)
    st.prefill(S0)
    A0 = st.anchor
    run_steps(st, M.tok, inp, L)  # one flush
    _, S = M.recurrent(inp, initial_state=A0)
    assert torch.equal(st.read_copy, quantize(S, "fp8e4m3"))
    assert torch.equal(st.anchor, quantize(S, "fp16"))
    from_anchor = quantize(st.anchor, "fp8e4m3")
    assert not torch.equal(st.read_copy, from_anchor)
    assert int((st.read_copy != from_anchor).sum()) > 0


def check_read_format_never_enters_anchor(M, L=4, windows=12, **kw):
    """Test 2 (second half): with rec:fp32, changing only the read format leaves the anchor
    bit-identical after many windows (while the outputs do change)."""
    T = L * windows + 2
    inp = M.inputs(T=T, dtype=torch.float32, seed=3)
    anchors, outs = [], []
    for f in FORMATS_READ:
        st = M.state(inp, f"read:{f}/rec:fp32", window=L, **kw)
        outs.append(run_steps(st, M.tok, inp, T))
        anchors.append(st.anchor)
    for a in anchors[1:]:
        assert torch.equal(a, anchors[0])
    assert not torch.equal(outs[0], outs[3])  # nvfp4 reads do change the outputs


def check_shared_window1_is_eager(M, fmt, with_prefill):
    """Test 3: shared:F at L = 1 equals the conventional eager recurrence bit for bit (and the
    eager:F state object equals both), including SR draws and a prefill cast."""
    T = 12
    inp = M.inputs(T=T, dtype=torch.float32, seed=4)
    S0 = torch.randn(M.state_shape(inp)) if with_prefill else None
    y_ref, S_ref = M.recurrent(inp, state_format=fmt, seed=11, layer=3, initial_state=S0)
    for pol in (f"shared:{fmt}", f"eager:{fmt}"):
        st = M.state(inp, pol, window=1 if pol.startswith("shared") else 16, seed=11, layer=3)
        assert st.window == 1
        if S0 is not None:
            st.prefill(S0)
        y = run_steps(st, M.tok, inp, T)
        assert torch.equal(y, y_ref), pol
        assert torch.equal(st.anchor, S_ref) and torch.equal(st.read_copy, S_ref), pol


def check_packed_nbytes(M):
    inp = M.inputs(T=3, dtype=torch.float32)
    B, H, V, K = M.state_shape(inp)
    st = M.state(inp, "read:nvfp4/rec:fp16", window=2)
    run_steps(st, M.tok, inp, 3)
    assert st.anchor_nbytes == B * H * V * K * 2
    assert st.read_nbytes == B * H * (V * K // 2 + V * K // 16 + 4)
    st = M.state(inp, "read:fp8e4m3/rec:fp32", window=2)
    assert st.anchor_nbytes == B * H * V * K * 4 and st.read_nbytes == B * H * (V * K + 4)
    st = M.state(inp, "shared:mxfp4", window=2)
    assert st.anchor_nbytes == B * H * (V * K // 2 + V * K // 32) and st.read_nbytes == 0


def check_bad_inputs(M):
    """Test 9: bad input raises ValueError naming the value and leaves the state unchanged."""
    inp = M.inputs(T=6, dtype=torch.float32, seed=6)
    with pytest.raises(ValueError, match="window"):
        M.state(inp, "fp32", window=0)
    with pytest.raises(ValueError, match="max_drafts"):
        M.state(inp, "fp32", window=4, max_drafts=-1)
    with pytest.raises(ValueError, match="max_drafts"):
        M.state(inp, "fp32", window=4, max_drafts=5)
    with pytest.raises(ValueError, match="nvfp5"):
        M.state(inp, "shared:nvfp5", window=4)
    with pytest.raises(ValueError, match="'meta' holds no values"):
        M.state(inp, "fp32", window=4, device="meta")
    with pytest.raises(ValueError, match=r"window=1000000000000 \+ max_drafts=0: .*GiB.* on cpu"):
        M.state(inp, "fp32", window=10**12)  # a ring no machine holds, refused by name
    with pytest.raises(ValueError, match="window must be an int, got True"):
        M.state(inp, "fp32", window=True)
    with pytest.raises(ValueError, match="window must be an int, got " + re.escape(repr(np.float64(4)))):
        M.state(inp, "fp32", window=np.float64(4))
    # numpy integers count as ints (as commit's count does), kept as Python ints
    st = M.state(inp, "shared:fp16+sr", window=np.int64(4), max_drafts=np.int32(2),
                 seed=np.uint16(3), layer=np.int64(1))
    assert (st.window, st.max_drafts, st.seed, st.layer) == (4, 2, 3, 1)
    assert all(type(v) is int for v in (st.window, st.max_drafts, st.seed, st.layer,
                                        st.config.window, st.config.seed))
    st = M.state(inp, "read:nvfp4+sr/rec:fp16", window=4, max_drafts=2)
    run_steps(st, M.tok, inp, 5)  # one flush, h = 1
    before = snapshot(st)
    tok = M.tok(inp, 5)
    bad_calls = []
    for i in range(len(tok)):
        t = tok[i]
        if t is None:
            continue
        wrong_shape = list(tok)
        wrong_shape[i] = t[..., :-1] if t.dim() > 1 else t[:-1]
        wrong_dtype = list(tok)
        wrong_dtype[i] = t.double()
        wrong_device = list(tok)
        wrong_device[i] = t.to("meta")
        bad_calls += [("shape", wrong_shape), ("dtype", wrong_dtype), ("device", wrong_device)]
    for what, args in bad_calls:
        with pytest.raises(ValueError, match=what):
            st.step(*args)
        assert same_snapshot(before, snapshot(st)), what
    with pytest.raises(ValueError, match="before verify"):
        st.commit(0)
    with pytest.raises(ValueError, match="shape"):
        st.prefill(torch.zeros(1, 1, 1, 1))
    drafts = M.tok(inp, slice(0, 3))
    with pytest.raises(ValueError, match="3 drafts"):
        st.verify(*drafts)
    assert same_snapshot(before, snapshot(st))
    # inputs that disagree on T: every input's T named (the shape check blamed whichever
    # input differed from the first one's T; a new-user trial)
    mixed = list(M.tok(inp, slice(0, 2)))
    mixed[-2 if M.name == "mamba2" else 0] = M.tok(inp, slice(0, 1))[-2 if M.name == "mamba2"
                                                                       else 0]
    with pytest.raises(ValueError, match=r"verify\(\) takes one T \(drafts, dim 1\) for every "
                                         r"input, got (?=.*: 1)(?=.*: 2)"):
        st.verify(*mixed)
    assert same_snapshot(before, snapshot(st))
    st.verify(*M.tok(inp, slice(0, 2)))
    pending = snapshot(st)
    with pytest.raises(ValueError, match="pending"):
        st.step(*tok)
    with pytest.raises(ValueError, match="pending"):
        st.verify(*M.tok(inp, slice(0, 2)))
    with pytest.raises(ValueError, match="pending"):
        st.flush()
    for bad in (3, -1, torch.tensor([0, 3]), torch.tensor([0.5, 1.0]), torch.tensor([1, 1, 1])):
        with pytest.raises(ValueError, match="accepted"):
            st.commit(bad)
        assert same_snapshot(pending, snapshot(st))
    st.commit(torch.tensor([0, 2]))
    assert st.committed.tolist() == [1, 3]
    st.verify(*M.tok(inp, slice(0, 1)))
    st.commit(np.int64(1))  # numpy integers count as ints
    assert st.committed.tolist() == [2, 0]  # the second reached L = 4 and flushed


def check_dtype_float64_keeps_fp32_exact(M):
    """float64 working dtype: fp32 means no rounding; other formats round in FP32."""
    inp = M.inputs(T=8, seed=8)
    y_ref, S_ref = M.recurrent(inp)
    st = M.state(inp, "fp32", window=4)
    y = run_steps(st, M.tok, inp, 8)
    assert y.dtype == torch.float64 and rel_err(y, y_ref) < 1e-13 and rel_err(st.anchor, S_ref) < 1e-13
    st = M.state(inp, "read:nvfp4/rec:fp16", window=4)
    run_steps(st, M.tok, inp, 8)
    assert st.anchor.dtype == torch.float64
    assert torch.equal(st.anchor, st.anchor.float().half().double())


def check_rmse_ordering(model, seed=0):
    """Test 7: over 512 steps with alpha in [0.9, 0.9999] (window 16), output RMSE against fp32
    orders read:fp8e4m3/rec:fp32 < read:nvfp4/rec:fp16+sr < shared:nvfp4+sr; the anchor RMSE is
    exactly 0 for rec:fp32, small for rec:fp16+sr and large for shared:nvfp4+sr."""
    from replayssm_quant.replay.drift import policy_drift

    fp8_fp32, nv_fp16sr, shared = policy_drift(model, steps=512, window=16, seed=seed)
    assert fp8_fp32["out_rmse"] < nv_fp16sr["out_rmse"] < shared["out_rmse"]
    assert fp8_fp32["anchor_rmse"] == 0.0
    assert 0 < nv_fp16sr["anchor_rmse"] < 1e-3
    assert shared["anchor_rmse"] > 0.05
    assert shared["anchor_rmse"] > 100 * nv_fp16sr["anchor_rmse"]


def run_expecting_device_assert(code: str) -> str:
    """Run ``code`` (which ends by printing ``NO ASSERT`` after a synchronisation) in a fresh
    Python process, assert that a device-side assert stopped it first, and return its stdout
    and stderr. (A subprocess: the assert leaves its CUDA context unusable.)"""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "NO ASSERT" not in out
    assert "device-side assert" in out
    return out

