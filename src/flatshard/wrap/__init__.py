"""Layer 4, wrapping a module: ``shard()`` (``shard``) plans, builds and attaches. The plan
(``plan``) checks the arguments (``arguments``), tells the planner what the params are
(``specs``) and decides the parts and units; building makes the flat buffers with rank 0's
values (``sync_states``); attaching adds grad sync and gathers for the stage's policy,
initializes a meta-device model (``init``) and swaps the module's class to gain
``ShardedModule``'s methods (``module``, which also holds ``ShardState``: everything attached
to a wrapped module). After wrapping: changes to the module are noticed (``changes``), full
values of record are read (``record``), uneven inputs end together (``uneven``) and a
pipeline's chunks on a rank know each other (``pipeline``). Params of a wrapper tensor
subclass are made plain, replicated or refused before planning (``subclass_params``). The
optimizer attaches itself through the ``ShardState`` seams."""
