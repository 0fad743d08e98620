"""Layer 4, wrapping a module: ``shard()`` (``shard``) checks its arguments (``arguments``),
tells the planner what the params are (``specs``), builds the buffers, grad sync and gathers
for the stage's policy, initializes a meta-device model (``init``) and swaps the module's
class to gain ``ShardedModule``'s methods (``module``, which also holds ``ShardState``:
everything attached to a wrapped module). After wrapping: changes to the module are noticed
(``changes``), full values of record are read (``record``) and uneven inputs end together
(``uneven``). The optimizer attaches itself through the ``ShardState`` seams."""
