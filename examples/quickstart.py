"""The README's Python snippet, runnable: requests that share a system prompt reuse it.

The manager only plans; an engine would run the copies and write KV and states where the
plan says. Here nothing is computed: the point is what the manager answers. Run:

    python examples/quickstart.py
"""

from __future__ import annotations

import numpy as np

from hybridcache import CacheConfig, HybridCacheManager, get_preset


def serve(m: HybridCacheManager, rid: str, prompt_ids: np.ndarray, tenant: str) -> int:
    """One request through the calls an engine makes; returns the prompt tokens reused."""
    hit = m.add_request(rid, prompt_ids, tenant=tenant)  # MatchResult(hit_tokens, kv_hit_tokens)
    step = m.allocate(rid, len(prompt_ids) - hit.hit_tokens)
    # engine: run step.state_copies (snapshot -> running slot), compute the tokens with
    # step.block_table / step.running_slot, write states at step.save_points
    m.commit(rid, len(prompt_ids))
    m.free(rid)
    return step.hit_tokens


def main() -> None:
    rng = np.random.default_rng(0)
    system = rng.integers(1, 32_000, size=4_096, dtype=np.uint32)  # a shared system prompt
    question = [rng.integers(1, 32_000, size=n, dtype=np.uint32) for n in (200, 300, 250)]
    prompts = [np.concatenate([system, q]) for q in question]

    m = HybridCacheManager(get_preset("kimi-linear-48b"), 64 << 30, CacheConfig())
    # req-2 diverges from req-1 after the system prompt: that branch point is where a state
    # snapshot is saved, so req-3 (a third question) resumes there; req-1 again resumes at
    # its own prompt end (the last full 16-token unit).
    for rid, prompt in (("req-1", prompts[0]), ("req-2", prompts[1]), ("req-3", prompts[2]),
                        ("req-1-again", prompts[0])):
        reused = serve(m, rid, prompt, tenant="acme")
        print(f"{rid}: {len(prompt):,} prompt tokens, {reused:,} served from the cache")
    other = serve(m, "req-4", prompts[2], tenant="other-tenant")
    print(f"req-4 (another tenant, the tokens of req-3): {other:,} from the cache")
    s = m.sync_metrics()
    print(f"snapshots saved {s.snapshots_saved}, token hit rate {s.token_hit_rate:.3f}")


if __name__ == "__main__":
    main()
