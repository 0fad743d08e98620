"""The GPU checks of one lease, in one command (needs CUDA; not part of the suite):
``PYTHONPATH=src python benchmarks/gpu_checks.py OUT_DIR [PART ...]`` with PARTs among
``step memory hybrid desync generate`` (default: all). ``--dry-run`` runs every part on the
CPU with tiny sizes and gloo, to catch a script error before spending device time.

Each part runs in its own process group, under its own deadline, and writes
``OUT_DIR/gpu-PART.json`` when it ends, so one that fails or runs out of time costs only itself.

- ``step``: world size 1 on NCCL, fp32 and bf16, the benchmark GPT: flatshard stages 0-3
  against plain training with the same optimizer (torch's AdamW, bf16 under autocast), FSDP2
  and DeepSpeed ZeRO-1/2/3 when it imports. Peers are built together, then take turns in
  rounds whose order rotates; a round's time comes from CUDA events around its steps, with no
  host sync inside; a peer's figure is the median of its per-round ratios to plain, with
  their spread.
- ``memory``: each stage alone (fp32 and bf16): the bytes held after a step
  (``memory_allocated``) against ``memory_report`` and ``plan_from_specs``, and the peak
  and reserved memory of a step against plain training's.
- ``hybrid``: under ``torch.cuda.set_per_process_memory_fraction``, a GPT whose AdamW
  state does not fit beside its params: plain AdamW runs out of memory, stage 2 with
  ``HybridDeviceOptimizer(offload_fraction=1.0)`` trains and follows uncapped plain AdamW's
  losses; the step with overlapped copies against one host step after every copy, and, from
  a profiler trace, how much of the copies' time overlaps the host's update.
- ``desync``: two ranks sharing the GPU over gloo with CUDA tensors; rank 1 skips a backward
  (stages 2 and 3): both must raise ``DesyncError`` naming the ranks within the deadline.
- ``generate``: a Llama built from a config, stage 3, greedy tokens against the unsharded
  model's and the time per token of each (world size 1 on NCCL).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from gpu_parts import arguments, child_part, run_one_rank, run_parts, write_result

DRY = "--dry-run" in sys.argv
CUDA = torch.cuda.is_available() and not DRY
DEADLINES = {"step": 200, "memory": 90, "hybrid": 120, "generate": 75, "desync": 45}


def _dev() -> torch.device:
    return torch.device("cuda", 0) if CUDA else torch.device("cpu")


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _gpt_config():
    from flatshard.toolkit.models import PRESETS, GPTConfig

    if DRY:
        return PRESETS["small"]
    return GPTConfig(vocab_size=32768, seq_len=1024, d_model=1024, n_layers=12, n_heads=16)


# -- step ------------------------------------------------------------------------------------
BATCH = 2 if DRY else 8
ROUNDS, STEPS, WARMUP = (3, 2, 2) if DRY else (6, 5, 3)


def _plain(model, bucket_size, compute):
    from flatshard.app.peers import ADAMW, Trainer

    return Trainer(model, torch.optim.AdamW(model.parameters(), **ADAMW), None, autocast=compute)


def _peers() -> dict:
    from flatshard.app import peers

    chosen = {"plain": _plain, "fsdp2": peers.PEERS["fsdp2-zero3"]}
    chosen.update({f"flatshard-{s}": peers.PEERS[f"flatshard-{s}"] for s in range(4)})
    chosen["flatshard-3-no-reshard"] = peers.PEERS["flatshard-3-no-reshard"]
    if CUDA and peers.deepspeed_installed():
        chosen.update(peers.DEEPSPEED_PEERS)
    return chosen


def _run_steps(trainer, data, zero_last: bool = True) -> list[torch.Tensor]:
    """The steps of ``trainer`` on ``data``, losses kept on the device (no host sync);
    ``zero_last=False`` keeps the last step's grads."""
    losses = []
    for i, (x, y) in enumerate(data):
        if trainer.engine is not None:
            loss = trainer.engine(x, y)
            trainer.engine.backward(loss)
            trainer.engine.step()
        else:
            with torch.autocast(
                x.device.type, dtype=trainer.autocast or torch.float32, enabled=trainer.autocast is not None
            ):
                loss = trainer.model(x, y)
            loss.backward()
            trainer.optimizer.step()
            if zero_last or i < len(data) - 1:
                trainer.optimizer.zero_grad()
        losses.append(loss.detach().float())
    return losses


def _timed(trainer, data) -> tuple[float, list[float]]:
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if CUDA else (None, None)
    _sync()
    t0 = time.perf_counter()
    if CUDA:
        start.record()
    losses = _run_steps(trainer, data)
    if CUDA:
        end.record()
    _sync()
    ms = start.elapsed_time(end) if CUDA else (time.perf_counter() - t0) * 1e3
    return ms / len(data), [float(v) for v in losses]


