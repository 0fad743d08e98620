"""``flatshard bench``: flatshard and its peers train the same model on the same data, on
the same ranks, in one run.

Each peer trains in processes of its own (so that its resident memory is its own), and the
peers take turns in rounds whose order rotates, so that the machine's drift hits them all
alike. Per peer, on every rank:

- step time: the median over all rounds of the step time of the slowest rank, and its ratio
  to torch DDP's;
- model-state bytes resident after warm-up (``memory_report``: params, grads, main params,
  optimizer state) where they can be counted from outside, and the process RSS after the
  timed steps (so that memory a peer's steps keep adding shows), which every peer gets
  measured the same way;
- bytes sent per step: what the rank's process wrote to its sockets (Linux
  ``/proc/self/io``), net of the timing barriers: on gloo that is every collective of every
  peer, whatever its implementation, measured the same way;
- the final loss (mean over ranks), which must agree between peers.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
import warnings
from datetime import date

import torch
import torch.distributed as dist
from torch import nn

from flatshard.app.peers import PEERS, Peer, default_peers, prepare, theory_bytes
from flatshard.memory import mib
from flatshard.planner import plan
from flatshard.toolkit import testing
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.malloc import retain_freed_cpu_memory
from flatshard.toolkit.models import PRESETS, CausalLMLoss, is_hf_model, model_dims, model_factory
from flatshard.toolkit.testing import run_distributed

DTYPES = ("fp32", "bf16")  # names in flatshard.planner.plan.DTYPES


def _proc_counter(path: str, key: str) -> int | None:
    """A counter from a /proc/self file ("VmRSS:  123 kB", "wchar: 456"), in bytes; None
    off Linux."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    number, *unit = value.split()
                    return int(number) * (1024 if unit == ["kB"] else 1)
    except OSError:
        return None
    return None


def _rss() -> int | None:
    return _proc_counter("/proc/self/status", "VmRSS")


def _bytes_written() -> int | None:
    return _proc_counter("/proc/self/io", "wchar")


def _barrier_bytes(count: int) -> float | None:
    """Bytes one ``dist.barrier()`` writes to this rank's sockets (the mean of ``count``)."""
    before = _bytes_written()
    for _ in range(count):
        dist.barrier()
    after = _bytes_written()
    return None if before is None or after is None else (after - before) / count


def build_model(spec: str) -> tuple[nn.Module, int, int]:
    """The model ``spec`` names (``models.model_factory``: a GPT preset, ``hf:TYPE``, a
    directory, ``module:function``) with the ``forward(tokens, targets) -> loss`` every peer
    calls, its vocabulary size and sequence length (at most 256 tokens)."""
    module = model_factory(spec)()
    vocab, seq_len = model_dims(module)
    if vocab is None or seq_len is None:
        raise ValueError(f"--model {spec}: the model does not say its vocab size and sequence length")
    return (CausalLMLoss(module) if is_hf_model(module) else module), vocab, min(seq_len, 256)


