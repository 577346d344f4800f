"""Speculative decoding through ``HybridCacheScheduler``, scheduler level (no model).

vLLM's real ``Scheduler`` runs with an n-gram-style speculative config; drafts are made up
(a random number of them right, then wrong), and :class:`SpecWorker` plays vLLM 0.32's
V1 worker for ``align`` mode with drafts (``preprocess_mamba``, the speculative state
columns, ``postprocess_mamba_fused_kernel``; see ``adapters/vllm/spec_decode.py``). Each
state block records which token prefix its state is of, so:

* a step must start from the state of exactly its computed prefix (a wrong column, a
  snapshot of another prefix or a clobbered block fails);
* every registered snapshot must hold the state of an *accepted* prefix at a block
  boundary: a rejected draft's state registered anywhere fails;
* at the end no page or slot leaks (everything in use belongs to a cached entry).

A state block has two parts, as vLLM's: the recurrent state and the conv window. The
worker keeps a speculative step's conv history in column ``cur`` only (the window after
its ``t + 1``-th input at offset ``t``, read at the accepted-count offset), unless it is
the plug-in's CPU worker, which also writes every column's own window
(``SpecWorker.whole_columns``, ``cpu_kernels.spread_conv_windows``). Sub-block tails are
on (the default 16-token unit); the worker applies ``kv_cache_block_copies`` whole, with
:class:`vllm_sched_harness.SimWorker`'s block semantics, so a tail copied from the wrong
column, from a column whose conv window is stale, or with a wrong KV block fails the
same checks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest

try:
    import hybridcache.adapters.vllm  # noqa: F401
except ImportError as exc:
    pytest.skip(f"vLLM adapter not importable: {exc}", allow_module_level=True)

import vllm_sched_harness as h  # noqa: E402
from cpu_skips import needs_torch_gdn_spec_path  # noqa: E402

pytestmark = pytest.mark.vllm

#: The two checks of tails under drafts below were built for vLLM's torch GDN speculative
#: path and skip elsewhere (cpu_skips).

K = 3  # draft tokens per step


def make_spec_scheduler(model_dir, num_blocks: int, *, max_batched: int = 256,
                        admission: str = h.DEFAULT_ADMISSION, manager_cls: Any = None,
                        tails_unit: int | None = None, columns_whole: bool | None = None) -> Any:
    """``vllm_sched_harness.make_scheduler`` with an n-gram speculative config of ``K``
    tokens (Mamba blocks get ``K`` speculative columns, as vLLM's engine gives them).
    ``manager_cls``, ``tails_unit`` or ``columns_whole`` rebuild the spec-decode manager
    with that class (the mutation tests), tail unit (``None``: none) or column mode."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridcache.adapters.vllm import HybridCacheScheduler

    bs = h.BLOCK
    model_config = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True, max_model_len=8192)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=8192,
            enable_chunked_prefill=True, async_scheduling=False, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True, mamba_cache_mode="align"),
        speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=K,
                                             prompt_lookup_max=4, prompt_lookup_min=2),
        additional_config={"hybridcache": {"admission": admission}},
    )
    mamba = MambaSpec(block_size=bs, shapes=((4, 130), (1, 128, 128)),
                      dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align",
                      mamba_type=MambaAttentionBackendEnum.GDN_ATTN, num_speculative_blocks=K)
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0.linear_attn"], mamba),
                         KVCacheGroupSpec(["layers.1.self_attn", "layers.3.self_attn"], attn)],
        prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
        hash_block_size=bs, cache_hit_alignment_tokens=bs,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    sched = HybridCacheScheduler(
        vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config), block_size=bs,
        log_stats=True)
    if manager_cls is not None or tails_unit is not None or columns_whole is not None:
        from hybridcache.adapters.vllm.spec_decode import SpecDecodeKVCacheManager

        old = sched.kv_cache_manager
        sched.kv_cache_manager = (manager_cls or SpecDecodeKVCacheManager)(
            kv_cache_config, max_model_len=old.manager.spec.max_model_len,
            config=old.manager.config, enable_caching=True, log_stats=True,
            prefix_match_unit=tails_unit, num_speculative_tokens=K,
            columns_whole=old.columns_whole if columns_whole is None else columns_whole)
    return sched


