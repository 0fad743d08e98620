"""A checkpoint of a pipeline-parallel model is the whole model's ([Note: checkpoints of
pipeline chunks] in ``checkpoint/chunks.py``): saved at PP2 x DP2 it loads at PP4 x DP1, as
the whole model over 4 ranks and in one process, and training continues on the saving run's
curve; saved by the whole model it loads into pipeline chunks."""

from __future__ import annotations

import pytest
import torch

from _pipeline import checkpoint_leg
from flatshard.toolkit.testing import RankError, run_distributed

# fp32: the legs reorder sums (micro-batches, dp, pp) as the parity tests do; 2 SGD steps
# after a bit-exact load: the parity tests' 1e-5 relative bound.
RELATIVE = 1e-5


def _close(a: list, b: list) -> bool:
    return all(abs(x - y) <= RELATIVE * abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_pipeline_checkpoint_moves_between_layouts_and_one_process(tmp_path, stage):
    """Saved at PP2 x DP2 (GPipe, SGD with momentum): every param loads bit-exactly at PP4 x
    DP1, as the whole model over 4 ranks and in one process, and the next 2 steps' losses
    follow the saving run's. Saved by the whole model, it loads into PP2 x DP2 chunks."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(checkpoint_leg, 4, path, 2, stage, True, timeout=300)
    expected_params = {n: p for r in saved for n, p in r["params"].items()}
    expected_losses = saved[-1]["losses"]  # (the last pipeline stage's ranks have the losses)
    legs = {
        "pp4": run_distributed(checkpoint_leg, 4, path, 4, stage, False, timeout=300),
        "whole over 4": run_distributed(checkpoint_leg, 4, path, 1, 2, False, timeout=300),
        "one process": run_distributed(checkpoint_leg, 1, path, 1, 0, False, timeout=300),
    }
    for leg, results in legs.items():
        loaded = {n: p for r in results for n, p in r["params"].items()}
        assert loaded.keys() == expected_params.keys(), leg
        for name, value in loaded.items():
            assert torch.equal(value, expected_params[name]), (leg, name)
        assert _close(results[-1]["losses"], expected_losses), (leg, results[-1]["losses"], expected_losses)
    whole = str(tmp_path / "whole")
    by_whole = run_distributed(checkpoint_leg, 4, whole, 1, stage, True, timeout=300)
    back = run_distributed(checkpoint_leg, 4, whole, 2, stage, False, timeout=300)
    assert _close(back[-1]["losses"], by_whole[-1]["losses"]), (back[-1]["losses"], by_whole[-1]["losses"])


def test_an_interleaved_pipelines_chunks_save_together_and_load_at_another_layout(tmp_path):
    """Two chunks a rank (interleaved 1F1B at PP2 x DP2, stage 2) saved as lists: loaded at
    PP2 x DP2 under GPipe (one chunk a rank of two layers), and in one process, every param
    bit-exact and the next 2 steps' losses on the saving run's curve."""
    path = str(tmp_path / "ckpt")
    saved = run_distributed(checkpoint_leg, 4, path, 2, 2, True, schedule="interleaved", timeout=300)
    expected = {n: p for r in saved for n, p in r["params"].items()}
    for leg in (
        run_distributed(checkpoint_leg, 4, path, 2, 1, False, timeout=300),
        run_distributed(checkpoint_leg, 1, path, 1, 0, False, timeout=300),
    ):
        loaded = {n: p for r in leg for n, p in r["params"].items()}
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[n], expected[n]) for n in loaded)
        assert _close(leg[-1]["losses"], saved[-1]["losses"]), (leg[-1]["losses"], saved[-1]["losses"])


def test_a_model_smaller_than_its_checkpoint_on_every_rank_is_refused(tmp_path):
    """Loading a PP2 checkpoint into the first chunk alone, on every rank, leaves the other
    chunk's params unread: refused naming one of them."""
    path = str(tmp_path / "ckpt")
    run_distributed(checkpoint_leg, 2, path, 2, 1, True, steps=1, timeout=300)
    with pytest.raises(RankError, match=r"has 'layers\.2\..*which the model does not, on any rank"):
        run_distributed(_load_first_chunk_everywhere, 2, path, timeout=300)


def _load_first_chunk_everywhere(path: str) -> None:
    import flatshard
    from _pipeline import CFG
    from flatshard.toolkit.models.llama import Llama, pipeline_chunk

    torch.manual_seed(0)
    chunk = flatshard.shard(pipeline_chunk(Llama(CFG), 0, 2), stage=1)
    opt = flatshard.DistributedOptimizer(chunk, torch.optim.SGD, lr=0.5, momentum=0.9)
    flatshard.load_checkpoint(path, chunk, opt)
