"""Side-by-side step-time benchmark of flatshard and its peers, in one run on the same ranks.

Every peer trains its own copy of the same model on the same data. Peers take turns in
rounds (the order rotates every round) so that the machine's drift hits them all alike;
the reported time is the median step over all rounds, and the ratio is to torch DDP's.
"""

from __future__ import annotations

import copy
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import date

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from flatshard.data import SyntheticCorpus
from flatshard.memory import memory_report, retain_freed_cpu_memory
from flatshard.models import GPT, PRESETS
from flatshard.testing import run_distributed

Peer = Callable[
    [nn.Module, int | None], tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer | None]
]
"""(model, bucket size) -> (wrapped model, optimizer, optimizer whose state memory_report
counts; None where model-state memory cannot be counted from outside)."""
ADAMW = {"lr": 1e-3, "weight_decay": 0.1}


def _ddp(model: nn.Module, bucket_size: int | None):
    model = DDP(model, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    return model, optimizer, optimizer


def _torch_zero1(model: nn.Module, bucket_size: int | None):
    model = DDP(model, gradient_as_bucket_view=True)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    return model, optimizer, optimizer.optim


def _fsdp2(reshard_after_forward: bool) -> Peer:
    """FSDP2 (``fully_shard`` per block, then the root); ``reshard_after_forward=False`` keeps
    params unsharded between forward and backward (ZeRO-2-like). Its resident state is
    counted from the local shards of its DTensors."""

    def wrap(model: nn.Module, bucket_size: int | None):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        return model, optimizer, optimizer

    return wrap


def _flatshard(stage: int) -> Peer:
    def wrap(model: nn.Module, bucket_size: int | None):
        kwargs = {} if bucket_size is None else {"bucket_size": bucket_size}
        model = flatshard.shard(model, stage=stage, **kwargs)
        if stage == 0:
            optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        else:
            optimizer = flatshard.DistributedOptimizer(
                model, torch.optim.AdamW, skip_nonfinite=False, **ADAMW
            )
        return model, optimizer, optimizer

    return wrap


def _hybrid(fraction: float, overlap: bool) -> Peer:
    """torch DDP + ``HybridDeviceOptimizer(AdamW)`` with ``fraction`` of the params on the host."""

    def wrap(model: nn.Module, bucket_size: int | None):
        model = DDP(model, gradient_as_bucket_view=True)
        optimizer = flatshard.HybridDeviceOptimizer(
            model.parameters(),
            offload_fraction=fraction,
            cpu_optimizer_class=torch.optim.AdamW,
            overlap=overlap,
            **ADAMW,
        )
        return model, optimizer, optimizer

    return wrap


def _owner(bucket_cap_bytes: int) -> Peer:
    """torch DDP + ``OwnerShardedOptimizer(AdamW)``; ``bucket_cap_bytes=0``: one broadcast per param."""

    def wrap(model: nn.Module, bucket_size: int | None):
        model = DDP(model, gradient_as_bucket_view=True)
        optimizer = flatshard.OwnerShardedOptimizer(
            model.parameters(), torch.optim.AdamW, bucket_cap_bytes=bucket_cap_bytes, **ADAMW
        )
        return model, optimizer, optimizer

    return wrap


STAGE_PEERS: dict[str, Peer] = {
    "ddp": _ddp,
    "torch-zero1": _torch_zero1,
    "fsdp2": _fsdp2(False),
    "fsdp2-zero3": _fsdp2(True),
    **{f"flatshard-{s}": _flatshard(s) for s in flatshard.api.IMPLEMENTED_STAGES},
}
OPTIMIZER_PEERS: dict[str, Peer] = {
    "ddp": _ddp,
    "torch-zero1": _torch_zero1,
    "owner": _owner(25 * 2**20),
    "owner-per-param": _owner(0),
    "hybrid-0.5": _hybrid(0.5, overlap=True),
    "hybrid-1.0": _hybrid(1.0, overlap=True),
    "hybrid-1.0-sync": _hybrid(1.0, overlap=False),
}
PEERS: dict[str, Peer] = {**STAGE_PEERS, **OPTIMIZER_PEERS}


def _rank_bench(preset: str, peers: list[str], steps: int, rounds: int, batch: int, bucket_size) -> dict:
    retain_freed_cpu_memory()  # the same allocator settings for every peer
    rank = dist.get_rank()
    cfg = PRESETS[preset]
    torch.manual_seed(0)
    base = GPT(cfg)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    runs = {}
    for name in peers:
        model, optimizer, counted = PEERS[name](copy.deepcopy(base), bucket_size)
        runs[name] = {
            "model": model,
            "opt": optimizer,
            "counted": counted,
            "times": [],
            "losses": [],
            "step": 0,
        }
    data = [corpus.batch(i, rank, batch) for i in range(steps)]

    def one_step(run: dict, measure: bool = False) -> None:
        x, y = data[run["step"] % steps]
        loss = run["model"](x, y)
        loss.backward()
        run["opt"].step()
        if measure:  # before zero_grad, so grads held in buckets count for every peer
            counted = run["counted"]
            run["memory"] = None if counted is None else memory_report(run["model"], counted).total
        run["opt"].zero_grad()
        run["losses"].append(loss.item())
        run["step"] += 1

    for name in peers:  # warm-up: first-iteration allocations, DDP's bucket rebuild
        for i in range(2):
            one_step(runs[name], measure=i == 1)
    for r in range(rounds):
        order = peers[r % len(peers) :] + peers[: r % len(peers)]
        for name in order:
            run = runs[name]
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                one_step(run)
                run["times"].append(time.perf_counter() - start)
    return {
        name: {
            "step_times": run["times"],
            "final_loss": run["losses"][-1],
            "model_state_bytes": run["memory"],
            "threads": torch.get_num_threads(),
        }
        for name, run in runs.items()
    }


def run_bench(
    *,
    world_size: int = 2,
    preset: str = "small",
    peers: list[str] | None = None,
    steps: int = 10,
    rounds: int = 6,
    batch: int = 16,
    bucket_size: int | None = None,
) -> dict:
    """Run every peer (default: DDP, the torch peers and flatshard's stages) on
    ``world_size`` local ranks; return a JSON-ready result."""
    peers = peers or list(STAGE_PEERS)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; known: {sorted(PEERS)}")
    per_rank = run_distributed(
        _rank_bench, world_size, preset, peers, steps, rounds, batch, bucket_size, timeout=1800
    )
    results = {}
    for name in peers:
        # a step is as slow as its slowest rank
        times = [max(ts) for ts in zip(*(r[name]["step_times"] for r in per_rank), strict=True)]
        results[name] = {
            "median_step_s": statistics.median(times),
            "final_loss": per_rank[0][name]["final_loss"],
            "model_state_bytes": per_rank[0][name]["model_state_bytes"],
        }
    ddp = results.get("ddp", {}).get("median_step_s")
    for r in results.values():
        r["ratio_to_ddp"] = r["median_step_s"] / ddp if ddp else None
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {per_rank[0][peers[0]]['threads']} torch thread(s)/rank, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}",
        "world_size": world_size,
        "model": preset,
        "params": sum(p.numel() for p in GPT(PRESETS[preset]).parameters()),
        "steps_per_round": steps,
        "rounds": rounds,
        "batch_per_rank": batch,
        "peers": results,
    }


def format_table(result: dict) -> str:
    lines = [
        f"{result['model']} GPT ({result['params']:,} params), {result['world_size']} ranks, "
        f"{result['rounds']} rounds x {result['steps_per_round']} steps, {result['date']},",
        f"  {result['machine']}",
        f"{'peer':<16} {'median step':>12} {'vs DDP':>8} {'model state/rank':>18} {'final loss':>11}",
    ]
    for name, r in result["peers"].items():
        ratio = "-" if r["ratio_to_ddp"] is None else f"{r['ratio_to_ddp']:.3f}"
        state = r["model_state_bytes"]
        state = "-" if state is None else f"{state / 2**20:.2f} MiB"
        lines.append(
            f"{name:<16} {r['median_step_s'] * 1e3:>9.1f} ms {ratio:>8} {state:>18} {r['final_loss']:>11.4f}"
        )
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def script_main(doc: str, peers: dict[str, Peer], default_out: str, argv: list[str] | None = None) -> None:
    """The command line of the scripts in ``benchmarks/``: run ``peers``, print, write JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--peers", nargs="+", default=list(peers), choices=list(PEERS))
    parser.add_argument("--steps", type=int, default=10, help="steps per peer per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--bucket-size", type=int, default=None)
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args(argv)
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
