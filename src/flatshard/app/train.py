"""The ``flatshard train`` job: a GPT preset or the user's model, on the built-in corpus or a
text file, on every rank; checkpoints with resume, per-step metrics, a loss curve."""

from __future__ import annotations

import math
import os
import re
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import flatshard
from flatshard.app.train_report import Metrics, Progress, format_summary, plot_losses
from flatshard.memory import memory_report
from flatshard.planner import plan
from flatshard.planner.stage import DEFAULT_BUCKET_SIZE
from flatshard.toolkit.data import ByteCorpus, SyntheticCorpus
from flatshard.toolkit.malloc import retain_freed_cpu_memory
from flatshard.toolkit.models import lm_loss, model_dims, model_factory
from flatshard.toolkit.models.float8 import float8_linears

KEEP_CHECKPOINTS = 2  # the newest complete checkpoints kept under --checkpoint-dir


@dataclass(frozen=True)
class TrainConfig:
    model: str = "small"  # a GPT preset or module:factory
    stage: int = 0
    steps: int = 300
    batch_size: int = 16  # sequences per rank per micro-batch
    micro_batches: int = 1  # gradient accumulation steps per optimizer step
    lr: float = 3e-3
    warmup: int = 20
    clip: float = 1.0
    bucket_size: int | None = DEFAULT_BUCKET_SIZE
    seed: int = 0
    device: str = "auto"
    offload_fraction: float = 0.0  # share of this rank's optimizer updates run on the host
    offload_step: str = "host"  # where an offloaded optimizer steps ([Note: streamed step])
    fp8_gathers: bool = False  # float8 linears, gathered in fp8 ([Note: fp8 gathers])
    dtype: str = "fp32"  # bf16: bf16 params and compute, fp32 main params
    data: str | None = None  # a text file (byte-level tokens); None: the synthetic corpus
    seq_len: int | None = None  # default: the model's cfg.seq_len
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end
    resume: bool = False  # continue from checkpoint_dir/latest when it exists
    init_from: str | None = None  # plain weights (.safetensors / .pt) to start from
    metrics: str | None = None  # JSONL file, one record per step
    plot: str | None = None  # loss-curve PNG
    timeout: float = 600.0  # seconds: the deadline of each collective ([Note: deadlines])


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


