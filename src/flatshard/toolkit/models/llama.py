"""A Llama-style model for tensor-parallel tests and benchmarks, with torchtitan's plan.

``Llama`` has separate q/k/v/o and w1/w2/w3 projections (attention works on whatever
heads a rank holds) and RMS norms; ``parallelize(model, tp_mesh)`` applies torchtitan's
Llama plan: sequence-parallel norms and residual stream (so replicated norm weights get
``Partial`` grads), column-wise q/k/v and w1/w3, row-wise wo and w2, the embeddings split
row-wise and the output gathered to every rank. ``pipeline_chunk(model, i, n)`` cuts the
``i``-th of ``n`` pipeline stages out of it, as torchtitan does (its params keep their names
in the whole model); ``context_parallel(model, cp_group)`` splits each sequence over the
ranks of ``cp_group`` (``sequence_slice``), attention gathering keys and values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flatshard.toolkit.models.moe import MoE, check_when_sharded


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 64
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 8
    hidden_mult: int = 2
    init_std: float = 0.2  # (norm weights too, around 1, so their grads are not all alike)
    n_experts: int = 0  # > 0: every feed-forward is an ``MoE`` of that many experts
    top_k: int = 2


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))
        self.cp_group: object = None  # (context_parallel: the ranks holding the other positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        if self.cp_group is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (the heads of this tp rank)
        else:
            y = _context_parallel_attention(q, k, v, self.cp_group)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def _context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group) -> torch.Tensor:
    """Causal attention of this rank's positions (the ``rank``-th contiguous slice of the
    sequence) over every earlier position: keys and values gathered over ``group``."""
    import torch.distributed as dist

    t, rank = q.shape[2], dist.get_rank(group)
    k_all, v_all = (_GatherSequence.apply(z, group) for z in (k, v))
    positions = torch.arange(t, device=q.device) + rank * t
    mask = torch.arange(k_all.shape[2], device=q.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask)


class _GatherSequence(torch.autograd.Function):
    """Every rank's slice of dim 2 (the sequence), in rank order; backward sums the grads of
    the whole over the ranks and keeps this rank's slice (the grad of what it computed)."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, group) -> torch.Tensor:  # type: ignore[override]
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.t = group, dist.get_rank(group), part.shape[2]
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[:, :, ctx.rank * ctx.t : (ctx.rank + 1) * ctx.t], None


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_mult * cfg.dim
        self.w1, self.w3 = nn.Linear(cfg.dim, hidden, bias=False), nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim)  # (a bias: a replicated param whose grad is Replicate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.feed_forward: nn.Module = (
            MoE(cfg.dim, cfg.hidden_mult * cfg.dim, cfg.n_experts, cfg.top_k)
            if cfg.n_experts
            else FeedForward(cfg)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """``forward(idx, targets)`` gives the mean next-token cross-entropy."""

    def __init__(self, cfg: LlamaConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=cfg.init_std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return lm_loss(self.output(self.norm(x)), targets)


def parallelize(model: nn.Module, tp_mesh) -> nn.Module:
    """``model`` (a ``Llama`` or a ``LlamaChunk``) tensor-parallel over the 1-D ``tp_mesh`` by
    torchtitan's Llama plan (the sequence length must divide by the mesh's size; every rank
    must have built the model from the same seed). Between blocks, and between pipeline
    chunks, the residual stream is each tp rank's slice of the sequence. Returns ``model``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sequence = (Shard(1),)
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    parallelize_module(model, tp_mesh, {k: v for k, v in root.items() if getattr(model, k) is not None})
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=sequence, desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=sequence, desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    layers = model.layers
    assert isinstance(layers, (nn.ModuleDict, nn.ModuleList))  # (a Llama's, or a chunk's)
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        plan = dict(block)
        if isinstance(layer.feed_forward, MoE):
            plan = {k: v for k, v in block.items() if not k.startswith("feed_forward")}
            plan.update(_moe_plan())
        parallelize_module(layer, tp_mesh, plan)
    return model


def _moe_plan() -> dict:
    """An ``MoE`` under sequence parallelism: it works on this tp rank's own tokens (its slice
    of the sequence, as a local tensor, the residual stream's form), its router replicated
    over tp (a ``Partial`` grad, as a norm's), its experts plain params (spread by
    ``expert_parallel``, not by tp)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    sequence = (Shard(1),)
    return {
        "feed_forward": PrepareModuleInput(
            input_layouts=sequence, desired_input_layouts=sequence, use_local_output=True
        ),
        "feed_forward.router": SequenceParallel(use_local_output=True),
    }


class LlamaChunk(nn.Module):
    """Some consecutive layers of a ``Llama`` (under their names in the whole model), after
    its embeddings on the first chunk and before its norm and output on the last:
    ``forward`` maps tokens or hidden states to hidden states or logits."""

    def __init__(self, model: Llama, first: int, last: int) -> None:
        super().__init__()
        n = len(model.layers)
        self.tok_embeddings = model.tok_embeddings if first == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(first, last)})
        self.norm = model.norm if last == n else None
        self.output = model.output if last == n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None and self.norm is not None:
            x = self.output(self.norm(x))
        return x


