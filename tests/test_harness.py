"""The multi-process harness reports failures and hangs instead of stalling."""

import ctypes
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flatshard.app.launch import rank_env
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


def test_a_test_over_its_share_of_the_suite_fails_the_run(pytester):
    """[Note: test budget] in conftest.py, on a suite of its own: three tests, one of which
    takes nearly all the time; the budget's floor on the number of tests lowered to 3."""
    conftest = (Path(__file__).parent / "conftest.py").read_text()
    pytester.makeconftest(conftest.replace("BUDGET_MIN_TESTS = 500", "BUDGET_MIN_TESTS = 3"))
    pytester.makepyfile(
        "import time\ndef test_quick(): pass\ndef test_also_quick(): pass\ndef test_slow(): time.sleep(0.3)\n"
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*over their budget of 8%*", "*test_slow*"])
    assert "test_quick" not in result.stdout.str()


def test_a_run_within_budget_passes(pytester):
    conftest = (Path(__file__).parent / "conftest.py").read_text()
    pytester.makeconftest(conftest.replace("BUDGET_MIN_TESTS = 500", "BUDGET_MIN_TESTS = 3"))
    # 40 equal tests: each 2.5% of the run, far from 8% even if one pays a start-up cost
    pytester.makepyfile("import time\n" + "".join(f"def test_{i}(): time.sleep(0.05)\n" for i in range(40)))
    assert pytester.runpytest("-p", "no:cacheprovider").ret == pytest.ExitCode.OK
