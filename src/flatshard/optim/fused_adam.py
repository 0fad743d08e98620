"""torch's Adam and AdamW over low-precision params and state in one pass: [Note: fused Adam step].

The reasoning is [Note: fused Adam step] below."""

# [Note: fused Adam step]
#
# The precision-aware optimizer steps any elementwise torch class by widening a chunk of the
# params and state into fp32 scratch, calling the class, and rounding the results back: a dozen
# passes over memory and two dozen kernels a chunk. For ``torch.optim.Adam`` and ``AdamW``
# (exactly those classes; a subclass may change the update) this module does the same update in
# one function that reads each param, grad and moment once and writes the param and moments
# back, rounded ([Note: rounding bits]); on an accelerator the function is compiled, so a chunk
# is one kernel, and on the CPU the same function is a native loop ([Note: native CPU Adam] in
# ``cpu_adam.py``; torch's CPU ops where it cannot be built). What stays the same as the
# chunked path:
#
# * the arithmetic: torch's single-tensor Adam, op for op, in fp32 (bias corrections and step
#   size computed on the host in double, as torch does), so with fp32 params and state it is
#   torch's step to fp32 rounding (the native CPU loop's sqrt is correctly rounded, as in
#   torch's ``fused=True`` step, which it equals to the bit; torch's CPU ops call MKL's, which
#   is not always, so the two differ by an ulp of a few updates);
# * the state: ``step`` (a CPU fp32 scalar tensor, as torch keeps it), ``exp_avg`` and
#   ``exp_avg_sq`` in the state dtype, so checkpoints, ``memory_report`` and a switch between
#   the two paths see one format;
# * the rounding bits, so the two paths differ only where a compiler orders fp32 arithmetic
#   differently (then an element may round to the neighbouring bf16 value).
#
# Groups with ``amsgrad``, ``capturable`` or ``differentiable`` take the chunked path.

from __future__ import annotations

import functools
from typing import Any

import torch

from flatshard.optim import cpu_adam
from flatshard.optim.rounding import noise, salt, shift_of, stochastic

FUSED_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
FUSED_CHUNK = 1 << 30
"""Elements a compiled call steps at once on an accelerator: it allocates nothing, so a chunk
is as long as int32 indexing allows, and the host's cost a call (guards, launch) is paid a few
times a step rather than once per 32M elements."""
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # (the salts' keys, in the order adam_chunk takes them)


def fusable(optimizer_class: type, group: dict[str, Any]) -> bool:
    """Whether ``group`` of ``optimizer_class`` can take the fused step."""
    return optimizer_class in FUSED_CLASSES and not any(
        group.get(flag, False) for flag in ("amsgrad", "capturable", "differentiable")
    )


def scalars(group: dict[str, Any], count: int) -> list[float]:
    """The group's per-step values for step ``count``, in the order ``adam_chunk`` unpacks them, as
    torch's single-tensor Adam derives them on the host (in double, rounded to fp32 on use)."""
    lr = float(group["lr"])
    beta1, beta2 = (float(b) for b in group["betas"])
    decoupled = bool(group.get("decoupled_weight_decay", False))
    return [
        1 - lr * float(group["weight_decay"]) if decoupled else 1.0,
        1 - beta1,
        beta2,
        1 - beta2,
        (1 - beta2**count) ** 0.5,
        float(group["eps"]),
        -lr / (1 - beta1**count),
    ]


def adam_chunk(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    ints: torch.Tensor,
    hyper: torch.Tensor,
    l2: float,
    maximize: bool,
    far: bool = True,
) -> None:
    """One Adam step of a chunk, in place: ``param`` and the moments are fp32 or bf16,
    ``grad`` any float dtype. ``ints`` (int64): the chunk's first element's place in its run,
    then the (lo, hi) salt of each of ``STATE_KEYS``; ``hyper`` (fp32): ``scalars``. Values
    that change from step to step are tensors, so a compiled kernel takes them as inputs
    (a Python float would be a constant, and each step would recompile it). ``far``: the
    chunk may reach past 2**32 of its run ([Note: rounding bits])."""
    decay, weight1, beta2, weight2, correction2_sqrt, eps, neg_step_size = hyper.unbind()
    g = grad.float()
    if maximize:
        g = -g
    w = param.float()
    if l2 != 0:  # (Adam's L2 term: a constant of the group, as torch's Scalar alpha)
        g = g.add(w, alpha=l2)
    w = w * decay
    m = exp_avg.float().lerp(g, weight1)
    # (torch's addcmul(g, g, value=1 - beta2) and addcdiv(m, denom, value=-step_size) with the
    # scalar folded into the first factor: the same kernels over the same fp32 products, so a
    # CPU kernel that fuses the multiply and the add, as AVX2's does, rounds as torch's step)
    v = torch.addcmul(exp_avg_sq.float() * beta2, weight2 * g, g)
    w = torch.addcdiv(w, m * neg_step_size, v.sqrt() / correction2_sqrt + eps)
    index = torch.arange(param.numel(), device=param.device) + ints[0]
    salts = ints[1:].view(3, 2)
    outs = (param, exp_avg, exp_avg_sq)
    for out, value, halves, key in zip(outs, (w, m, v), salts, STATE_KEYS, strict=True):
        bits = None if out.dtype == torch.float32 else noise(index, halves, far, shift_of(key))
        out.copy_(value if bits is None else stochastic(value, bits))


@functools.cache
def compiled_adam_chunk() -> Any:
    """``adam_chunk`` compiled once for any chunk length (one kernel a chunk on a GPU)."""
    return torch.compile(adam_chunk, dynamic=True, fullgraph=True)


def step_run(
    run: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    where: tuple[int, int, int],
    chunk: int,
    state_dtype: torch.dtype,
) -> None:
    """One fused step of ``run`` (a flat shard) with its fp32 ``grad``, creating torch's state
    on the first step; ``where`` is (seed, group index, the run's place in its group)."""
    if not state:
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros(run.shape, dtype=state_dtype, device=run.device)
        state["exp_avg_sq"] = torch.zeros(run.shape, dtype=state_dtype, device=run.device)
    state["step"] += 1
    count = int(state["step"].item())
    seed, group_index, place = where
    halves = [half for key in STATE_KEYS for half in salt(seed, count, group_index, place, key)]
    l2 = 0.0 if group.get("decoupled_weight_decay", False) else float(group["weight_decay"])
    maximize = bool(group.get("maximize", False))
    m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    flat, g = run.view(-1), grad.view(-1)
    if run.device.type == "cpu" and cpu_adam.step(
        flat, g, m, v, 0, halves, scalars(group, count), l2, maximize
    ):
        return  # ([Note: native CPU Adam]: the whole run in one call)
    hyper = torch.tensor(scalars(group, count), dtype=torch.float32, device=run.device)
    kernel = adam_chunk if run.device.type == "cpu" else compiled_adam_chunk()
    for start in range(0, flat.numel(), chunk):
        end = min(flat.numel(), start + chunk)
        ints = torch.tensor([start, *halves], dtype=torch.int64, device=run.device)
        far = end > 1 << 32  # (a chunk that reaches past 2**32 of the run: the hash's second round)
        kernel(flat[start:end], g[start:end], m[start:end], v[start:end], ints, hyper, l2, maximize, far)
