"""Layer 1, communication: the data-parallel group a set of buffers talks over (``world``),
the collectives flatshard issues on it, each counted in ``CommStats`` (``collectives``), a
deadline on each with every rank's published position (``deadline``) and the profiler's
named ranges around them (``trace``). Knows nothing of modules, buffers or stages."""
