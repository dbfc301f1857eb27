#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The browser tests (tests/test_browser.py) drive Debian's chromium: as root, install it when missing. Best effort:
# when apt-get cannot (no network, no such package), say so in one line and go on; those tests then skip and say why.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  if ! apt_errors="$( { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
                      2>&1 >/dev/null )"; then
    last="$(printf '%s\n' "$apt_errors" | grep -v '^[[:space:]]*$' | tail -n 1 || true)"
    echo "scripts/test.sh: warning: could not install chromium with apt-get${last:+ ($last)};" \
         "the browser tests will skip" >&2
  fi
fi
source scripts/setup.sh requirements-test.txt
# atencion's matrix-vector kernel (src/atencion/nn/matvec.cpp) is compiled here, once per machine, rather than inside the
# first test that decodes (that test would see its one-line notice); where it cannot compile, the notice says why.
python -c "from atencion.nn.matvec import kernel; kernel()"
exec python -m pytest "$@"
