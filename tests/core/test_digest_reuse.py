"""A prompt takes the digests of cached runs with equal tokens (TokenHasher.extend_reusing):
they must be the digests hashing gives, bit for bit, whatever eviction did to the runs."""

from __future__ import annotations

import numpy as np
import pytest

from hybridcache.hashing import MultiModalItem, TokenHasher, _same_units, as_token_array
from hybridcache.manager import CacheConfig, HybridCacheManager
from hybridcache.runs import Run
from tests.core.conftest import tiny_spec

U = 4

#: Digests of ``TokenHasher(16, algo, seed="s", tenant="t", lora=3)`` over ``range(40)`` then
#: nine 7s, and of ``TokenHasher(4, algo)`` over ``range(12)`` with an image at [2, 7):
#: written down from main 0ce4644, before the hasher was reworked. vLLM events and offload
#: tiers carry these digests, so they must never change.
PINNED = {
    "xxh3_128": (
        ["a8c3e86ad4e79197a7b02ff11d972107", "5c352584a3627e7ecd4e9e114a8426d9", "8277eb676b4b25849d632735ce2d03c3"],
        ["5de7eca2ad8cb1a6ed12e4a5da91c67c", "da8d46f2acc16fd8df08ae94d3997380", "da547f5afc8db7559e51e023210d4e05"],
    ),
    "sha256": (
        ["ae4fa2bb5c27b6576963b5cbfd00e991", "08c1b29e440d36e307a94f11e1f27a4d", "4fafd9cb14377757c91ca8e83400eadc"],
        ["a66f9c2c6ee5545e035d7107133dd4d1", "21524d5f8fe745a504fd8b2ed3e037de", "a2de8458dc33cb6f2d9dae1cc6a461af"],
    ),
}


@pytest.mark.parametrize("algo", sorted(PINNED))
def test_digests_are_pinned(algo):
    plain, image = PINNED[algo]
    h = TokenHasher(16, algo, seed="s", tenant="t", lora=3)
    h.extend(list(range(40)))
    h.extend([7] * 9)
    assert [d.hex() for d in h.digests] == plain and h.num_tokens == 49
    fresh = TokenHasher(16, algo, seed="s", tenant="t", lora=3)
    fresh.extend_reusing(as_token_array(list(range(40)) + [7] * 9), {}.get)
    assert fresh.digests == h.digests and fresh.num_tokens == 49
    m = TokenHasher(4, algo, mm_items=(MultiModalItem("img", 2, 5),))
    m.extend(list(range(12)))
    assert [d.hex() for d in m.digests] == image


def fresh_digests(tokens, tenant=None, mm=(), algo="xxh3_128"):
    h = TokenHasher(U, algo, tenant=tenant, mm_items=mm)
    h.extend(tokens)
    return h.digests


def chat_stream(seed: int, n: int):
    """Sessions over shared system prompts (two tenants), each turn's prompt the whole
    history, branches off a shared document, an image in some prompts past their first
    unit (so a plain prompt with the same tokens shares that unit's digest)."""
    rng = np.random.default_rng(seed)
    systems = [list(rng.integers(0, 500, int(rng.integers(3, 30)))) for _ in range(3)]
    sessions: dict[int, list[int]] = {}
    for i in range(n):
        s = int(rng.integers(0, 12))
        tenant = "a" if s % 2 else None
        hist = sessions.get(s)
        if hist is None or rng.random() < 0.15:  # new session, or a branch off its start
            hist = list(systems[s % 3]) + ([] if hist is None else hist[: int(rng.integers(0, len(hist) + 1))])
        prompt = hist + [int(x) for x in rng.integers(0, 500, int(rng.integers(1, 40)))]
        output = [int(x) for x in rng.integers(0, 500, int(rng.integers(0, 20)))]
        mm = (MultiModalItem(f"img{i % 3}", 6, 5),) if rng.random() < 0.1 and len(prompt) > 12 else ()
        sessions[s] = prompt + output
        yield str(i), prompt, output, tenant, mm