def _batches(corpus, first: int, count: int):
    return [tuple(t.to(_dev()) for t in corpus.batch(i, 0, BATCH)) for i in range(first, first + count)]


def part_step() -> dict:
    from flatshard.toolkit.data import SyntheticCorpus
    from flatshard.toolkit.models import GPT

    cfg = _gpt_config()
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    out: dict = {"config": vars(cfg), "batch": BATCH, "rounds": ROUNDS, "steps_per_round": STEPS}
    for dtype in ("fp32", "bf16"):
        compute = torch.bfloat16 if dtype == "bf16" else None
        entries = {}
        for name, peer in _peers().items():
            torch.manual_seed(0)
            try:
                trainer = peer(GPT(cfg).to(_dev()), None, compute)
                _, losses = _timed(trainer, _batches(corpus, 0, WARMUP))
            except Exception as e:  # report it, go on with the others
                print(f"step {dtype} {name}: ERROR {type(e).__name__}: {str(e)[:600]}", flush=True)
                out.setdefault("errors", {})[f"{dtype}/{name}"] = f"{type(e).__name__}: {str(e)[:600]}"
                continue
            entries[name] = {"trainer": trainer, "times": [], "losses": losses}
        names = list(entries)
        for r in range(ROUNDS):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                e = entries[name]
                ms, losses = _timed(e["trainer"], _batches(corpus, WARMUP + r * STEPS, STEPS))
                e["times"].append(ms)
                e["losses"] += losses
        out[dtype] = _step_rows(entries, dtype)
        del entries
        _release()
    return out


def _step_rows(entries: dict, dtype: str) -> dict:
    base = entries["plain"]
    rows = {}
    print(f"\nstep, {dtype}: {'peer':24s} {'ms':>7s} {'x plain':>8s} {'rounds':>13s} {'|dloss| 10':>10s}")
    for name, e in entries.items():
        ratios = [t / b for t, b in zip(e["times"], base["times"], strict=True)]
        dloss = max(abs(a - b) for a, b in zip(e["losses"][:10], base["losses"][:10], strict=True))
        rows[name] = {
            "step_ms": statistics.median(e["times"]),
            "ratio_to_plain": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
            "max_loss_diff_first_10": dloss,
            "final_loss": e["losses"][-1],
            "losses": e["losses"],
        }
        row = rows[name]
        print(
            f"step, {dtype}: {name:24s} {row['step_ms']:7.1f} {row['ratio_to_plain']:8.3f} "
            f"{min(ratios):6.3f}-{max(ratios):.3f} {dloss:10.2e}",
            flush=True,
        )
    return rows


# -- memory ----------------------------------------------------------------------------------
def _planned(model_cfg, stage: int, dtype: torch.dtype) -> dict:
    from flatshard.planner.plan import plan_from_specs
    from flatshard.toolkit.models import GPT
    from flatshard.wrap.specs import model_specs

    with torch.device("meta"):
        meta = GPT(model_cfg).to(dtype)
    specs, stage3 = model_specs(meta), model_specs(meta, stage=3)
    plans = plan_from_specs(specs, world_size=1, bucket_size=None, optimizer="adamw", stage3_specs=stage3)
    return plans[stage].as_dict()


def part_memory() -> dict:
    from flatshard.memory import memory_report
    from flatshard.toolkit.data import SyntheticCorpus
    from flatshard.toolkit.models import GPT

    cfg = _gpt_config()
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    data = _batches(corpus, 0, 3)
    out: dict = {}
    peers = _peers()
    for dtype in ("fp32", "bf16"):
        compute = torch.bfloat16 if dtype == "bf16" else None
        for name in ("plain", "flatshard-0", "flatshard-1", "flatshard-2", "flatshard-3"):
            _release()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() if CUDA else 0
            torch.manual_seed(0)
            trainer = peers[name](GPT(cfg).to(_dev()), None, compute)
            _run_steps(trainer, data[:2])
            _sync()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            _run_steps(trainer, data[2:], zero_last=False)  # (measured with its grads, as planned)
            _sync()
            row = {"held_bytes": (torch.cuda.memory_allocated() if CUDA else 0) - before}
            if CUDA:
                row["peak_bytes"] = torch.cuda.max_memory_allocated() - before
                row["reserved_bytes"] = torch.cuda.memory_reserved()
            if name != "plain":
                model = trainer.model
                if hasattr(model, "wait_for_params"):
                    model.wait_for_params()  # (stage 3: what the step prefetched is not state)
                row["report"] = memory_report(model, trainer.optimizer).as_dict()
                row["plan"] = _planned(cfg, int(name[-1]), compute or torch.float32)
                row["held_after_wait_bytes"] = (torch.cuda.memory_allocated() if CUDA else 0) - before
            out[f"{dtype}/{name}"] = row
            _print_memory(f"{dtype}/{name}", row)
            del trainer
    return out


