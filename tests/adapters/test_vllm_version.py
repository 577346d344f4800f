"""Version policy and plugin hook of ``hybridcache.adapters.vllm``.

The import-time checks run in subprocesses so that a faked vLLM version or a blocked
``vllm`` module cannot leak into other tests' module cache.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_without_vllm_says_to_install_the_extra():
    r = _run(
        "import sys; sys.modules['vllm'] = None\n"
        "try:\n"
        "    import hybridcache.adapters.vllm\n"
        "except ImportError as e:\n"
        "    print('ERR', type(e).__name__, e)\n"
    )
    assert "ERR UnsupportedVllmError" in r.stdout, r.stdout + r.stderr
    assert "hybridcache-llm[vllm]" in r.stdout and "not installed" in r.stdout


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed (its version is faked)")
def test_unsupported_version_is_refused_with_the_supported_list():
    fake = (
        "import importlib.metadata as m\n"
        "m.version = lambda name: '0.99.1'\n"
    )
    r = _run(
        fake + "try:\n"
        "    import hybridcache.adapters.vllm\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    assert "ERR" in r.stdout, r.stdout + r.stderr
    assert "0.99.1" in r.stdout and "0.32.0" in r.stdout
    assert "HYBRIDCACHE_ALLOW_UNSUPPORTED_VLLM" in r.stdout
    # The override lets a user try a newer release deliberately.
    r = _run("import os; os.environ['HYBRIDCACHE_ALLOW_UNSUPPORTED_VLLM'] = '1'\n" + fake
             + "import hybridcache.adapters.vllm as v; print('OK', v.VLLM_VERSION)")
    assert "OK 0.99.1" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed")
def test_local_build_tags_are_accepted():
    from hybridcache.adapters.vllm.version import SUPPORTED_VLLM, is_supported

    assert is_supported(SUPPORTED_VLLM[0] + "+cpu")
    assert not is_supported("0.31.9")


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed")
def test_plugin_register_is_harmless_and_cheap():
    # In a fresh interpreter: register() must not raise, nor import vLLM's scheduler.
    r = _run(
        "import sys\n"
        "from hybridcache.adapters.vllm.plugin import register\n"
        "register(); register()\n"
        "print('SCHED', 'vllm.v1.core.sched.scheduler' in sys.modules)\n"
    )
    assert r.returncode == 0, r.stderr
    assert "SCHED False" in r.stdout


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed")
def test_plugin_warns_on_unsupported_version(monkeypatch, caplog):
    from hybridcache.adapters.vllm import plugin, version

    monkeypatch.setattr(version, "installed_vllm_version", lambda: "0.40.0")
    with caplog.at_level("WARNING", logger="hybridcache.adapters.vllm"):
        plugin.register()
    assert "0.40.0" in caplog.text and "not supported" in caplog.text


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed")
def test_entry_point_is_declared_for_vllm_plugins():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("hybridcache") == "hybridcache.adapters.vllm.plugin:register"


@pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM installed")
def test_vllm_loads_and_calls_the_plugin():
    r = _run(
        "from vllm.plugins import load_plugins_by_group\n"
        "plugins = load_plugins_by_group('vllm.general_plugins')\n"
        "plugins['hybridcache']()\n"
        "print('LOADED', sorted(plugins))\n"
    )
    assert r.returncode == 0, r.stderr
    assert "hybridcache" in r.stdout and "Failed to load plugin" not in r.stderr
