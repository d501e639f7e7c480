"""Tiny configs of Hugging Face's hybrid and mixed-stack decoders (random weights, no hub access), as
`package.module:factory` callables: `--model tests.models.hybrid_models:bamba_tiny`.

Every factory builds the model in float32 with the attention in sdpa and the experts (where any) in
HF's fixed-shape `grouped_mm` implementation, so that it traces on fake tensors."""

from __future__ import annotations

import functools

from transformers import AutoConfig, AutoModelForCausalLM

_COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               tie_word_embeddings=False, attn_implementation="sdpa")
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=16)


def config(model_type: str, **overrides):
    """The tiny HF config of `model_type` (see the factories), with `overrides`."""
    return AutoConfig.for_model(model_type, **{**_TINY[model_type], **overrides})


def build(model_type: str, **overrides):
    return AutoModelForCausalLM.from_config(config(model_type, **overrides))


_TINY = {
    # Mamba-2 layers with attention at 1 (IBM Bamba)
    "bamba": dict(_COMMON, num_hidden_layers=4, intermediate_size=96, attn_layer_indices=[1], **_MAMBA),
    # Mamba-2 (M), MoE (E), attention (*) and MLP (-) layers, one mixer each (NVIDIA Nemotron-H)
    "nemotron_h": dict(_COMMON, layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                                                   "linear_attention", "mlp"],
                       head_dim=16, intermediate_size=96, ssm_state_size=16, mamba_num_heads=8,
                       mamba_head_dim=16, n_groups=2, conv_kernel=4, expand=2, chunk_size=16,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32, use_mamba_kernels=False,
                       experts_implementation="grouped_mm"),
    # Granite-4: Mamba-2 and attention layers, every one with a MoE and a shared MLP
    "granitemoehybrid": dict(_COMMON, num_hidden_layers=4, intermediate_size=32, shared_intermediate_size=96,
                             layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4,
                             num_experts_per_tok=2, experts_implementation="grouped_mm", **_MAMBA),
    # attention and Mamba-2 side by side in every layer (TII Falcon-H1)
    "falcon_h1": dict(_COMMON, num_hidden_layers=3, intermediate_size=96, mamba_d_ssm=128, **_MAMBA),
    # Mamba-1 layers with attention every 4th and MoE every 2nd (AI21 Jamba)
    "jamba": dict(_COMMON, num_hidden_layers=4, intermediate_size=96, attn_layer_period=4, attn_layer_offset=2,
                  expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
                  mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False,
                  experts_implementation="grouped_mm"),
    # Mamba-2 layers and hybrid layers holding a shared transformer block (Zyphra Zamba2)
    "zamba2": dict(_COMMON, num_hidden_layers=4, intermediate_size=96,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=16, mamba_d_conv=4,
                   mamba_expand=2, mamba_ngroups=2, n_mamba_heads=8, chunk_size=16, use_mamba_kernels=False,
                   num_mem_blocks=1, adapter_rank=8, tie_word_embeddings=True),
    # MLA attention; the first layer dense, the others MoE (DeepSeek-V3)
    "deepseek_v3": dict(_COMMON, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96,
                        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        experts_implementation="grouped_mm"),
    # not named by issue 25: Qwen2-MoE with dense layers between its MoE ones, Qwen3-Next (gated DeltaNet +
    # attention), LFM2 (short convolutions + attention), Gemma-3 (sliding and full attention: one kind)
    "qwen2_moe": dict(_COMMON, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
                      mlp_only_layers=[], experts_implementation="grouped_mm"),
    "qwen3_next": dict(_COMMON, num_hidden_layers=4, intermediate_size=96, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, head_dim=16,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, experts_implementation="grouped_mm"),
    "lfm2": dict(_COMMON, num_hidden_layers=4, intermediate_size=96,
                 layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "gemma3_text": dict(_COMMON, num_hidden_layers=6, intermediate_size=96, head_dim=16, sliding_window=8),
    # Gemma-4-31B's layers: sliding ones (head_dim 16, 2 KV heads, an 8-token window) and full ones with twice the
    # head_dim and one K/V head whose keys are its values (k_eq_v), per layer type in HF's per_layer_config
    "gemma4_text": dict(_COMMON, num_hidden_layers=4, intermediate_size=96, head_dim=16, global_head_dim=32,
                        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                        hidden_size_per_layer_input=0),
}


# the factories: `--model tests.models.hybrid_models:<model type>_tiny`
bamba_tiny, nemotron_h_tiny, granitemoehybrid_tiny, falcon_h1_tiny, jamba_tiny, zamba2_tiny, deepseek_v3_tiny = (
    functools.partial(build, t) for t in ("bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "jamba", "zamba2",
                                          "deepseek_v3"))
qwen3_next_tiny, lfm2_tiny = functools.partial(build, "qwen3_next"), functools.partial(build, "lfm2")
gemma4_tiny = functools.partial(build, "gemma4_text")
