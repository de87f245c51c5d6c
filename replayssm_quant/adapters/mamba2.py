"""Mamba-2 family mixers: post-activation inputs and the mixer output.

Covers the Hugging Face mixers that share the Mamba-2 layout (``in_proj`` -> gate z,
``xBC``, ``dt``; depthwise causal conv over ``xBC``; SSD with scalar decay per head; D skip;
gated RMSNorm; ``out_proj``): ``Mamba2Mixer`` (mamba2), ``NemotronHMamba2Mixer``
(nemotron_h), ``BambaMixer`` (bamba), ``GraniteMoeHybridMambaLayer`` (granitemoehybrid),
``Zamba2MambaMixer`` (zamba2) and ``FalconH1Mixer`` (falcon_h1: input multiplier, mup vector
on the projection, optional gated norm).

DESIGN.md section 3: ``dt = softplus(dt_raw + dt_bias)`` (decode path: no clamp),
``A = -exp(A_log)``, records ``la = dt * A``, ``v = dt * x``, ``k = B``, ``q = C`` (grouped B/C
repeated to the heads), ``y = S q + D x``.

Decision (docs/kl-runner.md): the model's ``time_step_limit`` clamp, which Hugging Face
applies only in its chunked (multi-token) scan, is applied in the prefill scan (so a patched
prefill equals the model's own), and not on the decode/emulation path (DESIGN.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .conv import causal_conv, mask_padding

__all__ = ["MAMBA2_MIXERS", "extract", "output", "dims"]

MAMBA2_MIXERS = {
    "Mamba2Mixer": "mamba2",
    "NemotronHMamba2Mixer": "mamba2",
    "BambaMixer": "mamba2",
    "GraniteMoeHybridMambaLayer": "mamba2",
    "Zamba2MambaMixer": "mamba2",
    "FalconH1Mixer": "falcon_h1",
}


def dims(mixer) -> tuple[int, int, int]:
    """(heads H, value dim V = head_dim P, key dim K = d_state N)."""
    return mixer.num_heads, mixer.head_dim, mixer.ssm_state_size


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def extract(mixer, hidden_states, cache, attention_mask, *, clamp_dt: bool):
    """Run the mixer up to the SSM: returns ``(inputs, ctx)``; updates the conv state.

    ``inputs``: post-activation ``x [B, T, H, P]``, ``dt [B, T, H]``, ``A [H]``, grouped
    ``B, C [B, T, G, N]`` in the working dtype (float64 for a float64 model, else float32).

    ``ctx`` keeps what :func:`output` needs (gate, x for the D skip, model dtype).
    """
    Bsz, T, _ = hidden_states.shape
    dtype = hidden_states.dtype
    wd = _work_dtype(dtype)
    H, P, N = dims(mixer)
    G = mixer.n_groups
    hs = mask_padding(hidden_states, attention_mask)
    falcon = type(mixer).__name__ == "FalconH1Mixer"
    if falcon:
        hs = hs * mixer.ssm_in_multiplier
    proj = mixer.in_proj(hs)
    if falcon:
        proj = proj * mixer.mup_vector
    gate, xBC, dt = proj.split([mixer.intermediate_size, mixer.conv_dim, H], dim=-1)
    xBC = causal_conv(mixer, xBC, cache)
    xBC = mask_padding(xBC, attention_mask)
    x, Bm, Cm = torch.split(xBC, [mixer.intermediate_size, G * N, G * N], dim=-1)

    A = -torch.exp(mixer.A_log.to(wd))
    dt = F.softplus(dt.to(wd) + mixer.dt_bias.to(wd))
    if clamp_dt:
        lo, hi = mixer.time_step_limit
        if lo > 0.0 or hi != math.inf:
            dt = torch.clamp(dt, min=lo, max=hi)
    x = x.to(wd).view(Bsz, T, H, P)
    inp = {"x": x, "dt": dt, "A": A, "B": Bm.to(wd).view(Bsz, T, G, N),
           "C": Cm.to(wd).view(Bsz, T, G, N)}
    return inp, {"gate": gate, "x": x, "dtype": dtype}


def output(mixer, ctx, o: torch.Tensor) -> torch.Tensor:
    """``y = o + D x`` -> gated RMSNorm -> ``out_proj``; ``o [B, T, H, P]``."""
    x = ctx["x"]
    Bsz, T = x.shape[:2]
    y = o + mixer.D.to(o.dtype)[:, None] * x
    y = y.reshape(Bsz, T, -1)
    gate = ctx["gate"]
    if type(mixer).__name__ == "FalconH1Mixer" and not mixer.mamba_rms_norm:
        y = y * F.silu(gate.to(y.dtype))
    else:
        y = mixer.norm(y, gate)
    return mixer.out_proj(y.to(ctx["dtype"]))
