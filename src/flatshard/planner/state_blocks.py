"""Optimizer state kept in blocks (torchao's low-bit Adams): which params get quantized
moments, and the bytes a run of them takes, for the plan ([Note: blockwise state] in
``optim/blockwise.py`` steps them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from flatshard.planner.layout import PARAM_ALIGN

QUANTIZED_MIN = 4096
"""torchao quantizes a tensor's state from this many elements on (bitsandbytes' rule)."""


@dataclass(frozen=True)
class BlockFormat:
    """How one of torchao's low-bit Adams keeps a moment: ``bits`` a code, one fp32 scale
    each ``block`` elements, and a code map of ``qmap`` fp32 entries a moment (0: none)."""

    bits: int
    block: int
    qmap: int

    @property
    def align(self) -> int:
        """``block_align`` of its blocks."""
        return block_align(self.block)


FORMATS = {
    "adamw8bit": BlockFormat(8, 256, 256),
    "adamw4bit": BlockFormat(4, 128, 16),
    "adamwfp8": BlockFormat(8, 256, 0),
}
"""The plan's names of torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8``."""


def block_align(block: int) -> int:
    """The smallest ``Buckets.align`` (a multiple of ``PARAM_ALIGN``) that keeps blocks of
    ``block`` elements whole ([Note: aligned shards] in ``planner/layout.py``)."""
    return math.lcm(PARAM_ALIGN, block)


def quantized(numel: int, block: int) -> bool:
    """Whether a param of ``numel`` elements gets quantized state (torchao's rule)."""
    return numel >= QUANTIZED_MIN and numel % block == 0


def run_state_bytes(fmt: BlockFormat, run_numel: int, param_numel: int) -> int:
    """Adam's state of a piece run of ``run_numel`` elements of a param of ``param_numel``:
    two moments (quantized where the whole param is, else fp32) and the fp32 step count."""
    if not quantized(param_numel, fmt.block):
        return 8 * run_numel + 4
    moment = run_numel * fmt.bits // 8 + 4 * (run_numel // fmt.block) + 4 * fmt.qmap
    return 2 * moment + 4
