"""Small model specs for core tests: tiny so that eviction happens after a few requests."""

from __future__ import annotations

import pytest

from hybridcache.manager import HybridCacheManager
from hybridcache.spec import (
    AttentionGroupSpec,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateTensorSpec,
)


def tiny_spec(
    state: bool = True, attention: bool = True, big_state: bool = True, max_len: int = 4096
) -> ModelSpec:
    """A hybrid spec with 256-byte-per-token KV and a 4 KiB (or 64 B) snapshot."""
    attn = (AttentionGroupSpec("attn", "full", num_layers=2, num_kv_heads=1, head_dim=32, dtype="float16"),)
    shape = (4, 16, 16) if big_state else (4,)
    st = (
        StateGroupSpec(
            "kda",
            "kda",
            num_layers=2,
            tensors=(
                StateTensorSpec("recurrent", shape, "float32"),
                StateTensorSpec("conv", (8, 3), "bfloat16"),
            ),
        ),
    )
    return ModelSpec(
        name="tiny",
        attention_groups=attn if attention else (),
        state_groups=st if state else (),
        flops=FlopModel(hidden_size=64, num_attention_layers=2, num_recurrent_layers=2),
        max_model_len=max_len,
    )


@pytest.fixture
def spec() -> ModelSpec:
    return tiny_spec()


def check_runs_and_ranks(m: HybridCacheManager) -> None:
    """Run bookkeeping agrees with a per-node recount; the value queue's top is the
    lowest priority of any evictable unit (the tail of a run is its minimum)."""
    index = m.index
    used = {id(n) for req in m.requests.values() for n in req.nodes}
    ppb = max(m.layout.pages_per_block, 1)
    evictable = [0] * m.layout.num_blocks
    kv = [n for n in index.nodes.values() if n.pages is not None]
    for node in kv:
        run = node.run
        assert run is not None and run.nodes[node.pos] is node and run.digests[node.pos] == node.digest
        assert node.pos == 0 or run.nodes[node.pos - 1].depth == node.depth - 1
        assert run.held == max(run.holds, default=0) <= len(run.nodes)
        assert max([*run.hits, *run.rel], default=0) <= len(run.nodes)
        assert (node.kv_ref > 0) == (id(node) in used), "held iff a live request uses it"
        if node.kv_ref == 0:
            for p in node.pages:
                evictable[p // ppb] += 1
    assert index._evictable_pages == evictable, "evictable pages per block"
    if m.config.eviction == "value":
        free = [index.kv_q.priority(n) for n in kv if n.kv_ref == 0]
        top = index.kv_q.peek()
        assert (top is None) == (not free)
        if free:
            assert top[0] == min(free) and top[1].kv_ref == 0
