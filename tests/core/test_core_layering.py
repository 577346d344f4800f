"""The core's source imports no torch, no engine and no adapter, not even lazily.

``test_core_imports`` checks what importing the core loads; this checks every import
statement in the core's modules, including those inside functions (which only run on some
paths, so an import-time check misses them). Engines without torch, and packages that add
presets or policies, depend on that layering.
"""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

import hybridcache

CORE = Path(hybridcache.__file__).parent
#: Top-level packages the core must not import, and side packages of hybridcache.
FORBIDDEN = ("torch", "triton", "vllm", "transformers", "redis")
FORBIDDEN_SIDE = ("hybridcache.adapters", "hybridcache.kernels", "hybridcache.sim")


def forbidden_imports(source: str) -> list[str]:
    """Every module ``source`` imports that the core may not, as ``line: module``."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        hit = [n for n in names if _forbidden(n)]
        if hit:  # one entry per statement: the module, or the first name imported from it
            bad.append((node.lineno, hit[0]))
    return [f"{line}: {name}" for line, name in sorted(bad)]


def _forbidden(name: str) -> bool:
    return name.split(".")[0] in FORBIDDEN or any(
        name == s or name.startswith(s + ".") for s in FORBIDDEN_SIDE
    )


def core_modules() -> list[Path]:
    """The core's own modules: the package's files and ``policies``, not the tiers (I/O)."""
    return sorted([*CORE.glob("*.py"), *(CORE / "policies").glob("*.py")])


def test_checker_catches_each_kind_of_forbidden_import():
    src = (
        "import torch\n"
        "def f():\n    from hybridcache.adapters.hf import presets\n"
        "from hybridcache import kernels\n"
        "import numpy, hybridcache.spec\n"
    )
    assert forbidden_imports(src) == ["1: torch", "3: hybridcache.adapters.hf", "4: hybridcache.kernels"]


@pytest.mark.parametrize("path", core_modules(), ids=lambda p: p.name)
def test_core_module_imports_nothing_forbidden(path: Path):
    assert forbidden_imports(path.read_text()) == []


def test_moved_storage_forwards_with_a_warning():
    sys.modules.pop("hybridcache.storage", None)
    old = importlib.import_module("hybridcache.storage")
    with pytest.warns(DeprecationWarning, match="hybridcache.kernels.storage"):
        cls = old.ArenaStorage
    from hybridcache.kernels.storage import ArenaStorage

    assert cls is ArenaStorage
    with warnings.catch_warnings(), pytest.raises(AttributeError):
        warnings.simplefilter("error")
        old.NoSuchName  # noqa: B018


def test_presets_come_through_the_entry_point_group():
    from importlib.metadata import entry_points

    from hybridcache import presets

    eps = {ep.name: ep.value for ep in entry_points(group=presets.PRESET_ENTRY_POINTS)}
    assert eps.get("hf") == "hybridcache.adapters.hf.presets:register_hf_presets"
    assert "qwen3-next-80b" in presets.preset_names()
