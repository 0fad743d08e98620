"""Heavy checks that start as soon as the suite is collected, beside the tests before them.

[Note: early starts]

A few checks are one long job each that needs nothing from the tests around it: the type
checker over ``src/`` (a subprocess, ~60 s) and the Hugging Face type sweep (two one-rank
runs, ~55 s). Run in their turn they add their whole time to the suite's; started at the end
of collection they run on the cores the multi-rank tests leave idle while their ranks wait
on each other (the two cores are ~70% busy), and the test that needs the result waits only
for what is left. A job starts only if a test of its module was selected; a test whose job
was never started (its module run alone, by a tool) runs it there and then.

Under pytest-xdist every worker collects every test, so only the first worker (``gw0``)
starts the jobs; it leaves each result in a file named by the run, where a test on another
worker reads it. The tests that wait for a job are collected last, so that they run after
the rest rather than wherever their folder's name puts them; the jobs run at a lower
priority (``NICE``), so that they take idle cores rather than slow the tests beside them.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

_POOL = ThreadPoolExecutor(2, thread_name_prefix="early")


class Early:
    """``job()``, started early when a test of ``module`` (its ``__file__``) is selected."""

    def __init__(self, module: str, job: Callable[[], Any]) -> None:
        self.path = Path(module).resolve()
        self.job = job
        self.future: Future | None = None
        JOBS.append(self)

    def start(self) -> None:
        if self.future is None:
            self.future = _POOL.submit(self._run)

    def result(self) -> Any:
        """The job's result (an exception it raised is raised here), started now if it was not
        (on another xdist worker than the first: read from the first worker's file)."""
        started = time.monotonic()
        try:
            if _WORKER not in (None, "gw0"):
                return self._read()
            self.start()
            assert self.future is not None
            return self.future.result()
        finally:
            _WAITED[0] += time.monotonic() - started

    def _file(self) -> Path:
        return Path(tempfile.gettempdir()) / f"flatshard-early-{_RUN}" / f"{self.path.stem}.pickle"

    def _run(self) -> Any:
        lower_priority()
        if _WORKER is None:
            return self.job()
        try:
            out: tuple[bool, Any] = (True, self.job())
        except Exception:
            out = (False, traceback.format_exc())
        self._file().parent.mkdir(exist_ok=True)
        partial = self._file().with_suffix(".partial")
        partial.write_bytes(pickle.dumps(out))
        partial.rename(self._file())  # (whole, or not there)
        if not out[0]:
            raise RuntimeError(out[1])
        return out[1]

    def _read(self) -> Any:
        deadline = time.monotonic() + WAIT_S
        while not self._file().exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker gw0 left no result of {self.path.name}'s early job in {WAIT_S} s")
            time.sleep(0.5)
        ok, value = pickle.loads(self._file().read_bytes())
        if not ok:
            raise RuntimeError(f"the early job of {self.path.name} raised on worker gw0:\n{value}")
        return value


def take_waited() -> float:
    """Seconds this process waited for jobs since the last call (the test budget leaves them
    out: idle time beside a job at a lower priority, not the test's own work)."""
    waited, _WAITED[0] = _WAITED[0], 0.0
    return waited


def lower_priority() -> None:
    """This thread (and the processes it starts) at ``NICE``: a job takes the cores the tests
    leave idle, not a share of theirs (at the same priority a compile test beside both jobs
    ran 3.5x slower than alone, 89 s against 25 s)."""
    with contextlib.suppress(OSError):  # (no per-thread priorities: the job runs all the same)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


JOBS: list[Early] = []
NICE = 10
_WAITED = [0.0]
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
WAIT_S = 1200


def start_selected(paths: set[Path]) -> None:
    """Start every job whose module holds one of the selected tests (``paths``); under xdist,
    on the first worker only."""
    if _WORKER not in (None, "gw0"):
        return
    for job in JOBS:
        if job.path in paths:
            job.start()


def last(items: list[Any]) -> list[Any]:
    """``items`` (pytest's) with the tests of modules that have a job moved to the end, in
    their order: they then run when their job is done or nearly (first in a worker's share,
    they waited for all of it: 102 s against ~50 s)."""
    with_jobs = {job.path for job in JOBS}
    waiting = [item for item in items if Path(item.path).resolve() in with_jobs]
    return [item for item in items if Path(item.path).resolve() not in with_jobs] + waiting
