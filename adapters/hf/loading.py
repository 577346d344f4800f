"""Reading Hugging Face configs: dicts, ``config.json`` paths and transformers objects.

Every architecture builder reads its numbers through :class:`ConfigView`, so that a missing
or malformed field always raises :class:`~hybridcache.errors.SpecError` *naming the field*
(with its path inside nested configs such as K3's ``text_config``) instead of a bare
``KeyError`` deep inside the arithmetic.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hybridcache.errors import SpecError

_MISSING: Any = object()


def load_hf_config(config: object) -> dict[str, Any]:
    """A plain dict from a dict, a ``config.json`` path (or its directory) or a config object.

    transformers ``PretrainedConfig`` objects (and vLLM's own config classes, which derive
    from it) are read through ``to_dict()``, which also flattens nested sub-configs.
    """
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        return _read_json(Path(config))
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        data = to_dict()
        if not isinstance(data, Mapping):
            raise SpecError(f"config: {type(config).__name__}.to_dict() did not return a dict")
        return dict(data)
    raise SpecError(
        "config: expected a dict, a path to config.json (or its directory) or a "
        f"transformers PretrainedConfig, got {type(config).__name__}"
    )


def _read_json(path: Path) -> dict[str, Any]:
    if path.is_dir():
        path = path / "config.json"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(f"config: cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"config: {str(path)!r} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SpecError(f"config: {str(path)!r} must hold a JSON object")
    return data


class ConfigView:
    """Typed, read-only access to one (possibly nested) config dict.

    ``where`` is the dotted path of this dict inside the top-level config ("" at the top,
    "text_config." for K3's text model) and prefixes every field named in an error.
    """

    def __init__(self, data: Mapping[str, Any], where: str = "") -> None:
        self._data = data
        self._where = where

    def name(self, key: str) -> str:
        """The full dotted name of ``key``, as errors print it."""
        return f"{self._where}{key}"

    def has(self, key: str) -> bool:
        """Whether ``key`` is present with a value other than ``None``."""
        return self._data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        value = self._data.get(key)
        return default if value is None else value

    def _require(self, key: str, default: Any) -> Any:
        value = self._data.get(key)
        if value is None:
            if default is _MISSING:
                raise SpecError(f"{self.name(key)}: missing from the config")
            return default
        return value

    def integer(self, key: str, default: Any = _MISSING, *, minimum: int = 1) -> int:
        """An integer field ``>= minimum``; ``default`` when absent (error if no default)."""
        value = self._require(key, default)
        return self._check_int(key, value, minimum)

    def first_int(self, keys: Iterable[str], default: Any = _MISSING, *, minimum: int = 1) -> int:
        """The first of several spellings of one integer field that is present."""
        keys = tuple(keys)
        for key in keys:
            if self.has(key):
                return self.integer(key, minimum=minimum)
        if default is _MISSING:
            names = " / ".join(self.name(k) for k in keys)
            raise SpecError(f"{names}: missing from the config")
        return default

    def number(self, key: str, default: Any = _MISSING) -> float:
        value = self._require(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(f"{self.name(key)}: must be a number, got {value!r}")
        return float(value)

    def string(self, key: str, default: Any = _MISSING) -> str:
        value = self._require(key, default)
        if not isinstance(value, str):
            raise SpecError(f"{self.name(key)}: must be a string, got {value!r}")
        return value

    def int_list(self, key: str, default: Any = _MISSING, *, minimum: int = 0) -> list[int]:
        value = self._require(key, default)
        if not isinstance(value, (list, tuple)):
            raise SpecError(f"{self.name(key)}: must be a list of integers, got {value!r}")
        return [self._check_int(f"{key}[{i}]", v, minimum) for i, v in enumerate(value)]

    def str_list(self, key: str, default: Any = _MISSING) -> list[str]:
        value = self._require(key, default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise SpecError(f"{self.name(key)}: must be a list of strings, got {value!r}")
        return list(value)

    def sub(self, key: str, default: Any = _MISSING) -> ConfigView:
        """The nested dict ``key`` (K3's ``text_config``, Kimi's ``linear_attn_config``)."""
        value = self._require(key, default)
        if not isinstance(value, Mapping):
            raise SpecError(f"{self.name(key)}: must be an object, got {type(value).__name__}")
        return ConfigView(value, f"{self._where}{key}.")

    def _check_int(self, key: str, value: Any, minimum: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            # JSON writers sometimes emit 4.0 for 4: accept integral floats only.
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise SpecError(f"{self.name(key)}: must be an integer, got {value!r}")
        if value < minimum:
            raise SpecError(f"{self.name(key)}: must be >= {minimum}, got {value}")
        return value
