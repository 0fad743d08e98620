"""Models whose params are tensor subclasses, for the tests of [Note: tensor-subclass
params] and of what composes with them."""

import torch
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from _parity import TiedGPT

BLOCKS = lambda m, name: name.startswith("blocks.")  # noqa: E731 (the linears converted)


def float8_gpt(pow2: bool = False, model_cls=TiedGPT) -> nn.Module:
    """The parity GPT with its blocks' linears converted to float8 training with fp8
    all-gathers (``pow2``: scales rounded down to a power of 2)."""
    model = model_cls()
    config = Float8LinearConfig(
        emulate=True, enable_fsdp_float8_all_gather=True, round_scales_to_power_of_2=pow2
    )
    convert_to_float8_training(model, config=config, module_filter_fn=BLOCKS)
    return model


class LoraNF4(nn.Module):
    """A linear whose frozen base is torchao's NF4 (QLoRA's) and a trainable low-rank update."""

    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        base = torch.randn(dim, dim) * 0.1
        self.weight = nn.Parameter(to_nf4(base, 64, 64), requires_grad=False)
        self.a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.b = nn.Parameter(torch.randn(dim, rank) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight) + x @ self.a.t() @ self.b.t()


def qlora(seed: int) -> nn.Module:
    """Two NF4-based LoRA linears and a plain head, built from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(LoraNF4(64), nn.ReLU(), LoraNF4(64), nn.ReLU(), nn.Linear(64, 1))
