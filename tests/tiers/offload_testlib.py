"""Helpers for the offload coordinator tests: a manager over real arena bytes whose every
KV page and snapshot holds a pattern derived from its unit digest, so a restored byte that
came from the wrong unit, tenant, group or slot cannot go unnoticed."""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from hybridcache.kernels.storage import ArenaStorage
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.spec import (
    AttentionGroupSpec,
    FlopModel,
    ModelSpec,
    StateGroupSpec,
    StateTensorSpec,
)
from hybridcache.tiers.offload import OffloadCoordinator

U = 4  # tokens per hash unit


def hybrid_spec(*, state: bool = True, attention: bool = True) -> ModelSpec:
    """Two attention groups of different page payloads (full fp16, MLA bf16) and a KDA-like
    state of two tensors (fp32 recurrent, bf16 conv)."""
    attn = (
        AttentionGroupSpec(
            "full", "full", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16"
        ),
        AttentionGroupSpec(
            "mla", "mla", num_layers=1, num_kv_heads=1, head_dim=24, dtype="bfloat16"
        ),
    )
    st = (
        StateGroupSpec(
            "kda",
            "kda",
            num_layers=2,
            tensors=(
                StateTensorSpec("recurrent", (2, 8, 8), "float32"),
                StateTensorSpec("conv", (8, 3), "bfloat16"),
            ),
        ),
    )
    return ModelSpec(
        name="offload-test",
        attention_groups=attn if attention else (),
        state_groups=st if state else (),
        flops=FlopModel(hidden_size=64, num_attention_layers=3, num_recurrent_layers=2),
        max_model_len=4096,
    )


def make_engine(
    *,
    capacity: int = 1 << 20,
    admission: str = "interval:8+turn-end",
    spec: ModelSpec | None = None,
) -> tuple[HybridCacheManager, ArenaStorage]:
    spec = spec or hybrid_spec()
    m = HybridCacheManager(spec, capacity, CacheConfig(hash_unit=U, admission=admission))
    return m, ArenaStorage(m.layout, spec)


def pattern(seed: bytes, n: int) -> torch.Tensor:
    rng = np.random.default_rng(xxhash.xxh64_intdigest(seed))
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


def kv_pattern(m: HybridCacheManager, digest: bytes, group: int) -> torch.Tensor:
    return pattern(b"kv" + bytes([group]) + digest, m.layout.page_payload[m.groups[group]])


def snap_span(m: HybridCacheManager) -> int:
    return max((p.offset + p.nbytes for p in m.layout.placements), default=0)


def snap_pattern(m: HybridCacheManager, digest: bytes) -> torch.Tensor:
    return pattern(b"snap" + digest, snap_span(m))


def serve(
    m: HybridCacheManager,
    st: ArenaStorage,
    rid: str,
    tokens: list[int],
    *,
    tenant: str | None = None,
    output: tuple[int, ...] = (),
    coordinator: OffloadCoordinator | None = None,
):
    """One whole request as an engine would run it: (prefetch), one step computing every
    token past the hit, pages and save points filled with their digest patterns, commit,
    free. Returns ``(hit tokens, load plan or None)``."""
    m.add_request(rid, tokens, tenant=tenant)
    plan = coordinator.prefetch(rid) if coordinator is not None else None
    hit = m.match(rid).hit_tokens
    a = m.allocate(rid, len(tokens) - hit + len(output))
    if output:
        m.append_tokens(rid, list(output))
    digests = m.requests[rid].hasher.digests
    for g, name in enumerate(m.groups):
        for i, page in enumerate(a.block_table[name]):
            if i >= hit // U and i < len(digests):
                st.page_bytes_view(page)[: m.layout.page_payload[name]].copy_(
                    kv_pattern(m, digests[i], g)
                )
    for sp in a.save_points:
        st.slot_bytes_view(sp.slot)[: snap_span(m)].copy_(
            snap_pattern(m, digests[sp.boundary // U - 1])
        )
    m.commit(rid, len(tokens) + len(output))
    m.free(rid, finished=True)
    return hit, plan


def digests_of(m: HybridCacheManager, tokens: list[int], tenant: str | None = None) -> list[bytes]:
    m.add_request("__probe__", tokens, tenant=tenant)
    out = list(m.requests["__probe__"].hasher.digests)
    m.free("__probe__", finished=False)
    return out


def assert_device_holds(
    m: HybridCacheManager, st: ArenaStorage, digests: list[bytes], units: int
) -> None:
    """Units ``[0, units)`` are cached on the device with their patterns, and the snapshot
    at ``units`` too (the hit a match would use)."""
    for i in range(units):
        node = m.index.nodes[digests[i]]
        assert node.pages is not None, f"unit {i} has no KV"
        for g, name in enumerate(m.groups):
            got = st.page_bytes_view(node.pages[g])[: m.layout.page_payload[name]]
            assert torch.equal(got, kv_pattern(m, digests[i], g)), f"unit {i} group {name}"
    if m.has_state and units:
        node = m.index.nodes[digests[units - 1]]
        assert node.snap >= 0, f"no snapshot at unit {units}"
        got = st.slot_bytes_view(node.snap)[: snap_span(m)]
        assert torch.equal(got, snap_pattern(m, digests[units - 1])), f"snapshot at {units}"


def check_arena(m: HybridCacheManager) -> None:
    """Free every request and the cache: the arena must be empty again (nothing leaked)."""
    for rid in list(m.requests):
        m.free(rid, finished=False)
    m.clear()
    s = m.arena.stats()
    assert s.used_bytes == 0, s
    assert not m.index.nodes
