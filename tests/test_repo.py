"""The repository keeps its promises: CI runs the README's test command, lint is clean,
modules stay small."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands():
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_readme_top_shows_two_commands_and_ci_runs_the_test_one():
    main_job, tests = _readme_commands()
    assert "flatshard train" in main_job and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci, f"{tests!r} is not a line of .ci/run"


def test_lint_and_format_are_clean():
    paths = ["src", "tests", "benchmarks"]
    check = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *paths], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_no_module_over_600_lines():
    long = {p.name: n for p in (ROOT / "src").rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"split these by concept: {long}"
