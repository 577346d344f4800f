"""A Kimi-Linear-style causal LM for vLLM: vLLM's KDA layer + GQA full attention.

Why a model class of our own: vLLM's ``KimiLinearForCausalLM`` pairs KDA with MLA, and
on CPUs without AMX (this project's machine is an AMD EPYC) vLLM's CPU platform turns
prefix caching and chunked prefill off for every MLA model (``CpuPlatform``: "MLA is
enabled on a non-GPU platform"). Prefix caching of a K3-like model can therefore only be
exercised on such a CPU with another full-attention layer. This class keeps what matters
for the cache exactly vLLM's: the KDA layers are vLLM's ``KimiK3DeltaAttention`` (Kimi
K3's full-rank-gate KDA, state shapes from ``MambaStateShapeCalculator.kda_state_shape``,
its metadata builder and ``align``-mode state blocks), and the mamba state shape / dtype
/ copy functions are ``KimiLinearForCausalLM``'s. Full-attention layers are standard
GQA (vLLM ``Attention`` with RoPE), MLPs dense SiLU.

Registered by the plug-in under :data:`ARCHITECTURE` (lazily, by qualified name); the
checkpoint format is this module's parameter names, see :func:`checkpoint_shapes`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

ARCHITECTURE = "HybridcacheKimiGQAForCausalLM"


def _kda_layers(config: Any) -> set[int]:
    """0-based indices of the KDA layers (the config lists them 1-based, as Kimi Linear)."""
    return {i - 1 for i in config.linear_attn_config["kda_layers"]}


def checkpoint_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every weight the model loads, with its shape (tensor parallelism 1).

    The builder of the tiny test checkpoint writes exactly these; :meth:`load_weights`
    refuses a checkpoint that misses one or has another shape.
    """
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    kda = config.linear_attn_config
    nh, d, w = kda["num_heads"], kda["head_dim"], kda["short_conv_kernel_size"]
    p = nh * d
    pad = -(4 * p + d + nh) % 16
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab, h),
    }
    for i in range(config.num_hidden_layers):
        pre = f"model.layers.{i}"
        out[f"{pre}.input_layernorm.weight"] = (h,)
        out[f"{pre}.post_attention_layernorm.weight"] = (h,)
        out[f"{pre}.mlp.gate_up_proj.weight"] = (2 * inter, h)
        out[f"{pre}.mlp.down_proj.weight"] = (h, inter)
        a = f"{pre}.self_attn"
        if i in _kda_layers(config):
            out[f"{a}.in_proj_qkvgfab.weight"] = (4 * p + d + nh + pad, h)
            out[f"{a}.f_b_proj.weight"] = (p, d)
            out[f"{a}.dt_bias"] = (p,)
            out[f"{a}.conv1d.weight"] = (3 * p, 1, w)
            out[f"{a}.A_log"] = (nh,)
            out[f"{a}.o_norm.weight"] = (d,)
            out[f"{a}.o_proj.weight"] = (h, p)
        else:
            out[f"{a}.qkv_proj.weight"] = ((heads + 2 * kv) * hd, h)
            out[f"{a}.o_proj.weight"] = (h, heads * hd)
    return out


def build_model_class() -> type[nn.Module]:
    """The model class (built on first use: it imports vLLM's model modules, and installs
    the CPU KDA layer before vLLM instantiates one)."""
    from .kda_cpu import install_cpu_kda

    cls = _causal_lm_class(_model_class(_gqa_attention_class()))  # imports vLLM's modules
    install_cpu_kda()
    return cls


