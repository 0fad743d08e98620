"""What the mesh benchmarks (``tensor_parallel.py``, ``pipeline.py``, ``experts.py``) share:
their command line, their model's size, one training step, timing every peer in rotating rounds on the same
ranks, and the table and JSON of the results.

A round times every peer for ``steps`` steps after one untimed step, starting at another
peer each round; a step's time is the slowest rank's. A peer's figure is its median step
time over the rounds, with the spread (min-max) of its per-round medians, as a ratio to the
first peer's median."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def arguments(doc: str, name: str, steps: int = 5) -> argparse.Namespace:
    """``--steps``, ``--rounds`` and ``--out`` (today's ``benchmarks/results/<date>-<name>.json``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y-%m-%d')}-{name}.json")
    return parser.parse_args()


def llama_config(**changes):
    """The toolkit Llama every mesh benchmark trains (4 layers, width 256, 8 heads, 512
    tokens, sequences of 64, a feed-forward 4x wide), with ``changes``."""
    from flatshard.toolkit.models.llama import LlamaConfig

    size = dict(vocab_size=512, dim=256, n_heads=8, n_layers=4, seq_len=64, hidden_mult=4, init_std=0.02)
    return LlamaConfig(**{**size, **changes})


def train_step(model, opt, clip, batch) -> float:
    """Forward and backward of ``batch`` (model inputs), ``clip()``, the step; the loss."""
    loss = model(*batch)
    loss.backward()
    clip()
    opt.step()
    opt.zero_grad()
    return loss.item()


def time_rounds(
    peers: list[str], step: Callable[[str], float], steps: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Each peer's per-round median step times, and its last step's loss (``step(peer)``
    runs one step and returns it)."""
    times: dict[str, list[float]] = {p: [] for p in peers}
    losses: dict[str, float] = {}
    for r in range(rounds):
        for peer in peers[r % len(peers) :] + peers[: r % len(peers)]:
            step(peer)  # (untimed: caches and gathers settle)
            per_step = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                losses[peer] = step(peer)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                per_step.append(elapsed.item())
            times[peer].append(statistics.median(per_step))
    return times, losses


def report(title: str, times: dict, memory: dict, losses: dict, meta: dict, out: str) -> None:
    """Print the table (ratios to the first peer) and write the JSON to ``out``."""
    peers = list(times)
    base = statistics.median(times[peers[0]])
    width = max(len(p) for p in peers) + 2
    print(title)
    ratio = "step vs " + peers[0]
    print(f"{'peer':<{width}}{ratio:>22}{'spread':>16}{'step (s)':>10}{'state/rank':>13}{'loss':>9}")
    rows = []
    for peer in peers:
        rounds = times[peer]
        median = statistics.median(rounds)
        spread = f"{min(rounds) / base:.3f}-{max(rounds) / base:.3f}"
        print(
            f"{peer:<{width}}{median / base:>22.3f}{spread:>16}{median:>10.4f}"
            f"{memory[peer]['total'] / 2**20:>10.2f} MiB{losses[peer]:>9.4f}"
        )
        rows.append(
            {
                "peer": peer,
                "ratio": median / base,
                "round_medians_s": rounds,
                "memory": memory[peer],
                "final_loss": losses[peer],
            }
        )
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads here, torch {torch.__version__}"
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": machine, **meta}
    with open(out, "w") as f:
        json.dump({"meta": meta, "peers": rows}, f, indent=1)
    print(f"wrote {out}")
