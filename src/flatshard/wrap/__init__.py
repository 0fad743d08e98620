"""Layer 4, wrapping a module: ``shard()`` (``shard``) builds the buffers, grad sync and
gathers for the stage's policy and swaps the module's class to gain ``ShardedModule``'s
methods (``module``, which also holds ``ShardState``: everything attached to a wrapped
module). The optimizer attaches itself through the ``ShardState`` seams."""
