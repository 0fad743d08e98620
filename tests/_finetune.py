"""Tiny Hugging Face + peft models for the fine-tuning tests (random init: nothing is
downloaded), with weights large enough that greedy tokens vary from step to step."""

from __future__ import annotations

import torch
from torch import nn

from flatshard.toolkit.models import tiny_model

VOCAB = 96
DIMS = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 3}
LORA_TARGETS = ["q_proj", "v_proj", "up_proj"]


def tiny_llama(seed: int = 0, **overrides) -> nn.Module:
    """A 3-layer Llama; ``initializer_range`` 0.3 so its logits are far from uniform."""
    torch.manual_seed(seed)
    options = {"num_key_value_heads": 1, "initializer_range": 0.3, "pad_token_id": 0, **overrides}
    return tiny_model("llama", vocab_size=VOCAB, seq_len=64, **DIMS, **options)


def tiny_lora(seed: int = 0, base: nn.Module | None = None) -> nn.Module:
    """``tiny_llama`` with a LoRA adapter whose weights are not zero (as after training)."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(seed) if base is None else base
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    return get_peft_model(base, config)


def prompt(rank: int) -> torch.Tensor:
    """A prompt of 3 + rank tokens (ranks differ in content and length)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(1, VOCAB, (1, 3 + rank), generator=g)
