"""Layer 0, the planner: pure functions and frozen data, no process group and no wrapped
module. ``layout`` (the flat layout: buffers, buckets, shards), ``stage`` (``StagePolicy``,
``Stage3`` and ``Buckets``: what each stage keeps sharded and the options that shape it),
``shard_map`` (which parts of a shard an optimizer run covers), ``plan`` (memory and bytes
per rank before anything runs), ``budget`` (the least offload that fits a device budget),
``mixed_precision`` and ``offload`` (``Offload``: which bytes live on the host), and
``state_blocks`` (torchao's low-bit state: which params it quantizes, its bytes). Everything
above reads offsets and stage rules from here; nothing here imports from above."""
