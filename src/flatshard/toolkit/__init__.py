"""Tools around the library, not part of its core: ``models`` (the demo GPT and the loader
of Hugging Face and users' models), ``data`` (the synthetic corpus), ``testing`` (the
multi-process test harness) and ``malloc`` (glibc malloc settings for ranks on CPU).
``shard()`` reads ``malloc`` to warn once; nothing else in the core imports the toolkit."""
