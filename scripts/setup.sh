# Sourced by demo.sh and test.sh: create .venv with Python 3.11 (or python3) and install into it.
# Usage: source scripts/setup.sh REQUIREMENTS_FILE
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="$(command -v python3.11 || command -v python3)"
if [ ! -x "$root/.venv/bin/python" ]; then
  "$python_bin" -m venv "$root/.venv"
fi
stamp="$root/.venv/.installed-$(basename "$1")"
if [ ! -f "$stamp" ] || [ "$1" -nt "$stamp" ] || [ "$root/requirements.txt" -nt "$stamp" ] \
   || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$1"
  "$root/.venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$root"
  touch "$stamp"
fi
export PATH="$root/.venv/bin:$PATH"
