"""Pieces every architecture builder shares: dtypes, attention groups, the MLP FLOP ratio."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridcache.errors import SpecError
from hybridcache.spec import (
    AttentionGroupSpec,
    AttentionKind,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
)

from .loading import ConfigView
from .state import model_dtype, normalize_dtype

#: Matrices in one MLP: gated (SwiGLU: gate, up, down) or plain (up, down; Nemotron's relu2).
GATED = 3
PLAIN = 2


@dataclass(frozen=True)
class Dtypes:
    """Resolved cache dtypes: KV, conv state, and the temporal-state override (None = auto)."""

    kv: str
    conv: str
    state: str | None


def resolve_dtypes(cfg: ConfigView, kv_dtype: object, state_dtype: object) -> Dtypes:
    """KV dtype: ``kv_dtype`` or the model dtype; conv state: the model dtype (vLLM "auto")."""
    model = model_dtype(cfg)
    kv = normalize_dtype(kv_dtype, "kv_dtype") or model
    return Dtypes(kv=kv, conv=model, state=normalize_dtype(state_dtype, "state_dtype"))


def attention_dims(cfg: ConfigView) -> tuple[int, int]:
    """(KV heads, head dim) of a GQA layer; head dim falls back to hidden / heads."""
    heads = cfg.integer("num_attention_heads")
    kv_heads = cfg.integer("num_key_value_heads", heads)
    if cfg.has("head_dim"):
        head_dim = cfg.integer("head_dim")
    elif cfg.has("attention_head_dim"):
        head_dim = cfg.integer("attention_head_dim")
    else:
        hidden = cfg.integer("hidden_size")
        if hidden % heads:
            raise SpecError(
                f"{cfg.name('head_dim')}: missing, and {cfg.name('hidden_size')}={hidden} is "
                f"not divisible by {cfg.name('num_attention_heads')}={heads}"
            )
        head_dim = hidden // heads
    return kv_heads, head_dim


def full_attention_group(cfg: ConfigView, num_layers: int, kv_dtype: str) -> AttentionGroupSpec:
    """One group of full-attention layers that store K and V for ``num_kv_heads`` heads."""
    kv_heads, head_dim = attention_dims(cfg)
    return AttentionGroupSpec(
        "attention", AttentionKind.FULL, num_layers=num_layers, num_kv_heads=kv_heads,
        head_dim=head_dim, dtype=kv_dtype,
    )


def mlp_flop_ratio(mlps: Sequence[tuple[int, int]], hidden_size: int) -> float:
    """``mlp_ratio`` of :class:`FlopModel` averaged over layers with an MLP.

    Each entry is ``(matrices, active intermediate width)`` of one layer's MLP. A layer's MLP
    costs ``2 * matrices * D * I`` FLOPs per token against Marconi's dense ``16 D^2``, so
    ``ratio = matrices * I / (8 D)``: ``3 I / (8 D)`` for a gated MLP, ``I / (4 D)`` for a
    plain one. Integer sums keep equal-layer models exact (Kimi Linear: 1.5).
    """
    if not mlps:
        return 1.0
    total = sum(matrices * width for matrices, width in mlps)
    return total / (8 * hidden_size * len(mlps))


def max_model_len(cfg: ConfigView) -> int | None:
    """The context limit: ``model_max_length`` (Kimi) or ``max_position_embeddings``."""
    for key in ("model_max_length", "max_position_embeddings"):
        if cfg.has(key):
            return cfg.integer(key)
    return None


def make_spec(
    name: str,
    *,
    attention: Sequence[AttentionGroupSpec],
    state: Sequence[StateGroupSpec],
    hidden_size: int,
    state_width: int,
    mlps: Sequence[tuple[int, int]],
    max_len: int | None,
    notes: str,
) -> ModelSpec:
    """Assemble a :class:`ModelSpec`, with the FLOP model counted from the groups."""
    n_attn = sum(g.num_layers for g in attention)
    n_rec = sum(g.num_layers for g in state)
    flops = FlopModel(
        hidden_size=hidden_size,
        num_attention_layers=n_attn,
        num_recurrent_layers=n_rec,
        state_width=state_width,
        mlp_ratio=mlp_flop_ratio(mlps, hidden_size),
        # None means "one MLP per layer", which is what a sequential hybrid has.
        num_mlp_layers=None if len(mlps) == n_attn + n_rec else len(mlps),
    )
    kwargs = {} if max_len is None else {"max_model_len": max_len}
    return ModelSpec(
        name=name, attention_groups=tuple(attention), state_groups=tuple(state), flops=flops,
        notes=notes, **kwargs,
    )


def layers_of_type(cfg: ConfigView, num_layers: int, wanted: str) -> set[int]:
    """0-based indices of the ``wanted`` entries of ``layer_types`` (linear/full attention),
    after checking that it names every layer with a known type."""
    types = cfg.str_list("layer_types")
    if len(types) != num_layers:
        raise SpecError(f"{cfg.name('layer_types')}: has {len(types)} entries for "
                        f"{num_layers} layers")
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise SpecError(f"{cfg.name('layer_types')}: unknown layer types {unknown}")
    return {i for i, t in enumerate(types) if t == wanted}
