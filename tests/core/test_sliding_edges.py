"""The sliding-window group's edges: tenant quotas, the FLOP model, the counters."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridcache.errors import SpecError
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.spec import AttentionGroupSpec, FlopModel, ModelSpec
from tests.core.conftest import tiny_spec

U = 4


def _manager(window: int, state: bool = False, quotas: dict[str, int] | None = None,
             admission: str = "last-token") -> HybridCacheManager:
    spec = tiny_spec(state=state, window=window, max_len=1 << 16)
    cfg = CacheConfig(hash_unit=U, admission=admission, tenant_quotas=quotas)
    return HybridCacheManager(spec, 1 << 22, cfg)


def _page_bytes(window: int = 9) -> int:
    return _manager(window).layout.page_bytes  # one page per group per unit


def _serve(m: HybridCacheManager, rid: str, tokens: list[int], tenant: str | None = None) -> int:
    hit = m.add_request(rid, tokens, tenant=tenant).hit_tokens
    m.allocate(rid, len(tokens) - hit)
    m.commit(rid, len(tokens))
    m.free(rid)
    return hit


def _cached_bytes(m: HybridCacheManager) -> int:
    """Every cached entry's bytes, recounted from the structures (one tenant in use)."""
    index, page = m.index, m.layout.page_bytes
    full = sum(len(run.digests) for run in index.heads.values()) * index.kv_groups * page
    slide = sum(len(c.entries) * c.groups for c in index.sliding) * page
    snaps = sum(1 for n in index.handles.values() if n.snap >= 0) * index.snap_bytes
    return full + slide + snaps


# ---------------------------------------------------------------------- quotas
def test_sliding_pages_count_against_the_tenant_quota():
    """A tenant's quota covers its sliding pages too: with room for 15 pages, 10 units of
    full KV and 5 of sliding pages are cached, not 10 + 10; the hit then ends where the
    cached window does (units 3, 4 before end 5)."""
    page = _page_bytes()
    m = _manager(9, quotas={"t": 15 * page})
    tokens = list(range(41))
    assert _serve(m, "a", tokens, "t") == 0
    assert _cached_bytes(m) == m.index.tenant_bytes["t"] == 15 * page
    assert m.stats()["sliding_quota_rejections"] == 5
    m.check_invariants()
    assert _serve(m, "b", tokens + [7], "t") == 5 * U  # the window of end 5 is cached
    _serve(m, "c", tokens)  # another tenant (chains salted apart), without a quota
    assert _serve(m, "d", tokens + [7]) == 10 * U
    m.check_invariants()


def test_evicting_sliding_pages_gives_the_tenant_its_room_back():
    page = _page_bytes()
    m = _manager(9, quotas={"t": 15 * page})
    _serve(m, "a", list(range(41)), "t")
    cache = m.coordinator.caches[0]
    cache.evict_oldest()
    assert m.index.tenant_bytes["t"] == 14 * page
    m.check_invariants()
    m.clear()
    assert "t" not in m.index.tenant_bytes  # a tenant with nothing cached is dropped
    _serve(m, "b", list(range(500, 541)), "t")
    assert m.index.tenant_bytes["t"] == 15 * page
    m.check_invariants()


def test_quota_with_state_and_a_wildcard():
    """With state (units left behind are cached unheld, or freed) and the ``*`` quota."""
    page = _page_bytes()
    quota = 20 * page + 2 * _manager(9, state=True).layout.slot_bytes
    m = _manager(9, state=True, quotas={"*": quota}, admission="interval:16+last-token")
    for k in range(3):
        _serve(m, f"r{k}", list(range(1000 * k, 1000 * k + 61)), f"tenant{k % 2}")
        for t, b in m.index.tenant_bytes.items():
            assert b <= quota, t
        m.check_invariants()


# ---------------------------------------------------------------------- FLOPs
def _flops(window: int | None, n_slide: int = 2, n_attn: int = 4) -> FlopModel:
    slide = ((window, n_slide),) if window is not None else ()
    return FlopModel(hidden_size=64, num_attention_layers=n_attn, num_recurrent_layers=1,
                     sliding_layers=slide)


@pytest.mark.parametrize("start,end,window", [
    (0, 100, 128), (0, 200, 128), (100, 300, 128), (150, 400, 128), (0, 17, 1), (5, 9, 8),
])
def test_a_sliding_layer_reads_min_p_window_keys(start, end, window):
    """Against full attention, each sliding layer saves ``8 D (p - w)`` per token at
    ``p > w``: ``4 D [(max(e, w) - w)^2 - (max(s, w) - w)^2]`` over ``[s, e)``."""
    full, slide = _flops(None), _flops(window)
    saved = 2 * 4.0 * 64 * ((max(end, window) - window) ** 2 - (max(start, window) - window) ** 2)
    assert full.prefill_flops(start, end) - slide.prefill_flops(start, end) == pytest.approx(saved, rel=1e-12)


