"""Deadlines on flatshard's collectives, and where each rank stands when one is missed.

The reasoning is [Note: deadlines] below."""

# [Note: deadlines]
#
# Ranks that are not at the same collective (one skipped a backward, ran out of data, saves a
# checkpoint at another step) would wait in it until the backend gives up: 30 minutes on gloo,
# and nothing said about who is where. So:
#
# * Every collective flatshard issues on a world with a ``timeout`` (``shard(timeout=...)``,
#   default ``DEFAULT_TIMEOUT``) carries it in the backend's own per-op options. The op ends by
#   then on its own, so no backend thread is left blocked and the process can still exit.
# * Each process keeps its position in ``HERE``: the steps it has finished, its phase
#   (``Phase``), and the collective it issued last or is waiting on, numbered within the step.
#   Keeping it costs a few attribute writes per collective.
# * A daemon thread (``_Publisher``) copies the position to the job's rendezvous store (the
#   default process group's) when it has changed, at most every ``PUBLISH_EVERY`` seconds: no
#   extra collective and no store round trip on the training thread.
# * When a wait fails (the deadline passed, or a peer closed its connection because it stopped),
#   the rank publishes its own position at once, gives the others a moment to publish theirs,
#   reads every rank's, and raises ``DesyncError`` naming each rank's step, phase and op. A
#   rank that exits publishes ``exited`` first. Every rank stuck in a collective raises in turn:
#   its own deadline passes, or its peer's exit breaks its connection.
#
# On NCCL the per-op timeout goes to NCCL's watchdog, which aborts the process; the positions
# are still published but no ``DesyncError`` is raised there (``wait()`` does not block).

from __future__ import annotations

import atexit
import json
import multiprocessing.util
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from enum import Enum

import torch.distributed as dist

