"""Which implementation of reduce-scatter and all-gather is fastest on this backend?

Times every correct way flatshard knows to do each op on a flat fp32 tensor, at several
sizes, on real ranks. flatshard's choice per backend (``flatshard.comm.collectives.IMPLS``)
comes from this table.

python benchmarks/collectives.py --world-size 2 --out bench-results/collectives.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import date
from functools import partial

import torch
import torch.distributed as dist

from flatshard.comm.collectives import GATHER_IMPLS, SCATTER_IMPLS, all_gather, reduce_scatter
from flatshard.comm.world import World
from flatshard.toolkit.testing import run_distributed


def _run(op, tensor: torch.Tensor, *, own: slice, world: World, impl: str) -> None:
    op(tensor, tensor[own], world, impl=impl).wait()


def _rank_bench(sizes_mb: list[float], repeats: int) -> list[dict]:
    world = World(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    rows = []
    for mb in sizes_mb:
        numel = int(mb * 2**20 / 4) // (128 * world.size) * (128 * world.size)
        tensor = torch.randn(numel)
        shard = numel // world.size
        own = slice(world.rank * shard, (world.rank + 1) * shard)
        ops = {("all_reduce", "all_reduce"): lambda t: dist.all_reduce(t)}
        for impl in SCATTER_IMPLS:
            ops["reduce_scatter", impl] = partial(_run, reduce_scatter, own=own, world=world, impl=impl)
        for impl in GATHER_IMPLS:
            ops["all_gather", impl] = partial(_run, all_gather, own=own, world=world, impl=impl)
        for (op, impl), fn in ops.items():
            times = []
            for i in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                fn(tensor)
                if i:  # the first call warms up gloo's buffers
                    times.append(time.perf_counter() - start)
            rows.append({"op": op, "impl": impl, "mb": mb, "ms": 1e3 * statistics.median(times)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench-results/collectives.json")
    args = parser.parse_args()
    rows = run_distributed(_rank_bench, args.world_size, args.sizes_mb, args.repeats, timeout=1800)[0]
    base = {r["mb"]: r["ms"] for r in rows if r["op"] == "all_reduce"}
    print(f"gloo, {args.world_size} ranks, fp32; ratio = time / all_reduce of the same tensor")
    print(f"{'op':<16}{'implementation':<26}{'MB':>6}{'ms':>10}{'ratio':>8}")
    for r in rows:
        r["ratio_to_all_reduce"] = r["ms"] / base[r["mb"]]
        print(f"{r['op']:<16}{r['impl']:<26}{r['mb']:>6g}{r['ms']:>10.1f}{r['ratio_to_all_reduce']:>8.2f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    meta = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "backend": "gloo",
        "world_size": args.world_size,
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
