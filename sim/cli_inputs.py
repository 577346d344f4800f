"""What the command line checks before a replay starts: model, policies, sizes, output paths.

A sweep can run for many minutes, so everything a user can mistype is checked first: the
model (a preset name or a Hugging Face ``config.json``), the policy list, the capacities and
every output path. Each check raises an error whose message says what to type instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from hybridcache.errors import HybridCacheError, UnknownNameError
from hybridcache.presets import get_preset, preset_names, register_preset
from hybridcache.sim.policies import NATIVE_POLICIES, POLICIES, not_applicable, parse_policies
from hybridcache.spec import ModelSpec

#: ``all`` leaves out the vLLM-native policies: they need the vllm extra and start vLLM
#: (seconds per run).
ALL = tuple(p for p in POLICIES if p not in NATIVE_POLICIES)
VLLM_HINT = "install the vllm extra: pip install 'hybridcache-llm[vllm]'"
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
_DECIMAL = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT][bB])\s*$")


class InputError(HybridCacheError, ValueError):
    """A command-line input that cannot work; the message says what would."""


def resolve_model(text: str) -> tuple[str, ModelSpec]:
    """``(name, spec)`` of a preset name or of a Hugging Face ``config.json`` (or its folder).

    A config is converted by :func:`hybridcache.adapters.hf.spec_from_hf_config` and
    registered as a preset under the path given, so that the sweep (which takes preset
    names) and the JSON output name it as the user wrote it.
    """
    if text in preset_names():
        return text, get_preset(text)
    path = Path(text)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        from hybridcache.adapters.hf import spec_from_hf_config

        spec = spec_from_hf_config(path)
        register_preset(text, lambda: spec, replace=True)
        return text, spec
    raise UnknownNameError(
        f"--model {text!r} is neither a preset nor a Hugging Face config.json; presets: "
        f"{', '.join(preset_names())} (or a path to config.json or the folder holding it)"
    )


def select_policies(text: str, spec: ModelSpec, token_trace: bool) -> tuple[list[str], list[str]]:
    """The policies to replay and the notes to print about the ones left out.

    ``all`` is every policy but the vLLM-native ones (vLLM's own manager at its default and
    at its strongest setting); ``all-native`` adds them. Either drops the policies that
    cannot model ``spec`` (with a note). A native policy asked for by name must be able to
    run: otherwise it is an error saying why and how to enable it.
    """
    word = text.strip()
    notes: list[str] = []
    if word in ("all", "all-native"):
        names = list(ALL) + (list(NATIVE_POLICIES) if word == "all-native" else [])
        if word == "all":
            notes.append("vllm-native and vllm-native-best (vLLM's own manager) are not in "
                         "'all': ask for them with --policy all-native or by name")
        for name in list(names):
            reason = not_applicable(name, spec) or (
                _native_reason(token_trace) if name in NATIVE_POLICIES else None)
            if reason:
                names.remove(name)
                notes.append(f"skipping {reason}")
        return names, notes
    try:
        names = parse_policies(word)
    except UnknownNameError as e:
        raise UnknownNameError(str(e) + ", all-native") from None
    for name in names:
        if name in NATIVE_POLICIES:
            reason = not_applicable(name, spec) or _native_reason(token_trace)
            if reason:
                raise InputError(reason)
    return names, notes


def _native_reason(token_trace: bool) -> str | None:
    if not token_trace:
        return "vLLM-native policies replay token traces only (this trace has block ids, not tokens)"
    from hybridcache.sim.vllm_native import unavailable_reason

    reason = unavailable_reason()
    return f"{reason}; {VLLM_HINT}" if reason else None


def decimal_notes(text: str) -> list[str]:
    """A note for each decimal size (``8GB``) saying what it means in bytes and in GiB."""
    notes = []
    for part in text.split(","):
        m = _DECIMAL.match(part)
        if m:
            from hybridcache.sim.sizes import format_bytes, parse_size

            n = parse_size(part)
            notes.append(f"{part.strip()} is decimal: {n:,} bytes ({format_bytes(n)}); "
                         f"write {m.group(1)}{m.group(2)[0].upper()}iB for the binary size")
    return notes


def check_output(path: str | os.PathLike[str], what: str, suffixes: Sequence[str] = ()) -> Path:
    """Fail now, not after the replay, if ``path`` cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{what} {str(p)!r} is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(f"{what} {str(p)!r}: folder {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise InputError(f"{what} {str(p)!r}: not writable")
    if suffixes and p.suffix.lower() not in suffixes:
        raise InputError(f"{what} {str(p)!r}: the file name must end in {', '.join(suffixes)}")
    return p


def check_out_dir(path: str | os.PathLike[str]) -> Path:
    """The demo's output folder: created if missing, and it must be writable."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"--out {str(p)!r} is a file; give a folder")
    p.mkdir(parents=True, exist_ok=True)
    if not os.access(p, os.W_OK):
        raise InputError(f"--out {str(p)!r}: not writable")
    return p