@dataclass
class SpecWorker(h.SimWorker):
    """:class:`vllm_sched_harness.SimWorker` with vLLM's speculative state columns."""

    accepted: dict[str, int] = field(default_factory=dict)  # worker's num_accepted_tokens
    good: set[tuple[int, str]] = field(default_factory=set)  # accepted prefix states
    good_any: set[tuple[int, str]] = field(default_factory=set)  # ... at any position
    whole_columns: bool = True  # the plug-in's CPU worker: every column gets its window
    # block -> conv windows by offset: the window after the step's t + 1-th input at t
    conv: dict[int, tuple[tuple[int, str], ...]] = field(default_factory=dict)

    def apply_block_ops(self, out: Any) -> None:
        for b in out.new_block_ids_to_zero or ():
            self.conv.pop(b, None)
        super().apply_block_ops(out)

    def _copy(self, src: int, dst: int) -> None:
        """A whole block (``kv_cache_block_copies``): KV, recurrent state, conv buffer."""
        super()._copy(src, dst)
        if src in self.conv:
            self.conv[dst] = self.conv[src]
        else:
            self.conv.pop(dst, None)

    def _shift_copy(self, conv_src: int, state_src: int, dst: int, bias: int) -> None:
        """vLLM's ``_copy_mamba_state_block``: the conv history of ``conv_src`` shifted by
        ``bias`` tokens, the recurrent state of ``state_src``."""
        window = self.conv.get(conv_src, ())[bias:]
        self._copy(state_src, dst)
        self.conv[dst] = window

    def conv_at(self, block: int, offset: int = 0) -> tuple[int, str] | None:
        got = self.conv.get(block, ())
        return got[offset] if offset < len(got) else None

    def run_step(self, out: Any, requests: dict[str, Any], rng: random.Random) -> Any:
        """Apply ``out``, play the forward pass and sampling; the ``ModelRunnerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        self.steps += 1
        for rid in list(out.finished_req_ids) + list(out.preempted_req_ids or ()):
            self.accepted.pop(rid, None)
        self.apply_block_ops(out)  # zeroing, then kv_cache_block_copies (sub-block tails)
        fresh = h.mirror_tables(out, self.tables, self.state_col)
        for rid in fresh:
            self.accepted.pop(rid, None)
        req_ids, sampled = list(out.num_scheduled_tokens), []
        for rid in req_ids:
            sampled.append(self._one(rid, out, requests[rid], rng))
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def _one(self, rid: str, out: Any, req: Any, rng: random.Random) -> list[int]:
        bs = self.block_size
        q = out.num_scheduled_tokens[rid]
        drafts = list(out.scheduled_spec_decode_tokens.get(rid, ()))
        c = req.num_computed_tokens - q  # the scheduler advanced it by q
        known = list(req.all_token_ids)
        inputs = known[:c] + known[c : c + q - len(drafts)] + drafts
        table = self.tables[rid]
        curr = (c + q - 1) // bs
        prev = self.state_col.get(rid, (c - 1) // bs if c else -1)
        acc = self.accepted.get(rid, 1)
        for g in self.mamba_groups:  # preprocess_mamba
            assert len(table[g]) > curr + len(drafts), f"{rid}: speculative columns missing"
            if prev != -1 and prev != curr:
                self._shift_copy(table[g][prev], table[g][prev + acc - 1], table[g][curr], acc - 1)
        if prev != -1 and prev != curr:
            acc = 1
        self.state_col[rid] = curr
        for g in self.attn_groups:  # KV of the inputs, then reads
            for pos in range(c, c + q):
                b = table[g][pos // bs]
                self.state.pop(b, None)
                self.conv.pop(b, None)
                self.kv[(b, pos % bs)] = inputs[pos]
            for pos in range(c + q):
                got = self.kv.get((table[g][pos // bs], pos % bs))
                assert got == inputs[pos], f"{rid}: KV at {pos} holds {got}"
        # vLLM's speculative rows: steps with drafts, and decodes that got none.
        spec_row = bool(drafts) or (c >= req.num_prompt_tokens and q == 1)
        for g in self.mamba_groups:
            src = table[g][curr + acc - 1]
            if c:
                want = (c, h.prefix_digest(inputs[:c]))
                assert self.state.get(src) == want, f"{rid}: starts from {self.state.get(src)}, needs {want}"
                conv = self.conv_at(table[g][curr], acc - 1)
                assert conv == want, f"{rid}: conv window from {conv}, needs {want}"
            after = [(c + t + 1, h.prefix_digest(inputs[: c + t + 1])) for t in range(q)]
            if drafts:
                for t in range(q):
                    self._write_state(table[g][curr + t], after[t])
                    if self.whole_columns and t:
                        self.conv[table[g][curr + t]] = (after[t],)
            else:
                self._write_state(table[g][curr], (c + q, h.prefix_digest(inputs)))
            self.conv[table[g][curr]] = tuple(after) if spec_row else (after[-1],)
            if not drafts:
                self.good_any.add((c + q, h.prefix_digest(inputs)))
                if (c + q) % bs == 0:  # known tokens only: an accepted state
                    self.good.add((c + q, h.prefix_digest(inputs)))
        if c + q < req.num_tokens:  # a prefill chunk: nothing sampled
            self.accepted[rid] = 1
            return []
        # Sampling: drafts that equal the model's tokens are accepted, then one more token.
        seq, tokens = known[: c + q - len(drafts)], []
        for dtok in drafts:
            t = h.fake_token(seq)
            tokens.append(t)
            if t != dtok:
                break
            seq = seq + [t]
        else:
            tokens.append(h.fake_token(seq))
        a = len(tokens)
        for n in range(c + 1, c + a + 1):
            state = (n, h.prefix_digest((known[: c + q - len(drafts)] + tokens)[:n]))
            self.good_any.add(state)
            if n % bs == 0:
                self.good.add(state)
        self._postprocess(rid, c, q, len(drafts), a)
        return tokens

    def _postprocess(self, rid: str, c: int, q: int, d: int, a: int) -> None:
        """``postprocess_mamba_fused_kernel``: the accepted block boundary's state into the
        column of the block that ends there."""
        bs = self.block_size
        running = c + q - d
        aligned = (running + a - 1) // bs * bs
        self.accepted[rid] = a
        if aligned < running:
            return
        bias, dst, curr = aligned - running, aligned // bs - 1, (c + q - 1) // bs
        if curr == dst:
            self.accepted[rid] = 1
            if bias == 0:
                return
        for g in self.mamba_groups:
            col = self.tables[rid][g]
            self._shift_copy(col[curr], col[curr + bias], col[dst], bias)


def drafts_for(sched: Any, rng: random.Random, p_right: float) -> Any:
    """Draft tokens for every running decode: right with probability ``p_right`` each, until
    the first wrong one (so 0..K drafts are accepted)."""
    from vllm.v1.outputs import DraftTokenIds

    ids, drafts = [], []
    for req in sched.running:
        if req.num_computed_tokens < req.num_tokens - 1 or req.is_finished():
            continue
        seq, ds = list(req.all_token_ids), []
        for _ in range(K):
            t = h.fake_token(seq) if rng.random() < p_right else rng.randrange(2, 500)
            ds.append(t)
            seq = seq + [t]
        ids.append(req.request_id)
        drafts.append(ds)
    return DraftTokenIds(ids, drafts)


def check_snapshots(sched: Any, worker: SpecWorker) -> None:
    """Every registered snapshot holds an accepted prefix's state at a block boundary, and
    every sub-block tail an accepted prefix's state at its own boundary."""
    km = sched.kv_cache_manager
    for node in km.manager.index.nodes.values():
        if node.snap < 0:
            continue
        block = km._state_blocks(node.snap, 0)
        got = worker.state.get(block)
        assert got in worker.good, f"snapshot slot {node.snap} holds {got}, not an accepted state"
        assert worker.conv_at(block) == got, f"snapshot slot {node.snap}: conv {worker.conv_at(block)}"
    for tail in km.tails.lru if km.tails is not None else ():  # sub-block tails
        if tail.ready:
            block = km._state_blocks(tail.slot, 0)
            got = worker.state.get(block)
            assert got is not None and got[0] == tail.boundary and got in worker.good_any, (
                f"tail at {tail.boundary} holds {got}, not an accepted state")
            assert worker.conv_at(block) == got, (
                f"tail at {tail.boundary}: conv window {worker.conv_at(block)}, not {got}")


