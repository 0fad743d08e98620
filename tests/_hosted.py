"""What the tests of flatshard under a host's trainer share (``test_hosts_hf.py``,
``test_hosts_trl.py``): the run both sides make, and what they compare."""

from __future__ import annotations

from typing import Any

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
