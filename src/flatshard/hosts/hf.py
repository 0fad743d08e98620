"""flatshard under ``transformers.Trainer``: ``flatshard.hosts.hf.Trainer`` is the Trainer,
training a sharded model.

The reasoning is [Note: hosted training] below."""

# [Note: hosted training]
#
# A host library (the Trainer, and TRL's trainers built on it) runs the loop: it wraps the
# model, builds the optimizer, accumulates, clips, logs, saves and resumes. Under it flatshard
# keeps the invariants it keeps in a hand-written loop, by taking over exactly the points
# where the host would otherwise break them:
#
# * **Sharded once the host has prepared the model.** With ``shard=``, the host's own
#   ``__init__`` runs on the plain model first (TRL adds its peft adapters, copies a reference
#   model, resizes embeddings), exactly as under its DDP; then the model it kept is sharded in
#   place (the same object, so every reference the host holds stays valid). At stage 3 a
#   frozen reference model (DPO's ``ref_model``) is sharded too.
# * **No wrapper on top.** The host prepares the model for evaluation only (autocast, no
#   DDP): flatshard's hooks reduce the grads (DDP on top is refused anyway). Its evaluation
#   runs the plain model under its DDP, so there the buffers (BatchNorm's statistics) are
#   neither sent nor armed to be (``buffer_broadcast_hooks`` in ``wrap/sync_states.py``).
# * **Only flatshard's optimizer steps.** The host's choice of optimizer (``args.optim``, or
#   ``optimizer_cls_and_kwargs``), its hyperparameters and its weight-decay groups become a
#   ``DistributedOptimizer`` of that class; LR schedulers see its param groups as usual. An
#   optimizer the host builds from the model by itself (factories, layer-wise, GaLore's
#   params) is refused, naming ``optim``.
# * **Accumulation and clipping are the host's own**: it runs the micro-batches before the last
#   under ``model.no_sync()``, and its clip is torch's ``clip_grad_norm_`` over the params,
#   whose grads give the global norm ([Note: grads seen by torch]); so the logged
#   ``grad_norm`` is the one DDP's Trainer logs. fp16 loss scaling uses ``ShardedGradScaler``
#   ([Note: grad scaler]) in place of the host's scaler.
# * **Saves are collective.** ``save_model`` gathers the full state dict on rank 0 (every rank
#   takes part) and writes it with the host's own ``save_pretrained`` path, so
#   ``from_pretrained`` loads the directory (a peft model: its adapter). A Trainer checkpoint
#   holds a flatshard checkpoint (``flatshard/``: params, fp32 main params, optimizer state) in
#   place of ``optimizer.pt``; ``resume_from_checkpoint`` loads it at any world size and stage,
#   with the scheduler, the trainer state and the RNG states the host saves itself.
#   The flatshard checkpoint is written in the background while training goes on
#   ([Note: background saves]); ``train()`` returns once the last one is complete.
#   ``resume_from_checkpoint=True`` (a restarted job) takes the newest *complete* checkpoint:
#   the host's own pick is the highest-numbered ``checkpoint-N``, which a save cut off by a
#   failure leaves behind half written; one counts as complete once its flatshard checkpoint
#   is whole and the host's last write (``trainer_state.json``) reads. Newer ones are skipped
#   with a warning naming each.
# * **What cannot hold is refused** before training: FSDP or DeepSpeed in the same arguments,
#   full-eval casts (they cast the params), ranks the host does not see (on CPU, without
#   ``use_cpu=True`` the host trains each rank alone), a torch optimizer passed in.

from __future__ import annotations

import inspect
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flatshard.checkpoint.background import wait_for_checkpoint
from flatshard.checkpoint.directory import load_checkpoint, read_manifest, save_checkpoint
from flatshard.engine.dynamo import uncompiled
from flatshard.errors import CheckpointError
from flatshard.hosts.scaler import use_sharded_scaler
from flatshard.optim.composite import unwrap_optimizer
from flatshard.optim.distributed import DistributedOptimizer
from flatshard.wrap.module import ShardedModule
from flatshard.wrap.shard import shard as shard_model

try:
    import transformers
except ImportError as e:  # (the hf extra)
    raise ImportError("flatshard.hosts.hf needs transformers: pip install 'flatshard[hf]'") from e

CHECKPOINT = "flatshard"
"""The flatshard checkpoint's folder inside a Trainer checkpoint (``checkpoint-N/flatshard``)."""
SCHEDULER = "scheduler.pt"
REFUSED_ARGUMENTS = (
    *("fsdp", "deepspeed", "fp16_full_eval", "bf16_full_eval"),
    *("auto_find_batch_size", "load_best_model_at_end"),
)
"""What would cast, reshard or reload the model behind flatshard's back ([Note: hosted training])."""


