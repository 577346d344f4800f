"""Trace records and the two on-disk formats the simulator reads.

Two formats, one JSON object a line (JSON Lines; a ``.gz`` file is decompressed):

- ``mooncake``: ``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids`` (ids of
  the prompt's blocks, 512 tokens each unless ``block_tokens`` says otherwise; prefix-chained:
  an equal id means an equal block *and* an equal prefix before it; the last block may be
  partial). Optional ``tenant``.
- ``tokens``: ``timestamp`` (s), ``session_id``, optional ``tenant``, ``input_ids`` (the whole
  prompt, history included) and ``output_ids`` or ``output_length``.

A bad line raises :class:`TraceFormatError` naming the file, the line and what is wrong,
because a silently skipped line changes every hit rate; ``skip_bad_lines`` skips such lines
and counts them instead (:attr:`Trace.skipped`). Bad covers anything a line can hold: bytes
that are not UTF-8, integers too long to convert, nesting too deep for the JSON decoder,
non-finite numbers, strings that cannot be encoded, and a request longer than the model
allows (``max_tokens``). Requests are replayed in file order.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hybridcache.errors import HybridCacheError
from hybridcache.validation import integer_at_least

FORMATS = ("auto", "mooncake", "tokens")
#: Tokens per block of a Mooncake trace (the default of ``block_tokens``).
MOONCAKE_BLOCK = 512
_MAX_TOKEN = (1 << 32) - 1
#: Largest count a line may give (lengths): far above any real prompt, small enough that
#: arithmetic on it stays exact and cheap.
_MAX_COUNT = (1 << 40) - 1
_GZIP_MAGIC = b"\x1f\x8b"


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
    #: Line of the trace file the request came from (0 for generated requests).
    line: int = 0


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


def read_trace(
    path: str | Path,
    fmt: str = "auto",
    skip_bad_lines: bool = False,
    *,
    block_tokens: int | None = None,
    max_tokens: int | None = None,
) -> Trace:
    """Read a trace file; ``fmt`` ``auto`` looks at the first parsable line.

    Args:
        block_tokens: tokens per ``hash_ids`` block of a block-level trace (default 512, the
            Mooncake block); ignored for token traces.
        max_tokens: longest request (prompt + output) the model serves; a longer one is a bad
            line (``None``: no limit).

    Raises:
        TraceFormatError: a malformed line (unless ``skip_bad_lines``), an unknown format,
            a JSON array instead of JSON Lines, or a file with no request.
        OSError: the file cannot be read.
    """
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    block = MOONCAKE_BLOCK if block_tokens is None else block_tokens
    checked = integer_at_least(block, 1)
    if checked is None:
        raise TraceFormatError(f"block_tokens must be a positive integer, got {block_tokens!r}")
    block = checked
    if max_tokens is not None:
        limit = integer_at_least(max_tokens, 1)
        if limit is None:  # otherwise every line would be "longer than the model's maximum of 0"
            raise TraceFormatError(f"max_tokens must be a positive integer or None, got {max_tokens!r}")
        max_tokens = limit
    path = Path(path)
    lines = list(_lines(path))
    _refuse_json_array(path, lines)
    if fmt == "auto":
        fmt = _detect(path, lines)
    trace = Trace(str(path), fmt, block_tokens=block if fmt == "mooncake" else 0)
    for lineno, raw in lines:
        try:
            obj = _load(raw)
            req = _parse_mooncake(obj, block) if fmt == "mooncake" else _parse_tokens(obj)
            _check_length(req, max_tokens)
        except _BadLine as e:
            if not skip_bad_lines:
                raise TraceFormatError(f"{path}:{lineno}: {e}") from None
            trace.skipped += 1
            continue
        req.line = lineno
        trace.requests.append(req)
    if not trace.requests:
        raise TraceFormatError(f"{path}: no valid request in the trace")
    return trace


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines as bytes (decoded per line, so one bad byte is one bad line)."""
    with open(path, "rb") as probe:
        gz = probe.read(2) == _GZIP_MAGIC
    opener = gzip.open if gz else open
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    yield lineno, raw
    except (gzip.BadGzipFile, EOFError) as e:
        raise TraceFormatError(f"{path}: not a readable gzip file ({e})") from None


def _refuse_json_array(path: Path, lines: list[tuple[int, bytes]]) -> None:
    """A JSON array file (``[{...}, {...}]``) would fail on every line: say what it is."""
    if lines and lines[0][1].lstrip().startswith(b"["):
        raise TraceFormatError(
            f"{path}:{lines[0][0]}: the file starts with '[': it looks like one JSON array, but "
            "a trace holds one JSON object per line (JSON Lines); convert it, e.g. "
            "python -c \"import json,sys; [print(json.dumps(o)) for o in json.load(sys.stdin)]\""
        )


def _detect(path: Path, lines: list[tuple[int, bytes]]) -> str:
    """``mooncake`` if the first parsable line has ``hash_ids``, ``tokens`` if ``input_ids``."""
    for lineno, raw in lines[:50]:
        try:
            obj = _load(raw)
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


