"""Cache layout of a hybrid model: what one token of KV and one state snapshot weigh.

Everything the manager, the arena, the simulator and the kernels need to know about a model
is here, as frozen dataclasses, so that a spec can be shared, hashed (model fingerprint) and
compared. Specs are built by hand, from presets (:mod:`hybridcache.presets`) or from Hugging
Face configs (:mod:`hybridcache.adapters.hf`).

Why bytes and FLOPs live together: value-based eviction trades a KV page against a state
snapshot by *prefill FLOPs saved per byte held*, so the spec carries a prefill FLOP model.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from functools import cached_property

from hybridcache.errors import SpecError

#: Bytes per element of every dtype a cache tensor may use.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_bytes(dtype: str, field_name: str = "dtype") -> int:
    """Size of one element of ``dtype``; raises :class:`SpecError` naming the field."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise SpecError(f"{field_name}: unknown dtype {dtype!r} (known: {known})") from None


class AttentionKind(str, Enum):
    """Kinds of per-token KV cache."""

    FULL = "full"
    MLA = "mla"
    SLIDING = "sliding"


class StateKind(str, Enum):
    """Kinds of fixed-size recurrent state."""

    KDA = "kda"
    GDN = "gdn"
    MAMBA1 = "mamba1"
    MAMBA2 = "mamba2"


