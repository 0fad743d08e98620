"""Python code run on fresh interpreters, one a rank, as torchrun without its agent runs a
script (rank 0 hosts the job's store), for the tests whose subject is a whole process: its
death, its exit."""

import os
import socket
import subprocess
import sys


def launched(
    code: str, world_size: int, *argv: str, timeout: float = 120
) -> tuple[int, list[subprocess.CompletedProcess]]:
    """Run ``code`` (``python -c``) with ``argv`` on ``world_size`` new processes given
    torchrun's environment; the store's port, and what each process returned and printed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outs = [p.communicate(timeout=timeout) for p in procs]
    done = [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outs, strict=True)]
    return port, done