def _load(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadLine(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise _BadLine("invalid JSON (nested too deeply to decode)") from None
    except ValueError as e:  # e.g. an integer longer than Python converts (4,300 digits)
        raise _BadLine(f"invalid JSON ({e})") from None
    if not isinstance(obj, dict):
        hint = " (a trace holds one JSON object per line)" if isinstance(obj, list) else ""
        raise _BadLine(f"expected a JSON object, got {type(obj).__name__}{hint}")
    return obj


def _int(obj: dict, key: str, minimum: int = 0, required: bool = True) -> int:
    if key not in obj:
        if required:
            raise _BadLine(f"missing field {key!r}")
        return 0
    v = obj[key]
    if not isinstance(v, int) or isinstance(v, bool):
        raise _BadLine(f"field {key!r} must be an integer, got {_short(v)}")
    if v < minimum:
        raise _BadLine(f"field {key!r} must be >= {minimum}, got {v}")
    if v > _MAX_COUNT:
        raise _BadLine(f"field {key!r} is implausibly large ({_short(v)} > {_MAX_COUNT})")
    return v


def _number(obj: dict, key: str) -> float:
    v = obj.get(key, 0)
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise _BadLine(f"field {key!r} must be a number, got {_short(v)}")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise _BadLine(f"field {key!r} must be a finite number, got {_short(v)}")
    return f


def _short(v: object, limit: int = 60) -> str:
    """``repr`` of a value, cut so that a huge value makes a readable message."""
    try:
        text = repr(v)
    except (ValueError, RecursionError):  # an int past the conversion limit, deep nesting
        text = f"<{type(v).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _name(obj: dict, key: str) -> str | None:
    """A string field (tenant, session id); integers are accepted as their decimal text."""
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, (str, int)) or isinstance(v, bool):
        raise _BadLine(f"field {key!r} must be a string, got {_short(v)}")
    if isinstance(v, int) and abs(v) > _MAX_COUNT:
        raise _BadLine(f"field {key!r} is an implausibly large number")
    text = str(v)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadLine(f"field {key!r} holds a lone surrogate (not encodable as UTF-8)") from None
    return text


def _tenant(obj: dict) -> str | None:
    return _name(obj, "tenant")


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
    except (ValueError, OverflowError, TypeError, RecursionError):
        fast = False
    if fast and (arr.size == 0 or (int(arr.min()) >= 0 and int(arr.max()) <= _MAX_TOKEN)):
        return arr.astype(np.uint32)
    for i, x in enumerate(v):  # slow path only to name the bad element
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= _MAX_TOKEN:
            raise _BadLine(f"field {key!r}[{i}] must be an integer in [0, 2^32-1], got {_short(x)}")
    return np.asarray(v, dtype=np.uint32)


def length_problem(input_length: int, output_length: int, max_tokens: int | None) -> str | None:
    """Why a request of these lengths is longer than a model serving ``max_tokens`` (prompt and
    output, which the replay appends), or ``None``. One wording for a trace file's line
    (:func:`read_trace`) and a request built in code (``hybridcache.sim.runner.sweep``)."""
    total = input_length + output_length
    if max_tokens is None or total <= max_tokens:
        return None
    return (f"request of {total:,} tokens ({input_length:,} prompt + {output_length:,} "
            f"output) is longer than the model's maximum of {max_tokens:,}")


def block_count_problem(input_length: int, n_ids: int | None, block: int) -> str | None:
    """Why a block-level request's ids (``hash_ids``, ``TraceRequest.block_ids``) do not
    cover its prompt, ``ceil(input_length / block)`` of them, or ``None``."""
    need = -(-input_length // block)
    if n_ids == need:
        return None
    have = "no" if n_ids is None else str(n_ids)
    return f"'hash_ids' has {have} ids but input_length {input_length} needs ceil({input_length}/{block}) = {need}"


def _check_length(req: TraceRequest, max_tokens: int | None) -> None:
    problem = length_problem(req.input_length, req.output_length, max_tokens)
    if problem:
        raise _BadLine(problem)


def _parse_mooncake(obj: dict, block: int) -> TraceRequest:
    n_in = _int(obj, "input_length", 1)
    n_out = _int(obj, "output_length", 0)
    ids = _ids(obj, "hash_ids")
    assert ids is not None
    problem = block_count_problem(n_in, len(ids), block)
    if problem:
        hint = "" if block != MOONCAKE_BLOCK else " (another block size? pass --block-tokens)"
        raise _BadLine(problem + hint)
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
    sid = _name(obj, "session_id")
    if sid is None:
        raise _BadLine("missing field 'session_id'")
    return TraceRequest(
        timestamp=_number(obj, "timestamp"),
        input_length=len(inp),
        output_length=n_out,
        tenant=_tenant(obj),
        session_id=sid,
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