@dataclass(frozen=True)
class AttentionGroupSpec:
    """Layers that share one KV layout.

    Args:
        name: group name (unique in a model).
        kind: full, MLA (one latent vector per token) or sliding window.
        num_layers: layers in the group.
        num_kv_heads: KV heads per layer (1 for MLA).
        head_dim: per head: K and V each have ``head_dim`` values for full/sliding
            attention; for MLA it is the latent width (kv_lora_rank + rope dim), stored once.
        dtype: KV dtype.
        window: tokens a sliding-window layer reads, its own included (vLLM's
            ``sliding_window``); ``None`` otherwise. Such groups are cached by
            :mod:`hybridcache.sliding`: a hit keeps only the last ``window`` tokens' KV.
    """

    name: str
    kind: AttentionKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    window: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", AttentionKind(self.kind))
        p = f"attention group {self.name!r}"
        _positive(self.num_layers, f"{p}.num_layers")
        _positive(self.num_kv_heads, f"{p}.num_kv_heads")
        _positive(self.head_dim, f"{p}.head_dim")
        dtype_bytes(self.dtype, f"{p}.dtype")
        if self.kind is AttentionKind.SLIDING:
            if self.window is None:
                raise SpecError(f"{p}.window: a sliding-window group needs a window")
            _positive(self.window, f"{p}.window")
        elif self.window is not None:
            raise SpecError(f"{p}.window: only sliding-window groups have a window")

    @property
    def values_per_token_per_layer(self) -> int:
        """K and V for attention; one latent vector for MLA."""
        per_head = self.head_dim if self.kind is AttentionKind.MLA else 2 * self.head_dim
        return per_head * self.num_kv_heads

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.values_per_token_per_layer * dtype_bytes(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token costs over all layers of the group."""
        return self.bytes_per_token_per_layer * self.num_layers


@dataclass(frozen=True)
class StateTensorSpec:
    """One state tensor of one layer (for example KDA's recurrent state ``(H, K, V)``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if not self.shape or any(s <= 0 for s in self.shape):
            raise SpecError(f"state tensor {self.name!r}.shape: must be positive, got {self.shape}")
        dtype_bytes(self.dtype, f"state tensor {self.name!r}.dtype")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StateGroupSpec:
    """Recurrent layers that share one state layout; every layer holds ``tensors``.

    A snapshot at a token boundary holds these tensors for every layer of every state group:
    the state of the whole model after that token.
    """

    name: str
    kind: StateKind
    num_layers: int
    tensors: tuple[StateTensorSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", StateKind(self.kind))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        _positive(self.num_layers, f"state group {self.name!r}.num_layers")
        if not self.tensors:
            raise SpecError(f"state group {self.name!r}.tensors: at least one tensor is needed")

    @property
    def bytes_per_layer(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def bytes_per_snapshot(self) -> int:
        return self.bytes_per_layer * self.num_layers


@dataclass(frozen=True)
class FlopModel:
    """Prefill FLOPs of a hybrid decoder, after Marconi's per-layer formulas.

    Per layer for L tokens at width D: attention ``8LD^2 + 4L^2 D`` (projections plus the
    quadratic score/value products), MLP ``16 L D^2`` scaled by the active MLP width
    (``mlp_ratio`` = active intermediate size / (4D), 1 for a dense 4x MLP), and a recurrent
    mixer ``12 L D^2 + 16 L D N + 10 L D`` with N its state width per channel.

    A sliding-window layer's token at position ``p`` reads ``min(p, window)`` keys, not
    ``p``: its score/value products cost ``8 D min(p, w)`` per token instead of ``8 D p``
    (the integral of which is the full layer's ``4 L^2 D``). Pricing it as full attention
    would overstate what a hit past the window saves, and the value policy would keep a
    sliding model's deep units for savings that do not exist.

    Args:
        hidden_size: model width D.
        num_attention_layers: layers with a KV cache.
        num_recurrent_layers: layers with a recurrent state.
        state_width: N in the recurrent formula (d_state for Mamba, head_dim for KDA/GDN).
        mlp_ratio: active MLP FLOPs relative to a dense 4D MLP (MoE: active experts only).
        num_mlp_layers: layers with an MLP (usually every layer).
        sliding_layers: ``(window, layers)`` per window: how many of the attention layers
            are sliding-window ones reading ``window`` tokens (``()``: every attention layer
            is full). :class:`ModelSpec` fills it in from its sliding-window groups when left
            empty, so a FLOP model built without it prices the spec's windows.
    """

    hidden_size: int
    num_attention_layers: int
    num_recurrent_layers: int
    state_width: int = 128
    mlp_ratio: float = 1.0
    num_mlp_layers: int | None = None
    sliding_layers: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        pairs = tuple((int(w), int(n)) for w, n in self.sliding_layers)
        object.__setattr__(self, "sliding_layers", pairs)
        for w, n in pairs:
            _positive(w, "flops.sliding_layers window")
            _positive(n, "flops.sliding_layers layers")
        if sum(n for _, n in pairs) > self.num_attention_layers:
            raise SpecError(
                f"flops.sliding_layers: {sum(n for _, n in pairs)} sliding layers exceed "
                f"num_attention_layers {self.num_attention_layers}"
            )

    def prefill_flops(self, start: int, end: int) -> float:
        """FLOPs to prefill tokens ``[start, end)`` with ``[0, start)`` already cached."""
        if end <= start:
            return 0.0
        per_token, per_square = self._coefficients
        # Each new token attends to everything before it: the quadratic term is the
        # difference of the two squares.
        out = per_token * (end - start) + per_square * (float(end) ** 2 - float(start) ** 2)
        if self.sliding_layers:
            out += self._sliding_flops(float(start), float(end))
        return out

    def _sliding_flops(self, start: float, end: float) -> float:
        """Score/value products of the sliding layers for tokens ``[start, end)``: ``8 D``
        times the integral of ``min(p, w)``: ``(min(e, w)^2 - min(s, w)^2) / 2`` below the
        window, plus ``w`` per token past it."""
        d, out = float(self.hidden_size), 0.0
        for w, n in self.sliding_layers:
            below = min(end, w) ** 2 - min(start, w) ** 2
            past = max(end, w) - max(start, w)
            out += n * 4.0 * d * (below + 2.0 * w * past)
        return out

    @cached_property
    def _coefficients(self) -> tuple[float, float]:
        """``(per token, per squared position)``: the formula's terms, summed once (the
        manager prices every snapshot and request with it)."""
        d = float(self.hidden_size)
        mlp_layers = (
            self.num_mlp_layers
            if self.num_mlp_layers is not None
            else self.num_attention_layers + self.num_recurrent_layers
        )
        per_token = (
            self.num_attention_layers * 8.0 * d * d
            + self.num_recurrent_layers * (12.0 * d * d + 16.0 * d * self.state_width + 10.0 * d)
            + mlp_layers * 16.0 * d * d * self.mlp_ratio
        )
        full = self.num_attention_layers - sum(n for _, n in self.sliding_layers)
        return per_token, full * 4.0 * d


@dataclass(frozen=True)
class ModelSpec:
    """The cache layout of one model: attention groups, state groups, limits, FLOP model."""

    name: str
    attention_groups: tuple[AttentionGroupSpec, ...]
    state_groups: tuple[StateGroupSpec, ...]
    flops: FlopModel
    max_model_len: int = 1 << 20
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention_groups", tuple(self.attention_groups))
        object.__setattr__(self, "state_groups", tuple(self.state_groups))
        if not self.attention_groups and not self.state_groups:
            raise SpecError(f"model {self.name!r}: needs at least one attention or state group")
        _positive(self.max_model_len, f"model {self.name!r}.max_model_len")
        names = [g.name for g in self.attention_groups] + [g.name for g in self.state_groups]
        if len(set(names)) != len(names):
            raise SpecError(f"model {self.name!r}: group names must be unique, got {names}")
        if not self.flops.sliding_layers:
            object.__setattr__(self, "flops", _with_sliding_layers(self.flops, self.attention_groups))

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token costs over all attention groups."""
        return sum(g.bytes_per_token for g in self.attention_groups)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of one state snapshot (every recurrent layer, every tensor)."""
        return sum(g.bytes_per_snapshot for g in self.state_groups)

    @property
    def has_state(self) -> bool:
        return bool(self.state_groups)

    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of the layout (not the name or notes).

        Offload tiers put it in their keys so that entries written for one layout can never
        be read back for another.
        """
        body = asdict(self)
        body.pop("name")
        body.pop("notes")
        if not body["flops"]["sliding_layers"]:  # keys written before the field existed
            del body["flops"]["sliding_layers"]
        text = json.dumps(body, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> dict[str, object]:
        """A JSON-friendly summary used by the CLI and the docs."""
        return {
            "name": self.name,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "snapshot_bytes": self.snapshot_bytes,
            "tokens_per_snapshot": (
                self.snapshot_bytes / self.kv_bytes_per_token if self.kv_bytes_per_token else None
            ),
            "attention_layers": sum(g.num_layers for g in self.attention_groups),
            "state_layers": sum(g.num_layers for g in self.state_groups),
        }


def _with_sliding_layers(flops: FlopModel, groups: tuple[AttentionGroupSpec, ...]) -> FlopModel:
    """``flops`` with the sliding-window groups' layers as its ``sliding_layers``.

    The layers are counted among ``num_attention_layers``; a hand-built FLOP model that
    counts fewer attention layers than the groups have (small test specs) prices as many
    sliding layers as it counts attention layers, windows in group order.
    """
    left, pairs = flops.num_attention_layers, []
    for g in groups:
        if g.kind is AttentionKind.SLIDING and left > 0:
            n = min(g.num_layers, left)
            pairs.append((g.window, n))
            left -= n
    return replace(flops, sliding_layers=tuple(pairs)) if pairs else flops


def _positive(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise SpecError(f"{name}: must be a positive integer, got {value!r}")
