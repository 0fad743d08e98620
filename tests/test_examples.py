"""The fine-tuning guide runs: every code block of ``docs/finetune.md`` is a part of
``examples/finetune_lora.py`` (so the guide cannot drift), and the example runs on 2 ranks,
then resumes its checkpoint on 3, as torchrun runs it (``run_script``: torchrun's
environment, in ranks forked with torch already imported). The example asserts by itself
that the sharded model's tokens equal the reloaded adapter model's, on every rank."""

import re
import shutil
from pathlib import Path

import pytest

from flatshard.toolkit.testing import run_script

ROOT = Path(__file__).resolve().parent.parent
GUIDE, EXAMPLE = ROOT / "docs" / "finetune.md", ROOT / "examples" / "finetune_lora.py"

pytest.importorskip("peft")  # (in the dev extras: CI has it)


def test_every_python_block_of_the_guide_is_in_the_example():
    blocks = re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)
    example = EXAMPLE.read_text()
    assert len(blocks) >= 5
    for block in blocks:
        assert block in example, block.splitlines()[0]


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