class ShardedTrainerMixin:
    """The Trainer's methods that flatshard takes over ([Note: hosted training]); put it first
    among the bases of any ``transformers.Trainer`` subclass (``sharded(cls)`` does)."""

    optimizer: Any  # (the Trainer's)
    model: Any
    model_wrapped: Any

    def __init__(self, *positional: Any, **kwargs: Any) -> None:
        how = kwargs.pop("shard", None)
        host_init = super().__init__  # type: ignore[misc]
        # (by the host's own signature: DPOTrainer takes ref_model second, before args)
        given = inspect.signature(host_init).bind_partial(*positional, **kwargs).arguments
        model, args = given.get("model"), given.get("args")
        if model is None or args is None:
            raise TypeError("a sharded Trainer needs model= and args= (the model is sharded before training)")
        _check_arguments(args)
        _check_sharding(model, how)
        if isinstance(model, ShardedModule) and kwargs.get("peft_config") is not None:
            raise ValueError(
                "peft_config= with a model that is already sharded: the adapters would be params flatshard "
                "never laid out. Pass the plain model with shard=STAGE (the host adds them, then flatshard "
                "shards the result), or add them before flatshard.shard and leave peft_config out"
            )
        optimizers = kwargs.get("optimizers", (None, None))
        if optimizers[0] is not None and not isinstance(optimizers[0], DistributedOptimizer):
            raise TypeError(
                f"optimizers=({type(optimizers[0]).__name__}, ...): flatshard steps its own shards; pass "
                "flatshard.DistributedOptimizer(model, torch.optim.AdamW, ...) built over the sharded model "
                "(shard it first with flatshard.shard), or leave optimizers out and choose args.optim"
            )
        host_init(*positional, **kwargs)
        if how is not None:  # sharded in place (same object) once the host prepared the model
            self.model = self.model_wrapped = _sharded(self.model, how, args.device)
            _shard_reference(self, how, args.device)

    # -- the host's pieces ------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()  # type: ignore[misc]
        use_sharded_scaler(self.accelerator)  # type: ignore[attr-defined]

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        """Autocast and the prepared mark, no DDP: flatshard reduces the grads."""
        return self.accelerator.prepare_model(  # type: ignore[attr-defined]
            model, device_placement=False, evaluation_mode=True
        )

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The host's evaluation, whose forwards its DDP never sees (it evaluates the plain
        model): they neither send rank 0's buffers nor arm the next training forward's send."""
        state = self.model.flatshard_state  # type: ignore[attr-defined]
        state.buffers_as_unwrapped = True
        try:
            return super().evaluation_loop(*args, **kwargs)  # type: ignore[misc]
        finally:
            state.buffers_as_unwrapped = False

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = _distributed_optimizer(self, self.model)  # type: ignore[attr-defined]
        return self.optimizer

    # -- saving and resuming ----------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:  # (else the host's pick: the highest-numbered)
            output_dir = self.args.output_dir  # type: ignore[attr-defined]
            resume_from_checkpoint = last_complete_checkpoint(output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output directory ({output_dir})")
        result = super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]
        wait_for_checkpoint()  # (the last checkpoint's writer: complete when train() returns)
        return result

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Every rank gathers the full state dict; the host's own ``_save`` writes it on rank 0
        (what ``from_pretrained`` loads), as the host does for FSDP."""
        state = self.model.full_state_dict() if state_dict is None else state_dict  # type: ignore[attr-defined]
        super()._save(output_dir, state_dict=state)  # type: ignore[misc]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        path, model, optimizer = os.path.join(output_dir, CHECKPOINT), self.model, _flat(self.optimizer)  # type: ignore[attr-defined]
        save_checkpoint(path, model, optimizer, blocking=False)  # (written while training goes on)
        if self.args.should_save:  # type: ignore[attr-defined]
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))  # type: ignore[attr-defined]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT)):
            raise FileNotFoundError(
                f"{resume_from_checkpoint} holds no flatshard checkpoint ({CHECKPOINT}/): it was not "
                "written by a sharded Trainer. To start from its weights, load them into the model "
                "before sharding (from_pretrained) and train without resume_from_checkpoint"
            )
        # (the params load with the optimizer's state, in _load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_checkpoint(os.path.join(checkpoint, CHECKPOINT), self.model, _flat(self.optimizer))  # type: ignore[attr-defined]
        scheduler = os.path.join(checkpoint, SCHEDULER)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))  # type: ignore[attr-defined]


