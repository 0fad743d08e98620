"""The guides run: every code block of ``docs/finetune.md`` is a part of
``examples/finetune_lora.py``, and every one of ``docs/lightning.md`` of
``examples/lightning_trainer.py`` (so a guide cannot drift), and each example runs on 2
ranks, then resumes its checkpoint on 3, as torchrun runs it (``run_script``: torchrun's
environment, in ranks forked with torch already imported). The fine-tuning example asserts
by itself that the sharded model's tokens equal the reloaded adapter model's, on every
rank; the Lightning example, that the validation loss falls; ``examples/hf_trainer.py`` (the
Trainer's page runs its own blocks), that the eval loss falls and ``from_pretrained`` loads the
weights it trained."""

import re
import shutil
from pathlib import Path

import pytest

from flatshard.toolkit.testing import run_script

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "finetune_lora.py"
GUIDES = {
    "docs/finetune.md": ("examples/finetune_lora.py", 5),
    "docs/lightning.md": ("examples/lightning_trainer.py", 4),
}

pytest.importorskip("peft")  # (in the dev extras: CI has it)


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_every_python_block_of_the_guide_is_in_the_example(guide):
    example, least = GUIDES[guide]
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / guide).read_text(), flags=re.S)
    text = (ROOT / example).read_text()
    assert len(blocks) >= least
    for block in blocks:
        assert block in text, block.splitlines()[0]


def _run(args: list[str], nproc: int) -> str:
    return "".join(run_script(EXAMPLE, nproc, *args))


def test_the_example_trains_generates_exports_reloads_and_resumes_elsewhere(tmp_path):
    pretrained, out = str(tmp_path / "pretrained"), str(tmp_path / "run")
    _run(["--make-tiny", pretrained], 1)
    first = _run(["--pretrained", pretrained, "--out", out, "--steps", "4", "--every", "2"], 2)
    assert "step 4:" in first and "rank 1 generated" in first, first
    for what in ("adapter/adapter_model.safetensors", "merged/model.safetensors", "checkpoint"):
        assert (tmp_path / "run" / what).exists(), what
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "run" / "checkpoint", resumed / "checkpoint")
    args = ["--pretrained", pretrained, "--out", str(resumed), "--steps", "6", "--every", "6"]
    second = _run(args, 3)
    assert "step 5:" in second and "step 6:" in second and "step 4:" not in second, second
    assert "rank 2 generated" in second, second


@pytest.mark.parametrize("loop", ["trainer", "fabric"])
def test_the_lightning_example_learns_and_resumes_on_3_ranks_at_another_stage(tmp_path, loop):
    """2 epochs on 2 ranks at stage 3, then a third on 3 ranks at stage 2 from the last
    checkpoint (192 sequences of 4 per rank and 2 micro-batches a step: 12 steps an epoch
    on 2 ranks, 8 on 3)."""
    example, out = ROOT / "examples" / "lightning_trainer.py", str(tmp_path / "run")
    fabric = ["--fabric"] if loop == "fabric" else []
    first = "".join(run_script(example, 2, *fabric, "--out", out, "--stage", "3", cwd=tmp_path))
    last = f"{out}/fabric-ckpt" if fabric else f"{out}/checkpoints/last.ckpt"
    again = [*fabric, "--out", out, "--epochs", "3", "--resume", last]
    second = "".join(run_script(example, 3, *again, cwd=tmp_path))
    assert ("after 2 epochs" if fabric else "after 24 steps") in first, first[-2000:]
    assert ("after 3 epochs" if fabric else "after 32 steps") in second, second[-2000:]


def test_the_trainer_example_learns_saves_and_resumes_on_3_ranks_at_another_stage(tmp_path):
    """24 steps on 2 ranks at stage 3 (checkpoints at 12 and 24), then on to 36 on 3 ranks at
    stage 2 from step 24's; each run checks that its eval loss falls and that
    ``from_pretrained`` loads the weights it trained."""
    example, out = ROOT / "examples" / "hf_trainer.py", str(tmp_path / "run")
    first = "".join(run_script(example, 2, "--out", out, "--stage", "3", cwd=tmp_path))
    again = ["--out", out, "--stage", "2", "--steps", "36", "--resume", f"{out}/checkpoint-24"]
    second = "".join(run_script(example, 3, *again, cwd=tmp_path))
    assert "after 24 steps" in first, first[-2000:]
    assert "after 36 steps" in second, second[-2000:]
