"""Our :class:`~hybridcache.spec.ModelSpec` from what vLLM decided about a model's cache.

Two specs come out of a vLLM ``KVCacheConfig``:

- :func:`spec_from_kv_cache_config` is the *true* layout: per attention group its heads,
  head size and dtype, per Mamba/GDN/KDA group its state tensors (shapes and dtypes exactly
  as vLLM allocates them, e.g. the fp32 recurrent state the CPU GDN backend forces). It is
  what the simulator and the offload tiers need (bytes per token, bytes per snapshot).
- :func:`pool_spec` is the *accounting* layout the manager uses inside vLLM. vLLM's worker
  owns the memory: one pool of equal blocks, every attention block inflated to one state
  page. The manager must hand out exactly those blocks, so its arena is sized in vLLM
  blocks: a KV page is one block (one block of ``block_size`` tokens of one attention
  group) and a state slot is one block per Mamba group. With ``alignment=1`` the arena
  places page ``p`` in vLLM block ``p`` and slot ``s`` in vLLM blocks ``s*G .. s*G+G-1``
  (``G`` Mamba groups), so a block is never a page and a slot at the same time.

The FLOP model (for value-based eviction) comes from the HF config when vLLM has one.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from hybridcache.errors import SpecError
from hybridcache.spec import (
    DTYPE_BYTES,
    AttentionGroupSpec,
    AttentionKind,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateKind,
    StateTensorSpec,
)

#: Name of the single state group of :func:`pool_spec` (one slot = all Mamba groups).
POOL_STATE_GROUP = "vllm-state-blocks"


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; raises :class:`SpecError` for dtypes we cannot size."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise SpecError(f"vLLM cache dtype {dtype} has no size in hybridcache.spec.DTYPE_BYTES")
    return name


def state_kind(spec: MambaSpec) -> StateKind:
    """Map vLLM's Mamba backend name (``GDN_ATTN``, a registered ``KDA``, ``MAMBA2``...)."""
    name = getattr(spec.mamba_type, "name", str(spec.mamba_type)).upper()
    if "KDA" in name:
        return StateKind.KDA
    if "GDN" in name:
        return StateKind.GDN
    return StateKind.MAMBA2


def _layer_specs(group_spec: KVCacheSpec, layer_names: list[str]) -> list[KVCacheSpec]:
    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return [group_spec.kv_cache_specs[n] for n in layer_names]
    return [group_spec] * len(layer_names)


def _attention_group(name: str, spec: AttentionSpec, num_layers: int) -> AttentionGroupSpec:
    if isinstance(spec, MLAAttentionSpec):
        return AttentionGroupSpec(
            name, AttentionKind.MLA, num_layers, 1, spec.head_size, dtype_name(spec.dtype)
        )
    if isinstance(spec, SlidingWindowSpec):
        return AttentionGroupSpec(
            name, AttentionKind.SLIDING, num_layers, spec.num_kv_heads, spec.head_size,
            dtype_name(spec.dtype), window=spec.sliding_window,
        )
    return AttentionGroupSpec(
        name, AttentionKind.FULL, num_layers, spec.num_kv_heads, spec.head_size,
        dtype_name(spec.dtype),
    )


def _state_group(name: str, spec: MambaSpec, num_layers: int) -> StateGroupSpec:
    tensors = tuple(
        StateTensorSpec(f"state{i}", tuple(shape), dtype_name(dt))
        for i, (shape, dt) in enumerate(zip(spec.shapes, spec.dtypes))
    )
    return StateGroupSpec(name, state_kind(spec), num_layers, tensors)


def flop_model_from_hf(hf_config: Any, num_attention: int, num_recurrent: int) -> FlopModel:
    """Marconi-style FLOP model from an HF config object (fields read defensively)."""
    text = getattr(hf_config, "text_config", None) or hf_config
    hidden = int(getattr(text, "hidden_size", 0) or 1024)
    width = int(getattr(text, "linear_key_head_dim", 0) or getattr(text, "state_size", 0) or 128)
    inter = getattr(text, "moe_intermediate_size", None)
    active = getattr(text, "num_experts_per_tok", None)
    if inter and active:
        mlp_ratio = float(inter) * float(active) / (4.0 * hidden)
    else:
        mlp_ratio = float(getattr(text, "intermediate_size", 4 * hidden)) / (4.0 * hidden)
    return FlopModel(
        hidden_size=hidden,
        num_attention_layers=max(num_attention, 0),
        num_recurrent_layers=max(num_recurrent, 0),
        state_width=width,
        mlp_ratio=mlp_ratio,
    )


