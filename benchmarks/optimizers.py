"""The optimizers of issue 5 side by side, same ranks, same run: OwnerShardedOptimizer
(bucketed broadcasts, and one broadcast per param) against torch's ZeroRedundancyOptimizer,
and HybridDeviceOptimizer (half or all of the params on the host, with and without overlap)
against the plain optimizer. Every peer is torch DDP + AdamW underneath.

python benchmarks/optimizers.py --world-size 2 --model small --out bench-results/optimizers.json

Without an accelerator "host" and "device" are the same CPU: the hybrid rows then measure
the cost of the extra copies and per-param sub-optimizers, not the benefit of offloading.
"""

import argparse
import os

from flatshard.bench import OPTIMIZER_PEERS, format_table, run_bench, write_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--peers", nargs="+", default=list(OPTIMIZER_PEERS), choices=list(OPTIMIZER_PEERS))
    parser.add_argument("--steps", type=int, default=10, help="steps per peer per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default="bench-results/optimizers.json")
    args = parser.parse_args()
    result = run_bench(
        world_size=args.world_size,
        preset=args.model,
        peers=args.peers,
        steps=args.steps,
        rounds=args.rounds,
        batch=args.batch,
    )
    print(format_table(result))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(result, args.out)
    print(f"wrote {args.out}")