def test_past_the_window_a_token_costs_the_same_at_any_depth():
    f = FlopModel(hidden_size=64, num_attention_layers=2, num_recurrent_layers=0,
                  sliding_layers=((32, 2),))
    step = f.prefill_flops(64, 65)
    assert f.prefill_flops(1000, 1001) == pytest.approx(step, rel=1e-12)
    assert f.prefill_flops(16, 17) < step  # below the window it still grows


def test_model_spec_prices_its_sliding_groups_and_leaves_others_alone():
    groups = (
        AttentionGroupSpec("full", "full", num_layers=3, num_kv_heads=1, head_dim=8),
        AttentionGroupSpec("swa", "sliding", num_layers=5, num_kv_heads=1, head_dim=8, window=64),
    )
    base = FlopModel(hidden_size=32, num_attention_layers=8, num_recurrent_layers=0)
    spec = ModelSpec("m", groups, (), base)
    assert spec.flops.sliding_layers == ((64, 5),)
    assert spec.flops.prefill_flops(0, 1000) < base.prefill_flops(0, 1000)
    plain = ModelSpec("p", groups[:1], (), FlopModel(32, 3, 0))
    assert plain.flops == FlopModel(32, 3, 0) and plain.flops.sliding_layers == ()
    # Explicit sliding layers are kept; more than the attention layers is refused.
    explicit = ModelSpec("e", groups, (), FlopModel(32, 8, 0, sliding_layers=((64, 2),)))
    assert explicit.flops.sliding_layers == ((64, 2),)
    with pytest.raises(SpecError, match="sliding_layers"):
        FlopModel(32, 3, 0, sliding_layers=((64, 4),))


def test_fingerprint_of_a_model_without_sliding_layers_is_unchanged():
    """Tier keys carry the fingerprint: entries written before ``sliding_layers`` existed
    must stay readable (the digest of kimi-linear-48b's layout as it was before)."""
    from hybridcache.presets import get_preset

    assert get_preset("kimi-linear-48b").fingerprint() == "78df44db694709b3"


# ---------------------------------------------------------------------- counters
def test_sliding_counters():
    m = _manager(9)
    tokens = list(range(41))
    m.add_request("a", tokens)
    done = 0
    while done < 41:
        m.allocate("a", min(8, 41 - done))
        done = min(done + 8, 41)
        m.commit("a", done)
    s = m.stats()
    # Stateless: every registered unit stays cached; the request holds its window only.
    assert s["sliding_pages_cached"] == 10
    assert s["sliding_pages_held"] == 2  # units 8, 9: the window of token 41
    assert s["sliding_pages_released_by_window"] == 8
    m.free("a")
    assert m.stats()["sliding_pages_held"] == 0
    cache = m.coordinator.caches[0]
    m.add_request("p", tokens + [1])
    digests = m.requests["p"].hasher.digests
    m.free("p")
    cache.evict(cache.entries[digests[8]])
    assert _serve(m, "b", tokens + [1]) == 8 * U  # end 10 lacks unit 8: 2 units lost
    s = m.stats()
    assert s["sliding_evictions"] == 1
    assert (s["window_limited_requests"], s["window_limited_tokens"]) == (1, 2 * U)
    assert s["kv_hit_state_miss_tokens"] >= s["window_limited_tokens"]
    text = m.coordinator.metrics().prometheus()
    assert "hybridcache_sliding_pages_cached 10" in text
    assert "hybridcache_window_limited_tokens_total 8" in text


def test_models_without_sliding_windows_report_no_sliding_counters():
    spec = tiny_spec(state=True)
    m = HybridCacheManager(spec, 1 << 22, CacheConfig(hash_unit=U))
    _serve(m, "a", list(range(41)))
    assert not [k for k in m.stats() if "sliding" in k or "window" in k]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    state=st.booleans(),
    quota_pages=st.integers(0, 30),
    reqs=st.lists(st.tuples(st.sampled_from(["a", "b", None]), st.integers(0, 3), st.integers(1, 40)),
                  min_size=1, max_size=12),
)
def test_no_tenant_ever_holds_more_than_its_quota(state, quota_pages, reqs):
    """Random conversations of quota'd tenants (``a``, ``b``) and an unlimited one: every
    tenant's cached bytes (full KV, snapshots, sliding pages) stay within its quota, and the
    index's per-tenant count equals the recount (``check_invariants``)."""
    page = _page_bytes()
    quota = quota_pages * page
    m = _manager(9, state=state, quotas={"a": quota, "b": quota}, admission="interval:8+turn-end")
    for k, (tenant, family, extra) in enumerate(reqs):
        tokens = list(range(family * 1000, family * 1000 + 20)) + list(range(5000 + k, 5000 + k + extra))
        _serve(m, f"r{k}", tokens, tenant)
        for t in ("a", "b"):
            assert m.index.tenant_bytes.get(t, 0) <= quota, t
        m.check_invariants()
