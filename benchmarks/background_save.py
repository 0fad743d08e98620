"""How long a checkpoint save stops the training loop (issue 62), in one run on 2 ranks: a
blocking ``save_checkpoint``, one in the background (``blocking=False``), and torch's
``dcp.async_save`` of the same model under DDP with the same optimizer, beside the time to copy
the rank's state in memory (the goal: a stall no longer than that).

    PYTHONPATH=src python benchmarks/background_save.py OUT.json [--model gpt-large|llama]
        [--stage 2] [--ranks 2] [--rounds 3] [--steps 4]

Per way and round: the stall (the call, to its return), the mean step time of the ``--steps``
steps that follow it (overlapping the background write), relative to plain steps measured in
the same ranks, and the wait left at the end. Then the roll-back: ``load_checkpoint`` of a
background save just written, from its snapshot in host memory ([Note: save snapshots]) and,
that snapshot dropped, from the files (the page cache warm: storage's best case). Medians over
the rounds, with the range.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from flatshard.checkpoint import snapshot
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, PRESETS
from flatshard.toolkit.testing import run_distributed

WAYS = ("copy in memory", "blocking save", "background save", "dcp.async_save (DDP)")


def _build(name: str):
    """The model and a loss of a batch (tokens, targets)."""
    torch.manual_seed(0)
    if name == "llama":
        from flatshard.toolkit.models.hf import tiny_model

        model = tiny_model(
            "llama", vocab_size=512, seq_len=128, hidden_size=512, intermediate_size=1376,
            num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        )  # fmt: skip
        return model, lambda m, x, y: m(input_ids=x, labels=y).loss, 512, 128
    cfg = PRESETS[name.removeprefix("gpt-")]
    return GPT(cfg), lambda m, x, y: m(x, y), cfg.vocab_size, cfg.seq_len


def _steps(model, opt, loss_of, corpus, n: int, start: int) -> float:
    """Mean seconds a step over ``n`` steps."""
    began = time.perf_counter()
    for step in range(start, start + n):
        x, y = corpus.batch(step, dist.get_rank(), 4)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - began) / n


def _round(way: str, kit: dict, root: str, i: int, steps: int) -> dict:
    model, opt, loss_of, corpus = kit["model"], kit["opt"], kit["loss_of"], kit["corpus"]
    path = os.path.join(root, f"{way.split()[0]}-{i}")
    dist.barrier()
    began = time.perf_counter()
    future = None
    if way == "copy in memory":
        inner = opt.inner  # (this rank's shards and their state, at any stage)
        tensors = [p.detach() for group in inner.param_groups for p in group["params"]]
        tensors += [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        [t.clone() for t in tensors]
    elif way == "blocking save":
        flatshard.save_checkpoint(path, model, opt)
    elif way == "background save":
        flatshard.save_checkpoint(path, model, opt, blocking=False)
    else:
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        future = dcp.async_save(state, checkpoint_id=path, process_group=kit["writer"])
    stall = time.perf_counter() - began
    step = _steps(model, opt, loss_of, corpus, steps, 100 * i)
    began = time.perf_counter()
    if future is not None:
        future.result()
    flatshard.wait_for_checkpoint()
    return {"stall": stall, "step": step, "wait": time.perf_counter() - began}


def _roll_back(kit: dict, root: str, i: int) -> dict:
    """Seconds to load a background save just written: from its snapshot, then from its files."""
    model, opt = kit["model"], kit["opt"]
    path = os.path.join(root, f"roll-back-{i}")
    flatshard.save_checkpoint(path, model, opt, blocking=False)
    flatshard.wait_for_checkpoint()
    took = {}
    for source in ("memory", "files"):
        if source == "files":
            snapshot.drop()
        dist.barrier()
        began = time.perf_counter()
        flatshard.load_checkpoint(path, model, opt)
        took[source] = time.perf_counter() - began
    return took


def _measure(name: str, stage: int, rounds: int, steps: int, root: str) -> dict:
    module, loss_of, vocab, seq = _build(name)
    corpus = SyntheticCorpus(vocab, seq)
    ours = flatshard.shard(module, stage=stage)
    kits = {"ours": {"model": ours, "loss_of": loss_of, "corpus": corpus}}
    kits["ours"]["opt"] = flatshard.DistributedOptimizer(ours, torch.optim.AdamW, lr=1e-4)
    ddp, _, _, _ = _build(name)
    ddp = DDP(ddp)
    kits["ddp"] = {
        "model": ddp,
        "loss_of": loss_of,
        "corpus": corpus,
        "opt": torch.optim.AdamW(ddp.parameters(), lr=1e-4),
        "writer": dist.new_group(backend="gloo"),  # (async saves' collectives: not on the DDP's group)
    }
    out: dict = {"params": sum(p.numel() for p in module.parameters())}
    for side, kit in kits.items():
        _steps(kit["model"], kit["opt"], loss_of, corpus, 2, 0)  # (warm: state made)
        kit["plain"] = statistics.median(
            _steps(kit["model"], kit["opt"], loss_of, corpus, steps, 50) for _ in range(2)
        )
        out[f"plain step {side}"] = kit["plain"]
    for way in WAYS:
        kit = kits["ddp" if way.startswith("dcp") else "ours"]
        runs = [_round(way, kit, root, i, steps) for i in range(rounds)]
        out[way] = {
            "stall_ms": [r["stall"] * 1e3 for r in runs],
            "step_vs_plain": [r["step"] / kit["plain"] for r in runs],
            "wait_ms": [r["wait"] * 1e3 for r in runs],
        }
    backs = [_roll_back(kits["ours"], root, i) for i in range(rounds)]
    out["roll back"] = {f"{source}_ms": [b[source] * 1e3 for b in backs] for source in ("memory", "files")}
    return out


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="gpt-large", help="gpt-<preset> or llama")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="flatshard-bg-save-")
    try:
        result = run_distributed(
            _measure, args.ranks, args.model, args.stage, args.rounds, args.steps, root, timeout=3600
        )[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.model} ({result['params']:,} params), stage {args.stage}, {args.ranks} ranks on gloo (CPU);"
    )
    ours, ddp = (result[f"plain step {side}"] * 1e3 for side in ("ours", "ddp"))
    print(f"plain step: flatshard {ours:.0f} ms, DDP {ddp:.0f} ms")
    print(f"{'way':24} {'stall ms':>22} {'steps after / plain':>22} {'wait at the end ms':>22}")
    for way in WAYS:
        r = result[way]
        cells = (_cell(r["stall_ms"], ".0f"), _cell(r["step_vs_plain"], ".2f"), _cell(r["wait_ms"], ".0f"))
        print(f"{way:24} " + " ".join(f"{c:>22}" for c in cells))
    back = result["roll back"]
    print(f"roll back to the last save: from memory {_cell(back['memory_ms'], '.0f')} ms, ", end="")
    print(f"from its files {_cell(back['files_ms'], '.0f')} ms")
    record = {"args": vars(args), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), **result}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
