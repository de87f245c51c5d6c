"""Tiny random configurations of every supported architecture, for tests and benchmarks.

Each config is as small as the architecture allows (hidden 32-64, 2-4 layers, vocab 96)
while still exercising what the adapters must get right: grouped B/C (Mamba-2,
``n_groups`` = 2 where the model accepts it), grouped q/k heads (GDN, 2 key heads for 4
value heads), a conv state, at least one attention layer (except pure ``mamba2``), and the
family-specific extras (Falcon-H1 multipliers and mup vector, OLMo-Hybrid's 2 x beta).
Nothing is downloaded: models are built with random weights from the config.
"""

from __future__ import annotations

import torch

__all__ = ["TINY_VOCAB", "tiny_config", "tiny_model", "TINY_ARCHITECTURES"]

TINY_VOCAB = 96
# Larger than the usual 0.02 so that the SSM path moves the logits well above the 1e-4
# test tolerance (with 0.02 the mixers barely touch the residual stream).
TINY_INIT_RANGE = 0.2

TINY_ARCHITECTURES = (
    "mamba2",
    "nemotron_h",
    "falcon_h1",
    "bamba",
    "granitemoehybrid",
    "zamba2",
    "qwen3_5",
    "qwen3_next",
    "olmo_hybrid",
)

_COMMON = dict(vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
               initializer_range=TINY_INIT_RANGE,
               tie_word_embeddings=False)


def tiny_config(arch: str):
    """A tiny random-weight config of model type ``arch`` (a transformers config object)."""
    import transformers as T

    if arch == "mamba2":
        return T.Mamba2Config(hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
                              expand=2, n_groups=2, state_size=16, conv_kernel=4,
                              chunk_size=8, **_COMMON)
    if arch == "nemotron_h":
        return T.NemotronHConfig(
            hidden_size=32, layers_block_type=["mamba", "attention", "mlp", "mamba"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
            ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
            conv_kernel=4, chunk_size=8, num_hidden_layers=4, **_COMMON)
    if arch == "falcon_h1":
        return T.FalconH1Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8,
            mamba_rms_norm=True, ssm_in_multiplier=0.75, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
            embedding_multiplier=1.5, lm_head_multiplier=0.8, **_COMMON)
    if arch == "bamba":
        return T.BambaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=8,
            mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8, **_COMMON)
    if arch == "granitemoehybrid":
        return T.GraniteMoeHybridConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
            num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=32,
            mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
            mamba_chunk_size=8, position_embedding_type="rope", **_COMMON)
    if arch == "zamba2":
        return T.Zamba2Config(
            hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"],
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8,
            mamba_headdim=8, num_attention_heads=4, num_key_value_heads=4, attention_head_dim=8,
            intermediate_size=64, adapter_rank=8, chunk_size=8, **_COMMON | {"tie_word_embeddings": True})
    if arch == "qwen3_5":
        return T.Qwen3_5TextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, **_COMMON)
    if arch == "qwen3_next":
        return T.Qwen3NextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=2,
            num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            **_COMMON)
    if arch == "olmo_hybrid":
        return T.OlmoHybridConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            linear_key_head_dim=16, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
            **_COMMON)
    raise ValueError(f"no tiny config for {arch!r}; known: {', '.join(TINY_ARCHITECTURES)}")


def tiny_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny randomly initialised ``*ForCausalLM`` of ``arch`` in eval mode on CPU.

    After the model's own init, the SSM parameters are perturbed (seeded) so that decays,
    time steps and D differ per head: the standard inits (A = 1..H, dt_bias = 1, D = 1)
    would hide head-mixing bugs.
    """
    import transformers as T

    cfg = tiny_config(arch)
    torch.manual_seed(seed)
    # eager experts: the grouped-mm MoE path does not take float64 (equivalence tests run in it)
    model = T.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.empty_like(p).uniform_(-1.5, 1.0, generator=g))
            elif leaf == "dt_bias":
                p.copy_(torch.empty_like(p).uniform_(-2.0, 0.5, generator=g))
            elif leaf == "D":
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif leaf == "weight" and ("norm" in name) and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()
