"""Seeded random inputs for the ReplaySSM tests (post-activation, realistic ranges)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# The ReplaySSM tests run thousands of tiny matmuls; on a small shared CPU, intra-op threads
# only contend (measured: a [2,2,8,32]x[32,4] matmul takes 5.8 ms with 2 threads under load,
# 28 us with 1). One thread keeps the whole file set fast.
torch.set_num_threads(1)


def decays(gen, shape, lo=0.9, hi=0.9999, dtype=torch.float64):
    """Per-token decays alpha uniform in [lo, hi]."""
    return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=dtype)


def mamba2_inputs(*, B=2, T=16, H=4, G=2, P=8, N=32, dtype=torch.float64, seed=0,
                  alpha=(0.9, 0.9999)):
    """x [B,T,H,P], dt [B,T,H] (> 0), A [H] (< 0), B/C [B,T,G,N], D [H]; a = exp(dt A) in alpha."""
    gen = torch.Generator().manual_seed(seed)
    A = -(0.5 + torch.rand(H, generator=gen, dtype=torch.float64))
    a = decays(gen, (B, T, H), *alpha)
    dt = torch.log(a) / A  # exp(dt * A) = a
    x = torch.randn(B, T, H, P, generator=gen, dtype=torch.float64)
    Bm = torch.randn(B, T, G, N, generator=gen, dtype=torch.float64) / math.sqrt(N)
    C = torch.randn(B, T, G, N, generator=gen, dtype=torch.float64) / math.sqrt(N)
    D = torch.randn(H, generator=gen, dtype=torch.float64)
    return {k: t.to(dtype) for k, t in dict(x=x, dt=dt, A=A, B=Bm, C=C, D=D).items()}


def gdn_inputs(*, B=2, T=16, HK=2, HV=4, DK=32, DV=8, dtype=torch.float64, seed=0,
               alpha=(0.9, 0.9999)):
    """q, k [B,T,HK,DK] (normalised; q scaled), v [B,T,HV,DV], g [B,T,HV] (log alpha), beta."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, HK, DK, generator=gen, dtype=torch.float64), dim=-1) * DK ** -0.5
    k = F.normalize(torch.randn(B, T, HK, DK, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, HV, DV, generator=gen, dtype=torch.float64)
    g = torch.log(decays(gen, (B, T, HV), *alpha))
    beta = torch.sigmoid(torch.randn(B, T, HV, generator=gen, dtype=torch.float64))
    return {n: t.to(dtype) for n, t in dict(q=q, k=k, v=v, g=g, beta=beta).items()}


def mamba2_state(inp, policy, *, window, max_drafts=0, seed=0, layer=0, sequence_ids=None, **kw):
    from replayssm_quant.replay import Mamba2ReplayState

    B, T, H, P = inp["x"].shape
    G, N = inp["B"].shape[2:]
    return Mamba2ReplayState(policy, batch=B, heads=H, head_dim=P, d_state=N, groups=G,
                             window=window, max_drafts=max_drafts, seed=seed, layer=layer,
                             sequence_ids=sequence_ids, dtype=inp["x"].dtype, **kw)


def gdn_state(inp, policy, *, window, max_drafts=0, seed=0, layer=0, sequence_ids=None, **kw):
    from replayssm_quant.replay import GDNReplayState

    B, T, HK, DK = inp["k"].shape
    HV, DV = inp["v"].shape[2:]
    return GDNReplayState(policy, batch=B, key_heads=HK, value_heads=HV, key_dim=DK,
                          value_dim=DV, window=window, max_drafts=max_drafts, seed=seed,
                          layer=layer, sequence_ids=sequence_ids, dtype=inp["v"].dtype, **kw)


def mamba2_tok(inp, t, b=slice(None)):
    """Arguments of Mamba2ReplayState.step for token t (t may be a slice: verify drafts)."""
    return (inp["x"][b, t], inp["dt"][b, t], inp["A"], inp["B"][b, t], inp["C"][b, t], inp["D"])


def gdn_tok(inp, t, b=slice(None)):
    return tuple(inp[n][b, t] for n in ("q", "k", "v", "g", "beta"))


def run_steps(state, tok, inp, T, t0=0):
    """Step tokens t0..t0+T-1; returns outputs stacked on dim 1."""
    return torch.stack([state.step(*tok(inp, t)) for t in range(t0, t0 + T)], 1)


def rel_err(a, b):
    """max |a - b| / max |b| (0 when both are all zero)."""
    d = float((a - b).abs().max())
    return d if d == 0 else d / float(b.abs().max())


def tslice(inp, s):
    """Slice every per-token input along time (A and D, 1-dim, are shared)."""
    return {n: (t[:, s] if t.dim() > 1 else t) for n, t in inp.items()}


def bslice(inp, b):
    return {n: (t[b] if t.dim() > 1 else t) for n, t in inp.items()}


class Model:
    """Uniform handle on one architecture for model-generic test bodies."""

    def __init__(self, name):
        from replayssm_quant.reference import gdn_recurrent, mamba2_recurrent

        self.name = name
        self.inputs = mamba2_inputs if name == "mamba2" else gdn_inputs
        self.state = mamba2_state if name == "mamba2" else gdn_state
        self.tok = mamba2_tok if name == "mamba2" else gdn_tok
        self._rec = mamba2_recurrent if name == "mamba2" else gdn_recurrent

    def recurrent(self, inp, **kw):
        return self._rec(**inp, **kw)

    def state_shape(self, inp):
        if self.name == "mamba2":
            B, _, H, P = inp["x"].shape
            return (B, H, P, inp["B"].shape[-1])
        B, _, HV, DV = inp["v"].shape
        return (B, HV, DV, inp["k"].shape[-1])


def snapshot(state):
    """Everything observable plus the ring, to check that a failed call changed nothing."""
    return dict(anchor=state.anchor, read=state.read_copy, h=state.committed,
                fi=state.flush_index, pending=state.pending_drafts,
                ring={n: t.clone() for n, t in state._ring.items()},
                nbytes=(state.anchor_nbytes, state.read_nbytes))


def same_snapshot(a, b):
    return (torch.equal(a["anchor"], b["anchor"]) and torch.equal(a["read"], b["read"])
            and torch.equal(a["h"], b["h"]) and torch.equal(a["fi"], b["fi"])
            and a["pending"] == b["pending"] and a["nbytes"] == b["nbytes"]
            and all(torch.equal(a["ring"][n], b["ring"][n]) for n in a["ring"]))
