"""The type checker, with zero errors: mypy over all of ``src/``, and ``--strict`` over the
planner (layer 0 of [Note: package layers]: pure functions and frozen data, the modules a
user reads first), ``memory`` and the public surface of ``flatshard/__init__.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRICT = [
    "errors.py",
    "planner",
    "toolkit/malloc.py",
    "memory.py",
    "__init__.py",
]


def _mypy(*args: str) -> None:
    pytest.importorskip("mypy")  # (in the dev extras: CI has it)
    command = [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--no-incremental", *args]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_package_type_checks():
    _mypy(str(ROOT / "src"))


def test_the_planner_and_the_public_surface_type_check_strictly():
    # (modules they import are read for their types but not held to --strict themselves)
    _mypy("--strict", "--follow-imports=silent", *(str(ROOT / "src" / "flatshard" / f) for f in STRICT))