def _print_memory(name: str, row: dict) -> None:
    mib = lambda b: f"{b / 2**20:9.1f}" if b is not None else "        -"  # noqa: E731
    report = row.get("report", {}).get("total")
    plan = row.get("plan", {}).get("bytes_per_rank")
    print(
        f"memory {name:20s} held {mib(row['held_bytes'])} MiB  report {mib(report)}  plan {mib(plan)}  "
        f"peak {mib(row.get('peak_bytes'))}  reserved {mib(row.get('reserved_bytes'))}",
        flush=True,
    )


# -- hybrid ----------------------------------------------------------------------------------
HYBRID_STEPS = 5
ACTIVATIONS = 1 << 30  # what the cap leaves for activations and the allocator (bytes)


def part_hybrid() -> dict:
    """bf16 params and grads on the device (4 bytes a param); AdamW's fp32 master params and
    moments (12 bytes a param) on the host. The cap: the params, grads and ``ACTIVATIONS``,
    under the 8 bytes a param of the moments alone."""
    import flatshard
    from flatshard.app.peers import ADAMW, Trainer
    from flatshard.toolkit.data import SyntheticCorpus
    from flatshard.toolkit.models import GPT, PRESETS, GPTConfig

    cfg = (
        PRESETS["small"]
        if DRY
        else GPTConfig(vocab_size=32768, seq_len=512, d_model=1536, n_layers=12, n_heads=16)
    )
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    data = [tuple(t.to(_dev()) for t in corpus.batch(i, 0, 2)) for i in range(HYBRID_STEPS)]
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    out: dict = {"config": vars(cfg), "params": n, "adam_moment_bytes": 8 * n}

    def build(offload: float, overlap: bool = True) -> Trainer:
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # (built in bf16 on the device: fp32 would not fit the cap)
        try:
            with _dev():
                model = GPT(cfg)
        finally:
            torch.set_default_dtype(default)
        opt = flatshard.HybridDeviceOptimizer(
            model.parameters(),
            offload_fraction=offload,
            cpu_optimizer_class=torch.optim.AdamW,
            overlap=overlap,
            **ADAMW,
        )
        return Trainer(model, opt, None)

    def steps(trainer: Trainer) -> tuple[list[float], float]:
        timed = [_timed(trainer, [batch]) for batch in data]
        return [t[1][0] for t in timed], statistics.median(t[0] for t in timed[2:])

    out["device_losses"], out["device_step_ms"] = steps(build(0.0))  # uncapped reference
    _release()
    if CUDA:
        out["cap_bytes"] = cap = 4 * n + ACTIVATIONS
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        steps(build(0.0))
        out["device_capped"] = "trained"
    except torch.OutOfMemoryError as e:
        out["device_capped"] = f"OutOfMemoryError: {str(e)[:160]}"
    _release()
    for name, overlap in (("host", True), ("host-sync", False)):
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        trainer = build(1.0, overlap)
        losses, ms = steps(trainer)
        row = {
            "losses": losses,
            "step_ms": ms,
            "max_loss_diff": max(abs(a - b) for a, b in zip(losses, out["device_losses"], strict=True)),
        }
        if CUDA:
            row["peak_bytes"] = torch.cuda.max_memory_allocated()
        if overlap:
            row["trace"] = _trace_overlap(trainer, data[:2])
        out[name] = row
        del trainer
        _release()
    print("hybrid", json.dumps({k: v for k, v in out.items() if "losses" not in k}, default=str), flush=True)
    return out