def resolve_device(name: str, local_ranks: int) -> str:
    """``"cpu"`` or ``"cuda"`` for ``--device name`` with ``local_ranks`` ranks on this host:
    ``auto`` is CUDA only when every local rank gets a GPU of its own (NCCL refuses two
    ranks on one GPU), else CPU. Raises ``ValueError`` for ``cuda`` without enough GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return "cuda" if gpus >= local_ranks else "cpu"
    if name == "cuda" and gpus < local_ranks:
        raise ValueError(
            f"--device cuda needs a CUDA device per local rank: {local_ranks} rank(s), {gpus} device(s)"
        )
    return name


def _device(name: str) -> torch.device:
    name = resolve_device(name, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if name == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device(name)


def build(cfg: TrainConfig, device: torch.device):
    """The sharded model, its data and the sequence length; errors name the bad option."""
    torch.manual_seed(cfg.seed)  # same init on every rank
    module = model_factory(cfg.model)().to(device)
    vocab, model_seq_len = model_dims(module)
    seq_len = cfg.seq_len or model_seq_len
    if seq_len is None:
        raise ValueError(f"--model {cfg.model} has no cfg.seq_len: pass --seq-len")
    corpus: ByteCorpus | SyntheticCorpus
    if cfg.data is not None:
        corpus = ByteCorpus(cfg.data, seq_len, seed=1234)
        if vocab is not None and vocab < ByteCorpus.vocab_size:
            raise ValueError(
                f"--data needs a model with vocab_size >= 256 (byte tokens); {cfg.model} has {vocab}"
            )
    elif vocab is None:
        raise ValueError(f"--model {cfg.model} has no cfg.vocab_size for the built-in corpus: pass --data")
    else:
        corpus = SyntheticCorpus(vocab, seq_len, seed=1234)
    kwargs: dict[str, Any] = {}
    if cfg.fp8_gathers:
        float8_linears(module, emulate=device.type != "cuda")
    if cfg.dtype != "fp32" or cfg.fp8_gathers:
        dtype = plan.DTYPES[cfg.dtype] if cfg.dtype != "fp32" else None
        kwargs["mixed_precision"] = flatshard.MixedPrecision(
            param_dtype=dtype, fp8_gathers=cfg.fp8_gathers or None
        )
    if cfg.offload_fraction > 0:  # ([Note: memory tiers])
        kwargs["offload"] = flatshard.Offload(optimizer=cfg.offload_fraction, step=cfg.offload_step)
    model = flatshard.shard(
        module,
        stage=cfg.stage,
        buckets=flatshard.Buckets(size=cfg.bucket_size),
        timeout=cfg.timeout,
        **kwargs,
    )
    return model, corpus


def _optimizer(cfg: TrainConfig, model):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    optimizer = flatshard.DistributedOptimizer(  # (on the host as the model's Offload says)
        model,
        torch.optim.AdamW,
        params=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        weight_decay=0.1,
        betas=(0.9, 0.95),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(cfg.warmup, cfg.steps))
    return optimizer, schedule


def resume_problem(checkpoint_dir: str | None, steps: int) -> str | None:
    """Why resuming from ``checkpoint_dir`` cannot train toward ``steps``, or None: the
    checkpoint a resume loads (``latest_checkpoint``, whose warnings the ranks give) is at
    step ``steps`` or past it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = flatshard.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    match = re.match(r"step-(\d+)", os.path.basename(path)) if path else None  # (as _save names them)
    if match and int(match.group(1)) >= steps:
        return (
            f"--steps {steps}, but the newest checkpoint {path} is at step {match.group(1)}: "
            f"pass --steps above {match.group(1)}"
        )
    return None


def _start(cfg: TrainConfig, model, optimizer, schedule) -> int:
    """The step to start from: the newest checkpoint's with --resume, else 0 (from
    --init-from weights when given)."""
    problem = resume_problem(cfg.checkpoint_dir, cfg.steps) if cfg.resume else None
    if problem is not None:
        raise ValueError(problem)
    path = flatshard.latest_checkpoint(cfg.checkpoint_dir) if cfg.resume and cfg.checkpoint_dir else None
    if path is not None:  # (the newest whose save finished whole: [Note: latest checkpoint])
        return int(flatshard.load_checkpoint(path, model, optimizer, extra={"schedule": schedule})["step"])
    if cfg.init_from is not None:
        flatshard.load_weights(model, cfg.init_from, optimizer)
    return 0


def _train(cfg: TrainConfig, device: torch.device, rank: int, world: int) -> dict:
    if device.type == "cpu":
        retain_freed_cpu_memory()
    model, corpus = build(cfg, device)
    optimizer, schedule = _optimizer(cfg, model)
    first_step = _start(cfg, model, optimizer, schedule)
    metrics = Metrics(cfg.metrics if rank == 0 else None, resume=first_step > 0)
    progress = Progress(cfg.steps, enabled=rank == 0)
    tokens = cfg.micro_batches * cfg.batch_size * corpus.seq_len * world  # per step
    state_bytes = None  # fixed once the first step has created the optimizer state
    start = time.perf_counter()
    for step in range(first_step, cfg.steps):
        began, sent = time.perf_counter(), model.comm_stats.total_wire_bytes
        loss = _accumulate(cfg, model, corpus, step, rank, device)
        norm = optimizer.clip_grad_norm_(cfg.clip)
        optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        schedule.step()
        optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        took = time.perf_counter() - began
        if state_bytes is None:
            state_bytes = memory_report(model, optimizer).total
        record = {
            "step": step + 1,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": float(norm),
            "tokens_per_s": tokens / took,
            "step_time_s": took,
            "model_state_bytes": state_bytes,
            "comm_wire_bytes": model.comm_stats.total_wire_bytes - sent,
        }
        metrics.add(record)
        progress.update(step + 1, record["loss"])
        directory = _checkpoint_due(cfg, step + 1)
        if directory is not None:
            _save(directory, step + 1, model, optimizer, schedule, rank)
    tokens_per_s = (cfg.steps - first_step) * tokens / (time.perf_counter() - start)
    model.wait_for_params()  # the last step's gathers, before the process group goes away
    flatshard.wait_for_checkpoint()  # (and the last save's writer, which needs it too)
    if rank == 0 and cfg.checkpoint_dir is not None:
        flatshard.prune_checkpoints(cfg.checkpoint_dir, KEEP_CHECKPOINTS)
    progress.close()
    metrics.close()
    return _finish(cfg, model, optimizer, corpus, metrics.records, first_step, tokens_per_s, rank, world)


