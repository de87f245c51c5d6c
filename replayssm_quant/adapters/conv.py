"""Depthwise causal conv1d with the Hugging Face conv state, and the padding rule, shared by
both families.

The conv state lives in the model's own cache (``cache.update_conv_state``), exactly as the
unpatched mixers keep it, so it travels with the attention KV cache between segment calls.
Plain torch (``F.conv1d``) on every device: never the ``causal_conv1d`` / fla kernels that
transformers may select (fla's are GPU-only even when the tensors are on CPU).

Padding rule (decided 2026-12-01, issue 12 item 10; docs/adapters.md): where a 2-D
``attention_mask [B, T]`` reaches a mixer, a padded position (mask 0) is a no-op for the row's
state, at either end of the row (left or right padding):

* its input to the conv is zeroed (:func:`mask_padding`), so left padding equals the zero
  initial conv state of the row run alone;
* its SSM record is the identity (decay 1, nothing written): Mamba-2 ``dt = 0`` (so
  ``a = exp(dt A) = 1`` and ``v = dt x = 0``), GDN ``g = 0`` and ``beta = 0`` (so
  ``alpha = 1`` and ``u = 0``) -- :func:`padding_noop`;
* the conv state left in the cache is the row's last ``conv_kernel_size`` *real* inputs
  (:func:`causal_conv`), not its trailing padding: Hugging Face keeps the last columns of the
  padded input, which for a right-padded row are padding, so its next decode step would see
  zeros instead of the row's last tokens.

Hugging Face itself only zeroes the mixer input (and, for Mamba-2, ``x`` after the conv); a
padded position still decays the state with ``exp(softplus(dt_bias) A)``, which corrupts the
state of a right-padded row (measured on the embedded models before this rule: the short row's
prefill anchor kept 0.32-0.86 of its norm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

__all__ = ["causal_conv", "mask_padding", "padding_noop", "real_conv_state"]


def _mask2d(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The 2-D padding mask ``[B, T]`` or None (4-D / custom masks carry no padding signal)."""
    if attention_mask is not None and attention_mask.dim() == 2:
        return attention_mask
    return None


def mask_padding(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded positions of ``hidden_states [B, T, C]`` (Hugging Face
    ``apply_mask_to_padding_states``); ``attention_mask [B, T]`` (1 = real token, 0 = padding)
    or None / a 4-D mask (no change)."""
    m = _mask2d(attention_mask)
    if m is not None:
        dtype = hidden_states.dtype
        hidden_states = (hidden_states * m[:, :, None]).to(dtype)
    return hidden_states


def padding_noop(t: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``t [B, T, H]`` (Mamba-2 ``dt``; GDN ``g`` and ``beta``) set to 0 at padded positions, which
    makes the position's record the identity for the state (module docstring; DESIGN.md
    section 3 records). Dtype and shape unchanged."""
    m = _mask2d(attention_mask)
    if m is None:
        return t
    return t * m.to(t.dtype)[:, :, None]


def real_conv_state(xt: torch.Tensor, attention_mask: torch.Tensor, K: int) -> torch.Tensor:
    """The conv state ``[B, C, K]`` a row would have run alone, unpadded: its last ``K`` real
    inputs (zeros in front when it has fewer).

    Args:
        xt: ``[B, C, W]`` what ``cache.update_conv_state`` returned (the previous conv state,
            if any, followed by this call's ``T`` inputs; ``W >= T``), columns oldest first.
        attention_mask: ``[B, T]`` of this call's inputs; the earlier ``W - T`` columns (the
            carried conv state) count as real.
        K: conv kernel size (the conv state's width).
    """
    B, C, W = xt.shape
    T = attention_mask.shape[1]
    real = torch.cat([torch.ones(B, K + W - T, dtype=torch.int8, device=xt.device),
                      attention_mask.to(device=xt.device, dtype=torch.bool).to(torch.int8)], 1)
    ext = torch.cat([xt.new_zeros(B, C, K), xt], -1)  # the zero state in front counts as real
    # stable sort: padded columns first, real columns after them in their original order
    order = torch.sort(real, dim=1, stable=True).indices[:, -K:]
    return ext.gather(2, order[:, None, :].expand(B, C, K))


def causal_conv(mixer, x: torch.Tensor, cache, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise conv of ``x [B, T, C]`` with the mixer's ``conv1d`` and activation,
    continuing from (and updating) the conv state of ``mixer.layer_idx`` in ``cache``.
    Returns ``[B, T, C]``.

    With a 2-D ``attention_mask [B, T]`` that has padding, the conv state stored in the cache
    is each row's last real inputs (:func:`real_conv_state`; module docstring). Raises
    ``NotImplementedError`` for a right-padded row on a cache that records its past for
    cropping (assisted decoding), whose conv state is not a fixed window."""
    T = x.shape[1]
    K = mixer.conv_kernel_size
    weight = mixer.conv1d.weight.squeeze(1)
    xt = x.transpose(1, 2)
    if cache is not None:
        xt = cache.update_conv_state(xt, mixer.layer_idx, conv_kernel_size=K)
        m = _mask2d(attention_mask)
        if m is not None and not bool(m[:, -1].bool().all()):  # a row ends in padding
            layer = cache.layers[mixer.layer_idx]
            if getattr(layer, "record_past", False):
                rows = (~m[:, -1].bool()).nonzero().flatten().tolist()
                raise NotImplementedError(
                    f"rows {rows} end in padding (right padding) on a cache that records its past "
                    f"for cropping; pad on the left instead")
            layer.conv_states[0].copy_(real_conv_state(xt, m, K))
    out = F.conv1d(xt.to(weight.dtype), weight.unsqueeze(1), mixer.conv1d.bias, padding=K - 1,
                   groups=weight.shape[0])[..., : xt.shape[-1]]
    out = out[..., -T:]
    out = ACT2FN[mixer.activation](out).to(x.dtype)
    return out.transpose(1, 2)
