"""Kimi Linear and Kimi K3: KDA (Kimi Delta Attention) layers interleaved with MLA.

vLLM 0.32.0 serves both from ``vllm/models/kimi_k3``: ``KimiLinearForCausalLM`` reads a
``KimiLinearConfig`` and ``KimiK3ForConditionalGeneration`` a ``KimiK3Config`` whose
``text_config`` is that same Kimi Linear schema (plus a vision tower, which has no cache).
A layer ``i`` (0-based) is KDA when ``i + 1`` is in ``linear_attn_config.kda_layers`` and
MLA otherwise; KDA state shapes come from ``kda_state_shape`` and the MLA cache holds one
latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and layer.
"""

from __future__ import annotations

from hybridcache.errors import SpecError
from hybridcache.spec import AttentionGroupSpec, AttentionKind, ModelSpec, StateGroupSpec, StateKind

from .common import GATED, layers_of_type, make_spec, max_model_len, resolve_dtypes
from .loading import ConfigView
from .state import kda_recurrent_dtype, kda_state


def kimi_linear(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``KimiLinearForCausalLM`` config."""
    return _kimi(cfg, cfg, name, kv_dtype, state_dtype, "KimiLinearForCausalLM")


def kimi_k3(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``KimiK3ForConditionalGeneration`` config (its ``text_config``)."""
    text = cfg.sub("text_config")
    dtype_cfg = text if (text.has("torch_dtype") or text.has("dtype")) else cfg
    return _kimi(text, dtype_cfg, name, kv_dtype, state_dtype, "KimiK3ForConditionalGeneration")


def _kimi(
    cfg: ConfigView, dtype_cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object,
    arch: str,
) -> ModelSpec:
    dtypes = resolve_dtypes(dtype_cfg, kv_dtype, state_dtype)
    num_layers = cfg.integer("num_hidden_layers")
    hidden = cfg.integer("hidden_size")
    kda_layers, heads, head_dim, conv_kernel = _kda_layout(cfg, num_layers)

    # MLA: vLLM asserts these two; the cache row is the compressed latent plus the rope key.
    latent = cfg.integer("kv_lora_rank") + cfg.integer("qk_rope_head_dim")
    n_kda = len(kda_layers)
    n_mla = num_layers - n_kda
    attention = []
    if n_mla:
        attention.append(AttentionGroupSpec(
            "mla", AttentionKind.MLA, num_layers=n_mla, num_kv_heads=1, head_dim=latent,
            dtype=dtypes.kv,
        ))
    state = []
    if n_kda:
        tensors = kda_state(heads, head_dim, conv_kernel, dtypes.conv,
                            kda_recurrent_dtype(dtypes.state))
        state.append(StateGroupSpec("kda", StateKind.KDA, num_layers=n_kda, tensors=tensors))
    notes = (
        f"{arch}: {n_kda} KDA ({heads} heads x {head_dim}, conv {conv_kernel}) + {n_mla} MLA "
        f"(latent {latent}); TP 1, no speculative tokens"
    )
    if cfg.has("routed_expert_hidden_size"):
        notes += "; latent MoE: FLOPs count routed experts at full width (an over-estimate)"
    return make_spec(
        name, attention=attention, state=state, hidden_size=hidden, state_width=head_dim,
        mlps=_mlps(cfg, num_layers), max_len=max_model_len(cfg), notes=notes,
    )


def _kda_layout(cfg: ConfigView, num_layers: int) -> tuple[set[int], int, int, int]:
    """0-based KDA layer indices, heads, head dim and conv kernel.

    Reads the checkpoint's ``linear_attn_config`` (1-based layer lists) or, for configs that
    transformers has normalised, ``layer_types`` with ``linear_num_heads`` and friends.
    """
    if cfg.has("linear_attn_config"):
        lac = cfg.sub("linear_attn_config")
        kda = _one_based(lac, "kda_layers", num_layers)
        full = _one_based(lac, "full_attn_layers", num_layers)
        if kda & full or len(kda | full) != num_layers:
            raise SpecError(
                f"{lac.name('kda_layers')} / {lac.name('full_attn_layers')}: must split the "
                f"{num_layers} layers between them, each layer once"
            )
        return (kda, lac.integer("num_heads"), lac.integer("head_dim"),
                lac.integer("short_conv_kernel_size", minimum=2))
    if cfg.has("layer_types"):
        kda = layers_of_type(cfg, num_layers, "linear_attention")
        return (kda, cfg.integer("linear_num_heads"), cfg.integer("linear_head_dim"),
                cfg.integer("linear_conv_kernel_dim", minimum=2))
    raise SpecError(f"{cfg.name('linear_attn_config')}: missing from the config "
                    "(needed to tell KDA layers from MLA layers)")


def _one_based(lac: ConfigView, key: str, num_layers: int) -> set[int]:
    layers = lac.int_list(key, minimum=1)
    if any(i > num_layers for i in layers) or len(set(layers)) != len(layers):
        raise SpecError(f"{lac.name(key)}: 1-based layer numbers up to {num_layers}, "
                        f"each once; got {layers}")
    return {i - 1 for i in layers}


def _mlps(cfg: ConfigView, num_layers: int) -> list[tuple[int, int]]:
    """Active SwiGLU width per layer: dense first layers, then routed + shared experts."""
    dense_until = cfg.integer("first_k_dense_replace", 0, minimum=0)
    freq = cfg.integer("moe_layer_freq", 1)
    moe_width = 0
    if cfg.has("num_experts"):
        expert = cfg.integer("moe_intermediate_size")
        active = cfg.integer("num_experts_per_token") + cfg.integer("num_shared_experts", 0,
                                                                      minimum=0)
        moe_width = active * expert
    out = []
    for i in range(num_layers):
        if moe_width and i >= dense_until and i % freq == 0:
            out.append((GATED, moe_width))
        else:
            out.append((GATED, cfg.integer("intermediate_size")))
    return out