from flatshard.comm.trace import span
from flatshard.errors import DesyncError

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""The deadline of one collective when ``shard()`` is given none (NCCL's default too)."""
PUBLISH_EVERY = 0.2
"""Seconds between the publisher's looks at the position."""


def as_timeout(value: float | timedelta | None) -> timedelta | None:
    """A deadline given as seconds or a timedelta (None: the process group's own)."""
    if value is None:
        return None
    if not isinstance(value, timedelta):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(
                f"timeout must be a positive number of seconds, a timedelta or None, got {value!r}"
            )
        value = timedelta(seconds=min(float(value), 2**31 / 1000))  # gloo counts int32 milliseconds
    if value <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {value!r}")
    return value


class Phase(str, Enum):
    """What a rank is doing, as its position names it."""

    START = "not started"
    WRAP = "wrapping (shard)"
    FORWARD = "forward"
    BACKWARD = "backward"
    AFTER_BACKWARD = "after backward"
    STEP = "optimizer step"
    AFTER_STEP = "after the optimizer step"
    GATHER = "gathering full params"
    SAVE = "save_checkpoint"
    LOAD = "load_checkpoint"
    EXITED = "exited"


class Position:
    """Where this process stands: the steps it has finished, its phase, the forwards it has
    begun in this step (micro-batches), the collective it issued last (``op`` #``seq`` within
    the step) and the one it is waiting on, if any. ``version`` changes with every move, so the
    publisher sends only what is new."""

    __slots__ = ("forwards", "op", "phase", "seq", "steps", "version", "waiting", "waiting_since")

    def __init__(self) -> None:
        self.steps, self.phase, self.op, self.seq, self.forwards = 0, Phase.START, "", 0, 0
        self.waiting: Watched | None = None
        self.waiting_since = 0.0  # time.time() when that wait began
        self.version = 0

    def enter(self, phase: Phase) -> None:
        if self.phase is not phase:
            self.phase = phase
            self.version += 1

    def forward(self) -> None:
        """Entering a forward (a recomputation inside a backward stays in the backward)."""
        if self.phase is not Phase.FORWARD and self.phase is not Phase.BACKWARD:
            self.phase = Phase.FORWARD
            self.forwards += 1
            self.version += 1

    @contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """In ``phase`` for the block, then back in the phase before it."""
        before = self.phase
        self.enter(phase)
        try:
            yield
        finally:
            self.enter(before)

    def step_done(self) -> None:
        self.steps += 1
        self.phase, self.seq, self.forwards = Phase.AFTER_STEP, 0, 0
        self.version += 1

    def issued(self, op: str) -> int:
        """Number ``op``, just issued, within the current step."""
        self.seq += 1
        self.op = op
        self.version += 1
        return self.seq

    def as_dict(self) -> dict[str, object]:
        """What the other ranks read: ``step`` is the step in progress (steps done + 1); the
        op is the one waited on (``waiting_since`` set), else the last one issued."""
        step = self.steps + 1
        out: dict[str, object] = {
            "step": step,
            "phase": self.phase.value,
            "op": self.op,
            "op_step": step,
            "seq": self.seq,
            "forwards": self.forwards,
            "waiting_since": None,
        }
        if self.waiting is not None:
            w = self.waiting
            out.update(op=w.op, op_step=w.step, seq=w.seq, waiting_since=self.waiting_since)
        return out


HERE = Position()
"""This process's position (one rank per process)."""


def describe(where: dict | None, now: float, rank: int | None = None) -> str:
    """One rank's position in words (``rank``: whose, to name the store's host)."""
    if where is None:
        return "no position published (it has not wrapped a model)"
    if where is STORE_GONE and rank is not None and rank == store_rank():
        return "gone: it hosts the job's store, which stopped answering, so it has exited"
    if where is STORE_GONE:
        host = store_rank()
        return f"unknown: the job's store{'' if host is None else f' (on rank {host})'} does not answer"
    if where["phase"] == Phase.EXITED.value:
        done = where["step"] - 1
        return f"exited after {done} step{'s' if done != 1 else ''}"
    text = f"step {where['step']}, {where['phase']}"
    if where.get("forwards", 0) > 1:  # (micro-batches: say which)
        text = f"step {where['step']}, forward {where['forwards']} of the step, {where['phase']}"
    if where["op"]:
        since = where["waiting_since"]
        state = f"waiting {now - since:.1f} s on" if since is not None else "last issued"
        of_step = f" of step {where['op_step']}" if where["op_step"] != where["step"] else ""
        text += f", {state} {where['op']} #{where['seq']}{of_step}"
    return text


class _Publisher(threading.Thread):
    """Copies ``HERE`` to the store when it has changed."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        super().__init__(name="flatshard-position", daemon=True)
        self.store, self.rank = store, rank
        self.sent = -1
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(PUBLISH_EVERY):
            self.publish()

    def publish(self) -> None:
        with self.lock:
            version = HERE.version
            if version == self.sent:
                return
            try:
                self.store.set(_key(self.rank), json.dumps(HERE.as_dict()))
            except (RuntimeError, ValueError):  # the store is gone: the job is over
                self.stopped.set()
                return
            self.sent = version


_PUBLISHER: _Publisher | None = None


class _Job:
    """This process's job: its number (the jobs ended before it with ``end_job``; a job's
    positions are keyed by it, so one job never reads another's) and its failed waits."""

    def __init__(self) -> None:
        self.number, self.failed_waits = 0, 0


_JOB = _Job()


def _key(rank: int) -> str:
    return f"flatshard/position/{_JOB.number}/{rank}"


def _default_store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    if world is None:
        return None
    try:
        return world.get_group_store()
    except (AttributeError, RuntimeError, ValueError):  # pragma: no cover - a torch without it
        return None


def publish_positions() -> None:
    """Start publishing this process's position to the default group's store (once per job;
    a new job in the same process starts from a fresh position)."""
    global _PUBLISHER
    store = _default_store()
    if store is None or (_PUBLISHER is not None and _PUBLISHER.store is store):
        return
    if _PUBLISHER is not None:
        _PUBLISHER.stopped.set()
        Position.__init__(HERE)  # (a fresh position, in the object every module imported)
    _PUBLISHER = _Publisher(store, dist.get_rank())
    _PUBLISHER.publish()
    _PUBLISHER.start()
    # a multiprocessing child skips atexit and starts with its parent's finalizers cleared
    multiprocessing.util.Finalize(None, _publish_exit, args=(_PUBLISHER,), exitpriority=100)


def _publish_exit(publisher: _Publisher | None = None) -> None:
    """At exit: a normal interpreter exit, or the end of a ``multiprocessing`` child (which
    skips ``atexit``)."""
    if publisher not in (None, _PUBLISHER):
        return  # an earlier job's
    if _PUBLISHER is not None and not _PUBLISHER.stopped.is_set():
        HERE.enter(Phase.EXITED)
        HERE.op = ""
        _PUBLISHER.publish()


atexit.register(_publish_exit)


def end_job() -> bool:
    """End this process's job as its exit would (the position ``exited`` published), and
    start the next from a fresh position under new keys: for a process that runs one job
    after another in the same group (the test harness's reused ranks, [Note: reused ranks]
    in ``toolkit/rank_pool.py``). Returns whether a wait failed in the job that ended: its
    groups may then hold a half-done collective."""
    global _PUBLISHER
    if _PUBLISHER is not None:
        _publish_exit()
        _PUBLISHER.stopped.set()
        _PUBLISHER.join(timeout=5 * PUBLISH_EVERY)
        _PUBLISHER = None
    Position.__init__(HERE)
    failed = _JOB.failed_waits > 0
    _JOB.number, _JOB.failed_waits = _JOB.number + 1, 0
    return failed


def positions(ranks: list[int], wait: float = 3 * PUBLISH_EVERY) -> dict[int, dict | None]:
    """Every rank's published position, after ``wait`` seconds for the latest to arrive
    (this rank's own is published first)."""
    if _PUBLISHER is None:
        return {r: None for r in ranks}
    _PUBLISHER.publish()
    time.sleep(wait)
    found: dict[int, dict | None] = {}
    for rank in ranks:
        try:
            key = _key(rank)
            found[rank] = json.loads(_PUBLISHER.store.get(key)) if _PUBLISHER.store.check([key]) else None
        except (RuntimeError, ValueError):
            found[rank] = STORE_GONE
    return found


STORE_GONE = {"phase": "store gone"}
"""A position that could not be read because the job's store did not answer."""


def store_rank() -> int | None:
    """The rank whose process hosts the job's store: rank 0, unless torchrun's agent hosts it."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else 0


def _store_host() -> str:
    store = getattr(_PUBLISHER, "store", None)
    while store is not None and not hasattr(store, "host"):  # a PrefixStore around the TCPStore
        store = getattr(store, "underlying_store", None)
    return f"{store.host}:{store.port}" if store is not None else "its host"


def desync(watched: Watched, err: Exception, since: float) -> DesyncError:
    """The error for the collective ``watched``, waited on from ``since`` (``time.time()``),
    that failed with ``err``, naming every rank's position as it was when the failure came."""
    now = time.time()
    _JOB.failed_waits += 1
    found = positions(dist.get_process_group_ranks(watched.group))
    if _PUBLISHER is not None:  # the others keep reading where this rank failed, not its exit
        _PUBLISHER.stopped.set()
    lines = [f"  rank {r}: {describe(where, now, r)}" for r, where in found.items()]
    lines += _uneven_forwards(found)
    if any(where is STORE_GONE for where in found.values()):
        host = "torchrun's agent" if store_rank() is None else f"rank {store_rank()}"
        lines.append(
            f"  the job's rendezvous store ({_store_host()}) stopped answering: the process that "
            f"hosts it, {host}, has exited"
        )
    limit = watched.timeout.total_seconds() if watched.timeout else None
    if limit is not None and now - since >= 0.9 * limit:
        what = f"did not complete within its deadline of {limit:g} s"
    else:  # before the deadline: the backend gave up (a peer closed its connection, ...)
        what = f"failed after {now - since:.1f} s"
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return DesyncError(
        f"{watched.op} #{watched.seq} of step {watched.step} {what} on rank "
        f"{dist.get_rank()}: the ranks are not at the same collective, or one has stopped. "
        f"Where each rank is:\n" + "\n".join(lines) + f"\n(the backend said: {cause})"
    )


def _uneven_forwards(found: dict[int, dict | None]) -> list[str]:
    """A line naming the likely cause when ranks at the same step ran different numbers of
    forwards in it (micro-batches of gradient accumulation), else none."""
    live = {r: w for r, w in found.items() if w and "step" in w and w["phase"] != Phase.EXITED.value}
    if len({w["step"] for w in live.values()}) != 1 or len({w.get("forwards") for w in live.values()}) < 2:
        return []
    counts = ", ".join(f"rank {r}: {w.get('forwards')}" for r, w in live.items())
    return [
        f"  the ranks began different numbers of forwards in this step ({counts}): under no_sync a "
        "rank that runs more micro-batches than the others gathers (stage 3) or reduces alone; "
        "give every rank the same number of micro-batches a step"
    ]


def disagreement(ranks: list[int], what: str) -> DesyncError:
    """The error for ranks found at different points by an agreement of theirs (not a failed
    collective): ``what`` happened, and where each of ``ranks`` is."""
    now = time.time()
    found = positions(ranks)
    lines = [f"  rank {r}: {describe(where, now, r)}" for r, where in found.items()]
    return DesyncError(f"{what}. Where each rank is:\n" + "\n".join(lines))


class Watched:
    """A collective's handle whose failed ``wait()`` raises ``DesyncError``."""

    __slots__ = ("group", "handle", "op", "seq", "step", "timeout")

    def __init__(self, handle, group: dist.ProcessGroup | None, timeout: timedelta | None, op: str) -> None:
        self.handle, self.group, self.timeout, self.op = handle, group, timeout, op
        self.seq, self.step = HERE.issued(op), HERE.steps + 1

    def is_completed(self) -> bool:
        return self.handle.is_completed()

    def wait(self, timeout: timedelta | None = None) -> object:
        """Finish the collective; with ``timeout``, a poll: ``RuntimeError`` if it is still in
        flight by then (and it stays valid to wait again)."""
        since = time.time()
        HERE.waiting, HERE.waiting_since = self, since
        HERE.version += 1
        try:
            with span("wait {} #{}", self.op, self.seq):  # ([Note: profiler ranges] in comm/trace.py)
                return self.handle.wait() if timeout is None else self.handle.wait(timeout=timeout)
        except RuntimeError as err:
            if timeout is not None and not self.handle.is_completed():
                raise  # a poll that ran out: still in flight
            raise desync(self, err, since) from err
        finally:
            HERE.waiting = None
            HERE.version += 1
