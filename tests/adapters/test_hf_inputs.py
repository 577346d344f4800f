"""spec_from_hf_config inputs: paths, transformers objects, bad configs, the preset registry."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hybridcache.adapters.hf import (
    PRESET_CONFIGS,
    SUPPORTED_ARCHITECTURES,
    preset_config,
    spec_from_hf_config,
)
from hybridcache.errors import SpecError, UnknownNameError
from hybridcache.presets import get_preset, kimi_k3, kimi_linear_48b, preset_names

#: A small Qwen3-Next: 2 Gated DeltaNet + 2 attention layers (as DESIGN.md's CPU model).
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "torch_dtype": "bfloat16",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "max_position_embeddings": 4096,
}
# KV: 2 layers x 2 heads x (K + V) x 32 x 2 B. State per GDN layer: conv over
# 2*2*128 + 4*32 = 640 channels x 3 taps x 2 B, recurrent (4, 32, 128) x 2 B.
TINY_KV = 2 * 2 * 2 * 32 * 2
TINY_SNAPSHOT = 2 * (640 * 3 * 2 + 4 * 32 * 128 * 2)


def test_tiny_qwen3_next_bytes() -> None:
    spec = spec_from_hf_config(TINY_QWEN3_NEXT, name="tiny")
    assert (spec.kv_bytes_per_token, spec.snapshot_bytes) == (TINY_KV, TINY_SNAPSHOT) == (
        512, 73_216)


def test_config_json_path_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3_NEXT), encoding="utf-8")
    expected = spec_from_hf_config(TINY_QWEN3_NEXT, name="tiny")
    for source in (tmp_path / "config.json", tmp_path, str(tmp_path)):
        assert spec_from_hf_config(source, name="tiny") == expected


def test_default_name_comes_from_name_or_path() -> None:
    spec = spec_from_hf_config(dict(TINY_QWEN3_NEXT, _name_or_path="/models/Qwen3-Next-tiny/"))
    assert spec.name == "Qwen3-Next-tiny"
    assert spec_from_hf_config(TINY_QWEN3_NEXT).name == "Qwen3NextForCausalLM"


def test_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="cannot read"):
        spec_from_hf_config(tmp_path / "nowhere" / "config.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(SpecError, match="not valid JSON"):
        spec_from_hf_config(tmp_path)
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(SpecError, match="JSON object"):
        spec_from_hf_config(bad)
    with pytest.raises(SpecError, match="expected a dict"):
        spec_from_hf_config(42)


def test_transformers_config_object() -> None:
    transformers = pytest.importorskip("transformers")
    try:
        cfg = transformers.Qwen3NextConfig(
            **{k: v for k, v in TINY_QWEN3_NEXT.items() if k != "model_type"})
    except Exception as exc:  # an older transformers without Qwen3-Next
        pytest.skip(f"transformers cannot build Qwen3NextConfig offline: {exc}")
    assert spec_from_hf_config(cfg, name="tiny") == spec_from_hf_config(TINY_QWEN3_NEXT, name="tiny")


@pytest.mark.parametrize(
    ("preset", "class_name"),
    [
        ("kimi-linear-48b", "KimiLinearConfig"),
        ("nemotron-h-8b", "NemotronHConfig"),
        ("jamba-mini", "JambaConfig"),
        ("falcon-h1-7b", "FalconH1Config"),
        ("mamba2-2.7b", "Mamba2Config"),
        ("granite-4.0-h-small", "GraniteMoeHybridConfig"),
    ],
)
def test_transformers_objects_of_the_presets(preset: str, class_name: str) -> None:
    """transformers renames fields (Nemotron's pattern becomes layers_block_type, ...)."""
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, class_name, None)
    if cls is None:
        pytest.skip(f"transformers has no {class_name}")
    fields = {k: v for k, v in preset_config(preset).items() if k != "model_type"}
    try:
        obj = cls(**fields)
    except Exception as exc:
        pytest.skip(f"transformers cannot build {class_name} offline: {exc}")
    assert spec_from_hf_config(obj, name=preset) == get_preset(preset)


def test_unsupported_architecture_lists_the_supported_ones() -> None:
    with pytest.raises(SpecError) as info:
        spec_from_hf_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096})
    message = str(info.value)
    assert "LlamaForCausalLM" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)
    assert len(SUPPORTED_ARCHITECTURES) == 9
    with pytest.raises(SpecError, match="'llama'.*Qwen3NextForCausalLM"):
        spec_from_hf_config({"model_type": "llama"})
    with pytest.raises(SpecError, match="architectures: missing"):
        spec_from_hf_config({"hidden_size": 4096})


def test_model_type_stands_in_for_a_missing_architectures() -> None:
    cfg = {k: v for k, v in TINY_QWEN3_NEXT.items() if k != "architectures"}
    assert spec_from_hf_config(cfg, name="tiny") == spec_from_hf_config(TINY_QWEN3_NEXT, name="tiny")


