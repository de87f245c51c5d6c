"""Depthwise causal conv1d with the Hugging Face conv state, shared by both families.

The conv state lives in the model's own cache (``cache.update_conv_state``), exactly as the
unpatched mixers keep it, so it travels with the attention KV cache between segment calls.
Plain torch (``F.conv1d``) on every device: never the ``causal_conv1d`` / fla kernels that
transformers may select (fla's are GPU-only even when the tensors are on CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

__all__ = ["causal_conv", "mask_padding"]


def mask_padding(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Zero padded positions (Hugging Face ``apply_mask_to_padding_states``)."""
    if attention_mask is not None and attention_mask.dim() == 2:
        dtype = hidden_states.dtype
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
    return hidden_states


def causal_conv(mixer, x: torch.Tensor, cache) -> torch.Tensor:
    """Causal depthwise conv of ``x [B, T, C]`` with the mixer's ``conv1d`` and activation,
    continuing from (and updating) the conv state of ``mixer.layer_idx`` in ``cache``.
    Returns ``[B, T, C]``."""
    T = x.shape[1]
    K = mixer.conv_kernel_size
    weight = mixer.conv1d.weight.squeeze(1)
    xt = x.transpose(1, 2)
    if cache is not None:
        xt = cache.update_conv_state(xt, mixer.layer_idx, conv_kernel_size=K)
    out = F.conv1d(xt.to(weight.dtype), weight.unsqueeze(1), mixer.conv1d.bias, padding=K - 1,
                   groups=weight.shape[0])[..., : xt.shape[-1]]
    out = out[..., -T:]
    out = ACT2FN[mixer.activation](out).to(x.dtype)
    return out.transpose(1, 2)
