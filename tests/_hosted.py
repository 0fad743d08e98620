"""What the tests of flatshard under a host's trainer share (``hosts/test_hosts_*.py``): the
model and data both sides train, the run they make, and what they compare."""

from __future__ import annotations

from typing import Any

import torch

from flatshard.toolkit.models import tiny_model

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


def float8_linears(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder's linears converted to torchao's float8 training (emulated on the CPU),
    their weights wrapped for fp8 all-gathers, as a user's recipe converts them."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    decoder = lambda m, name: ".layers." in name  # noqa: E731
    return convert_to_float8_training(model, config=config, module_filter_fn=decoder)