def _checkpoint_due(cfg: TrainConfig, done: int) -> str | None:
    """The checkpoint directory if a checkpoint is due after ``done`` steps, else None."""
    if cfg.checkpoint_dir is None:
        return None
    due = done == cfg.steps or (cfg.checkpoint_every > 0 and done % cfg.checkpoint_every == 0)
    return cfg.checkpoint_dir if due else None


def _save(directory: str, done: int, model, optimizer, schedule, rank: int) -> None:
    """Save ``directory/step-N`` in the background ([Note: background saves]: the next save
    or the run's end waits for it); then drop all but the newest ``KEEP_CHECKPOINTS`` that
    are complete (the one in flight is not yet: the run's end prunes once more)."""
    path = os.path.join(directory, f"step-{done}")  # (the step read back by resume_problem)
    extra = {"step": done, "schedule": schedule}
    flatshard.save_checkpoint(path, model, optimizer, extra=extra, blocking=False)
    if rank == 0:
        flatshard.prune_checkpoints(directory, KEEP_CHECKPOINTS)


def _accumulate(cfg: TrainConfig, model, corpus, step: int, rank: int, device) -> torch.Tensor:
    """Forward and backward over the step's micro-batches (grads synced on the last only);
    the mean loss."""
    total = torch.zeros((), device=device)
    for micro in range(cfg.micro_batches):
        x, y = (t.to(device) for t in corpus.batch(step * cfg.micro_batches + micro, rank, cfg.batch_size))
        last = micro == cfg.micro_batches - 1
        model.set_requires_gradient_sync(last)
        loss = lm_loss(model, x, y) / cfg.micro_batches
        loss.backward()
        total += loss.detach().float()
    return total


def _finish(cfg, model, optimizer, corpus, records, first_step, tokens_per_s, rank, world) -> dict:
    losses = [r["loss"] for r in records]
    summary = {
        "model": cfg.model if ":" in cfg.model else f"{cfg.model} GPT",
        "params": sum(p.numel() for p in model.parameters()),
        "stage": cfg.stage,
        "dtype": cfg.dtype,
        "offload_fraction": cfg.offload_fraction,
        "offload_step": cfg.offload_step,
        "fp8_gathers": cfg.fp8_gathers,
        "world_size": world,
        "first_step": first_step,
        "steps": cfg.steps,
        "tokens_per_s": tokens_per_s,
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else float("nan"),
        "uniform_loss": corpus.uniform_loss,
        "entropy_floor": corpus.entropy_rate,
        "memory": memory_report(model, optimizer).as_dict(),
    }
    if rank == 0:
        print(format_summary(summary), flush=True)
        if cfg.plot and records:
            title = f"{summary['model']}, stage {cfg.stage}, {world} rank(s), {cfg.dtype}"
            reference = {"uniform guess": corpus.uniform_loss, "entropy floor": corpus.entropy_rate}
            plot_losses(cfg.plot, records, title, reference)
            print(f"wrote {cfg.plot}", flush=True)
    return summary


def _warmup_cosine(warmup: int, steps: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
