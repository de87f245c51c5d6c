"""Output and anchor drift of state policies against ``fp32`` on seeded random inputs.

Used by issue 3's test 7 and by ``scripts/replay_rmse_table.py`` (the table in
``docs/replay.md``). Inputs are post-activation with realistic decays: per-token alpha uniform
in [0.9, 0.9999] (Mamba-2: ``dt = log(alpha) / A``), unit-variance x / v, B and C scaled by
N^-1/2, GDN q, k L2-normalised (q scaled by DK^-1/2), beta = sigmoid(normal).

Metrics, per (model, policy, seed), relative to the ``fp32`` policy run with the same window
(the same code path, so only the state policy differs):

* ``out_rmse``: RMS over all steps, sequences, heads and channels of ``y - y_fp32``, divided by
  the RMS of ``y_fp32``; for Mamba-2 ``y = S C`` without the ``D x`` skip, which does not
  depend on the policy and would only dilute the relative error;
* ``anchor_rmse``: the same for the dequantised anchor after the last step (steps is a multiple
  of the window, so both runs have just flushed).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .gdn import GDNReplayState
from .mamba2 import Mamba2ReplayState

DEFAULT_POLICIES = ("read:fp8e4m3/rec:fp32", "read:nvfp4/rec:fp16+sr", "shared:nvfp4+sr")
MAMBA2_DIMS = dict(batch=2, heads=4, groups=1, head_dim=16, d_state=64)
GDN_DIMS = dict(batch=2, key_heads=2, value_heads=4, key_dim=64, value_dim=32)


def _alpha(gen, shape, lo, hi):
    return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)


def random_mamba2_inputs(steps, *, seed=0, alpha=(0.9, 0.9999), dtype=torch.float32, **dims):
    """Seeded Mamba-2 step inputs: dict of x [B,T,H,P], dt [B,T,H], A [H], B, C [B,T,G,N], D [H]."""
    d = {**MAMBA2_DIMS, **dims}
    B, H, G, P, N = d["batch"], d["heads"], d["groups"], d["head_dim"], d["d_state"]
    gen = torch.Generator().manual_seed(seed)
    A = -(0.5 + torch.rand(H, generator=gen, dtype=torch.float64))
    dt = torch.log(_alpha(gen, (B, steps, H), *alpha)) / A
    out = dict(x=torch.randn(B, steps, H, P, generator=gen, dtype=torch.float64), dt=dt, A=A,
               B=torch.randn(B, steps, G, N, generator=gen, dtype=torch.float64) / math.sqrt(N),
               C=torch.randn(B, steps, G, N, generator=gen, dtype=torch.float64) / math.sqrt(N),
               D=torch.randn(H, generator=gen, dtype=torch.float64))
    return {n: t.to(dtype) for n, t in out.items()}


def random_gdn_inputs(steps, *, seed=0, alpha=(0.9, 0.9999), dtype=torch.float32, **dims):
    """Seeded GDN step inputs: dict of q, k [B,T,HK,DK], v [B,T,HV,DV], g, beta [B,T,HV]."""
    d = {**GDN_DIMS, **dims}
    B, HK, HV, DK, DV = d["batch"], d["key_heads"], d["value_heads"], d["key_dim"], d["value_dim"]
    gen = torch.Generator().manual_seed(seed)
    out = dict(
        q=F.normalize(torch.randn(B, steps, HK, DK, generator=gen, dtype=torch.float64), dim=-1) * DK ** -0.5,
        k=F.normalize(torch.randn(B, steps, HK, DK, generator=gen, dtype=torch.float64), dim=-1),
        v=torch.randn(B, steps, HV, DV, generator=gen, dtype=torch.float64),
        g=torch.log(_alpha(gen, (B, steps, HV), *alpha)),
        beta=torch.sigmoid(torch.randn(B, steps, HV, generator=gen, dtype=torch.float64)))
    return {n: t.to(dtype) for n, t in out.items()}


def run_policy(model: str, policy, inputs: dict, *, window: int, seed: int = 0, **state_kw):
    """Step a fresh state through ``inputs``; returns ``(outputs [B,T,...], anchor)``."""
    if model == "mamba2":
        x = inputs["x"]
        B, T, H, P = x.shape
        G, N = inputs["B"].shape[2:]
        st = Mamba2ReplayState(policy, batch=B, heads=H, head_dim=P, d_state=N, groups=G,
                               window=window, seed=seed, dtype=x.dtype, **state_kw)
        ys = [st.step(x[:, t], inputs["dt"][:, t], inputs["A"], inputs["B"][:, t],
                      inputs["C"][:, t], inputs.get("D")) for t in range(T)]
    elif model == "gdn":
        v = inputs["v"]
        B, T, HV, DV = v.shape
        HK, DK = inputs["k"].shape[2:]
        st = GDNReplayState(policy, batch=B, key_heads=HK, value_heads=HV, key_dim=DK,
                            value_dim=DV, window=window, seed=seed, dtype=v.dtype, **state_kw)
        ys = [st.step(*(inputs[n][:, t] for n in ("q", "k", "v", "g", "beta"))) for t in range(T)]
    else:
        raise ValueError(f"model must be 'mamba2' or 'gdn', got {model!r}")
    return torch.stack(ys, 1), st.anchor


def _rel_rms(a, ref):
    return float(((a.double() - ref.double()) ** 2).mean().sqrt() / (ref.double() ** 2).mean().sqrt())


def policy_drift(model: str, policies=DEFAULT_POLICIES, *, steps: int = 512, window: int = 16,
                 seed: int = 0, **dims) -> list[dict]:
    """Tidy rows ``{model, policy, seed, window, steps, out_rmse, anchor_rmse}`` (see module)."""
    make = random_mamba2_inputs if model == "mamba2" else random_gdn_inputs
    inputs = make(steps, seed=seed, **dims)
    inputs.pop("D", None)  # Mamba-2: compare the state read S C, not the policy-free D x
    y_ref, a_ref = run_policy(model, "fp32", inputs, window=window, seed=seed)
    rows = []
    for p in policies:
        y, a = run_policy(model, p, inputs, window=window, seed=seed)
        rows.append(dict(model=model, policy=str(p), seed=seed, window=window, steps=steps,
                         out_rmse=_rel_rms(y, y_ref), anchor_rmse=_rel_rms(a, a_ref)))
    return rows
