#!/usr/bin/env bash
# Set up .venv (first run only) with JupyterLab, and open the course notebooks (notebooks/, in Spanish) on the
# project's Python. Extra arguments go to JupyterLab (e.g. --no-browser --port 8890).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh requirements-notebooks.txt
# The notebooks ask for the kernel "python3". ipykernel installs its spec into .venv/share/jupyter, and the server
# runs its "python" as its own interpreter (this .venv's); JUPYTER_PATH puts it ahead of any other python3 kernel.
export JUPYTER_PATH="$PWD/.venv/share/jupyter${JUPYTER_PATH:+:$JUPYTER_PATH}"
# JupyterLab refuses to run as root unless told; as root (a container) tell it.
root_flag=()
if [ "$(id -u)" = 0 ]; then root_flag=(--allow-root); fi
exec python -m jupyterlab --notebook-dir=notebooks "${root_flag[@]}" "$@"
