"""Mamba-based models: Nemotron-H, Jamba, Falcon-H1, Mamba2 and Granite-4.0-H.

Each builder reads the fields vLLM's ``get_mamba_state_shape_from_config`` reads for that
model class and places attention layers exactly as the vLLM model does.

Jamba's mixers are Mamba1 (an SSM state ``(d_inner, d_state)`` rather than Mamba2's
``(heads, head_dim, d_state)``): its group is named ``"mamba1"`` and has kind ``MAMBA1``.
"""

from __future__ import annotations

from hybridcache.errors import SpecError
from hybridcache.spec import (
    AttentionGroupSpec,
    AttentionKind,
    ModelSpec,
    StateGroupSpec,
    StateKind,
    StateTensorSpec,
)

from .common import (
    GATED,
    PLAIN,
    full_attention_group,
    make_spec,
    max_model_len,
    resolve_dtypes,
)
from .loading import ConfigView
from .state import mamba1_state, mamba2_state, normalize_dtype, ssm_dtype

#: Layer kinds from Nemotron-H's pattern characters and from the layer-type names that
#: transformers' configs use (old and new spellings).
_NEMOTRON_CHARS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_LAYER_NAMES = {
    "mamba": "mamba", "linear_attention": "mamba",
    "attention": "attention", "full_attention": "attention",
    "mlp": "mlp", "moe": "moe",
}


