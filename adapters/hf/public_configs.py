"""Configs of public checkpoints, embedded so that presets need no download.

Each dict holds the fields of the published ``config.json`` that the cache layout and the
FLOP model depend on (plus ``architectures``/``model_type``/dtype to identify it); other
fields (tokenizer ids, rope settings, ...) are left out. Values are copied from the
published files, except where a comment says otherwise. The two Kimi K3 configs are not
published: they follow vLLM's ``KimiK3Config`` schema with stated assumptions.
"""

from __future__ import annotations

from typing import Any


def _kda_split(num_layers: int, every: int) -> dict[str, list[int]]:
    """1-based KDA / full-attention layer lists with attention on every ``every``-th layer."""
    full = [i for i in range(1, num_layers + 1) if i % every == 0]
    return {"kda_layers": [i for i in range(1, num_layers + 1) if i % every],
            "full_attn_layers": full}


#: moonshotai/Kimi-Linear-48B-A3B-Instruct (and -Base): 27 layers, MLA at 4, 8, ..., 24, 27.
KIMI_LINEAR_48B_A3B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "torch_dtype": "bfloat16",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "model_max_length": 1048576,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}


def _kimi_k3_like(kda_heads: int, mla_heads: int) -> dict[str, Any]:
    """A K3-shaped ``KimiK3Config``; every number below is an assumption unless noted."""
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": {
            "model_type": "kimi_linear",
            "torch_dtype": "bfloat16",
            "hidden_size": 7168,  # Kimi K2's width; vLLM's K3 kernels also require 7168
            "num_hidden_layers": 64,  # assumed: 48 KDA + 16 MLA (Kimi Linear's 3 : 1)
            "num_attention_heads": mla_heads,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,  # K2's MLA latent, as vLLM's K3 fused_qkv_a_proj implies
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,  # vLLM asserts K3's MLA is NoPE
            "num_experts": 896,  # public: 16 of 896 experts active
            "num_experts_per_token": 16,
            "num_shared_experts": 1,  # assumed, as the expert width below
            "moe_intermediate_size": 2048,
            "first_k_dense_replace": 0,
            "moe_layer_freq": 1,
            "model_max_length": 1048576,  # public: 1M context
            "linear_attn_config": {
                **_kda_split(64, 4),
                "num_heads": kda_heads,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": True,  # what selects vLLM's KimiK3DeltaAttention
            },
        },
    }


#: The hand-built ``kimi-k3`` preset's assumptions, written as a config: 64 KDA heads.
KIMI_K3_LIKE: dict[str, Any] = _kimi_k3_like(kda_heads=64, mla_heads=64)

#: Per-layer K3 shapes implied by vLLM 0.32.0's K3 kernel tables (``KIMI_K3_PROJECTIONS``
#: in ``vllm/models/kimi_k3/nvidia/low_latency_gemm.py``, keyed by TP-8 shard shapes):
#: f_b_proj N = 1536 = 96 * 128 / 8 and in_proj_qkvgfab N = 6288 = 4 * 1536 + 128 + 12
#: (+4 padding) give 96 KDA heads of dim 128; q_b_proj 2304 = 96 * 192 / 8 gives 96 MLA
#: heads. Layer counts and experts remain the assumptions of ``KIMI_K3_LIKE``.
KIMI_K3_96H: dict[str, Any] = _kimi_k3_like(kda_heads=96, mla_heads=96)

#: Qwen/Qwen3-Next-80B-A3B-Instruct (the Thinking model has the same layout).
QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 262144,
}

#: nvidia/Nemotron-H-8B-Base-8K: 24 Mamba2 + 4 attention + 24 MLP layers.
NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "torch_dtype": "bfloat16",
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "expand": 2,
    "mlp_hidden_act": "relu2",
    "max_position_embeddings": 8192,
}

#: ai21labs/Jamba-v0.1 (AI21-Jamba-1.5-Mini shares the layout): 32 layers, attention at
#: i % 8 == 4, MoE (16 experts, top 2) at i % 2 == 1, Mamba1 elsewhere.
JAMBA_V0_1: dict[str, Any] = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "torch_dtype": "bfloat16",
    "vocab_size": 65536,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 256,
    "max_position_embeddings": 262144,
}

#: tiiuae/Falcon-H1-7B-Base (and -Instruct): attention and Mamba2 in parallel in 44 layers.
FALCON_H1_7B: dict[str, Any] = {
    "architectures": ["FalconH1ForCausalLM"],
    "model_type": "falcon_h1",
    "torch_dtype": "bfloat16",
    "vocab_size": 130048,
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "num_hidden_layers": 44,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "mamba_d_ssm": 3072,
    "mamba_n_heads": 24,
    "mamba_d_head": 128,
    "mamba_n_groups": 1,
    "mamba_d_state": 256,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "max_position_embeddings": 262144,
}

#: state-spaces/mamba2-2.7b, translated from its mamba_ssm config (d_model 2560, n_layer 64,
#: ssm_cfg layer Mamba2, d_intermediate 0) into transformers' Mamba2Config fields; d_state,
#: d_conv, expand, headdim and ngroups are mamba_ssm's Mamba2 defaults (128, 4, 2, 64, 1),
#: which that config does not override. No torch_dtype: served in bfloat16.
MAMBA2_2_7B: dict[str, Any] = {
    "architectures": ["Mamba2ForCausalLM"],
    "model_type": "mamba2",
    "vocab_size": 50277,
    "hidden_size": 2560,
    "num_hidden_layers": 64,
    "expand": 2,
    "head_dim": 64,
    "num_heads": 80,
    "state_size": 128,
    "n_groups": 1,
    "conv_kernel": 4,
}

#: ibm-granite/granite-4.0-h-small (32B total, 9B active): 36 Mamba2 + 4 attention layers,
#: each with 72 experts (top 10, width 768) and a 1536-wide shared expert. The Mamba2 head
#: layout (128 heads x 64, 1 group) and the attention positions (layers 5, 15, 25, 35) are
#: from our reading of the published file and were not re-checked against it here; the
#: positions do not affect any cache size.
GRANITE_4_0_H_SMALL: dict[str, Any] = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "torch_dtype": "bfloat16",
    "vocab_size": 100352,
    "hidden_size": 4096,
    "num_hidden_layers": 40,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "layer_types": ["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "num_local_experts": 72,
    "num_experts_per_tok": 10,
    "intermediate_size": 768,
    "shared_intermediate_size": 1536,
    "max_position_embeddings": 131072,
}


def _gpt_oss(num_layers: int, experts: int) -> dict[str, Any]:
    """The fields both gpt-oss checkpoints share (they differ in depth and experts)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "torch_dtype": "bfloat16",  # attention and KV; the experts' weights are mxfp4
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        "initial_context_length": 4096,
        "max_position_embeddings": 131072,
    }


#: openai/gpt-oss-20b: 24 layers alternating sliding-window (128 tokens) and full attention.
GPT_OSS_20B: dict[str, Any] = _gpt_oss(24, 32)

#: openai/gpt-oss-120b: 36 layers, 128 experts, otherwise as gpt-oss-20b.
GPT_OSS_120B: dict[str, Any] = _gpt_oss(36, 128)
