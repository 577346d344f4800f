"""One byte budget for KV pages and state snapshots, carved from the same memory.

Layout. The budget is cut into equal *blocks*. A block is either free, a **KV slab** holding
``pages_per_block`` KV pages, or a **state block** holding ``slots_per_block`` state slots
(one snapshot or one running state each). A block changes kind whenever it empties, so the
KV/state split follows the workload: no fixed ratio (SGLang) and no inflation of the
attention block to the state size (vLLM's ``align`` mode).

Sizes are chosen so that both kinds tile a block exactly and every slot or page sits at a
uniform stride, which lets an engine view the whole arena as per-layer tensors
``[num_slots, *state_shape]`` and ``[num_pages, *page_shape]`` over one byte buffer
(:class:`ArenaLayout` gives the offsets):

- state at least one page (the usual case: a Kimi Linear snapshot is 41.4 MiB, a 16-token
  MLA page 126 KiB): a block is ``ceil(S / P)`` pages and holds one slot; waste < 1 page.
- state smaller than a page (small Mamba2 models): a block is one page and holds
  ``P // S`` slots; the remainder is padding (reported).

Allocation is O(1): a stack of free blocks, and per kind a stack of blocks with free
entries plus per-block free lists. New KV pages fill the most recently opened slab first,
so pages that live and die together (one request's prompt) share slabs, and a slab empties
(and can become a state block) without evicting unrelated pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.errors import CapacityError
from hybridcache.spec import ModelSpec, dtype_bytes

FREE, KV, STATE = 0, 1, 2


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorPlacement:
    """Where one state tensor of one layer sits inside a slot (byte offset, shape, dtype)."""

    group: str
    layer: int
    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class ArenaLayout:
    """Byte geometry of an arena for one model and hash unit.

    Attributes:
        page_bytes: stride of one KV page (one hash unit of tokens of one attention group,
            padded to the largest group and to ``alignment``).
        page_payload: KV bytes per page of each attention group, by group name.
        slot_bytes: stride of one state slot (one snapshot, aligned).
        snapshot_bytes: unpadded bytes of one snapshot.
        block_bytes: bytes of one block.
        pages_per_block / slots_per_block: entries a block holds as a KV slab / state block.
        num_blocks: blocks in the budget.
        placements: offset of each state tensor of each layer inside a slot.
    """

    page_bytes: int
    page_payload: dict[str, int]
    slot_bytes: int
    snapshot_bytes: int
    block_bytes: int
    pages_per_block: int
    slots_per_block: int
    num_blocks: int
    placements: tuple[TensorPlacement, ...]

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_pages(self) -> int:
        return self.num_blocks * self.pages_per_block

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.slots_per_block

    def page_offset(self, page: int) -> int:
        """Byte offset of KV page ``page`` in the arena buffer."""
        return page // self.pages_per_block * self.block_bytes + page % self.pages_per_block * self.page_bytes

    def slot_offset(self, slot: int) -> int:
        """Byte offset of state slot ``slot`` in the arena buffer."""
        return slot // self.slots_per_block * self.block_bytes + slot % self.slots_per_block * self.slot_bytes


def plan_layout(
    spec: ModelSpec, capacity_bytes: int, hash_unit: int, alignment: int = 256
) -> ArenaLayout:
    """Compute the arena geometry for ``spec`` within ``capacity_bytes``.

    Raises:
        CapacityError: the budget cannot hold one block (one snapshot, or one page for a
            model without state), with the number of bytes needed.
    """
    placements: list[TensorPlacement] = []
    off = 0
    for g in spec.state_groups:
        for layer in range(g.num_layers):
            for t in g.tensors:
                a = max(alignment, dtype_bytes(t.dtype))
                off = _align(off, a)
                placements.append(
                    TensorPlacement(g.name, layer, t.name, off, t.shape, t.dtype, t.nbytes)
                )
                off += t.nbytes
    snapshot = spec.snapshot_bytes
    slot_bytes = _align(off, alignment) if off else 0
    payload = {g.name: hash_unit * g.bytes_per_token for g in spec.attention_groups}
    page_bytes = _align(max(payload.values()), alignment) if payload else 0

    if slot_bytes and page_bytes:
        if slot_bytes >= page_bytes:
            ppb = -(-slot_bytes // page_bytes)
            block, spb = ppb * page_bytes, 1
            slot_bytes = block  # one slot per block: the stride is the block
        else:
            block, ppb, spb = page_bytes, 1, page_bytes // slot_bytes
    elif slot_bytes:  # pure state model (Mamba2): blocks are single slots
        block, ppb, spb = slot_bytes, 0, 1
    else:  # pure attention model: slabs of 64 pages
        block, ppb, spb = 64 * page_bytes, 64, 0
    if capacity_bytes < block:
        what = "one state snapshot" if slot_bytes else "one slab of KV pages"
        raise CapacityError(
            f"capacity {capacity_bytes} B cannot hold {what} of {spec.name!r}: "
            f"needs at least {block} B"
        )
    return ArenaLayout(
        page_bytes=page_bytes,
        page_payload=payload,
        slot_bytes=slot_bytes,
        snapshot_bytes=snapshot,
        block_bytes=block,
        pages_per_block=ppb,
        slots_per_block=spb,
        num_blocks=capacity_bytes // block,
        placements=tuple(placements),
    )


@dataclass(frozen=True)
class ArenaStats:
    """Occupancy of the arena, in bytes unless named otherwise."""

    capacity_bytes: int
    used_bytes: int
    kv_bytes: int
    state_bytes: int
    kv_blocks: int
    state_blocks: int
    free_blocks: int
    padding_bytes: int
    fragmentation_bytes: int

    @property
    def utilisation(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


class Arena:
    """Allocator of KV pages and state slots over the blocks of an :class:`ArenaLayout`.

    Page ids run over ``[0, num_pages)`` and slot ids over ``[0, num_slots)``; the id encodes
    its block (``id // per_block``), so freeing is O(1). The arena only does bookkeeping;
    what a page or slot holds is the manager's business.
    """

    def __init__(self, layout: ArenaLayout) -> None:
        self.layout = layout
        n = layout.num_blocks
        self._kind = [FREE] * n
        # Entries in use per block; read by the index's per-page hot loops (a list index,
        # not a call), written only here.
        self.used_per_block = [0] * n
        self._free_blocks = list(range(n - 1, -1, -1))  # stack: block 0 first
        # Free entries of a block in use: the freed ones (taken last-in first) and, from
        # ``_fresh[b]`` to the block's end, the never-used ones (taken lowest first, without
        # a list of them: opening a 337-page slab made 300 integers per request otherwise).
        self._entry_free: list[list[int]] = [[] for _ in range(n)]
        self._fresh = [0] * n
        self._open = {KV: [], STATE: []}  # blocks of that kind with a free entry
        self._is_open = [False] * n
        self.pages_in_use = 0
        self.slots_in_use = 0
        # One flag per entry: catches double frees inside a block that is still in use.
        self._live = {KV: bytearray(layout.num_pages), STATE: bytearray(layout.num_slots)}
        # One slot per block (state at least a page, the usual hybrid): a slot is a whole
        # block, taken from and given back to the free stack (three calls per request).
        self._one_slot = layout.slots_per_block == 1

    # ------------------------------------------------------------------ allocation
    def alloc_page(self) -> int | None:
        """A free KV page id, or ``None`` when no page and no free block is left."""
        got = self.alloc_pages(1)
        return got[0] if got else None

    def alloc_pages(self, n: int) -> list[int]:
        """Up to ``n`` free KV page ids (fewer when the arena runs out), in the order that
        ``n`` calls of :meth:`alloc_page` would return them.

        A prefill step allocates tens of pages at once: taking them a slab at a time is
        one list slice per slab instead of one call per page.
        """
        out = self._take(KV, self.layout.pages_per_block, n)
        self.pages_in_use += len(out)
        return out

    def alloc_slot(self) -> int | None:
        """A free state slot id, or ``None`` when no slot and no free block is left."""
        if self._one_slot and not self._open[STATE]:  # what _take does for one whole block
            free = self._free_blocks
            if not free:
                return None
            b = free.pop()
            self._kind[b] = STATE
            self._live[STATE][b] = 1
            self._fresh[b] = b + 1
            self.used_per_block[b] = 1
            self.slots_in_use += 1
            return b
        got = self._take(STATE, self.layout.slots_per_block, 1)
        if not got:
            return None
        self.slots_in_use += 1
        return got[0]

    def free_page(self, page: int) -> None:
        """Return ``page``; its slab becomes a free block once it is empty."""
        self._free(KV, page, self.layout.pages_per_block)
        self.pages_in_use -= 1

    def free_slot(self, slot: int) -> None:
        """Return ``slot``; its block becomes free once it is empty."""
        if self._one_slot:  # what _free does when the slot is its block's only entry
            live = self._live[STATE]
            if self._kind[slot] != STATE or not live[slot]:
                raise ValueError(f"entry {slot} is not allocated as state")
            live[slot] = 0
            self.used_per_block[slot] = 0
            self._kind[slot] = FREE
            self._entry_free[slot] = []
            self._free_blocks.append(slot)
            self.slots_in_use -= 1
            return
        self._free(STATE, slot, self.layout.slots_per_block)
        self.slots_in_use -= 1

    def free_pages(self, pages: list[int]) -> None:
        """Return ``pages``, in order: what :meth:`free_page` on each does (the same free
        lists, in the same order), in one call (eviction frees a run's tail at once)."""
        ppb, live, used = self.layout.pages_per_block, self._live[KV], self.used_per_block
        kinds, entry_free, is_open = self._kind, self._entry_free, self._is_open
        for page in pages:  # checked first: a refused call frees nothing
            if not 0 <= page < len(live) or kinds[page // ppb] != KV or not live[page]:
                raise ValueError(f"entry {page} is not allocated as KV")
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages freed twice in one call: {pages}")
        self.pages_in_use -= len(pages)
        for page in pages:
            b = page // ppb
            live[page] = 0
            left = used[b] - 1
            used[b] = left
            if not left:
                kinds[b] = FREE
                entry_free[b] = []
                self._free_blocks.append(b)
                continue
            entry_free[b].append(page)
            if not is_open[b]:
                self._open[KV].append(b)
                is_open[b] = True

    def _take(self, kind: int, per_block: int, n: int) -> list[int]:
        """Up to ``n`` free entries of ``kind``, marked live: from the most recently opened
        block of that kind first, then from fresh blocks (lowest entry first)."""
        out: list[int] = []
        open_blocks = self._open[kind]
        if per_block == 0 or n <= 0 or not (open_blocks or self._free_blocks):
            return out  # a full arena answers here: eviction loops ask it after every victim
        live, used, kinds, entry_free = self._live[kind], self.used_per_block, self._kind, self._entry_free
        while len(out) < n:
            want = n - len(out)
            if open_blocks:
                b = open_blocks[-1]
                free = entry_free[b]
                fresh, end = self._fresh[b], (b + 1) * per_block
                if kinds[b] != kind or (not free and fresh >= end):
                    open_blocks.pop()  # stale entry (block was released)
                    self._is_open[b] = False
                    continue
                take = free[: -want - 1 : -1] if want < len(free) else free[::-1]
                del free[len(free) - len(take) :]
                for e in take:
                    live[e] = 1
                out += take
                k = min(want - len(take), end - fresh)
                if k > 0:
                    out += range(fresh, fresh + k)
                    live[fresh : fresh + k] = b"\x01" * k
                    self._fresh[b] = fresh = fresh + k
                used[b] += len(take) + max(k, 0)
                if not free and fresh >= end:
                    open_blocks.pop()
                    self._is_open[b] = False
            elif self._free_blocks:
                b = self._free_blocks.pop()
                kinds[b] = kind
                base = b * per_block
                k = min(want, per_block)
                out += range(base, base + k)
                live[base : base + k] = b"\x01" * k
                self._fresh[b] = base + k
                used[b] = k
                if k < per_block:
                    open_blocks.append(b)
                    self._is_open[b] = True
            else:
                break
        return out

    def _free(self, kind: int, entry: int, per_block: int) -> None:
        b = entry // per_block
        live = self._live[kind]
        if self._kind[b] != kind or not live[entry]:
            raise ValueError(f"entry {entry} is not allocated as {'KV' if kind == KV else 'state'}")
        live[entry] = 0
        self.used_per_block[b] -= 1
        if self.used_per_block[b] == 0:
            self._kind[b] = FREE
            self._entry_free[b] = []
            self._free_blocks.append(b)
            return
        self._entry_free[b].append(entry)
        if not self._is_open[b]:
            self._open[kind].append(b)
            self._is_open[b] = True

    # ------------------------------------------------------------------ queries
    def may_have_slot(self) -> bool:
        """Cheap hint for eviction loops: ``False`` means :meth:`alloc_slot` would fail now
        (no free block, no state block with a free slot)."""
        return bool(self._free_blocks) or bool(self._open[STATE])

    def block_kind(self, block: int) -> int:
        return self._kind[block]

    @property
    def blocks_in_use(self) -> dict[int, int]:
        """Blocks in use per kind, from the entry counters alone: one of the two kinds always
        has one entry per block (a slot at least a page: one slot per block; else a block is
        one page), so no per-block scan or extra counter is needed."""
        lay = self.layout
        used = lay.num_blocks - len(self._free_blocks)
        if lay.slots_per_block <= 1:  # no state, or one slot per block
            state = self.slots_in_use
            return {KV: used - state, STATE: state}
        kv = self.pages_in_use  # several slots per block: a block is one page
        return {KV: kv, STATE: used - kv}

    @property
    def free_page_entries(self) -> int:
        """Free pages inside KV slabs in use (taken before any new block is opened)."""
        return self.blocks_in_use[KV] * self.layout.pages_per_block - self.pages_in_use

    @property
    def free_slot_entries(self) -> int:
        """Free slots inside state blocks in use."""
        return self.blocks_in_use[STATE] * self.layout.slots_per_block - self.slots_in_use

    def check_invariants(self) -> None:
        """Recount every per-block field from the entry flags (raises ``AssertionError``).

        Invariants: a block's kind is FREE iff no entry of it is live and it is on the free
        stack exactly once; ``used_per_block`` counts its live entries; the in-use
        counters are the sums of those; an open block of a kind has that kind.
        """
        lay = self.layout
        free = set(self._free_blocks)
        assert len(free) == len(self._free_blocks), "a block twice on the free stack"
        per = {KV: lay.pages_per_block, STATE: lay.slots_per_block}
        totals = {KV: 0, STATE: 0}
        blocks = {KV: 0, STATE: 0}
        for b in range(lay.num_blocks):
            kind = self._kind[b]
            if kind == FREE:
                assert b in free and self.used_per_block[b] == 0, f"free block {b} in use"
                continue
            assert b not in free, f"block {b} in use and on the free stack"
            n = per[kind]
            live = sum(self._live[kind][b * n : (b + 1) * n])
            assert live == self.used_per_block[b] > 0, f"block {b}: {live} live entries"
            totals[kind] += live
            blocks[kind] += 1
        assert totals[KV] == self.pages_in_use and totals[STATE] == self.slots_in_use
        assert blocks == self.blocks_in_use, "blocks in use per kind"

    @property
    def free_block_count(self) -> int:
        return len(self._free_blocks)

    def stats(self) -> ArenaStats:
        """Occupancy, padding (bytes no entry can use) and fragmentation.

        Fragmentation counts free entries inside blocks of the other kind: bytes that exist
        but that an allocation of the kind that needs them cannot use until the block empties.
        """
        lay = self.layout
        kv_blocks = sum(1 for k in self._kind if k == KV)
        st_blocks = sum(1 for k in self._kind if k == STATE)
        kv_payload = max(lay.page_payload.values()) if lay.page_payload else 0
        pad = kv_blocks * (lay.block_bytes - lay.pages_per_block * kv_payload)
        pad += st_blocks * (lay.block_bytes - lay.slots_per_block * lay.snapshot_bytes)
        frag = (kv_blocks * lay.pages_per_block - self.pages_in_use) * lay.page_bytes
        frag += (st_blocks * lay.slots_per_block - self.slots_in_use) * lay.slot_bytes
        return ArenaStats(
            capacity_bytes=lay.capacity_bytes,
            used_bytes=(kv_blocks + st_blocks) * lay.block_bytes,
            kv_bytes=self.pages_in_use * lay.page_bytes,
            state_bytes=self.slots_in_use * lay.slot_bytes,
            kv_blocks=kv_blocks,
            state_blocks=st_blocks,
            free_blocks=len(self._free_blocks),
            padding_bytes=pad,
            fragmentation_bytes=frag,
        )
