"""GPU.md item 1, offload under a cap (needs CUDA; not part of the suite):

    PYTHONPATH=src python benchmarks/gpu_offload.py OUT_DIR [PART ...] [--dry-run]

PARTs (default: all, in this order), each in its own process under its own deadline, writing
``OUT_DIR/gpu-offload-PART.json``:

- ``check``: the copies this CPU machine cannot race, raced on a GPU. A small Llama at stages
  1-3 trained 4 steps with nothing offloaded, with ``Offload(step="device")`` (chunks small
  enough that several stream a step: uploads, steps and downloads on three streams) and with
  ``Offload()`` (asynchronous grad-shard copies down, asynchronous part copies up at each
  gather). fp32 params and torch's fused AdamW on the device: the streamed run must equal the
  unoffloaded one to the bit (the same kernel on the same values); the host step differs only
  by the CPU's kernel (a bound printed, not asserted here). A race shows as a mismatch. Each
  step also runs a forward under ``no_grad`` between the backward and the step, not waited
  for: its loss must be the step's own (a gather still reading a host frame the host step
  writes would see new weights).
- ``flatshard-host``, ``flatshard-device``, ``flatshard-budget``: the Llama-3-8B-shaped model
  (bf16 params and grads, the 4-byte optimizer state) on one GPU capped at ``CAP`` bytes
  (``torch.cuda.set_per_process_memory_fraction``), activation checkpointing on, at stage 3
  with ``Offload()`` (stepped on the host), ``Offload(step="device")`` (streamed), and
  ``Offload(device_budget=...)`` (the planner's units); tokens/s, MFU, the peak device memory,
  and the bytes over the host link a step against ``plan_from_specs``.
- ``fsdp2``: the same model in bf16 under the same cap with FSDP2's ``CPUOffloadPolicy`` (a
  ``fully_shard`` a decoder layer) and torch's AdamW stepping on the host.
- ``deepspeed``: DeepSpeed ZeRO-3 with ``offload_param`` and ``offload_optimizer`` to the
  CPU under the same cap, when DeepSpeed imports (the row says why not otherwise).

``--dry-run`` runs every part on the CPU with a two-layer narrow Llama and gloo (no cap).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from gpu_parts import drive, write_result
from gpu_showcase import (
    BF16,
    CUDA,
    DRY,
    MarkovTokens,
    _build,
    _dims,
    _flops_per_token,
    _mem,
    _rates,
    _release,
    warm_then_timed,
)

CAP = 24 * 10**9  # bytes the GPU may hold (GPU.md: "capped at 24 GB")
WARMUP, STEPS = (1, 2) if DRY else (1, 3)
DEADLINES = {"check": 120, "flatshard-host": 420, "flatshard-device": 420, "flatshard-budget": 420}
DEADLINES |= {"fsdp2": 420, "deepspeed": 420}
HYPER = {"lr": 3e-4, "weight_decay": 0.1}


def _cap() -> dict:
    """Cap the process's GPU memory at ``CAP`` (a CPU dry run has no cap)."""
    if not CUDA:
        return {}
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP / total))
    return {"cap": CAP, "total": total}


def _check_run(stage: int, offload) -> tuple[list[float], dict, float]:
    import flatshard
    from flatshard.toolkit.models import lm_loss, tiny_model

    torch.manual_seed(0)
    dims = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8}
    device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
    with device:
        model = tiny_model("llama", vocab_size=512, seq_len=128, num_key_value_heads=4, **dims)
    model = flatshard.shard(model, stage=stage, offload=offload)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, fused=True, **HYPER)
    corpus = MarkovTokens(512, 128)
    losses, evals = [], []
    for step in range(4):
        x, y = (t.to(device) for t in corpus.batch(step))
        loss = lm_loss(model, x, y)
        loss.backward()  # (no clipping: a norm summed on the host rounds unlike the device's)
        with torch.no_grad():  # (a forward between the backward and the step, not waited for:
            evals.append(lm_loss(model, x, y))  # its gathers read the host frames the step writes)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    model.wait_for_params()
    state = {k: v.float().cpu() for k, v in model.full_state_dict().items()}
    eval_diff = max(abs(float(e) - v) for e, v in zip(evals, losses, strict=True))
    return losses, state, eval_diff


def part_check() -> dict:
    import flatshard

    out: dict = {}
    for stage in (1, 2, 3):
        none = _check_run(stage, None)
        streamed = _check_run(stage, flatshard.Offload(step="device", stream_chunk=1 << 18))
        host = _check_run(stage, flatshard.Offload())
        diff = max((host[1][k] - v).abs().max().item() for k, v in none[1].items())
        out[str(stage)] = {
            "streamed_equal": streamed[0] == none[0]
            and all(torch.equal(streamed[1][k], v) for k, v in none[1].items()),
            "host_max_param_diff": diff,
            # (the same weights and batch with and without grad: a gather racing the host
            # step would show here as a step's change of the loss, ~1e-2)
            "eval_minus_train_loss": {"none": none[2], "streamed": streamed[2], "host": host[2]},
            "losses": {"none": none[0], "streamed": streamed[0], "host": host[0]},
        }
        print(f"check stage {stage}: {out[str(stage)]}", flush=True)
    return out


