"""Small model specs for core tests: tiny so that eviction happens after a few requests."""

from __future__ import annotations

import pytest

from hybridcache.arena import KV
from hybridcache.manager import HybridCacheManager
from hybridcache.spec import (
    AttentionGroupSpec,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateTensorSpec,
)


def tiny_spec(
    state: bool = True, attention: bool = True, big_state: bool = True, max_len: int = 4096,
    window: int | None = None,
) -> ModelSpec:
    """A hybrid spec with 256-byte-per-token KV and a 4 KiB (or 64 B) snapshot; with
    ``window``, also a sliding-window group reading that many tokens."""
    attn: tuple[AttentionGroupSpec, ...] = (
        AttentionGroupSpec("attn", "full", num_layers=2, num_kv_heads=1, head_dim=32, dtype="float16"),
    )
    if window is not None:
        attn += (AttentionGroupSpec(
            "swa", "sliding", num_layers=2, num_kv_heads=1, head_dim=32, dtype="float16", window=window,
        ),)
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
    """Run bookkeeping agrees with a per-unit recount; the value queue's top is the lowest
    priority of any evictable unit (the tail of a run is its minimum). Reads the index
    without making handles, so the check does not change what it checks."""
    index = m.index
    used = {d for req in m.requests.values() for d in req.hasher.digests[: req.units]}
    ppb = max(m.layout.pages_per_block, 1)
    registered = [0] * m.layout.num_blocks
    held_blocks: set[int] = set()
    runs = list(index.heads.values())
    units = {d: (run, pos) for run in runs for pos, d in enumerate(run.digests)}
    assert len(units) == sum(len(r) for r in runs), "a unit in two runs"
    free = []
    for head, run in index.heads.items():
        assert len(run) > 0 and run.digests[0] == head
        assert all(len(p) == len(run) for p in run.pages)
        assert run.held == max(run.holds, default=0) <= len(run)
        assert max([*run.hits, *run.rel], default=0) <= len(run)
        for pos, d in enumerate(run.digests):
            node = index.handles.get(d)
            assert node is None or (node.run is run and node.depth == run.first + pos and node.tenant == run.tenant)
            ref = run.ref(pos)
            assert (ref > 0) == (d in used), "held iff a live request uses it"
            for p in run.unit_pages(pos):
                registered[p // ppb] += 1
                if ref:
                    held_blocks.add(p // ppb)
            if ref == 0 and m.config.eviction == "value":
                if run.qseq and index._stranded_tail(run):
                    # A stranded tail is ranked at the clock as it was when queued; the
                    # clock can move past it (a slot allocation takes victims only from
                    # unpinned slabs, not the global lowest), and then above units before
                    # it, which the run queue ranks only once the tail is gone: the queue
                    # offers the tail at its queued rank.
                    if pos == len(run) - 1:
                        free.append(run.qprio)
                else:
                    free.append(index.kv_q.unit_priority(run, pos))
    for cache in index.sliding:  # sliding pages count as registered; held ones pin
        for e in cache.entries.values():
            for p in e.pages:
                registered[p // ppb] += 1
                if e.ref:
                    held_blocks.add(p // ppb)
    for d, node in index.handles.items():
        assert node.digest == d and (d in units or node.snap >= 0), "empty handle kept"
        assert (node.run is None) == (d not in units) == (d in index.bare)
    assert set(index.bare) <= set(index.handles)
    assert index._registered == registered, "registered pages per block"
    assert index._held_runs == {r for r in runs if r.held}, "held runs"
    # A slab is a slot allocation's KV target iff every page in it is cached and unheld.
    arena = m.arena
    for b in range(m.layout.num_blocks):
        if arena.block_kind(b) == KV and m.layout.pages_per_block > 1:
            want = registered[b] == arena.used_per_block[b] and b not in held_blocks
            assert index._in_unpinned_slab((b * ppb,)) == want, f"slab {b}"
    if m.config.eviction == "value":
        top = index.kv_q.peek()
        assert (top is None) == (not free)
        if free:
            assert top[0] == min(free) and top[1].kv_ref == 0
