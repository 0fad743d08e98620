"""Eager and compiled training on one GPU, side by side (needs CUDA; not part of the suite):
``PYTHONPATH=src python benchmarks/gpu_compile.py MODEL OUT.json`` with MODEL one of
``gpt150m`` (d_model 1024, 12 blocks, 1024 tokens, vocab 32768: 186 M params) or a GPT preset.

World size 1 on NCCL, bf16 params (fp32 main params and grads), AdamW. The peers:

- ``plain``: the model and ``torch.optim.AdamW(fused=True)`` under bf16 autocast;
- ``ddp``: torch DDP, likewise;
- ``fsdp2``: ``fully_shard`` on each block and the root, ``MixedPrecisionPolicy(bf16)``;
- ``flatshard-S``: ``shard(stage=S, mixed_precision=MixedPrecision(bf16))`` and
  ``DistributedOptimizer(AdamW)``.

Each peer trains eager and compiled with inductor: the whole model (``+model``,
``torch.compile`` of what the peer returns) and, for FSDP2 and flatshard, per block
(``+block``, ``block.compile()`` before wrapping, torchtitan's recipe).
Every peer is built and warmed up first (compilation happens then), then they take turns in
rounds whose order rotates; the step time of a peer is the median over rounds, and its
ratio to ``plain`` eager is given with the spread of the per-round ratios. Memory: the
bytes a peer holds after warm-up (params, grads, optimizer state) and the peak during its
steps above what the other peers hold. The losses of every peer on the same data must
agree (bf16 rounding): the largest difference from ``plain`` eager over the first
``COMPARED_STEPS`` steps is printed, and the final loss.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, PRESETS, GPTConfig

MODELS = {"gpt150m": GPTConfig(vocab_size=32768, seq_len=1024, d_model=1024, n_layers=12, n_heads=16)}
BATCH, WARMUP, ROUNDS, STEPS = 8, 3, 8, 8
PEERS = ["plain", "ddp", "fsdp2", "flatshard-0", "flatshard-2", "flatshard-3"]
MODES = {"plain": ("", "model"), "ddp": ("", "model")}  # the others: eager, per block, whole model
COMPARED_STEPS = WARMUP + STEPS  # bf16 trajectories drift apart after a while: compare the first


def build(peer: str, mode: str, cfg: GPTConfig):
    """(the callable to train, its optimizer, whether it needs autocast); ``mode``: "" (eager),
    "block" (each block compiled before wrapping) or "model" (the wrapped model compiled)."""
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    wrap = torch.compile if mode == "model" else lambda m: m
    if peer in ("plain", "ddp"):
        run = model if peer == "plain" else DDP(model, device_ids=[0])
        return wrap(run), torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), True
    if mode == "block":
        for block in model.blocks:
            block.compile()
    if peer == "fsdp2":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return wrap(model), torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), False
    stage = int(peer.rsplit("-", 1)[1])
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    model = flatshard.shard(model, stage=stage, mixed_precision=mp)
    return wrap(model), flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-4), False


def steps(entry: dict, corpus: SyntheticCorpus, first: int, count: int) -> list[float]:
    run, opt, autocast = entry["run"], entry["opt"], entry["autocast"]
    losses = []
    for i in range(first, first + count):
        x, y = corpus.batch(i, 0, BATCH)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = run(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in losses]


def bench(model_name: str) -> dict:
    cfg = MODELS.get(model_name) or PRESETS[model_name]
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    entries: dict[str, dict] = {}
    for peer in PEERS:
        for mode in MODES.get(peer, ("", "block", "model")):
            name = f"{peer}{'+' + mode if mode else ''}"
            before = torch.cuda.memory_allocated()
            counters.clear()
            start = time.perf_counter()
            try:
                run, opt, autocast = build(peer, mode, cfg)
                entry = {"run": run, "opt": opt, "autocast": autocast}
                entry["losses"] = steps(entry, corpus, 0, WARMUP)
            except Exception as e:  # report it, go on with the others
                print(f"{name}: ERROR {type(e).__name__}: {str(e)[:800]}", flush=True)
                continue
            torch.cuda.synchronize()
            entry["warmup_s"] = time.perf_counter() - start
            entry["held_mib"] = (torch.cuda.memory_allocated() - before) / 2**20
            entry["graphs"] = counters["stats"]["unique_graphs"]
            entry["breaks"] = sum(counters["graph_break"].values())
            entry["times"], entry["peaks"] = [], []
            entries[name] = entry
            print(f"built {name} in {entry['warmup_s']:.1f} s, holds {entry['held_mib']:.0f} MiB", flush=True)
    names = list(entries)
    for r in range(-1, ROUNDS):  # (round -1 warms every peer up again after the others were built)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            entry = entries[name]
            others = torch.cuda.memory_allocated() - entry["held_mib"] * 2**20
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
            start = time.perf_counter()
            losses = steps(entry, corpus, WARMUP + (r + 1) * STEPS, STEPS)
            torch.cuda.synchronize()
            if r >= 0:
                entry["times"].append((time.perf_counter() - start) / STEPS * 1e3)
                entry["peaks"].append((torch.cuda.max_memory_allocated() - others) / 2**20)
            entry["losses"] += losses
    return report(model_name, cfg, entries)


def report(model_name: str, cfg: GPTConfig, entries: dict) -> dict:
    base = entries["plain"]
    rows = {}
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    print(
        f"\n{model_name}: {params / 1e6:.0f} M params, "
        f"batch {BATCH} x {cfg.seq_len}, bf16, AdamW, {torch.cuda.get_device_name()}"
    )
    print(
        f"{'peer':24s} {'step ms':>8s} {'x plain':>8s} {'spread':>13s} {'held MiB':>9s} "
        f"{'peak MiB':>9s} {'|dloss|':>8s} {'loss':>7s} {'warmup s':>8s} {'graphs':>6s} {'breaks':>6s}"
    )
    for name, e in entries.items():
        ratios = [t / b for t, b in zip(e["times"], base["times"], strict=True)]
        pairs = zip(e["losses"][:COMPARED_STEPS], base["losses"][:COMPARED_STEPS], strict=True)
        dloss = max(abs(a - b) for a, b in pairs)
        rows[name] = {
            "step_ms": statistics.median(e["times"]),
            "ratio_to_plain": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
            "held_mib": e["held_mib"],
            "peak_mib": max(e["peaks"]),
            "max_loss_diff": dloss,
            "warmup_s": e["warmup_s"],
            "graphs": e["graphs"],
            "graph_breaks": e["breaks"],
            "final_loss": e["losses"][-1],
        }
        row = rows[name]
        print(
            f"{name:24s} {row['step_ms']:8.1f} {row['ratio_to_plain']:8.3f} "
            f"{row['ratio_spread'][0]:6.3f}-{row['ratio_spread'][1]:.3f} {row['held_mib']:9.0f} "
            f"{row['peak_mib']:9.0f} {dloss:8.4f} {row['final_loss']:7.3f} {row['warmup_s']:8.1f} "
            f"{e['graphs']:6d} {e['breaks']:6d}",
            flush=True,
        )
    return {"model": model_name, "config": vars(cfg), "batch": BATCH, "rows": rows}


def _main(model_names: list[str], path: str) -> None:
    torch.cuda.set_device(0)
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "rounds": ROUNDS,
        "steps_per_round": STEPS,
        "models": [],
    }
    for name in model_names:  # (written after each model, so a run cut short keeps what it did)
        out["models"].append(bench(name))
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        torch.compiler.reset()


if __name__ == "__main__":
    from flatshard.toolkit.testing import run_distributed

    run_distributed(_main, 1, sys.argv[1].split(","), sys.argv[2], backend="nccl", timeout=580)
