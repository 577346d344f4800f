"""Specs from Hugging Face configs: one public config per architecture, bytes by hand.

The configs are written out here (numbers from the public ``config.json`` files) instead of
read from :mod:`hybridcache.adapters.hf.public_configs`, so that the presets are checked
against an independent copy. Every expected byte count is worked out in the test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridcache.adapters.hf import spec_from_hf_config
from hybridcache.errors import SpecError
from hybridcache.presets import get_preset, kimi_k3, kimi_linear_48b
from hybridcache.spec import AttentionKind, StateKind

BF16, FP32 = 2, 4

KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "torch_dtype": "bfloat16",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 1024,
    "first_k_dense_replace": 1,
    "model_max_length": 1048576,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}


def test_kimi_linear_matches_the_hand_built_preset() -> None:
    spec = spec_from_hf_config(KIMI_LINEAR, name="kimi-linear-48b")
    # MLA: (512 latent + 64 rope) values x 2 B x 7 layers.
    assert spec.kv_bytes_per_token == 576 * BF16 * 7 == 8_064
    # KDA layer: conv over q, k, v = 3 * 32 * 128 channels x (4 - 1) taps in bf16,
    # plus the fp32 recurrent state 32 x 128 x 128.
    conv = 3 * 32 * 128 * 3 * BF16  # 73,728
    recurrent = 32 * 128 * 128 * FP32  # 2,097,152
    assert spec.snapshot_bytes == 20 * (conv + recurrent) == 43_417_600
    (mla,) = spec.attention_groups
    assert (mla.kind, mla.num_layers, mla.head_dim) == (AttentionKind.MLA, 7, 576)
    (kda,) = spec.state_groups
    assert kda.kind is StateKind.KDA
    assert [t.shape for t in kda.tensors] == [(12288, 3), (32, 128, 128)]
    # Layer 0 is dense (9216); the others run 8 routed + 1 shared expert of 1024 = 9216.
    assert spec.flops.mlp_ratio == 3 * 9216 / (8 * 2304) == 1.5
    assert spec.max_model_len == 1 << 20
    # Same layout, FLOP model and limits as the hand-built core preset (notes aside).
    assert spec == kimi_linear_48b()
    assert spec.fingerprint() == kimi_linear_48b().fingerprint()


def test_kimi_linear_from_transformers_layer_types() -> None:
    """transformers' normalised schema: layer_types + linear_num_heads and friends."""
    cfg = {
        "model_type": "kimi_linear",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 16,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                        "full_attention"],
        "linear_num_heads": 2,
        "linear_head_dim": 32,
        "linear_conv_kernel_dim": 4,
    }
    spec = spec_from_hf_config(cfg)
    assert spec.name == "KimiLinearForCausalLM"
    assert spec.kv_bytes_per_token == (64 + 16) * BF16 * 1 == 160
    # 3 KDA layers x (conv 3*2*32 channels x 3 taps bf16 + recurrent 2x32x32 fp32).
    assert spec.snapshot_bytes == 3 * (192 * 3 * BF16 + 2 * 32 * 32 * FP32) == 28_032
    assert spec.flops.mlp_ratio == 3 * 512 / (8 * 256)


def test_kimi_k3_config_matches_the_hand_built_preset() -> None:
    """vLLM's KimiK3Config schema: the text model sits in text_config."""
    text = {
        "model_type": "kimi_linear",
        "torch_dtype": "bfloat16",
        "hidden_size": 7168,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "num_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "model_max_length": 1048576,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, 65) if i % 4],
            "full_attn_layers": list(range(4, 65, 4)),
            "num_heads": 64,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
    }
    spec = spec_from_hf_config(
        {"architectures": ["KimiK3ForConditionalGeneration"], "text_config": text},
        name="kimi-k3",
    )
    assert spec.kv_bytes_per_token == 576 * BF16 * 16 == 18_432
    per_layer = 3 * 64 * 128 * 3 * BF16 + 64 * 128 * 128 * FP32  # 147,456 + 4,194,304
    assert spec.snapshot_bytes == 48 * per_layer == 208_404_480
    assert spec == kimi_k3()
    assert get_preset("kimi-k3") == kimi_k3()


def test_kimi_k3_96h_preset_only_changes_the_kda_heads() -> None:
    base, wide = get_preset("kimi-k3"), get_preset("kimi-k3-96h")
    assert wide.kv_bytes_per_token == base.kv_bytes_per_token == 18_432
    assert wide.snapshot_bytes == 48 * (3 * 96 * 128 * 3 * BF16 + 96 * 128 * 128 * FP32)
    assert wide.snapshot_bytes == 312_606_720


QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "torch_dtype": "bfloat16",
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
    "max_position_embeddings": 262144,
}


def test_qwen3_next_80b() -> None:
    spec = spec_from_hf_config(QWEN3_NEXT)
    # 12 attention layers (every 4th), K and V for 2 heads of 256, bf16.
    assert spec.kv_bytes_per_token == 12 * 2 * 2 * 256 * BF16 == 24_576
    # GDN: conv over q, k (16 heads x 128 each) and v (32 x 128) = 8192 channels x 3 taps;
    # recurrent (32 value heads, 128, 128) in the model dtype (vLLM's default for GDN).
    per_layer = 8192 * 3 * BF16 + 32 * 128 * 128 * BF16  # 49,152 + 1,048,576
    assert spec.snapshot_bytes == 36 * per_layer == 39_518_208
    (gdn,) = spec.state_groups
    assert gdn.kind is StateKind.GDN and gdn.num_layers == 36
    # Every layer MoE: 10 x 512 routed + 512 shared = 5632 active SwiGLU width.
    assert spec.flops.mlp_ratio == 3 * 5632 / (8 * 2048)
    assert spec.flops.state_width == 128
    assert replace(spec, name="qwen3-next-80b") == get_preset("qwen3-next-80b")


def test_qwen3_next_state_dtype_override_and_layer_types() -> None:
    fp32 = spec_from_hf_config(QWEN3_NEXT, state_dtype="float32")
    assert fp32.snapshot_bytes == 36 * (8192 * 3 * BF16 + 32 * 128 * 128 * FP32) == 77_266_944
    listed = dict(QWEN3_NEXT, full_attention_interval=None,
                  layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                               for i in range(48)])
    assert spec_from_hf_config(listed) == spec_from_hf_config(QWEN3_NEXT)


NEMOTRON_H_8B = {
    "architectures": ["NemotronHForCausalLM"],
    "torch_dtype": "bfloat16",
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
    "max_position_embeddings": 8192,
}


def test_nemotron_h_8b() -> None:
    spec = spec_from_hf_config(NEMOTRON_H_8B)
    assert spec.kv_bytes_per_token == 4 * 8 * 2 * 128 * BF16 == 16_384
    # Mamba2: conv over x (128 x 64 = 8192) and B, C (8 groups x 128 each) = 10,240 ch x 3;
    # SSM (128, 64, 128) in fp32: vLLM's Nemotron-H default.
    per_layer = 10_240 * 3 * BF16 + 128 * 64 * 128 * FP32  # 61,440 + 4,194,304
    assert spec.snapshot_bytes == 24 * per_layer == 102_137_856
    # 24 '-' layers with a relu2 MLP (2 matrices): 21504 / (4 * 4096).
    assert spec.flops.num_mlp_layers == 24
    assert spec.flops.mlp_ratio == 21504 / (4 * 4096) == 1.3125
    assert spec.max_model_len == 8192
    assert replace(spec, name="nemotron-h-8b") == get_preset("nemotron-h-8b")


def test_nemotron_h_config_ssm_dtype_and_moe_layers() -> None:
    cfg = dict(NEMOTRON_H_8B, mamba_ssm_cache_dtype="bfloat16", hybrid_override_pattern="M*E",
               num_hidden_layers=3, num_experts_per_tok=2, moe_intermediate_size=1024,
               n_shared_experts=1, moe_shared_expert_intermediate_size=2048)
    spec = spec_from_hf_config(cfg)
    assert spec.snapshot_bytes == 10_240 * 3 * BF16 + 128 * 64 * 128 * BF16
    # The user's state_dtype wins over the config's.
    assert spec_from_hf_config(cfg, state_dtype="float32").snapshot_bytes == (
        10_240 * 3 * BF16 + 128 * 64 * 128 * FP32)
    # One MoE layer: 2 x 1024 routed + 2048 shared, relu2 experts.
    assert spec.flops.num_mlp_layers == 1
    assert spec.flops.mlp_ratio == (2 * 1024 + 2048) / (4 * 4096)


JAMBA = {
    "architectures": ["JambaForCausalLM"],
    "torch_dtype": "bfloat16",
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
    "max_position_embeddings": 262144,
}


