"""Fixtures shared by the vLLM adapter tests.

vLLM-side helpers are imported inside the fixtures: the Hugging Face config tests in this
folder run without vLLM.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
for _p in (HERE, HERE.parent / "tiers"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@pytest.fixture
def redis_server(tmp_path) -> Iterator[object]:
    """A real redis-server of this test's own, on a free loopback port."""
    import tiers_testlib

    server = tiers_testlib.RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """Config folder of the tiny Qwen3-Next that scheduler-level tests build vLLM's config from
    (no weights: the scheduler never runs the model)."""
    import vllm_sched_harness as h

    return h.write_config_dir(tmp_path_factory.mktemp("qwen3-next-config"))


@pytest.fixture
def uniproc(monkeypatch) -> None:
    """One process, as ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM's CPU platform
    otherwise switches the executor to worker processes, where a HostTier is refused)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
