"""Presets derived from public configs, registered with :mod:`hybridcache.presets`.

Each preset is :func:`~hybridcache.adapters.hf.spec_from_hf_config` applied to a config
embedded in :mod:`~hybridcache.adapters.hf.public_configs`, in vLLM's default dtypes. The two
core presets (``kimi-linear-48b``, ``kimi-k3``) are replaced by config-derived ones that
produce the same spec (the tests check equality with the hand-built ones).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from hybridcache.errors import UnknownNameError
from hybridcache.presets import register_preset
from hybridcache.spec import ModelSpec

from . import public_configs as pc
from .convert import spec_from_hf_config


def kimi_linear_48b() -> ModelSpec:
    """Kimi Linear 48B-A3B from moonshotai/Kimi-Linear-48B-A3B-Instruct's ``config.json``.

    20 KDA layers (32 heads x 128, conv 4) + 7 MLA layers (512 + 64 latent): 8,064 B of
    bf16 KV per token, 43,417,600 B per snapshot (fp32 recurrent + bf16 conv state).
    """
    return spec_from_hf_config(pc.KIMI_LINEAR_48B_A3B, name="kimi-linear-48b")


def kimi_k3() -> ModelSpec:
    """A Kimi K3-like model in vLLM's ``KimiK3Config`` schema; layer counts are assumptions.

    Same assumptions as the hand-built core preset: hidden 7168, 64 layers at 3 KDA : 1 MLA,
    KDA 64 heads x 128 with conv 4, MLA latent 512 + 64, 16 routed + 1 shared expert of
    width 2048. 18,432 B of KV per token, 208,404,480 B per snapshot.
    """
    return spec_from_hf_config(pc.KIMI_K3_LIKE, name="kimi-k3")


def kimi_k3_96h() -> ModelSpec:
    """``kimi-k3`` with the 96 KDA heads that vLLM 0.32.0's K3 kernel tables imply.

    Per-layer KDA and MLA shapes from the TP-8 projection shapes in vLLM's K3 kernels (see
    ``public_configs.KIMI_K3_96H``); layer counts and experts still as ``kimi-k3``.
    18,432 B of KV per token, 312,606,720 B per snapshot.
    """
    return spec_from_hf_config(pc.KIMI_K3_96H, name="kimi-k3-96h")


def qwen3_next_80b() -> ModelSpec:
    """Qwen3-Next 80B-A3B from Qwen/Qwen3-Next-80B-A3B-Instruct's ``config.json``.

    36 Gated DeltaNet + 12 attention layers (2 KV heads x 256): 24,576 B of KV per token;
    39,518,208 B per snapshot with vLLM's default bf16 recurrent state.
    """
    return spec_from_hf_config(pc.QWEN3_NEXT_80B_A3B, name="qwen3-next-80b")


def nemotron_h_8b() -> ModelSpec:
    """Nemotron-H 8B from nvidia/Nemotron-H-8B-Base-8K's ``config.json``.

    24 Mamba2 (128 heads x 64, d_state 128, 8 groups) + 4 attention layers: 16,384 B of KV
    per token; 102,137,856 B per snapshot (fp32 SSM state, vLLM's Nemotron-H default).
    """
    return spec_from_hf_config(pc.NEMOTRON_H_8B, name="nemotron-h-8b")


def jamba_mini() -> ModelSpec:
    """Jamba (v0.1 / 1.5-Mini layout) from ai21labs/Jamba-v0.1's ``config.json``.

    28 Mamba1 (d_inner 8192, d_state 16) + 4 attention layers: 16,384 B of KV per token,
    8,716,288 B per snapshot (bf16). Mamba1 state (kind MAMBA1).
    """
    return spec_from_hf_config(pc.JAMBA_V0_1, name="jamba-mini")


def falcon_h1_7b() -> ModelSpec:
    """Falcon-H1 7B from tiiuae/Falcon-H1-7B-Base's ``config.json``.

    44 layers, each with attention (2 KV heads x 128) and Mamba2 (24 heads x 128, d_state
    256): 45,056 B of KV per token, 70,152,192 B per snapshot (bf16).
    """
    return spec_from_hf_config(pc.FALCON_H1_7B, name="falcon-h1-7b")


def mamba2_2_7b() -> ModelSpec:
    """Mamba2 2.7B from state-spaces/mamba2-2.7b's config (translated, see public_configs).

    64 Mamba2 layers (80 heads x 64, d_state 128), no KV cache: 85,950,464 B per snapshot.
    """
    return spec_from_hf_config(pc.MAMBA2_2_7B, name="mamba2-2.7b")


def granite_4_0_h_small() -> ModelSpec:
    """Granite-4.0-H-Small from ibm-granite/granite-4.0-h-small's ``config.json``.

    36 Mamba2 (128 heads x 64, d_state 128) + 4 attention layers (8 KV heads x 128):
    16,384 B of KV per token, 77,322,240 B per snapshot (bf16).
    """
    return spec_from_hf_config(pc.GRANITE_4_0_H_SMALL, name="granite-4.0-h-small")


def gpt_oss_20b() -> ModelSpec:
    """gpt-oss-20b from openai/gpt-oss-20b's ``config.json``.

    12 sliding-window layers (128 tokens) + 12 full-attention layers, 8 KV heads x 64 each:
    24,576 B of bf16 KV per token per kind (49,152 B in all), no recurrent state.
    """
    return spec_from_hf_config(pc.GPT_OSS_20B, name="gpt-oss-20b")


def gpt_oss_120b() -> ModelSpec:
    """gpt-oss-120b from openai/gpt-oss-120b's ``config.json``: 18 + 18 layers, as 20b."""
    return spec_from_hf_config(pc.GPT_OSS_120B, name="gpt-oss-120b")


#: Preset name -> (factory, embedded config, whether it replaces a core preset).
_PRESETS: dict[str, tuple[Callable[[], ModelSpec], Mapping[str, Any], bool]] = {
    "kimi-linear-48b": (kimi_linear_48b, pc.KIMI_LINEAR_48B_A3B, True),
    "kimi-k3": (kimi_k3, pc.KIMI_K3_LIKE, True),
    "kimi-k3-96h": (kimi_k3_96h, pc.KIMI_K3_96H, False),
    "qwen3-next-80b": (qwen3_next_80b, pc.QWEN3_NEXT_80B_A3B, False),
    "nemotron-h-8b": (nemotron_h_8b, pc.NEMOTRON_H_8B, False),
    "jamba-mini": (jamba_mini, pc.JAMBA_V0_1, False),
    "falcon-h1-7b": (falcon_h1_7b, pc.FALCON_H1_7B, False),
    "mamba2-2.7b": (mamba2_2_7b, pc.MAMBA2_2_7B, False),
    "granite-4.0-h-small": (granite_4_0_h_small, pc.GRANITE_4_0_H_SMALL, False),
    "gpt-oss-20b": (gpt_oss_20b, pc.GPT_OSS_20B, False),
    "gpt-oss-120b": (gpt_oss_120b, pc.GPT_OSS_120B, False),
}

#: Read-only view: preset name -> the embedded config it is derived from.
PRESET_CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: cfg for name, (_, cfg, _) in _PRESETS.items()}
)

_registered = False


def preset_config(name: str) -> dict[str, Any]:
    """A private copy of the config behind preset ``name`` (safe to edit and re-derive)."""
    try:
        return copy.deepcopy(dict(PRESET_CONFIGS[name]))
    except KeyError:
        raise UnknownNameError(
            f"no config-derived preset {name!r}; known: {', '.join(sorted(PRESET_CONFIGS))}"
        ) from None


def register_hf_presets() -> None:
    """Register every config-derived preset once (importing the package does it)."""
    global _registered
    if _registered:
        return
    for name, (factory, _, replace) in _PRESETS.items():
        register_preset(name, factory, replace=replace)
    _registered = True
