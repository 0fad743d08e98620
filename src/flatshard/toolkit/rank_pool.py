"""Ranks kept between runs of ``run_distributed``: one group of ranks per world size, joined
once, each run's function sent to them.

The reasoning is [Note: reused ranks] below."""

# [Note: reused ranks]
#
# Starting ranks costs ~0.1 s a rank (a fork of a server that holds torch and the hosts'
# libraries, the process's exit, the rendezvous), and the suite makes ~1,500 runs. So the
# ranks of a run stay up for the next run of the same world size, and each run finds them as
# a new process would (``Slate``):
#
# * before a run: the RNG states (torch, Python, numpy) the ranks started with, the run's
#   thread count, and its timeout as the default group's;
# * after it: the environment, working directory, ``sys.argv`` and ``sys.path``, torch's
#   default dtype, grad mode and algorithm flags, dynamo's caches, counters and configs, the
#   warning filters and signal handlers, flatshard's published position, and each attribute of
#   a module (or of a class it defines) that the run rebound: a patch the test did not undo
#   (in torch's modules, functions and classes only: torch keeps counters there).
#
# What cannot be undone retires the ranks after the run (they exit; the next run starts new
# ones): an error or timeout on any rank, a collective whose wait failed (a ``DesyncError``
# caught), the default group destroyed, a Python thread left running, accelerate's
# process-wide state set (the HF Trainer's), a rank past ``MAX_RSS``.
# State changed in place (a cache filled) and process groups a run created stay, as in a long
# training process. ``run_distributed(..., reuse=False)`` or ``FLATSHARD_TEST_REUSE=0`` runs
# in new processes instead; ``FLATSHARD_TEST_REUSE_LOG=<file>`` appends why ranks retired.

from __future__ import annotations

import os
import pickle
import queue
import random
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from flatshard.comm import deadline
from flatshard.toolkit.ranks import collect, join, torchrun_env

MAX_RSS = 3 << 30
"""A rank whose resident memory is past this after a run retires (bytes)."""
_WATCHED = ("flatshard", "torch.distributed", "torch.optim", "torch.nn", "torch.utils.checkpoint")
"""Modules whose rebound attributes a run's end puts back, besides the tests' own (any module
loaded from outside the installed packages and the standard library)."""


class Pool:
    """``world_size`` ranks in one default group, kept for run after run (parent side)."""

    def __init__(self, ctx: Any, world_size: int, backend: str) -> None:
        self.world_size, self.backend, self.runs = world_size, backend, 0
        self.busy = threading.Lock()
        self.store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=serve,
                args=(rank, world_size, self.store.port, backend, inbox, self.results, os.getpid()),
                daemon=True,
            )
            for rank, inbox in enumerate(self.inboxes)
        ]
        for p in self.procs:
            p.start()

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, threads: int, timeout: float) -> list:
        """``fn(*args, **kwargs)`` on every rank; each rank's result. Any failure closes the pool."""
        self.runs += 1
        task = pickle.dumps((fn, args, kwargs, threads, timeout))
        try:
            for inbox in self.inboxes:
                inbox.put((self.runs, task))
            results, retire = collect(self.procs, self.results, timeout, self.runs)
        except BaseException:
            self.close()
            raise
        if retire:
            _log(f"{getattr(fn, '__qualname__', fn)} on {self.world_size} ranks: " + "; ".join(retire))
            self.close()
        return results

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        for q in (*self.inboxes, self.results):
            q.close()


