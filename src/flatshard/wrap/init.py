"""How a meta-device model's modules are initialized when ``shard()`` is given no
``param_init_fn`` ([Note: meta init] in ``units/build.py``).

The reasoning is [Note: default init] below."""

# [Note: default init]
#
# A model built under ``torch.device("meta")`` is materialized unit by unit and each module
# that holds params or buffers is initialized once. By default:
#
# * a LoRA adapter's matrices (a peft ``LoraLayer``'s ``lora_A``/``lora_B`` modules) as peft
#   initializes them by default: A as ``nn.Linear`` (Kaiming uniform), **B zero**, so that a
#   fine-tune starts from exactly the pretrained model (``nn.Linear.reset_parameters`` would
#   make B random, and the loaded model wrong before its first step);
# * inside a Hugging Face model, every other module by the model's own ``_init_weights``
#   (after its ``reset_parameters()``, if it has one): this also computes the rotary
#   embeddings' ``inv_freq``, a buffer no checkpoint holds;
# * anything else by its ``reset_parameters()``; a module with neither is an error naming it.
#
# Weights loaded afterwards (``load_pretrained``) overwrite what they hold; what they do not
# hold (adapters, non-persistent buffers) keeps this initialization.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def default_init(root: nn.Module) -> Callable[[nn.Module], None]:
    """The initializer of [Note: default init] for the modules of ``root``."""
    lora_a, lora_b = _lora_modules(root)
    hf = next((m for m in root.modules() if callable(getattr(m, "_init_weights", None))), None)

    def init(module: nn.Module) -> None:
        reset: Any = getattr(module, "reset_parameters", None)
        if id(module) in lora_b:
            with torch.no_grad():
                for p in module.parameters(recurse=False):
                    p.zero_()
        elif id(module) in lora_a or hf is None:
            if not callable(reset):
                raise ValueError(
                    f"{type(module).__name__} holds params or buffers on the meta device but has no "
                    "reset_parameters(); pass param_init_fn=... to shard() to initialize it"
                )
            reset()
        else:
            if callable(reset):
                reset()
            hf_init: Any = hf._init_weights  # (transformers' per-module initializer)
            hf_init(module)

    return init


def _lora_modules(root: nn.Module) -> tuple[set[int], set[int]]:
    """Ids of the A and B modules of every peft LoRA layer in ``root`` (found by their
    ``lora_A``/``lora_B`` module dicts: no peft import)."""
    a: set[int] = set()
    b: set[int] = set()
    for module in root.modules():
        for name, found in (("lora_A", a), ("lora_B", b)):
            adapters = getattr(module, name, None)
            if isinstance(adapters, nn.ModuleDict):
                found.update(id(m) for m in adapters.values())
    return a, b
