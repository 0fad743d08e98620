"""The showcase of GPU.md item 0 (needs CUDA; not part of the suite): a Llama-3-8B-shaped
model, built from its config with random init, trained on one GPU with bf16 params, bf16
grads and 4 bytes a param of optimizer state (bf16 main params and AdamW moments).

    PYTHONPATH=src python benchmarks/gpu_showcase.py OUT_DIR [PART ...] [--dry-run]

PARTs (default: all, in this order), each in its own process under its own deadline,
writing ``OUT_DIR/gpu-showcase-PART.json``:

- ``flatshard``: world size 1 on NCCL, stage 2, ``MixedPrecision(bf16, grad_dtype=bf16)``
  and ``OptimizerPrecision(bf16, bf16)``; batch 1 of 8192 tokens. Step time (CUDA events
  around forward+backward and around the optimizer step, no host sync inside), tokens/s and
  MFU by torchtitan's count (6 x the non-embedding params + 12 x layers x heads x head size x
  sequence a token, against 989 TFLOP/s of dense bf16), the held bytes against
  ``memory_report`` and ``plan_from_specs``, the peak of a step. The optimizer is timed on its
  chunked path (``fused=False``: widen each ``DEVICE_CHUNK`` to fp32, torch's AdamW, round back)
  and on its default, the fused Adam step ([Note: fused Adam step]), in the same run.
- ``plain-fp32``: the usual mixed-precision recipe without flatshard, fp32 params under bf16
  autocast with torch's AdamW (16 bytes a param before activations): where it runs out of
  memory, and after how many bytes.
- ``plain-bf16``: torch's AdamW stepping bf16 params directly (8 bytes a param, as flatshard
  here, but round-to-nearest updates: ``benchmarks/precision.py`` has its loss lag): the
  step time of the same model with no wrapper, for flatshard's overhead.

``--dry-run`` runs every part on the CPU with a two-layer narrow Llama and gloo.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import statistics
import sys
import time

import torch

from gpu_parts import drive, write_result

DRY = "--dry-run" in sys.argv
CUDA = torch.cuda.is_available() and not DRY
BF16 = torch.bfloat16
PEAK_FLOPS = 989e12  # dense bf16 of an H100/H200 SXM, the peak torchtitan's MFU divides by
TITAN = {"tokens_per_s_per_gpu": 5762, "mfu": 0.35, "setup": "Llama 3 8B, 8 H100s, FSDP, bf16, seq 8192"}
SEQ = 256 if DRY else 8192
BATCH = 1
WARMUP, STEPS = (1, 2) if DRY else (2, 5)
DEADLINES = {"flatshard": 240, "plain-fp32": 60, "plain-bf16": 100}
HYPER = {"lr": 3e-4, "weight_decay": 0.1}

LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}
DRY_DIMS = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 224}
DRY_DIMS |= {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def _dev() -> torch.device:
    return torch.device("cuda", 0) if CUDA else torch.device("cpu")


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _release() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def _dims() -> dict:
    return DRY_DIMS if DRY else LLAMA3_8B


def _build(dtype: torch.dtype):
    """The Llama of ``_dims()`` with random init, built on the device in ``dtype``."""
    from flatshard.toolkit.models import tiny_model

    dims = dict(_dims())
    vocab = dims.pop("vocab_size")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with _dev():
            return tiny_model("llama", vocab_size=vocab, seq_len=SEQ, **dims)
    finally:
        torch.set_default_dtype(default)


class MarkovTokens:
    """Token sequences of a random first-order Markov chain with 4 successors a token (a
    loss that can fall below ln(vocab)); built in O(vocab), unlike SyntheticCorpus."""

    def __init__(self, vocab: int, seq: int, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab, self.seq = vocab, seq
        self.successors = torch.randint(vocab, (vocab, 4), generator=gen)
        self.probs = torch.tensor([8.0, 4.0, 2.0, 1.0]) / 15

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(step)
        tokens = torch.empty(BATCH, self.seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (BATCH,), generator=gen)
        choice = torch.multinomial(self.probs, BATCH * self.seq, replacement=True, generator=gen).view(
            BATCH, -1
        )
        for t in range(self.seq):
            tokens[:, t + 1] = self.successors[tokens[:, t], choice[:, t]]
        return tokens[:, :-1].to(_dev()), tokens[:, 1:].to(_dev())


def _flops_per_token(model) -> float:
    """torchtitan's count: 6 x params but the input embedding, plus attention's 12 x L x H x Q x T."""
    d = _dims()
    embedding = model.get_input_embeddings().weight.numel()
    dense = sum(p.numel() for p in model.parameters()) - embedding
    head = d["hidden_size"] // d["num_attention_heads"]
    return 6 * dense + 12 * d["num_hidden_layers"] * d["num_attention_heads"] * head * SEQ


def _events():
    return [torch.cuda.Event(enable_timing=True) for _ in range(3)] if CUDA else None


def _step(model, opt, x, y, autocast: bool = False) -> tuple[torch.Tensor, list | None, float]:
    """One step; CUDA events before forward, after backward and after the optimizer step."""
    from flatshard.toolkit.models import lm_loss

    ev = _events()
    t0 = time.perf_counter()
    if ev:
        ev[0].record()
    with torch.autocast(x.device.type, dtype=BF16, enabled=autocast):
        loss = lm_loss(model, x, y)
    loss.backward()
    if ev:
        ev[1].record()
    opt.step()
    opt.zero_grad()
    if ev:
        ev[2].record()
    return loss.detach().float(), ev, t0


def _timed(model, opt, corpus, first: int, count: int, autocast: bool = False) -> dict:
    """``count`` steps from batch ``first``: median ms of forward+backward, optimizer, whole."""
    batches = [corpus.batch(first + i) for i in range(count)]
    _sync()
    runs = [_step(model, opt, x, y, autocast) for x, y in batches]
    _sync()
    losses = [float(r[0]) for r in runs]
    if CUDA:
        fb = [r[1][0].elapsed_time(r[1][1]) for r in runs]
        op = [r[1][1].elapsed_time(r[1][2]) for r in runs]
    else:
        ends = [r[2] for r in runs[1:]] + [time.perf_counter()]
        fb, op = [(e - r[2]) * 1e3 for r, e in zip(runs, ends, strict=True)], [0.0] * count
    whole = [a + b for a, b in zip(fb, op, strict=True)]
    return {
        "losses": losses,
        "fwd_bwd_ms": statistics.median(fb),
        "optimizer_ms": statistics.median(op),
        "step_ms": statistics.median(whole),
        "step_ms_range": [min(whole), max(whole)],
    }


def _rates(row: dict, flops_per_token: float) -> dict:
    tokens_s = BATCH * SEQ / (row["step_ms"] / 1e3)
    return {"tokens_per_s": tokens_s, "mfu": tokens_s * flops_per_token / PEAK_FLOPS}


def warm_then_timed(model, opt, corpus, flops: float, warmup: int, steps: int, before=None) -> dict:
    """``warmup`` steps, then the allocator's peak reset (and ``before()``, e.g. a counter's
    reset), then ``steps`` timed steps with their rates: {"warmup", "steps", "memory"}."""
    out = {"warmup": _timed(model, opt, corpus, 0, warmup)}
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    if before is not None:
        before()
    out["steps"] = _timed(model, opt, corpus, warmup, steps)
    out["steps"] |= _rates(out["steps"], flops)
    out["memory"] = _mem()
    return out


def _mem() -> dict:
    if not CUDA:
        return {}
    return {
        "allocated": torch.cuda.memory_allocated(),
        "peak": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "total": torch.cuda.get_device_properties(0).total_memory,
    }


def _planned(precision) -> dict:
    from flatshard.planner.plan import plan_from_specs
    from flatshard.wrap.specs import model_specs

    with torch.device("meta"):
        meta = _build(BF16)
    specs = [dataclasses.replace(s, grad_dtype=BF16) for s in model_specs(meta)]  # (grad_dtype=bf16)
    plans = plan_from_specs(specs, world_size=1, bucket_size=None, optimizer="adamw", precision=precision)
    return plans[2].as_dict()


def part_flatshard() -> dict:
    import flatshard
    from flatshard.optim.precision import DEVICE_CHUNK
    from flatshard.toolkit.models import lm_loss

    precision = flatshard.OptimizerPrecision(main_dtype=BF16, state_dtype=BF16)
    model = _build(BF16)
    n = sum(p.numel() for p in model.parameters())
    flops = _flops_per_token(model)
    print(f"flatshard: {n / 1e9:.3f}B params, {flops / 1e9:.1f} GFLOP a token", flush=True)
    mp = flatshard.MixedPrecision(BF16, grad_dtype=BF16)
    model = flatshard.shard(model, stage=2, mixed_precision=mp)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, precision=precision, **HYPER)
    _release()
    out: dict = {"params": n, "flops_per_token": flops, "after_shard": _mem()}
    corpus = MarkovTokens(_dims()["vocab_size"], SEQ)
    out["warmup"] = _timed(model, opt, corpus, 0, WARMUP)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    opt.inner.fused = False
    out["chunked"] = _timed(model, opt, corpus, WARMUP, STEPS) | {"chunk": DEVICE_CHUNK}
    out["chunked"] |= _rates(out["chunked"], flops)
    out["chunked_memory"] = _mem()
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    opt.inner.fused = True  # (the default)
    out["warmup_fused"] = _timed(model, opt, corpus, WARMUP + STEPS, 1)  # (compiles the kernel)
    out["default"] = _timed(model, opt, corpus, WARMUP + STEPS + 1, STEPS) | {"fused": True}
    out["default"] |= _rates(out["default"], flops)
    out["step_memory"] = _mem()
    out["report_after_zero_grad"] = flatshard.memory_report(model, opt).as_dict()
    out["held_after_zero_grad"] = torch.cuda.memory_allocated() if CUDA else 0
    x, y = corpus.batch(WARMUP + 2 * STEPS + 1)
    lm_loss(model, x, y).backward()  # (the state as planned: with this step's grads)
    out["report"] = flatshard.memory_report(model, opt).as_dict()
    out["held_with_grads"] = torch.cuda.memory_allocated() if CUDA else 0
    opt.zero_grad()
    try:
        out["plan"] = _planned(precision)
    except Exception as e:  # (the plan is a comparison, not the run)
        out["plan"] = f"{type(e).__name__}: {e}"
    for key in ("chunked", "default"):
        r = out[key]
        print(
            f"flatshard {key}: step {r['step_ms']:.0f} ms (fwd+bwd {r['fwd_bwd_ms']:.0f}, opt "
            f"{r['optimizer_ms']:.0f}), {r['tokens_per_s']:.0f} tokens/s, MFU {r['mfu']:.1%}, "
            f"losses {[round(v, 3) for v in r['losses']]}",
            flush=True,
        )
    print(f"flatshard memory: {json.dumps(out['step_memory'])} report {out['report']}", flush=True)
    return out


def _plain(dtype: torch.dtype, autocast: bool) -> dict:
    out: dict = {}
    stage = "build"
    try:
        model = _build(dtype)
        flops = _flops_per_token(model)
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
        corpus = MarkovTokens(_dims()["vocab_size"], SEQ)
        stage = "warmup steps"
        out["warmup"] = _timed(model, opt, corpus, 0, WARMUP, autocast)
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        stage = "timed steps"
        out["steps"] = _timed(model, opt, corpus, WARMUP, STEPS, autocast)
        out["steps"] |= _rates(out["steps"], flops)
        out["result"] = "trained"
    except torch.OutOfMemoryError as e:
        out["result"] = f"OutOfMemoryError in {stage}: {str(e)[:300]}"
    out["memory"] = _mem()
    print(f"plain {dtype}: {out['result']} {json.dumps(out.get('steps', {}))[:400]}", flush=True)
    return out


PARTS = {
    "flatshard": part_flatshard,
    "plain-fp32": lambda: _plain(torch.float32, autocast=True),
    "plain-bf16": lambda: _plain(BF16, autocast=False),
}


def _one(part: str, path: str) -> None:
    write_result(path, part, CUDA, PARTS[part], model=_dims(), seq_len=SEQ, batch=BATCH, torchtitan=TITAN)


def main() -> None:
    drive(__file__, "gpu-showcase", list(PARTS), DEADLINES, _one, CUDA, DRY)


if __name__ == "__main__":
    main()
