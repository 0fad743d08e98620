"""The type checker, with zero errors, in one run: mypy over all of ``src/``, holding the
planner (layer 0 of [Note: package layers]: pure functions and frozen data, the modules a
user reads first), ``errors``, ``memory`` and the public surface of ``flatshard/__init__.py``
to what ``--strict`` asks (``[tool.mypy]`` in ``pyproject.toml``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from _early import WAIT_S, Early

ROOT = Path(__file__).resolve().parents[2]


def _mypy(*args: str) -> subprocess.CompletedProcess | None:
    if importlib.util.find_spec("mypy") is None:
        return None  # (in the dev extras: CI has it)
    command = [sys.executable, "-m", "mypy", "--no-incremental", *args]
    # (about a minute alone; a hang guard, not a budget: two CI runs beside other work on the
    # same 2 cores took over 600 s, so it waits as long as the early job's own wait)
    return subprocess.run(command, capture_output=True, text=True, timeout=WAIT_S - 60, cwd=ROOT)


MYPY = Early(__file__, lambda: _mypy(str(ROOT / "src")))  # ([Note: early starts] in _early.py)


def test_the_package_type_checks_and_its_first_layers_strictly():
    out = MYPY.result()
    if out is None:
        pytest.skip("mypy is not installed (pip install -e '.[dev]')")
    assert out.returncode == 0, out.stdout + out.stderr
