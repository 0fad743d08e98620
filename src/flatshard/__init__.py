"""flatshard: ZeRO-style sharded data parallelism for PyTorch on flat, bucketed buffers."""

from flatshard.layout import Layout, ParamSpec, plan_layout

__all__ = ["Layout", "ParamSpec", "plan_layout"]
__version__ = "0.1.0"
