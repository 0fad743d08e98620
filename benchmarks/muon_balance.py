"""Load balance of whole-param buckets ([Note: whole-param buckets] in flatshard/planner/layout.py).

For a GPT preset with Muon on the blocks' matrices (``whole_params``), at each world size and
stage: the Muon elements and Newton-Schulz work (~ m * n * min(m, n) per matrix) each rank
owns, as max / mean over the ranks, and the padding the whole-param buckets add, as the
elements every collective moves relative to the flat layout of the same model. Pure
planning: no process group, the model is built on the meta device.

    python benchmarks/muon_balance.py --model medium --out benchmarks/results/muon-balance.json
"""

from __future__ import annotations

import argparse
import json

import torch

from flatshard.app.peers import is_hidden_matrix
from flatshard.planner.layout import plan_layout
from flatshard.planner.stage import DEFAULT_BUCKET_SIZE, StagePolicy
from flatshard.toolkit.models import GPT, PRESETS
from flatshard.wrap.specs import model_specs


def balance_row(module: torch.nn.Module, world_size: int, stage: int, bucket_size: int | None) -> dict:
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters() if is_hidden_matrix(n, p)}
    policy = StagePolicy(stage)
    specs = model_specs(module, stage=stage, whole_params=is_hidden_matrix)
    flat_specs = model_specs(module, stage=stage)
    plan = dict(world_size=world_size, bucket_size=bucket_size, shard=policy.pads_for_shards)
    layout, flat = plan_layout(specs, **plan), plan_layout(flat_specs, **plan)
    elements, flops = [0] * world_size, [0] * world_size
    for bucket in (b for buffer in layout.buffers for b in buffer.buckets):
        for slot in (s for s in bucket.params if s.name in shapes):
            (m, n), owner = shapes[slot.name], bucket.owner(slot)
            elements[owner] += m * n
            flops[owner] += m * n * min(m, n)
    return {
        "world_size": world_size,
        "stage": stage,
        "buckets": sum(len(b.buckets) for b in layout.buffers),
        "muon_elements_max_over_mean": max(elements) / (sum(elements) / world_size),
        "ns_flops_max_over_mean": max(flops) / (sum(flops) / world_size),
        "collective_elements_vs_flat": layout.numel / flat.numel,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium", choices=sorted(PRESETS))
    parser.add_argument("--bucket-size", type=int, default=DEFAULT_BUCKET_SIZE)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with torch.device("meta"):
        module = GPT(PRESETS[args.model])
    rows = [balance_row(module, w, s, args.bucket_size) for s in (1, 2, 3) for w in (2, 3, 4, 8)]
    print(f"{args.model} GPT, Muon on the blocks' matrices, bucket size {args.bucket_size:,} elements")
    heads = ("stage", "ranks", "buckets", "elements max/mean", "NS flops max/mean", "sent vs flat")
    print(" ".join(f"{h:>{max(5, len(h))}}" for h in heads))
    for r in rows:
        values = (r["stage"], r["world_size"], r["buckets"])
        ratios = (
            r["muon_elements_max_over_mean"],
            r["ns_flops_max_over_mean"],
            r["collective_elements_vs_flat"],
        )
        cells = [f"{v:>{max(5, len(h))}}" for v, h in zip(values, heads, strict=False)]
        cells += [f"{v:>{len(h)}.3f}" for v, h in zip(ratios, heads[3:], strict=True)]
        print(" ".join(cells))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "bucket_size": args.bucket_size, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
