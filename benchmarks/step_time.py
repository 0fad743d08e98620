"""Step time of flatshard vs torch DDP on the built-in GPT, same ranks, same run.

python benchmarks/step_time.py --world-size 2 --model small --out bench-results/step_time.json
"""

import argparse
import os

from flatshard.bench import PEERS, STAGE_PEERS, format_table, run_bench, write_json

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--peers", nargs="+", default=list(STAGE_PEERS), choices=list(PEERS))
    parser.add_argument("--steps", type=int, default=10, help="steps per peer per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--bucket-size", type=int, default=None)
    parser.add_argument("--out", default="bench-results/step_time.json")
    args = parser.parse_args()
    result = run_bench(
        world_size=args.world_size,
        preset=args.model,
        peers=args.peers,
        steps=args.steps,
        rounds=args.rounds,
        batch=args.batch,
        bucket_size=args.bucket_size,
    )
    print(format_table(result))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    write_json(result, args.out)
    print(f"wrote {args.out}")
