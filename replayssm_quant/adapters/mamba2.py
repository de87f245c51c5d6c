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

dt limit (decided 2026-12-01, issue 12 item 9; docs/adapters.md). Hugging Face gives each mixer a
``time_step_limit`` (Nemotron-H and Zamba2: ``(config.time_step_min, inf)``, 0.001 in real
Nemotron-H checkpoints; others ``config.time_step_limit``) and is itself inconsistent: its
chunked scan (prefill and multi-token continuations) clamps dt to it, its single-token decode
step (like ``mamba_ssm``'s ``selective_state_update``, what serving runs) does not. The adapter
applies one rule, :class:`DtLimit`, to every call -- prefill, teacher-forced emulation and
steps alike -- so that prefill k + emulate N-k tokens equals emulate N for every k:

* ``DtLimit.DECODE`` (default, ``"decode"``): no clamp, ``dt = softplus(dt_raw + dt_bias)``
  (DESIGN.md section 3). Oracle: the unpatched model's token-by-token decode.
* ``DtLimit.CLAMP`` (``"clamp"``): ``dt = clamp(softplus(dt_raw + dt_bias), *time_step_limit)``
  everywhere. Oracle: the unpatched model's chunked forward of the full sequence.

Padded positions (2-D attention mask, module :mod:`.conv`) get ``dt = 0`` after the rule, so
they neither decay nor write the state.
"""

from __future__ import annotations

import enum
import math

import torch
import torch.nn.functional as F

from .conv import causal_conv, mask_padding, padding_noop

__all__ = ["MAMBA2_MIXERS", "DtLimit", "apply_dt_limit", "extract", "output", "dims"]


class DtLimit(str, enum.Enum):
    """Which time-step rule every Mamba-2 call applies (module docstring; DESIGN.md section 3).

    Parse user input with :meth:`parse`; ``str(member)`` is its name as accepted there (what a
    run manifest records).
    """

    #: ``dt = softplus(dt_raw + dt_bias)``, no clamp: the model's single-token decode step
    #: (what serving runs). Default.
    DECODE = "decode"
    #: ``dt = clamp(softplus(dt_raw + dt_bias), lo, hi)`` with the mixer's ``time_step_limit``
    #: ``(lo, hi)``: the model's chunked (multi-token) scan.
    CLAMP = "clamp"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "str | DtLimit") -> "DtLimit":
        """A :class:`DtLimit` from a member or its name (``"decode"``, ``"clamp"``; case and
        surrounding blanks ignored).

        Raises:
            ValueError: naming the bad value and the accepted names.
        """
        if isinstance(value, cls):
            return value
        names = ", ".join(repr(m.value) for m in cls)
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise ValueError(f"dt_limit must be one of {names}, got {value!r}")


def apply_dt_limit(dt: torch.Tensor, time_step_limit, rule: DtLimit) -> torch.Tensor:
    """``dt [..., H]`` (after softplus, any float dtype) under ``rule``: unchanged for
    ``DtLimit.DECODE``; clamped to ``time_step_limit = (lo, hi)`` for ``DtLimit.CLAMP`` (a no-op
    limit ``(<= 0, inf)`` skips the clamp). Same shape and dtype."""
    if rule is DtLimit.CLAMP:
        lo, hi = time_step_limit
        if lo > 0.0 or hi != math.inf:
            dt = torch.clamp(dt, min=lo, max=hi)
    return dt


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


def extract(mixer, hidden_states, cache, attention_mask, *, dt_limit: DtLimit = DtLimit.DECODE):
    """Run the mixer up to the SSM: returns ``(inputs, ctx)``; updates the conv state.

    ``hidden_states [B, T, D]`` (model dtype); ``attention_mask`` ``[B, T]`` (1 real, 0 padding)
    or None; ``dt_limit``: the time-step rule (:class:`DtLimit`, applied on every call).
    Padded positions get ``dt = 0`` (no-op records; :mod:`.conv`).

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
    xBC = causal_conv(mixer, mask_padding(xBC, attention_mask), cache, attention_mask)
    xBC = mask_padding(xBC, attention_mask)
    x, Bm, Cm = torch.split(xBC, [mixer.intermediate_size, G * N, G * N], dim=-1)

    A = -torch.exp(mixer.A_log.to(wd))
    dt = F.softplus(dt.to(wd) + mixer.dt_bias.to(wd))
    dt = apply_dt_limit(dt, getattr(mixer, "time_step_limit", (0.0, math.inf)), dt_limit)
    dt = padding_noop(dt, attention_mask)
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
