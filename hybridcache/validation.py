"""Argument checks of the public API, run before any state changes.

Why a module of its own: the manager's promise is that bad input raises the library's
documented error (:mod:`hybridcache.errors`) *before* anything changes, so a caller can
catch it and go on with an intact cache. Python's own errors for the same input arrive
late (``allocate(r, 1.5)`` used to fail with ``TypeError`` after taking a block) or are
silent (``commit(r, nan)``: every comparison with NaN is false). Each check here is
called at the top of a public method and costs a type test on the common path.

Settings are checked when they are made: :class:`~hybridcache.config.CacheConfig` calls
:func:`check_cache_config` in ``__post_init__`` and the manager calls
:func:`check_manager_args`, so a bad field is a :class:`ConfigError` naming it at
construction, not an ``AttributeError`` at the first request.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np

from hybridcache.errors import CapacityError, ConfigError, InvalidRequestError

__all__ = [
    "as_count",
    "check_cache_config",
    "check_digests",
    "check_key",
    "check_manager_args",
    "check_request_id",
    "unhashable_request_id",
    "check_text",
    "integer_at_least",
    "number_at_least",
]


def _integer(value: object) -> int | None:
    """``value`` as an ``int`` if it is an integer (numpy ones too) and not a bool."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)):
        return None  # bool is an int subclass: True must not be a count of 1
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def integer_at_least(value: object, minimum: int) -> int | None:
    """``value`` as an ``int`` (Python or NumPy integer; not bool, float or NaN) if it is at
    least ``minimum``, else ``None``: the one test behind every "an int >= N" argument, each
    caller raising its own error (``ConfigError`` for a setting, ``ValueError`` in the
    simulator's generator, ``TraceFormatError`` in its reader)."""
    n = _integer(value)
    return n if n is not None and n >= minimum else None


