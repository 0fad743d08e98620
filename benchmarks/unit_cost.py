"""What stage 3 pays per unit: the main thread's time in flatshard's hooks, the collectives a
step issues and the step time, against the number of units (issue 25).

    python benchmarks/unit_cost.py --models medium deep --unit-bytes none default \\
        --out benchmarks/results/DATE-cpu-unit-cost.json

Every hook flatshard registers (module pre- and post-forward hooks, tensor and param grad
hooks, multi-grad hooks, the end-of-backward callbacks) is wrapped, before the model is
wrapped, by a timer that adds the wall time and the thread's CPU time spent inside it: the
hooks run the gather schedule, so this is the main thread's time in hooks and schedule
(waits for gathers included in the wall time). The model itself registers none. Each
configuration runs on ``--world-size`` gloo ranks (1 thread each) in processes of its own,
configurations rotate over ``--rounds``, and each figure is rank 0's median over rounds of
the mean over ``--steps`` timed steps. ``--unit-bytes default`` passes nothing, so a
revision without the option runs the same command (``PYTHONPATH=<its src>``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HookClock:
    """Wall and thread-CPU seconds spent inside wrapped hooks (outermost calls only)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.calls = 0
        self._depth = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            self.calls += 1
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu
                self._depth -= 1

        return timed

    def reset(self) -> None:
        self.wall = self.cpu = 0.0
        self.calls = 0


def _install(clock: HookClock) -> None:
    """Wrap every way flatshard registers a hook with ``clock``."""
    from torch import nn

    import flatshard.engine.grad_sync as grad_sync
    import flatshard.units.unshard as unshard
    import flatshard.wrap.shard as shard

    def hooking(register):
        def patched(self, hook, *args, **kwargs):
            return register(self, clock.wrap(hook), *args, **kwargs)

        return patched

    for owner, name in (
        (nn.Module, "register_forward_pre_hook"),
        (nn.Module, "register_forward_hook"),
        (torch.Tensor, "register_hook"),
        (torch.Tensor, "register_post_accumulate_grad_hook"),
    ):
        setattr(owner, name, hooking(getattr(owner, name)))
    for module in (unshard, shard):
        multi = module.register_multi_grad_hook
        module.register_multi_grad_hook = lambda tensors, fn, _m=multi, **kw: _m(
            tensors, clock.wrap(fn), **kw
        )
    unshard.Unsharder._end_backward = clock.wrap(unshard.Unsharder._end_backward)
    grad_sync.GradSync.finish = clock.wrap(grad_sync.GradSync.finish)


def _session(preset: str, stage: int, unit_bytes: str, steps: int, warmup: int, batch: int) -> dict:
    import torch.distributed as dist

    import flatshard
    from flatshard.toolkit.data import SyntheticCorpus
    from flatshard.toolkit.malloc import retain_freed_cpu_memory
    from flatshard.toolkit.models import GPT, PRESETS

    retain_freed_cpu_memory()
    clock = HookClock()
    _install(clock)
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    options = {}  # ("default", and stage 2: shard()'s own)
    if stage == 3 and unit_bytes != "default":
        options["stage3"] = flatshard.Stage3(unit_bytes=None if unit_bytes == "none" else int(unit_bytes))
    model = flatshard.shard(GPT(cfg), stage=stage, **options)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    data = [corpus.batch(i, dist.get_rank(), batch) for i in range(warmup + steps)]

    def step(x, y) -> None:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    for i in range(warmup):
        step(*data[i])
    dist.barrier()
    model.comm_stats.reset()
    clock.reset()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        step(*data[i])
    elapsed = time.perf_counter() - start
    unsharder = model.flatshard_state.unsharder
    return {
        "step_ms": 1e3 * elapsed / steps,
        "hook_wall_ms": 1e3 * clock.wall / steps,
        "hook_cpu_ms": 1e3 * clock.cpu / steps,
        "hook_calls": clock.calls / steps,
        "collectives": sum(model.comm_stats.calls.values()) / steps,
        "by_op": {op: n / steps for op, n in model.comm_stats.calls.items()},
        "units": len(unsharder.units) if unsharder is not None else None,
        # (a revision before merged units has Unit.module, one each)
        "modules_in_units": sum(len(getattr(u, "modules", "x")) for u in unsharder.units)
        if unsharder
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["medium", "deep"])
    parser.add_argument("--unit-bytes", nargs="+", default=["none", "default"], help="none, default or bytes")
    parser.add_argument("--stage2", action="store_true", help="also stage 2 (hooks without units)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench-results", "unit-cost.json"))
    args = parser.parse_args()

    from flatshard.toolkit.testing import run_distributed

    configs = [(m, 3, ub) for m in args.models for ub in args.unit_bytes]
    configs += [(m, 2, "-") for m in args.models] if args.stage2 else []
    runs: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for model, stage, ub in configs[r % len(configs) :] + configs[: r % len(configs)]:
            rank0 = run_distributed(
                _session, args.world_size, model, stage, ub, args.steps, args.warmup, args.batch, timeout=1800
            )[0]
            runs.setdefault(f"{model} stage {stage} unit_bytes={ub}", []).append(rank0)
    fields = ("step_ms", "hook_wall_ms", "hook_cpu_ms", "hook_calls", "collectives")
    table = {
        name: {
            **{f: statistics.median(r[f] for r in rs) for f in fields},
            "units": rs[0]["units"],
            "modules_in_units": rs[0]["modules_in_units"],
            "by_op": rs[0]["by_op"],
        }
        for name, rs in runs.items()
    }
    print(
        f"{args.world_size} gloo ranks, batch {args.batch}, {args.rounds} rounds x {args.steps} steps, "
        f"rank 0, medians over rounds; torch {torch.__version__}"
    )
    heads = (("units", 6), ("step", 10), ("hooks wall", 12), ("hooks cpu", 11), ("calls", 7), ("coll.", 7))
    print(f"{'configuration':<36}" + "".join(f"{h:>{w}}" for h, w in heads))
    for name, row in table.items():
        units = "-" if row["units"] is None else row["units"]
        print(
            f"{name:<36}{units:>6}{row['step_ms']:>8.1f}ms{row['hook_wall_ms']:>10.1f}ms"
            f"{row['hook_cpu_ms']:>9.1f}ms{row['hook_calls']:>7.0f}{row['collectives']:>7.0f}"
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {"date": date.today().isoformat(), "args": vars(args), "results": table, "runs": runs},
            f,
            indent=1,
        )
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
