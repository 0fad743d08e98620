"""The multi-process harness reports failures and hangs instead of stalling."""

import ctypes
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flatshard.app.launcher import rank_env
from flatshard.toolkit.malloc import cpu_malloc_env
from flatshard.toolkit.testing import RankError, run_distributed


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t), torch.get_num_threads()


def test_results_come_back_in_rank_order():
    results = run_distributed(_rank_and_sum, 3)
    assert results == [(r, 3, 3.0, 1) for r in range(3)]


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise KeyError("the failing rank's own message")
    dist.barrier()  # rank 0 would wait here for ever


def test_a_failing_rank_raises_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 failed.*KeyError.*the failing rank's own message"):
        run_distributed(_rank_one_raises, 2, timeout=60)
    assert time.monotonic() - start < 30, "the other rank must be killed, not waited for"


def _hang():
    time.sleep(600)


def test_a_hang_times_out_naming_the_ranks():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] had not finished"):
        run_distributed(_hang, 2, timeout=3)


def test_cpu_malloc_env_adds_the_tunables_and_keeps_the_users():
    assert cpu_malloc_env({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=5"}
    assert cpu_malloc_env(mine) == mine  # the user's tcache_count stays
    other = cpu_malloc_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert other["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=0"


_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo(ctypes.Structure):  # glibc's struct mallinfo2: size_t fields
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2.split(" ")]


def _a_freed_block_counts_as_free() -> tuple[str, bool]:
    """Whether glibc counts a freed 600-byte block as free at once (not while its per-thread
    cache holds it, still marked in use)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.mallinfo2.restype = _MallInfo
    block = libc.malloc(600)
    before = libc.mallinfo2().fordblks
    libc.free(block)
    return os.environ.get("GLIBC_TUNABLES", ""), libc.mallinfo2().fordblks >= before + 600


def test_ranks_start_with_the_cpu_malloc_tunables():
    for tunables, freed in run_distributed(_a_freed_block_counts_as_free, 2):
        assert "glibc.malloc.tcache_count=0" in tunables.split(":")
        assert freed, "glibc did not apply the tunables: a freed block sat in its thread cache"


def test_launched_cpu_ranks_get_the_tunables_and_cuda_ranks_do_not():
    cpu = rank_env({"PATH": "/bin"}, 1, 2, 1234, threads=1, cpu=True)
    assert cpu["RANK"] == "1" and cpu["WORLD_SIZE"] == "2" and cpu["MASTER_PORT"] == "1234"
    assert cpu["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"
    assert "GLIBC_TUNABLES" not in rank_env({"PATH": "/bin"}, 1, 2, 1234, threads=1, cpu=False)


def _budget_suite(pytester, monkeypatch, body: str) -> pytest.RunResult:
    """``body`` run as a suite of its own under the real conftest, the budget's floor on the
    number of tests lowered to 3, in a new interpreter. Not in this process: pytester's
    in-process run empties ``sys.modules`` for a moment when it ends, and an import on another
    thread then (an early job's, [Note: early starts] in _early.py) made new copies of modules,
    ``_io`` among them: the next tests on that worker failed on ``BytesIO.fileno()`` raising
    an exception class torch's loader did not know."""
    conftest = (Path(__file__).parents[1] / "conftest.py").read_text()
    for line in ("BUDGET_MIN_TESTS = 500", "testing.warm_up()"):
        assert line in conftest, line
    # (no forkserver for ranks this suite does not start)
    pytester.makeconftest(
        conftest.replace("BUDGET_MIN_TESTS = 500", "BUDGET_MIN_TESTS = 3").replace(
            "testing.warm_up()", "pass"
        )
    )
    pytester.makepyfile(body)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))  # (the conftest imports _early)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:xdist", timeout=120)


def test_a_test_over_its_share_of_the_suite_fails_the_run(pytester, monkeypatch):
    """[Note: test budget] in conftest.py, on a suite of its own: three tests, one of which
    takes nearly all the time."""
    body = (
        "import time\ndef test_quick(): pass\ndef test_also_quick(): pass\ndef test_slow(): time.sleep(0.3)\n"
    )
    result = _budget_suite(pytester, monkeypatch, body)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*over their budget of 8%*", "*test_slow*"])
    assert "test_quick" not in result.stdout.str()


def test_a_run_within_budget_passes():
    """40 equal tests: each 2.5% of the run, far from 8%. (The run of the whole suite is this
    case end to end, on every CI run.)"""
    from conftest import BUDGET_SHARE, over_budget

    assert over_budget({f"test_{i}": 0.05 for i in range(40)}, BUDGET_SHARE) == []
    assert [name for name, _ in over_budget({"a": 1.0, "b": 1.0, "slow": 30.0}, BUDGET_SHARE)] == ["slow"]


# -- reused ranks ([Note: reused ranks] in toolkit/rank_pool.py) ------------------------------


def _leave_a_mess() -> int:
    """Change what a test could forget to put back; this rank's pid."""
    import flatshard.optim.agreement as agreement

    os.environ["FLATSHARD_TEST_LEFTOVER"] = "1"
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(1234 + dist.get_rank())
    agreement.CHECK_EVERY = -1
    dist.new_group([0, 1])
    return os.getpid()


def _what_a_new_rank_sees() -> tuple:
    import flatshard.optim.agreement as agreement

    return (
        os.getpid(),
        os.environ.get("FLATSHARD_TEST_LEFTOVER"),
        os.getcwd(),
        torch.get_default_dtype(),
        float(torch.rand(1)),
        agreement.CHECK_EVERY,
        dist.get_world_size(),
    )


def test_kept_ranks_find_each_run_as_new_ranks_would():
    fresh = run_distributed(_what_a_new_rank_sees, 2, reuse=False)
    pids = run_distributed(_leave_a_mess, 2)
    seen = run_distributed(_what_a_new_rank_sees, 2)
    assert [s[0] for s in seen] == pids  # the same processes
    assert [s[1:] for s in seen] == [f[1:] for f in fresh]  # in the state of new ones
    assert fresh[0][1:4] == (None, os.getcwd(), torch.float32)


def _pid() -> int:
    return os.getpid()


def _raise_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1's own error")


def _start_a_thread() -> int:
    import threading

    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    return os.getpid()


@pytest.mark.parametrize("leaves", ["an error", "a thread"])
def test_a_run_that_leaves_what_cannot_be_undone_retires_its_ranks(leaves):
    """A failed run's group may hold half a collective, a thread may touch the next run."""
    before = run_distributed(_pid, 2)
    if leaves == "an error":
        with pytest.raises(RankError, match="rank 1's own error"):
            run_distributed(_raise_on_rank_1, 2)
    else:
        assert run_distributed(_start_a_thread, 2) == before
    after = run_distributed(_pid, 2)
    assert not set(after) & set(before)
    assert run_distributed(_pid, 2) == after  # (and the new ones are kept)


def test_a_run_beside_a_busy_pool_and_a_run_that_asks_get_new_ranks():
    from concurrent.futures import ThreadPoolExecutor

    kept = run_distributed(_pid, 2)
    assert not set(run_distributed(_pid, 2, reuse=False)) & set(kept)
    with ThreadPoolExecutor(2) as pool:  # one of the two finds the kept ranks busy
        runs = [r.result() for r in [pool.submit(run_distributed, _rank_and_sum, 2) for _ in range(2)]]
    assert runs[0] == runs[1] == [(r, 2, 1.0, 1) for r in range(2)]
