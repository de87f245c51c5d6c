"""The stepwise references against independent formulations."""

import pytest
import torch

from replayssm_quant import quantize, stream_key
from replayssm_quant.reference import gdn_recurrent, mamba2_recurrent

from _replay_inputs import gdn_inputs, mamba2_inputs, rel_err


def _naive_mamba2(inp):
    """Per (batch, head) loop with torch.outer; no shared helpers."""
    x, dt, A, Bm, C, D = (inp[n] for n in ("x", "dt", "A", "B", "C", "D"))
    Bz, T, H, P = x.shape
    G, N = Bm.shape[2:]
    y = torch.zeros_like(x)
    S = torch.zeros(Bz, H, P, N, dtype=x.dtype)
    for b in range(Bz):
        for h in range(H):
            grp = h // (H // G)
            s = torch.zeros(P, N, dtype=x.dtype)
            for t in range(T):
                s = torch.exp(dt[b, t, h] * A[h]) * s + torch.outer(dt[b, t, h] * x[b, t, h], Bm[b, t, grp])
                y[b, t, h] = s @ C[b, t, grp] + D[h] * x[b, t, h]
            S[b, h] = s
    return y, S


def _naive_gdn(inp):
    """Householder-product form: S_t = alpha S_{t-1} (I - beta k k^T) + beta v k^T."""
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    Bz, T, HK, DK = k.shape
    HV, DV = v.shape[2:]
    o = torch.zeros_like(v)
    S = torch.zeros(Bz, HV, DV, DK, dtype=v.dtype)
    eye = torch.eye(DK, dtype=v.dtype)
    for b in range(Bz):
        for h in range(HV):
            kh = h // (HV // HK)
            s = torch.zeros(DV, DK, dtype=v.dtype)
            for t in range(T):
                kk, bt = k[b, t, kh], beta[b, t, h]
                s = torch.exp(g[b, t, h]) * s @ (eye - bt * torch.outer(kk, kk)) + bt * torch.outer(v[b, t, h], kk)
                o[b, t, h] = s @ q[b, t, kh]
            S[b, h] = s
    return o, S


def test_mamba2_matches_naive():
    inp = mamba2_inputs(B=2, T=12, H=4, G=2, P=4, N=16)
    y, S = mamba2_recurrent(**inp)
    yn, Sn = _naive_mamba2(inp)
    assert rel_err(y, yn) < 1e-13 and rel_err(S, Sn) < 1e-13


def test_gdn_matches_householder_form():
    inp = gdn_inputs(B=2, T=12, HK=2, HV=4, DK=16, DV=4)
    o, S = gdn_recurrent(**inp)
    on, Sn = _naive_gdn(inp)
    assert rel_err(o, on) < 1e-12 and rel_err(S, Sn) < 1e-12


@pytest.mark.parametrize("model", ["mamba2", "gdn"])
def test_float32_close_to_float64(model):
    if model == "mamba2":
        i64 = mamba2_inputs(T=64)
        i32 = {n: t.float() for n, t in i64.items()}
        (a, _), (b, _) = mamba2_recurrent(**i64), mamba2_recurrent(**i32)
    else:
        i64 = gdn_inputs(T=64)
        i32 = {n: t.float() for n, t in i64.items()}
        (a, _), (b, _) = gdn_recurrent(**i64), gdn_recurrent(**i32)
    assert b.dtype == torch.float32 and rel_err(b.double(), a) < 1e-5


def test_initial_state_and_fp32_format_is_exact():
    inp = mamba2_inputs(T=10)
    S0 = torch.randn(2, 4, 8, 32, dtype=torch.float64)
    y1, S1 = mamba2_recurrent(**inp, initial_state=S0)
    y2, S2 = mamba2_recurrent(**inp, initial_state=S0, state_format="fp32")
    assert torch.equal(y1, y2) and torch.equal(S1, S2)
    # splitting the run in two with the carried state gives the same result
    first = {n: (t[:, :4] if t.dim() > 1 else t) for n, t in inp.items()}
    rest = {n: (t[:, 4:] if t.dim() > 1 else t) for n, t in inp.items()}
    ya, Sa = mamba2_recurrent(**first, initial_state=S0)
    yb, Sb = mamba2_recurrent(**rest, initial_state=Sa)
    assert rel_err(torch.cat([ya, yb], 1), y1) < 1e-14 and rel_err(Sb, S1) < 1e-14


def test_eager_rounds_every_token_with_keyed_streams():
    """The final eager state is exactly the cast of the unrounded last update, drawn from the
    stream (layer, sequence, head, flush = T, copy 0)."""
    inp = gdn_inputs(T=6, dtype=torch.float32)
    o, S = gdn_recurrent(**inp, state_format="nvfp4+sr", seed=5, layer=3)
    pre = {n: t[:, :5] for n, t in inp.items()}
    last = {n: t[:, 5:] for n, t in inp.items()}
    _, S5 = gdn_recurrent(**pre, state_format="nvfp4+sr", seed=5, layer=3)
    _, S6_unrounded = gdn_recurrent(**last, initial_state=S5)
    stream = stream_key(layer=3, sequence=torch.arange(2)[:, None], head=torch.arange(4)[None], flush=6)
    assert torch.equal(S, quantize(S6_unrounded, "nvfp4+sr", seed=5, stream=stream))


def test_eager_does_not_depend_on_batch_composition():
    inp = mamba2_inputs(B=3, T=8, dtype=torch.float32)
    y, S = mamba2_recurrent(**inp, state_format="fp8e4m3+sr", seed=1)
    one = {n: (t[2:3] if t.dim() > 1 else t) for n, t in inp.items()}
    y1, S1 = mamba2_recurrent(**one, state_format="fp8e4m3+sr", seed=1, sequence_ids=[2])
    assert torch.equal(y1, y[2:3]) and torch.equal(S1, S[2:3])
