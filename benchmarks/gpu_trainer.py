"""GPU.md item 1 (needs CUDA; not part of the suite): the Llama-3-8B-shaped model of
``gpu_showcase.py`` trained by a real ``transformers.Trainer`` on one GPU, world size 1, bf16,
with flatshard at stages 1-3 and with the Trainer's own FSDP2 and DeepSpeed options.

    PYTHONPATH=src python benchmarks/gpu_trainer.py OUT_DIR [PART ...] [--dry-run]

PARTs (default: all, in this order), each in its own process under its own deadline,
writing ``OUT_DIR/gpu-trainer-PART.json``:

- ``flatshard-3``, ``flatshard-2``, ``flatshard-1``: ``flatshard.hosts.hf.Trainer`` over the
  model sharded with ``MixedPrecision(bf16, grad_dtype=bf16)``, stepped by a
  ``DistributedOptimizer`` of torch's AdamW with ``OptimizerPrecision(bf16, bf16)`` passed as
  ``optimizers=`` (8 bytes a param: bf16 params, bf16 grads, bf16 main params and moments).
- ``fsdp2``: ``fsdp=True``, ``fsdp_config={"version": 2, ...}`` (full shard, a unit a layer) over the
  model built in bf16, ``bf16=False``: torch's AdamW steps the bf16 params directly
  (8 bytes a param too, but round-to-nearest updates).
- ``deepspeed-3``: ``deepspeed={ZeRO-3, bf16}`` with ``bf16=True``, the Trainer's documented
  recipe: fp32 main params, grads and AdamW state beside the bf16 params. At world size 1 the
  ZeRO stages hold the same bytes, so one stage stands for the three.
- ``fsdp2-mixed``: FSDP2 with ``bf16=True``, the Trainer's mixed-precision recipe (accelerate
  keeps fp32 params).

Each part builds the model on the GPU from its config (random init), trains ``WARMUP + STEPS``
steps of one 8192-token sequence and reports, from a callback that syncs at each step's
edges, the median step time with its range over the timed steps, tokens/s, MFU by
torchtitan's count (``gpu_showcase._flops_per_token``), the peak memory of the timed steps,
the bytes held after training, and the logged losses; or the error that stopped it (an
out-of-memory names its stage: build, Trainer, or the steps).

``--dry-run`` runs every part on the CPU (gloo, a two-layer narrow Llama); the DeepSpeed
part runs there when deepspeed imports (``DS_ACCELERATOR=cpu``), FSDP2 when accelerate
allows FSDP on CPU.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from gpu_parts import arguments, child_part, run_one_rank, run_parts, write_result
from gpu_showcase import (
    BF16,
    CUDA,
    DRY,
    HYPER,
    PEAK_FLOPS,
    SEQ,
    MarkovTokens,
    _build,
    _dims,
    _flops_per_token,
    _mem,
)

WARMUP, STEPS = (1, 2) if DRY else (2, 4)
DEADLINES = {
    "flatshard-3": 110,
    "fsdp2": 110,
    "flatshard-2": 100,
    "flatshard-1": 100,
    "deepspeed-3": 90,
    "fsdp2-mixed": 60,
}
EXTRA = {"flatshard-2-bf16-adamw": 100, "flatshard-3-bf16-adamw": 100}
"""Parts run only when named: flatshard stepping torch's fused AdamW on its bf16 params, as FSDP2 does."""
DEADLINES |= EXTRA


class _Sequences(torch.utils.data.Dataset):
    """``WARMUP + STEPS`` sequences of the Markov chain (labels = inputs: the model shifts)."""

    def __init__(self) -> None:
        corpus = MarkovTokens(_dims()["vocab_size"], SEQ)
        self.ids = [corpus.batch(i)[0][0].cpu() for i in range(WARMUP + STEPS)]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _clock():
    import transformers

    class Clock(transformers.TrainerCallback):
        """Step times (synced at each step's edges) and the peak of the steps after warm-up."""

        def __init__(self) -> None:
            self.ms: list[float] = []
            self.start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if CUDA:
                torch.cuda.synchronize()
                if state.global_step == WARMUP:
                    torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if CUDA:
                torch.cuda.synchronize()
            self.ms.append((time.perf_counter() - self.start) * 1e3)

    return Clock()


