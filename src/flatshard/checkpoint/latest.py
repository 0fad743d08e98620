"""The newest complete checkpoint under a directory, for a job that resumes by itself after a
restart ([Note: latest checkpoint])."""

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
# ``PATH.old``, complete. Every rank decides alone; the load that follows checks that every
# rank opened the same save ([Note: checkpoints] in ``directory.py``), so ranks that see
# different files fail there, naming the paths.

from __future__ import annotations

import os
import warnings

from flatshard.checkpoint.destination import MANIFEST, PARTIAL_MARK
from flatshard.checkpoint.directory import read_manifest
from flatshard.errors import CheckpointError

__all__ = ["latest_checkpoint"]


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
