"""Our state shapes and dtypes against vLLM's own, for the same configs (needs vLLM).

For each preset config, vLLM's model class computes its state shapes/dtypes from the same
config (``get_mamba_state_shape_from_config`` / ``..._dtype_...``, or the KDA layer's
``get_state_shape``), and its KV cache specs give the bytes per token and layer. vLLM is
fed a minimal stand-in for ``VllmConfig`` (TP 1, bf16, no speculative tokens), so nothing
is loaded or downloaded.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from hybridcache.adapters.hf import preset_config, spec_from_hf_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _import(name: str):
    """Import a vLLM module or skip: a broken install fails with more than ImportError."""
    try:
        return importlib.import_module(name)
    except Exception as exc:  # ImportError, or e.g. a torchvision clash at import time
        pytest.skip(f"vLLM not usable here: {type(exc).__name__}: {exc}")


@pytest.fixture(scope="module")
def vllm():
    torch = _import("torch")
    utils = _import("vllm.model_executor.layers.mamba.mamba_utils")
    kv = _import("vllm.v1.kv_cache_interface")
    return SimpleNamespace(torch=torch, utils=utils, kv=kv)


def _vllm_config(vllm, hf: dict, ssm_cache_dtype: str = "auto") -> SimpleNamespace:
    hf_ns = SimpleNamespace(**hf)
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_ns, hf_text_config=hf_ns,
                                     dtype=vllm.torch.bfloat16),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto",
                                     mamba_ssm_cache_dtype=ssm_cache_dtype,
                                     use_replayssm=False, use_kda_recoverssm=False),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        num_speculative_tokens=0,
        speculative_config=None,
    )


def _as_ours(vllm, shapes, dtypes) -> list[tuple[tuple[int, ...], str]]:
    """vLLM's (shape, dtype) list in our orientation: conv states (dim, state_len)."""
    shapes = [tuple(s) for s in shapes]
    if not vllm.utils.is_conv_state_dim_first():  # vLLM's default "SD" = (state_len, dim)
        shapes[0] = shapes[0][::-1]
    return [(s, str(d).removeprefix("torch.")) for s, d in zip(shapes, dtypes)]


def _state_of(spec) -> list[tuple[tuple[int, ...], str]]:
    (group,) = spec.state_groups
    return [(t.shape, t.dtype) for t in group.tensors]


MODEL_CLASSES = [
    ("qwen3-next-80b", "qwen3_next", "Qwen3NextForCausalLM"),
    ("nemotron-h-8b", "nemotron_h", "NemotronHForCausalLM"),
    ("jamba-mini", "jamba", "JambaForCausalLM"),
    ("falcon-h1-7b", "falcon_h1", "FalconH1ForCausalLM"),
    ("mamba2-2.7b", "mamba2", "Mamba2ForCausalLM"),
    ("granite-4.0-h-small", "granitemoehybrid", "GraniteMoeHybridForCausalLM"),
]


@pytest.mark.parametrize("state_dtype", [None, "float32", "bfloat16"])
@pytest.mark.parametrize(("preset", "module", "class_name"), MODEL_CLASSES)
def test_mamba_and_gdn_states_match_vllm(vllm, preset, module, class_name, state_dtype) -> None:
    model = getattr(_import(f"vllm.model_executor.models.{module}"), class_name)
    hf = preset_config(preset)
    vcfg = _vllm_config(vllm, hf, state_dtype or "auto")
    if preset == "nemotron-h-8b":  # vLLM's config hook turns "auto" into float32 here
        cfg_mod = _import("vllm.model_executor.models.config")
        cfg_mod.NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype(
            cache_config=vcfg.cache_config, hf_config=vcfg.model_config.hf_config)
    shapes = model.get_mamba_state_shape_from_config(vcfg)
    dtypes = model.get_mamba_state_dtype_from_config(vcfg)
    spec = spec_from_hf_config(hf, state_dtype=state_dtype)
    assert _state_of(spec) == _as_ours(vllm, shapes, dtypes)
    # vLLM's page for one layer's state holds exactly our per-layer bytes.
    page = vllm.kv.MambaSpec(block_size=16, shapes=tuple(shapes), dtypes=tuple(dtypes))
    assert spec.state_groups[0].bytes_per_layer == page.page_size_bytes


