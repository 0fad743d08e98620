"""Hugging Face ``transformers`` causal LMs built from a config (random init: no weights are
downloaded), and the loss the training loop takes from any causal LM.

``flatshard train --model hf:llama`` (any ``model_type`` ``transformers`` knows: ``gpt2``,
``mistral``, ``mixtral``, ``qwen2``, ...) builds a tiny model of that type; ``lm_loss`` gives
the same next-token cross-entropy for it as for the built-in GPT, from its logits (the
corpus's targets are already shifted, so ``labels=`` would shift them twice).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
"""The dimensions of ``tiny_model``, in the names ``transformers`` maps for every model type."""

HEAD = TINY["hidden_size"] // TINY["num_attention_heads"]
SMALLER = {  # where a type's config has the field (not None): a value that fits TINY
    "num_key_value_heads": 2,
    "head_dim": HEAD,
    "rotary_dim": HEAD,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "max_window_layers": 2,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": HEAD // 2,
    "qk_nope_head_dim": HEAD // 2,
    "v_head_dim": HEAD,
    "ffn_dim": TINY["intermediate_size"],
    "word_embed_proj_dim": TINY["hidden_size"],
    # encoder-decoder families (BART, Marian, Whisper, ...) name their sizes per side
    "d_model": TINY["hidden_size"],
    "encoder_layers": TINY["num_hidden_layers"],
    "decoder_layers": TINY["num_hidden_layers"],
    "encoder_attention_heads": TINY["num_attention_heads"],
    "decoder_attention_heads": TINY["num_attention_heads"],
    "encoder_ffn_dim": TINY["intermediate_size"],
    "decoder_ffn_dim": TINY["intermediate_size"],
    # hybrids that place attention every k-th layer (Jamba, Zamba)
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "rescale_every": 0,  # (RWKV rescales its weights in place in eval mode: no sharded param allows it)
    # sizes one family names its own way (CPM-Ant, RoCBert, BLT, Phi-4's audio encoder, GOT-OCR2)
    "dim_ff": TINY["intermediate_size"],
    "shape_vocab_size": 256,
    "shape_embed_dim": TINY["hidden_size"],
    "pronunciation_vocab_size": 256,
    "pronunciation_embed_dim": TINY["hidden_size"],
    "encoder_hash_byte_group_vocab": 256,
    "hidden_size_global": TINY["hidden_size"],
    "ext_pw_out_channel": TINY["hidden_size"],
    "depthwise_separable_out_channel": TINY["hidden_size"],
    "nemo_conv_channels": TINY["hidden_size"],
    "output_channels": TINY["hidden_size"],  # (GOT-OCR2's vision neck)
    # state-space and linear-attention layers (Bamba, Nemotron-H, Kimi Linear): their full-size
    # states and head counts made a 64-wide model's step seconds long
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    "ssm_state_size": 16,
    "linear_num_heads": TINY["num_attention_heads"],
    "linear_head_dim": HEAD,
}
DERIVED = ("head_dim", "num_key_value_heads", "num_experts_per_tok", "n_routed_experts", "n_shared_experts")
"""Fields some types leave None (to derive from others that ``TINY`` changes): set anyway."""
LAYER_KINDS = ("layer_types", "layers_block_type", "block_types", "mlp_layer_types")
"""Per-layer kinds (attention, linear attention, recurrent; dense or sparse MLP)."""


def tiny_config(model_type: str, *, vocab_size: int = 256, seq_len: int = 64, **overrides):
    """A ``transformers`` config of ``model_type`` shrunk to ``TINY``: its defaults (a
    full-size model's), with the width, depth and heads of ``TINY``, and every field that must
    agree with them (key-value heads, head size, experts, windows, a hybrid's layer kinds) set
    to fit; ``use_cache`` off (a training config: no generation cache). A composite config
    (a multimodal model's text and vision configs, ...) has each of its parts shrunk alike."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    fields = _tiny_fields(defaults, vocab_size, seq_len, overrides)
    return AutoConfig.for_model(model_type, **fields)


def _tiny_fields(defaults, vocab_size: int, seq_len: int, overrides: dict) -> dict:
    """The fields that shrink the config ``defaults`` (and its sub-configs) to ``TINY``."""
    fields = {**TINY, "vocab_size": vocab_size, "max_position_embeddings": seq_len}
    if getattr(defaults, "unpadded_vocab_size", None) is not None:  # (the head's share of a padded vocab)
        fields["unpadded_vocab_size"] = vocab_size
    settable = [k for k in SMALLER if not isinstance(getattr(type(defaults), k, None), property)]
    fields.update(
        {
            k: SMALLER[k]
            for k in settable
            if getattr(defaults, k, None) is not None or (k in DERIVED and hasattr(defaults, k))
        }
    )
    fields.update(_layer_kinds(defaults, overrides.get("num_hidden_layers", TINY["num_hidden_layers"])))
    if getattr(defaults, "use_cache", None):  # (training needs no cache; hybrids' caches refuse some layouts)
        fields["use_cache"] = False
    if getattr(defaults, "sliding_window", None) is not None:
        fields["sliding_window"] = seq_len
    for token in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(defaults, token, None) is not None:
            fields[token] = 0
    fields.update(overrides)
    head = fields["hidden_size"] // fields["num_attention_heads"]  # (of the dimensions asked for)
    for key in ("head_dim", "rotary_dim", "v_head_dim"):
        if key in fields and key not in overrides:
            fields[key] = head
    if "qk_rope_head_dim" in fields and "head_dim" in fields and "head_dim" not in overrides:
        fields["head_dim"] = fields["qk_rope_head_dim"]  # (multi-head latent attention: rotary size)
    for name in getattr(type(defaults), "sub_configs", {}):
        part = getattr(defaults, name, None)
        if part is not None and hasattr(part, "to_dict"):
            fields[name] = type(part)(**_tiny_fields(part, vocab_size, seq_len, overrides))
    return fields


def _layer_kinds(defaults, layers: int) -> dict:
    """One layer of each kind a full-size pattern holds, in the order they first appear (so
    a tiny hybrid has attention as well as its other kinds), the last repeated up to
    ``layers``; more layers where a pattern has more kinds."""
    patterns = {}
    for key in LAYER_KINDS:
        kinds = getattr(defaults, key, None)
        stored = getattr(type(defaults), "attribute_map", {}).get(key, key)  # (an alias of it)
        if isinstance(getattr(type(defaults), stored, None), property):
            continue  # (derived from other fields)
        if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
            patterns[key] = list(dict.fromkeys(kinds))
    if not patterns:
        return {}
    layers = max(layers, *(len(p) for p in patterns.values()))
    fields = {key: p + [p[-1]] * (layers - len(p)) for key, p in patterns.items()}
    return {**fields, "num_hidden_layers": layers}


def tiny_model(model_type: str, *, vocab_size: int = 256, seq_len: int = 64, **overrides) -> nn.Module:
    """A ``transformers`` causal LM of ``model_type`` with ``tiny_config``'s dimensions (and
    ``overrides``), ``vocab_size`` tokens and ``seq_len`` positions, randomly initialized."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise ValueError(f"hf:{model_type} needs transformers: pip install transformers") from None
    try:
        config = tiny_config(model_type, vocab_size=vocab_size, seq_len=seq_len, **overrides)
        return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise ValueError(f"hf:{model_type}: {e}") from None


def pretrained_model(path: str) -> nn.Module:
    """The causal LM of a local ``config.json`` or ``save_pretrained`` directory, built from
    its config (random init: ``load_pretrained`` fills a sharded model afterwards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path)
        return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        what = "a transformers config or save_pretrained directory"
        raise ValueError(f"--model {path}: not {what} ({e})") from None


def apply_tensor_parallel_plan(model: nn.Module, tp_mesh: Any) -> nn.Module:
    """Make a ``transformers`` model built from its config tensor-parallel over the 1-D
    ``tp_mesh`` by its own plan (``base_model_tp_plan``: column-wise q/k/v and gate/up,
    row-wise o and down, the embeddings split by vocabulary, the head gathered), as
    ``from_pretrained(..., distributed_config=DistributedConfig(tp_size=...))`` does on a
    mesh of its own; then ``flatshard.shard(model, group=mesh["dp"])`` makes it
    data-parallel. Each rank keeps its slice of its own values, so every rank must have
    built the model from the same seed. Returns ``model``."""
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError as e:
        raise ValueError(
            f"apply_tensor_parallel_plan needs transformers >= 5 with its tensor-parallel plans ({e})"
        ) from None
    if not is_hf_model(model) or not hasattr(model, "_resolve_parallel_plans"):
        raise ValueError(f"apply_tensor_parallel_plan takes a transformers model, got {type(model).__name__}")
    if getattr(tp_mesh, "ndim", None) != 1:
        raise ValueError(f'tp_mesh must be a 1-D DeviceMesh (mesh["tp"]), got {tp_mesh!r}')
    transformers_model: Any = model  # (its plan methods are not in nn.Module's types)
    plan = transformers_model._resolve_parallel_plans(DistributedConfig(tp_size=tp_mesh.size()))[0]
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (its config's base_model_tp_plan)"
        )
    return apply_tensor_parallelism(model, tp_mesh, plan)


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


class CausalLMLoss(nn.Module):
    """A causal LM with the ``forward(tokens, targets) -> loss`` of the built-in GPT (what the
    benchmark's peers call); ``lm`` is the model itself, so its units are found inside."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.lm, x, y)


def model_dims(module: nn.Module) -> tuple[int | None, int | None]:
    """(vocab size, sequence length) of a built-in GPT (``cfg``) or a ``transformers`` model
    (``config``), None where the model does not say."""
    cfg = getattr(module, "cfg", None) or getattr(module, "config", None)
    seq = getattr(cfg, "seq_len", None) or getattr(cfg, "max_position_embeddings", None)
    return getattr(cfg, "vocab_size", None), seq
