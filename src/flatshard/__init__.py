"""flatshard: ZeRO-style sharded data parallelism for PyTorch on flat, bucketed buffers.

The reasoning is [Note: package layers] below."""

# [Note: package layers]
#
# The package is cut into layers; a module imports only from its own layer and the layers
# listed before it (``tests/repo/test_repo.py`` checks every import):
#
# 0. ``planner/``, pure planning with no process group and no wrapped module: ``layout``
#    (the flat layout planner), ``stage`` (``StagePolicy``: what each stage keeps sharded),
#    ``shard_map`` (which parts of a shard an optimizer run covers), ``plan`` (memory and
#    bytes per rank before running anything), ``mixed_precision``; beside it ``errors`` and
#    ``toolkit.malloc`` (glibc malloc settings for ranks on CPU, a leaf);
# 1. ``comm/``: worlds, collectives, deadlines;
# 2. ``engine/``: flat buffers, reductions, grad sync, param gathers, hook wrappers,
#    tensor-parallel params;
# 3. ``units/``: stage 3: the unit tree, full buckets, placeholders, unsharding units, meta
#    init, full params;
# 4. ``wrap/``: ``shard()`` and the ``ShardedModule`` mixin with its ``ShardState``;
# 5. ``optim/``: the distributed, hybrid and owner-sharded optimizers, loss scaling;
# 6. ``checkpoint/``: checkpoint directories, pieces, checksums, weights files;
# 7. the public surface: this module (``flatshard.__all__``), ``memory``
#    (``memory_report``, which reads a wrapped module and its optimizer) and ``phases``
#    (``offload_states``/``reload_states``: the model state to the host between phases);
# 8. tools on top: ``app/`` (CLI, training loop, launcher, bench and its peers, drawings),
#    ``hosts/`` (flatshard inside other libraries' loops: ``hf``, ``accelerate``, ``lightning``,
#    ``pipelining``) and
#    ``toolkit/``: ``models`` (the demo GPT, Hugging Face configs), ``data`` (the synthetic
#    corpus) and ``testing`` (the multi-process test harness).
#
# Public: the names in ``__all__``, the modules of ``planner/``, ``memory``, ``toolkit/``,
# ``hosts/`` and the CLI. Everything else may move between releases.

import importlib
from typing import TYPE_CHECKING, Any

from flatshard.comm.collectives import CommStats
from flatshard.errors import (
    CheckpointError,
    ChecksumError,
    DesyncError,
    NonFiniteGradError,
    ShardedGradError,
    ShardedParamError,
)
from flatshard.memory import MemoryReport, memory_report
from flatshard.optim.distributed import DistributedOptimizer
from flatshard.optim.grad_scaler import ShardedGradScaler
from flatshard.optim.grouped import GroupedOptimizer
from flatshard.optim.hybrid import HybridDeviceOptimizer
from flatshard.optim.loss_scale import DynamicLossScaler, StaticLossScaler
from flatshard.optim.owner import OwnerShardedOptimizer
from flatshard.phases import offload_states, offloaded, reload_states
from flatshard.planner.layout import Layout, ParamSpec, plan_layout
from flatshard.planner.mixed_precision import MixedPrecision, OptimizerPrecision
from flatshard.planner.offload import Offload
from flatshard.planner.stage import Buckets, Stage3
from flatshard.wrap.module import ShardedModule
from flatshard.wrap.shard import Experts, shard
from flatshard.wrap.uneven import even_batches

__all__ = [
    "Buckets",
    "CheckpointError",
    "ChecksumError",
    "CommStats",
    "DesyncError",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "Experts",
    "GroupedOptimizer",
    "HybridDeviceOptimizer",
    "Layout",
    "MemoryReport",
    "MixedPrecision",
    "NonFiniteGradError",
    "Offload",
    "OptimizerPrecision",
    "OwnerShardedOptimizer",
    "ParamSpec",
    "ShardedGradError",
    "ShardedGradScaler",
    "ShardedModule",
    "ShardedParamError",
    "Stage3",
    "StaticLossScaler",
    "even_batches",
    "export_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "load_pretrained",
    "load_weights",
    "memory_report",
    "offload_states",
    "offloaded",
    "plan_layout",
    "prune_checkpoints",
    "reload_states",
    "save_checkpoint",
    "save_pretrained",
    "shard",
    "verify_checkpoint",
    "wait_for_checkpoint",
]
__version__ = "0.1.0"

_CHECKPOINTS = {
    "load_checkpoint": "directory",
    "save_checkpoint": "directory",
    "verify_checkpoint": "directory",
    "wait_for_checkpoint": "background",
    "latest_checkpoint": "latest",
    "prune_checkpoints": "latest",
    "load_pretrained": "pretrained",
    "save_pretrained": "pretrained",
    "export_checkpoint": "weights",
    "load_weights": "weights",
}
"""The checkpoint functions, imported at their first use: they bring in
``torch.distributed.checkpoint`` and DTensor (a third of ``import flatshard``, ~1.1 s, which
every ``python -m flatshard`` and every rank paid, checkpoint or not)."""

if TYPE_CHECKING:
    from flatshard.checkpoint.background import wait_for_checkpoint
    from flatshard.checkpoint.directory import load_checkpoint, save_checkpoint, verify_checkpoint
    from flatshard.checkpoint.latest import latest_checkpoint, prune_checkpoints
    from flatshard.checkpoint.pretrained import load_pretrained, save_pretrained
    from flatshard.checkpoint.weights import export_checkpoint, load_weights


def __getattr__(name: str) -> Any:
    if name not in _CHECKPOINTS:
        raise AttributeError(f"module 'flatshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"flatshard.checkpoint.{_CHECKPOINTS[name]}"), name)
    globals()[name] = value
    return value
