"""Every implementation of reduce-scatter and all-gather gives the same, exact result, and
the byte accounting names the implementation that ran."""

import time

import pytest
import torch
import torch.distributed as dist

from flatshard.comm.collectives import (
    GATHER_IMPLS,
    SCATTER_IMPLS,
    UNEVEN,
    CommStats,
    all_gather,
    reduce_scatter,
    reduce_scatter_coalesced,
    sum_rows,
    wait_until,
)
from flatshard.comm.world import World
from flatshard.toolkit.testing import run_distributed


def _case(op: str, impl: str, numel: int, splits=None) -> dict:
    world = World(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    n, rank = world.size, world.rank
    sizes = splits or [numel // n] * n
    starts = [sum(sizes[:r]) for r in range(n)]
    own = slice(starts[rank], starts[rank] + sizes[rank])
    owner = torch.repeat_interleave(torch.arange(n), torch.tensor(sizes))  # each element's rank
    # small integers: sums are exact in any order
    tensors = [
        torch.randint(-8, 8, (numel,), generator=torch.Generator().manual_seed(r)).float() for r in range(n)
    ]
    stats = CommStats()
    tensor = tensors[rank].clone()
    if op == "reduce_scatter":
        reduce_scatter(tensor, tensor[own], world, stats=stats, impl=impl, splits=splits).wait()
        expected = sum(tensors)[own]
        got = tensor[own]
    else:
        tensor = torch.where(owner == rank, tensors[rank], torch.full((numel,), 99.0))
        all_gather(tensor, tensor[own], world, stats=stats, impl=impl, splits=splits).wait()
        expected = torch.cat([tensors[r][starts[r] : starts[r] + sizes[r]] for r in range(n)])
        got = tensor
    return {"equal": torch.equal(got, expected), "stats": stats.as_dict()[op]}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize(
    ("op", "impl"), [("reduce_scatter", i) for i in SCATTER_IMPLS] + [("all_gather", i) for i in GATHER_IMPLS]
)
def test_every_implementation_is_exact(world_size, op, impl):
    numel = 384 * world_size
    for result in run_distributed(_case, world_size, op, impl, numel):
        assert result["equal"]
        assert result["stats"]["impl"] == impl
        assert result["stats"]["payload_bytes"] == numel * 4


def _chunked_case(chunk_bytes: int, numel: int, splits=None) -> dict:
    from flatshard.comm import collectives

    collectives.A2A_CHUNK = chunk_bytes  # (this rank's process only)
    return _case("reduce_scatter", "chunked_all_to_all", numel, splits)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_chunked_all_to_all_sums_every_block(world_size):
    """Blocks of 7 columns (a chunk of 28 * N bytes) over shards of 384 + 3 elements: many
    blocks and a short last one; the wire bytes stay a ring reduce-scatter's."""
    numel = (384 + 3) * world_size
    for result in run_distributed(_chunked_case, world_size, 7 * 4 * world_size, numel):
        assert result["equal"]
        assert result["stats"]["wire_bytes"] == (world_size - 1) * numel * 4 // world_size


UNEVEN_SPLITS = {2: [640, 128], 3: [256, 0, 384], 4: [0, 384, 128, 0]}
"""Shards of whole-param buckets ([Note: whole-param buckets]): of any size, some empty."""


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    ("op", "impl"), [("reduce_scatter", i) for i in SCATTER_IMPLS] + [("all_gather", i) for i in GATHER_IMPLS]
)
def test_every_implementation_is_exact_on_uneven_shards(world_size, op, impl):
    """An implementation that takes equal shards only hands over to one that takes any
    (``UNEVEN``), and says so in the byte accounting."""
    splits = UNEVEN_SPLITS[world_size]
    for result in run_distributed(_case, world_size, op, impl, sum(splits), splits):
        assert result["equal"]
        assert result["stats"]["impl"] == UNEVEN.get(impl, impl)
        assert result["stats"]["payload_bytes"] == sum(splits) * 4


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_chunked_all_to_all_sums_every_block_of_uneven_shards(world_size):
    """Blocks of 7 columns over shards of 0 to 640 elements: a short shard runs out of
    columns blocks before a long one, and every rank still issues the same all-to-alls."""
    splits = UNEVEN_SPLITS[world_size]
    for result in run_distributed(_chunked_case, world_size, 7 * 4 * world_size, sum(splits), splits):
        assert result["equal"]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5])
def test_sum_rows_equals_torch_sum(rows):
    """The reduce-scatter's local sum (chained adds up to four rows, torch.sum above)."""
    values = torch.randn(rows, 1000, generator=torch.Generator().manual_seed(rows))
    out = torch.full((1000,), float("nan"))
    sum_rows(values, out)
    assert torch.allclose(out, values.sum(dim=0), rtol=0, atol=1e-6)


