"""flatshard: ZeRO-style sharded data parallelism for PyTorch on flat, bucketed buffers."""

from flatshard._collectives import CommStats
from flatshard._sharded_module import ShardedModule
from flatshard.api import ExpertGroup, shard
from flatshard.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint
from flatshard.errors import CheckpointError, ChecksumError
from flatshard.hybrid_optimizer import HybridDeviceOptimizer
from flatshard.layout import Layout, ParamSpec, plan_layout
from flatshard.loss_scale import DynamicLossScaler, StaticLossScaler
from flatshard.memory import MemoryReport, memory_report
from flatshard.mixed_precision import MixedPrecision
from flatshard.optimizer import DistributedOptimizer
from flatshard.owner_optimizer import OwnerShardedOptimizer
from flatshard.weights import export_checkpoint, load_weights

__all__ = [
    "CheckpointError",
    "ChecksumError",
    "CommStats",
    "DistributedOptimizer",
    "DynamicLossScaler",
    "ExpertGroup",
    "HybridDeviceOptimizer",
    "Layout",
    "MemoryReport",
    "MixedPrecision",
    "OwnerShardedOptimizer",
    "ParamSpec",
    "ShardedModule",
    "StaticLossScaler",
    "export_checkpoint",
    "load_checkpoint",
    "load_weights",
    "memory_report",
    "plan_layout",
    "save_checkpoint",
    "shard",
    "verify_checkpoint",
]
__version__ = "0.1.0"
