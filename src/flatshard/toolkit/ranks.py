"""What the test harness's ranks share, whether started for one run or kept for many: the
environment a rank sees, joining the process group, and collecting the ranks' results."""

from __future__ import annotations

import pickle
import queue
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist


class RankError(RuntimeError):
    """A rank of ``run_distributed`` raised; the message carries its traceback."""

    def __init__(self, rank: int, trace: str, others: dict[int, str]) -> None:
        self.rank = rank
        self.trace = trace
        note = f" (ranks {sorted(others)} failed too)" if others else ""
        super().__init__(f"rank {rank} failed{note}:\n{trace}")


def torchrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for local rank ``rank`` of a job whose agent hosts the
    rendezvous store at ``port`` (the launcher's ranks and the test harness's alike)."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def join(rank: int, world_size: int, port: int, backend: str, timeout: float) -> None:
    """Join the default process group through the parent's store at ``port``."""
    deadline = timedelta(seconds=timeout)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=deadline)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=deadline)


def collect(procs: list[Any], results: Any, timeout: float, run: int = 0) -> tuple[list[Any], list[str]]:
    """Each rank's result, in rank order, from the ``(rank, ok, payload, run, retire)``
    messages on ``results`` (those of another ``run`` are skipped), and the reasons ranks gave
    not to be reused. A rank that raised, or exited without a word, raises ``RankError``;
    ``timeout`` seconds without every result raises ``TimeoutError`` naming the missing ranks."""
    world_size = len(procs)
    deadline = time.monotonic() + timeout
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    retire: list[str] = []
    first_error_at: float | None = None
    while len(done) + len(errors) < world_size:
        now = time.monotonic()
        # after a failure, give the other ranks a moment to report their own errors
        if first_error_at is not None and now - first_error_at > 2.0:
            break
        if now > deadline:
            missing = sorted(set(range(world_size)) - set(done) - set(errors))
            if errors:
                break
            raise TimeoutError(
                f"run_distributed timed out after {timeout:.0f}s; ranks {missing} had not finished"
            )
        try:
            rank, ok, payload, of_run, reason = results.get(timeout=0.1)
        except queue.Empty:
            for rank, p in enumerate(procs):
                if p.exitcode not in (None, 0) and rank not in done and rank not in errors:
                    errors[rank] = f"rank {rank} exited with code {p.exitcode} without reporting"
                    first_error_at = first_error_at or time.monotonic()
            continue
        if of_run != run:
            continue
        if reason:
            retire.append(f"rank {rank}: {reason}")
        if ok:
            done[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            first_error_at = first_error_at or time.monotonic()
    if errors:
        first = next(iter(errors))  # the first to report is the cause; the rest follow from it
        raise RankError(first, errors[first], {r: t for r, t in errors.items() if r != first})
    return [done[r] for r in range(world_size)], retire
