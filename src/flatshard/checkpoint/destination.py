"""Where a save may write, and how it becomes visible: the destination check, the save
lock and the publishing renames ([Note: save destinations]). Touches nothing it did not
write."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

FORMAT = "flatshard-checkpoint/1"
MANIFEST = "flatshard.json"

# [Note: save destinations]
# A save writes PATH.partial, moves a checkpoint already at PATH to PATH.old, renames
# PATH.partial to PATH, then deletes PATH.old. Each of those deletions and renames touches
# only what flatshard wrote: PATH and PATH.old must be absent or checkpoints (a readable
# flatshard.json of this format), PATH.partial absent or an unfinished save (it carries
# PARTIAL_MARK, or holds only the files a save writes). Anything else there -- a user's
# directory, a file -- refuses the save before anything is written, on every rank: rank 0
# decides and tells the others, so that ranks on different views of the path agree.
# PATH.lock (held by rank 0 through the save, see save_lock) is created and removed by the
# save; one that is not empty or a flatshard lock refuses the save and stays as it is.
# A removal can be cut off too (a kill while PATH.old or an old PATH.partial is deleted), so
# it deletes the entry that marks the directory as ours last (flatshard.json, PARTIAL_MARK)
# and the empty directory after it: what a cut-off removal leaves is still a checkpoint
# missing some files, an unfinished save, or an empty directory, and the next save accepts
# each (an empty directory holds nothing to lose).
PARTIAL_MARK = ".flatshard-partial"
_SAVE_FILES = re.compile(r"(\.metadata|__\d+_\d+\.distcp|flatshard\.json|\.flatshard-partial)")


def _is_checkpoint(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _is_unfinished_save(path: str) -> bool:
    """Marked by the save that made it (DCP's temporary files may be there too), or, from a
    flatshard without the mark, holding only the files a save writes."""
    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    return PARTIAL_MARK in names or all(_SAVE_FILES.fullmatch(name) for name in names)


def _is_replaced_checkpoint(path: str) -> bool:
    """A checkpoint, or what its removal left when cut off before its last step."""
    return _is_checkpoint(path) or (os.path.isdir(path) and not os.listdir(path))


def destination_problem(path: str) -> str | None:
    """Why ``save_checkpoint(path)`` must not write there, or None when it may."""
    checks = (
        (path, _is_checkpoint, "a flatshard checkpoint"),
        (path + ".old", _is_replaced_checkpoint, "a flatshard checkpoint"),
        (path + ".partial", _is_unfinished_save, "an unfinished flatshard save"),
    )
    for where, ours, what in checks:
        if os.path.lexists(where) and not ours(where):
            kind = "a directory" if os.path.isdir(where) else "a file"
            return (
                f"{where} exists and is {kind} that is not {what}: save_checkpoint replaces only "
                f"what it wrote itself. Choose another path, or move {where} away"
            )
    return None


LOCK_MARK = b"flatshard save lock\n"


@contextmanager
def save_lock(path: str, take: bool) -> Iterator[str | None]:
    """Hold ``PATH.lock`` (an exclusive ``flock``) for a save to ``path``; yields None when
    held, else why not (another save holds it, or the file is not a flatshard lock).

    The kernel drops the lock when its holder exits, killed or not, so a killed save never
    blocks the next one. The holder removes the file before letting go of it; a process that
    locked a file after it was removed sees that the path no longer names its file and tries
    again, so two saves never hold two different files.
    """
    if not take:
        yield None
        return
    lock = path + ".lock"
    for _ in range(3):
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            yield f"cannot open the save lock {lock}: {e.strerror}"
            return
        try:
            problem = _lock(fd, lock, path)
            if problem != _STALE:
                try:
                    yield problem
                finally:
                    if problem is None:
                        os.unlink(lock)
                return
        finally:
            os.close(fd)  # (releases the flock)
    yield f"cannot take the save lock {lock}: other saves to {path} keep replacing it"


_STALE = "removed by the save that held it"


def _lock(fd: int, lock: str, path: str) -> str | None:
    content = os.pread(fd, len(LOCK_MARK) + 1, 0)
    if content and content != LOCK_MARK:
        return f"{lock} exists and is not a flatshard save lock: move it away, or choose another path"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return (
            f"another save to {path} is in progress (it holds {lock}): two saves to one path at "
            "once would mix their files; wait for it, or save elsewhere"
        )
    try:
        if os.stat(lock).st_ino != os.fstat(fd).st_ino:
            return _STALE
    except FileNotFoundError:
        return _STALE
    if not content:
        os.pwrite(fd, LOCK_MARK, 0)
    return None


def publish(partial: str, path: str) -> None:
    """Make ``partial`` visible as ``path``; an older checkpoint there stays complete under
    ``path.old`` until the new one is in place."""
    old = path + ".old"
    if os.path.lexists(path):
        if os.path.lexists(old):
            remove_saved(old, MANIFEST)
        os.rename(path, old)
    os.rename(partial, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    if os.path.lexists(old):
        remove_saved(old, MANIFEST)


def remove_saved(path: str, mark: str) -> None:
    """Remove a directory a save wrote (a replaced checkpoint, an unfinished save), its
    ``mark`` (the entry that shows it is ours) last and the empty directory after it, so that
    a removal cut off at any moment leaves something the next save still recognises
    ([Note: save destinations]). A symbolic link to one goes only as a link (what it points
    to was not written here and stays)."""
    if os.path.islink(path):
        os.unlink(path)
        return
    for name in sorted(os.listdir(path), key=lambda name: name == mark):
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        else:
            os.unlink(entry)
    os.rmdir(path)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
