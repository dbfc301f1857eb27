#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh requirements-test.txt
exec python -m pytest "$@"
