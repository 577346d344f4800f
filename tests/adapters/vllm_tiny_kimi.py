"""Build a tiny, randomly initialised Kimi-Linear-style checkpoint (KDA + GQA attention).

Nothing is downloaded: the tokenizer is the byte-level BPE of :mod:`vllm_tiny_model`
(trained here), the weights are random (seeded), and ``config.json`` is a Kimi Linear
config (``model_type="kimi_linear"``) whose architecture is hybridcache's
``HybridcacheKimiGQAForCausalLM`` (:mod:`hybridcache.adapters.vllm.kda_model`): vLLM's
``KimiK3DeltaAttention`` layers (full-rank gate, as Kimi K3) next to GQA full attention,
because vLLM's CPU build turns prefix caching off for MLA models on CPUs without AMX.

Sizes: 4 layers (KDA, attention, KDA, attention; Kimi Linear's 3:1 ratio would need 8 and
double the start-up), hidden 128, one KDA head of dim 64 (a small state keeps vLLM's
``align``-mode attention block a few hundred tokens, as for the tiny Qwen3-Next).
"""

from __future__ import annotations

import json
from pathlib import Path

KDA_HEAD_DIM = 64


def kimi_config(*, head_dim: int = KDA_HEAD_DIM, lower_bound: float | None = -5.0) -> dict:
    """The ``config.json`` of the tiny model."""
    linear = {
        "kda_layers": [1, 3],
        "full_attn_layers": [2, 4],
        "head_dim": head_dim,
        "num_heads": 1,
        "short_conv_kernel_size": 4,
        "use_full_rank_gate": True,
    }
    if lower_bound is not None:
        linear["gate_lower_bound"] = lower_bound
    return {
        "architectures": ["HybridcacheKimiGQAForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "linear_attn_config": linear,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "torch_dtype": "bfloat16",
    }


def build_tiny_kimi(out_dir: Path, *, seed: int = 0) -> Path:
    """Write config, tokenizer and random bf16 weights of the tiny KDA model to ``out_dir``."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file
    from vllm_tiny_model import train_tokenizer

    from hybridcache.adapters.vllm.kda_model import checkpoint_shapes

    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir)
    cfg = kimi_config()
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = {"eos_token_id": 0, "pad_token_id": 1, "bos_token_id": 0}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    shapes = checkpoint_shapes(SimpleNamespace(**cfg))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith(("norm.weight", "layernorm.weight")):
            t = torch.ones(shape)
        elif name.endswith("A_log"):
            t = torch.rand(shape, generator=g) * 2 - 1
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, generator=g) * 0.5
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=g) * 0.5
        else:  # projections and embeddings: ~ N(0, 1/fan_in)
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        tensors[name] = t.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


if __name__ == "__main__":  # pragma: no cover - manual use: python vllm_tiny_kimi.py DIR
    import sys

    print(build_tiny_kimi(Path(sys.argv[1])))
