#!/usr/bin/env bash
# Set up .venv (first run only) and run the main job. Extra arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh requirements.txt
exec atencion demo "$@"
