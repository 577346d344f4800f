"""State tensor shapes and dtypes of recurrent layers, derived as vLLM derives them.

Shapes follow ``MambaStateShapeCalculator`` and dtypes ``MambaStateDtypeCalculator`` in
``vllm/model_executor/layers/mamba/mamba_utils.py`` (vLLM 0.32.0), at tensor-parallel size 1
(the whole model's state) and without speculative tokens (``num_spec`` = 0).

Conv states are written ``(dim, state_len)``: vLLM's "DS" layout and the orientation of
:func:`hybridcache.presets.kda_state_tensors`. vLLM's default "SD" layout stores the transpose
``(state_len, dim)``; the bytes are identical, and only bytes and element counts matter to the
cache, so we keep one orientation for every model.

Dtype rules (``"auto"`` everywhere is vLLM's default):
  * conv state: the KV/activation dtype of the model (``--mamba-cache-dtype auto``);
  * Mamba1/Mamba2/Gated DeltaNet temporal state: the conv dtype unless overridden
    (``--mamba-ssm-cache-dtype``); Nemotron-H overrides "auto" with its config's
    ``mamba_ssm_cache_dtype`` or float32;
  * KDA recurrent state: float32 unless overridden, and only float32 or bfloat16 allowed.
"""

from __future__ import annotations

from hybridcache.errors import SpecError
from hybridcache.spec import DTYPE_BYTES, StateTensorSpec

from .loading import ConfigView

#: Spellings accepted for a dtype argument, mapped to the names :mod:`hybridcache.spec` uses.
_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}

#: What ``--mamba-ssm-cache-dtype`` accepts in vLLM besides "auto".
_SSM_DTYPES = ("float32", "bfloat16", "float16")
_KDA_DTYPES = ("float32", "bfloat16")


def normalize_dtype(dtype: object, field_name: str) -> str | None:
    """``None`` for "auto"/``None``; otherwise the spec's name of ``dtype`` (torch dtypes too)."""
    if dtype is None:
        return None
    text = str(dtype).lower().removeprefix("torch.")
    if text == "auto":
        return None
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_BYTES:
        known = ", ".join(sorted(DTYPE_BYTES))
        raise SpecError(f"{field_name}: unknown dtype {dtype!r} (known: auto, {known})")
    return text


def model_dtype(cfg: ConfigView) -> str:
    """The dtype vLLM runs the model in with ``--dtype auto``.

    The config's ``torch_dtype`` (or ``dtype``, its newer name) when it is a 16-bit type;
    float32 or no dtype at all is downcast to bfloat16, as vLLM does on current GPUs.
    """
    for key in ("torch_dtype", "dtype"):
        if cfg.has(key):
            name = normalize_dtype(cfg.raw(key), cfg.name(key))
            if name in ("bfloat16", "float16"):
                return name
            return "bfloat16"
    return "bfloat16"


def ssm_dtype(override: str | None, conv_dtype: str, *, default: str | None = None) -> str:
    """Temporal state dtype of Mamba1/Mamba2/GDN layers (vLLM's ``_mamba_state_dtype``)."""
    chosen = override if override is not None else default
    if chosen is None:
        return conv_dtype
    if chosen not in _SSM_DTYPES:
        raise SpecError(f"state_dtype: must be one of auto, {', '.join(_SSM_DTYPES)}; got {chosen!r}")
    return chosen


def kda_recurrent_dtype(override: str | None) -> str:
    """KDA recurrent state dtype (vLLM's ``kda_state_dtype``): float32 unless overridden."""
    if override is None:
        return "float32"
    if override not in _KDA_DTYPES:
        raise SpecError(
            f"state_dtype: KDA keeps its recurrent state in {' or '.join(_KDA_DTYPES)}; "
            f"got {override!r}"
        )
    return override


def kda_state(
    num_heads: int, head_dim: int, conv_kernel: int, conv_dtype: str, recurrent_dtype: str
) -> tuple[StateTensorSpec, ...]:
    """KDA layer: conv over q, k, v (``3 * H * D`` channels) and recurrent ``(H, D, D)``.

    vLLM ``kda_state_shape``: conv_dim = H*D + 2 * H_k*D_k with H_k = H, D_k = D.
    """
    conv_dim = num_heads * head_dim + 2 * num_heads * head_dim
    return (
        StateTensorSpec("conv", (conv_dim, conv_kernel - 1), conv_dtype),
        StateTensorSpec("recurrent", (num_heads, head_dim, head_dim), recurrent_dtype),
    )


def gated_delta_net_state(
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
    conv_dtype: str,
    recurrent_dtype: str,
) -> tuple[StateTensorSpec, ...]:
    """Gated DeltaNet layer (vLLM ``gated_delta_net_state_shape``).

    The conv runs over q and k (``H_k * D_k`` each) and v (``H_v * D_v``); the recurrent
    state is ``(H_v, D_v, D_k)``.
    """
    conv_dim = head_k_dim * num_k_heads * 2 + head_v_dim * num_v_heads
    return (
        StateTensorSpec("conv", (conv_dim, conv_kernel - 1), conv_dtype),
        StateTensorSpec("recurrent", (num_v_heads, head_v_dim, head_k_dim), recurrent_dtype),
    )


def mamba2_state(
    intermediate_size: int,
    n_groups: int,
    num_heads: int,
    head_dim: int,
    state_size: int,
    conv_kernel: int,
    conv_dtype: str,
    ssm_dtype_: str,
) -> tuple[StateTensorSpec, ...]:
    """Mamba2 layer (vLLM ``mamba2_state_shape`` at TP 1).

    The conv runs over x (``intermediate_size``) and B, C (``n_groups * d_state`` each); the
    SSM state is ``(heads, head_dim, d_state)``.
    """
    conv_dim = intermediate_size + 2 * n_groups * state_size
    return (
        StateTensorSpec("conv", (conv_dim, conv_kernel - 1), conv_dtype),
        StateTensorSpec("ssm", (num_heads, head_dim, state_size), ssm_dtype_),
    )


def mamba1_state(
    intermediate_size: int, state_size: int, conv_kernel: int, conv_dtype: str, ssm_dtype_: str
) -> tuple[StateTensorSpec, ...]:
    """Mamba1 layer (vLLM ``mamba1_state_shape``): conv over x, SSM ``(d_inner, d_state)``."""
    return (
        StateTensorSpec("conv", (intermediate_size, conv_kernel - 1), conv_dtype),
        StateTensorSpec("ssm", (intermediate_size, state_size), ssm_dtype_),
    )
