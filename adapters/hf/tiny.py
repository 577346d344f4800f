"""A tiny, randomly initialised Qwen3-Next checkpoint that vLLM's CPU build can serve.

For trying the vLLM integration without downloading a model (``examples/vllm_cpu.py``):
nothing is downloaded, the tokenizer is a byte-level BPE trained here on generated
sentences, the weights are random (seeded) and the config is written by ``transformers``.
Needs ``torch`` and ``transformers`` (both come with the ``vllm`` extra).

Why these sizes: 4 layers (2 Gated DeltaNet + 2 full attention), hidden 128 and a 4-expert
MoE keep vLLM's start-up near 25 s on 2 CPU cores; a key head of 128 is what the CPU GDN
kernel supports (it also wants the value head as wide as the key head). One value head keeps
one state page small, so that vLLM's ``align`` mode inflates the attention block to a few
hundred tokens rather than thousands. The outputs are meaningless; the cache behaviour is
that of a real hybrid model.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB = 512
WORDS = (
    "the a cache state token prefix model layer block page memory attention delta net "
    "request session document branch system prompt user assistant answer question reads "
    "writes keeps moves shares saves loads hybrid linear recurrent kernel engine tier host "
    "fast slow long short first last next every some many one two three four five six"
).split()


def _sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 18))) + "." for _ in range(n)]


def train_tokenizer(out_dir: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE of ``vocab_size`` tokens trained on generated text, saved for HF
    (the tests' tiny Kimi Linear shares it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_sentences(2000, seed=7), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(out_dir))


def build_tiny_qwen3_next(
    out_dir: str | Path, *, value_head_dim: int = 128, value_heads: int = 1, seed: int = 0
) -> Path:
    """Save a 4-layer Qwen3-Next (GDN, attention, GDN, attention) with random weights.

    ``value_heads`` GDN value heads (sharing one key head) widen the recurrent state and so
    vLLM's inflated ``align`` block: 8 heads give a block of more than 1,024 tokens, the
    size of real models' blocks relative to short prompts (the fine-grained hit tests).
    Returns ``out_dir`` (created if missing), ready for ``vllm.LLM(model=out_dir)``.
    """
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out)
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=1, linear_num_value_heads=value_heads, linear_key_head_dim=128,
        linear_value_head_dim=value_head_dim, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, decoder_sparse_step=1,
        max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=0, pad_token_id=1, bos_token_id=0,
    )
    cfg.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(seed)
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    gen = {"eos_token_id": 0, "pad_token_id": 1, "bos_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out
