"""gpt-oss: sliding-window and full attention layers, alternating, and no recurrent state.

The family with sliding-window layers that vLLM 0.32 serves (``GptOssForCausalLM``). The
Mamba + sliding-window hybrids (Samba, Phi-4-mini-flash's SambaY) are not in vLLM 0.32, and
their cross-decoder layers reuse one layer's KV instead of keeping their own, which a
per-layer cache layout does not describe; gpt-oss's layers each keep their own KV.

vLLM's ``GptOssAttention`` gives layer ``i`` (0-based) the config's ``sliding_window`` when
``i`` is even and full attention when odd; transformers' ``GptOssConfig`` writes the same
schedule into ``layer_types`` (``sliding_attention`` first). A config's ``layer_types``,
when present, is read as written (checked against the layer count and the two names).

Each group holds ``num_key_value_heads`` x ``head_dim`` K and V per token per layer; the
sliding group's window is ``sliding_window`` tokens, the layer's own token included (vLLM's
``SlidingWindowSpec``), so a hit needs ``ceil((window - 1) / unit)`` units of it.
"""

from __future__ import annotations

from hybridcache.errors import SpecError
from hybridcache.spec import AttentionGroupSpec, AttentionKind, ModelSpec

from .common import GATED, attention_dims, make_spec, max_model_len, resolve_dtypes
from .loading import ConfigView

SLIDING, FULL = "sliding_attention", "full_attention"


def gpt_oss(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``GptOssForCausalLM`` config: a full-attention and a sliding-window group."""
    dtypes = resolve_dtypes(cfg, kv_dtype, state_dtype)
    num_layers = cfg.integer("num_hidden_layers")
    types = _layer_types(cfg, num_layers)
    n_slide, n_full = types.count(SLIDING), types.count(FULL)
    kv_heads, head_dim = attention_dims(cfg)
    attention = []
    if n_full:
        attention.append(AttentionGroupSpec(
            "attention", AttentionKind.FULL, num_layers=n_full, num_kv_heads=kv_heads,
            head_dim=head_dim, dtype=dtypes.kv,
        ))
    if n_slide:
        attention.append(AttentionGroupSpec(
            "sliding_attention", AttentionKind.SLIDING, num_layers=n_slide, num_kv_heads=kv_heads,
            head_dim=head_dim, dtype=dtypes.kv, window=cfg.integer("sliding_window"),
        ))
    # Every layer's MoE: num_experts_per_tok SwiGLU experts of intermediate_size.
    width = cfg.integer("num_experts_per_tok") * cfg.integer("intermediate_size")
    return make_spec(
        name, attention=attention, state=[], hidden_size=cfg.integer("hidden_size"),
        state_width=128, mlps=[(GATED, width)] * num_layers, max_len=max_model_len(cfg),
        notes=f"GptOssForCausalLM: {n_slide} sliding-window ({cfg.integer('sliding_window')} tokens) "
              f"+ {n_full} full attention layers; TP 1",
    )


def _layer_types(cfg: ConfigView, num_layers: int) -> list[str]:
    if not cfg.has("layer_types"):
        return [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    types = cfg.str_list("layer_types")
    if len(types) != num_layers:
        raise SpecError(f"{cfg.name('layer_types')}: has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise SpecError(f"{cfg.name('layer_types')}: unknown layer types {unknown}")
    return types