@pytest.mark.parametrize("eviction", ["value", "lru", "marconi"])
@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_reused_digests_equal_fresh_hashing(eviction, algo):
    """Small budget: runs are shortened, split and evicted in ranges between the turns."""
    m = HybridCacheManager(tiny_spec(), 1 << 18, CacheConfig(hash_unit=U, eviction=eviction, hash_algo=algo))
    for k, (rid, prompt, output, tenant, mm) in enumerate(chat_stream(3, 300)):
        res = m.add_request(rid, prompt, tenant=tenant, mm_items=mm)
        assert m.requests[rid].hasher.digests == fresh_digests(prompt, tenant, mm, algo), rid
        m.allocate(rid, len(prompt) + len(output) - res.hit_tokens)
        if output:
            m.append_tokens(rid, output)
        assert m.requests[rid].hasher.digests == fresh_digests(prompt + output, tenant, mm, algo), rid
        m.commit(rid, len(prompt) + len(output))
        m.free(rid)
        if k % 25 == 0:
            m.check_invariants()
    m.check_invariants()
    assert m.index.evictions["kv"] > 0  # the budget did make eviction cut runs
    assert any(run.tokens for run in m.index.heads.values())  # and runs kept their tokens


def test_reuse_takes_the_runs_digests():
    """The digests past a matched run start come from the run, not from hashing: so a run
    whose tokens are not its units' would hand out wrong digests. The invariant recount
    (``tokens_chain``) is what catches that; it fails on a corrupted run."""
    tokens = list(range(100, 124))  # six units of 4
    real = fresh_digests(tokens)
    run = Run.of(real[:1] + [b"x" * 16] * 5, [list(range(6))], 1.0, 1, 0, None,
                 as_token_array(tokens).tobytes())
    h = TokenHasher(U)
    h.extend_reusing(as_token_array(tokens), {real[0]: run}.get)
    assert h.digests == real[:1] + [b"x" * 16] * 5  # taken over as they were
    m = HybridCacheManager(tiny_spec(), 1 << 20, CacheConfig(hash_unit=U))
    res = m.add_request("a", tokens)
    m.allocate("a", len(tokens) - res.hit_tokens)
    m.commit("a", len(tokens))
    m.free("a")
    m.check_invariants()
    (cached,) = m.index.heads.values()
    cached.tokens[4 * 4 * 2] ^= 1  # one token of unit 2 changed
    with pytest.raises(AssertionError, match="tokens are not its units'"):
        m.check_invariants()
    cached.tokens[4 * 4 * 2] ^= 1
    del cached.tokens[-4:]  # no longer one unit's bytes per digest
    with pytest.raises(AssertionError, match="tokens are not its units'"):
        m.check_invariants()


def test_multimodal_runs_keep_no_tokens():
    """An image past unit 0 leaves unit 0's digest plain: a plain prompt with the same
    tokens finds the image prompt's run, which must not give it the image's digests."""
    tokens = list(range(40))
    m = HybridCacheManager(tiny_spec(), 1 << 20, CacheConfig(hash_unit=U))
    mm = (MultiModalItem("img", 9, 6),)
    res = m.add_request("img", tokens, mm_items=mm)
    m.allocate("img", len(tokens) - res.hit_tokens)
    m.commit("img", len(tokens))
    m.free("img")
    assert all(run.tokens is None for run in m.index.heads.values())
    m.add_request("plain", tokens)
    assert m.requests["plain"].hasher.digests == fresh_digests(tokens)
    assert m.requests["plain"].hasher.digests[:2] == fresh_digests(tokens, mm=mm)[:2]


def test_same_units_counts_equal_units():
    a = bytes(range(64))
    b = bytearray(a)
    assert _same_units(a, 8, b, 8, 6, 8) == 6  # all equal
    assert _same_units(a, 0, b, 0, 0, 8) == 0
    b[8 * 4 + 3] ^= 1  # unit 4 differs
    assert _same_units(a, 0, b, 0, 8, 8) == 4  # found without a hint
    assert _same_units(a, 0, b, 0, 8, 8, hint=4) == 4  # the right hint
    assert _same_units(a, 0, b, 0, 8, 8, hint=2) == 4  # a wrong one is checked, not trusted
    assert _same_units(a, 0, b, 0, 8, 8, hint=6) == 4
    assert _same_units(a, 8, b, 0, 3, 8) == 0  # shifted by a unit: nothing equal
