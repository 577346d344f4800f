"""Trace records and the two on-disk formats the simulator reads.

Two formats, one JSON object a line:

- ``mooncake``: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (ids of
  the prompt's 512-token blocks, prefix-chained: an equal id means an equal block *and* an
  equal prefix before it; the last block may be partial). Optional ``tenant``.
- ``tokens``: ``timestamp`` (s), ``session_id``, optional ``tenant``, ``input_ids`` (the whole
  prompt, history included) and ``output_ids`` or ``output_length``.

A bad line raises :class:`TraceFormatError` naming the file, the line and what is wrong,
because a silently skipped line changes every hit rate; ``skip_bad_lines`` skips such lines
and counts them instead (:attr:`Trace.skipped`). Requests are replayed in file order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridcache.errors import HybridCacheError

FORMATS = ("auto", "mooncake", "tokens")
#: Tokens per block of a Mooncake trace.
MOONCAKE_BLOCK = 512
_MAX_TOKEN = (1 << 32) - 1


class TraceFormatError(HybridCacheError, ValueError):
    """A malformed trace line; the message names the file, the line and the problem."""


@dataclass
class TraceRequest:
    """One request of a trace, whichever format it came from.

    Exactly one of ``input_ids`` (token traces) and ``block_ids`` (Mooncake) is set.
    ``output_ids`` is set only when the trace carries the generated tokens.
    """

    timestamp: float
    input_length: int
    output_length: int
    tenant: str | None = None
    session_id: str | None = None
    input_ids: np.ndarray | None = None
    output_ids: np.ndarray | None = None
    block_ids: np.ndarray | None = None


@dataclass
class Trace:
    """Requests of one trace file plus what reading it found."""

    path: str
    format: str
    requests: list[TraceRequest] = field(default_factory=list)
    skipped: int = 0
    #: Tokens per block id of a block-level (Mooncake) trace; 0 for token traces.
    block_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def tenants(self) -> list[str]:
        return sorted({r.tenant or "" for r in self.requests})


def read_trace(path: str | Path, fmt: str = "auto", skip_bad_lines: bool = False) -> Trace:
    """Read a trace file; ``fmt`` ``auto`` looks at the first non-empty line.

    Raises:
        TraceFormatError: a malformed line (unless ``skip_bad_lines``), an unknown format,
            or a file with no request.
        OSError: the file cannot be read.
    """
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    path = Path(path)
    lines = list(_lines(path))
    if fmt == "auto":
        fmt = _detect(path, lines)
    parse = _parse_mooncake if fmt == "mooncake" else _parse_tokens
    trace = Trace(str(path), fmt, block_tokens=MOONCAKE_BLOCK if fmt == "mooncake" else 0)
    for lineno, text in lines:
        try:
            trace.requests.append(parse(_load(text)))
        except _BadLine as e:
            if not skip_bad_lines:
                raise TraceFormatError(f"{path}:{lineno}: {e}") from None
            trace.skipped += 1
    if not trace.requests:
        raise TraceFormatError(f"{path}: no valid request in the trace")
    return trace


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if text.strip():
                yield lineno, text


def _detect(path: Path, lines: list[tuple[int, str]]) -> str:
    """``mooncake`` if the first parsable line has ``hash_ids``, ``tokens`` if ``input_ids``."""
    for lineno, text in lines[:50]:
        try:
            obj = _load(text)
        except _BadLine:
            continue
        if "hash_ids" in obj:
            return "mooncake"
        if "input_ids" in obj:
            return "tokens"
        raise TraceFormatError(
            f"{path}:{lineno}: cannot tell the format: neither 'hash_ids' (mooncake) nor "
            "'input_ids' (tokens) is present; pass --trace-format"
        )
    raise TraceFormatError(f"{path}: no parsable JSON line to detect the format from")


class _BadLine(Exception):
    pass


def _load(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def _int(obj: dict, key: str, minimum: int = 0, required: bool = True) -> int:
    if key not in obj:
        if required:
            raise _BadLine(f"missing field {key!r}")
        return 0
    v = obj[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise _BadLine(f"field {key!r} must be an integer, got {v!r}")
    if v < minimum:
        raise _BadLine(f"field {key!r} must be >= {minimum}, got {v}")
    return v


def _number(obj: dict, key: str) -> float:
    v = obj.get(key, 0)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _BadLine(f"field {key!r} must be a number, got {v!r}")
    return float(v)


def _tenant(obj: dict) -> str | None:
    t = obj.get("tenant")
    if t is None:
        return None
    if not isinstance(t, (str, int)) or isinstance(t, bool):
        raise _BadLine(f"field 'tenant' must be a string, got {t!r}")
    return str(t)


def _ids(obj: dict, key: str, required: bool = True) -> np.ndarray | None:
    if key not in obj:
        if required:
            raise _BadLine(f"missing field {key!r}")
        return None
    v = obj[key]
    if not isinstance(v, list):
        raise _BadLine(f"field {key!r} must be a list of integers, got {type(v).__name__}")
    try:
        arr = np.asarray(v)
        fast = arr.ndim == 1 and (arr.dtype.kind in "iu" or arr.size == 0)
    except (ValueError, OverflowError):
        fast = False
    if fast and (arr.size == 0 or (int(arr.min()) >= 0 and int(arr.max()) <= _MAX_TOKEN)):
        return arr.astype(np.uint32)
    for i, x in enumerate(v):  # slow path only to name the bad element
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= _MAX_TOKEN:
            raise _BadLine(f"field {key!r}[{i}] must be an integer in [0, 2^32-1], got {x!r}")
    return np.asarray(v, dtype=np.uint32)


def _parse_mooncake(obj: dict) -> TraceRequest:
    n_in = _int(obj, "input_length", 1)
    n_out = _int(obj, "output_length", 0)
    ids = _ids(obj, "hash_ids")
    assert ids is not None
    need = -(-n_in // MOONCAKE_BLOCK)
    if len(ids) != need:
        raise _BadLine(
            f"'hash_ids' has {len(ids)} ids but input_length {n_in} needs "
            f"ceil({n_in}/{MOONCAKE_BLOCK}) = {need}"
        )
    return TraceRequest(
        timestamp=_number(obj, "timestamp"),
        input_length=n_in,
        output_length=n_out,
        tenant=_tenant(obj),
        block_ids=ids,
    )


def _parse_tokens(obj: dict) -> TraceRequest:
    inp = _ids(obj, "input_ids")
    assert inp is not None
    if len(inp) == 0:
        raise _BadLine("field 'input_ids' is empty")
    out = _ids(obj, "output_ids", required=False)
    if out is not None:
        n_out = len(out)
        if "output_length" in obj and _int(obj, "output_length") != n_out:
            raise _BadLine(
                f"'output_length' {obj['output_length']} != len(output_ids) {n_out}"
            )
    elif "output_length" in obj:
        n_out = _int(obj, "output_length")
    else:
        raise _BadLine("missing field 'output_ids' or 'output_length'")
    sid = obj.get("session_id")
    if sid is None:
        raise _BadLine("missing field 'session_id'")
    if not isinstance(sid, (str, int)) or isinstance(sid, bool):
        raise _BadLine(f"field 'session_id' must be a string, got {sid!r}")
    return TraceRequest(
        timestamp=_number(obj, "timestamp"),
        input_length=len(inp),
        output_length=n_out,
        tenant=_tenant(obj),
        session_id=str(sid),
        input_ids=inp,
        output_ids=out,
    )


def write_token_trace(path: str | Path, requests: list[TraceRequest]) -> None:
    """Write token-level requests as a ``tokens`` trace (one JSON object a line)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            obj: dict[str, object] = {"timestamp": round(r.timestamp, 3), "session_id": r.session_id}
            if r.tenant is not None:
                obj["tenant"] = r.tenant
            assert r.input_ids is not None
            obj["input_ids"] = r.input_ids.tolist()
            if r.output_ids is not None:
                obj["output_ids"] = r.output_ids.tolist()
            else:
                obj["output_length"] = r.output_length
            f.write(json.dumps(obj, separators=(",", ":")) + "\n")
