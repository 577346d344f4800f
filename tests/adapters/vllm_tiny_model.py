"""Build tiny, randomly initialised hybrid checkpoints that vLLM's CPU build can serve.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on generated
sentences, the weights are random (seeded), and the config is written by ``transformers``.
Used by the end-to-end tests (``test_vllm_e2e.py``) and by ``docs/vllm.md``'s recipe.

Why these sizes: 4 layers (2 Gated DeltaNet + 2 full attention), hidden 128 and a 4-expert
MoE keep vLLM's start-up near 25 s on 2 CPU cores; ``linear_key_head_dim=128`` is what the
CPU GDN kernel supports (it also wants the value head as wide as the key head). One value
head keeps one state page small, so that vLLM's ``align`` mode inflates the attention block
to a few hundred tokens rather than thousands (the block size is read, not assumed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a cache state token prefix model layer block page memory attention delta net "
    "request session document branch system prompt user assistant answer question reads "
    "writes keeps moves shares saves loads hybrid linear recurrent kernel engine tier host "
    "fast slow long short first last next every some many one two three four five six"
).split()


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))) + "." for _ in range(n)]


def train_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE on generated text and save it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_sentences(2000, seed=7), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(str(out_dir))


def build_qwen3_next(
    out_dir: Path, *, value_head_dim: int = 128, value_heads: int = 1, seed: int = 0
) -> Path:
    """Save a 4-layer Qwen3-Next (GDN, attn, GDN, attn) with random weights to ``out_dir``.

    ``value_heads`` GDN value heads (sharing one key head) widen the recurrent state and so
    vLLM's inflated ``align`` block: 8 heads give a block of more than 1,024 tokens, the
    size of real models' blocks relative to short prompts (fine-grained hit tests).
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir)
    cfg = Qwen3NextConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=value_head_dim,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=1,
        bos_token_id=0,
    )
    cfg.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    gen = {"eos_token_id": 0, "pad_token_id": 1, "bos_token_id": 0}
    (out_dir / "generation_config.json").write_text(json.dumps(gen))
    return out_dir


if __name__ == "__main__":  # pragma: no cover - manual use: python vllm_tiny_model.py DIR
    import sys

    print(build_qwen3_next(Path(sys.argv[1])))


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
