"""A reduction's reduce-scatter: one collective a bucket, or one for the group?

For groups of K buckets of B bytes (fp32, equal shards) on real ranks, times K reduce-
scatters launched together and then waited (each by the implementation ``IMPLS`` picks
for its size) against ``reduce_scatter_coalesced`` (one all-to-all of the packed buckets,
where the backend's implementation is an all-to-all, whatever their size: the table sets
``COALESCE_LIMIT``). The two take turns, in alternating
order, ``--repeats`` times; the table gives the medians and the ratio of each repeat.

python benchmarks/coalesced.py --world-size 2 --out benchmarks/results/coalesced-2ranks.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from datetime import date

import torch
import torch.distributed as dist

from flatshard.comm.collectives import reduce_scatter, reduce_scatter_coalesced
from flatshard.comm.world import World
from flatshard.toolkit.testing import run_distributed


def _time(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # (the slowest rank's time)
    return float(elapsed)


def _rank_bench(cases: list[tuple[int, float]], repeats: int) -> list[dict]:
    world = World(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    rows = []
    for count, kib in cases:
        numel = int(kib * 1024 / 4) // (128 * world.size) * (128 * world.size)
        shard = numel // world.size
        own = slice(world.rank * shard, (world.rank + 1) * shard)
        tensors = [torch.randn(numel) for _ in range(count)]
        buckets = [(t, t[own], None) for t in tensors]

        def separate(buckets=buckets) -> None:
            for handle in [reduce_scatter(t, s, world) for t, s, _ in buckets]:
                handle.wait()

        def coalesced(buckets=buckets) -> None:
            reduce_scatter_coalesced(buckets, world, limit=math.inf).wait()

        separate(), coalesced()  # warm-up
        times: dict[str, list[float]] = {"separate": [], "coalesced": []}
        for r in range(repeats):
            for name, fn in (("separate", separate), ("coalesced", coalesced))[:: 1 if r % 2 else -1]:
                times[name].append(_time(fn))
        ratios = [c / s for c, s in zip(times["coalesced"], times["separate"], strict=True)]
        rows.append(
            {
                "buckets": count,
                "bucket_kib": kib,
                "separate_ms": 1e3 * statistics.median(times["separate"]),
                "coalesced_ms": 1e3 * statistics.median(times["coalesced"]),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = [(count, kib) for count in (4, 16) for kib in (16, 64, 256, 1024)]
    rows = run_distributed(_rank_bench, args.world_size, cases, args.repeats, timeout=1800)[0]
    print(f"{args.world_size} ranks, gloo, torch {torch.__version__}, {args.repeats} alternating repeats")
    heads = f"{'buckets':>7} {'KiB each':>9} {'separate ms':>12} {'coalesced ms':>13}"
    print(f"{heads} {'ratio':>6} {'range':>12}")
    for r in rows:
        spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        print(
            f"{r['buckets']:>7} {r['bucket_kib']:>9,} {r['separate_ms']:>12.2f} {r['coalesced_ms']:>13.2f}"
            f" {r['ratio_median']:>6.2f} {spread:>12}"
        )
    if args.out:
        meta = {"date": date.today().isoformat(), "machine": f"{platform.machine()}, {torch.__version__}"}
        with open(args.out, "w") as f:
            json.dump({**meta, "world_size": args.world_size, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
