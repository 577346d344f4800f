"""State oracle for speculative decoding: every snapshot our scheduler registers holds the
state a no-cache, no-draft engine computes at the same token boundary.

Two runs, each a fresh process (vLLM keeps process-wide state; the engine runs in that
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the worker's tensors are this process's):

* ``capture``: ``HybridCacheScheduler`` (or a mutant, ``--scheduler-cls``) with the n-gram
  drafter serves :func:`workload` (the echo workload of :mod:`vllm_tiny_kimi` and an echo
  sweep, so drafts are both accepted and rejected). The engine is stepped here
  (``LLMEngine.step``), and after
  every step the scheduler's registrations are read: block-level snapshots (the core
  index's units with a snapshot slot) and sub-block tails (``TailCache.by_key``, once
  their copies have run). Each new one is read from the worker's Mamba-layer caches (the
  ``kv_cache`` of every layer in the forward context: conv window and recurrent state of
  the slot's vLLM blocks) and recorded with its token prefix, its kind, the step, and
  whether its state was computed in a step that rejected drafts (its boundary lies in
  that step's kept tokens).
* ``truth``: caching off, no drafter, chunked prefill of ``unit`` tokens per step (so every
  unit boundary is a step end), one request at a time. For each needed prefix the longest
  needed sequence holding it is prefilled and the request's (only) state block is read
  after the step that ends at each boundary.

:func:`compare` then gives, per snapshot, the largest difference of its recurrent state
and of its conv window from the truth. Nothing in the library is patched: the capture
only reads the scheduler's and the worker's own objects between steps (the adapter's
index, tails and per-request speculative state: read-only, and tied to the adapter's
layout of today).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import vllm_tiny_kimi as kimi

# Output tokens per request: more than the e2e tests' 16, so that decode runs past the
# echoed answer and the n-gram drafter's proposals are partly rejected while decode tails
# (every unit boundary inside a block) are being made.
DECODE_TOKENS = 48
MAX_NUM_SEQS = 4  # as vllm_tiny_kimi.engine_kwargs


# --------------------------------------------------------------------------- worker tensors
def mamba_layers(llm: Any) -> dict[str, Any]:
    """``{layer name: layer}`` of the Mamba-style (KDA, GDN) layers of an in-process engine."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    ctx = runner.vllm_config.compilation_config.static_forward_context
    return {k: v for k, v in ctx.items() if isinstance(v, MambaBase)}


def read_state(layer: Any, block: int, window: int) -> tuple[Any, Any]:
    """(conv window, recurrent state) of ``block``: the first ``window`` conv columns (the
    window at offset 0, what a restore reads) and the whole recurrent state, as fp32."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv, rec = layer.kv_cache[0], layer.kv_cache[1]
    c = conv[block] if is_conv_state_dim_first() else conv[block].transpose(0, 1)
    return c[:, :window].float().clone(), rec[block].float().clone()


def conv_columns(layer: Any) -> int:
    """Columns of a layer's conv state (``W - 1 + num_speculative_tokens``)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    conv = layer.kv_cache[0]
    return conv.shape[-1] if is_conv_state_dim_first() else conv.shape[-2]


def group_layers(sched: Any, layers: dict[str, Any], mamba_gids: list[int]) -> list[list[str]]:
    """Layer names of each Mamba group, in the adapter's ``mamba_ids`` order."""
    groups = sched.kv_cache_config.kv_cache_groups
    return [[n for n in groups[g].layer_names if n in layers] for g in mamba_gids]


# --------------------------------------------------------------------------- capture
@dataclass
class _Digests:
    """Digest -> token prefix of every sequence seen, at the core's unit and the tails'."""

    mgr: Any
    tail_unit: int | None

    def __post_init__(self) -> None:
        from hybridcache.hashing import TokenHasher

        cfg = self.mgr.config
        self._make = lambda unit: TokenHasher(unit, cfg.hash_algo, cfg.hash_seed)
        self.prefix: dict[bytes, tuple[int, ...]] = {}
        self._seen: set[tuple[int, ...]] = set()

    def add(self, tokens: list[int]) -> None:
        key = tuple(tokens)
        if key in self._seen:
            return
        self._seen.add(key)
        for unit in {self.mgr.unit, self.tail_unit} - {None}:
            h = self._make(unit)
            h.extend(list(tokens))
            for i, d in enumerate(h.digests):
                self.prefix.setdefault(d, key[: (i + 1) * unit])


