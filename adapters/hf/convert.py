"""``spec_from_hf_config``: one entry point, dispatching on the config's architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import PurePath

from hybridcache.errors import SpecError
from hybridcache.spec import ModelSpec

from . import gpt_oss, kimi, mamba, qwen3_next
from .loading import ConfigView, load_hf_config

Builder = Callable[[ConfigView, str, object, object], ModelSpec]

#: Architecture name (``config.architectures[0]``) -> spec builder.
_BUILDERS: dict[str, Builder] = {
    "KimiK3ForConditionalGeneration": kimi.kimi_k3,
    "KimiLinearForCausalLM": kimi.kimi_linear,
    "Qwen3NextForCausalLM": qwen3_next.qwen3_next,
    "NemotronHForCausalLM": mamba.nemotron_h,
    "JambaForCausalLM": mamba.jamba,
    "FalconH1ForCausalLM": mamba.falcon_h1,
    "Mamba2ForCausalLM": mamba.mamba2,
    "GraniteMoeHybridForCausalLM": mamba.granite_moe_hybrid,
    "GptOssForCausalLM": gpt_oss.gpt_oss,
}

#: ``model_type`` -> architecture, for configs built without ``architectures`` (a bare
#: transformers config object, for example).
_MODEL_TYPES: dict[str, str] = {
    "kimi_k3": "KimiK3ForConditionalGeneration",
    "kimi_linear": "KimiLinearForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "jamba": "JambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}

#: Every architecture :func:`spec_from_hf_config` understands, sorted.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_BUILDERS))


def spec_from_hf_config(
    config: object,
    *,
    name: str | None = None,
    kv_dtype: object = None,
    state_dtype: object = None,
) -> ModelSpec:
    """The cache layout of a hybrid model, from its Hugging Face config.

    Args:
        config: a config dict, a path to ``config.json`` or to the directory holding it, or
            a transformers ``PretrainedConfig`` (vLLM's ``KimiK3Config`` included).
        name: the spec's name; defaults to the config's ``_name_or_path`` or architecture.
        kv_dtype: KV cache dtype ("auto"/None: the model dtype, as vLLM's
            ``--kv-cache-dtype auto``; "fp8" means float8_e4m3fn).
        state_dtype: dtype of the temporal/recurrent state, as vLLM's
            ``--mamba-ssm-cache-dtype`` ("auto"/None keeps vLLM's per-model default: float32
            for KDA and Nemotron-H, the model dtype otherwise). Conv states always use the
            model dtype.

    Shapes are those vLLM 0.32.0 allocates at tensor-parallel size 1 without speculative
    tokens (see :mod:`hybridcache.adapters.hf.state`).

    Raises:
        SpecError: an unsupported architecture (the message lists the supported ones) or a
            missing/invalid field (the message names it).
    """
    data = load_hf_config(config)
    arch = _architecture(data)
    cfg = ConfigView(data)
    spec_name = name or _default_name(data, arch)
    return _BUILDERS[arch](cfg, spec_name, kv_dtype, state_dtype)


def _architecture(data: dict[str, object]) -> str:
    archs = data.get("architectures")
    if archs is not None:
        if isinstance(archs, str):
            archs = [archs]
        if not isinstance(archs, (list, tuple)) or not all(isinstance(a, str) for a in archs):
            raise SpecError(f"architectures: must be a list of names, got {archs!r}")
        for arch in archs:
            if arch in _BUILDERS:
                return arch
        if archs:
            raise SpecError(
                f"architectures: unsupported architecture {', '.join(archs)}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    model_type = data.get("model_type")
    if isinstance(model_type, str) and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    if model_type is None:
        raise SpecError(
            "architectures: missing from the config (and no model_type); supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    raise SpecError(
        f"model_type: unsupported model type {model_type!r} and no supported architectures; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _default_name(data: dict[str, object], arch: str) -> str:
    path = data.get("_name_or_path")
    if isinstance(path, str) and path.strip():
        return PurePath(path.rstrip("/")).name or path
    return arch
