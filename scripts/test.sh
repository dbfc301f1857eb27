#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Two optional packages from Debian, installed when missing (as root): chromium, which the browser tests drive
# (tests/test_browser.py), and SIMDe's headers (libsimde-dev), with which tests/test_matvec.py runs the kernels' AVX-512
# branches on a CPU without AVX-512. Best effort: when apt-get cannot (no network, no such package), say so in one
# line and go on; those tests then skip and say why.
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -f /usr/include/simde/x86/avx512.h ] || missing+=(libsimde-dev)
if [ "$(id -u)" = 0 ] && [ "${#missing[@]}" -gt 0 ] && command -v apt-get >/dev/null; then
  updated="$(apt-get update -qq 2>&1 >/dev/null)" || true
  for package in "${missing[@]}"; do  # one at a time: a package this system lacks does not keep the other out
    if ! apt_errors="$(DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$package" 2>&1 >/dev/null)"; then
      last="$(printf '%s\n%s\n' "$updated" "$apt_errors" | grep -v '^[[:space:]]*$' | tail -n 1 || true)"
      echo "scripts/test.sh: warning: could not install $package with apt-get${last:+ ($last)};" \
           "the tests that need it will skip" >&2
    fi
  done
fi
source scripts/setup.sh requirements-test.txt
# atencion's matrix-vector kernel (src/atencion/nn/matvec.cpp) is compiled here, once per machine, rather than inside the
# first test that decodes (that test would see its one-line notice); where it cannot compile, the notice says why.
python -c "from atencion.nn.matvec import kernel; kernel()"
exec python -m pytest "$@"
