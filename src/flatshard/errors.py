"""The exceptions flatshard raises on purpose, beside Python's own (``ValueError`` for a bad
argument, ``FileExistsError`` for a destination it will not touch, ...).

Every one is an ``Exception``, so ``except Exception`` sees it, and names what is wrong: the
file, the param, the rank.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint or weights file cannot be read as written: missing or cut-short files, an
    unknown format, a manifest that is not JSON, or a save or load that failed on some rank
    (the message names each rank and its cause)."""


class ChecksumError(CheckpointError):
    """Bytes read back from a checkpoint or weights file differ from the bytes written: the
    message names the file and the tensor (or param) whose checksum does not match."""


class DesyncError(RuntimeError):
    """A collective flatshard issued did not complete within its deadline (``shard(timeout=
    ...)``), or failed because a peer stopped: the ranks are not at the same collective. The
    message names every rank's step, phase and last collective ([Note: deadlines] in
    ``comm/deadline.py``)."""