def _release() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def _trace_overlap(trainer, data) -> dict:
    """From a profiler trace of two steps: the device-host copies' time, the host's AdamW
    steps, and how much of the copies' time runs during a host step (a copy hidden behind
    another param's update)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        _run_steps(trainer, data)
        _sync()
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "gpu-hybrid-trace.json")
        prof.export_chrome_trace(path)
        subprocess.run(["gzip", "-f", path], check=False)
    events = prof.events()
    copies = [
        (e.time_range.start, e.time_range.end)
        for e in events
        if "Memcpy" in e.name and ("DtoH" in e.name or "HtoD" in e.name)
    ]
    host = _merge(
        (e.time_range.start, e.time_range.end) for e in events if e.name.startswith("Optimizer.step#AdamW")
    )
    overlap = sum(max(0, min(ce, he) - max(cs, hs)) for cs, ce in copies for hs, he in host)
    return {
        "copies": len(copies),
        "copy_us": sum(e - s for s, e in copies),
        "host_steps_us": sum(e - s for s, e in host),
        "copy_us_during_host_steps": overlap,
    }


def _merge(intervals) -> list[list[float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


# -- desync ----------------------------------------------------------------------------------
def _skip_backward(stage: int) -> dict:
    import flatshard
    from flatshard.toolkit.data import SyntheticCorpus
    from flatshard.toolkit.models import GPT, PRESETS

    if CUDA:
        torch.cuda.set_device(0)
    cfg = PRESETS["small"]
    torch.manual_seed(0)
    rank = dist.get_rank()
    model = flatshard.shard(
        GPT(cfg).to(_dev()), stage=stage, buckets=flatshard.Buckets(size=3000), timeout=2.0
    )
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    start = time.monotonic()
    try:
        for step in range(3):
            x, y = (t.to(_dev()) for t in corpus.batch(step, rank, 4))
            loss = model(x, y)
            if not (rank == 1 and step == 1):
                loss.backward()
            opt.step()
            opt.zero_grad()
    except flatshard.DesyncError as e:
        return {"error": str(e)[:1500], "after_s": time.monotonic() - start}
    return {"error": None, "after_s": time.monotonic() - start}


def part_desync() -> dict:
    from flatshard.toolkit.testing import run_distributed

    out = {}
    for stage in (2, 3):
        res = run_distributed(
            _skip_backward, 2, stage, backend="cpu:gloo,cuda:gloo" if CUDA else "gloo", timeout=45
        )
        named = all(r["error"] is None or ("rank 0" in r["error"] and "rank 1" in r["error"]) for r in res)
        out[f"stage-{stage}"] = {"ranks": res, "raised": any(r["error"] for r in res), "names_ranks": named}
        print(
            f"desync stage {stage}: raised {out[f'stage-{stage}']['raised']}, names both ranks {named}, "
            f"after {[round(r['after_s'], 2) for r in res]} s",
            flush=True,
        )
    return out


# -- generate --------------------------------------------------------------------------------
def part_generate() -> dict:
    import flatshard
    from flatshard.toolkit.models import tiny_model

    dims = (
        {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2}
        if DRY
        else {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_attention_heads": 16,
            "num_hidden_layers": 8,
        }
    )
    torch.manual_seed(0)
    model = (
        tiny_model(
            "llama", vocab_size=32000, seq_len=2048, num_key_value_heads=4, initializer_range=0.1, **dims
        )
        .to(_dev())
        .eval()
    )
    prompt = torch.randint(1, 32000, (1, 16), generator=torch.Generator().manual_seed(1)).to(_dev())
    new = 8 if DRY else 64

    def timed_generate(m):
        m.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)  # warm-up
        _sync()
        t0 = time.perf_counter()
        tokens = m.generate(input_ids=prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new)
        _sync()
        return tokens[0, -new:].tolist(), (time.perf_counter() - t0) / new * 1e3

    expected, plain_ms = timed_generate(model)
    sharded = flatshard.shard(model, stage=3)
    got, sharded_ms = timed_generate(sharded)
    out = {
        "params": sum(p.numel() for p in model.parameters()),
        "new_tokens": new,
        "equal": got == expected,
        "plain_ms_per_token": plain_ms,
        "stage3_ms_per_token": sharded_ms,
        "expected": expected,
        "got": got,
    }
    print(
        f"generate: tokens equal {out['equal']}, ms/token plain {plain_ms:.2f}, stage 3 {sharded_ms:.2f}",
        flush=True,
    )
    return out


# -- driver ----------------------------------------------------------------------------------
PARTS = {
    "step": part_step,
    "memory": part_memory,
    "hybrid": part_hybrid,
    "generate": part_generate,
    "desync": part_desync,
}


def _one(part: str, path: str) -> None:
    write_result(path, part, CUDA, PARTS[part])


def main() -> None:
    out_dir, parts = arguments(list(PARTS))
    part = child_part(parts)
    if part is None:
        run_parts(__file__, out_dir, parts, DEADLINES, DRY)
    elif part == "desync":  # (its own ranks)
        _one(part, os.path.join(out_dir, f"gpu-{part}.json"))
    else:
        threads = (os.cpu_count() or 1) if part == "hybrid" else 1
        path = os.path.join(out_dir, f"gpu-{part}.json")
        run_one_rank(_one, part, path, cuda=CUDA, timeout=DEADLINES[part], threads=threads)


if __name__ == "__main__":
    main()
