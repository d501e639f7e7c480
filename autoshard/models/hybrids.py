"""Published configs of large mixed layer stacks, as `package.module:factory` callables (`--model
autoshard.models.hybrids:nemotron_h_56b`), built on the device the caller sets (`resolve_model`: meta, no weights):

* `nemotron_h_56b`: Nemotron-H-56B-Base-8K (arXiv 2504.03624; Megatron-Bridge's `NemotronHModelProvider56B`):
  118 layers, 54 Mamba-2, 10 attention, 54 squared-ReLU MLP; hidden 8192, 64 heads (8 KV), MLP 32768, Mamba-2
  256 heads of 64, 8 groups, state 256, chunk 128, vocabulary 131072.
* `deepseek_v3`: DeepSeek-V3 (arXiv 2412.19437, its config.json): 61 layers, 3 dense (MLP 18432) then 256 routed
  experts of width 2048, top-8, 1 shared; MLA 128 heads, q rank 1536, KV rank 512; hidden 7168; no MTP layer.
* `qwen3_next_80b`: Qwen3-Next-80B-A3B (`Qwen3NextConfig`'s defaults): 48 layers, three gated DeltaNet then one
  gated attention, repeated; 512 routed experts of width 512, top-10, a shared expert; hidden 2048.
Experts in HF's fixed-shape `grouped_mm` (traceable on fake tensors); bench/bench_mixed_plan.py plans the first two."""

from __future__ import annotations

# "M" Mamba-2, "*" attention, "-" MLP (Nemotron-H's hybrid_override_pattern letters)
NEMOTRON_H_56B_PATTERN = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
                          "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def nemotron_h_56b_config():
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=131072, hidden_size=8192, layers_block_type=[_NEMOTRON_KINDS[c] for c in NEMOTRON_H_56B_PATTERN],
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, intermediate_size=32768,
        mlp_hidden_act="relu2", ssm_state_size=256, mamba_num_heads=256, mamba_head_dim=64, n_groups=8,
        conv_kernel=4, expand=2, chunk_size=128, max_position_embeddings=8192, tie_word_embeddings=False,
        use_mamba_kernels=False, attn_implementation="sdpa")


def nemotron_h_56b():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(nemotron_h_56b_config())


def deepseek_v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, n_group=8, topk_group=4, num_attention_heads=128, num_key_value_heads=128,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=163840, tie_word_embeddings=False, attn_implementation="sdpa",
        experts_implementation="grouped_mm")


def deepseek_v3():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(deepseek_v3_config())


def qwen3_next_80b():
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    return AutoModelForCausalLM.from_config(Qwen3NextConfig(attn_implementation="sdpa", experts_implementation="grouped_mm"))
