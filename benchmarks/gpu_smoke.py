"""GPU checks (not part of the suite, which runs on CPU): on a CUDA machine,
``PYTHONPATH=src python benchmarks/gpu_smoke.py one-rank|two-ranks OUT.json``.

``one-rank`` trains 30 steps on NCCL at world size 1 (stages 0-3, HybridDeviceOptimizer,
bf16) and ``two-ranks`` 8 steps with two ranks sharing GPU 0 over gloo with CUDA tensors
(stages 0-3, no reshard, a meta-device model, per-block compile); each prints step time, reserved memory
across the steps and the largest difference of its losses from DDP's."""

import json
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from flatshard.planner.mixed_precision import MixedPrecision
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, PRESETS
from flatshard.toolkit.testing import run_distributed

STEPS = 8


def _train(kind: str, stage: int, options: dict, steps: int = STEPS, preset: str = "small") -> dict:
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    cfg = PRESETS[preset]
    rank = dist.get_rank()
    corpus = SyntheticCorpus(cfg.vocab_size, cfg.seq_len)
    bf16 = options.pop("bf16", False)
    hybrid = options.pop("hybrid", None)
    meta = options.pop("meta", False)
    compiled = options.pop("compile", False)
    if meta:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg).to(dev)
    if kind == "ddp":
        m = DDP(model, device_ids=[0])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    else:
        if bf16:
            options["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16)
        if compiled:  # per-block, inductor
            for block in model.blocks:
                block.compile()
        m = flatshard.shard(model, stage=stage, **options)
        if hybrid is None:
            opt = flatshard.DistributedOptimizer(m, torch.optim.AdamW, lr=1e-3)
        else:
            opt = flatshard.DistributedOptimizer(
                m,
                flatshard.HybridDeviceOptimizer,
                offload_fraction=hybrid,
                cpu_optimizer_class=torch.optim.AdamW,
                lr=1e-3,
            )
    losses, reserved = [], []
    start = None
    for i in range(steps):
        if i == 2:
            torch.cuda.synchronize()
            start = time.perf_counter()
        x, y = corpus.batch(i, rank, 16)
        with torch.autocast("cuda", torch.bfloat16, enabled=bf16 and kind == "ddp"):
            loss = m(x.to(dev), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        reserved.append(torch.cuda.memory_reserved())
    torch.cuda.synchronize()
    return {
        "losses": losses,
        "step_ms": (time.perf_counter() - start) / (steps - 2) * 1e3,
        "reserved_mib": [r / 2**20 for r in reserved[1 :: max(1, steps // 4)]],
        "max_alloc_mib": torch.cuda.max_memory_allocated() / 2**20,
    }


def main(backend: str, world: int, cases: list[tuple[str, str, int, dict]], steps: int) -> None:
    out = {}
    for name, kind, stage, options in cases:
        try:
            res = run_distributed(_train, world, kind, stage, options, steps, backend=backend, timeout=300)
            out[name] = res[0]
            print(name, json.dumps({k: v for k, v in res[0].items() if k != "losses"}), flush=True)
            print("   losses", [round(v, 5) for v in res[0]["losses"]], flush=True)
        except Exception as e:  # report and go on
            out[name] = {"error": str(e)[-1500:]}
            print(name, "ERROR", str(e)[-1500:], flush=True)
    ref = out.get("ddp", {}).get("losses")
    for name, r in out.items():
        if ref and "losses" in r:
            diff = max(abs(a - b) for a, b in zip(r["losses"], ref, strict=True))
            print(f"{name:28s} max |loss - ddp| = {diff:.2e}")
    with open(sys.argv[2], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "two-ranks":
        cases = [
            ("ddp", "ddp", 0, {}),
            ("flatshard-0", "fs", 0, {}),
            ("flatshard-2", "fs", 2, {}),
            ("flatshard-3", "fs", 3, {}),
            ("flatshard-3-no-reshard", "fs", 3, {"stage3": flatshard.Stage3(reshard_after_forward=False)}),
            ("flatshard-3-meta", "fs", 3, {"meta": True, "sync_module_states": True}),
            ("flatshard-2-compile", "fs", 2, {"compile": True}),
            ("flatshard-3-compile", "fs", 3, {"compile": True}),
            ("flatshard-3-bf16-compile", "fs", 3, {"compile": True, "bf16": True}),
        ]
        main("cpu:gloo,cuda:gloo", 2, cases, STEPS)
    else:
        cases = [
            ("ddp", "ddp", 0, {}),
            ("flatshard-0", "fs", 0, {}),
            ("flatshard-2", "fs", 2, {}),
            ("flatshard-3", "fs", 3, {}),
            ("flatshard-3-hybrid-0.5", "fs", 3, {"hybrid": 0.5}),
            ("flatshard-2-hybrid-0.5", "fs", 2, {"hybrid": 0.5}),
            ("ddp-bf16", "ddp", 0, {"bf16": True}),
            ("flatshard-3-bf16", "fs", 3, {"bf16": True}),
            ("flatshard-3-bf16-hybrid", "fs", 3, {"bf16": True, "hybrid": 0.5}),
        ]
        main("nccl", 1, cases, 30)
