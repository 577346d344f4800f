"""The offload coordinator over the engine port only: no internal module imported by
``hybridcache/tiers`` (AST scan, with the scan's own mutation test), no manager internals
touched, evictions learnt from the event stream with the victim's bytes copied at the
right moment, and other consumers of the stream left their events."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from hybridcache.events import REMOVED, STORED
from hybridcache.port import EnginePort
from hybridcache.tiers.host import HostTier
from hybridcache.tiers.offload import OffloadCoordinator
from hybridcache.tiers.offload_policy import DemotionPolicy
from tests.tiers.offload_testlib import digests_of, kv_pattern, make_engine, serve

TIERS = Path(__file__).resolve().parents[2] / "hybridcache" / "tiers"
INTERNAL = ("hybridcache.index", "hybridcache.runs", "hybridcache.arena", "hybridcache.eviction")
#: Manager internals the coordinator must not read or write (it has the port).
INTERNAL_ATTRS = {"index", "arena", "requests", "tick", "hasher", "on_evict", "_m"}
PROMPT = list(range(100, 140))  # 10 units


def internal_imports(source: str) -> list[str]:
    """Modules from ``INTERNAL`` (or below them) that ``source`` imports, wherever the
    import sits (``TYPE_CHECKING`` blocks and functions included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found += [n for n in names if any(n == m or n.startswith(m + ".") for m in INTERNAL)]
    return found


def internal_attributes(source: str) -> list[str]:
    return sorted({
        n.attr for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Attribute) and n.attr in INTERNAL_ATTRS
    })


def test_tiers_import_no_internal_module():
    files = sorted(TIERS.glob("**/*.py"))
    assert len(files) > 10
    bad = {f.name: internal_imports(f.read_text()) for f in files}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_import_scan_fails_when_an_internal_import_is_added():
    clean = (TIERS / "offload.py").read_text()
    assert internal_imports(clean) == []
    for added in (
        "from hybridcache.index import UnitHandle\n",
        "import hybridcache.runs as runs\n",
        "from hybridcache import arena\n",
        "if TYPE_CHECKING:\n    from hybridcache.eviction import Evictor\n",
        "def f():\n    from hybridcache.arena.sub import x\n",
    ):
        assert internal_imports(clean + "\n" + added), added


def test_the_coordinator_touches_no_manager_internals():
    for f in sorted(TIERS.glob("offload*.py")):
        assert internal_attributes(f.read_text()) == [], f.name
    assert internal_attributes("m.tick += 1\n") == ["tick"]
    assert internal_attributes("x = manager.index.handles\n") == ["index"]


def test_a_victim_is_copied_before_the_evicting_call_hands_its_pages_on():
    """B's allocate evicts A and gets A's pages, which B's step then overwrites: the tier
    must hold A's bytes (copied inside the call), not B's."""
    probe, _ = make_engine()
    m, st = make_engine(capacity=12 * probe.layout.block_bytes)
    host = HostTier(1 << 24)
    coord = OffloadCoordinator(m, st, [host], policy=DemotionPolicy(kv="all"))
    watch = EnginePort(m, record_events=False).subscribe()
    serve(m, st, "a", PROMPT, coordinator=coord)
    a_pages = {
        p for ev in watch.take() if ev.action == STORED and ev.kind == "kv"
        for unit in ev.locations for p in unit
    }
    other = list(range(2000, 2040))
    serve(m, st, "b", other, coordinator=coord)
    coord.flush()
    events = watch.take()
    b_pages = {
        p for ev in events if ev.action == STORED and ev.kind == "kv"
        for unit in ev.locations for p in unit
    }
    assert a_pages & b_pages, "the test needs B to reuse A's pages"
    removed = [ev for ev in events if ev.action == REMOVED and ev.kind == "kv"]
    assert removed and coord.metrics.demoted_kv == len(removed)
    da = digests_of(m, PROMPT)
    for ev in removed:
        i = da.index(ev.digests[0])
        entry = host.get(coord.keys.kv(None, ev.digests[0]))
        assert entry is not None
        for g, name in enumerate(m.groups):
            assert torch.equal(entry.pieces[f"kv.{name}"], kv_pattern(m, da[i], g)), i
    # The mutation a deferred copy would be: A's reused pages now hold B's bytes, so a
    # copy taken after the evicting call's step would not match A's pattern.
    reused = [(ev, g) for ev in removed for g, p in enumerate(ev.locations[0]) if p in b_pages]
    assert reused
    for ev, g in reused:
        now = st.page_bytes_view(ev.locations[0][g])[: m.layout.page_payload[m.groups[g]]]
        assert not torch.equal(now, kv_pattern(m, ev.digests[0], g))


def test_other_consumers_keep_their_events():
    m, st = make_engine()
    engine = EnginePort(m)  # the engine's default take_events queue
    queue = engine.subscribe()  # e.g. a KV-events publisher
    coord = OffloadCoordinator(m, st, [HostTier(1 << 24)])
    serve(m, st, "a", PROMPT, coordinator=coord)
    engine.clear()
    taken = engine.take_events()
    subscribed = queue.take()
    assert taken == subscribed and taken
    removed = [e for e in taken if e.action == REMOVED]
    assert len(removed) == 10 + 5  # ten KV units, five snapshots: the coordinator saw them
    assert coord.metrics.demoted_kv + coord.metrics.demote_skipped_policy >= 10
    assert engine.take_events() == [] and queue.take() == []
    queue.close()
    serve(m, st, "b", PROMPT + [5] * 4, coordinator=coord)
    assert queue.take() == [] and engine.take_events()


def test_close_detaches_from_the_event_stream_and_the_host_tier():
    m, st = make_engine()
    host = HostTier(1 << 24)
    coord = OffloadCoordinator(m, st, [host], policy=DemotionPolicy(kv="all"))
    serve(m, st, "a", PROMPT, coordinator=coord)
    coord.close()
    m.clear()
    assert coord.metrics.demoted_kv == 0 and coord.metrics.demoted_snapshots == 0
    assert not host.contains(coord.keys.kv(None, digests_of(m, PROMPT)[0]))
    assert host._evict_observers == []  # noqa: SLF001
    coord.close()  # idempotent
