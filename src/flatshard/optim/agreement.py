"""Ranks agree on the optimizer's settings, or say they don't ([Note: never silent] in
``errors.py``).

Every rank steps its own shard with its own inner optimizer: a rank whose learning rate,
betas, weight decay or param groups differ (a scheduler stepped on one rank only, a group
left out) updates its shard by other rules, and the model drifts with no error. So the
settings are compared:

* at construction, in full: every group's hyperparameters, and its members (fixed from then
  on) among the ranks that optimize the same params (a pipeline's stages hold different ones);
* at every step that computes the global grad norm (stages 1-3 unless ``nonfinite="step"``, a
  loss scaler or clipping), by a digest *riding on the norm's own all-reduce*: two 16-bit
  digests ``d`` go along as ``(d, d²)``; the sums satisfy ``N·Σd² = (Σd)²`` exactly (in
  fp64, integers below 2^53) if and only if every rank's ``d`` is equal. No collective is
  added to the step;
* otherwise every ``CHECK_EVERY`` steps, and at every checkpoint save, by one all-gather of
  a digest.

A disagreement is a ``ValueError`` on every rank naming the first differing setting, the rank
and both values (``check_ranks_agree``).
"""

from __future__ import annotations

import hashlib

import torch

from flatshard.comm.world import World, check_ranks_agree

CHECK_EVERY = 100  # steps between checks where no grad-norm all-reduce carries the digest
_BITS = 16  # per digest: d² summed over 2^20 ranks stays below 2^53, exact in fp64
RIDING = 4  # elements the digests add to the norm's all-reduce


class SettingsCheck:
    """Compares ``inner``'s hyperparameters across the ranks of ``world`` (every rank of the
    job) and, once, the param groups' members among the ranks that optimize the same params."""

    def __init__(self, world: World, members: list[list[str]]) -> None:
        self.world = world
        self.unchecked_steps = 0
        lines = [
            f"param group {i} members {hashlib.sha256(' '.join(names).encode()).hexdigest()[:16]}"
            for i, names in enumerate(members)
        ]
        params = " ".join(sorted(name for names in members for name in names))
        check_ranks_agree(world, lines, "the optimizer's param groups", among=params)

    def describe(self, inner: torch.optim.Optimizer) -> list[str]:
        lines = [f"optimizer {type(inner).__name__}", f"{len(inner.param_groups)} param groups"]
        for i, group in enumerate(inner.param_groups):
            hyper = ", ".join(f"{k}={_value(v)}" for k, v in sorted(group.items()) if k != "params")
            lines.append(f"param group {i}: {hyper}")
        return lines

    def check(self, inner: torch.optim.Optimizer, world: World | None = None) -> None:
        """The full comparison over ``world`` (default: the job's): one all-gather of a digest
        (the lines only on a mismatch)."""
        self.unchecked_steps = 0
        check_ranks_agree(world or self.world, self.describe(inner), "the optimizer's settings")

    def riding(self, inner: torch.optim.Optimizer, device: torch.device) -> torch.Tensor:
        """What this rank adds to the grad norm's all-reduce: ``(d1, d1², d2, d2²)``."""
        blob = hashlib.sha256("\n".join(self.describe(inner)).encode()).digest()
        d1, d2 = (int.from_bytes(blob[i : i + 2], "little") % (1 << _BITS) for i in (0, 2))
        return torch.tensor([d1, d1 * d1, d2, d2 * d2], dtype=torch.float64, device=device)

    def after_riding(self, inner: torch.optim.Optimizer, summed: torch.Tensor, world: World) -> None:
        """Check ``riding``'s values all-reduced over ``world``; on a mismatch, name it (every
        rank of ``world`` sees the same sums, so they all enter the full check together)."""
        s1, q1, s2, q2 = (int(v) for v in summed.tolist())
        n = world.size
        if n * q1 != s1 * s1 or n * q2 != s2 * s2:
            self.check(inner, world)

    def after_step(self, inner: torch.optim.Optimizer) -> None:
        """Count a step no norm checked; every ``CHECK_EVERY`` of them, check in full."""
        self.unchecked_steps += 1
        if self.unchecked_steps >= CHECK_EVERY:
            self.check(inner)


def _value(v: object) -> str:
    if isinstance(v, torch.Tensor):
        return repr(v.tolist())
    if isinstance(v, type):
        return v.__qualname__
    return repr(v)
