"""Tiny, randomly initialised hybrid checkpoints that vLLM's CPU build can serve.

Nothing is downloaded. The tiny Qwen3-Next (and its tokenizer, shared with the Kimi models
here and in :mod:`vllm_tiny_kimi`) is the package's own
:func:`hybridcache.adapters.hf.tiny.build_tiny_qwen3_next`, which ``examples/vllm_cpu.py``
serves too: one builder, so the tests exercise the model users get (sizes and why: that
module's docstring). Used by the end-to-end tests (``test_vllm_e2e.py``) and by
``docs/vllm.md``'s recipe.
"""

from __future__ import annotations

from pathlib import Path

from hybridcache.adapters.hf.tiny import WORDS, train_tokenizer
from hybridcache.adapters.hf.tiny import build_tiny_qwen3_next as build_qwen3_next

__all__ = ["WORDS", "build_kimi_linear", "build_qwen3_next", "train_tokenizer"]


def build_kimi_linear(out_dir: Path, *, seed: int = 0) -> Path:
    """Save a 4-layer Kimi Linear (KDA, MLA, KDA, MLA) with random weights to ``out_dir``.

    Used to record whether vLLM's CPU build can serve KDA layers (see ``docs/vllm.md``).
    """
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir)
    cfg = KimiLinearConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        linear_num_heads=1, linear_head_dim=128, linear_conv_kernel_dim=4,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4],
                            "head_dim": 128, "num_heads": 1, "short_conv_kernel_size": 4},
        first_k_dense_replace=0, moe_layer_freq=1,
        eos_token_id=0, pad_token_id=1, bos_token_id=0, model_max_length=4096,
    )
    cfg.architectures = ["KimiLinearForCausalLM"]
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


if __name__ == "__main__":  # pragma: no cover - manual use: python vllm_tiny_model.py DIR
    import sys

    print(build_qwen3_next(Path(sys.argv[1])))
