"""Heavy checks that start as soon as the suite is collected, beside the tests before them.

[Note: early starts]

A few checks are one long job each that needs nothing from the tests around it: the type
checker over ``src/`` (a subprocess, ~60 s) and the Hugging Face type sweep (two one-rank
runs, ~55 s). Run in their turn they add their whole time to the suite's; started at the end
of collection they run on the cores the multi-rank tests leave idle while their ranks wait
on each other (the two cores are ~70% busy), and the test that needs the result waits only
for what is left. A job starts only if a test of its module was selected; a test whose job
was never started (its module run alone, by a tool) runs it there and then.
"""

from __future__ import annotations

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
            self.future = _POOL.submit(self.job)

    def result(self) -> Any:
        """The job's result (an exception it raised is raised here), started now if it was not."""
        self.start()
        assert self.future is not None
        return self.future.result()


JOBS: list[Early] = []


def start_selected(paths: set[Path]) -> None:
    """Start every job whose module holds one of the selected tests (``paths``)."""
    for job in JOBS:
        if job.path in paths:
            job.start()