class Trainer(ShardedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training a sharded model: ``Trainer(model=..., args=...,
    shard=2)``, where ``shard`` is the stage, or ``flatshard.shard``'s keyword arguments as a
    dict (``{"stage": 3, "mixed_precision": ...}``), or omitted for a model already sharded.
    Everything else is the Trainer's ([Note: hosted training])."""


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The highest-numbered ``checkpoint-N`` under ``output_dir`` whose save finished (its
    flatshard checkpoint whole, its ``trainer_state.json`` readable), or None; newer ones
    are skipped with a warning naming each ([Note: hosted training])."""
    from transformers.trainer import TRAINER_STATE_NAME
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    if not os.path.isdir(output_dir):
        return None
    steps = {}
    for name in os.listdir(output_dir):
        number = name.removeprefix(f"{PREFIX_CHECKPOINT_DIR}-")
        if number.isdigit() and os.path.isdir(os.path.join(output_dir, name)):
            steps[os.path.join(output_dir, name)] = int(number)
    for path in sorted(steps, key=steps.__getitem__, reverse=True):  # (the newest step first)
        try:
            read_manifest(os.path.join(path, CHECKPOINT))
            with open(os.path.join(path, TRAINER_STATE_NAME)) as f:
                json.load(f)
        except (CheckpointError, OSError, ValueError) as e:
            warnings.warn(f"skipping {path}: its save did not finish or is torn ({e})", stacklevel=2)
            continue
        return path
    return None


def sharded(trainer_class: type) -> type:
    """``trainer_class`` (a ``transformers.Trainer`` subclass: TRL's ``SFTTrainer``,
    ``DPOTrainer``, yours) training a sharded model, as ``Trainer`` does."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"sharded() takes a transformers.Trainer subclass, got {trainer_class!r}")
    if issubclass(trainer_class, ShardedTrainerMixin):
        return trainer_class
    return type(f"Sharded{trainer_class.__name__}", (ShardedTrainerMixin, trainer_class), {})


# -- helpers ------------------------------------------------------------------------------------
def _check_arguments(args: Any) -> None:
    """Refuse what would train wrong or fail late ([Note: hosted training])."""
    for name in REFUSED_ARGUMENTS:
        if getattr(args, name):
            raise ValueError(
                f"TrainingArguments({name}=...) with a sharded Trainer: flatshard shards the model itself "
                f"and {name} would change or reshard it; leave it out"
            )
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks != args.world_size:
        raise ValueError(
            f"the job has {ranks} ranks but the Trainer sees {args.world_size} (on CPU the Trainer "
            "trains each rank alone unless TrainingArguments(use_cpu=True)): every rank would train "
            "its own copy"
        )


def _check_sharding(model: nn.Module, how: int | Mapping[str, Any] | None) -> None:
    if isinstance(model, ShardedModule) and how is not None:
        raise ValueError(f"shard={how!r} for a model that is already sharded: leave shard out")
    if not isinstance(model, ShardedModule) and how is None:
        raise ValueError(
            "the model is not sharded: pass shard=STAGE (0-3) or shard={...} (flatshard.shard's keywords)"
        )
    stage = isinstance(how, int) and not isinstance(how, bool)
    if how is not None and not (stage or isinstance(how, Mapping)):
        raise TypeError(f"shard must be a stage (0-3) or a dict of flatshard.shard's keywords, got {how!r}")


def _sharded(model: nn.Module, how: int | Mapping[str, Any], device: torch.device) -> nn.Module:
    """``model`` as the host prepared it (TRL's adapters added, its reference model copied),
    sharded in place."""
    options = {"stage": how} if isinstance(how, int) else how
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: TrainingArguments starts it under torchrun (use_cpu=True on CPU)"
        )
    return shard_model(model.to(device), **options)


def _shard_reference(trainer: Any, how: int | Mapping[str, Any], device: torch.device) -> None:
    """A frozen model the host keeps beside the trained one (TRL's DPO ``ref_model``): at
    stage 3 sharded too, each rank holding its shards of it, as TRL shards it under FSDP or
    ZeRO-3; below stage 3 it is replicated on every rank, as it does under DDP or ZeRO-1/2."""
    options = {"stage": how} if isinstance(how, int) else dict(how)
    reference = getattr(trainer, "ref_model", None)
    if not isinstance(reference, nn.Module) or isinstance(uncompiled(reference), ShardedModule):
        return
    if options.get("stage") == 3:
        trainer.ref_model = shard_model(reference.to(device), **options)


def _distributed_optimizer(trainer: Any, model: nn.Module) -> DistributedOptimizer:
    """The host's optimizer choice over its weight-decay groups, as a ``DistributedOptimizer``."""
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": trainer.args.weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    chosen = trainer.optimizer_cls_and_kwargs or trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
    cls, kwargs = chosen
    built_by_host = {"params", "model", "optimizer_dict"} & set(kwargs)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or built_by_host:
        raise ValueError(
            f"optim={trainer.args.optim!r} builds its optimizer from the model itself ({cls!r}); flatshard "
            "steps a torch.optim class over its shards: choose e.g. optim='adamw_torch', 'sgd' or "
            "'adafactor'... or pass optimizer_cls_and_kwargs=(torch.optim.X, {...})"
        )
    return DistributedOptimizer(model, cls, params=[g for g in groups if g["params"]], **kwargs)


def _flat(optimizer: Any) -> DistributedOptimizer:
    """The ``DistributedOptimizer`` under the host's wrapper (accelerate's)."""
    inner = unwrap_optimizer(optimizer)
    if not isinstance(inner, DistributedOptimizer):
        raise TypeError(f"the Trainer's optimizer is {type(inner).__name__}, not flatshard's")
    return inner
