"""Shared helpers of the reference-model tests: one CPU thread, tiny model and workload.

The model's matrices are tiny, so torch's intra-op threads only add synchronisation (40x
slower per op on a busy 2-core machine, measured); every test runs single-threaded.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybridcache.adapters.reference import ReferenceConfig, WorkloadShape
from hybridcache.adapters.reference.check import CheckOptions

#: 3 KDA : 1 attention, width 32: a check of ~10 requests takes about a second.
TINY = ReferenceConfig(
    vocab_size=128,
    hidden_size=32,
    layer_pattern="KKKA",
    kda_heads=2,
    kda_head_dim=8,
    attn_heads=2,
    attn_kv_heads=1,
    attn_head_dim=8,
    mlp_hidden=64,
    max_model_len=4096,
)
#: Short prompts: a system prompt fills 1-4 pages of 16 tokens, a document 5-10.
SMALL = WorkloadShape(
    system_prompts=2,
    system_len=(20, 60),
    documents=2,
    document_len=(80, 160),
    user_len=(4, 20),
    max_new=(2, 10),
    chat_turns=(1, 3),
    doc_turns=(1, 2),
)
#: 24 blocks of 4 KiB (one block = one snapshot or 4 pages): four live requests contend.
TINY_CAPACITY = 96 * 1024


def tiny_options(**overrides: object) -> CheckOptions:
    """Check options for the tiny model and workload; keyword arguments override fields."""
    base = CheckOptions(requests=10, capacity=TINY_CAPACITY, model=TINY, shape=SMALL)
    return replace(base, **overrides)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
