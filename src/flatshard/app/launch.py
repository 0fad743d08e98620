"""Start N local ranks of a command with torchrun's environment, or detect torchrun's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from flatshard.app.malloc import cpu_malloc_env


def launched() -> bool:
    """Whether this process is one rank of a launched job (ours or torchrun's)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_local(
    argv: list[str], nproc: int, *, threads_per_rank: int | None = None, cpu: bool = False
) -> int:
    """Run ``python -m flatshard *argv`` as ``nproc`` ranks; return the first failing exit
    code (the others are stopped), or 0. Ranks that train on ``cpu`` start with
    ``CPU_MALLOC_TUNABLES`` (see ``flatshard.app.malloc``).

    Like torchrun's agent, this process hosts the rendezvous store (on a port the OS picks,
    so no race for a free port) and outlives every rank, so no rank loses the store while
    another is still shutting down.
    """
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    store = dist.TCPStore(
        "127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    procs = []
    for rank in range(nproc):
        env = rank_env(os.environ, rank, nproc, store.port, threads=threads, cpu=cpu)
        procs.append(subprocess.Popen([sys.executable, "-m", "flatshard", *argv], env=env))
    code = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.returncode not in (None, 0)]
            if failed:
                code = failed[0].returncode
                break
            time.sleep(0.05)
        else:
            code = next((p.returncode for p in procs if p.returncode), 0)
    except KeyboardInterrupt:
        code = 130
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    return code


def rank_env(
    base: Mapping[str, str], rank: int, nproc: int, port: int, *, threads: int, cpu: bool
) -> dict[str, str]:
    """The environment of local rank ``rank``: ``base`` with torchrun's variables, and
    ``CPU_MALLOC_TUNABLES`` for ranks that train on ``cpu``."""
    env = {
        **base,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "OMP_NUM_THREADS": str(threads),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    return cpu_malloc_env(env) if cpu else env
