"""Gated DeltaNet family mixers: post-activation inputs and the mixer output.

Covers ``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet`` (separate ``in_proj_qkv``,
``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``Qwen3NextGatedDeltaNet`` (fused ``in_proj_qkvz``
and ``in_proj_ba`` in per-key-head groups) and ``OlmoHybridGatedDeltaNet`` (separate q/k/v/a/b/g
projections, beta x 2 when ``allow_neg_eigval``).

DESIGN.md section 3: q and k L2-normalised (eps 1e-6) after the conv, q scaled by dk^-1/2,
``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)`` (x2 where allowed), grouped
q/k heads repeated (``repeat_interleave``) to the value heads; output gated RMSNorm per value
head, then the output projection.

Padded positions (2-D attention mask; rule in :mod:`.conv`, 2026-12-01) get ``g = 0`` and
``beta = 0``: decay ``alpha = 1`` and correction ``u = beta (...) = 0``, so they neither decay nor
write the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import causal_conv, mask_padding, padding_noop

__all__ = ["GDN_MIXERS", "extract", "output", "dims", "L2NORM_EPS"]

L2NORM_EPS = 1e-6  # fla / Hugging Face l2norm eps for q and k

GDN_MIXERS = {
    "Qwen3_5GatedDeltaNet": "qwen3_5",
    "Qwen3_5MoeGatedDeltaNet": "qwen3_5",
    "Qwen3NextGatedDeltaNet": "qwen3_next",
    "OlmoHybridGatedDeltaNet": "olmo_hybrid",
}


def dims(mixer) -> tuple[int, int, int]:
    """(value heads HV, value dim DV, key dim DK)."""
    return mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def _project(mixer, hs):
    """-> (mixed_qkv [B, T, 2*key_dim + value_dim], gate z [B, T, HV, DV], b, a [B, T, HV])."""
    Bsz, T, _ = hs.shape
    kind = GDN_MIXERS[type(mixer).__name__]
    DV = mixer.head_v_dim
    if kind == "qwen3_5":
        qkv = mixer.in_proj_qkv(hs)
        z = mixer.in_proj_z(hs).reshape(Bsz, T, -1, DV)
        b, a = mixer.in_proj_b(hs), mixer.in_proj_a(hs)
    elif kind == "qwen3_next":
        q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hs),
                                                             mixer.in_proj_ba(hs))
        q, k, v = (t.reshape(Bsz, T, -1) for t in (q, k, v))
        qkv = torch.cat((q, k, v), dim=-1)
    else:  # olmo_hybrid
        qkv = torch.cat([mixer.q_proj(hs), mixer.k_proj(hs), mixer.v_proj(hs)], dim=-1)
        z = mixer.g_proj(hs).reshape(Bsz, T, -1, DV)
        b, a = mixer.b_proj(hs), mixer.a_proj(hs)
    return qkv, z, b, a


def extract(mixer, hidden_states, cache, attention_mask, *, dt_limit=None):
    """Run the mixer up to the recurrence: returns ``(inputs, ctx)``; updates the conv state.

    ``hidden_states [B, T, D]`` (model dtype); ``attention_mask`` ``[B, T]`` (1 real, 0 padding)
    or None. ``inputs``: grouped ``q, k [B, T, HK, DK]`` (L2-normalised, q scaled),
    ``v [B, T, HV, DV]``, ``g, beta [B, T, HV]`` in the working dtype; padded positions have
    ``g = beta = 0`` (no-op records). ``dt_limit`` is accepted for a uniform signature and
    ignored (GDN has no time-step limit).
    """
    del dt_limit
    Bsz, T, _ = hidden_states.shape
    dtype = hidden_states.dtype
    wd = torch.float64 if dtype == torch.float64 else torch.float32
    HV, DV, DK = dims(mixer)
    hs = mask_padding(hidden_states, attention_mask)
    qkv, z, b, a = _project(mixer, hs)
    qkv = causal_conv(mixer, mask_padding(qkv, attention_mask), cache, attention_mask)
    q, k, v = torch.split(qkv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q = q.to(wd).reshape(Bsz, T, -1, DK)
    k = k.to(wd).reshape(Bsz, T, -1, DK)
    v = v.to(wd).reshape(Bsz, T, HV, DV)
    q = _l2norm(q) / (DK ** 0.5)
    k = _l2norm(k)
    beta = b.sigmoid()
    if getattr(mixer, "allow_neg_eigval", False):
        beta = beta * 2.0
    g = -mixer.A_log.to(wd).exp() * F.softplus(a.to(wd) + mixer.dt_bias.to(wd))
    g = padding_noop(g, attention_mask)
    beta = padding_noop(beta.to(wd), attention_mask)
    inp = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    return inp, {"z": z, "dtype": dtype}


def output(mixer, ctx, o: torch.Tensor) -> torch.Tensor:
    """Gated RMSNorm per value head, then the output projection; ``o [B, T, HV, DV]``."""
    Bsz, T, HV, DV = o.shape
    dtype = ctx["dtype"]
    y = o.to(dtype).reshape(-1, DV)
    z = ctx["z"].reshape(-1, DV)
    kind = GDN_MIXERS[type(mixer).__name__]
    if kind == "olmo_hybrid":
        y = mixer.o_norm(y, z).reshape(Bsz, T, -1)
        return mixer.o_proj(y)
    y = mixer.norm(y, z).reshape(Bsz, T, -1)
    return mixer.out_proj(y)