def _cap_model():
    """The capped job's model: bf16, activation checkpointing on."""
    model = _build(BF16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _flatshard_capped(offload_of) -> dict:
    import flatshard
    from flatshard.planner.plan import plan_from_specs
    from flatshard.wrap.specs import model_specs

    out: dict = {"cap": _cap()}
    model = _cap_model()
    flops = _flops_per_token(model)
    precision = flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16)
    mp = flatshard.MixedPrecision(BF16, grad_dtype=BF16)
    offload = offload_of(model)
    model = flatshard.shard(model, stage=3, mixed_precision=mp, offload=offload)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=precision, **HYPER)
    out["offload"] = repr(opt.offload)
    _release()
    corpus = MarkovTokens(_dims()["vocab_size"], _seq())
    stats = model.comm_stats
    out |= warm_then_timed(model, opt, corpus, flops, WARMUP, STEPS, before=stats.reset)
    link = sum(stats.payload_bytes[op] for op in ("host_to_device", "device_to_host"))
    out["link_bytes_per_step"] = link / STEPS
    out["report"] = flatshard.memory_report(model, opt).as_dict()
    try:
        with torch.device("meta"):
            meta = _build(BF16)
        specs = model_specs(meta)
        streamed = opt.offload is not None and opt.offload.step == "device"
        plan = plan_from_specs(
            specs,
            world_size=1,
            bucket_size=None,
            precision=precision,
            offload=True,
            streamed=streamed,
            stage3_specs=model_specs(meta, stage=3),
        )
        out["plan"] = plan[3].as_dict()
    except Exception as e:  # (the plan is a comparison, not the run)
        out["plan"] = f"{type(e).__name__}: {e}"
    print(f"flatshard {out['offload']}: {out['steps']} link {link / STEPS:.3g} B/step", flush=True)
    return out


def _seq() -> int:
    return 256 if DRY else 4096


def part_fsdp2() -> dict:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    out: dict = {"cap": _cap()}
    model = _cap_model()
    flops = _flops_per_token(model)
    policy = CPUOffloadPolicy(pin_memory=CUDA)
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    _release()
    corpus = MarkovTokens(_dims()["vocab_size"], _seq())
    out |= warm_then_timed(model, opt, corpus, flops, WARMUP, STEPS)
    print(f"fsdp2 CPUOffloadPolicy: {out['steps']}", flush=True)
    return out


def part_deepspeed() -> dict:
    try:
        import deepspeed
    except Exception as e:  # (not installed on the lent machine, or its op does not build)
        return {"result": f"DeepSpeed does not import: {type(e).__name__}: {e}"}
    out: dict = {"cap": _cap()}
    model = _cap_model()
    flops = _flops_per_token(model)
    pin = CUDA
    zero = {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": pin}}
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": zero}
    config["optimizer"] = {"type": "AdamW", "params": HYPER}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    corpus = MarkovTokens(_dims()["vocab_size"], _seq())

    def step(i: int) -> tuple[float, float]:
        x, y = corpus.batch(i)
        if CUDA:
            torch.cuda.synchronize()
        start = time.perf_counter()
        logits = engine(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        engine.backward(loss)
        engine.step()
        if CUDA:
            torch.cuda.synchronize()
        return loss.item(), (time.perf_counter() - start) * 1e3

    try:
        for i in range(WARMUP):
            step(i)
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        runs = [step(WARMUP + i) for i in range(STEPS)]
        ms = sorted(r[1] for r in runs)
        out["steps"] = {
            "losses": [r[0] for r in runs],
            "step_ms": ms[len(ms) // 2],
            "step_ms_range": [ms[0], ms[-1]],
        }
        out["steps"] |= _rates(out["steps"], flops)
        out["result"] = "trained"
    except torch.OutOfMemoryError as e:
        out["result"] = f"OutOfMemoryError: {str(e)[:300]}"
    out["memory"] = _mem()
    print(f"deepspeed ZeRO-3 offload: {out.get('steps', out['result'])}", flush=True)
    return out


def _budget(model) -> object:
    import flatshard

    return flatshard.Offload(device_budget=CAP // 2)  # (half the cap for model state: the rest activations)


PARTS = {
    "check": part_check,
    "flatshard-host": lambda: _flatshard_capped(lambda m: __import__("flatshard").Offload()),
    "flatshard-device": lambda: _flatshard_capped(lambda m: __import__("flatshard").Offload(step="device")),
    "flatshard-budget": lambda: _flatshard_capped(_budget),
    "fsdp2": part_fsdp2,
    "deepspeed": part_deepspeed,
}


def _one(part: str, path: str) -> None:
    write_result(path, part, CUDA, PARTS[part], model=_dims(), seq_len=_seq(), cap=CAP)
    if part == "check":  # (a mismatch fails the part: the lease's log shows it at once)
        with open(path) as f:
            result = json.load(f)
        broken = [stage for stage in ("1", "2", "3") if not result[stage]["streamed_equal"]]
        if broken:
            raise AssertionError(f"the streamed step left other params than no offload at stages {broken}")


def main() -> None:
    drive(__file__, "gpu-offload", list(PARTS), DEADLINES, _one, CUDA, DRY)


if __name__ == "__main__":
    sys.exit(main())
