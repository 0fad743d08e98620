"""The command line run in the test's own process, for the tests of several features."""

import contextlib
import io
import subprocess


def cli(*args) -> subprocess.CompletedProcess:
    """``python -m flatshard ARGS`` in this process, for commands that start no ranks (plan,
    layout, export, verify, --help): what a process would return, without its interpreter
    start and torch import (~3 s each)."""
    from flatshard.app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # (argparse's errors and --help)
            code = e.code if isinstance(e.code, int) else 1
    return subprocess.CompletedProcess(["flatshard", *args], code, out.getvalue(), err.getvalue())


def missing_from_help(command: str, options: tuple[str, ...]) -> list[str]:
    """The ``options`` that ``python -m flatshard COMMAND --help`` does not list (all of them
    if it fails)."""
    out = cli(command, "--help")
    return [o for o in options if out.returncode != 0 or o not in out.stdout]
