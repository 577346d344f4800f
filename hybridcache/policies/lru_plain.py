"""``lru-plain``: LRU without the stranded-KV rule (:mod:`.lru`).

vLLM's free-block queue ages KV blocks past the last cached state like any other block;
the simulator's ``vllm-align`` emulation replays with this policy so that the peer is
modelled as it behaves, not as our rule would make it.
"""

from __future__ import annotations

from hybridcache.policies import PolicyParts, PolicySettings, register_policy
from hybridcache.policies.lru import LRUQueue


@register_policy("lru-plain")
def build_lru_plain(settings: PolicySettings) -> PolicyParts:
    """Two plain LRU queues: the index sets its stranded test only on a queue that declares
    one (:class:`~hybridcache.policies.lru.StrandedLRUQueue` does, :class:`LRUQueue` not)."""
    return PolicyParts(LRUQueue(), LRUQueue())
