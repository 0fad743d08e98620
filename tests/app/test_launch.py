"""The CLI's launcher stops every rank as soon as one fails and says which and how."""

from __future__ import annotations

import sys
import time

import pytest

from flatshard.app.launcher import run_ranks

RANK_1_FAILS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    time.sleep(0.5)
    {action}
time.sleep(120)  # rank 0: busy, never failing by itself
"""


@pytest.mark.parametrize(
    ("action", "code", "said"),
    [
        ("sys.exit(3)", 3, "rank 1 (pid {pid}) exited with code 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 128 + 9, "rank 1 (pid {pid}) was killed by SIGKILL"),
        ("os.kill(os.getpid(), signal.SIGTERM)", 128 + 15, "rank 1 (pid {pid}) was killed by SIGTERM"),
    ],
)
def test_a_failing_rank_stops_the_others_and_is_named(action, code, said, capfd):
    start = time.monotonic()
    got = run_ranks([sys.executable, "-c", RANK_1_FAILS.format(action=action)], 3, cpu=True)
    assert time.monotonic() - start < 15  # not rank 0's 120 s
    assert got == code
    err = capfd.readouterr().err
    prefix, _, rest = said.partition("{pid}")
    assert prefix in err and rest in err and "stopping the other ranks" in err, err


def test_ranks_that_all_succeed_return_zero():
    assert run_ranks([sys.executable, "-c", "import time; time.sleep(0.2)"], 2) == 0
