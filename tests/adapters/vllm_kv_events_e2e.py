"""One ``LLM(...)`` run with vLLM's ``kv_events_config``, its events read back over ZeroMQ.

Run as a script (one fresh process per engine: vLLM keeps process-wide state):
``python vllm_kv_events_e2e.py MODEL OUT.json [--scheduler-cls CLS]``. The engine publishes
on a loopback port with vLLM's own ZeroMQ publisher; a subscriber in this process decodes
the ``KVEventBatch`` messages as a router would and writes them to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plain(x: object) -> object:
    return x.hex() if isinstance(x, bytes) else x


def run(model: str, scheduler_cls: str | None) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_events import KVEventBatch

    # vLLM's publisher binds a wildcard endpoint (vLLM's default form, tcp://*:5557);
    # the router's subscriber connects to it.
    port = _free_port()
    endpoint = f"tcp://*:{port}"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    kw: dict = dict(model=model, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
                    mamba_cache_mode="align", max_num_seqs=4, async_scheduling=False, seed=0,
                    kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                      "endpoint": endpoint, "topic": "kv"})
    if scheduler_cls:
        kw["scheduler_cls"] = scheduler_cls
    llm = LLM(**kw)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(block_size + 40)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for n in (block_size, block_size + 60):  # two rounds: the second hits the shared block
        prompts = [{"prompt_token_ids": shared + [rng.randrange(3, 500) for _ in range(n + i)]}
                   for i in range(2)]
        llm.generate(prompts, sp, use_tqdm=False)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    events: list[dict] = []
    deadline = time.time() + 5
    while time.time() < deadline:
        if not sub.poll(500):
            continue
        _topic, _seq, payload = sub.recv_multipart()
        for e in decoder.decode(payload).events:
            d = {f: _plain(getattr(e, f)) for f in e.__struct_fields__}
            d["block_hashes"] = [_plain(x) for x in d.get("block_hashes") or []]
            d["type"] = type(e).__name__
            events.append(d)
    return {"block_size": block_size, "events": events}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--scheduler-cls", default=None)
    a = ap.parse_args()
    res = run(a.model, a.scheduler_cls)
    with open(a.out, "w") as f:
        json.dump(res, f)
    os._exit(0)  # the engine's threads (and the publisher's) need not be joined


if __name__ == "__main__":
    main()
