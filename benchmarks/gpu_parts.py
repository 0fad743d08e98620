"""The driver the GPU scripts share: each part of a lease's checks in a process of its own,
under its own deadline, so that one that fails or runs out of time costs only itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable


def run_parts(script: str, out_dir: str, parts: list[str], deadlines: dict[str, float], dry: bool) -> None:
    """Run ``script OUT_DIR PART`` for each part, as a child (``GPU_PART_CHILD=1``), killed
    ``deadlines[part] + 30`` s after it starts; print each part's exit status and time."""
    for part in parts:
        start = time.perf_counter()
        argv = [sys.executable, script, out_dir, part] + (["--dry-run"] if dry else [])
        env = {**os.environ, "GPU_PART_CHILD": "1"}
        try:
            rc: int | str = subprocess.run(argv, env=env, timeout=deadlines[part] + 30).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== {part}: rc {rc} in {time.perf_counter() - start:.0f} s", flush=True)


def child_part(parts: list[str]) -> str | None:
    """The part this process runs, when it is a child of ``run_parts``; else None."""
    return parts[0] if len(parts) == 1 and os.environ.get("GPU_PART_CHILD") else None


def run_one_rank(
    one: Callable[..., None],
    part: str,
    path: str,
    *,
    cuda: bool,
    timeout: float,
    threads: int,
    init: bool = True,
) -> None:
    """``one(part, path)`` on a world of one rank (NCCL on a GPU, else gloo); ``init=False``
    leaves the process group to the part (a host library starts it from torchrun's variables)."""
    from flatshard.toolkit.testing import run_distributed

    backend = "nccl" if cuda else "gloo"
    run_distributed(one, 1, part, path, backend=backend, timeout=timeout, threads=threads, init=init)


def arguments(all_parts: list[str]) -> tuple[str, list[str]]:
    """``OUT_DIR [PART ...]`` from the command line (``--dry-run`` aside), OUT_DIR created."""
    args = [a for a in sys.argv[1:] if a != "--dry-run"]
    out_dir, parts = args[0], args[1:] or list(all_parts)
    os.makedirs(out_dir, exist_ok=True)
    return out_dir, parts


def write_result(path: str, part: str, cuda: bool, measure: Callable[[], dict], **fields: object) -> None:
    """``measure()``'s result as JSON at ``path``, after the part, the device, torch's and
    CUDA's versions, the date and ``fields``."""
    import torch

    if cuda:
        torch.cuda.set_device(0)
    result = {
        "part": part,
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        **fields,
    }
    result.update(measure())
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def drive(
    script: str, prefix: str, all_parts: list[str], deadlines: dict[str, float], one, cuda: bool, dry: bool
):
    """A GPU script's ``main``: run each part of the command line as a child (``run_parts``),
    or, in a child, run its part on one rank, ``one(part, OUT_DIR/PREFIX-PART.json)``."""
    out_dir, parts = arguments(all_parts)
    part = child_part(parts)
    if part is None:
        run_parts(script, out_dir, parts, deadlines, dry)
        return
    path = os.path.join(out_dir, f"{prefix}-{part}.json")
    run_one_rank(one, part, path, cuda=cuda, timeout=deadlines[part], threads=4)
