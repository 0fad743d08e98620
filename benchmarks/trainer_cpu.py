"""Issue 46, item 7, on the CPU: one job under the Hugging Face Trainer on 2 gloo ranks, with
each way of sharding it side by side in one run.

    PYTHONPATH=src:tests python benchmarks/trainer_cpu.py [--steps N] [--rounds R] [--out PATH]

The job: a 4-layer Llama (width 256, 2048 tokens) built from its config, sequences of 128
tokens, 4 a micro-batch, 2 micro-batches a step, AdamW, clipping at 1.0, a linear schedule.
The peers, each in ranks of its own:

- ``ddp``: the Trainer's own DDP on the plain model (the reference of every ratio);
- ``flatshard-1/2/3``: ``flatshard.hosts.hf.Trainer(..., shard=N)``;
- ``loop-1/2/3``: flatshard in a hand-written loop doing the same (the issue's goal: the
  Trainer at most 3% slower than this);
- ``fsdp2``: the Trainer's ``fsdp="full_shard"`` with ``fsdp_config={"version": 2}``;
- ``deepspeed-1/2/3``: the Trainer's ``deepspeed={"zero_optimization": {"stage": N}}``
  (``DS_ACCELERATOR=cpu``), when deepspeed imports.

Each round runs every peer once, in a rotating order; a peer's figure is its median step
time over the rounds' timed steps, with the spread of its per-round medians. Peak memory is
rank 0's resident-set growth during its run (``/proc/self/clear_refs``), bytes sent per step
are flatshard's own count (``comm_stats``) and the ring count for the peers (DDP and ZeRO-1/2:
2(N-1)/N of the fp32 grads; ZeRO-3 and FSDP2: 3(N-1)/N). A peer that fails is reported with
its error. Prints a table; writes JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time

import torch

WORLD = 2
PEERS = [
    "ddp",
    *(f"flatshard-{s}" for s in (1, 2, 3)),
    *(f"loop-{s}" for s in (1, 2, 3)),
    "fsdp2",
    *(f"deepspeed-{s}" for s in (1, 2, 3)),
]
WARMUP = 2
SETTINGS = dict(
    use_cpu=True,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    learning_rate=1e-3,
    weight_decay=0.01,
    max_grad_norm=1.0,
    lr_scheduler_type="linear",
    optim="adamw_torch",
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    seed=0,
    disable_tqdm=True,
    dataloader_drop_last=True,
)


def _model() -> torch.nn.Module:
    from flatshard.toolkit.models import tiny_model

    torch.manual_seed(0)
    return tiny_model(
        "llama", vocab_size=2048, seq_len=128, hidden_size=256, intermediate_size=688, num_hidden_layers=4
    )


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.ids = torch.randint(1, 2048, (size, 128), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _memory_mark() -> float:
    """Reset this process's peak RSS; its RSS now, in MiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _peer(name: str, steps: int, out: str) -> dict:
    """One peer's run on this rank: its step times (s), peak RSS growth (MiB), bytes sent."""
    torch.manual_seed(0)
    base = _memory_mark()
    try:
        times, sent = (_loop if name.startswith("loop") else _hosted)(name, steps, out)
    except Exception as e:  # (a peer that cannot run here is reported, not fatal)
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}
    return {"times": times, "peak_mib": _status("VmHWM") - base, "bytes_per_step": sent}


def _hosted(name: str, steps: int, out: str) -> tuple[list[float], float | None]:
    import transformers

    from flatshard.hosts import hf

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == WARMUP and hasattr(model, "comm_stats"):
                model.comm_stats.reset()  # (the timed steps' bytes only)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    kind, _, stage = name.partition("-")
    more: dict = {}
    if kind == "fsdp2":
        more = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "reshard_after_forward": True}}
    if kind == "deepspeed":
        os.environ["DS_ACCELERATOR"] = "cpu"
        zero = {"stage": int(stage)}
        more = {
            "deepspeed": {
                "zero_optimization": zero,
                "zero_allow_untested_optimizer": True,
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
            }
        }
    args = transformers.TrainingArguments(output_dir=f"{out}/{name}", max_steps=steps, **SETTINGS, **more)
    data = _Tokens(WORLD * 4 * 2 * steps)
    sharding = {"shard": int(stage)} if kind == "flatshard" else {}
    host = hf.Trainer if kind == "flatshard" else transformers.Trainer
    trainer = host(model=_model(), args=args, train_dataset=data, callbacks=[Clock()], **sharding)
    trainer.train()
    stats = getattr(trainer.model, "comm_stats", None)
    return times[WARMUP:], None if stats is None else stats.total_wire_bytes / (steps - WARMUP)


