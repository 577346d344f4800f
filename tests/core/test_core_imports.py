"""Boundaries of the core.

- The core imports neither torch nor an adapter: engines without torch (or with their own
  tensors) use the manager and the port as they are.
- Engines use the core only through its port (issue 13): ``adapters/vllm``,
  ``hybridcache/tiers`` and the simulator import none of the core's internal modules and
  read none of its internals. An AST check (below) finds both; tests run it on injected
  offenders to show that it can fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hybridcache import plans
from hybridcache.port import CachedPrefix, DevicePrefix, EnginePort, RequestView, SnapshotPin
from hybridcache.requests import Request

ROOT = Path(__file__).resolve().parents[2]


def test_core_import_path_has_no_torch_and_no_adapter():
    code = (
        "import sys\n"
        "import hybridcache, hybridcache.manager, hybridcache.port, hybridcache.port_import\n"
        "import hybridcache.policies, hybridcache.room, hybridcache.invariants, hybridcache.events\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('hybridcache.adapters')]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout


# ---------------------------------------------------------------------- the port boundary
#: The core's internal modules (``hybridcache.<name>``): its index, runs, arena, eviction
#: and request records.
INTERNAL_MODULES = frozenset({"index", "runs", "arena", "eviction", "requests"})
#: Members only the core's internals have: read on any object, they mean an engine holds
#: an index, an arena or a run.
INTERNAL_MEMBERS = frozenset({
    "arena", "handles", "kv_path", "hold_tables", "chain_holds", "hold_runs",
    "release_runs", "evictor",
})
#: The manager's internal members (read on a manager: ``manager.requests``, ``mgr.tick``).
MANAGER_INTERNALS = frozenset({"requests", "tick", "index", "arena", "admission", "_get"})
#: Names an engine module gives a core manager (other objects have other names: vLLM's
#: metadata ``m.num_prefills`` is not flagged, as its members are none of the above).
MANAGER_NAMES = frozenset({"manager", "mgr", "m", "core", "_m", "cache_manager"})
#: Index members that also exist on the port under the same name (``port.pin_snapshot``):
#: an offence only when read on an index.
INDEX_ONLY = frozenset({"pin_snapshot", "unpin_snapshot", "walk", "events"})
#: Private members through which a port, view or import reaches the core's records.
PRIVATE_LEAKS = frozenset({"_r", "_m", "_req", "_get", "_engine_pages", "_engine_slots"})
#: Record fields that the engines' own objects also have (a tail's ``pages`` and ``slot``,
#: a connector track's ``hasher``): not flagged by name. A record can only be reached
#: through ``manager.requests``, ``_get`` or a view's ``_r``, which are.
GENERIC_FIELDS = frozenset({"units", "pages", "slot", "saves", "hasher", "restore", "holds",
                            "walk", "counted"})


def _public(*types: type) -> set[str]:
    return {n for t in types for n in dir(t) if not n.startswith("_")}


def record_only_fields() -> frozenset[str]:
    """Fields of the core's request record that no public type of the port offers (so a
    read of one means a record was reached): derived from the classes, not listed."""
    public = _public(RequestView, EnginePort, CachedPrefix, DevicePrefix, SnapshotPin,
                     plans.Allocation, plans.MatchResult, plans.SavePoint, plans.CopyPlan)
    return frozenset(set(Request.__slots__) - public - GENERIC_FIELDS)


def _tail_name(node: ast.expr) -> str | None:
    """``x`` for ``x`` or ``a.b.x``: what an expression that holds an object is called."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _resolve(module: str | None, level: int, package: str) -> str:
    if not level:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(base + ([module] if module else []))


def _internal(module: str) -> bool:
    parts = module.split(".")
    return len(parts) >= 2 and parts[0] == "hybridcache" and parts[1] in INTERNAL_MODULES


