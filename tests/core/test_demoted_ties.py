"""A demoted snapshot ties with stranded KV at the queues' floor, and KV wins the tie.

``PrefixIndex.demote_snapshot`` ranks a snapshot at the floor, where stranded KV (past the
last snapshot on its path) ranks as well, and the victim chooser gives ties to KV. Where the
KV is all stranded, a page allocation never evicts the demoted spare checkpoints: under a
fixed setting that saves a state only for a boundary seen twice (``min_seen=2``) with
``spare-interval``, the spares the first requests left in free room hold most of the arena
for good (documents, seed 18, 1 GiB: 17 of 24 blocks to the end of the trace, hit rate 0.250
against 0.443 without the spares). The live adaptive cache did not reach it on the cells
checked: its ``seen-twice`` settings are adopted once the free room is gone, and the
starting setting's save points evict spares through slot allocations.

Giving demoted snapshots the tie fixes that configuration, and was measured on the
generated sweeps (docs/results.md, "A floor under the z test", tried and not kept): 37 -> 45
of 400 cells behind the best other policy, mean hit rate -0.0002, and three tests'
measured figures moved. The test below shows the defect and is a strict expected failure
until a fix is kept.
"""

from __future__ import annotations

import pytest

from hybridcache.invariants import check_manager
from hybridcache.manager import CacheConfig, HybridCacheManager
from tests.core.conftest import tiny_spec
from tests.core.test_suffix_starts import U, doc, question, serve

BLOCK = HybridCacheManager(tiny_spec(), 1 << 22, CacheConfig(hash_unit=U)).layout.block_bytes


def _documents(spares: bool, blocks: int = 16) -> tuple[HybridCacheManager, list[int]]:
    """One long document whose spare checkpoints fill the free room, then six documents
    asked four times each, round-robin (a state is saved at a branch only once it was
    wanted twice, so the fourth round is the first to hit); the hit tokens of each round."""
    rules = "last-token+branch-point" + ("+spare-interval:16" if spares else "")
    m = HybridCacheManager(tiny_spec(), blocks * BLOCK, CacheConfig(hash_unit=U, admission=rules, min_seen=2))
    serve(m, "long", doc(99, 160) + question(99, 0))
    hits = [0] * 4
    for r in range(4):
        for i in range(6):
            hits[r] += serve(m, f"{i}.{r}", doc(i) + question(i, r)).hit_tokens
    check_manager(m)
    return m, hits


@pytest.mark.xfail(strict=True, reason="KV wins a tie with a demoted snapshot (module docstring)")
def test_demoted_spares_leave_before_stranded_kv():
    """16 blocks: with the spares, the documents hit as they do without them (240 tokens in
    the fourth round), the long document's ten spares evicted for their KV. With KV
    winning the tie (as now), the spares stay (9 slots held to the end) and the documents
    never hit."""
    plain, plain_hits = _documents(spares=False)
    m, hits = _documents(spares=True)
    assert plain_hits[-1] > 0 and hits == plain_hits, (hits, plain_hits)
    assert m.index.evictions["state"] >= 10 and m.index.evictions["kv"] == plain.index.evictions["kv"]
