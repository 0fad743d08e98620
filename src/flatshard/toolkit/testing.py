"""Run a function on N real processes joined in a gloo process group: the test harness.

``run_distributed(fn, world_size, *args)`` returns ``[fn(*args) on rank 0, ..., rank N-1]``.
Each rank is a separate process forked from a forkserver that has torch already imported
(so a rank starts in milliseconds, without inheriting the parent's threads); the parent
hosts the rendezvous store on a port the OS picks. A rank that raises makes the call raise
``RankError`` with that rank's traceback; a run past ``timeout`` seconds is killed and
raises ``TimeoutError`` naming the ranks that had not finished: a hang fails, it never
stalls.

``fn`` must be importable by name (a module-level function), as must its arguments. With
``init=False`` it joins the process group itself, as a script under torchrun does:
``dist.init_process_group("gloo")`` finds the job's store through the environment torchrun
would set. ``run_script(path, world_size, *argv)`` runs a Python file that way, as
``__main__`` on every rank, and returns what each rank printed (the docs' pages and the
example run so, without an interpreter start and imports per rank).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import runpy
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist

from flatshard.toolkit.malloc import cpu_malloc_env
from flatshard.toolkit.rank_pool import Pool
from flatshard.toolkit.ranks import RankError, collect, join, torchrun_env

__all__ = ["PRELOAD", "RankError", "run_distributed", "run_script", "warm_up"]

_CONTEXT: Any = None
_POOLS: dict[tuple[int, str], Pool] = {}
_POOLS_LOCK = threading.Lock()
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "flatshard", "flatshard.checkpoint.directory"]
"""Modules the forkserver imports once before forking ranks, rather than each rank for
seconds (torch._dynamo: shard() wraps its hooks with torch.compiler.disable;
``import flatshard`` leaves the checkpoint modules to their first use). A process
whose ranks need more (the test suite: inductor, transformers, peft) extends the list
before its first ``run_distributed``; a module that is not installed is skipped."""


def warm_up() -> None:
    """Start the forkserver now: it imports ``PRELOAD`` (seconds) beside what the caller does
    next, rather than when the first run waits for it."""
    _context()


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _start_forkserver()
        _CONTEXT = ctx
    return _CONTEXT


def _start_forkserver() -> None:
    """Start the forkserver (unless this process already has) with ``CPU_MALLOC_TUNABLES``
    in its environment: glibc reads them only when a process starts, and every rank forked
    from the server inherits them."""
    saved = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = cpu_malloc_env(os.environ)["GLIBC_TUNABLES"]
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["GLIBC_TUNABLES"]
        else:
            os.environ["GLIBC_TUNABLES"] = saved


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads: int | None = None,
    init: bool = True,
    reuse: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return each rank's result.

    ``threads``: torch's intra-op threads per rank (default ``$FLATSHARD_TEST_THREADS``, else
    1), so that a whole suite can be run again under another thread count, whose kernels sum
    in another order (a tolerance must hold under both). ``reuse``: run on the ranks kept from
    an earlier run of this world size ([Note: reused ranks] in rank_pool.py), unless
    ``$FLATSHARD_TEST_REUSE`` is ``0``; a run with ``init=False`` always has new ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if threads is None:
        threads = int(os.environ.get("FLATSHARD_TEST_THREADS", "1"))
    if init and reuse and os.environ.get("FLATSHARD_TEST_REUSE", "1") != "0":
        pool = _idle_pool(world_size, backend)
        if pool is not None:
            try:
                return pool.run(fn, args, kwargs, threads, timeout)
            finally:
                pool.busy.release()
    return _run_new(fn, world_size, args, kwargs, timeout, backend, threads, init)


def _idle_pool(world_size: int, backend: str) -> Pool | None:
    """The kept ranks of this size, held for the caller; None while another thread runs on them."""
    with _POOLS_LOCK:
        pool = _POOLS.get((world_size, backend))
        if pool is None or not pool.alive:
            pool = _POOLS[(world_size, backend)] = Pool(_context(), world_size, backend)
        return pool if pool.busy.acquire(blocking=False) else None


def _run_new(fn, world_size, args, kwargs, timeout, backend, threads, init) -> list[Any]:
    """The run on ranks started for it alone."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    ctx = _context()
    results: Any = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, args, kwargs, rank, world_size, store.port, backend, threads, timeout, results, init),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return collect(procs, results, timeout)[0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        results.close()
        del store


def run_script(
    path: str | os.PathLike,
    world_size: int,
    *argv: str,
    cwd: str | os.PathLike | None = None,
    timeout: float = 300.0,
    compile_backend: str | None = None,
) -> list[str]:
    """Run the file ``path`` with ``argv`` as ``__main__`` on ``world_size`` ranks, as torchrun
    would (the script joins the process group itself), in ``cwd``; each rank's printed text.
    A script that raises, or exits with a status other than 0, fails as in ``run_distributed``.
    ``compile_backend``: what ``torch.compile`` without a backend uses while the script runs."""
    cwd = None if cwd is None else os.fspath(cwd)
    return run_distributed(
        _script_main,
        world_size,
        os.fspath(path),
        list(argv),
        cwd,
        compile_backend,
        init=False,
        timeout=timeout,
    )


def _script_main(path: str, argv: list[str], cwd: str | None, compile_backend: str | None) -> str:
    if cwd is not None:
        os.chdir(cwd)
    printed = io.StringIO()
    sys.argv = [path, *argv]
    torch.compiler.set_default_backend(compile_backend)  # (None: inductor; reset below, ranks are reused)
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(
                f"{path} exited with {e.code!r}; it printed:\n{printed.getvalue()[-3000:]}"
            ) from e
    except BaseException as e:
        raise RuntimeError(f"{path} raised; it printed:\n{printed.getvalue()[-3000:]}") from e
    finally:
        torch.compiler.set_default_backend(None)
    return printed.getvalue()


def _rank_main(fn, args, kwargs, rank, world_size, port, backend, threads, timeout, results, init) -> None:
    torch.set_num_threads(threads)
    os.environ.update(torchrun_env(rank, world_size, port))  # (init=False: env:// joins the parent's store)
    try:
        if init:
            join(rank, world_size, port, backend, timeout)
        # plain pickle copies tensors by value; the queue's own pickler would share them
        # through file descriptors that vanish when this process exits
        results.put((rank, True, pickle.dumps(fn(*args, **kwargs)), 0, ""))
    except BaseException:
        results.put((rank, False, traceback.format_exc(), 0, ""))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