def drive_spec(sched: Any, sessions: dict, seed: int, p_right: float,
               whole_columns: bool | None = None) -> tuple[h.DriveResult, SpecWorker]:
    """Run ``sessions``; the worker writes every column's conv window when
    ``whole_columns`` (default: what the manager believes it does)."""
    kvc = sched.kv_cache_config
    mamba = [i for i, g in enumerate(kvc.kv_cache_groups) if "linear" in g.layer_names[0]]
    attn = [i for i in range(len(kvc.kv_cache_groups)) if i not in mamba]
    if whole_columns is None:
        whole_columns = sched.kv_cache_manager.columns_whole
    worker = SpecWorker(sched.block_size, mamba, attn, whole_columns=whole_columns)
    rng = random.Random(seed)
    steps = [0]

    def step(out: Any, live: dict) -> Any:
        res = worker.run_step(out, live, rng)
        steps[0] += 1
        return res

    orig_update = sched.update_from_output

    def update(out: Any, mro: Any) -> Any:
        r = orig_update(out, mro)
        sched.update_draft_token_ids(drafts_for(sched, rng, p_right))
        check_snapshots(sched, worker)
        return r

    sched.update_from_output = update
    res = h.run_sessions(sched, sessions, step, max_steps=20000)
    return res, worker


