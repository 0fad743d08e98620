"""Memory a collective works on is freed or reused only after its handle was waited, and
every handle is waited before the step that follows.

This is what makes the CUDA path safe without ``record_stream``: ProcessGroupNCCL (torch
>= 2.8) keeps an async collective's tensors alive until ``wait()``, which also makes the
current stream wait for the collective; storage freed after that point is reused by the
current stream only after the collective finished. Freeing a full bucket (a storage
resize) or pooling a grad scratch before the wait would let the next allocation overwrite
data that NCCL (or gloo's worker thread here) still reads or writes. Checked on gloo by
watching every collective stage 2 and 3 issue, with ranks taking different control flow,
units called twice and recomputed forwards.
"""

import pytest
import torch
import torch.distributed as dist

import flatshard
import flatshard.engine.buffer as buffer_module
import flatshard.engine.reduction as reduction
import flatshard.units.full_buckets as full_buckets
import flatshard.units.parts as parts
from _parity import CheckpointedGPT, RankSkippingGPT, SharedBlockGPT
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed


class _Watch:
    """Every collective issued through the patched names, and what was freed too early."""

    def __init__(self) -> None:
        self.open: list[_Watched] = []
        self.issued = 0
        self.early: list[str] = []

    def wrap(self, fn):
        def issue(tensor, *args, **kwargs):
            # (a reduction's buckets, as reduce_scatter_coalesced takes them: views of one range)
            storage = (tensor[0][0] if isinstance(tensor, list) else tensor).untyped_storage()
            watched = _Watched(fn(tensor, *args, **kwargs), storage.data_ptr(), self)
            self.open.append(watched)
            self.issued += 1
            return watched

        return issue

    def check_free(self, tensor: torch.Tensor, what: str) -> None:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr and any(w.ptr == ptr for w in self.open):
            self.early.append(what)


class _Watched:
    def __init__(self, handle, ptr: int, watch: _Watch) -> None:
        self.handle, self.ptr, self.watch = handle, ptr, watch

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def wait(self, **timeout):
        result = self.handle.wait(**timeout)  # (raises if it times out: still open)
        if self in self.watch.open:
            self.watch.open.remove(self)
        return result


def _install(watch: _Watch) -> None:
    parts.all_gather = watch.wrap(parts.all_gather)
    reduction.reduce_scatter_coalesced = watch.wrap(reduction.reduce_scatter_coalesced)
    reduction.all_reduce = watch.wrap(reduction.all_reduce)
    release, give = buffer_module.release, reduction.ScratchPool.give

    def checked_release(tensor):
        watch.check_free(tensor, "a full bucket or grad shard was freed")
        return release(tensor)

    def checked_give(pool, tensor):
        watch.check_free(tensor, "grad scratch went back to the pool")
        give(pool, tensor)

    buffer_module.release = full_buckets.release = checked_release  # (grad shards, full buckets)
    reduction.ScratchPool.give = checked_give


MODELS = {"rank-skipping": RankSkippingGPT, "shared-block": SharedBlockGPT, "checkpointed": CheckpointedGPT}


def _case(model_name: str, stage: int, options: dict) -> dict:
    watch = _Watch()
    _install(watch)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    corpus = SyntheticCorpus(model.cfg.vocab_size, model.cfg.seq_len)
    model = flatshard.shard(model, stage=stage, **{"buckets": flatshard.Buckets(size=2000), **options})
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    open_after_backward = []
    for step in range(4):
        x, y = corpus.batch(step, dist.get_rank(), 4)
        model(x, y).backward()
        open_after_backward.append(len(watch.open))
        opt.step()
        opt.zero_grad()
    return {"issued": watch.issued, "early": watch.early, "open_after_backward": open_after_backward}


@pytest.mark.parametrize(
    ("model_name", "stage", "options", "world_size"),
    [
        ("rank-skipping", 3, {}, 2),
        ("rank-skipping", 3, {"stage3": flatshard.Stage3(backward_prefetch="post", forward_prefetch=2)}, 3),
        (
            "rank-skipping",
            3,
            {"stage3": flatshard.Stage3(reshard_after_forward=False, backward_prefetch=None)},
            2,
        ),
        ("shared-block", 3, {"stage3": flatshard.Stage3(limit_all_gathers=1)}, 2),
        ("checkpointed", 3, {}, 2),
        ("rank-skipping", 2, {"buckets": flatshard.Buckets(size=2000, per_launch=1)}, 3),
    ],
)
def test_collective_memory_outlives_its_collective(model_name, stage, options, world_size):
    for r in run_distributed(_case, world_size, model_name, stage, options):
        assert r["issued"] > 0
        assert r["early"] == [], r["early"][:3]
        # when backward returns every reduction and gather was waited (the step's
        # prefetch for the next forward comes after)
        assert all(n == 0 for n in r["open_after_backward"]), r
