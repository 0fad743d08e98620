"""Built-in models for the demo, tests and benchmarks (``gpt``; ``llama``, a Llama-style
model with torchtitan's tensor-parallel plan; ``moe``, its mixture-of-experts feed-forward
and expert parallelism; ``hf``, ``transformers`` models from configs; ``float8``, linears
converted to torchao's float8 training), and the loader of users' models."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from functools import partial

from torch import nn

from flatshard.toolkit.models.gpt import GPT, PRESETS, GPTConfig
from flatshard.toolkit.models.hf import (
    CausalLMLoss,
    is_hf_model,
    lm_loss,
    model_dims,
    pretrained_model,
    tiny_model,
)

__all__ = [
    "GPT",
    "PRESETS",
    "CausalLMLoss",
    "GPTConfig",
    "is_hf_model",
    "lm_loss",
    "model_dims",
    "model_factory",
    "tiny_model",
]


def model_factory(spec: str) -> Callable[[], nn.Module]:
    """What builds the model named ``spec``: a GPT preset, ``hf:<model_type>`` (a tiny
    ``transformers`` causal LM of that type, ``models.hf``), a local directory or
    ``config.json`` (the ``transformers`` causal LM it configures, e.g. a ``save_pretrained``
    directory), or ``module:factory`` (a function of no arguments returning an ``nn.Module``,
    imported from ``module``)."""
    if spec.startswith("hf:"):
        return partial(tiny_model, spec.removeprefix("hf:"))
    if os.path.isdir(spec) or spec.endswith(".json"):
        return partial(pretrained_model, spec)
    if ":" in spec:
        module_name, name = spec.split(":", 1)
        try:
            factory = getattr(importlib.import_module(module_name), name)
        except ImportError as e:
            raise ValueError(f"--model {spec}: cannot import {module_name!r} ({e})") from None
        except AttributeError:
            raise ValueError(f"--model {spec}: module {module_name!r} has no {name!r}") from None
        return lambda: _checked(factory(), spec)
    if spec in PRESETS:
        return lambda: GPT(PRESETS[spec])
    raise ValueError(
        f"--model {spec!r} is neither a GPT preset {sorted(PRESETS)}, hf:<model_type>, a directory, "
        "a config.json nor module:factory"
    )


def _checked(module: object, spec: str) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise ValueError(f"{spec} returned {type(module).__name__}, not an nn.Module")
    return module
