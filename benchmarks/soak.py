"""RSS of stage-3 ranks on CPU over a long run, started by ``torchrun`` (which sets no malloc
tunables), with and without ``GLIBC_TUNABLES=glibc.malloc.tcache_count=0``.

    python benchmarks/soak.py --steps 2000 --out benchmarks/results/DATE-soak.json

Each variant runs ``torchrun --standalone --nproc-per-node 2`` of this file in rank mode: a
plain training loop of your own kind (the small GPT, ``flatshard.shard(stage=3)``,
``DistributedOptimizer`` with AdamW), each rank reading its RSS from ``/proc/self/status``
every ``--every`` steps. The table gives RSS at a few steps and the growth after warm-up
(from step ``--every``) to the end, per variant, the worst rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SETTINGS = {
    "as torchrun starts it": None,
    "GLIBC_TUNABLES=glibc.malloc.tcache_count=0": "glibc.malloc.tcache_count=0",
}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import flatshard
    from flatshard.toolkit.data import SyntheticCorpus
    from flatshard.toolkit.models import GPT, PRESETS

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = flatshard.shard(GPT(PRESETS[args.model]), stage=3)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    corpus = SyntheticCorpus(model.cfg.vocab_size, model.cfg.seq_len)
    samples = []
    for step in range(1, args.steps + 1):
        model(*corpus.batch(step, rank, args.batch)).backward()
        opt.step()
        opt.zero_grad()
        if step % args.every == 0:
            samples.append((step, _rss()))
    model.wait_for_params()
    with open(f"{args.json}.{rank}", "w") as f:
        json.dump(samples, f)
    dist.barrier()
    dist.destroy_process_group()


def _variant(args: argparse.Namespace, tunables: str | None, tmp: str) -> list[list[tuple[int, int]]]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if tunables is not None:
        env["GLIBC_TUNABLES"] = tunables
    out = os.path.join(tmp, "samples")
    rank_args = ["--rank-main", "--steps", str(args.steps), "--every", str(args.every)]
    rank_args += ["--batch", str(args.batch), "--model", args.model, "--json", out]
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", os.path.abspath(__file__), *rank_args]
    subprocess.run(command, check=True, env=env)
    ranks = []
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            ranks.append([tuple(s) for s in json.load(f)])
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100, help="steps between RSS samples")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--model", default="small")
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    result = {
        "what": f"stage 3, {args.model} GPT, 2 ranks under torchrun, batch {args.batch}",
        "variants": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, tunables in SETTINGS.items():
            ranks = _variant(args, tunables, tmp)
            growth = max((r[-1][1] - r[0][1]) / r[0][1] for r in ranks)
            result["variants"][name] = {"rss_by_rank": ranks, "growth_after_warmup": round(growth, 4)}
            picks = [
                s for s in ranks[0] if s[0] in (args.every, args.steps // 4, args.steps // 2, args.steps)
            ]
            shown = "  ".join(f"step {s}: {rss / 2**20:.0f} MiB" for s, rss in picks)
            print(f"{name:45s} {shown}  growth {100 * growth:+.2f}%", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
