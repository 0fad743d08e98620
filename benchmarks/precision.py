"""Loss curves of low-precision optimizer state ([Note: precision-aware optimizer] in
flatshard/optim/precision.py), side by side with the peers' low-precision AdamW.

Every run trains the same bf16 model from the same init on the same batches with AdamW
(lr 3e-3, weight decay 0.1, a 20-step warmup): flatshard with fp32 main params and state
(12 bytes a param), bf16 state (8), bf16 main params and state (4); torchao's bf16 AdamW
with stochastic rounding (4, where torchao installs) and torch's AdamW stepping the bf16
params directly (4, round-to-nearest). The table gives each run's bytes a param of main
params and state (``memory_report``; the peers' from their state), its final loss (the mean
of the last 20 steps), that loss's gap to the fp32-state run's and the largest gap of the
10-step means along the curve after the warmup; JSON and a plot of the curves are written.
One process, one thread (the optimizers' arithmetic does not depend on the world size).

    python benchmarks/precision.py --model small --steps 300 --batch 8 --out results/precision-small
    python benchmarks/precision.py --model hf:llama --steps 300 --batch 8 --out results/precision-llama
    python benchmarks/precision.py --table results/precision-small.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import torch
from torch import nn

import flatshard
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import lm_loss, model_dims, model_factory

BF16 = torch.bfloat16
HYPER = {"lr": 3e-3, "weight_decay": 0.1}
WARMUP = 20
TAIL = 20  # steps averaged for the final loss


def _flatshard(precision):
    def make(model: nn.Module):
        sharded = flatshard.shard(model, stage=1, mixed_precision=flatshard.MixedPrecision(BF16))
        opt = flatshard.DistributedOptimizer(sharded, torch.optim.AdamW, precision=precision, **HYPER)
        return sharded, opt, lambda: flatshard.memory_report(sharded, opt)

    return make


def _plain(optimizer):
    """A peer: ``optimizer(params)`` over the model's own bf16 params, no flatshard."""

    def make(model: nn.Module):
        model = model.to(BF16)
        opt = optimizer(model.parameters())

        return model, opt, lambda: flatshard.memory_report(model, opt)  # (quantized state: its storages)

    return make


def _torchao_adamw():
    try:
        from torchao.optim import _AdamW
    except ImportError:
        return None
    return _plain(lambda params: _AdamW(params, bf16_stochastic_round=True, **HYPER))


def _flatshard_low_bit(name: str):
    """flatshard over a torchao low-bit Adam (fp32 main params, the state in blocks: [Note:
    blockwise state]), None where torchao does not install."""
    try:
        import torchao.optim
    except ImportError:
        return None

    def make(model: nn.Module):
        mp, aligned = flatshard.MixedPrecision(BF16), flatshard.Buckets(align=256)
        sharded = flatshard.shard(model, stage=1, mixed_precision=mp, buckets=aligned)
        opt = flatshard.DistributedOptimizer(sharded, getattr(torchao.optim, name), **HYPER)
        return sharded, opt, lambda: flatshard.memory_report(sharded, opt)

    return make


def _torchao_low_bit(name: str):
    try:
        import torchao.optim
    except ImportError:
        return None
    return _plain(lambda params: getattr(torchao.optim, name)(params, **HYPER))


RUNS = {
    "flatshard fp32 main + state": _flatshard(None),
    "flatshard bf16 state": _flatshard(flatshard.OptimizerPrecision(state_dtype=BF16)),
    "flatshard bf16 main + state": _flatshard(
        flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16)
    ),
    "torchao AdamW bf16, stochastic rounding": _torchao_adamw(),
    "torch AdamW on bf16 params": _plain(lambda params: torch.optim.AdamW(params, **HYPER)),
    "flatshard fp32 main + AdamW8bit state": _flatshard_low_bit("AdamW8bit"),
    "flatshard fp32 main + AdamW4bit state": _flatshard_low_bit("AdamW4bit"),
    "flatshard fp32 main + AdamWFp8 state": _flatshard_low_bit("AdamWFp8"),
    "torchao AdamW8bit on bf16 params": _torchao_low_bit("AdamW8bit"),
}
BASELINE = "flatshard fp32 main + state"


def train(make, base: nn.Module, corpus: SyntheticCorpus, steps: int, batch: int) -> dict:
    torch.manual_seed(0)
    model, opt, report = make(copy.deepcopy(base))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    numel = sum(p.numel() for p in base.parameters() if p.requires_grad)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        x, y = corpus.batch(step, 0, batch)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    memory = report()
    return {
        "losses": losses,
        "final": sum(losses[-TAIL:]) / len(losses[-TAIL:]),
        "bytes_per_param": (memory.main_params + memory.optimizer_state) / numel,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a GPT preset or hf:TYPE")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--out", default=None, help="PATH: writes PATH.json and PATH.png")
    parser.add_argument("--table", default=None, help="print the table of a JSON written before, and exit")
    parser.add_argument("--only", nargs="*", default=None, help="only the runs named with one of these")
    args = parser.parse_args()
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        report(saved["setup"], saved["runs"])
        return
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = model_factory(args.model)()
    vocab, seq_len = model_dims(base)
    corpus = SyntheticCorpus(vocab, seq_len or 64, seed=1234)
    results = {}
    for name, make in RUNS.items():
        if args.only is not None and name != BASELINE and not any(part in name for part in args.only):
            continue
        if make is None:
            print(f"{name}: not installed, skipped")
            continue
        results[name] = train(make, base, corpus, args.steps, args.batch)
    setup = {"model": args.model, "params": sum(p.numel() for p in base.parameters()), "steps": args.steps}
    setup |= {"batch": args.batch, **HYPER}
    report(setup, results)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"setup": setup, "runs": results}, f, indent=1)
        _plot(results, args.model, args.out + ".png")


def _smooth(losses: list[float], width: int = 10) -> list[float]:
    return [sum(losses[max(0, i - width + 1) : i + 1]) / min(i + 1, width) for i in range(len(losses))]


def report(setup: dict, results: dict) -> None:
    """The table: bytes a param, final loss, its gap to the fp32-state run's, the largest gap
    of the 10-step means along the curve (after the warmup), seconds a step."""
    reference = results[BASELINE]
    curve = _smooth(reference["losses"])
    print(
        f"\n{setup['model']} ({setup['params']:,} params), AdamW, {setup['steps']} steps of "
        f"{setup['batch']} sequences, bf16 params"
    )
    print(f"{'run':<42} {'bytes/param':>11} {'final loss':>10} {'gap':>8} {'worst gap':>9} {'s/step':>7}")
    for name, r in results.items():
        r["gap"] = (r["final"] - reference["final"]) / reference["final"]
        gaps = [(a - b) / b for a, b in zip(_smooth(r["losses"]), curve, strict=True)][WARMUP:]
        r["worst_curve_gap"] = max(gaps, key=abs)
        cells = f"{r['bytes_per_param']:>11.2f} {r['final']:>10.4f} {r['gap']:>+8.2%}"
        cells += f" {r['worst_curve_gap']:>+9.2%}"
        print(f"{name:<42} {cells} {r['seconds'] / setup['steps']:>7.3f}")


def _plot(results: dict, model: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        ax.plot(_smooth(r["losses"]), label=f"{name} ({r['bytes_per_param']:.0f} B/param)", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean of 10 steps)")
    ax.set_title(f"{model}: AdamW state precision")
    low = min(min(r["losses"]) for r in results.values())
    ax.set_ylim(bottom=math.floor(low * 10) / 10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
