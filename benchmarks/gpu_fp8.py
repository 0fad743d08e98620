"""GPU.md item 2, fp8 (needs CUDA; not part of the suite):

    PYTHONPATH=src python benchmarks/gpu_fp8.py OUT_DIR [PART ...] [--dry-run]

The Llama-3-8B-shaped model of ``gpu_showcase.py`` (bf16 params and grads, the 4-byte
optimizer state, one GPU, stage 2, sequence 8192) trained ``STEPS`` steps on the same batches
by each PART, each in its own process under its own deadline, writing
``OUT_DIR/gpu-fp8-PART.json``:

- ``bf16-compiled``, ``fp8-compiled``: each decoder layer compiled (torchtitan's setup), with
  its linears in bf16, or converted to torchao's float8 training (tensorwise scaling, real fp8
  matmuls; ``toolkit.models.float8.float8_linears``, the output head left in bf16): tokens/s,
  MFU (bf16's dense peak, as torchtitan divides), peak memory and the losses. torchtitan's
  published gain for the same model on 8 H100s is 5,760 -> 7,186 tokens/s a GPU. One GPU gathers
  nothing, so this measures fp8 training under flatshard, not fp8 gathers (their bytes are
  counted on the CPU: ``benchmarks/fp8_gathers.py``).
- ``adamw8bit``: torchao's ``AdamW8bit`` over block-aligned shards ([Note: blockwise state]),
  fp32 grads and main params (a low-bit class steps per param), a few steps: the device's
  peak and held memory beside ``memory_report`` and the plan.
- ``bf16``, ``fp8``: the same as the first two, uncompiled (last: the compiled pair is the
  comparison that matters).

``--dry-run`` runs every part on the CPU with a two-layer narrow Llama, fp8 matmuls emulated
and layers compiled on dynamo's aot_eager backend.
"""

from __future__ import annotations

import torch

from gpu_parts import drive, write_result
from gpu_showcase import (
    BF16,
    CUDA,
    DRY,
    SEQ,
    TITAN,
    MarkovTokens,
    _build,
    _dims,
    _flops_per_token,
    _mem,
    _release,
    _timed,
    warm_then_timed,
)

WARMUP, STEPS = (1, 2) if DRY else (2, 30)
DEADLINES = {"bf16-compiled": 360, "fp8-compiled": 360, "adamw8bit": 240, "bf16": 240, "fp8": 240}
HYPER = {"lr": 3e-4, "weight_decay": 0.1}


def _trained(fp8: bool, compiled: bool) -> dict:
    import flatshard
    from flatshard.toolkit.models.float8 import float8_linears

    model = _build(BF16)
    flops = _flops_per_token(model)  # (of the bf16 model: the same FLOPs, as torchtitan counts them)
    if fp8:
        float8_linears(model, emulate=not CUDA)
    if compiled:
        for layer in model.model.layers:
            layer.compile(backend="inductor" if CUDA else "aot_eager")
    precision = flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16)
    model = flatshard.shard(model, stage=2, mixed_precision=flatshard.MixedPrecision(BF16, grad_dtype=BF16))
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=precision, **HYPER)
    _release()
    corpus = MarkovTokens(_dims()["vocab_size"], SEQ)
    out: dict = {"fp8": fp8, "compiled": compiled, "flops_per_token": flops}
    out |= warm_then_timed(model, opt, corpus, flops, WARMUP, STEPS)  # (warm-up compiles)
    r = out["steps"]
    print(
        f"{'fp8' if fp8 else 'bf16'}{' compiled' if compiled else ''}: step {r['step_ms']:.0f} ms, "
        f"{r['tokens_per_s']:.0f} tokens/s, MFU {r['mfu']:.1%}, last loss {r['losses'][-1]:.4f}",
        flush=True,
    )
    return out


def part_adamw8bit() -> dict:
    import torchao.optim

    import flatshard
    from flatshard.planner.plan import plan_from_specs
    from flatshard.toolkit.models import lm_loss
    from flatshard.wrap.specs import model_specs

    model = _build(BF16)  # (fp32 grads: a low-bit class steps per param, not the 4-byte path)
    mp = flatshard.MixedPrecision(BF16)
    model = flatshard.shard(model, stage=2, mixed_precision=mp, buckets=flatshard.Buckets(align=256))
    opt = flatshard.DistributedOptimizer(model, torchao.optim.AdamW8bit, **HYPER)
    _release()
    corpus = MarkovTokens(_dims()["vocab_size"], SEQ)
    out: dict = {"warmup": _timed(model, opt, corpus, 0, WARMUP)}
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    out["steps"] = _timed(model, opt, corpus, WARMUP, 3)
    out["memory"] = _mem()
    x, y = corpus.batch(WARMUP + 3)
    lm_loss(model, x, y).backward()  # (the state as planned: with a step's grads)
    out["report"] = flatshard.memory_report(model, opt).as_dict()
    out["held_with_grads"] = torch.cuda.memory_allocated() if CUDA else 0
    opt.zero_grad()
    try:
        with torch.device("meta"):
            meta = _build(BF16)
        plan = plan_from_specs(model_specs(meta), world_size=1, bucket_size=None, optimizer="adamw8bit")
        out["plan"] = plan[2].as_dict()
    except Exception as e:  # (the plan is a comparison, not the run)
        out["plan"] = f"{type(e).__name__}: {e}"
    print(f"adamw8bit: report {out['report']} memory {out['memory']}", flush=True)
    return out


PARTS = {
    "bf16-compiled": lambda: _trained(fp8=False, compiled=True),
    "fp8-compiled": lambda: _trained(fp8=True, compiled=True),
    "adamw8bit": part_adamw8bit,
    "bf16": lambda: _trained(fp8=False, compiled=False),
    "fp8": lambda: _trained(fp8=True, compiled=False),
}


def _one(part: str, path: str) -> None:
    write_result(path, part, CUDA, PARTS[part], model=_dims(), seq_len=SEQ, torchtitan=TITAN)


def main() -> None:
    drive(__file__, "gpu-fp8", list(PARTS), DEADLINES, _one, CUDA, DRY)


if __name__ == "__main__":
    main()
