"""What every test file shares: the modules ranks start with, and the suite's time budget
per test.

[Note: test budget]

The whole suite must run in ten minutes on a 2-core machine, and it grows with each
feature; one test quietly growing (a bigger model, more steps, a new world size) is how it
got slow. So each test's time (setup, call and teardown, as pytest measures them) is held
to a share of the whole run's: ``BUDGET_SHARE`` of the summed time of all tests. A share,
not seconds, so that a machine three times slower, or busy beside other work, gives the
same verdict. It is checked at the end of a run of at least ``BUDGET_MIN_TESTS`` tests (a
few selected tests are each a large share of their own run); a test over its share fails
the run, naming it and its time. Heavy work shared by many tests (the Hugging Face type
sweep) runs once, beside the tests at a lower priority ([Note: early starts] in
_early.py); the seconds a test waits for it are idle time and do not count against it.

[Note: compile backends in the suite]

Inductor builds C++ kernels for each new graph, in every rank, and CI starts with an empty
cache: a cold compile of the parity GPT's forward is 28 s in one process here, half of it
g++ (``-O0`` is no faster: the headers dominate), and the compiled tests were a third of the
suite's time (968 of 2,955 s at 42561d2). What flatshard does under ``torch.compile`` (its
hooks breaking graphs, DTensor and float8 params traced by AOTAutograd, functionalized writes
into buffers, the partitioner's saved tensors) is Dynamo's and AOTAutograd's, which
``aot_eager`` runs in full; inductor adds kernels that fuse, reorder and reuse buffers. So
inductor runs where flatshard's buffers meet its kernels: ``stages/test_compile.py``'s parity
at every stage and bf16 runs, torchao's compiled low-bit step over pieces (on a model of one
shape, as it compiles per shape), the fused Adam step; ``aot_eager`` where the subject is a
compile path (a host's, a mesh's, float8's, offload's, the docs' pages) or Dynamo's graph and
break counts, which are the same under any backend.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import _early
from flatshard.toolkit import testing

# The tests live in one folder per feature (``planning/``, ``stages/``, ``optim/``, ...) and the
# helpers they share (``_parity``, ``_hosted``, ...) here. pytest puts a test file's folder on
# ``sys.path`` when it collects the file, but the ranks' forkserver copies ``sys.path`` once,
# when it starts (at configure, before collection): every folder goes on it now, so a rank
# can import the test module whose function it runs.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if _folder.is_dir() and any(_folder.glob("test_*.py")) and str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# The suite's ranks fork with these already imported: each rank used to import them for
# ~2.5 s (test_hf.py: 79 s -> 32 s); one import in the forkserver instead. The Trainer and
# TRL: ~1.7 s a rank of the hosted tests (test_hosts_*: 70 s -> 60 s). _inductor_probes:
# inductor's per-process probes, run once (see its docstring).
testing.PRELOAD.extend(["torch._inductor.compile_fx", "transformers.modeling_utils", "peft"])
# Inductor builds a compile's kernels in-process rather than starting a pool of workers in
# every rank that compiles (test_compile.py: 91 s -> 83 s alone, more beside other work).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
testing.PRELOAD.extend(["transformers.trainer", "trl", "lightning.pytorch", "_inductor_probes"])

pytest_plugins = ["pytester"]  # (tests/repo/test_harness.py runs the budget on suites of its own)

BUDGET_SHARE = 0.08
BUDGET_MIN_TESTS = 500

_seconds: dict[str, float] = defaultdict(float)


def over_budget(seconds: dict[str, float], share: float) -> list[tuple[str, float]]:
    """The tests whose time is above ``share`` of the total, slowest first."""
    total = sum(seconds.values())
    return sorted(((k, v) for k, v in seconds.items() if v > share * total), key=lambda kv: -kv[1])


def pytest_configure(config: pytest.Config) -> None:
    """The ranks' forkserver imports its modules while the tests are collected (not in the
    xdist controller, which runs no test)."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        testing.warm_up()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that wait for an early job run last ([Note: early starts] in _early.py)."""
    items[:] = _early.last(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """The heavy jobs of the selected modules start now ([Note: early starts] in _early.py)."""
    _early.start_selected({Path(item.path).resolve() for item in session.items})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Each phase's report carries the seconds it waited for an early job (on the worker)."""
    outcome = yield
    outcome.get_result().user_properties.append(("early_wait", _early.take_waited()))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    waited = sum(v for k, v in report.user_properties if k == "early_wait")
    _seconds[report.nodeid] += report.duration - waited


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if len(_seconds) < BUDGET_MIN_TESTS or hasattr(session.config, "workerinput"):
        return  # (under xdist the controller sees every test's report and judges the whole run)
    _write_times(session.config)
    over = over_budget(_seconds, BUDGET_SHARE)
    if over:
        total = sum(_seconds.values())
        lines = [f"  {name}: {t:.1f} s of {total:.0f} s ({t / total:.1%})" for name, t in over]
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"tests over their budget of {BUDGET_SHARE:.0%} of the suite's time "
                "([Note: test budget] in tests/conftest.py):\n" + "\n".join(lines),
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _write_times(config: pytest.Config) -> None:
    """Each test's and each file's seconds, slowest first, in the cache folder
    (``.pytest_cache/v/flatshard/test-times``): where the suite's time goes, without a rerun."""
    if getattr(config, "cache", None) is None:  # (-p no:cacheprovider)
        return
    files: dict[str, float] = defaultdict(float)
    for nodeid, seconds in _seconds.items():
        files[nodeid.split("::")[0]] += seconds
    slowest = sorted(_seconds.items(), key=lambda kv: -kv[1])
    config.cache.set(
        "flatshard/test-times",
        {
            "total": sum(_seconds.values()),
            "files": dict(sorted(files.items(), key=lambda kv: -kv[1])),
            "tests": dict(slowest),
        },
    )
