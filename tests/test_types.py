"""The type checker, with zero errors, in one run: mypy over all of ``src/``, holding the
planner (layer 0 of [Note: package layers]: pure functions and frozen data, the modules a
user reads first), ``errors``, ``memory`` and the public surface of ``flatshard/__init__.py``
to what ``--strict`` asks (``[tool.mypy]`` in ``pyproject.toml``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mypy(*args: str) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy")  # (in the dev extras: CI has it)
    command = [sys.executable, "-m", "mypy", "--no-incremental", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_package_type_checks_and_its_first_layers_strictly():
    out = _mypy(str(ROOT / "src"))
    assert out.returncode == 0, out.stdout + out.stderr
