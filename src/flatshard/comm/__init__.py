"""Layer 1, communication: ``World`` (a process group seen from one rank, or a world of one)
and the collectives flatshard issues on it, each counted in ``CommStats``. Knows nothing of
modules, buffers or stages."""