def _loop(name: str, steps: int, out: str) -> tuple[list[float], float | None]:
    """flatshard in the loop the Trainer runs: the same model, data, optimizer, schedule."""
    import torch.distributed as dist

    import flatshard

    dist.init_process_group("gloo")
    model = flatshard.shard(_model(), stage=int(name.split("-")[1]))
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    optimizer = flatshard.DistributedOptimizer(model, torch.optim.AdamW, params=groups, lr=1e-3)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.0, total_iters=steps)
    data = _Tokens(WORLD * 4 * 2 * steps)
    sampler = torch.utils.data.DistributedSampler(data, shuffle=True, seed=0)
    batches = iter(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, drop_last=True))
    times = []
    for step in range(steps):
        micro_batches = [next(batches), next(batches)]  # (fetched before the clock, as the Trainer does)
        start = time.perf_counter()
        if step == WARMUP:
            model.comm_stats.reset()
        for micro, batch in enumerate(micro_batches):
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                (model(**batch).loss / 2).backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return times[WARMUP:], model.comm_stats.total_wire_bytes / (steps - WARMUP)


def _ring_bytes(name: str) -> float:
    """The ring count of bytes a rank sends a step, for a peer flatshard does not count."""
    params = sum(p.numel() for p in _model().parameters())
    factor = 3 if name in ("fsdp2", "deepspeed-3") else 2
    return factor * (WORLD - 1) / WORLD * params * 4


def main() -> None:
    from flatshard.toolkit import testing

    testing.PRELOAD.extend(["transformers.trainer", "accelerate"])  # (once, not in every rank)
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peers", nargs="*", default=PEERS)
    parser.add_argument("--out", default=f"benchmarks/results/{time.strftime('%Y-%m-%d')}-trainer-cpu.json")
    args = parser.parse_args()
    rounds: dict[str, list[dict]] = {p: [] for p in args.peers}
    for r in range(args.rounds):
        order = args.peers[r % len(args.peers) :] + args.peers[: r % len(args.peers)]
        for name in order:
            ranks = testing.run_distributed(
                _peer, WORLD, name, args.steps, f"/tmp/trainer-cpu/{r}", init=False, timeout=900
            )
            rounds[name].append(ranks[0])
            print(f"round {r + 1} {name}: {_summary(ranks[0])}", flush=True)
    table = _table(rounds)
    _print(table)
    with open(args.out, "w") as f:
        json.dump(
            {
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{os.cpu_count()} cores",
                "world": WORLD,
                "steps": args.steps,
                "warmup": WARMUP,
                "torch": torch.__version__,
                "peers": table,
                "rounds": rounds,
            },
            f,
            indent=1,
        )
    print(f"wrote {args.out}")


def _summary(run: dict) -> str:
    return run["error"] if "error" in run else f"{statistics.median(run['times']) * 1e3:.0f} ms"


def _table(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    ok = {n: [r for r in runs if "error" not in r] for n, runs in rounds.items()}
    ddp = statistics.median(t for r in ok.get("ddp", []) for t in r["times"]) if ok.get("ddp") else None
    table = {}
    for name, runs in ok.items():
        if not runs:
            table[name] = {"error": rounds[name][0]["error"]}
            continue
        per_round = [statistics.median(r["times"]) for r in runs]
        median = statistics.median(t for r in runs for t in r["times"])
        counted = runs[0]["bytes_per_step"]
        table[name] = {
            "step_ms": median * 1e3,
            "ratio_to_ddp": None if ddp is None else median / ddp,
            "ratio_range": None if ddp is None else [min(per_round) / ddp, max(per_round) / ddp],
            "peak_mib": statistics.median(r["peak_mib"] for r in runs),
            "bytes_per_step": counted if counted is not None else _ring_bytes(name),
            "bytes_counted": counted is not None,
        }
    return table


def _print(table: dict[str, dict]) -> None:
    print(f"{'peer':<14}{'step ms':>9}{'x DDP':>8}{'range':>14}{'peak MiB':>10}{'MB sent/step':>14}")
    for name, row in table.items():
        if "error" in row:
            print(f"{name:<14} failed: {row['error'][:100]}")
            continue
        ratio = "" if row["ratio_to_ddp"] is None else f"{row['ratio_to_ddp']:.3f}"
        spread = "" if row["ratio_range"] is None else "{:.2f}-{:.2f}".format(*row["ratio_range"])
        mark = "" if row["bytes_counted"] else " (ring)"
        print(
            f"{name:<14}{row['step_ms']:>9.0f}{ratio:>8}{spread:>14}{row['peak_mib']:>10.0f}"
            f"{row['bytes_per_step'] / 1e6:>9.2f}{mark}"
        )


if __name__ == "__main__":
    main()
