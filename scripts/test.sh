#!/usr/bin/env bash
# Installs everything the tests need, then runs the whole suite (CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
exec python3 -m pytest -q -p no:cacheprovider "$@"