def pipeline_chunk(model: Llama, stage_index: int, num_stages: int) -> LlamaChunk:
    """Pipeline stage ``stage_index`` of ``num_stages`` of ``model``: its layers split as
    evenly as they go (the first stages take one more where they do not divide)."""
    n = len(model.layers)
    if not 0 <= stage_index < num_stages <= n:
        raise ValueError(f"stage {stage_index} of {num_stages}: a {n}-layer Llama has 1 to {n} stages")
    bounds = [i * (n // num_stages) + min(i, n % num_stages) for i in range(num_stages + 1)]
    return LlamaChunk(model, bounds[stage_index], bounds[stage_index + 1])


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``Llama``'s loss from the last chunk's logits: the mean next-token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def context_parallel(model: nn.Module, cp_group) -> nn.Module:
    """``model``'s attention layers (of a ``Llama`` or its chunks) context-parallel over the
    process group ``cp_group``: each rank then takes the ``rank``-th contiguous slice of every
    sequence (``sequence_slice``), and its attention reads the keys and values of all
    earlier positions from the other ranks (an all-gather, as Llama 3's context parallelism
    does). Once ``model`` is sharded, its first forward checks that flatshard's group holds
    the cp ranks (``group=mesh["dp", "cp"]._flatten()``): over ``mesh["dp"]`` alone the cp
    ranks' replicated params would drift apart. Returns ``model``."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.cp_group = cp_group
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(cp_group)
    if len(ranks) > 1:
        check_when_sharded(model, lambda state: _check_cp_reduced(state, ranks))
    return model


def _check_cp_reduced(state, ranks: list[int]) -> None:
    """Raise unless flatshard reduces the model's grads over every rank of ``ranks``."""
    import torch.distributed as dist

    main = next(iter(state.sets.values()))
    reduced = {dist.get_rank()}
    for world in (main.world, main.replicate):  # (ranks a reduction reaches in one dimension)
        reduced |= set(dist.get_process_group_ranks(world.group)) if world.group is not None else set()
    if not set(ranks) <= set(reduced):
        raise ValueError(
            f"the model is context-parallel over the ranks {ranks}, but flatshard reduces its grads over "
            f"{sorted(reduced)} only: each cp rank's params would drift from the others'. Shard over the "
            'flattened dp x cp group, group=mesh["dp", "cp"]._flatten()'
        )


def sequence_slice(tokens: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The positions of ``tokens`` (batch, sequence) that context-parallel rank ``rank`` of
    ``size`` holds: the ``rank``-th of ``size`` equal contiguous slices."""
    t = tokens.shape[1]
    if t % size:
        raise ValueError(f"a sequence of {t} positions does not split into {size} equal slices")
    return tokens[:, rank * t // size : (rank + 1) * t // size]
