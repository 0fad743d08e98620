"""The checkpoints under a directory: the newest complete one, for a job that resumes by
itself after a restart, and pruning all but the newest few ([Note: latest checkpoint])."""

# [Note: latest checkpoint]
#
# A job restarted after a failure (``torchrun --max-restarts``, a scheduler's requeue) resumes
# from the newest checkpoint that a save finished: ``latest_checkpoint(root)`` looks at each
# directory right under ``root`` that a save made (it holds the manifest, or the mark of an
# unfinished save), newest first by the time its manifest (else the directory) was written,
# and returns the first whose files are all there at their written sizes and whose index
# matches its checksum (``read_manifest``'s check, which every load makes first). An
# unfinished save (killed, or failed on some rank) or a torn one (a file missing or cut
# short) newer than the one returned is skipped with a warning naming it and why; nothing
# is deleted. A checkpoint whose save was killed between its two renames is found as
# ``PATH.old``, complete, and one killed between its manifest and its rename as
# ``PATH.partial``, complete (its files all written: the manifest is the last). Every rank
# decides alone; the load that follows checks that every rank opened the same save
# ([Note: checkpoints] in ``directory.py``), so ranks that see
# different files fail there, naming the paths.
#
# ``prune_checkpoints(root, keep)`` keeps the ``keep`` newest complete checkpoints in that
# order and removes the older complete ones, and the unfinished saves older than the oldest
# kept one: those cannot be in flight, since a process saves one at a time and a save in
# flight began after the one before it was complete. Newer unfinished saves stay (one may
# be this job's, being written). Only what a save made is removed, file by file with its
# mark last (``remove_saved``), so a pruning cut off is finished by the next; it runs on one
# rank.

from __future__ import annotations

import os
import warnings

from flatshard.checkpoint.destination import MANIFEST, PARTIAL_MARK, remove_saved
from flatshard.checkpoint.directory import read_manifest
from flatshard.errors import CheckpointError

__all__ = ["latest_checkpoint", "prune_checkpoints"]


def latest_checkpoint(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under directory ``root`` (None if there is
    none, or no ``root``): resume with ``flatshard.load_checkpoint(path, model, opt)``.
    Newer saves that did not finish, or whose files are torn, are skipped with a warning
    naming each."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return None
    for path, complete in _saves_newest_first(root):
        if not complete:
            warnings.warn(f"skipping {path}: its save did not finish (it has no {MANIFEST})", stacklevel=2)
            continue
        try:
            read_manifest(path)
        except CheckpointError as e:
            warnings.warn(f"skipping {path}: {e}", stacklevel=2)
            continue
        return path
    return None


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[str]:
    """Remove all but the ``keep`` newest complete checkpoints directly under ``root`` (and
    unfinished saves older than the oldest kept); returns the paths removed. Call it on one
    rank, e.g. rank 0 after each save: a save in flight is never removed."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (the checkpoints kept), got {keep!r}")
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    kept = 0
    removed = []
    for path, complete in _saves_newest_first(root):
        if kept < keep:
            kept += complete
            continue
        try:  # (the mark last: a removal cut off is listed, and finished, by the next pruning)
            remove_saved(path, MANIFEST if complete else PARTIAL_MARK)
        except OSError as e:
            warnings.warn(f"could not remove the older checkpoint {path}: {e}", stacklevel=2)
            continue
        removed.append(path)
    return removed


def _saves_newest_first(root: str) -> list[tuple[str, bool]]:
    """Each directory under ``root`` a save made, newest first: (path, has a manifest)."""
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        manifest = os.path.join(path, MANIFEST)
        if os.path.isfile(manifest):
            found.append((os.stat(manifest).st_mtime_ns, path, True))
        elif os.path.isfile(os.path.join(path, PARTIAL_MARK)):
            found.append((os.stat(path).st_mtime_ns, path, False))
    return [(path, complete) for _, path, complete in sorted(found, reverse=True)]
