"""What a commit registers: a request's computed full units become cached KV, its saved
states cached snapshots (with quotas, duplicates and the marginal value of each snapshot).

Kept apart from :mod:`hybridcache.manager`, which decides *when* (commit, free); this
module is *what* a registration does to the index. It reads the manager's parts (index,
arena, metrics, config: the adaptive manager swaps the config) through the manager.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import UnitHandle
    from hybridcache.manager import HybridCacheManager
    from hybridcache.requests import Request


class CommitRegistrar:
    """Registers a manager's committed units and snapshots (module docstring)."""

    def __init__(self, manager: HybridCacheManager) -> None:
        self._m = manager

    def register_units(self, req: Request, full_units: int) -> None:
        m = self._m
        index, digests, quota = m.index, req.hasher.digests, self.quota(req.tenant)
        data, ub = req.hasher.token_bytes, m.unit * 4  # kept with the KV (hybridcache.runs)
        registered, i = 0, req.units
        while i < full_units:
            if index.has_kv_at(digests, i, req.held_run(i - 1) if i else None):
                # Cached already (past a snapshot-limited hit, or computed meanwhile by
                # another request): keep our private pages, hold the cached ones.
                j, path = index.kv_path(digests, full_units)  # exact: walked from unit 0
                dups = [(run, end) for run, end in path if run.first + end > i]
                index.hold_runs(dups)
                req.holds += dups
                req.dup_pages.extend(range(i, j))
                i = req.units = j
                continue
            end = full_units
            if quota is not None:
                room = (quota - index.tenant_bytes.get(req.tenant, 0)) // index.node_kv_bytes
                if room <= 0:
                    m.metrics.quota_rejections += 1
                    break
                end = min(end, i + room)
            # Depth-independent value: a prefix's head must never rank below its tail,
            # or value eviction drops heads first and strands unreachable tails.
            last = req.holds[-1] if req.holds else None
            tokens = data[i * ub : end * ub] if data is not None else None
            got = index.register_kv_run(digests, i, end, req.tenant, req.pages, m._unit_flops, last, tokens)
            assert got is not None, "unit without KV registered by no one"
            hold, n = got
            if last is not None and hold[0] is last[0]:
                req.holds[-1] = hold  # the new units extended the run we held
            else:
                req.holds.append(hold)
            i = req.units = i + n
            registered += n * len(req.pages)
        m.metrics.kv_pages_registered += registered

    def register_snapshot(self, req: Request, boundary: int, slot: int, *,
                          past: int = 0) -> UnitHandle | None:
        """Cache ``slot`` as the state at ``boundary``, valued by what it saves over the
        deepest snapshot below it on ``req``'s path, or below ``past`` when that snapshot is
        about to be ranked first (:meth:`register_turn_end`).

        Returns:
            The handle whose state is cached at ``boundary`` now (this slot's, or an equal
            one another request cached first), or ``None`` where none is.
        """
        m = self._m
        index, u = m.index, boundary // m.unit - 1
        if u >= req.units:  # not registered by this request: no KV it holds
            m.arena.free_slot(slot)
            return None
        node = index.handles.get(req.hasher.digests[u])
        if node is not None and node.snap >= 0:
            m.arena.free_slot(slot)  # duplicate: the cached one stays
            return node
        run = node.run if node is not None else req.held_run(u)
        if run is None:
            m.arena.free_slot(slot)  # unregistered KV: drop
            return None
        quota = self.quota(req.tenant) if m.config.tenant_quotas else None
        if quota is not None and index.tenant_bytes.get(req.tenant, 0) + index.snap_bytes > quota:
            m.metrics.quota_rejections += 1
            m.arena.free_slot(slot)
            return None
        if node is None:
            node = index.handle(run, u - run.first)
        spares = req.spare  # spare boundaries, in increasing order (empty without the rule)
        i = bisect.bisect_left(spares, boundary) if spares else 0
        spare = i < len(spares) and spares[i] == boundary
        prev = base = req.last_snapshot_boundary(boundary, mark=not spare)
        if past:
            prev = req.last_snapshot_boundary(past, mark=False)
        if spare and i:  # valued from the spare below it: what it saves beyond its neighbours
            prev = max(prev, req.spare[i - 1])
        m.index.register_snapshot(node, slot, self._value(prev, boundary), m.tick)
        m.metrics.snapshots_saved += 1
        cohort = req.cohort  # hybridcache.superseded (written out: runs per snapshot)
        if cohort is None:
            cohort = req.cohort = [req.resumed_from]  # [resumed from, *digests]
        cohort.append(node.digest)
        node.snap_cohort = cohort
        if spare:  # the spare-interval rule's: first to evict (hybridcache.admission)
            node.snap_base = base  # what a request restoring it values its snapshots from
            m.index.demote_snapshot(node)
        return node

    def _value(self, base: int, boundary: int) -> float:
        """The prefill FLOPs a snapshot at ``boundary`` saves over one at ``base`` (capped at
        what its bytes would hold as KV): what value eviction ranks it by."""
        m = self._m
        return min(m.spec.flops.prefill_flops(base, boundary), m._snap_flops_cap)

    def register_turn_end(self, req: Request, turn_end: int, slot: int) -> None:
        """Cache a finished request's turn-end state; rank its unused prompt-end one last.

        The next turn resumes from the turn end, so the prompt-end state only serves a
        repeat of the same prompt: it stays cached while memory is free (requests running
        concurrently with the same prompt need it) and goes first under pressure. Branch
        points (the prompt was a repeat already) keep their rank.

        The turn end is valued over the prompt end (the output's tokens) unless this is a
        session's turn (it extended the turn before: ``req.resumed_from``, the superseded
        rule's evidence) and the prompt end is to go first: then the turn end is what the
        next turn resumes from and saves the whole turn, so it is valued from below the
        prompt end. Valued at the output alone it went before states worth less and the
        next turn resumed from the session's tool prefix (docs/results.md, "Held-out
        workload shapes"). A request that extended nothing (a document's question) keeps
        the output's value: nothing says a next turn will come.
        """
        m = self._m
        prompt_end = self._prompt_end_to_demote(req, turn_end)
        past = 0
        if prompt_end is not None and req.resumed_from is not None:  # a session's turn
            past = (prompt_end.depth + 1) * m.unit  # the prompt end's boundary
        cached = self.register_snapshot(req, turn_end, slot, past=past)
        if prompt_end is not None and cached is not None:
            m.index.demote_snapshot(prompt_end)

    def _prompt_end_to_demote(self, req: Request, turn_end: int) -> UnitHandle | None:
        """The cached prompt-end state of ``req`` that its turn end makes last to keep, if
        any: one this request saved (not a hit), below the turn end, never restored."""
        m = self._m
        b = (req.prompt_len - 1) // m.unit * m.unit
        if not 0 < b < turn_end <= req.units * m.unit or req.kv_hit_tokens >= b:
            return None
        node = m.index.handles.get(req.hasher.digests[b // m.unit - 1])
        if node is None or node.snap < 0 or node.snap_hits or node.snap_ref:
            return None
        return node

    def quota(self, tenant: str | None) -> int | None:
        m = self._m
        q = m.config.tenant_quotas
        if not q:
            return None
        return q.get(tenant if tenant is not None else "", q.get("*"))