def test_jamba() -> None:
    spec = spec_from_hf_config(JAMBA)
    # Attention at layers 4, 12, 20, 28; head dim 4096 / 32 = 128, 8 KV heads.
    assert spec.kv_bytes_per_token == 4 * 8 * 2 * 128 * BF16 == 16_384
    # Mamba1: d_inner = 2 x 4096; conv (8192, 3) and SSM (8192, 16), both bf16.
    per_layer = 8192 * 3 * BF16 + 8192 * 16 * BF16  # 49,152 + 262,144
    assert spec.snapshot_bytes == 28 * per_layer == 8_716_288
    (group,) = spec.state_groups
    assert (group.name, group.kind) == ("mamba1", StateKind.MAMBA1)
    assert [t.shape for t in group.tensors] == [(8192, 3), (8192, 16)]
    # 16 MoE layers run 2 experts of 14336, 16 dense layers one MLP of 14336.
    assert spec.flops.mlp_ratio == 3 * (16 * 2 + 16) * 14336 / (8 * 4096 * 32)
    assert replace(spec, name="jamba-mini") == get_preset("jamba-mini")


FALCON_H1_7B = {
    "architectures": ["FalconH1ForCausalLM"],
    "torch_dtype": "bfloat16",
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


def test_falcon_h1_7b_parallel_layers() -> None:
    spec = spec_from_hf_config(FALCON_H1_7B)
    # Every one of the 44 layers has attention: 2 KV heads x 128, K and V, bf16.
    assert spec.kv_bytes_per_token == 44 * 2 * 2 * 128 * BF16 == 45_056
    # ... and a Mamba2 mixer: conv (3072 + 2 x 1 x 256 = 3584, 3), SSM (24, 128, 256).
    per_layer = 3584 * 3 * BF16 + 24 * 128 * 256 * BF16  # 21,504 + 1,572,864
    assert spec.snapshot_bytes == 44 * per_layer == 70_152_192
    flops = spec.flops
    assert (flops.num_attention_layers, flops.num_recurrent_layers, flops.num_mlp_layers) == (
        44, 44, 44)
    assert flops.mlp_ratio == 3 * 12288 / (8 * 3072) == 1.5
    assert replace(spec, name="falcon-h1-7b") == get_preset("falcon-h1-7b")


def test_falcon_h1_derives_d_ssm_and_head_dim() -> None:
    cfg = dict(FALCON_H1_7B, mamba_d_ssm=None, mamba_d_head="auto", mamba_n_heads=48)
    (group,) = spec_from_hf_config(cfg).state_groups
    # d_ssm = expand x hidden = 6144; head dim = 6144 / 48 = 128.
    assert [t.shape for t in group.tensors] == [(6144 + 512, 3), (48, 128, 256)]


MAMBA2 = {
    "architectures": ["Mamba2ForCausalLM"],
    "hidden_size": 2560,
    "num_hidden_layers": 64,
    "expand": 2,
    "head_dim": 64,
    "state_size": 128,
    "n_groups": 1,
    "conv_kernel": 4,
}


def test_mamba2_pure_state() -> None:
    spec = spec_from_hf_config(MAMBA2)
    assert spec.attention_groups == () and spec.kv_bytes_per_token == 0
    # d_inner 5120 -> 80 heads of 64; conv (5120 + 2 x 128, 3), SSM (80, 64, 128), bf16.
    per_layer = 5376 * 3 * BF16 + 80 * 64 * 128 * BF16  # 32,256 + 1,310,720
    assert spec.snapshot_bytes == 64 * per_layer == 85_950_464
    assert spec.flops.num_mlp_layers == 0
    assert spec.describe()["tokens_per_snapshot"] is None
    assert replace(spec, name="mamba2-2.7b") == get_preset("mamba2-2.7b")


GRANITE_4_H = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "torch_dtype": "bfloat16",
    "hidden_size": 4096,
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


def test_granite_4_h_small() -> None:
    spec = spec_from_hf_config(GRANITE_4_H)
    assert spec.kv_bytes_per_token == 4 * 8 * 2 * 128 * BF16 == 16_384
    per_layer = (8192 + 2 * 128) * 3 * BF16 + 128 * 64 * 128 * BF16  # 50,688 + 2,097,152
    assert spec.snapshot_bytes == 36 * per_layer == 77_322_240
    # Every layer: 10 x 768 routed + 1536 shared = 9216 SwiGLU width.
    assert spec.flops.mlp_ratio == 3 * 9216 / (8 * 4096)
    assert replace(spec, name="granite-4.0-h-small") == get_preset("granite-4.0-h-small")


@pytest.mark.parametrize(
    ("kv_dtype", "expected"), [("fp8", 8_064 // 2), ("float32", 8_064 * 2), ("auto", 8_064)]
)
def test_kv_dtype(kv_dtype: str, expected: int) -> None:
    assert spec_from_hf_config(KIMI_LINEAR, kv_dtype=kv_dtype).kv_bytes_per_token == expected


def test_kda_state_dtype_rules() -> None:
    bf16 = spec_from_hf_config(KIMI_LINEAR, state_dtype="bfloat16")
    assert bf16.snapshot_bytes == 20 * (3 * 32 * 128 * 3 * BF16 + 32 * 128 * 128 * BF16)
    with pytest.raises(SpecError, match="state_dtype"):
        spec_from_hf_config(KIMI_LINEAR, state_dtype="float16")
    with pytest.raises(SpecError, match="kv_dtype"):
        spec_from_hf_config(KIMI_LINEAR, kv_dtype="int4")


def test_float32_checkpoint_is_served_in_bfloat16() -> None:
    """vLLM downcasts float32 checkpoints with --dtype auto; caches follow."""
    spec = spec_from_hf_config(dict(JAMBA, torch_dtype="float32"))
    assert spec == spec_from_hf_config(JAMBA)
    half = spec_from_hf_config(dict(JAMBA, torch_dtype="float16"))
    assert {t.dtype for t in half.state_groups[0].tensors} == {"float16"}


GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "torch_dtype": "bfloat16",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
}


def test_gpt_oss_20b() -> None:
    """Two groups of 12 layers each, one of them a 128-token sliding window."""
    spec = spec_from_hf_config(GPT_OSS_20B)
    full, slide = spec.attention_groups
    assert (full.kind, full.num_layers, full.window) == (AttentionKind.FULL, 12, None)
    assert (slide.kind, slide.num_layers, slide.window) == (AttentionKind.SLIDING, 12, 128)
    assert full.bytes_per_token == slide.bytes_per_token == 12 * 8 * 2 * 64 * BF16 == 24_576
    assert spec.kv_bytes_per_token == 49_152 and not spec.state_groups
    # Every layer: 4 active SwiGLU experts of width 2880.
    assert spec.flops.mlp_ratio == 3 * 4 * 2880 / (8 * 2880)
    assert spec.max_model_len == 131072
    assert replace(spec, name="gpt-oss-20b") == get_preset("gpt-oss-20b")
    big = get_preset("gpt-oss-120b")
    assert [g.num_layers for g in big.attention_groups] == [18, 18]
    assert big.attention_groups[1].window == 128


def test_gpt_oss_without_layer_types_follows_vllm() -> None:
    """vLLM's GptOssAttention: even layers (0-based) slide, odd ones attend fully."""
    cfg = {k: v for k, v in GPT_OSS_20B.items() if k != "layer_types"}
    assert spec_from_hf_config(cfg) == spec_from_hf_config(GPT_OSS_20B)
    odd = dict(cfg, num_hidden_layers=5)
    assert [g.num_layers for g in spec_from_hf_config(odd).attention_groups] == [2, 3]


@pytest.mark.parametrize(
    "change", [{"layer_types": ["sliding_attention"] * 23}, {"layer_types": ["local"] * 24}]
)
def test_gpt_oss_bad_layer_types(change: dict) -> None:
    with pytest.raises(SpecError, match="layer_types"):
        spec_from_hf_config(dict(GPT_OSS_20B, **change))


def test_gpt_oss_manager_holds_the_window() -> None:
    """The preset through the manager: the sliding group is the coordinator's, with the
    exact token rule at 16-token units (ceil(127 / 16) = 8 units before a hit end)."""
    from hybridcache.manager import CacheConfig, HybridCacheManager

    m = HybridCacheManager(get_preset("gpt-oss-20b"), 1 << 30, CacheConfig(hash_unit=16))
    assert m.groups == ["attention"] and m.sliding_groups == ("sliding_attention",)
    assert m.coordinator.caches[0].reach == 8
    tokens = list(range(1000))
    m.add_request("a", tokens)
    m.allocate("a", 1000)
    m.commit("a", 1000)
    table = m.requests["a"].slide[0].tables[0]
    # The next token (1000) reads tokens 873..999: units 54..62 stay, the rest is released.
    assert [u for u, p in enumerate(table) if p >= 0] == list(range(54, 63))
    m.free("a")
    assert m.add_request("b", tokens + [5]).hit_tokens == 992
    m.check_invariants()