class _Checker(ast.NodeVisitor):
    def __init__(self, package: str) -> None:
        self.package = package
        self.found: list[str] = []
        self.record_fields = record_only_fields()
        self._called: set[int] = set()

    def _flag(self, node: ast.AST, what: str) -> None:
        self.found.append(f"line {getattr(node, 'lineno', '?')}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if _internal(alias.name):
                self._flag(node, f"imports {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _resolve(node.module, node.level, self.package)
        if _internal(module):
            self._flag(node, f"imports from {module}")
        elif module == "hybridcache":
            for alias in node.names:
                if alias.name in INTERNAL_MODULES:
                    self._flag(node, f"imports hybridcache.{alias.name}")

    def visit_Call(self, node: ast.Call) -> None:
        self._called.add(id(node.func))
        name = _tail_name(node.func)
        if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
            if isinstance(node.args[0].value, str) and _internal(node.args[0].value):
                self._flag(node, f"imports {node.args[0].value}")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        attr, owner = node.attr, _tail_name(node.value)
        is_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if attr in INTERNAL_MEMBERS:
            self._flag(node, f"reads .{attr}")
        elif attr == "index" and id(node) not in self._called:
            self._flag(node, "reads .index")  # (``seq.index(x)`` is a call: allowed)
        elif attr in MANAGER_INTERNALS and owner in MANAGER_NAMES:
            self._flag(node, f"reads {owner}.{attr}")
        elif attr in INDEX_ONLY and owner == "index":
            self._flag(node, f"reads index.{attr}")
        elif attr in PRIVATE_LEAKS and not is_self:
            self._flag(node, f"reads {owner}.{attr}")
        elif attr in self.record_fields:
            self._flag(node, f"reads the request record field .{attr}")
        self.generic_visit(node)


def check_source(source: str, package: str) -> list[str]:
    """Offences of one module's source against the port boundary (``package``: the
    module's package, for relative imports)."""
    checker = _Checker(package)
    tree = ast.parse(source)
    for node in ast.walk(tree):  # calls first: ``x.index(...)`` is known as a call
        if isinstance(node, ast.Call):
            checker._called.add(id(node.func))
    checker.visit(tree)
    return checker.found


#: Folder -> the package it installs as.
ENGINE_DIRS = {"adapters/vllm": "hybridcache.adapters.vllm", "hybridcache/tiers": "hybridcache.tiers",
               "sim": "hybridcache.sim"}


def offences(folder: str) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        sub = ".".join(rel.parts[:-1])
        package = ENGINE_DIRS[folder] + (f".{sub}" if sub else "")
        out += [f"{path.relative_to(ROOT)} {o}" for o in check_source(path.read_text(), package)]
    return out


@pytest.mark.parametrize("folder", [
    "adapters/vllm",
    "hybridcache/tiers",
    "sim",
])
def test_engines_use_only_the_port(folder):
    assert offences(folder) == []


OFFENDERS = {
    "import": "import hybridcache.index\n",
    "import as": "import hybridcache.runs as r\n",
    "from import": "from hybridcache.arena import plan_layout\n",
    "from package": "from hybridcache import eviction\n",
    "relative": "from ...requests import Request\n",
    "type-checking": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hybridcache.index import UnitHandle\n",
    "import_module": "import importlib\nimportlib.import_module('hybridcache.index')\n",
    "requests": "def f(self):\n    return self.manager.requests['a']\n",
    "membership": "def f(self, rid):\n    return rid in self.manager.requests\n",
    "tick": "def f(mgr):\n    mgr.tick += 1\n",
    "admission": "def f(self, v):\n    return admission_points(self.manager.admission, v, 0, 9, 4)\n",
    "index": "def f(self):\n    return self.manager.index\n",
    "index handles": "def f(m, d):\n    return m.index.handles.get(d)\n",
    "index pin": "def f(index, node):\n    index.pin_snapshot(node)\n",
    "arena": "def f(self, s):\n    self.manager.arena.free_slot(s)\n",
    "kv_path": "def f(ix, d):\n    return ix.kv_path(d, 3)\n",
    "private get": "def f(self, rid):\n    return self.manager._get(rid).hasher\n",
    "view record": "def f(view):\n    return view._r.saves\n",
    "record field": "def f(mreq):\n    return mreq.units_allocated\n",
    "dup pages": "def f(req):\n    return len(req.dup_pages)\n",
}

CLEAN = {
    "sequence index": "def f(xs):\n    return xs.index(3)\n",
    "trace requests": "def f(trace):\n    return len(trace.requests)\n",
    "host tick": "def f(slot):\n    return slot.tick\n",
    "port pin": "def f(self, rid):\n    return self.port.pin_snapshot(rid, 64)\n",
    "tail pages": "def f(tail):\n    return tail.pages, tail.slot\n",
    "port import": "from hybridcache.port import EnginePort\nfrom ..errors import OutOfSpaceError\n",
    "views": "def f(self, rid):\n    v = self.port.request(rid)\n    return v.save_slots, v.rolling_slot\n",
}


@pytest.mark.parametrize("name", sorted(OFFENDERS))
def test_the_check_catches_an_injected_offender(name):
    assert check_source(OFFENDERS[name], "hybridcache.adapters.vllm"), name


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_the_check_lets_port_use_through(name):
    assert check_source(CLEAN[name], "hybridcache.adapters.vllm") == []


def test_the_check_finds_an_offender_injected_into_a_real_module():
    """The adapter's own manager module with one internal read added back fails."""
    src = (ROOT / "adapters/vllm/manager.py").read_text()
    assert check_source(src, "hybridcache.adapters.vllm") == []
    bad = src.replace("known = self.port.request(rid)", "known = self.manager.requests.get(rid)")
    assert bad != src and check_source(bad, "hybridcache.adapters.vllm")


def test_record_fields_are_derived_from_the_record():
    fields = record_only_fields()
    assert {"units_allocated", "dup_pages", "pending_rolling"} <= fields
    assert not fields & _public(RequestView)  # what the view offers is not an offence
