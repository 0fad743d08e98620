"""The optimizer step on the host (issue 61's first measurement): one AdamW step over one flat
run of N fp32 elements on the CPU, on one thread, by every way there is to take it, in one run.

    PYTHONPATH=src python benchmarks/host_adam.py OUT.json [--sizes 24 26] [--repeats 5] [--threads 1]

Rows (median ms of ``--repeats`` steps after a warm-up step, with the range):

* ``torch fused``: ``torch.optim.AdamW(fused=True)`` on the CPU (torch's vectorized kernel);
* ``torch foreach``: ``foreach=True`` (a kernel per op over the whole tensor);
* ``torch single``: ``foreach=False`` (torch's loop, the op sequence again);
* ``flatshard native``: ``optim/cpu_adam`` (what ``step_run`` does on the CPU: one C loop
  over the run, [Note: native CPU Adam]);
* ``flatshard eager``: ``optim/fused_adam.adam_chunk`` uncompiled, over chunks of 2^22 (the
  torch ops ``step_run`` falls back to without a C compiler);
* ``flatshard compiled``: the same function compiled by inductor (one C++ loop a chunk);
* ``... bf16 state``: fp32 params with bf16 moments, stochastic rounding;
* ``... bf16 params and state``: bf16 params with bf16 moments (the 4-byte state of
  ``OptimizerPrecision(torch.bfloat16, torch.bfloat16)``), stochastic rounding;
* ``deepspeed cpu adam``: ``DeepSpeedCPUAdam`` when DeepSpeed is installed and its op
  builds (``DS_ACCELERATOR=cpu``; a few minutes the first time); otherwise the row says why.

Each row also gives ns per element. The goal (issue 61): at or below torch fused, with the
4-byte state and stochastic rounding too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

CHUNK = 1 << 22
BF16 = torch.bfloat16
HYPER = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _time(step: Callable[[], None], repeats: int) -> dict:
    step()  # (warm: first-step state, compiles)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1000)
    return {"ms": statistics.median(times), "range": [min(times), max(times)]}


def _torch_row(n: int, **flags) -> Callable[[], None]:
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n) * 1e-3
    opt = torch.optim.AdamW([param], **HYPER, **flags)
    return opt.step


def _flatshard_row(
    n: int, how: str, state_dtype: torch.dtype, param_dtype=torch.float32
) -> Callable[[], None]:
    from flatshard.optim import cpu_adam, fused_adam

    torch.manual_seed(0)
    run, grad = torch.randn(n).to(param_dtype), torch.randn(n) * 1e-3
    state: dict = {}
    group = {**HYPER, "decoupled_weight_decay": True}
    kernel = fused_adam.compiled_adam_chunk() if how == "compiled" else fused_adam.adam_chunk
    if how == "native" and not cpu_adam.available():
        raise RuntimeError("the native CPU loop did not build (see the warning)")

    def step() -> None:
        # (the other rows stand the kernel in for the native loop, as step_run does without one)
        original, native = fused_adam.adam_chunk, cpu_adam.step
        fused_adam.adam_chunk = kernel
        if how != "native":
            cpu_adam.step = lambda *args: False
        try:
            fused_adam.step_run(run, grad, state, group, (0, 0, 0), CHUNK, state_dtype)
        finally:
            fused_adam.adam_chunk, cpu_adam.step = original, native

    return step


def _deepspeed_row(n: int) -> Callable[[], None] | str:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # (not installed, or no CPU accelerator set)
        return f"not run: {type(e).__name__}: {e}"[:200]
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n) * 1e-3
    try:
        opt = DeepSpeedCPUAdam(
            [param],
            lr=HYPER["lr"],
            betas=HYPER["betas"],
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            adamw_mode=True,
        )
    except Exception as e:  # (its op did not build)
        return f"not run: {type(e).__name__}: {e}"[:200]
    return opt.step


def _rows(n: int, repeats: int) -> dict:
    rows: dict = {}
    makers: dict[str, Callable[[], Callable[[], None] | str]] = {
        "torch fused": lambda: _torch_row(n, fused=True),
        "torch foreach": lambda: _torch_row(n, foreach=True),
        "torch single": lambda: _torch_row(n, foreach=False),
        "flatshard native": lambda: _flatshard_row(n, "native", torch.float32),
        "flatshard eager": lambda: _flatshard_row(n, "eager", torch.float32),
        "flatshard compiled": lambda: _flatshard_row(n, "compiled", torch.float32),
        "flatshard native, bf16 state": lambda: _flatshard_row(n, "native", torch.bfloat16),
        "flatshard eager, bf16 state": lambda: _flatshard_row(n, "eager", torch.bfloat16),
        "flatshard compiled, bf16 state": lambda: _flatshard_row(n, "compiled", torch.bfloat16),
        "flatshard native, bf16 params+state": lambda: _flatshard_row(n, "native", BF16, BF16),
        "flatshard compiled, bf16 params+state": lambda: _flatshard_row(n, "compiled", BF16, BF16),
        "deepspeed cpu adam": lambda: _deepspeed_row(n),
    }
    for name, make in makers.items():
        step = make()
        if isinstance(step, str):
            rows[name] = {"note": step}
            continue
        rows[name] = _time(step, repeats)
        rows[name]["ns/element"] = rows[name]["ms"] * 1e6 / n
        del step
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--sizes", type=int, nargs="+", default=[24, 26], help="log2 of N")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (and the native loop's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__, "sizes": {}}
    for log2 in args.sizes:
        rows = _rows(1 << log2, args.repeats)
        result["sizes"][f"2^{log2}"] = rows
        fused = rows["torch fused"]["ms"]
        print(f"\nN = 2^{log2} elements, {args.threads} thread(s)")
        print(f"{'row':38} {'ms':>9} {'range':>19} {'ns/el':>7} {'x fused':>8}")
        for name, row in rows.items():
            if "note" in row:
                print(f"{name:38} {row['note']}")
                continue
            lo, hi = row["range"]
            spread = f"{lo:9.1f}-{hi:9.1f}"
            print(
                f"{name:38} {row['ms']:9.1f} {spread:>19} {row['ns/element']:7.2f} {row['ms'] / fused:8.2f}"
            )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