class Capture:
    """Reads what the scheduler registered since the last call (see module docstring)."""

    def __init__(self, llm: Any, num_spec: int) -> None:
        self.sched = llm.llm_engine.engine_core.engine_core.scheduler
        self.km = self.sched.kv_cache_manager
        self.layers = mamba_layers(llm)
        self.by_group = group_layers(self.sched, self.layers, list(self.km.mamba_ids))
        self.window = conv_columns(next(iter(self.layers.values()))) - num_spec
        self.dtypes = {n: (str(x.kv_cache[0].dtype), str(x.kv_cache[1].dtype))
                       for n, x in self.layers.items()}  # (conv, recurrent) as vLLM keeps them
        tails = self.km.tails
        self.digests = _Digests(self.km.manager, tails.unit if tails is not None else None)
        self.seen: set[tuple[str, bytes, int]] = set()
        self.records: list[dict] = []
        self.step = 0
        # (tokens, c, c + a) of every request-step that rejected drafts: the state at a
        # boundary b with c < b <= c + a was computed in that step (and only there).
        self._rejecting: list[tuple[tuple[int, ...], int, int]] = []

    def _blocks(self, slot: int) -> list[int]:
        return list(self.km.tails.state_blocks(slot))

    def _state(self, slot: int) -> dict[str, tuple[Any, Any]]:
        out = {}
        for names, block in zip(self.by_group, self._blocks(slot)):
            for n in names:
                out[n] = read_state(self.layers[n], block, self.window)
        return out

    def _steps_with_rejections(self) -> list[tuple[tuple[int, ...], int, int]]:
        """(tokens, c, c + a) of every request whose step just run verified drafts and
        rejected some: ``c`` computed before it, ``a`` tokens kept (vLLM has already taken
        the rejected ones off ``num_computed_tokens``)."""
        out = []
        for rid, st in self.km._spec.items():
            req = self.sched.requests.get(rid)
            if req is None or st.step is None:
                continue
            c, q, d = st.step
            a = req.num_computed_tokens - c
            if d and a < q:
                out.append((tuple(req.all_token_ids), c, c + a))
        return out

    def after_step(self) -> None:
        """Record the registrations that became visible in the step just run (the
        scheduler registers what the previous step computed, when this one starts)."""
        self.step += 1
        for req in self.sched.requests.values():
            self.digests.add(list(req.all_token_ids))
        found = []
        for digest, node in self.km.manager.index.handles.items():
            if node.snap >= 0:
                found.append(("block", digest, node.snap, (node.depth + 1) * self.km.manager.unit))
        tails = self.km.tails
        if tails is not None:
            for digest, tail in tails.by_key.items():
                if tail.ready:
                    found.append(("tail", digest, tail.slot, tail.boundary))
        for kind, digest, slot, boundary in found:
            key = (kind, digest, slot)
            if key in self.seen:
                continue
            self.seen.add(key)
            prefix = self.digests.prefix.get(digest)
            if prefix is None or len(prefix) != boundary:
                raise AssertionError(f"{kind} snapshot at {boundary}: its tokens are unknown")
            rejected = any(c < boundary <= kept and toks[:boundary] == prefix
                           for toks, c, kept in self._rejecting)
            self.records.append(dict(kind=kind, boundary=boundary, tokens=list(prefix),
                                     step=self.step, rejected_in_step=rejected,
                                     state=self._state(slot)))
        self._rejecting += self._steps_with_rejections()