def _peer_session(
    name: str, preset: str, steps: int, warmup: int, batch: int, bucket_size, dtype: str
) -> dict:
    """One peer on this rank: build, warm up, then ``steps`` timed steps."""
    retain_freed_cpu_memory()  # the same allocator settings for every peer
    barrier_bytes = _barrier_bytes(steps)  # before any peer's collective can be in flight
    rank = dist.get_rank()
    warnings.filterwarnings("ignore")  # the peers' own chatter stays out of the table: no
    sys.stdout.flush()  # warnings, and what they print (DeepSpeed's op builds) goes to stderr
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    prepare(name)
    rss_base = _rss()
    torch.manual_seed(0)
    compute = None if dtype == "fp32" else plan.DTYPES[dtype]  # mixed precision: fp32 params, compute in it
    model, vocab, seq_len = build_model(preset)
    trainer = PEERS[name](model, bucket_size, compute)
    corpus = SyntheticCorpus(vocab, seq_len)
    data = [corpus.batch(i, rank, batch) for i in range(warmup + steps)]
    for i in range(warmup):  # first-iteration allocations, DDP's bucket rebuild, ...
        trainer.step(*data[i], measure=i == warmup - 1)
    # gloo's barrier first finishes the group's pending work (a gather a step left in
    # flight), so both ends of the counted window stand at the same point of a step
    dist.barrier()
    start_sent = _bytes_written()
    times, loss = [], 0.0
    for i in range(warmup, warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        loss = trainer.step(*data[i])
        times.append(time.perf_counter() - start)
    dist.barrier()
    rss = _rss()
    sent = None
    end_sent = _bytes_written()
    if start_sent is not None and end_sent is not None and barrier_bytes is not None:
        sent = (end_sent - start_sent - (steps + 1) * barrier_bytes) / steps
    final = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(final)
    return {
        "step_times": times,
        "final_loss": final.item() / dist.get_world_size(),
        "model_state_bytes": trainer.model_state_bytes,
        "rss_bytes": rss,
        "rss_base_bytes": rss_base,
        "sent_bytes_per_step": sent,
        "threads": torch.get_num_threads(),
    }


def _preload(preset: str, peers: list[str]) -> None:
    """Each round of each peer starts new ranks: have the forkserver they fork from import
    once what they would otherwise each import (``testing.PRELOAD``; only before the
    process's first ``run_distributed``): ``bench -n 2 --model hf:llama`` of DDP, FSDP2 and
    flatshard-3 for 2 steps went from 23 s to 19 s on 2 cores."""
    hf = ":" in preset or preset.endswith(".json") or os.path.isdir(preset)
    extra = ["transformers.modeling_utils"] if hf else []
    if any(p.startswith("fsdp") for p in peers):
        extra.append("torch.distributed.fsdp")
    testing.PRELOAD.extend(m for m in extra if m not in testing.PRELOAD)


def run_bench(
    *,
    world_size: int = 2,
    preset: str = "small",
    peers: list[str] | None = None,
    steps: int = 10,
    rounds: int = 6,
    warmup: int = 2,
    batch: int = 16,
    bucket_size: int | None = None,
    dtype: str = "fp32",
) -> dict:
    """Run every peer (default: ``default_peers()``) on ``world_size`` local ranks, ``rounds``
    times each; return a JSON-ready result."""
    peers = peers or default_peers()
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; known: {sorted(PEERS)}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    _preload(preset, peers)
    sessions: dict[str, list[list[dict]]] = {name: [] for name in peers}
    for r in range(rounds):
        for name in peers[r % len(peers) :] + peers[: r % len(peers)]:
            progress(f"round {r + 1}/{rounds}: {name} ...", end="")
            per_rank = run_distributed(
                _peer_session,
                world_size,
                name,
                preset,
                steps,
                warmup,
                batch,
                bucket_size,
                dtype,
                timeout=1800,
            )
            sessions[name].append(per_rank)
            progress(f" {_step_median(per_rank) * 1e3:.1f} ms/step, loss {per_rank[0]['final_loss']:.4f}")
    results = {name: _summarize(runs) for name, runs in sessions.items()}
    numel = sum(p.numel() for p in build_model(preset)[0].parameters())
    compute = plan.DTYPE_BYTES[dtype]  # (params are gathered in the compute dtype, grads reduced in fp32)
    for name, row in results.items():
        row["theory_bytes_per_step"] = theory_bytes(name, world_size, 4 * numel, compute * numel)
    ddp = results.get("ddp", {}).get("median_step_s")
    for name, row in results.items():
        row["ratio_to_ddp"] = row["median_step_s"] / ddp if ddp else None
        row["ratio_to_ddp_by_round"] = (
            [_step_median(a) / _step_median(b) for a, b in zip(sessions[name], sessions["ddp"], strict=True)]
            if ddp
            else None
        )
    threads = sessions[peers[0]][0][0]["threads"]
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {threads} torch thread(s)/rank, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}",
        "world_size": world_size,
        "model": preset,
        "dtype": dtype,
        "params": numel,
        "steps_per_round": steps,
        "rounds": rounds,
        "batch_per_rank": batch,
        "peers": results,
    }


def progress(text: str, end: str = "\n") -> None:
    """A line of progress on stderr (the table and the JSON path go to stdout)."""
    sys.stderr.write(text + end)
    sys.stderr.flush()


def _step_times(per_rank: list[dict]) -> list[float]:
    """One round's step times: each step as slow as its slowest rank."""
    return [max(ts) for ts in zip(*(r["step_times"] for r in per_rank), strict=True)]


def _step_median(per_rank: list[dict]) -> float:
    return statistics.median(_step_times(per_rank))


def _summarize(runs: list[list[dict]]) -> dict:
    """One peer's rounds (each a list of per-rank results) in one line of the table."""
    return {
        "median_step_s": statistics.median(t for per_rank in runs for t in _step_times(per_rank)),
        "final_loss": runs[-1][0]["final_loss"],
        "final_losses_agree_across_rounds": len({per_rank[0]["final_loss"] for per_rank in runs}) == 1,
        "model_state_bytes": _worst(runs, lambda r: r["model_state_bytes"]),
        "rss_bytes": _worst(runs, lambda r: r["rss_bytes"]),
        "rss_growth_bytes": _worst(runs, _rss_growth),
        "sent_bytes_per_step": _worst(runs, lambda r: r["sent_bytes_per_step"]),
    }