def spec_from_kv_cache_config(
    kv_cache_config: KVCacheConfig,
    *,
    name: str = "vllm-model",
    hf_config: Any = None,
    max_model_len: int = 1 << 20,
) -> ModelSpec:
    """The true cache layout vLLM allocated: one attention/state group per vLLM group.

    Layers that vLLM splits into several groups of equal size (it does so to share one
    block table shape) stay separate groups here, named ``attn{i}`` / ``state{i}`` after
    the vLLM group index ``i``; a group whose layers have different specs is split by spec.
    """
    attn: list[AttentionGroupSpec] = []
    state: list[StateGroupSpec] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        specs = _layer_specs(group.kv_cache_spec, group.layer_names)
        by_spec: dict[KVCacheSpec, int] = {}
        for s in specs:
            by_spec[s] = by_spec.get(s, 0) + 1
        for k, (s, n) in enumerate(by_spec.items()):
            gname = f"{i}" if len(by_spec) == 1 else f"{i}.{k}"
            if isinstance(s, MambaSpec):
                state.append(_state_group(f"state{gname}", s, n))
            elif isinstance(s, AttentionSpec):
                attn.append(_attention_group(f"attn{gname}", s, n))
            else:
                raise SpecError(f"vLLM group {i}: unsupported cache spec {type(s).__name__}")
    n_attn = sum(g.num_layers for g in attn)
    n_rec = sum(g.num_layers for g in state)
    flops = flop_model_from_hf(hf_config, n_attn, n_rec) if hf_config is not None else FlopModel(
        1024, n_attn, n_rec
    )
    return ModelSpec(name, tuple(attn), tuple(state), flops, max_model_len=max_model_len)


def group_roles(kv_cache_config: KVCacheConfig) -> tuple[list[int], list[int]]:
    """Indices of vLLM's attention groups and of its Mamba groups, in group order.

    Raises:
        SpecError: a group is neither (cross-attention, encoder-only and other special
            specs are not supported by the adapter).
    """
    attn, mamba = [], []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            kinds = {isinstance(s, MambaSpec) for s in spec.kv_cache_specs.values()}
            if len(kinds) != 1:
                raise SpecError(f"vLLM group {i} mixes state and attention layers")
            (is_mamba,) = kinds
        elif isinstance(spec, MambaSpec):
            is_mamba = True
        elif isinstance(spec, AttentionSpec):
            is_mamba = False
        else:
            raise SpecError(f"vLLM group {i}: unsupported cache spec {type(spec).__name__}")
        (mamba if is_mamba else attn).append(i)
    return attn, mamba


def pool_spec(
    kv_cache_config: KVCacheConfig,
    *,
    flops: FlopModel,
    max_model_len: int,
    name: str = "vllm-pool",
) -> ModelSpec:
    """The manager's accounting spec over vLLM's block pool (see module docstring).

    With ``hash_unit = block_size`` and ``alignment = 1``, every attention group's page is
    ``block_size`` bytes and the one state slot is ``G * block_size`` bytes, so
    :func:`hybridcache.arena.plan_layout` yields ``pages_per_block = G`` and one slot per
    arena block: page ``p`` is vLLM block ``p``, slot ``s`` covers vLLM blocks ``s*G ..``.
    """
    attn_ids, mamba_ids = group_roles(kv_cache_config)
    if not attn_ids:
        raise SpecError("the adapter needs at least one attention group (pure Mamba models "
                        "have no KV pages to address)")
    attn = tuple(
        AttentionGroupSpec(f"g{i}", AttentionKind.MLA, 1, 1, 1, "uint8") for i in attn_ids
    )
    state: tuple[StateGroupSpec, ...] = ()
    if mamba_ids:
        block = pool_block_size(kv_cache_config)
        tensor = StateTensorSpec("blocks", (len(mamba_ids) * block,), "uint8")
        state = (StateGroupSpec(POOL_STATE_GROUP, StateKind.GDN, 1, (tensor,)),)
    return ModelSpec(name, attn, state, flops, max_model_len=max_model_len,
                     notes="accounting spec: one byte per token per vLLM block")


def pool_block_size(kv_cache_config: KVCacheConfig) -> int:
    """The one block size every group uses (vLLM aligns them in hybrid models).

    Raises:
        SpecError: groups have different block sizes (the adapter maps one hash unit to
            one block of every group, so they must agree).
    """
    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
    if len(sizes) != 1:
        raise SpecError(f"vLLM groups use different block sizes {sorted(sizes)}; "
                        "the adapter needs one")
    return sizes.pop()


def spec_from_vllm_config(vllm_config: Any, kv_cache_config: KVCacheConfig) -> ModelSpec:
    """:func:`spec_from_kv_cache_config` named after the served model, with its HF config
    (FLOP model) and ``max_model_len`` taken from ``vllm_config``."""
    model_config = vllm_config.model_config
    return spec_from_kv_cache_config(
        kv_cache_config,
        name=str(getattr(model_config, "served_model_name", None) or model_config.model),
        hf_config=getattr(model_config, "hf_config", None),
        max_model_len=int(model_config.max_model_len),
    )