def workload(generate: Any) -> None:
    """:func:`vllm_tiny_kimi._workload` (``repeat``), then an echo sweep.

    The sweep continues session A's last turn (its prompt and answer) with a few filler
    tokens and the session's echoed ``ECHO`` tokens, so the n-gram drafter proposes the
    answer that followed them; a small model continues much like it did for a few tokens
    (measured: some drafts accepted, the rest rejected). The filler sets the prompt's
    length to ``16 m - j`` (j = 1..4, twice): the first decode step's kept tokens then
    cross a 16-token unit boundary inside the step, where a sub-block tail is made from
    the column of the ``j``-th state (j > 1: a later column than the step's first)."""
    import random

    histories: dict[str, list[int]] = {}

    def recording(named: list[tuple[str, list[int]]]) -> list[list[int]]:
        outs = generate(named)
        for (name, ids), out in zip(named, outs):
            histories[name] = ids + out
        return outs

    kimi._workload(recording, repeat=True)
    base = histories["sessionA-turn2"]
    echo = base[-(DECODE_TOKENS + kimi.ECHO):-DECODE_TOKENS]
    rng = random.Random(4321)
    named = []
    for i, j in enumerate((1, 2, 3, 4, 1, 2, 3, 4)):
        fill = (-j - len(base) - len(echo)) % 16 + 16 * (1 + i // 4)
        named.append((f"echo-{i}", base + [rng.randrange(2, 512) for _ in range(fill)] + echo))
    recording(named[:MAX_NUM_SEQS])
    recording(named[MAX_NUM_SEQS:])


def drive(llm: Any, on_step: Any) -> Any:
    """A ``generate(named)`` for :func:`vllm_tiny_kimi._workload` that steps the engine
    itself and calls ``on_step()`` after every step."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    counter = iter(range(1 << 30))
    results: list[dict] = []

    def generate(named: list[tuple[str, list[int]]]) -> list[list[int]]:
        ids = []
        for name, tokens in named:
            rid = f"{name}-{next(counter)}"
            engine.add_request(rid, {"prompt_token_ids": tokens}, sp)
            ids.append(rid)
        outs: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
            on_step()
        got = []
        for (name, tokens), rid in zip(named, ids):
            o = next(v for k, v in outs.items() if k.startswith(rid))
            out = list(o.outputs[0].token_ids)
            results.append(dict(name=name, prompt=tokens, output=out,
                                num_cached_tokens=o.num_cached_tokens or 0))
            got.append(out)
        return got

    generate.results = results  # type: ignore[attr-defined]
    return generate


def run_capture(model: str, out: str, spec_tokens: int, scheduler_cls: str) -> None:
    import os
    import time

    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    t0 = time.time()
    llm = LLM(**kimi.engine_kwargs(model, "ours", spec_tokens, scheduler_cls))
    started = time.time() - t0
    cap = Capture(llm, spec_tokens)
    generate = drive(llm, cap.after_step)
    workload(generate)
    for r in generate.results:
        cap.digests.add(r["prompt"] + r["output"])
    torch.save(dict(records=cap.records, requests=generate.results,
                    stats=cap.sched.hybridcache_stats(),
                    rejecting_steps=len(cap._rejecting), dtypes=cap.dtypes, start_s=started,
                    total_s=time.time() - t0), out)


# --------------------------------------------------------------------------- truth
def run_truth(model: str, out: str, needed_from: list[str]) -> None:
    """No-cache, no-draft states at every boundary the capture files recorded."""
    import os
    import time

    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    needed = {tuple(r["tokens"]) for f in needed_from for r in torch.load(f, weights_only=False)["records"]}
    unit = max(u for u in (16, 8, 4, 2, 1) if all(len(t) % u == 0 for t in needed))
    t0 = time.time()
    kw = kimi.engine_kwargs(model, "off")
    kw.update(max_num_seqs=1, enable_chunked_prefill=True, max_num_batched_tokens=unit)
    llm = LLM(**kw)
    started = time.time() - t0
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    layers = mamba_layers(llm)
    groups = sched.kv_cache_config.kv_cache_groups
    gids = [g for g, grp in enumerate(groups) if type(grp.kv_cache_spec).__name__ == "MambaSpec"]
    by_group = group_layers(sched, layers, gids)
    window = conv_columns(next(iter(layers.values())))
    leaves = sorted(needed, key=len, reverse=True)
    plan: dict[tuple[int, ...], set[int]] = {}
    for t in leaves:  # each prefix is read from the longest needed sequence holding it
        home = next((s for s in plan if s[: len(t)] == t), None)
        plan.setdefault(home or t, set()).add(len(t))
    states: dict[tuple[int, ...], dict] = {}
    for i, (seq, bounds) in enumerate(plan.items()):
        rid = f"truth-{i}"
        engine.add_request(rid, {"prompt_token_ids": list(seq)}, SamplingParams(max_tokens=1))
        blocks = None
        while engine.has_unfinished_requests():
            engine.step()
            key = next((k for k in sched.requests if k.startswith(rid)), None)
            if key is None:  # finished (after the step that computed the whole sequence)
                continue
            if blocks is None:
                ids = sched.kv_cache_manager.get_block_ids(key)
                blocks = [ids[g][0] for g in gids]
            n = sched.requests[key].num_computed_tokens
            if n in bounds:
                states[seq[:n]] = {name: read_state(layers[name], b, window)
                                   for names, b in zip(by_group, blocks) for name in names}
        # The last step (boundary = the whole sequence) finishes and frees the request:
        # its block is read after that step (nothing else runs to overwrite it).
        if len(seq) in bounds and seq not in states:
            states[seq] = {name: read_state(layers[name], b, window)
                           for names, b in zip(by_group, blocks) for name in names}
    missing = needed - set(states)
    assert not missing, f"truth run missed boundaries {sorted(len(t) for t in missing)}"
    torch.save(dict(states=states, unit=unit, start_s=started, total_s=time.time() - t0), out)


# --------------------------------------------------------------------------- comparison
# Tolerances. The two runs differ in batch shapes (chunks of 16 tokens alone against the
# capture's block-aligned chunks and 1 + 3-token verification steps batched with other
# requests), so the bf16 projections feeding the layers round differently: measured on
# both tiny models, the conv windows then differ by up to one bf16 ulp of the window's
# magnitude and the fp32 recurrent state (KDA and GDN alike, as vLLM keeps them here) by
# up to ~2e-2 of its magnitude (docs/results.md). A state from another token boundary
# differs by ~1x its magnitude (the mutants: mostly 1 to 3x).
REC_REL_TOL = 0.05  # max |state - truth| / max |truth|, per layer
CONV_ULP_TOL = 2.0  # max |window - truth| in bf16 ulps of max |truth window|, per layer


from vllm_e2e_workload import bf16_ulp as _bf16_ulp  # noqa: E402 - one definition of a bf16 step


def compare(capture: dict, truth: dict) -> list[dict]:
    """Per recorded snapshot: its kind, boundary, step facts, and its worst layer's
    differences from the truth: ``rec`` (max absolute, recurrent state), ``rec_rel``
    (that over the truth's largest magnitude), ``conv`` (max absolute, conv window) and
    ``conv_ulps`` (that in bf16 ulps of the truth window's largest magnitude); ``ok``:
    both within :data:`REC_REL_TOL` / :data:`CONV_ULP_TOL`."""
    rows = []
    for r in capture["records"]:
        t = truth["states"][tuple(r["tokens"])]
        rec = rec_rel = conv = conv_ulps = 0.0
        for name, (c, s) in r["state"].items():
            tc, ts = t[name]
            d_rec, d_conv = float((s - ts).abs().max()), float((c - tc).abs().max())
            rec, conv = max(rec, d_rec), max(conv, d_conv)
            rec_rel = max(rec_rel, d_rec / max(float(ts.abs().max()), 1e-30))
            conv_ulps = max(conv_ulps, d_conv / _bf16_ulp(float(tc.abs().max())))
        rows.append(dict(kind=r["kind"], boundary=r["boundary"], step=r["step"],
                         rejected_in_step=r["rejected_in_step"], rec=rec, rec_rel=rec_rel,
                         conv=conv, conv_ulps=conv_ulps,
                         ok=rec_rel <= REC_REL_TOL and conv_ulps <= CONV_ULP_TOL))
    return rows


def _env() -> dict[str, str]:
    import os

    return dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false")


def _run(args: list[str]) -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], env=_env(),
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]


def capture(model: Path, out: Path, *, spec_tokens: int = 3,
            scheduler_cls: str = kimi.SCHEDULER) -> dict:
    """Run :func:`run_capture` in a fresh process; returns what it saved."""
    import torch

    _run(["capture", str(model), str(out), "--spec-tokens", str(spec_tokens),
          "--scheduler-cls", scheduler_cls])
    return torch.load(out, weights_only=False)


def truth(model: Path, out: Path, captures: list[Path]) -> dict:
    """Run :func:`run_truth` in a fresh process for the boundaries of ``captures``."""
    import torch

    _run(["truth", str(model), str(out), *map(str, captures)])
    return torch.load(out, weights_only=False)


def _main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("capture", "truth"))
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("captures", nargs="*")
    ap.add_argument("--spec-tokens", type=int, default=3)
    ap.add_argument("--scheduler-cls", default=kimi.SCHEDULER)
    a = ap.parse_args()
    if a.what == "capture":
        run_capture(a.model, a.out, a.spec_tokens, a.scheduler_cls)
    else:
        run_truth(a.model, a.out, a.captures)
    print(json.dumps({"done": a.what}))


if __name__ == "__main__":  # pragma: no cover - python vllm_specdec_oracle.py capture|truth ...
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).parent))
    _main()
