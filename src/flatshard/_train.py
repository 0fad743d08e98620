"""The ``flatshard train`` job: a built-in GPT on the built-in corpus, on every rank."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import flatshard
from flatshard.data import SyntheticCorpus
from flatshard.memory import memory_report, retain_freed_cpu_memory
from flatshard.models import GPT, PRESETS


@dataclass(frozen=True)
class TrainConfig:
    model: str = "small"
    stage: int = 0
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    clip: float = 1.0
    bucket_size: int | None = flatshard.api.DEFAULT_BUCKET_SIZE
    seed: int = 0
    device: str = "auto"
    offload_fraction: float = 0.0  # share of this rank's optimizer updates run on the host


def run(cfg: TrainConfig) -> dict:
    """Train on this rank (joining the process group from the environment); rank 0 reports."""
    device = _device(cfg.device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=300))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        summary = _train(cfg, device, rank, world)
        if dist.is_initialized():
            dist.barrier()  # no rank tears down its connections while a peer still uses them
        return summary
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device(name)


def _train(cfg: TrainConfig, device: torch.device, rank: int, world: int) -> dict:
    model_cfg = PRESETS[cfg.model]
    if device.type == "cpu":
        retain_freed_cpu_memory()
    torch.manual_seed(cfg.seed)  # same init on every rank
    model = flatshard.shard(GPT(model_cfg).to(device), stage=cfg.stage, bucket_size=cfg.bucket_size)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    inner: dict = {"optimizer_class": torch.optim.AdamW}
    if cfg.offload_fraction > 0:
        inner = {
            "optimizer_class": flatshard.HybridDeviceOptimizer,
            "offload_fraction": cfg.offload_fraction,
            "cpu_optimizer_class": torch.optim.AdamW,
        }
    optimizer = flatshard.DistributedOptimizer(
        model,
        params=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        weight_decay=0.1,
        betas=(0.9, 0.95),
        **inner,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(cfg.warmup, cfg.steps))
    corpus = SyntheticCorpus(model_cfg.vocab_size, model_cfg.seq_len, seed=1234)
    progress = _Progress(cfg.steps, enabled=rank == 0)
    losses = []
    start = time.perf_counter()
    for step in range(cfg.steps):
        x, y = (t.to(device) for t in corpus.batch(step, rank, cfg.batch_size))
        loss = model(x, y)
        loss.backward()
        optimizer.clip_grad_norm_(cfg.clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        progress.update(step + 1, losses[-1])
    elapsed = time.perf_counter() - start
    progress.close()
    final = torch.tensor([sum(losses[-10:]) / len(losses[-10:])], device=device)
    if world > 1:
        dist.all_reduce(final)
    summary = {
        "model": cfg.model,
        "params": sum(p.numel() for p in model.parameters()),
        "stage": cfg.stage,
        "offload_fraction": cfg.offload_fraction,
        "world_size": world,
        "steps": cfg.steps,
        "tokens_per_s": cfg.steps * cfg.batch_size * model_cfg.seq_len * world / elapsed,
        "first_loss": losses[0],
        "final_loss": float(final) / world,
        "uniform_loss": corpus.uniform_loss,
        "entropy_floor": corpus.entropy_rate,
        "memory": memory_report(model, optimizer).as_dict(),
    }
    if rank == 0:
        print(format_summary(summary), flush=True)
    return summary


def _warmup_cosine(warmup: int, steps: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def format_summary(s: dict) -> str:
    mem = s["memory"]
    offload = s.get("offload_fraction", 0.0)
    offload = f", {offload:.0%} of the optimizer on the host" if offload else ""
    return "\n".join(
        [
            f"flatshard train: {s['model']} GPT ({s['params']:,} params), stage {s['stage']}, "
            f"{s['world_size']} rank(s)"
            + (
                f", {s['offload_fraction']:.0%} of the optimizer on the host" if s["offload_fraction"] else ""
            ),
            f"  steps            {s['steps']}",
            f"  tokens/s         {s['tokens_per_s']:,.0f}",
            f"  loss             {s['first_loss']:.3f} -> {s['final_loss']:.3f}  "
            f"(uniform guess {s['uniform_loss']:.3f}, corpus entropy floor {s['entropy_floor']:.3f})",
            f"  model state/rank {_mib(mem['total'])}  (params {_mib(mem['params'])}, grads "
            f"{_mib(mem['grads'])}, main params {_mib(mem['main_params'])}, optimizer "
            f"{_mib(mem['optimizer_state'])})",
        ]
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class _Progress:
    """A progress bar on rank 0: rich when installed, a plain line otherwise."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._rich = None
        self._last = 0.0
        if not enabled:
            return
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )
        except ImportError:
            return
        self._rich = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task = self._rich.add_task("train", total=total, loss="-")
        self._rich.start()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=step, loss=f"{loss:.3f}")
            return
        now = time.monotonic()
        if now - self._last > 0.5 or step == self.total:
            self._last = now
            filled = int(30 * step / self.total)
            sys.stderr.write(
                f"\rtrain [{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} loss {loss:.3f}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.enabled:
            sys.stderr.write("\n")