def _sessions(seed: int) -> dict:
    return h.chats_and_document(seed, chats=3, turns=3, first=(40, 23), later=(30, 17),
                                answers=(24, 20), questions=3)


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_accept_0_to_k_no_leak_no_rejected_state(model_dir, seed):
    sched = make_spec_scheduler(model_dir, 400, admission=h.DEFAULT_ADMISSION + "+interval:64")
    res, worker = drive_spec(sched, _sessions(seed), seed, p_right=[0.0, 0.5, 0.8, 1.0][seed % 4])
    km = sched.kv_cache_manager
    assert km.num_owned_column_slots == 0
    h.assert_ours_clean(sched)
    assert sum(res.hits.values()) > 0
    # the drafts were really verified: some steps accepted drafts, some rejected them
    assert worker.steps > 0


def test_outputs_equal_without_spec_decode(model_dir):
    """Drafts change how many steps a request takes, never its tokens or what it hits."""
    sessions = _sessions(11)
    plain = h.make_scheduler(model_dir, __import__("hybridcache.adapters.vllm",
                             fromlist=["HybridCacheScheduler"]).HybridCacheScheduler, 400,
                             max_batched=256)
    base = h.drive(plain, sessions)
    spec = make_spec_scheduler(model_dir, 400)
    res, _ = drive_spec(spec, sessions, 11, p_right=0.6)
    assert res.outputs == base.outputs
    assert sum(res.hits.values()) >= 0.95 * sum(base.hits.values())


class _RegistersScratchState:
    """Mutation: a save point whose boundary token was rejected is still served, from the
    column the step wrote the (draft) state after that token into (vLLM #43559's kind of
    failure: a rejected token's state becomes a cache entry)."""

    def _accept_step(self, tr):
        st = self._spec.get(tr.request.request_id)
        self._mut_step = st.step if st is not None else None
        return super()._accept_step(tr)

    def _serve_save(self, st, mreq, boundary, core_slot, end):
        if boundary <= end or self._mut_step is None:
            return super()._serve_save(st, mreq, boundary, core_slot, end)
        c, q, _ = self._mut_step
        col = (c + q - 1) // self.block_size + (boundary - 1 - c)
        if col in st.owned and boundary % self.block_size == 0:
            slot = st.owned.pop(col)  # white-box: the port refuses a save point accept dropped
            self.manager.requests[mreq.id].saves[boundary] = slot
            self.port._engine_slots.discard(slot)
        return None


def test_mutation_registering_a_rejected_draft_state_fails(model_dir):
    from hybridcache.adapters.vllm.spec_decode import SpecDecodeKVCacheManager

    class Mutated(_RegistersScratchState, SpecDecodeKVCacheManager):
        pass

    sched = make_spec_scheduler(model_dir, 400, admission=h.DEFAULT_ADMISSION + "+interval:64",
                                manager_cls=Mutated)
    with pytest.raises(AssertionError):
        drive_spec(sched, _sessions(3), 3, p_right=0.5)


def _short_sessions(seed: int) -> dict:
    """Prompts that end inside 64-token blocks: hits there are sub-block tails."""
    return h.chats_and_document(seed, chats=3, turns=3, first=(20, 7), later=(15, 3),
                                answers=(20, 12), questions=3)


@pytest.mark.parametrize(("seed", "whole"), [(0, True), (1, True), (2, True),
                                           (0, False), (1, False), (2, False)])
