"""Triton backend: every byte segment of a plan in ONE kernel launch.

Design (why):

* The host builds an int64 table with one row ``(src_addr, dst_addr, nbytes)`` per *chunk*.
  Segments (one row of one tensor for one pair, or a merged run of adjacent rows) longer
  than ``chunk_bytes`` are split, so a snapshot spreads over many programs and the GPU
  stays busy even for a single copy-on-extend. The chunk size adapts to the plan (see
  :func:`default_chunk_bytes`): 64 KiB for large plans, down to 8 KiB for one snapshot.
  One launch covers all tensors of all layers whatever their dtype: the kernel only sees
  bytes.
* Addresses are raw integers cast to pointers inside the kernel, so tensors need not share a
  base buffer and host staging memory (pinned, hence device-addressable through unified
  virtual addressing) works the same way as device memory.
* Wide accesses: when a chunk's source and destination have the same address modulo 16, the
  kernel copies a byte head up to the next 16-byte boundary, then the body as int32 words
  with a 16-byte alignment hint (the compiler emits ``ld.global.v4.b32`` /
  ``st.global.v4.b32``; checked by compiling for sm_90, see docs/kernels.md), then a byte
  tail. Other chunks are copied byte by byte: correct, slower, and rare in an arena whose
  rows are 16-byte multiples. Chunk boundaries are multiples of 16 bytes, so splitting never
  breaks alignment.

Interpreter: with ``TRITON_INTERPRET=1`` set before this module is imported, ``triton.jit``
returns an interpreted function that runs the same kernel body with numpy on the host.
Raw addresses work there for CPU tensors (the interpreter dereferences host memory), which
is how CI tests this exact kernel. No autotune, no ``.to()`` on loop counters (the
interpreter lacks both).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .segments import Segments

MAX_CHUNK_BYTES = 64 * 1024
"""Largest bytes per program: 32 programs per 2 MiB state row; large enough that the
per-program table load is noise."""
MIN_CHUNK_BYTES = 8 * 1024
"""Smallest automatic chunk: one loop iteration of the word path."""
TARGET_PROGRAMS = 2048
"""Aim for at least this many programs (an H200 holds ~1,000 resident programs of 8 warps),
so a single 41 MiB snapshot still fills the GPU instead of running as one thin wave."""
WORD_BLOCK = 2048
"""int32 words per loop iteration (8 KiB): 8 words = two 16-byte accesses per thread at 8 warps."""
BYTE_BLOCK = 1024
"""Bytes per iteration of the byte loop (heads, tails, unaligned chunks)."""
NUM_WARPS = 8

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
"""True when the kernel below was built by the interpreter (TRITON_INTERPRET=1 at import)."""


@triton.jit
def _copy_bytes(src, dst, start, end, BLOCK: tl.constexpr):
    """Copy bytes [start, end) from address ``src`` to ``dst`` with masked uint8 accesses."""
    sp = src.to(tl.pointer_type(tl.uint8))
    dp = dst.to(tl.pointer_type(tl.uint8))
    offs = tl.arange(0, BLOCK)
    for i in range(start, end, BLOCK):
        mask = (i + offs) < end
        tl.store(dp + i + offs, tl.load(sp + i + offs, mask=mask), mask=mask)


@triton.jit
def _copy_words16(src, dst, nbytes, BLOCK: tl.constexpr):
    """Copy ``nbytes`` (a multiple of 16) between 16-byte aligned addresses as int32 words."""
    sp = tl.multiple_of(src.to(tl.pointer_type(tl.int32)), 16)
    dp = tl.multiple_of(dst.to(tl.pointer_type(tl.int32)), 16)
    nwords = nbytes // 4
    nfull = (nwords // BLOCK) * BLOCK
    offs = tl.arange(0, BLOCK)
    for i in range(0, nfull, BLOCK):
        tl.store(dp + i + offs, tl.load(sp + i + offs))
    mask = (nfull + offs) < nwords
    tl.store(dp + nfull + offs, tl.load(sp + nfull + offs, mask=mask), mask=mask)


@triton.jit
def copy_chunks_kernel(table, WORD_BLOCK: tl.constexpr, BYTE_BLOCK: tl.constexpr):
    """One program copies one table row: ``nbytes`` bytes from ``src`` to ``dst``."""
    row = tl.program_id(0).to(tl.int64) * 3
    src = tl.load(table + row)
    dst = tl.load(table + row + 1)
    nbytes = tl.load(table + row + 2)
    head = nbytes * 0
    body = nbytes * 0
    if ((src ^ dst) & 15) == 0:
        head = tl.minimum((16 - (src & 15)) & 15, nbytes)
        body = ((nbytes - head) // 16) * 16
    if head > 0:
        _copy_bytes(src, dst, 0, head, BYTE_BLOCK)
    if body > 0:
        _copy_words16(src + head, dst + head, body, WORD_BLOCK)
    if head + body < nbytes:
        _copy_bytes(src, dst, head + body, nbytes, BYTE_BLOCK)


def default_chunk_bytes(total_bytes: int) -> int:
    """A power of two in [MIN_CHUNK_BYTES, MAX_CHUNK_BYTES] giving ~TARGET_PROGRAMS chunks."""
    want = max(total_bytes // TARGET_PROGRAMS, 1)
    chunk = 1 << (want.bit_length() - 1)
    return int(min(max(chunk, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES))


def chunk_table(segs: Segments, chunk_bytes: int) -> np.ndarray:
    """Split segments into chunks of at most ``chunk_bytes``; returns an (n, 3) int64 table."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    if len(segs) == 0:
        return np.zeros((0, 3), np.int64)
    counts = (segs.nbytes + chunk_bytes - 1) // chunk_bytes
    seg_of = np.repeat(np.arange(len(segs)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    offset = (np.arange(seg_of.size, dtype=np.int64) - first) * chunk_bytes
    table = np.empty((seg_of.size, 3), np.int64)
    table[:, 0] = segs.src[seg_of] + offset
    table[:, 1] = segs.dst[seg_of] + offset
    table[:, 2] = np.minimum(segs.nbytes[seg_of] - offset, chunk_bytes)
    return table


def unavailable_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` in this process, or None if it can."""
    if INTERPRETED and device.type != "cpu":
        return (
            "TRITON_INTERPRET=1 was set when hybridcache.kernels.triton_copy was imported; "
            "the interpreter dereferences raw addresses on the host, so it needs CPU tensors"
        )
    if not INTERPRETED and device.type != "cuda":
        return (
            f"tensors are on {device}; compiled Triton needs CUDA tensors (set "
            "TRITON_INTERPRET=1 before import to run the kernel in the interpreter on CPU)"
        )
    return None


def launch(
    table: np.ndarray,
    device: torch.device,
    *,
    word_block: int = WORD_BLOCK,
    byte_block: int = BYTE_BLOCK,
) -> None:
    """Copy every row of ``table`` in one kernel launch on ``device`` (no launch if empty)."""
    if table.shape[0] == 0:
        return
    dev_table = torch.from_numpy(np.ascontiguousarray(table)).to(device)
    grid = (table.shape[0],)
    if device.type == "cuda":
        with torch.cuda.device(device):
            copy_chunks_kernel[grid](
                dev_table, WORD_BLOCK=word_block, BYTE_BLOCK=byte_block, num_warps=NUM_WARPS
            )
    else:
        copy_chunks_kernel[grid](dev_table, WORD_BLOCK=word_block, BYTE_BLOCK=byte_block)


def copy_segments_triton(
    segs: Segments,
    device: torch.device,
    *,
    chunk_bytes: int | None = None,
    word_block: int = WORD_BLOCK,
    byte_block: int = BYTE_BLOCK,
) -> int:
    """Copy all segments in one launch; returns the number of programs launched."""
    reason = unavailable_reason(device)
    if reason is not None:
        from .errors import BackendError

        raise BackendError(f"triton backend cannot run: {reason}")
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(segs.total_bytes)
    table = chunk_table(segs, chunk_bytes)
    launch(table, device, word_block=word_block, byte_block=byte_block)
    return int(table.shape[0])
