"""Model specs from Hugging Face configs, and the presets derived from public configs.

:func:`spec_from_hf_config` turns the ``config.json`` of Kimi K3, Kimi Linear, Qwen3-Next,
Nemotron-H, Jamba, Falcon-H1, Mamba2 or Granite-4.0-H into a
:class:`~hybridcache.spec.ModelSpec` whose KV bytes and state tensors are those vLLM would
allocate for it. Importing this package registers the config-derived presets (see
:mod:`hybridcache.adapters.hf.presets`) with :mod:`hybridcache.presets`.
"""

from __future__ import annotations

from .convert import SUPPORTED_ARCHITECTURES, spec_from_hf_config
from .loading import load_hf_config
from .presets import PRESET_CONFIGS, preset_config, register_hf_presets

register_hf_presets()

__all__ = [
    "PRESET_CONFIGS",
    "SUPPORTED_ARCHITECTURES",
    "load_hf_config",
    "preset_config",
    "register_hf_presets",
    "spec_from_hf_config",
]
