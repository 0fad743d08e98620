"""A model's linears converted to torchao's float8 training with fp8 all-gathers, as a
torchtitan-style recipe converts them (``flatshard plan --fp8-gathers``, the tests)."""

from __future__ import annotations

from torch import nn

HEADS = ("lm_head", "head", "output")
"""Names of output heads, left in high precision as torchtitan's recipe leaves them."""


def float8_linears(module: nn.Module, *, emulate: bool = False) -> nn.Module:
    """Convert every ``nn.Linear`` of ``module`` whose dims are multiples of 16 (what fp8
    matmuls take), but the output head, to torchao's ``Float8Linear`` with
    ``enable_fsdp_float8_all_gather=True`` (``emulate``: fp8 matmuls emulated, as a CPU needs);
    returns ``module``."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        raise ImportError(f"float8 linears need torchao ({e})") from None

    def chosen(linear: nn.Module, name: str) -> bool:
        dims = isinstance(linear, nn.Linear) and linear.in_features % 16 == linear.out_features % 16 == 0
        return dims and name.rsplit(".", 1)[-1] not in HEADS

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
    return convert_to_float8_training(module, config=config, module_filter_fn=chosen)