def _log(line: str) -> None:
    path = os.environ.get("FLATSHARD_TEST_REUSE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def serve(rank: int, world_size: int, port: int, backend: str, inbox: Any, results: Any, parent: int) -> None:
    """A reused rank: join the group at the first run, then run what arrives until a run
    leaves what cannot be undone, or the parent is gone."""
    os.environ.update(torchrun_env(rank, world_size, port))
    results.put((rank, True, b"", 0, ""))  # (starts the queue's feeder thread before the slate is taken)
    slate = Slate()
    while True:
        message = _next(inbox, parent)
        if message is None:
            break
        run, task = message
        out: bytes | str
        try:
            fn, args, kwargs, threads, timeout = pickle.loads(task)
            if not dist.is_initialized():
                join(rank, world_size, port, backend, timeout)
                slate.joined()
            slate.before(threads, timeout)
            out, ok = pickle.dumps(fn(*args, **kwargs)), True
        except BaseException:
            out, ok = traceback.format_exc(), False
        try:
            reason = slate.after() if ok else "the run failed"
        except Exception as e:  # (a clean-up that fails is a reason not to go on)
            reason = f"cleaning up after the run raised {e!r}"
        results.put((rank, ok, out, run, reason))
        if reason:
            break
    if dist.is_initialized():
        dist.destroy_process_group()


def _next(inbox: Any, parent: int) -> Any:
    """The next message, or None once the parent process has exited."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue.Empty:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                return None


class Slate:
    """What a new rank would find: taken when the rank starts, put back around each run."""

    def __init__(self) -> None:
        self.rng = torch.get_rng_state(), random.getstate(), _numpy_rng()
        self.environ = dict(os.environ)
        self.cwd, self.argv, self.path = os.getcwd(), list(sys.argv), list(sys.path)
        self.flags = _torch_flags()
        self.configs = _configs()
        self.filters, self.showwarning = list(warnings.filters), warnings.showwarning
        self.handlers = {s: signal.getsignal(s) for s in _signals()}
        self.attrs = _Attributes()
        self.world: Any = None
        self.threads: set[threading.Thread] = set()

    def joined(self) -> None:
        self.world = dist.group.WORLD
        self.threads = set(threading.enumerate())

    def before(self, threads: int, timeout: float) -> None:
        self.attrs.watch_new()  # (the run's own module was just loaded to unpickle its function)
        torch.set_rng_state(self.rng[0])
        random.setstate(self.rng[1])
        if self.rng[2] is not None:
            sys.modules["numpy"].random.set_state(self.rng[2])
        torch.set_num_threads(threads)
        torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout))
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].utils.counters.clear()

    def after(self) -> str:
        """Put the slate back; what could not be (a reason to retire the rank), else ''."""
        failed_wait = deadline.end_job()
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
        self._process()
        self.attrs.restore()
        self.attrs.watch_new()
        return (
            "a collective's wait failed (its groups may hold half of it)"
            if failed_wait
            else self._unfixable()
        )

    def _process(self) -> None:
        if dict(os.environ) != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        sys.argv[:], sys.path[:] = self.argv, self.path
        _set_torch_flags(self.flags)
        _set_configs(self.configs)
        warnings.resetwarnings()  # (which also forgets the warnings given "once")
        warnings.filters[:] = self.filters  # type: ignore[index]  # (a list at runtime)
        warnings.showwarning = self.showwarning
        for s, handler in self.handlers.items():
            if signal.getsignal(s) is not handler:
                signal.signal(s, handler)

    def _unfixable(self) -> str:
        if not dist.is_initialized() or dist.group.WORLD is not self.world:
            return "the default process group was destroyed or replaced"
        left = [
            t
            for t in threading.enumerate()
            if t not in self.threads and t.is_alive() and t.name not in _LIBRARY_THREADS
        ]
        for t in left:
            t.join(timeout=1.0)
        running = [t.name for t in left if t.is_alive()]
        if running:
            return f"threads left running: {running}"
        state = sys.modules.get("accelerate.state")
        if state is not None and state.PartialState._shared_state:
            return "accelerate's process-wide state is set"
        rss = _rss()
        if rss > MAX_RSS:
            return f"resident memory {rss / 2**30:.1f} GiB"
        return ""


_LIBRARY_THREADS = ("tqdm_monitor",)
"""Threads a library starts once per process and keeps (tqdm's progress-bar monitor)."""


def _numpy_rng() -> Any:
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random.get_state()


def _signals() -> list[signal.Signals]:
    return [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]


def _torch_flags() -> dict[str, Any]:
    return {
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "matmul": torch.get_float32_matmul_precision(),
        "anomaly": torch.is_anomaly_enabled(),
    }


def _set_torch_flags(flags: dict[str, Any]) -> None:
    torch.set_default_dtype(flags["dtype"])
    torch.set_grad_enabled(flags["grad"])
    on, warn_only = flags["deterministic"]
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    torch.set_float32_matmul_precision(flags["matmul"])
    torch.autograd.set_detect_anomaly(flags["anomaly"])


_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")


def _configs() -> dict[str, Any]:
    return {name: sys.modules[name].get_config_copy() for name in _CONFIGS if name in sys.modules}


def _set_configs(saved: dict[str, Any]) -> None:
    for name, values in saved.items():
        config = sys.modules[name]
        if config.get_config_copy() != values:
            config.load_config(values)


_MISSING = object()


class _Attributes:
    """The attributes of watched modules (and of the classes they define) as they were when
    each module was first seen; ``restore`` rebinds any a run changed or deleted."""

    def __init__(self) -> None:
        self.saved: dict[str, tuple[Any, dict[str, Any], list[tuple[type, dict[str, Any]]]]] = {}
        self.seen: set[str] = set()
        packages, stdlib = os.path.dirname(os.path.dirname(torch.__file__)), os.path.dirname(os.__file__)
        self.installed = (packages, stdlib)

    def _watched(self, name: str, module: Any) -> bool:
        if name.startswith(_WATCHED):
            return True
        path = getattr(module, "__file__", None)
        return path is not None and not path.startswith(self.installed)

    def watch_new(self) -> None:
        for name in sys.modules.keys() - self.seen:
            module = sys.modules[name]
            self.seen.add(name)
            if module is None or not self._watched(name, module):
                continue
            classes = [
                (c, dict(vars(c)))
                for c in list(vars(module).values())
                if issubclass(type(c), type) and vars(c).get("__module__") == name
            ]
            self.saved[name] = (module, dict(vars(module)), classes)

    def restore(self) -> None:
        for name, (module, attrs, classes) in self.saved.items():
            ours = not name.startswith("torch")
            _rebind(module, vars(module), attrs, ours)
            for cls, cls_attrs in classes:
                _rebind(cls, vars(cls), cls_attrs, ours)


def _rebind(owner: Any, now: Any, saved: dict[str, Any], data: bool) -> None:
    """Put back what changed; a value that is not a function or class only if ``data`` (torch
    keeps its own counters in module globals: ``_group_count`` names the next group)."""
    for key, value in saved.items():
        if now.get(key, _MISSING) is not value and (data or callable(value)):
            setattr(owner, key, value)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
