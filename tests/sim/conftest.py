"""Shared helpers of the simulator tests: hand-made traces and the Mooncake trace path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hybridcache.presets import get_preset
from hybridcache.sim.traces import Trace, TraceRequest

REPO = Path(__file__).resolve().parents[2]
#: CI and developers have shared/ beside the clone.
MOONCAKE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def toks(n: int, seed: int) -> np.ndarray:
    """``n`` distinct-looking token ids; different seeds never share a 16-token unit."""
    return np.random.default_rng(seed).integers(1, 1 << 30, size=n).astype(np.uint32)


def token_trace(*prompts: np.ndarray, out: int = 0, tenants: list[str | None] | None = None,
                outputs: list[np.ndarray] | None = None) -> Trace:
    reqs = []
    for i, p in enumerate(prompts):
        o = outputs[i] if outputs is not None else None
        reqs.append(TraceRequest(
            timestamp=float(i), input_length=len(p), output_length=len(o) if o is not None else out,
            tenant=tenants[i] if tenants else None, session_id=f"s{i}", input_ids=p, output_ids=o,
        ))
    return Trace("<test>", "tokens", reqs)


@pytest.fixture(scope="session")
def kimi():
    return get_preset("kimi-linear-48b")


@pytest.fixture(scope="session")
def mooncake_path() -> Path:
    if not MOONCAKE.exists():
        pytest.skip(f"Mooncake trace not found at {MOONCAKE}")
    return MOONCAKE
