"""The optimizer step on the host (issue 61's first measurement): one AdamW step over one flat
run of N fp32 elements on the CPU, on one thread, by every way there is to take it, in one run.

    PYTHONPATH=src python benchmarks/host_adam.py OUT.json [--sizes 24 26] [--repeats 5]

Rows (median ms of ``--repeats`` steps after a warm-up step, with the range):

* ``torch fused``: ``torch.optim.AdamW(fused=True)`` on the CPU (torch's vectorized kernel);
* ``torch foreach``: ``foreach=True`` (a kernel per op over the whole tensor);
* ``torch single``: ``foreach=False`` (torch's loop, the op sequence again);
* ``flatshard eager``: ``optim/fused_adam.adam_chunk`` uncompiled, over chunks of 2^22 (what
  ``step_run`` does on the CPU today: the op sequence, plus the rounding bits when a
  16-bit state needs them);
* ``flatshard compiled``: the same function compiled by inductor (one C++ loop a chunk);
* ``... bf16 state``: fp32 params with bf16 moments (the 4-byte state), stochastic rounding;
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


def _flatshard_row(n: int, compiled: bool, state_dtype: torch.dtype) -> Callable[[], None]:
    from flatshard.optim import fused_adam

    torch.manual_seed(0)
    run, grad = torch.randn(n), torch.randn(n) * 1e-3
    state: dict = {}
    group = {**HYPER, "decoupled_weight_decay": True}
    if compiled:  # (step_run picks the eager function on the CPU: the compiled one stands in)
        kernel = fused_adam.compiled_adam_chunk()
        original = fused_adam.adam_chunk
        fused_adam.adam_chunk = kernel

        def step() -> None:
            fused_adam.adam_chunk = kernel
            try:
                fused_adam.step_run(run, grad, state, group, (0, 0, 0), CHUNK, state_dtype)
            finally:
                fused_adam.adam_chunk = original

        return step
    return lambda: fused_adam.step_run(run, grad, state, group, (0, 0, 0), CHUNK, state_dtype)


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
        "flatshard eager": lambda: _flatshard_row(n, False, torch.float32),
        "flatshard compiled": lambda: _flatshard_row(n, True, torch.float32),
        "flatshard eager, bf16 state": lambda: _flatshard_row(n, False, torch.bfloat16),
        "flatshard compiled, bf16 state": lambda: _flatshard_row(n, True, torch.bfloat16),
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    result: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__, "sizes": {}}
    for log2 in args.sizes:
        rows = _rows(1 << log2, args.repeats)
        result["sizes"][f"2^{log2}"] = rows
        fused = rows["torch fused"]["ms"]
        print(f"\nN = 2^{log2} fp32 elements, 1 thread")
        print(f"{'row':34} {'ms':>9} {'range':>19} {'ns/el':>7} {'x fused':>8}")
        for name, row in rows.items():
            if "note" in row:
                print(f"{name:34} {row['note']}")
                continue
            lo, hi = row["range"]
            spread = f"{lo:9.1f}-{hi:9.1f}"
            print(
                f"{name:34} {row['ms']:9.1f} {spread:>19} {row['ns/element']:7.2f} {row['ms'] / fused:8.2f}"
            )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
