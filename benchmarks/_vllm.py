"""Import helpers for benchmarks that compare against the real vLLM (optional)."""

from __future__ import annotations

import os


def import_vllm():
    """Import vLLM's scheduler-side modules, or return ``None`` when vLLM is not installed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        import vllm.v1.core.kv_cache_utils as kcu
        from vllm.sampling_params import SamplingParams
        from vllm.utils import hashing
        from vllm.v1.request import Request
    except Exception as exc:  # noqa: BLE001 - any import failure means "no vLLM here"
        print(f"(vLLM not importable: {type(exc).__name__}: {exc}; its columns are skipped)")
        return None
    return kcu, hashing, Request, SamplingParams
