"""Named model specs used by the simulator, the benchmarks and the docs.

A preset is a zero-argument factory registered under a name. The two core presets are built
by hand from public numbers (see ``shared/DESIGN.md``); :mod:`hybridcache.adapters.hf`
registers more, derived from Hugging Face configs, through :func:`register_preset`.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridcache.errors import UnknownNameError
from hybridcache.spec import (
    AttentionGroupSpec,
    AttentionKind,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateKind,
    StateTensorSpec,
)

_PRESETS: dict[str, Callable[[], ModelSpec]] = {}


def register_preset(name: str, factory: Callable[[], ModelSpec], *, replace: bool = False) -> None:
    """Register ``factory`` under ``name``; refuses to shadow a preset unless ``replace``."""
    if name in _PRESETS and not replace:
        raise ValueError(f"preset {name!r} is already registered")
    _PRESETS[name] = factory


def preset_names() -> list[str]:
    """Every registered preset name, sorted (loads the HF-derived presets first)."""
    _load_adapter_presets()
    return sorted(_PRESETS)


def get_preset(name: str) -> ModelSpec:
    """The spec registered as ``name``; unknown names raise an error listing the known ones."""
    _load_adapter_presets()
    try:
        factory = _PRESETS[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown model preset {name!r}; known presets: {', '.join(sorted(_PRESETS))}"
        ) from None
    return factory()


def _load_adapter_presets() -> None:
    """Import the HF adapter once so that its presets are registered, if it is present."""
    try:
        import hybridcache.adapters.hf  # noqa: F401
    except ImportError:
        pass


def kda_state_tensors(
    num_heads: int, head_dim: int, conv_kernel: int, conv_dtype: str = "bfloat16"
) -> tuple[StateTensorSpec, ...]:
    """KDA / Gated DeltaNet state of one layer: short-conv history on q, k, v + recurrent S.

    The conv state keeps the last ``conv_kernel - 1`` inputs of each of the ``3 * H * D``
    channels of q, k and v; the recurrent state is ``(H, K, V)`` in fp32, as vLLM keeps it.
    """
    return (
        StateTensorSpec("conv", (3 * num_heads * head_dim, conv_kernel - 1), conv_dtype),
        StateTensorSpec("recurrent", (num_heads, head_dim, head_dim), "float32"),
    )


def kimi_linear_48b() -> ModelSpec:
    """Kimi Linear 48B-A3B: 27 layers = 20 KDA + 7 MLA, hidden 2304.

    KDA: 32 heads of dim 128, conv kernel 4 -> per layer 2 MiB fp32 recurrent state plus
    72 KiB bf16 conv state; 41.4 MiB per snapshot. MLA: 512 latent + 64 rope values in bf16,
    8,064 B per token over 7 layers. MoE: 8 of 256 experts (intermediate 1024) plus a shared
    expert are active, a SwiGLU width of 9,216 = 4D, so ``mlp_ratio`` = 1.5 (three matrices).
    """
    return ModelSpec(
        name="kimi-linear-48b",
        attention_groups=(
            AttentionGroupSpec("mla", AttentionKind.MLA, num_layers=7, num_kv_heads=1,
                               head_dim=576, dtype="bfloat16"),
        ),
        state_groups=(
            StateGroupSpec("kda", StateKind.KDA, num_layers=20,
                           tensors=kda_state_tensors(32, 128, 4)),
        ),
        flops=FlopModel(hidden_size=2304, num_attention_layers=7, num_recurrent_layers=20,
                        state_width=128, mlp_ratio=1.5),
        max_model_len=1 << 20,
    )


def kimi_k3() -> ModelSpec:
    """A Kimi K3-like model. Layer counts are *assumptions*: K3's are not public to us.

    Known: 2.8T-parameter MoE with 16 of 896 experts active, 1M context, KDA layers with
    periodic full (MLA) attention. Assumed here: Kimi K2's width (hidden 7168, MLA latent
    512 + rope 64 in bf16), 64 layers at the Kimi Linear ratio of 3 KDA : 1 MLA (48 KDA +
    16 MLA), KDA with 64 heads of dim 128 and conv kernel 4, expert intermediate size 2048.
    That gives 18,432 B of KV per token and ~199 MiB per fp32 snapshot (~11.3k tokens of KV).
    """
    return ModelSpec(
        name="kimi-k3",
        attention_groups=(
            AttentionGroupSpec("mla", AttentionKind.MLA, num_layers=16, num_kv_heads=1,
                               head_dim=576, dtype="bfloat16"),
        ),
        state_groups=(
            StateGroupSpec("kda", StateKind.KDA, num_layers=48,
                           tensors=kda_state_tensors(64, 128, 4)),
        ),
        flops=FlopModel(hidden_size=7168, num_attention_layers=16, num_recurrent_layers=48,
                        state_width=128, mlp_ratio=3 * 17 * 2048 / (8 * 7168)),
        max_model_len=1 << 20,
    )


register_preset("kimi-linear-48b", kimi_linear_48b)
register_preset("kimi-k3", kimi_k3)
