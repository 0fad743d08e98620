"""What the tests of flatshard under a host's trainer share (``hosts/test_hosts_*.py``): the
model and data both sides train, the run they make, and what they compare."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from flatshard.toolkit.models import tiny_model
from flatshard.toolkit.models.float8 import float8_linears as _float8_linears

SEQ = 16

SETTINGS: dict[str, Any] = dict(
    use_cpu=True,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,  # (accumulation: the micro-batches before the last under no_sync)
    max_steps=4,
    learning_rate=1e-3,
    weight_decay=0.01,
    max_grad_norm=0.5,  # (every step clips: the norms are well above it)
    lr_scheduler_type="linear",
    optim="adamw_torch",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    disable_tqdm=True,
    dataloader_drop_last=True,
)
"""The ``TrainingArguments`` (or a TRL config's) of every hosted run, but ``output_dir``."""


def logged_steps(trainer: Any) -> list[tuple[float, float]]:
    """Each logged step's (loss, grad norm)."""
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


class Tokens(torch.utils.data.Dataset):
    """32 fixed sequences of random tokens (labels = inputs: the model shifts them)."""

    def __init__(self) -> None:
        self.ids = torch.randint(1, 256, (32, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> torch.nn.Module:
    """A tiny Llama from its config, the same on every rank and side (seed 0)."""
    torch.manual_seed(0)
    return tiny_model("llama", seq_len=SEQ)


float8_linears = partial(_float8_linears, emulate=True)
"""A model's linears in torchao's float8 training with fp8 all-gathers, emulated (a CPU)."""


def on_eager_dynamo(run, *args, **kwargs):
    """``run(*args, **kwargs)`` with dynamo's "eager" backend as torch.compile's default: torchao's
    low-bit optimizers compile their step, the same graph op by op on both sides, instead of
    ~20 s of inductor a test (see tests/optim/test_blockwise_state.py)."""
    torch.compiler.set_default_backend("eager")
    try:
        return run(*args, **kwargs)
    finally:
        torch.compiler.set_default_backend(None)