def _kda_self(vllm, lac: dict, **cache) -> SimpleNamespace:
    """The attributes vLLM's KDA layer sets in __init__ and reads in get_state_*."""
    return SimpleNamespace(
        tp_size=1, num_spec=0, num_heads=lac["num_heads"], head_dim=lac["head_dim"],
        conv_size=lac["short_conv_kernel_size"],
        model_config=SimpleNamespace(dtype=vllm.torch.bfloat16),
        cache_config=SimpleNamespace(mamba_cache_dtype="auto", use_kda_recoverssm=False,
                                     **cache),
    )


def test_kimi_linear_kda_state_matches_vllm(vllm) -> None:
    layer = _import("vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn")
    cls = layer.KimiGatedDeltaNetAttention
    hf = preset_config("kimi-linear-48b")
    me = _kda_self(vllm, hf["linear_attn_config"])
    theirs = _as_ours(vllm, cls.get_state_shape(me), cls.get_state_dtype(me))
    assert _state_of(spec_from_hf_config(hf)) == theirs
    # Which layers are KDA, by vLLM's own config class.
    configs = _import("vllm.transformers_utils.configs.kimi_linear")
    vcfg = configs.KimiLinearConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    n_kda = sum(vcfg.is_kda_layer(i) for i in range(vcfg.num_hidden_layers))
    assert spec_from_hf_config(hf).state_groups[0].num_layers == n_kda == 20


@pytest.mark.parametrize("preset", ["kimi-k3", "kimi-k3-96h"])
@pytest.mark.parametrize("state_dtype", [None, "bfloat16"])
def test_kimi_k3_kda_state_matches_vllm(vllm, preset, state_dtype) -> None:
    kda = _import("vllm.models.kimi_k3.nvidia.kda")
    cls = kda.KimiK3DeltaAttention
    hf = preset_config(preset)
    me = _kda_self(vllm, hf["text_config"]["linear_attn_config"],
                   mamba_ssm_cache_dtype=state_dtype or "auto")
    theirs = _as_ours(vllm, cls.get_state_shape(me), cls.get_state_dtype(me))
    assert _state_of(spec_from_hf_config(hf, state_dtype=state_dtype)) == theirs
    configs = _import("vllm.transformers_utils.configs.kimi_k3")
    k3 = configs.KimiK3Config(text_config=hf["text_config"])
    text = k3.text_config
    n_kda = sum(text.is_kda_layer(i) for i in range(text.num_hidden_layers))
    spec = spec_from_hf_config(k3)
    assert spec.state_groups[0].num_layers == n_kda == 48
    assert spec == spec_from_hf_config(hf)


@pytest.mark.parametrize(
    "preset", ["kimi-linear-48b", "kimi-k3", "qwen3-next-80b", "nemotron-h-8b", "jamba-mini",
               "falcon-h1-7b", "granite-4.0-h-small"],
)
def test_kv_bytes_per_layer_match_vllm_specs(vllm, preset) -> None:
    spec = spec_from_hf_config(preset_config(preset))
    (group,) = spec.attention_groups
    block = 16
    if group.kind.value == "mla":
        page = vllm.kv.MLAAttentionSpec(block_size=block, num_kv_heads=1,
                                        head_size=group.head_dim, dtype=vllm.torch.bfloat16)
    else:
        page = vllm.kv.FullAttentionSpec(block_size=block, num_kv_heads=group.num_kv_heads,
                                         head_size=group.head_dim, dtype=vllm.torch.bfloat16)
    assert group.bytes_per_token_per_layer * block == page.page_size_bytes


@pytest.mark.parametrize(
    ("preset", "class_name", "attr", "attention_names"),
    [
        ("qwen3-next-80b", "Qwen3NextConfig", "layer_types", {"full_attention"}),
        ("jamba-mini", "JambaConfig", "layers_block_type", {"attention"}),
        ("granite-4.0-h-small", "GraniteMoeHybridConfig", "layer_types",
         {"attention", "full_attention"}),
    ],
)
def test_attention_layer_counts_match_the_config_vllm_reads(
    vllm, preset, class_name, attr, attention_names
) -> None:
    """vLLM places layers from the transformers config object's layer list."""
    transformers = _import("transformers")
    hf = preset_config(preset)
    obj = getattr(transformers, class_name)(**{k: v for k, v in hf.items() if k != "model_type"})
    n_attention = sum(t in attention_names for t in getattr(obj, attr))
    spec = spec_from_hf_config(hf)
    assert sum(g.num_layers for g in spec.attention_groups) == n_attention
    assert spec.state_groups[0].num_layers == len(getattr(obj, attr)) - n_attention