def nemotron_h(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``NemotronHForCausalLM`` config (Mamba2, attention, MLP and MoE layers)."""
    dtypes = resolve_dtypes(cfg, kv_dtype, state_dtype)
    kinds = _nemotron_pattern(cfg)
    n_mamba, n_attn = kinds.count("mamba"), kinds.count("attention")
    heads, head_dim = cfg.integer("mamba_num_heads"), cfg.integer("mamba_head_dim")
    d_state = cfg.integer("ssm_state_size")
    # vLLM's NemotronH config hook: "auto" becomes the config's mamba_ssm_cache_dtype or fp32.
    default_ssm = normalize_dtype(cfg.raw("mamba_ssm_cache_dtype", "float32"),
                                  cfg.name("mamba_ssm_cache_dtype"))
    tensors = mamba2_state(
        intermediate_size=heads * head_dim,
        n_groups=cfg.first_int(("n_groups", "mamba_n_groups")),
        num_heads=heads, head_dim=head_dim, state_size=d_state,
        conv_kernel=cfg.first_int(("conv_kernel", "mamba_d_conv"), minimum=2),
        conv_dtype=dtypes.conv,
        ssm_dtype_=ssm_dtype(dtypes.state, dtypes.conv, default=default_ssm),
    )
    mlps = []
    for kind in kinds:
        if kind == "mlp":  # relu2: up and down projections only
            mlps.append((PLAIN, cfg.integer("intermediate_size")))
        elif kind == "moe":
            shared = (cfg.integer("n_shared_experts", 0, minimum=0)
                      * cfg.integer("moe_shared_expert_intermediate_size", 0, minimum=0))
            routed = cfg.integer("num_experts_per_tok") * cfg.integer("moe_intermediate_size")
            mlps.append((PLAIN, routed + shared))
    return _assemble(cfg, name, dtypes.kv, n_attn, "mamba2", n_mamba, tensors, d_state, mlps,
                     f"NemotronHForCausalLM: {n_mamba} Mamba2 + {n_attn} attention + "
                     f"{len(mlps)} MLP/MoE layers; TP 1")


def _nemotron_pattern(cfg: ConfigView) -> list[str]:
    if cfg.has("hybrid_override_pattern"):
        key = "hybrid_override_pattern"
        pattern = cfg.string(key)
        bad = sorted(set(pattern) - set(_NEMOTRON_CHARS))
        if bad or not pattern:
            raise SpecError(f"{cfg.name(key)}: characters must be M, *, - or E; got {pattern!r}")
        kinds = [_NEMOTRON_CHARS[c] for c in pattern]
    else:
        key = "layers_block_type" if cfg.has("layers_block_type") else "layer_types"
        if not cfg.has(key):
            raise SpecError(f"{cfg.name('hybrid_override_pattern')}: missing from the config")
        kinds = _layer_kinds(cfg, key)
    if cfg.has("num_hidden_layers") and cfg.integer("num_hidden_layers") != len(kinds):
        raise SpecError(f"{cfg.name(key)}: has {len(kinds)} layers but "
                        f"{cfg.name('num_hidden_layers')} is {cfg.integer('num_hidden_layers')}")
    return kinds


def _layer_kinds(cfg: ConfigView, key: str) -> list[str]:
    names = cfg.str_list(key)
    unknown = sorted(set(names) - set(_LAYER_NAMES))
    if unknown:
        raise SpecError(f"{cfg.name(key)}: unknown layer types {unknown}")
    return [_LAYER_NAMES[n] for n in names]


def jamba(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``JambaForCausalLM`` config: Mamba1 layers with periodic attention and MoE."""
    dtypes = resolve_dtypes(cfg, kv_dtype, state_dtype)
    num_layers = cfg.integer("num_hidden_layers")
    period, offset = cfg.integer("attn_layer_period"), cfg.integer("attn_layer_offset", minimum=0)
    n_attn = sum(1 for i in range(num_layers) if i % period == offset)
    d_state = cfg.integer("mamba_d_state")
    tensors = mamba1_state(
        intermediate_size=cfg.integer("mamba_expand") * cfg.integer("hidden_size"),
        state_size=d_state, conv_kernel=cfg.integer("mamba_d_conv", minimum=2),
        conv_dtype=dtypes.conv, ssm_dtype_=ssm_dtype(dtypes.state, dtypes.conv),
    )
    width = cfg.integer("intermediate_size")
    experts = cfg.integer("num_experts", 1)
    e_period = cfg.integer("expert_layer_period", 1)
    e_offset = cfg.integer("expert_layer_offset", 0, minimum=0)
    mlps = []
    for i in range(num_layers):
        moe = experts > 1 and i % e_period == e_offset
        mlps.append((GATED, width * (cfg.integer("num_experts_per_tok") if moe else 1)))
    n_mamba = num_layers - n_attn
    return _assemble(cfg, name, dtypes.kv, n_attn, "mamba1", n_mamba, tensors, d_state, mlps,
                     f"JambaForCausalLM: {n_mamba} Mamba1 (kind mamba2) + {n_attn} attention; TP 1")


def falcon_h1(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``FalconH1ForCausalLM`` config: attention and Mamba2 side by side in every layer."""
    dtypes = resolve_dtypes(cfg, kv_dtype, state_dtype)
    num_layers = cfg.integer("num_hidden_layers")
    hidden = cfg.integer("hidden_size")
    if cfg.has("mamba_d_ssm"):
        d_ssm = cfg.integer("mamba_d_ssm")
    else:
        d_ssm = int(cfg.number("mamba_expand") * hidden)
    heads = cfg.integer("mamba_n_heads")
    if cfg.raw("mamba_d_head") in (None, "auto"):  # transformers' spelling of "derive it"
        head_dim = d_ssm // heads
    else:
        head_dim = cfg.integer("mamba_d_head")
    d_state = cfg.integer("mamba_d_state")
    tensors = mamba2_state(
        intermediate_size=d_ssm, n_groups=cfg.integer("mamba_n_groups"), num_heads=heads,
        head_dim=head_dim, state_size=d_state, conv_kernel=cfg.integer("mamba_d_conv", minimum=2),
        conv_dtype=dtypes.conv, ssm_dtype_=ssm_dtype(dtypes.state, dtypes.conv),
    )
    mlps = [(GATED, cfg.integer("intermediate_size"))] * num_layers
    return _assemble(cfg, name, dtypes.kv, num_layers, "mamba2", num_layers, tensors, d_state,
                     mlps, f"FalconH1ForCausalLM: {num_layers} layers, each attention + "
                     "Mamba2 in parallel; TP 1")


def mamba2(cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object) -> ModelSpec:
    """Spec of a ``Mamba2ForCausalLM`` config: state only, no KV cache and no MLP."""
    dtypes = resolve_dtypes(cfg, kv_dtype, state_dtype)
    num_layers = cfg.integer("num_hidden_layers")
    d_inner = cfg.integer("expand") * cfg.integer("hidden_size")
    head_dim = cfg.integer("head_dim")
    d_state = cfg.integer("state_size")
    tensors = mamba2_state(
        intermediate_size=d_inner, n_groups=cfg.integer("n_groups", 1),
        num_heads=cfg.integer("num_heads", d_inner // head_dim), head_dim=head_dim,
        state_size=d_state, conv_kernel=cfg.integer("conv_kernel", minimum=2),
        conv_dtype=dtypes.conv, ssm_dtype_=ssm_dtype(dtypes.state, dtypes.conv),
    )
    return _assemble(cfg, name, dtypes.kv, 0, "mamba2", num_layers, tensors, d_state, [],
                     f"Mamba2ForCausalLM: {num_layers} Mamba2 layers; TP 1")


def granite_moe_hybrid(
    cfg: ConfigView, name: str, kv_dtype: object, state_dtype: object
) -> ModelSpec:
    """Spec of a ``GraniteMoeHybridForCausalLM`` (Granite-4.0-H) config.

    Close to Nemotron-H: Mamba2 and attention layers from ``layer_types``, but every layer
    also carries an MLP (routed experts and/or a shared SwiGLU).
    """
    dtypes = resolve_dtypes(cfg, kv_dtype, state_dtype)
    kinds = _layer_kinds(cfg, "layer_types")
    if any(k not in ("mamba", "attention") for k in kinds):
        raise SpecError(f"{cfg.name('layer_types')}: Granite layers are mamba or attention")
    if cfg.has("num_hidden_layers") and cfg.integer("num_hidden_layers") != len(kinds):
        raise SpecError(f"{cfg.name('layer_types')}: has {len(kinds)} entries but "
                        f"{cfg.name('num_hidden_layers')} is {cfg.integer('num_hidden_layers')}")
    hidden = cfg.integer("hidden_size")
    d_state = cfg.integer("mamba_d_state")
    tensors = mamba2_state(
        intermediate_size=cfg.integer("mamba_expand") * hidden,
        n_groups=cfg.integer("mamba_n_groups"), num_heads=cfg.integer("mamba_n_heads"),
        head_dim=cfg.integer("mamba_d_head"), state_size=d_state,
        conv_kernel=cfg.integer("mamba_d_conv", minimum=2),
        conv_dtype=dtypes.conv, ssm_dtype_=ssm_dtype(dtypes.state, dtypes.conv),
    )
    width = cfg.integer("shared_intermediate_size", 0, minimum=0)
    if cfg.integer("num_local_experts", 0, minimum=0):
        width += cfg.integer("num_experts_per_tok") * cfg.integer("intermediate_size")
    mlps = [(GATED, width)] * len(kinds) if width else []
    n_mamba, n_attn = kinds.count("mamba"), kinds.count("attention")
    # vLLM's Granite attention ignores any head_dim field: hidden / heads.
    heads = cfg.integer("num_attention_heads")
    attention = []
    if n_attn:
        attention.append(AttentionGroupSpec(
            "attention", AttentionKind.FULL, num_layers=n_attn,
            num_kv_heads=cfg.integer("num_key_value_heads", heads), head_dim=hidden // heads,
            dtype=dtypes.kv,
        ))
    state = [StateGroupSpec("mamba2", StateKind.MAMBA2, n_mamba, tensors)] if n_mamba else []
    return make_spec(
        name, attention=attention, state=state, hidden_size=hidden, state_width=d_state,
        mlps=mlps, max_len=max_model_len(cfg),
        notes=f"GraniteMoeHybridForCausalLM: {n_mamba} Mamba2 + {n_attn} attention; TP 1",
    )


def _assemble(
    cfg: ConfigView, name: str, kv_dtype: str, n_attn: int, state_name: str, n_state: int,
    tensors: tuple[StateTensorSpec, ...], state_width: int, mlps: list[tuple[int, int]], notes: str,
) -> ModelSpec:
    attention = [full_attention_group(cfg, n_attn, kv_dtype)] if n_attn else []
    state = []
    if n_state:
        kind = StateKind.MAMBA1 if state_name == "mamba1" else StateKind.MAMBA2
        state.append(StateGroupSpec(state_name, kind, n_state, tensors))
    return make_spec(
        name, attention=attention, state=state, hidden_size=cfg.integer("hidden_size"),
        state_width=state_width, mlps=mlps, max_len=max_model_len(cfg), notes=notes,
    )