def _bad_shard_case() -> str:
    world = World(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    tensor = torch.zeros(12)
    try:
        reduce_scatter(tensor, tensor[:6] if world.rank else tensor[6:], world)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_shard_that_is_not_this_ranks_part_is_refused():
    assert all("is not its own part of the bucket" in m for m in run_distributed(_bad_shard_case, 2))


def _control_device_case() -> dict:
    """Groups that take host tensors, and one that takes only device tensors as NCCL does
    (gloo registered for the cuda device type alone: a host tensor is refused the same way)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    device_only = dist.new_group(backend="cuda:gloo")
    both = dist.new_group(backend="cpu:gloo,cuda:gloo")
    try:
        dist.all_reduce(torch.zeros(1), group=device_only)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {
        "world": World(dist.group.WORLD, rank, size).control_device,
        "device_only": World(device_only, rank, size).control_device,
        "both": World(both, rank, size).control_device,
        "refused": refused,
    }


def test_control_tensors_live_where_the_backend_takes_them():
    """Digests and flags go on the host for gloo and on the device for a device-only
    backend (NCCL), whose collectives refuse host tensors."""
    for result in run_distributed(_control_device_case, 2):
        assert result["world"] == torch.device("cpu")
        assert result["both"] == torch.device("cpu")
        assert result["device_only"] == torch.device("cuda")
        assert "device type cpu" in result["refused"]
    assert World(None, 0, 1).control_device == torch.device("cpu")


def _late_rank_case(impl: str) -> tuple[bool, bool, bool]:
    """Rank 1 joins a reduce-scatter a second late; rank 0 first waits 0.1 s for it."""
    world = World(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    tensor = torch.full((8,), float(world.rank + 1))
    if world.rank == 1:
        time.sleep(1.0)
    handle = reduce_scatter(tensor, tensor[4 * world.rank : 4 * world.rank + 4], world, impl=impl)
    early = wait_until(handle, time.monotonic() + 0.1) if world.rank == 0 else False
    late = wait_until(handle, time.monotonic() + 60)
    handle.wait()
    return early, late, tensor[4 * world.rank : 4 * world.rank + 4].tolist() == [3.0] * 4


@pytest.mark.parametrize("impl", ["all_reduce", "all_to_all"])  # a torch Work, and one with a copy-back
def test_a_wait_with_a_deadline_gives_up_and_the_collective_still_finishes(impl):
    (early, late, summed), (_, late_1, summed_1) = run_distributed(_late_rank_case, 2, impl, timeout=60)
    assert not early, "rank 1 had not even issued it: the wait must give up at its deadline"
    assert late and late_1 and summed and summed_1


def _completes_on_host_case() -> dict:
    rank, size = dist.get_rank(), dist.get_world_size()
    host_only = World(dist.new_group(backend="cpu:gloo"), rank, size)
    world = World(dist.group.WORLD, rank, size)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    return {
        "gloo": (world.completes_on_host(cpu), world.completes_on_host(cuda)),
        "host_only": (host_only.completes_on_host(cpu), host_only.completes_on_host(cuda)),
    }


def test_gloo_finishes_collectives_on_the_host_for_either_device():
    """The bounded wait for a reduction blocks on gloo's collectives, on CUDA tensors too: on
    an H100/H200, gloo's reduce_scatter_tensor of CUDA tensors never reported is_completed()
    to a poll (torch 2.11), and polling it stalled every stage-3 backward for the whole
    timeout. A device type with no backend gets polled."""
    for result in run_distributed(_completes_on_host_case, 2):
        assert result["gloo"] == (True, True)
        assert result["host_only"] == (True, False)
    assert World(None, 0, 1).completes_on_host(torch.device("cuda"))


def _coalesced_case(splits_per_bucket: list, limit=None) -> dict:
    """Buckets of several shapes (equal and uneven shards), reduced as one collective."""
    world = World(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    n, rank = world.size, world.rank
    buckets, expected = [], []
    for b, splits in enumerate(splits_per_bucket):
        sizes = splits or [384] * n
        numel, start = sum(sizes), sum(sizes[:rank])
        values = [
            torch.randint(-8, 8, (numel,), generator=torch.Generator().manual_seed(10 * b + r)).float()
            for r in range(n)
        ]
        tensor = values[rank].clone()
        buckets.append((tensor, tensor[start : start + sizes[rank]], splits))
        expected.append(sum(values)[start : start + sizes[rank]])
    stats = CommStats()
    reduce_scatter_coalesced(buckets, world, stats=stats, limit=limit).wait()
    equal = all(torch.equal(shard, want) for (_, shard, _), want in zip(buckets, expected, strict=True))
    return {"equal": equal, "stats": stats.as_dict()["reduce_scatter"]}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_a_bucket_group_is_reduce_scattered_by_one_all_to_all(world_size):
    buckets = [None, UNEVEN_SPLITS[world_size], None]
    for result in run_distributed(_coalesced_case, world_size, buckets):
        assert result["equal"]
        assert result["stats"]["calls"] == 1 and result["stats"]["impl"] == "all_to_all"
        assert result["stats"]["payload_bytes"] == 4 * (2 * 384 * world_size + sum(UNEVEN_SPLITS[world_size]))


def test_a_group_with_a_bucket_over_the_limit_runs_one_collective_a_bucket():
    for result in run_distributed(_coalesced_case, 3, [None, UNEVEN_SPLITS[3], None], 0):
        assert result["equal"]
        assert result["stats"]["calls"] == 3
