"""flatshard: ZeRO-style sharded data parallelism for PyTorch on flat, bucketed buffers."""

from flatshard._collectives import CommStats
from flatshard._sharded_module import ShardedModule
from flatshard.api import ExpertGroup, shard
from flatshard.layout import Layout, ParamSpec, plan_layout

__all__ = [
    "CommStats",
    "ExpertGroup",
    "Layout",
    "ParamSpec",
    "ShardedModule",
    "plan_layout",
    "shard",
]
__version__ = "0.1.0"
