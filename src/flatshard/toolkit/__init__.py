"""Layer 8, tools around the library, not part of its core: ``models`` (the demo GPT and
the loader of Hugging Face and users' models), ``data`` (the synthetic corpus), ``testing``
(the multi-process test harness, with ``ranks`` and ``rank_pool``: the ranks it keeps from
run to run) and ``malloc`` (glibc malloc settings for ranks on CPU, a leaf at layer 0:
``shard()`` reads it to warn once; nothing else in the core imports the toolkit)."""