def _gqa_attention_class() -> type[nn.Module]:
    """Standard GQA full attention (vLLM ``Attention`` with RoPE), the non-KDA layers."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.rotary_embedding import get_rope

    class GQAAttention(nn.Module):
        def __init__(self, config: Any, vllm_config: VllmConfig, prefix: str) -> None:
            super().__init__()
            self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
            self.head_dim = config.head_dim
            self.qkv_proj = QKVParallelLinear(
                config.hidden_size, self.head_dim, self.heads, self.kv_heads,
                bias=False, prefix=f"{prefix}.qkv_proj",
            )
            self.o_proj = RowParallelLinear(
                self.heads * self.head_dim, config.hidden_size, bias=False,
                prefix=f"{prefix}.o_proj",
            )
            self.rotary_emb = get_rope(
                self.head_dim, config.max_position_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            )
            self.attn = Attention(
                self.heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.kv_heads,
                cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn",
            )

        def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            qkv, _ = self.qkv_proj(hidden_states)
            q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q, k = self.rotary_emb(positions, q, k)
            out, _ = self.o_proj(self.attn(q, k, v))
            return out

    return GQAAttention


def _model_class(attention_cls: type[nn.Module]) -> type[nn.Module]:
    """The decoder stack: vLLM's ``KimiK3DeltaAttention`` on the KDA layers,
    ``attention_cls`` on the others, dense SiLU MLPs, RMS norms."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.llama import LlamaMLP
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    class DecoderLayer(nn.Module):
        def __init__(self, config: Any, vllm_config: VllmConfig, index: int, prefix: str) -> None:
            super().__init__()
            if index in _kda_layers(config):
                self.self_attn = KimiK3DeltaAttention(
                    config, vllm_config, prefix=f"{prefix}.self_attn"
                )
            else:
                self.self_attn = attention_cls(config, vllm_config, f"{prefix}.self_attn")
            self.mlp = LlamaMLP(
                config.hidden_size, config.intermediate_size, "silu", prefix=f"{prefix}.mlp"
            )
            self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            h = hidden + self.self_attn(
                hidden_states=self.input_layernorm(hidden), positions=positions
            )
            return h + self.mlp(self.post_attention_layernorm(h))

    class Model(nn.Module):
        def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
            super().__init__()
            config = vllm_config.model_config.hf_config
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                DecoderLayer(config, vllm_config, i, f"{prefix}.layers.{i}")
                for i in range(config.num_hidden_layers)
            )
            self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    return Model


def _causal_lm_class(model_cls: type[nn.Module]) -> type[nn.Module]:
    """The causal LM vLLM loads: ``model_cls`` + LM head, with ``KimiLinearForCausalLM``'s
    mamba state shape, dtype and copy functions (so the cache sees exactly vLLM's KDA)."""
    from vllm.config import VllmConfig
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
    from vllm.models.kimi_k3.nvidia.model import KimiLinearForCausalLM

    class HybridcacheKimiGQAForCausalLM(nn.Module, HasInnerState, IsHybrid):
        """KDA (vLLM's ``KimiK3DeltaAttention``) + GQA attention; see module docstring."""

        def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
            super().__init__()
            self.config = vllm_config.model_config.hf_config
            self.model = model_cls(vllm_config, "model")
            self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size)
            self.logits_processor = LogitsProcessor(self.config.vocab_size)

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model.embed_tokens(input_ids)

        def forward(
            self, input_ids: torch.Tensor | None, positions: torch.Tensor,
            intermediate_tensors: Any = None, inputs_embeds: torch.Tensor | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            for layer in self.model.layers:
                h = layer(h, positions)
            return h

        def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
            return self.logits_processor(self.lm_head, self.model.norm(hidden_states))

        get_mamba_state_dtype_from_config = KimiLinearForCausalLM.get_mamba_state_dtype_from_config
        get_mamba_state_shape_from_config = KimiLinearForCausalLM.get_mamba_state_shape_from_config
        get_mamba_state_copy_func = KimiLinearForCausalLM.get_mamba_state_copy_func

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return load_checked_weights(self, weights)

    return HybridcacheKimiGQAForCausalLM


def load_checked_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Copy ``weights`` into ``model``, refusing (``ValueError``) a tensor that is not in
    :func:`checkpoint_shapes` with its shape, and a checkpoint that misses one."""
    params = dict(model.named_parameters())
    expected = checkpoint_shapes(model.config)
    loaded: set[str] = set()
    for name, w in weights:
        if name not in params or tuple(w.shape) != expected.get(name):
            raise ValueError(f"unexpected checkpoint tensor {name} {tuple(w.shape)}")
        params[name].data.copy_(w.to(params[name].dtype))
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint misses {missing[:5]}")
    return loaded


def __getattr__(name: str) -> Any:
    """``kda_model.HybridcacheKimiGQAForCausalLM`` for vLLM's lazy model registry."""
    if name == ARCHITECTURE:
        cls = build_model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