def number_at_least(value: object, minimum: float, *, strict: bool = False) -> float | None:
    """``value`` as a ``float`` if it is a finite real number (not bool, NaN or infinite) at
    least ``minimum`` (above it where ``strict``), else ``None``: the one test behind every
    "a finite number >= x" argument, each caller raising its own error."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    x = float(value)
    if not math.isfinite(x) or x < minimum or (strict and x == minimum):
        return None
    return x


def as_count(value: object, what: str) -> int:
    """``value`` as an ``int`` count (Python or numpy integer; not bool, float or NaN).

    Raises:
        InvalidRequestError: not an integer; ``what`` names the argument.
    """
    if type(value) is int:  # the common call: no second function
        return value
    n = _integer(value)
    if n is None:
        raise InvalidRequestError(f"{what} must be an integer, got {value!r}")
    return n


def check_request_id(request_id: object) -> None:
    """Request ids are dict keys: they must be hashable."""
    try:
        hash(request_id)
    except TypeError:
        raise unhashable_request_id(request_id) from None


def unhashable_request_id(request_id: object) -> InvalidRequestError:
    """The error for an id that cannot be a dict key (raised where a look-up found it so)."""
    return InvalidRequestError(f"request id must be hashable (a str), got {type(request_id).__name__}")


def check_text(value: str, what: str, error: type[Exception] = InvalidRequestError) -> bytes:
    """The UTF-8 bytes of ``value``; a lone surrogate cannot be encoded and is refused."""
    try:
        return value.encode()
    except UnicodeEncodeError as e:
        raise error(f"{what} {value!r} is not valid text: {e.reason} at {e.start}") from None


def check_key(tenant: object, lora: object) -> None:
    """Types of the hash-chain keys: tenant ``str | None``, LoRA ``str | int | None``
    (numpy integers count as ``int``).

    Types only (cheap, every request); their text is checked when the root digest is made
    (:func:`hybridcache.hashing.root_digest`, cached per key). A tenant ``5`` would hash
    as ``"5"`` if it were stringified, so it is refused instead.
    """
    if tenant is not None and not isinstance(tenant, str):
        raise InvalidRequestError(f"tenant must be a str or None, got {type(tenant).__name__}")
    if lora is not None and (not isinstance(lora, (str, int, np.integer)) or isinstance(lora, bool)):
        raise InvalidRequestError(f"lora must be a str, an int or None, got {type(lora).__name__}")


def check_digests(digests: object, token_ids: object, request_id: object) -> int:
    """The ``digests=`` form of ``add_request``: a sequence of ``bytes`` and a token count.

    Returns:
        The number of tokens (``token_ids`` is a count or a sequence whose length counts).
    """
    if isinstance(digests, (str, bytes)) or not isinstance(digests, Sequence):
        raise InvalidRequestError(
            f"request {request_id!r}: digests must be a sequence of bytes, got {type(digests).__name__}"
        )
    for i, d in enumerate(digests):
        if not isinstance(d, bytes) or not d:
            raise InvalidRequestError(
                f"request {request_id!r}: digest {i} must be non-empty bytes, got {type(d).__name__}"
            )
    n = _integer(token_ids)
    if n is None:
        try:
            n = len(token_ids)  # type: ignore[arg-type]
        except TypeError:
            raise InvalidRequestError(
                f"request {request_id!r}: with digests, token_ids must be a token count or "
                f"a sequence, got {type(token_ids).__name__}"
            ) from None
    if n < 0:
        raise InvalidRequestError(f"request {request_id!r}: negative token count {n}")
    return n


# ---------------------------------------------------------------------- settings
def _positive_int(cfg: object, field: str, minimum: int = 1) -> None:
    value = getattr(cfg, field)
    if integer_at_least(value, minimum) is None:
        raise ConfigError(f"{field} must be an int >= {minimum}, got {value!r}")


def _str_field(cfg: object, field: str) -> str:
    value = getattr(cfg, field)
    if not isinstance(value, str):
        raise ConfigError(f"{field} must be a str, got {type(value).__name__}")
    return value


def check_cache_config(cfg: Any) -> None:
    """Every field of a :class:`~hybridcache.config.CacheConfig` (names are checked by the
    manager, which knows the registries: :class:`UnknownNameError` lists the known ones).

    Raises:
        ConfigError: the message names the field.
    """
    _positive_int(cfg, "hash_unit")
    _positive_int(cfg, "marconi_window")
    _positive_int(cfg, "min_seen")
    _positive_int(cfg, "alignment")
    if cfg.alignment & (cfg.alignment - 1):
        raise ConfigError(f"alignment must be a power of two, got {cfg.alignment!r}")
    for field in ("hash_algo", "admission", "eviction"):
        _str_field(cfg, field)
    check_text(_str_field(cfg, "hash_seed"), "hash_seed", ConfigError)
    alpha = cfg.marconi_alpha
    if number_at_least(alpha, 0.0) is None:
        raise ConfigError(f"marconi_alpha must be a finite number >= 0, got {alpha!r}")
    _check_quotas(cfg.tenant_quotas)


def _check_quotas(quotas: object) -> None:
    if quotas is None:
        return
    if not isinstance(quotas, Mapping):
        raise ConfigError(f"tenant_quotas must be a dict of tenant -> bytes, got {type(quotas).__name__}")
    for tenant, q in quotas.items():
        if not isinstance(tenant, str):
            raise ConfigError(f"tenant_quotas: tenant names are str, got {tenant!r}")
        n = _integer(q)
        if n is None or n < 0:
            raise ConfigError(f"tenant_quotas[{tenant!r}] must be an int >= 0 bytes, got {q!r}")


def check_manager_args(spec: object, capacity_bytes: object, config: object) -> None:
    """The manager's constructor arguments, before it builds anything.

    Raises:
        ConfigError: a wrong type (the field named).
        CapacityError: a budget too small to serve even a one-token request: one state
            slot (models with state) plus one page per attention group, where a block is
            either a slab of pages or state slots (see :mod:`hybridcache.arena`).
    """
    from hybridcache.arena import plan_layout  # the arena imports nothing of ours that needs this
    from hybridcache.config import CacheConfig
    from hybridcache.spec import ModelSpec

    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    if config is not None and not isinstance(config, CacheConfig):
        raise ConfigError(f"config must be a CacheConfig or None, got {type(config).__name__}")
    capacity = _integer(capacity_bytes)
    if capacity is None or capacity <= 0:
        raise ConfigError(
            f"capacity_bytes must be a positive int number of bytes, got {capacity_bytes!r} "
            "(parse sizes such as '8GiB' with hybridcache.sim.sizes.parse_size)"
        )
    cfg = config or CacheConfig()
    layout = plan_layout(spec, capacity, cfg.hash_unit, cfg.alignment)  # CapacityError if < 1 block
    groups = len(layout.page_payload)
    need = (1 if layout.slots_per_block else 0) + (
        -(-groups // layout.pages_per_block) if groups else 0
    )
    if layout.num_blocks < need:
        raise CapacityError(
            f"capacity_bytes {capacity} B holds {layout.num_blocks} block(s) of {layout.block_bytes} B "
            f"but a request of {spec.name!r} needs {need} (a state slot and a page per attention "
            f"group): needs at least {need * layout.block_bytes} B"
        )