def test_sub_block_tails_with_spec_decode(model_dir, seed, whole):
    """Tails with drafts, on a worker that gives every column its conv window (the
    plug-in's CPU forwards) and on one that keeps it in column ``cur`` only (vLLM's
    kernels): they hit, outputs equal a run without drafts, every tail holds an accepted
    state with its own conv window, nothing leaks."""
    from hybridcache.adapters.vllm import HybridCacheScheduler

    sessions = _short_sessions(seed)
    base = h.drive(h.make_scheduler(model_dir, HybridCacheScheduler, 400), sessions)
    sched = make_spec_scheduler(model_dir, 400, tails_unit=16, columns_whole=whole)
    assert sched.kv_cache_manager.tails is not None
    res, worker = drive_spec(sched, sessions, seed, p_right=[0.6, 1.0, 0.3][seed])
    assert worker.whole_columns is whole
    assert res.outputs == base.outputs
    stats = sched.kv_cache_manager.stats()
    assert stats["tail_hits"] > 0 and stats["saves_dropped"] == 0
    assert any(hit % h.BLOCK for hit in res.hits.values())
    assert sum(res.hits.values()) >= 0.95 * sum(base.hits.values())
    assert sched.kv_cache_manager.num_owned_column_slots == 0
    h.assert_ours_clean(sched)


def test_mutation_tails_anywhere_on_a_worker_without_column_windows_fails(model_dir):
    """Mutation (the bug this guards): the manager makes tails at any accepted boundary
    of a step with drafts while the worker keeps the conv window in column ``cur`` only,
    so a tail pairs the right recurrent state with a stale conv window."""
    sched = make_spec_scheduler(model_dir, 400, tails_unit=16, columns_whole=True)
    with pytest.raises(AssertionError, match="conv window"):
        drive_spec(sched, _short_sessions(1), 1, p_right=1.0, whole_columns=False)


def test_mutation_tail_from_the_column_holding_n_fails(model_dir):
    """Mutation: after a step with drafts, a tail copies the state block of the column
    holding ``n`` (right without drafts) instead of the draft column the state is in."""
    from hybridcache.adapters.vllm.manager import HybridKVCacheManager
    from hybridcache.adapters.vllm.spec_decode import SpecDecodeKVCacheManager

    class Mutated(SpecDecodeKVCacheManager):
        _tell_tails = HybridKVCacheManager._tell_tails

    # Snapshots at every block boundary: the next turn's block-level hit reaches the
    # column of the last turn's decode tail, which it then extends.
    sched = make_spec_scheduler(model_dir, 400, admission=h.DEFAULT_ADMISSION + "+interval:64",
                                manager_cls=Mutated, tails_unit=16)
    with pytest.raises(AssertionError, match="starts from|not an accepted state"):
        drive_spec(sched, _sessions(2), 2, p_right=0.8)


