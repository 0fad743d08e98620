"""Start N local ranks of a command with torchrun's environment, or detect torchrun's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from flatshard.toolkit.malloc import cpu_malloc_env
from flatshard.toolkit.ranks import torchrun_env


def launched() -> bool:
    """Whether this process is one rank of a launched job (ours or torchrun's)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_local(
    argv: list[str], nproc: int, *, threads_per_rank: int | None = None, cpu: bool = False
) -> int:
    """Run ``python -m flatshard *argv`` as ``nproc`` ranks (``run_ranks``)."""
    return run_ranks(
        [sys.executable, "-m", "flatshard", *argv], nproc, threads_per_rank=threads_per_rank, cpu=cpu
    )


def run_ranks(
    command: list[str], nproc: int, *, threads_per_rank: int | None = None, cpu: bool = False
) -> int:
    """Run ``command`` as ``nproc`` local ranks; 0 once all succeed. When one fails, the
    others are stopped at once and its failure is returned as a shell reports it (its exit
    code, or 128 + the signal that killed it), after a line on stderr naming the rank and how
    it ended. Ranks that train on ``cpu`` start with ``CPU_MALLOC_TUNABLES`` (see
    ``flatshard.toolkit.malloc``).

    Like torchrun's agent, this process hosts the rendezvous store (on a port the OS picks,
    so no race for a free port) and outlives every rank, so no rank loses the store while
    another is still shutting down.
    """
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    store = dist.TCPStore(
        "127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    procs = [
        subprocess.Popen(command, env=rank_env(os.environ, rank, nproc, store.port, threads=threads, cpu=cpu))
        for rank in range(nproc)
    ]
    try:
        code = _first_failure(procs)
    except KeyboardInterrupt:
        code = 130
    finally:
        _stop(procs)
    return code


def _first_failure(procs: list[subprocess.Popen]) -> int:
    """Poll every rank until all have exited (0) or one has failed (its code, reported)."""
    while True:
        for rank, p in enumerate(procs):
            code = p.poll()
            if code not in (None, 0):
                print(
                    f"flatshard: rank {rank} (pid {p.pid}) {_how(code)}; stopping the other ranks",
                    file=sys.stderr,
                )
                return 128 - code if code < 0 else code
        if all(p.returncode == 0 for p in procs):
            return 0
        time.sleep(0.05)


def _how(code: int) -> str:
    """How a process that returned ``code`` (``Popen.returncode``) ended, in words."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


def _stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the ranks still running (killed if they do not end within 10 s)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def rank_env(
    base: Mapping[str, str], rank: int, nproc: int, port: int, *, threads: int, cpu: bool
) -> dict[str, str]:
    """The environment of local rank ``rank``: ``base`` with torchrun's variables, and
    ``CPU_MALLOC_TUNABLES`` for ranks that train on ``cpu``."""
    env = {**base, **torchrun_env(rank, nproc, port), "OMP_NUM_THREADS": str(threads)}
    return cpu_malloc_env(env) if cpu else env
