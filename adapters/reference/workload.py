"""Random serving workloads with the sharing patterns a prefix cache exists for.

Three kinds of sessions, drawn from one seed:

- **chat**: one of a few shared system prompts, then 1-3 user turns; each turn's prompt is
  the whole history (previous prompt + the model's reply + the new user message), so a
  turn-end snapshot of turn ``j`` is what turn ``j + 1`` resumes from.
- **document**: one of a few long shared documents, then a question: many requests branch
  off the same long prefix at different points (a branch-point snapshot pays off here).
- **fresh**: a unique prompt nobody shares (pure miss traffic that still fills the cache).

Token ids are uniform random ids; the model is random too, so what matters is only which
token sequences are shared.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Turn:
    """One user turn: the new user tokens and how many tokens to generate."""

    user: tuple[int, ...]
    max_new: int


@dataclass(frozen=True)
class Session:
    """A shared prefix (system prompt or document) followed by turns that build on it."""

    sid: str
    prefix: tuple[int, ...]
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes of a generated workload (token counts are inclusive ranges)."""

    system_prompts: int = 3
    system_len: tuple[int, int] = (48, 160)
    documents: int = 2
    document_len: tuple[int, int] = (256, 480)
    user_len: tuple[int, int] = (6, 40)
    max_new: tuple[int, int] = (4, 16)
    chat_turns: tuple[int, int] = (1, 3)
    doc_turns: tuple[int, int] = (1, 2)
    #: Probabilities of a chat and a document session (the rest are fresh prompts).
    p_chat: float = 0.55
    p_document: float = 0.35


def make_workload(
    seed: int, num_requests: int, vocab_size: int, shape: WorkloadShape | None = None
) -> list[Session]:
    """Sessions holding ``num_requests`` turns in total, deterministic in ``seed``."""
    shp = shape or WorkloadShape()
    rng = random.Random(seed)

    def toks(lo_hi: tuple[int, int]) -> tuple[int, ...]:
        return tuple(rng.randrange(vocab_size) for _ in range(rng.randint(*lo_hi)))

    systems = [toks(shp.system_len) for _ in range(shp.system_prompts)]
    docs = [toks(shp.document_len) for _ in range(shp.documents)]
    sessions: list[Session] = []
    left = num_requests
    while left > 0:
        r = rng.random()
        if r < shp.p_chat:
            prefix, n_turns, kind = rng.choice(systems), rng.randint(*shp.chat_turns), "chat"
        elif r < shp.p_chat + shp.p_document:
            prefix, n_turns, kind = rng.choice(docs), rng.randint(*shp.doc_turns), "doc"
        else:
            prefix, n_turns, kind = toks(shp.system_len), 1, "fresh"
        n_turns = min(n_turns, left)
        turns = tuple(Turn(toks(shp.user_len), rng.randint(*shp.max_new)) for _ in range(n_turns))
        sessions.append(Session(f"{kind}{len(sessions)}", prefix, turns))
        left -= n_turns
    return sessions


def total_turns(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)
