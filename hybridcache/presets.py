"""Named model specs used by the simulator, the benchmarks and the docs.

A preset is a zero-argument factory registered under a name. The two core presets are built
by hand from public numbers (see ``shared/DESIGN.md``); packages register more through the
``hybridcache.presets`` entry-point group (the HF adapter's config-derived presets come that
way), or directly with :func:`register_preset`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points

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

_log = logging.getLogger("hybridcache.presets")
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


#: The entry-point group through which packages register presets. The core names no adapter:
#: ``hybridcache.adapters.hf`` registers its config-derived presets here (see pyproject), and
#: so can any other package, without the core importing it by name.
PRESET_ENTRY_POINTS = "hybridcache.presets"
_plugins_loaded = False


def _load_adapter_presets() -> None:
    """Call every ``hybridcache.presets`` entry point once, so that their presets exist.

    A plug-in that fails to load is logged and skipped: one broken third-party package must
    not make the built-in presets unreachable. Loaded lazily (first lookup), because reading
    entry-point metadata costs milliseconds that ``import hybridcache`` should not pay.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=PRESET_ENTRY_POINTS):
        try:
            ep.load()()
        except Exception:  # noqa: BLE001 - a plug-in's failure is reported, not raised
            _log.warning("preset plug-in %r (%s) failed to load", ep.name, ep.value, exc_info=True)


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
