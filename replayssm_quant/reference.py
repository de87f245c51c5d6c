"""Stepwise reference recurrences (DESIGN.md section 3), float64 or float32.

Plain loops over time that read like the equations; they are the ground truth the ReplaySSM
state objects are tested against. With ``state_format`` they are the conventional ("eager")
quantised decoders: the state is rounded after every token and the rounded value feeds the
next step, while each token's output is read from the unrounded state.

Layouts follow Hugging Face / fla (time after batch): ``x [B, T, H, P]``; states are
``[B, H, V, K]`` "value x key" (Mamba-2 ``[B, H, P, N]`` like HF's ``ssm_state``; GDN
``[B, HV, DV, DK]``, the transpose of fla's ``[B, H, K, V]``).

Random streams under SR: the cast after token ``t`` (0-based) is flush index ``t + 1`` and the
cast of ``initial_state`` (a prefill) is flush index 0, copy bit 0, keyed by
``(seed, layer, sequence_ids[b], head)``, exactly as the state objects do, so ``shared:F`` at
window 1 reproduces these loops bit for bit.
"""

from __future__ import annotations

import torch

from .formats import parse_spec
from .philox import stream_key
from .replay.core import ANCHOR_COPY, PREFILL_FLUSH_INDEX, cast_state, expand_heads, matvec


def _caster(state_format, seed, layer, sequence_ids, batch, heads, device):
    if state_format is None:
        return None
    spec = parse_spec(state_format)
    seq = (torch.arange(batch) if sequence_ids is None else torch.as_tensor(sequence_ids)).to(torch.int64)
    head = torch.arange(heads, dtype=torch.int64)

    def cast(S, flush_index):
        stream = stream_key(layer=layer, sequence=seq[:, None], head=head[None, :],
                            flush=flush_index, copy=ANCHOR_COPY).to(device)
        return cast_state(S, spec, seed=seed, stream=stream)[0]

    return cast


def mamba2_recurrent(x, dt, A, B, C, D=None, *, initial_state=None, state_format=None,
                     seed: int = 0, layer: int = 0, sequence_ids=None):
    """Mamba-2 (SSD, scalar decay per head), post-activation inputs.

    ``S_t = a_t S_{t-1} + v_t k_t^T``, ``a_t = exp(dt_t A)``, ``v_t = dt_t x_t``, ``k_t = B_t``;
    ``y_t = S_t C_t + D x_t``.

    Args:
        x: ``[B, T, H, P]``.
        dt: ``[B, T, H]`` after softplus (and dt_bias).
        A: ``[H]``, negative (``-exp(A_log)``).
        B, C: ``[B, T, G, N]``, G groups shared by ``H // G`` consecutive heads.
        D: ``[H]`` skip, or None.
        initial_state: ``[B, H, P, N]`` or None (zeros).
        state_format: None (exact) or a format token (eager rounding after every token).
        seed, layer, sequence_ids: SR stream keys (see module docstring).

    Returns:
        ``(y [B, T, H, P], final_state [B, H, P, N])`` in x's dtype.
    """
    Bsz, T, H, P = x.shape
    N = B.shape[-1]
    S = x.new_zeros(Bsz, H, P, N) if initial_state is None else initial_state.clone()
    cast = _caster(state_format, seed, layer, sequence_ids, Bsz, H, x.device)
    if cast is not None and initial_state is not None:
        S = cast(S, PREFILL_FLUSH_INDEX)
    ys = []
    for t in range(T):
        a = torch.exp(dt[:, t] * A)  # [B, H]
        v = dt[:, t, :, None] * x[:, t]  # [B, H, P]
        k = expand_heads(B[:, t], H, 1)
        q = expand_heads(C[:, t], H, 1)
        S = a[..., None, None] * S + v[..., :, None] * k[..., None, :]
        y = matvec(S, q)
        if D is not None:
            y = y + D[:, None] * x[:, t]
        ys.append(y)
        if cast is not None:
            S = cast(S, t + 1)
    return torch.stack(ys, 1), S


def gdn_recurrent(q, k, v, g, beta, *, initial_state=None, state_format=None, seed: int = 0,
                  layer: int = 0, sequence_ids=None):
    """Gated DeltaNet, post-activation inputs (fla conventions).

    ``u_t = beta_t (v_t - alpha_t S_{t-1} k_t)``, ``S_t = alpha_t S_{t-1} + u_t k_t^T``,
    ``o_t = S_t q_t``, ``alpha_t = exp(g_t)``.

    Args:
        q, k: ``[B, T, HK, DK]``; k L2-normalised, q L2-normalised and scaled by DK^-1/2.
        v: ``[B, T, HV, DV]``; HV a multiple of HK (value head h uses key head h // (HV/HK)).
        g: ``[B, T, HV]`` log decay (<= 0).
        beta: ``[B, T, HV]``.
        initial_state: ``[B, HV, DV, DK]`` or None.
        state_format, seed, layer, sequence_ids: as :func:`mamba2_recurrent`.

    Returns:
        ``(o [B, T, HV, DV], final_state [B, HV, DV, DK])``.
    """
    Bsz, T, HV, DV = v.shape
    DK = k.shape[-1]
    S = v.new_zeros(Bsz, HV, DV, DK) if initial_state is None else initial_state.clone()
    cast = _caster(state_format, seed, layer, sequence_ids, Bsz, HV, v.device)
    if cast is not None and initial_state is not None:
        S = cast(S, PREFILL_FLUSH_INDEX)
    os_ = []
    for t in range(T):
        alpha = torch.exp(g[:, t])  # [B, HV]
        kt = expand_heads(k[:, t], HV, 1)
        qt = expand_heads(q[:, t], HV, 1)
        u = beta[:, t, :, None] * (v[:, t] - alpha[..., None] * matvec(S, kt))
        S = alpha[..., None, None] * S + u[..., :, None] * kt[..., None, :]
        os_.append(matvec(S, qt))
        if cast is not None:
            S = cast(S, t + 1)
    return torch.stack(os_, 1), S
