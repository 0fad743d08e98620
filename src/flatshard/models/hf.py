"""Hugging Face ``transformers`` causal LMs built from a config (random init: no weights are
downloaded), and the loss the training loop takes from any causal LM.

``flatshard train --model hf:llama`` (any ``model_type`` ``transformers`` knows: ``gpt2``,
``mistral``, ``mixtral``, ``qwen2``, ...) builds a tiny model of that type; ``lm_loss`` gives
the same next-token cross-entropy for it as for the built-in GPT, from its logits (the
corpus's targets are already shifted, so ``labels=`` would shift them twice).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256}
"""The dimensions of ``tiny_model``, in the names ``transformers`` maps for every model type."""


def tiny_model(model_type: str, *, vocab_size: int = 256, seq_len: int = 64, **overrides) -> nn.Module:
    """A ``transformers`` causal LM of ``model_type`` with ``TINY`` dimensions (and
    ``overrides``), ``vocab_size`` tokens and ``seq_len`` positions, randomly initialized."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError(f"hf:{model_type} needs transformers: pip install transformers") from None
    try:
        config = AutoConfig.for_model(
            model_type,
            vocab_size=vocab_size,
            max_position_embeddings=seq_len,
            bos_token_id=0,
            eos_token_id=0,
            **{**TINY, **overrides},
        )
        return AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ValueError(f"hf:{model_type}: {e}") from None


def is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` model (its class, swapped or not, comes from it)."""
    return any(c.__module__.startswith("transformers.") for c in type(module).__mro__)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of ``model`` on inputs ``x`` and targets ``y``: a
    ``transformers`` model's from its logits, any other model's ``model(x, y)``."""
    if not is_hf_model(model):
        return model(x, y)
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def model_dims(module: nn.Module) -> tuple[int | None, int | None]:
    """(vocab size, sequence length) of a built-in GPT (``cfg``) or a ``transformers`` model
    (``config``), None where the model does not say."""
    cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
    seq = getattr(cfg, "seq_len", None) or getattr(cfg, "max_position_embeddings", None)
    return getattr(cfg, "vocab_size", None), seq