def _args(out: str, **overrides):
    import transformers

    settings = dict(
        output_dir=out,
        use_cpu=not CUDA,
        per_device_train_batch_size=1,
        max_steps=WARMUP + STEPS,
        learning_rate=HYPER["lr"],
        weight_decay=HYPER["weight_decay"],
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    return transformers.TrainingArguments(**{**settings, **overrides})


def _flatshard_trainer(stage: int, out: str, data, clock, low_precision_state: bool = True):
    import flatshard
    from flatshard.hosts import hf

    args = _args(out)
    assert args.device is not None  # (reading it starts the process group, as the Trainer would)
    mixed = flatshard.MixedPrecision(BF16, grad_dtype=BF16)
    model = flatshard.shard(_build(BF16), stage=stage, mixed_precision=mixed)
    if low_precision_state:
        precision = flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16)
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=precision, **HYPER)
    else:  # (torch's fused AdamW on the bf16 params, as under FSDP2)
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, fused=CUDA, **HYPER)
    return hf.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None), callbacks=[clock])


def _fsdp2_trainer(out: str, data, clock, mixed: bool):
    import transformers

    config = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    config["reshard_after_forward"] = True
    args = _args(out, fsdp=True, fsdp_config=config, bf16=mixed)
    return transformers.Trainer(model=_build(BF16), args=args, train_dataset=data, callbacks=[clock])


def _deepspeed_trainer(out: str, data, clock):
    import transformers

    auto = "auto"
    config = {
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": auto},
        "train_micro_batch_size_per_gpu": auto,
        "train_batch_size": auto,
        "gradient_accumulation_steps": auto,
        "gradient_clipping": auto,
    }
    args = _args(out, deepspeed=config, bf16=True)
    return transformers.Trainer(model=_build(BF16), args=args, train_dataset=data, callbacks=[clock])


def _trainer(part: str, out: str, data, clock):
    if part.startswith("flatshard-"):
        low = not part.endswith("-bf16-adamw")
        return _flatshard_trainer(int(part[len("flatshard-")]), out, data, clock, low)
    if part.startswith("fsdp2"):
        return _fsdp2_trainer(out, data, clock, mixed=part == "fsdp2-mixed")
    return _deepspeed_trainer(out, data, clock)


def _measure(part: str) -> dict:
    out: dict = {"warmup": WARMUP, "steps": STEPS}
    stage = "data"
    try:
        data = _Sequences()
        clock = _clock()
        stage = "build and Trainer"
        trainer = _trainer(part, f"/tmp/gpu-trainer-{part}", data, clock)
        out["optim"] = str(trainer.args.optim)
        out["after_build"] = _mem()
        stage = "steps"
        trainer.train()
        timed = clock.ms[WARMUP:]
        step = statistics.median(timed)
        flops = _flops_per_token(trainer.model)
        tokens_s = SEQ / (step / 1e3)
        out |= {"step_ms": step, "step_ms_range": [min(timed), max(timed)], "all_step_ms": clock.ms}
        out |= {"tokens_per_s": tokens_s, "mfu": tokens_s * flops / PEAK_FLOPS if CUDA else None}
        out["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        out["grad_norms"] = [e.get("grad_norm") for e in trainer.state.log_history if "loss" in e]
        out["result"] = "trained"
        out["wrapped"] = type(trainer.model_wrapped).__name__
        out["param_type"] = type(next(trainer.model.parameters())).__name__
    except torch.OutOfMemoryError as e:
        out["result"] = f"OutOfMemoryError in {stage}: {str(e)[:400]}"
    except Exception as e:  # (a peer that cannot run here is a row, not the end of the lease)
        out["result"] = f"{type(e).__name__} in {stage}: {str(e)[:600]}"
    out["memory"] = _mem()
    summary = {k: out.get(k) for k in ("result", "step_ms", "step_ms_range", "tokens_per_s", "mfu", "losses")}
    print(f"{part}: {summary} memory {out['memory']}", flush=True)
    return out


def _one(part: str, path: str) -> None:
    if not CUDA:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    write_result(path, part, CUDA, lambda: _measure(part), model=_dims(), seq_len=SEQ, batch=1)


def main() -> None:
    out_dir, parts = arguments([p for p in DEADLINES if p not in EXTRA])
    part = child_part(parts)
    if part is None:
        run_parts(__file__, out_dir, parts, DEADLINES, DRY)
        return
    path = os.path.join(out_dir, f"gpu-trainer-{part}.json")
    run_one_rank(_one, part, path, cuda=CUDA, timeout=DEADLINES[part], threads=4, init=False)


if __name__ == "__main__":
    sys.exit(main())