def _rss_growth(rank_result: dict) -> int | None:
    rss = rank_result["rss_bytes"]
    return None if rss is None else rss - rank_result["rss_base_bytes"]


def _worst(runs: list[list[dict]], value) -> int | None:
    """The median over rounds of the largest ``value`` of any rank (None where not counted)."""
    values = [max(value(r) for r in per_rank) for per_rank in runs if value(per_rank[0]) is not None]
    return int(statistics.median(values)) if values else None


def format_table(result: dict) -> str:
    width = max(16, *(len(name) for name in result["peers"]))
    lines = [
        f"{result['model']} ({result['params']:,} params, {result.get('dtype', 'fp32')}), "
        f"{result['world_size']} ranks, {result['rounds']} rounds x {result['steps_per_round']} steps, "
        f"{result['date']},",
        f"  {result['machine']}",
        f"{'peer':<{width}} {'median step':>12} {'vs DDP':>7} {'by round':>12} {'model state':>13} "
        f"{'RSS (growth)':>22} {'sent/step':>13} {'theory':>13} {'final loss':>11}",
    ]
    for name, r in result["peers"].items():
        ratio = "-" if r["ratio_to_ddp"] is None else f"{r['ratio_to_ddp']:.3f}"
        by_round = r.get("ratio_to_ddp_by_round")
        spread = f"{min(by_round):.2f}-{max(by_round):.2f}" if by_round else "-"
        rss = "-" if r["rss_bytes"] is None else f"{mib(r['rss_bytes'])} ({mib(r['rss_growth_bytes'])})"
        lines.append(
            f"{name:<{width}} {r['median_step_s'] * 1e3:>9.1f} ms {ratio:>7} {spread:>12} "
            f"{mib(r['model_state_bytes']):>13} {rss:>22} {mib(r['sent_bytes_per_step']):>13} "
            f"{mib(r.get('theory_bytes_per_step')):>13} {r['final_loss']:>11.4f}"
        )
    lines.append(
        "by round: the lowest and highest ratio of a round's median step to DDP's in the same round; "
        "model state: params, grads, main params and optimizer state resident per rank (- where it "
        "cannot be counted from outside); RSS after the timed steps (growth from before the model was "
        "built); sent: bytes the rank wrote to its sockets per step; theory: what the peer's ring "
        "collectives must send (flatshard.app.peers.RING_UNITS; stage 3 keeps some units gathered)"
    )
    return "\n".join(lines)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def add_arguments(parser, *, default_out: str, peers: list[str] | None = None) -> None:
    """The options of ``flatshard bench`` and of the scripts in ``benchmarks/``."""
    parser.add_argument("--world-size", "-n", type=int, default=2, help="ranks (default 2)")
    parser.add_argument(
        "--model",
        default="small",
        help=f"a GPT preset ({', '.join(PRESETS)}; default small), hf:TYPE (a tiny transformers "
        "causal LM), a save_pretrained directory or config.json, or module:function (an nn.Module "
        "whose forward(tokens, targets) returns the loss, with a cfg or config giving vocab_size "
        "and seq_len or max_position_embeddings)",
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        default=peers,
        choices=list(PEERS),
        metavar="PEER",
        help=f"systems to compare (default: {' '.join(peers or default_peers())}); known: {' '.join(PEERS)}",
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per peer per round (default 10)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds, each peer once per round (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before each timing (default 2)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank per step (default 16)")
    parser.add_argument(
        "--bucket-size", type=int, default=None, help="elements per bucket (default: each's own)"
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="compute dtype (default fp32); bf16 runs every peer in mixed precision as its users "
        "do: fp32 (main) params, bf16 compute (DDP: autocast, FSDP2: MixedPrecisionPolicy, "
        "DeepSpeed: bf16, flatshard: MixedPrecision)",
    )
    parser.add_argument("--out", default=default_out, help=f"JSON file to write (default {default_out})")


def bench_main(args) -> None:
    """Run what ``add_arguments`` parsed: print the table, write the JSON."""
    result = run_bench(
        world_size=args.world_size,
        preset=args.model,
        peers=args.peers,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        batch=args.batch,
        bucket_size=args.bucket_size,
        dtype=args.dtype,
    )
    print(format_table(result))
    write_json(result, args.out)
    print(f"wrote {args.out}")


def script_main(doc: str, peers: dict[str, Peer], default_out: str, argv: list[str] | None = None) -> None:
    """The command line of the scripts in ``benchmarks/``: run ``peers``, print, write JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, default_out=default_out, peers=list(peers))
    bench_main(parser.parse_args(argv))
