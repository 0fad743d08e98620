"""The precision-aware AdamW step alone ([Note: fused Adam step]): bf16 params, bf16 grads,
bf16 moments, on one run of N elements, beside torch's own AdamW over a bf16 param of the same
size; then where the time of a whole ``DistributedOptimizer.step`` goes on a two-layer
Llama-3-8B-wide model (world size 1, stage 2, the showcase's settings), by the profiler.

    PYTHONPATH=src python benchmarks/fused_adam.py OUT.json [--dry-run]

Rows (median ms of ``REPEATS`` calls, CUDA events on a GPU, wall clock on the CPU):
``torch-fused`` (``AdamW(fused=True)`` on the GPU, torch's default on the CPU; round to
nearest), ``fused-compiled`` (``adam_chunk`` compiled, one call), ``fused-eager``
(``adam_chunk`` uncompiled), ``noise-compiled`` (the rounding bits alone, summed),
``optimizer-fused`` and ``optimizer-chunked`` (``PrecisionAwareOptimizer.step`` over the run,
fused and ``fused=False``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

DRY = "--dry-run" in sys.argv or not torch.cuda.is_available()
DEV = torch.device("cpu" if DRY else "cuda")
N = (1 << 20) if DRY else (1 << 28)
REPEATS = 3 if DRY else 5
BF16 = torch.bfloat16


def _sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, repeats: int = REPEATS) -> dict:
    fn()  # (warm: compiles, allocates)
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - start) * 1000)
    return {"ms": statistics.median(times), "range": [min(times), max(times)]}


def _rows() -> dict:
    from flatshard import OptimizerPrecision
    from flatshard.optim import fused_adam
    from flatshard.optim.precision import PrecisionAwareOptimizer
    from flatshard.optim.rounding import noise, salt

    torch.manual_seed(0)
    p = torch.randn(N, device=DEV).to(BF16)
    g = (torch.randn(N, device=DEV) * 1e-3).to(BF16)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    halves = [half for k in fused_adam.STATE_KEYS for half in salt(0, 1, 0, 0, k)]
    ints = torch.tensor([0, *halves], device=DEV)
    group = {
        "lr": 3e-4,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "decoupled_weight_decay": True,
    }
    hyper = torch.tensor(fused_adam.scalars(group, 3), device=DEV)
    compiled = fused_adam.compiled_adam_chunk()
    rows: dict = {}
    ref = torch.nn.Parameter(p.clone())
    ref.grad = g.clone()
    torch_opt = torch.optim.AdamW([ref], lr=3e-4, weight_decay=0.1, **({} if DRY else {"fused": True}))
    rows["torch-fused"] = _time(torch_opt.step)
    rows["fused-compiled"] = _time(lambda: compiled(p, g, m, v, ints, hyper, 0.0, False))
    rows["fused-eager"] = _time(lambda: fused_adam.adam_chunk(p, g, m, v, ints, hyper, 0.0, False), 2)
    index_sum = torch.compile(lambda n: noise(torch.arange(n, device=DEV), ints[1:3]).sum(), dynamic=True)
    rows["noise-compiled"] = _time(lambda: index_sum(N))
    grads = {id(p): g}
    precision = OptimizerPrecision(BF16, BF16)
    opt = PrecisionAwareOptimizer(torch.optim.AdamW, [{"params": [p]}], {"lr": 3e-4}, precision, grads)
    rows["optimizer-fused"] = _time(opt.step)
    opt.fused = False
    rows["optimizer-chunked"] = _time(opt.step, 2)
    from torch._dynamo.utils import counters

    rows["dynamo"] = {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "recompiles")}
    return rows


def _profile() -> str:
    """The profiler's top ops of one whole ``DistributedOptimizer.step`` (stage 2, world 1)."""
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import flatshard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo" if DRY else "nccl", rank=0, world_size=1)
    width = 256 if DRY else 4096
    cfg = LlamaConfig(
        vocab_size=1024 if DRY else 128256,
        hidden_size=width,
        intermediate_size=width * 7 // 2,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
    )
    with torch.device(DEV):
        model = LlamaForCausalLM(cfg).to(BF16)
    mp = flatshard.MixedPrecision(BF16, grad_dtype=BF16)
    model = flatshard.shard(model, stage=2, mixed_precision=mp)
    opt = flatshard.DistributedOptimizer(
        model,
        torch.optim.AdamW,
        precision=flatshard.OptimizerPrecision(BF16, BF16),
        lr=3e-4,
        weight_decay=0.1,
    )
    x = torch.randint(0, cfg.vocab_size, (1, 512), device=DEV)
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model(input_ids=x, labels=x).loss.backward()
    _sync()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [] if DRY else [torch.profiler.ProfilerActivity.CUDA]
    )
    with torch.profiler.profile(activities=activities) as prof:
        opt.step()
        _sync()
    key = "self_cpu_time_total" if DRY else "self_device_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    dist.destroy_process_group()
    return table + "\n" + cpu


def main() -> None:
    out = sys.argv[1]
    result = {
        "device": torch.cuda.get_device_name() if not DRY else "cpu",
        "torch": torch.__version__,
        "n": N,
    }
    result |= _rows()
    for name, row in result.items():
        if isinstance(row, dict) and "ms" in row:
            print(
                f"{name:18s} {row['ms']:9.2f} ms  ({row['range'][0]:.2f}-{row['range'][1]:.2f})", flush=True
            )
    print("dynamo", result["dynamo"], flush=True)
    result["profile"] = _profile()
    print(result["profile"], flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