def _without(config: dict, path: str) -> dict:
    """A deep copy of ``config`` with the dotted field ``path`` removed."""
    out = copy.deepcopy(config)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    del node[leaf]
    return out


@pytest.mark.parametrize(
    ("preset", "field"),
    [
        ("qwen3-next-80b", "linear_num_value_heads"),
        ("qwen3-next-80b", "hidden_size"),
        ("kimi-linear-48b", "kv_lora_rank"),
        ("kimi-linear-48b", "linear_attn_config.short_conv_kernel_size"),
        ("kimi-k3", "text_config.linear_attn_config.num_heads"),
        ("kimi-k3", "text_config"),
        ("nemotron-h-8b", "mamba_head_dim"),
        ("nemotron-h-8b", "hybrid_override_pattern"),
        ("jamba-mini", "attn_layer_period"),
        ("falcon-h1-7b", "mamba_n_groups"),
        ("mamba2-2.7b", "state_size"),
        ("granite-4.0-h-small", "layer_types"),
    ],
)
def test_missing_field_is_named(preset: str, field: str) -> None:
    with pytest.raises(SpecError, match=f"{field}: missing"):
        spec_from_hf_config(_without(preset_config(preset), field))


@pytest.mark.parametrize(
    ("patch", "pattern"),
    [
        ({"num_hidden_layers": "48"}, r"num_hidden_layers: must be an integer"),
        ({"linear_conv_kernel_dim": 1}, r"linear_conv_kernel_dim: must be >= 2"),
        ({"num_key_value_heads": 0}, r"num_key_value_heads: must be >= 1"),
        ({"layer_types": ["linear_attention"] * 47}, r"layer_types: has 47 entries"),
        ({"layer_types": ["linear_attention"] * 47 + ["mystery"]}, r"unknown layer types"),
        ({"mlp_only_layers": "none"}, r"mlp_only_layers: must be a list"),
        ({"torch_dtype": "int4"}, r"torch_dtype: unknown dtype"),
    ],
)
def test_invalid_field_is_named(patch: dict, pattern: str) -> None:
    with pytest.raises(SpecError, match=pattern):
        spec_from_hf_config({**preset_config("qwen3-next-80b"), **patch})


def test_invalid_layer_layouts() -> None:
    kimi = preset_config("kimi-linear-48b")
    kimi["linear_attn_config"]["full_attn_layers"] = [3, 4, 8, 12, 16, 20, 24, 27]
    with pytest.raises(SpecError, match="kda_layers / linear_attn_config.full_attn_layers"):
        spec_from_hf_config(kimi)
    kimi["linear_attn_config"]["kda_layers"] = [1, 2, 28]
    with pytest.raises(SpecError, match="kda_layers: 1-based layer numbers up to 27"):
        spec_from_hf_config(kimi)
    nemotron = preset_config("nemotron-h-8b")
    with pytest.raises(SpecError, match="hybrid_override_pattern: characters"):
        spec_from_hf_config(dict(nemotron, hybrid_override_pattern="M-X*"))
    with pytest.raises(SpecError, match="has 4 layers but num_hidden_layers is 52"):
        spec_from_hf_config(dict(nemotron, hybrid_override_pattern="M-M*"))


def test_spec_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        spec_from_hf_config({"architectures": ["GPT2LMHeadModel"]})


def test_presets_are_registered_and_replace_the_core_ones() -> None:
    names = set(preset_names())
    assert set(PRESET_CONFIGS) <= names
    assert {"kimi-linear-48b", "kimi-k3", "qwen3-next-80b", "nemotron-h-8b", "jamba-mini",
            "falcon-h1-7b", "mamba2-2.7b", "granite-4.0-h-small"} <= names
    # The registered factories are now the config-derived ones, whose notes name the source.
    assert "KimiLinearForCausalLM" in get_preset("kimi-linear-48b").notes
    assert get_preset("kimi-linear-48b") == kimi_linear_48b()
    assert "KimiK3ForConditionalGeneration" in get_preset("kimi-k3").notes
    assert get_preset("kimi-k3") == kimi_k3()
    for name in PRESET_CONFIGS:
        assert get_preset(name).name == name


def test_preset_config_is_a_private_copy() -> None:
    cfg = preset_config("kimi-linear-48b")
    cfg["linear_attn_config"]["num_heads"] = 64
    assert spec_from_hf_config(cfg).snapshot_bytes == 2 * get_preset("kimi-linear-48b").snapshot_bytes
    assert PRESET_CONFIGS["kimi-linear-48b"]["linear_attn_config"]["num_heads"] == 32
    with pytest.raises(UnknownNameError, match="known: .*qwen3-next-80b"):
        preset_config("llama-3-8b")
