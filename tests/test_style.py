"""The code passes the declared linter: `ruff check` with pyproject.toml's [tool.ruff] settings."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                    reason="ruff is not installed (pip install -r requirements-test.txt)")
def test_the_code_passes_the_declared_linter():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise",
                             "src", "tests", "benchmarks", "notebooks"], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"ruff check src tests benchmarks notebooks:\n{result.stdout}{result.stderr}", pytrace=False)
