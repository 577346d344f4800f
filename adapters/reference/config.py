"""Configuration of the reference hybrid model and the cache spec derived from it.

The spec is *derived*, never written by hand: the bytes per token of the attention group
and the KDA state tensors come from the same numbers the model uses, so the arena lays its
tensors out exactly as the model reads and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.presets import kda_state_tensors
from hybridcache.spec import (
    AttentionGroupSpec,
    AttentionKind,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateKind,
)

#: Layer kinds in :attr:`ReferenceConfig.layer_pattern`.
KDA, ATTENTION = "K", "A"
ATTN_GROUP, KDA_GROUP = "attn", "kda"


@dataclass(frozen=True)
class ReferenceConfig:
    """Shape and seed of the reference model (fp32 everywhere).

    Args:
        vocab_size: token ids are ``[0, vocab_size)``.
        hidden_size: model width.
        layer_pattern: one letter per layer, ``K`` = KDA, ``A`` = full attention; the
            default ``KKKAKKKA`` is the Kimi Linear ratio of 3 KDA : 1 attention.
        kda_heads / kda_head_dim: KDA heads and their key = value width.
        conv_kernel: short causal conv width on q, k, v (its state keeps ``kernel - 1``).
        attn_heads / attn_kv_heads / attn_head_dim: query heads, KV heads (GQA), head width.
        mlp_hidden: SwiGLU intermediate width.
        kda_chunk: chunk length of the chunked KDA path.
        max_model_len: longest sequence the manager accepts.
        seed: weights are drawn from ``torch.Generator().manual_seed(seed)``.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    layer_pattern: str = "KKKAKKKA"
    kda_heads: int = 2
    kda_head_dim: int = 16
    conv_kernel: int = 4
    attn_heads: int = 4
    attn_kv_heads: int = 2
    attn_head_dim: int = 16
    mlp_hidden: int = 128
    kda_chunk: int = 64
    max_model_len: int = 1 << 14
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.layer_pattern or set(self.layer_pattern) - {KDA, ATTENTION}:
            raise ValueError(f"layer_pattern must be letters K and A, got {self.layer_pattern!r}")
        if KDA not in self.layer_pattern:
            raise ValueError("layer_pattern needs at least one KDA layer (K)")
        if self.attn_heads % self.attn_kv_heads:
            raise ValueError("attn_heads must be a multiple of attn_kv_heads")
        for name in (
            "vocab_size",
            "hidden_size",
            "kda_heads",
            "kda_head_dim",
            "attn_heads",
            "attn_head_dim",
            "mlp_hidden",
            "kda_chunk",
            "max_model_len",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.conv_kernel < 2:
            raise ValueError("conv_kernel must be >= 2 (the conv state keeps kernel - 1 inputs)")

    @property
    def num_kda_layers(self) -> int:
        return self.layer_pattern.count(KDA)

    @property
    def num_attention_layers(self) -> int:
        return self.layer_pattern.count(ATTENTION)

    @property
    def kda_width(self) -> int:
        """Channels of each of q, k and v in a KDA layer."""
        return self.kda_heads * self.kda_head_dim

    def group_layer(self, layer: int) -> tuple[str, int]:
        """``(group, index within the group)`` of model layer ``layer``."""
        kind = self.layer_pattern[layer]
        idx = self.layer_pattern[:layer].count(kind)
        return (KDA_GROUP, idx) if kind == KDA else (ATTN_GROUP, idx)


def model_spec(cfg: ReferenceConfig) -> ModelSpec:
    """The cache layout of ``cfg`` for :class:`~hybridcache.manager.HybridCacheManager`.

    KV is fp32 (``2 * kv_heads * head_dim`` values per token per attention layer); the KDA
    state is the conv history on q, k, v plus the recurrent ``(H, K, K)`` matrix, both fp32
    (a bf16 conv state would cost ~1e-4 of output error, which the check would flag).
    """
    attn: tuple[AttentionGroupSpec, ...] = ()
    if cfg.num_attention_layers:
        attn = (
            AttentionGroupSpec(
                ATTN_GROUP,
                AttentionKind.FULL,
                num_layers=cfg.num_attention_layers,
                num_kv_heads=cfg.attn_kv_heads,
                head_dim=cfg.attn_head_dim,
                dtype="float32",
            ),
        )
    state = (
        StateGroupSpec(
            KDA_GROUP,
            StateKind.KDA,
            num_layers=cfg.num_kda_layers,
            tensors=kda_state_tensors(
                cfg.kda_heads, cfg.kda_head_dim, cfg.conv_kernel, conv_dtype="float32"
            ),
        ),
    )
    flops = FlopModel(
        hidden_size=cfg.hidden_size,
        num_attention_layers=cfg.num_attention_layers,
        num_recurrent_layers=cfg.num_kda_layers,
        state_width=cfg.kda_head_dim,
        mlp_ratio=6.0 * cfg.mlp_hidden / (16.0 * cfg.hidden_size),
    )
    return ModelSpec(
        name=f"reference-{cfg.layer_pattern}-d{cfg.hidden_size}",
        attention_groups=attn,
        state_groups=state,
        flops=flops,
        max_model_len=cfg.max_model_len,
    )