def test_mutation_tail_of_a_rejected_draft_state_fails(model_dir):
    """Mutation: a tail after a step with drafts copies the step's last written column
    (the state after its last draft, accepted or not) under the accepted boundary's key."""
    from hybridcache.adapters.vllm.spec_decode import SpecDecodeKVCacheManager

    class Mutated(SpecDecodeKVCacheManager):
        def _accept_step(self, tr):
            st = self._spec.get(tr.request.request_id)
            self._mut_q = st.step[1] if st is not None and st.step is not None else None
            return super()._accept_step(tr)

        def _tell_tails(self, tr, n):
            st = self._spec.get(tr.request.request_id)
            unit = self.tails.unit
            u = min(n, tr.request.num_tokens) // unit * unit
            if st is None or st.landed is None or not st.landed[0] < u or u % h.BLOCK == 0:
                return super()._tell_tails(tr, n)
            last = st.landed[2] + self._mut_q - 1
            self.tails.computed(tr.request.request_id, u, tr.request.num_prompt_tokens,
                                [tr.tables[g][(u - 1) // h.BLOCK] for g in self.attn_ids],
                                [tr.tables[g][last] for g in self.mamba_ids])
            return None

    sched = make_spec_scheduler(model_dir, 400, manager_cls=Mutated, tails_unit=16)
    with pytest.raises(AssertionError, match="not an accepted state"):
        drive_spec(sched, _short_sessions(0), 0, p_right=0.5)


def test_scheduler_keeps_sub_block_tails_under_spec_decode(model_dir, caplog):
    """The default 16-token unit keeps tails with drafts; an INFO line says where they are
    made (here, vLLM's CPU build with the plug-in's forwards: at every accepted boundary)."""
    needs_torch_gdn_spec_path()
    import logging

    from hybridcache.adapters.vllm.cpu_kernels import speculative_columns_whole

    with caplog.at_level(logging.INFO, logger="hybridcache.adapters.vllm.spec_decode"):
        sched = make_spec_scheduler(model_dir, 400)
    km = sched.kv_cache_manager
    assert km.tails is not None and km.tails.unit == 16
    assert km.columns_whole is speculative_columns_whole() is True
    assert any("sub-block tails" in r.getMessage() and "every accepted unit boundary"
               in r.getMessage() for r in caplog.records)
    res, _ = drive_spec(sched, _short_sessions(0), 0, p_right=0.6)
    assert any(hit % h.BLOCK for hit in res.hits.values())
    assert km.stats()["tail_hits"] > 0


def _state(km: Any) -> tuple:
    """Everything a refused ``allocate_slots`` must leave as it was: the core manager's
    fingerprint (entries, recency, tiers' counters, every request's fields), the port's
    engine-owned pages and slots, the adapter's per-request tables and columns, and the
    sub-block tails (which ones, in what recency order, how many evicted)."""
    from tests.core.fingerprint import fingerprint

    port, tails = km.port, km.tails
    tracked = tuple(sorted((rid, tuple(tr.cols), tuple(tuple(t) for t in tr.tables))
                           for rid, tr in km._tracked.items()))
    spec = tuple(sorted((rid, tuple(sorted(st.owned.items())), st.step, tuple(st.saves))
                        for rid, st in km._spec.items()))
    tail_state = None if tails is None else (
        tuple(id(t) for t in tails.lru), tails.evicted, tuple(sorted(tails.by_key)))
    return (fingerprint(km.manager), tuple(sorted(port._engine_pages)),
            tuple(sorted(port._engine_slots)), tracked, spec, tail_state)


def _checked(base: type, refused: list) -> type:
    """``base`` whose refused ``allocate_slots`` calls are recorded and must change
    nothing of :func:`_state`."""

    class Checked(base):  # type: ignore[misc, valid-type]
        def allocate_slots(self, request, *args, **kwargs):
            before = _state(self)
            out = super().allocate_slots(request, *args, **kwargs)
            if out is None:
                refused.append(request.request_id)
                assert _state(self) == before, f"{request.request_id}: a refused allocation changed state"
            return out

    return Checked


def test_no_slot_for_a_speculative_column_preempts(model_dir):
    """With too few blocks for every request's speculative columns, ``allocate_slots``
    returns ``None`` (vLLM preempts or keeps the request waiting) instead of raising, and
    a refused call changes nothing at all (:func:`_state`: no entry evicted, no recency
    refreshed, no slot kept, no tail dropped); the run finishes with the outputs of a run
    with room to spare and nothing leaks."""
    from hybridcache.adapters.vllm import HybridCacheScheduler
    from hybridcache.adapters.vllm.spec_decode import SpecDecodeKVCacheManager

    refused: list = []
    sessions = _sessions(3)
    base = h.drive(h.make_scheduler(model_dir, HybridCacheScheduler, 400), sessions)
    sched = make_spec_scheduler(model_dir, 40, manager_cls=_checked(SpecDecodeKVCacheManager, refused),
                                tails_unit=16)
    res, _ = drive_spec(sched, sessions, 3, p_right=0.8)
    assert refused and res.preemptions > 0
    assert res.outputs == base.outputs
    assert sched.kv_cache_manager.num_owned_column_slots == 0
    h.assert_ours_clean(sched)


class _TakesColumnsBeforeCounting:
    """Mutation: the step's state columns are taken (evicting) before the allocation is
    counted, as the adapter did for running requests before it counted them together
    (a first allocation's columns so taken could evict the very hit it adopted, which
    fails otherwise)."""

    def _allocate(self, rid, num_tokens):
        if rid not in self._tracked:
            return super()._allocate(rid, num_tokens)
        need, self._need = self._need, 0
        while len(self._reserved) < need:
            slot = self._column_slot()
            if slot is None:
                break
            self._reserved.append(slot)
        return super()._allocate(rid, num_tokens)


def test_mutation_taking_columns_before_counting_fails(model_dir):
    needs_torch_gdn_spec_path()
    from hybridcache.adapters.vllm.spec_decode import SpecDecodeKVCacheManager

    class Mutant(_TakesColumnsBeforeCounting, SpecDecodeKVCacheManager):
        pass

    sched = make_spec_scheduler(model_dir, 40, manager_cls=_checked(Mutant, []), tails_unit=16)
    with pytest.raises(AssertionError, match="a refused allocation changed state"):
        drive_spec(sched, _sessions(3), 3, p_right=0.8)
