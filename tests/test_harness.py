"""The multi-process harness reports failures and hangs instead of stalling."""

import time

import pytest
import torch
import torch.distributed as dist

from flatshard.testing import RankError, run_distributed


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
