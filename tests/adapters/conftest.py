"""Fixtures shared by the vLLM adapter tests.

vLLM-side helpers are imported inside the fixtures: the Hugging Face config tests in this
folder run without vLLM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before any test module imports vLLM or transformers: nothing downloads, and the CPU
# build's KV cache stays small. One place for every test in this folder.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

HERE = Path(__file__).parent
for _p in (HERE, HERE.parent / "tiers"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
# check_same_greedy's asserts, as in the test modules.
pytest.register_assert_rewrite("vllm_e2e_workload")


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


@pytest.fixture
def host_tier(request) -> Iterator[object]:
    """Connector settings for a fresh, named HostTier per call (``host_tier("x")``); every
    name is dropped before use and at the end of the test."""
    from hybridcache.adapters.vllm import connector_config as cc

    names = []

    def make(tag: str) -> dict:
        name = f"test-{request.node.name}-{tag}"
        cc.drop_host_tier(name)
        names.append(name)
        return {"tier": "host", "host_name": name, "host_bytes": 256 << 20}

    yield make
    for name in names:
        cc.drop_host_tier(name)


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory) -> Path:
    """The tiny random Qwen3-Next of the end-to-end tests, built once per module."""
    import vllm_tiny_model

    return vllm_tiny_model.build_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="module")
def tiny_qwen3_next_wide(tmp_path_factory) -> Path:
    """The tiny Qwen3-Next with 8 GDN value heads: vLLM inflates its block to 1,152 tokens,
    so every prompt of the fine-grained end-to-end test is shorter than one block."""
    import vllm_tiny_model

    return vllm_tiny_model.build_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next-wide"),
                                            value_heads=8)
