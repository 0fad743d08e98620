"""flatshard as the data-parallel dimension of a pipeline-parallel model ([Note: pipeline
chunks] in ``wrap/pipeline.py``): PP2 x DP2 under GPipe, 1F1B, interleaved 1F1B and interleaved
zero-bubble follows the whole model in one process at every stage, reducing each chunk's grads
once a step, and what does not compose is refused by name."""

from __future__ import annotations

import pytest

from _pipeline import (
    planned_and_measured,
    reference,
    refusals,
    torch_stage_reductions,
    train_pipelined,
    train_tp_pp,
)
from flatshard.toolkit.testing import run_distributed

# fp32 throughout. Against the one-process run the pipelined one sums each grad over 2
# micro-batches and 2 dp ranks in another order, and its norm over chunks and pp ranks: a few
# ulps (eps = 1.2e-7) per op, over 3 SGD steps with momentum 0.9 (at most 1 + 0.9 + 0.81 =
# 2.7 steps' worth of each step's relative error), as in the tensor-parallel tests: 1e-5
# relative leaves ~10x room. A micro-batch's grads reduced twice, or a norm of one chunk only
# (clipping bites: the norms are ~2.5, the bound 0.5), is off by 1e-2 or more.
RELATIVE = 1e-5
STEPS, BATCH = 3, 4  # (2 sequences a dp rank a step: 2 micro-batches of 1)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zero-bubble"])
def test_pipeline_follows_one_process_at_every_stage(schedule):
    """Each step's loss and clipped norm (the optimizer's, and torchtitan's over torch's
    get_total_norm of the ShardedGrads summed over pp) and every param after 3 steps, at
    stages 0-3; each chunk reduces its grads once a step (one reduction per bucket, as one
    backward does), not once a micro-batch."""
    expected = reference(STEPS, BATCH)
    results = run_distributed(train_pipelined, 4, schedule, [0, 1, 2, 3], timeout=300)
    for rank, by_stage in enumerate(results):
        for stage, r in by_stage.items():
            norms = [abs(a - b) / b for a, b in zip(r["norm"], expected["norm"], strict=True)]
            assert max(norms) < RELATIVE, (rank, stage, r["norm"], expected["norm"])
            assert min(expected["norm"]) > 1.0, "clipping must scale the grads for the norm to matter"
            if rank >= 2:  # (the last pipeline stage's ranks compute the loss)
                losses = [abs(a - b) / b for a, b in zip(r["loss"], expected["loss"], strict=True)]
                assert max(losses) < RELATIVE, (rank, stage, r["loss"], expected["loss"])
            for name, value in r["params"].items():
                want = expected["params"][name]
                diff = ((value - want).abs().max() / want.abs().max()).item()
                assert diff < RELATIVE, (rank, stage, name, diff)
            # every step, each chunk's reductions are those of one backward: its buckets' count
            first = r["reductions"][0]
            assert all(step == first for step in r["reductions"]), (stage, r["reductions"])
    covered = {n for by_stage in results for n in by_stage[0]["params"]}
    assert covered == set(expected["params"]), "every param is in some rank's chunk"


def test_reductions_per_step_do_not_grow_with_micro_batches():
    """With 4 micro-batches a chunk issues the reductions it issues with 2 (one backward's);
    torch's own PipelineStage around the same chunk issues one backward's per micro-batch."""
    two = run_distributed(train_pipelined, 4, "gpipe", [2], steps=1, batch=8, micro=2, timeout=300)
    four = run_distributed(train_pipelined, 4, "gpipe", [2], steps=1, batch=8, micro=4, timeout=300)
    ours = [r[2]["reductions"][0][0] for r in two]
    assert ours == [r[2]["reductions"][0][0] for r in four] and min(ours) > 0
    torch_two = run_distributed(torch_stage_reductions, 4, 2, timeout=300)
    torch_four = run_distributed(torch_stage_reductions, 4, 4, timeout=300)
    assert [f[0] - t[0] for f, t in zip(torch_four, torch_two, strict=True)] == [2 * n for n in ours]


def test_tensor_parallel_pipeline_chunks_follow_one_process_at_every_stage():
    """PP2 x TP2: each chunk made tensor-parallel (every param a DTensor, the residual stream
    each tp rank's slice of the sequence between chunks), then sharded by flatshard: losses,
    the optimizer's norm (summed over tp, then over pp) and every param after 3 clipped steps
    follow the one-process run at stages 0-3 (the RELATIVE bound)."""
    expected = reference(STEPS, BATCH)
    results = run_distributed(train_tp_pp, 4, [0, 1, 2, 3], timeout=300)
    for rank, by_stage in enumerate(results):
        for stage, r in by_stage.items():
            assert r["dtensors"] == len(r["params"]) > 0, (rank, stage)
            norms = [abs(a - b) / b for a, b in zip(r["norm"], expected["norm"], strict=True)]
            assert max(norms) < RELATIVE, (rank, stage, r["norm"], expected["norm"])
            if rank >= 2:
                losses = [abs(a - b) / b for a, b in zip(r["loss"], expected["loss"], strict=True)]
                assert max(losses) < RELATIVE, (rank, stage, r["loss"], expected["loss"])
            for name, value in r["params"].items():
                want = expected["params"][name]
                assert ((value - want).abs().max() / want.abs().max()).item() < RELATIVE, (rank, stage, name)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_chunks_memory_and_bytes_a_step_equal_the_plan_of_its_params(stage):
    """Each chunk's memory_report equals plan_from_specs of the chunk's params over dp, role by
    role, and the bytes it sends in a steady step (4 micro-batches) equal the plan's: one
    backward's reduction and one step's gathers, the ring theory over dp, whatever the number
    of micro-batches. (Stage 3 gathers once per micro-batch: not the plan's one step.)"""
    for r in run_distributed(planned_and_measured, 4, stage, 4, timeout=300):
        for role in ("params", "grads", "main_params", "optimizer_state"):
            assert r["plan"][role] == r["measured"][role], (role, r["plan"], r["measured"])
        assert r["plan"]["comm_bytes_per_step"] == r["sent"], (r["plan"], r["sent"])


def test_what_does_not_compose_is_refused_by_name(tmp_path):
    """A checkpoint of one of a rank's two chunks (an interleaved schedule), a chunk flatshard did
    not wrap, a chunk without its DistributedOptimizer (the norm needs every
    chunk's), loss scaling, and ranks whose learning rates differ; while the param groups'
    members, which differ between pipeline stages by design, are compared only among ranks
    holding the same params (the other cases built their optimizers without a complaint)."""
    results = run_distributed(refusals, 2, str(tmp_path / "ckpt"), timeout=120)
    assert not list(tmp_path.iterdir())  # (the refused save wrote nothing)
    for r in results:
        assert r["checkpoint of two chunks a rank"].startswith("ValueError: save_checkpoint was given 1 of")
        assert "stages [" in r["checkpoint of two chunks a rank"]
        assert r["plain chunk"].startswith("TypeError: flatshard's PipelineStage takes a chunk flatshard")
        assert r["chunk without optimizer"].startswith("ValueError: pipeline stage ")
        assert "has no DistributedOptimizer" in r["chunk without optimizer"]
        assert r["loss scaling"].startswith("ValueError: loss scaling is not supported in a pipeline")
        assert r["lr differs on one rank"].startswith("ValueError: ranks disagree on the optimizer's")
        assert "lr=1.0" in r["lr differs on one rank"]
