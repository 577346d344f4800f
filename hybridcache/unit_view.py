"""A read-only ``digest -> UnitHandle`` view over every cached unit, for inspection and tests.

Kept apart from :mod:`hybridcache.index`: hot paths never use it (looking up a unit that
does not start a run scans the runs).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from hybridcache.index import PrefixIndex, UnitHandle
    from hybridcache.runs import Run

Digest = bytes


class UnitView(Mapping[Digest, "UnitHandle"]):
    """Read-only ``digest -> UnitHandle`` over every cached unit (with KV, a snapshot or both).

    For inspection and tests: the index maps only runs' first units, so looking up any
    other unit scans the runs, and a KV unit looked up gets its handle (kept, so the same
    unit always gives the same node). Hot paths use :meth:`PrefixIndex.kv_path` and
    :attr:`PrefixIndex.handles`.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def _find(self, digest: object) -> tuple[Run, int] | None:
        for run in self._index.heads.values():
            if digest in run.digests:
                return run, run.digests.index(digest)  # type: ignore[arg-type]
        return None

    def __getitem__(self, digest: Digest) -> UnitHandle:
        index = self._index
        node = index.handles.get(digest)
        if node is not None:
            return node
        found = self._find(digest)
        if found is None:
            raise KeyError(digest)
        return index.handle(*found)

    def __contains__(self, digest: object) -> bool:
        return digest in self._index.handles or self._find(digest) is not None

    def __iter__(self) -> Iterator[Digest]:
        index = self._index
        for run in index.heads.values():
            yield from run.digests
        yield from index.bare

    def __len__(self) -> int:
        index = self._index
        return sum(len(run) for run in index.heads.values()) + len(index.bare)
