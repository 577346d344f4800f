"""Qwen3-Next: Gated DeltaNet layers with a full (gated, GQA) attention layer every few.

Layer ``i`` is full attention when ``layer_types[i] == "full_attention"``, or, in configs
without ``layer_types``, when ``(i + 1) % full_attention_interval == 0`` (vLLM and the
checkpoint agree on this). State shapes follow vLLM's ``gated_delta_net_state_shape``; the
recurrent state defaults to the model dtype, as ``gated_delta_net_state_dtype`` does.
"""

from __future__ import annotations

from hybridcache.errors import SpecError
from hybridcache.spec import ModelSpec, StateGroupSpec, StateKind

from .common import (
    GATED,
    full_attention_group,
    layers_of_type,
    make_spec,
    max_model_len,
    resolve_dtypes,
)
from .loading import ConfigView
from .state import gated_delta_net_state, ssm_dtype


def qwen3_next(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``Qwen3NextForCausalLM`` config."""
    dtypes = resolve_dtypes(cfg, kv_dtype, state_dtype)
    num_layers = cfg.integer("num_hidden_layers")
    full = _full_attention_layers(cfg, num_layers)
    n_full = len(full)
    n_gdn = num_layers - n_full
    key_dim = cfg.integer("linear_key_head_dim")
    attention = [full_attention_group(cfg, n_full, dtypes.kv)] if n_full else []
    state = []
    if n_gdn:
        tensors = gated_delta_net_state(
            num_k_heads=cfg.integer("linear_num_key_heads"),
            num_v_heads=cfg.integer("linear_num_value_heads"),
            head_k_dim=key_dim,
            head_v_dim=cfg.integer("linear_value_head_dim"),
            conv_kernel=cfg.integer("linear_conv_kernel_dim", minimum=2),
            conv_dtype=dtypes.conv,
            recurrent_dtype=ssm_dtype(dtypes.state, dtypes.conv),
        )
        state.append(StateGroupSpec("gdn", StateKind.GDN, num_layers=n_gdn, tensors=tensors))
    notes = f"Qwen3NextForCausalLM: {n_gdn} Gated DeltaNet + {n_full} full attention; TP 1"
    return make_spec(
        name, attention=attention, state=state, hidden_size=cfg.integer("hidden_size"),
        state_width=key_dim, mlps=_mlps(cfg, num_layers), max_len=max_model_len(cfg),
        notes=notes,
    )


def _full_attention_layers(cfg: ConfigView, num_layers: int) -> set[int]:
    if cfg.has("layer_types"):
        return layers_of_type(cfg, num_layers, "full_attention")
    if not cfg.has("full_attention_interval"):
        raise SpecError(f"{cfg.name('layer_types')} / {cfg.name('full_attention_interval')}: "
                        "missing from the config (one is needed to place attention layers)")
    interval = cfg.integer("full_attention_interval")
    return {i for i in range(num_layers) if (i + 1) % interval == 0}


def _mlps(cfg: ConfigView, num_layers: int) -> list[tuple[int, int]]:
    """vLLM's rule: MoE unless in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
    experts = cfg.integer("num_experts", 0, minimum=0)
    step = cfg.integer("decoder_sparse_step", 1)
    dense_only = set(cfg.int_list("mlp_only_layers", []))
    out = []
    for i in range(num_layers):
        if experts and i not in dense_only and (i + 1) % step == 0:
            width = (cfg.integer("num_experts_per_tok") * cfg.integer("moe_intermediate_size")
                     + cfg.integer("shared_expert_intermediate_size", 0, minimum=0))
        else:
            width = cfg.integer("intermediate_size")
        out.append((GATED, width))
    return out
