"""Helpers for the tier tests: entries derived from their keys, comparison, polling."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable

import numpy as np
import torch

from hybridcache.tiers import Entry, EntryKey

SECRET = b"test-secret-0123456789abcdef"
FINGERPRINT = "0123456789abcdef"


def key(tenant: str, n: int, fingerprint: str = FINGERPRINT) -> EntryKey:
    """The key of prefix ``n`` of ``tenant`` (the prefix hash is the same for every tenant,
    to check isolation does not rest on the upstream salt alone)."""
    return EntryKey.from_int(tenant, fingerprint, 0x5EED0000 + n)


def entry_for(k: EntryKey, kv_tokens: int = 8, torch_state: bool = True) -> Entry:
    """A small entry whose every byte derives from ``k``: a mix-up cannot go unnoticed."""
    seed = int.from_bytes(k.prefix_hash[-8:], "big") ^ zlib.crc32(k.tenant.encode())
    rng = np.random.default_rng(seed & 0xFFFFFFFF)
    kv = rng.standard_normal((kv_tokens, 2, 16)).astype(np.float16)
    state = torch.from_numpy(rng.standard_normal((2, 8, 8)).astype(np.float32))
    pieces = {"kv": kv, "state": state.to(torch.bfloat16) if torch_state else state.numpy()}
    return Entry(pieces, meta={"tenant": k.tenant, "n": int.from_bytes(k.prefix_hash, "big")})


def assert_same(a: Entry | None, b: Entry) -> None:
    """Same names, types, dtypes, shapes, bytes and metadata."""
    assert a is not None
    assert list(a.pieces) == list(b.pieces)
    assert dict(a.meta) == dict(b.meta)
    for name, x in a.pieces.items():
        y = b.pieces[name]
        assert type(x) is type(y), name
        assert x.dtype == y.dtype and tuple(x.shape) == tuple(y.shape), name
        assert _raw(x) == _raw(y), name


def _raw(x) -> bytes:
    if isinstance(x, torch.Tensor):
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(x).tobytes()


def poll(predicate: Callable[[], bool], timeout_s: float = 10.0, step_s: float = 0.05) -> bool:
    """Wait for ``predicate`` (no fixed sleeps: the test is as fast as the system allows)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step_s)
    return predicate()
