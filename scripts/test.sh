#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The browser tests (tests/test_browser.py) drive Debian's chromium: as root, install it when missing.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
source scripts/setup.sh requirements-test.txt
exec python -m pytest "$@"
