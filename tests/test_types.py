"""The type checker: mypy ``--strict`` over the planner (layer 0 of [Note: package layers]:
pure functions and frozen data, the modules a user reads first), ``memory`` and the public
surface of ``flatshard/__init__.py``, with zero errors. Modules they import are read for
their types (``--follow-imports=silent``) but not themselves held to ``--strict``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STRICT = [
    "errors.py",
    "layout.py",
    "stage.py",
    "shard_map.py",
    "plan.py",
    "mixed_precision.py",
    "malloc.py",
    "memory.py",
    "__init__.py",
]


def test_the_planner_and_the_public_surface_type_check_strictly():
    pytest.importorskip("mypy")  # (in the dev extras: CI has it)
    files = [str(ROOT / "src" / "flatshard" / f) for f in STRICT]
    args = ["--strict", "--ignore-missing-imports", "--follow-imports=silent", "--no-incremental"]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", *args, *files], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert out.returncode == 0, out.stdout + out.stderr
