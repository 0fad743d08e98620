"""A mixture-of-experts feed-forward for the toolkit's Llama, and expert parallelism for it.

``MoE`` routes each token to its ``top_k`` experts by a softmax router (weights renormalized
over the chosen ones, as Mixtral does) and runs every token it was given: dropless, no
capacity and no auxiliary loss, so its result is the same however its experts are spread.
``expert_parallel(model, ep_group)`` keeps each rank's contiguous share of every ``MoE``'s
experts and sends each token to the rank holding its expert and back (an all-to-all over
``ep_group``, whose backward is the reverse all-to-all), as Megatron-Core's and
torchtitan's dispatchers do. Expert params have ``experts`` in their names (``is_expert``),
for ``flatshard.Experts`` ([Note: expert parallelism] in ``wrap/plan.py``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def is_expert(name: str, param: nn.Parameter) -> bool:
    """Whether ``name`` is an expert param of an ``MoE`` (``flatshard.Experts``' ``match``)."""
    return "experts" in name.split(".")


class GroupedExperts(nn.Module):
    """SwiGLU experts as stacked weights: ``w1``, ``w3`` (experts, dim, hidden) and ``w2``
    (experts, hidden, dim)."""

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` grouped by expert, ``counts[e]`` of them for expert ``e`` (every expert
        runs, on no token too: its params get a grad of zeros, as on every rank)."""
        outs = []
        for e, h in enumerate(torch.split(tokens, counts)):
            outs.append((F.silu(h @ self.w1[e]) * (h @ self.w3[e])) @ self.w2[e])
        return torch.cat(outs)


class MoE(nn.Module):
    """Top-``top_k`` routed experts over the last dim of its input."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        if not 0 < top_k <= n_experts:
            raise ValueError(f"top_k must be 1 to n_experts ({n_experts}), got {top_k}")
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, dim, hidden)
        self.ep_group: object = None  # (expert_parallel: the ranks holding the other experts)

    @torch._dynamo.disable  # (routing sizes change every step: each would recompile)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Eager under ``torch.compile``: how many tokens each expert gets changes every step."""
        scores = self.router(x)
        tokens = x.reshape(-1, x.shape[-1])
        probs = scores.reshape(-1, self.n_experts).float().softmax(-1)
        weight, chosen = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert
        routed = tokens[order // self.top_k]
        counts = torch.bincount(flat, minlength=self.n_experts)
        if self.ep_group is None:
            out = self.experts(routed, counts.tolist())
        else:
            out = _dispatched(self.experts, routed, counts, self.ep_group)
        unsorted = torch.empty_like(out).index_copy(0, order, out)
        y = (unsorted.view(-1, self.top_k, x.shape[-1]) * weight.unsqueeze(-1).to(out.dtype)).sum(1)
        return y.view(x.shape)


def _dispatched(experts: GroupedExperts, routed: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """``routed`` (grouped by global expert, ``counts`` each) run by the ranks of ``group``
    holding their experts (rank ``r`` the ``r``-th contiguous share) and brought back."""
    size, local = dist.get_world_size(group), experts.w1.shape[0]
    received = torch.empty_like(counts)  # (from each rank, its tokens for each local expert)
    dist.all_to_all_single(received, counts, group=group)
    sent_to, got = counts.view(size, local).sum(1).tolist(), received.view(size, local)
    arrived = _AllToAll.apply(routed, got.sum(1).tolist(), sent_to, group)
    perm = _by_local_expert(got)
    out = experts(arrived[perm], got.sum(0).tolist())
    back = torch.empty_like(out).index_copy(0, perm, out)
    return _AllToAll.apply(back, sent_to, got.sum(1).tolist(), group)


def _by_local_expert(got: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder tokens arrived by (source rank, local expert) into
    (local expert, source rank)."""
    sizes = got.flatten()
    starts = torch.cumsum(sizes, 0) - sizes
    size, local = got.shape
    rows = [
        torch.arange(int(starts[i * local + e]), int(starts[i * local + e] + sizes[i * local + e]))
        for e in range(local)
        for i in range(size)
    ]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


class _AllToAll(torch.autograd.Function):
    """Rows sent ``sent[j]`` to rank ``j`` and ``got[i]`` taken from rank ``i`` over
    ``group``; backward sends the grads back the same way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, got: list[int], sent: list[int], group) -> torch.Tensor:  # type: ignore[override]
        ctx.got, ctx.sent, ctx.group = got, sent, group
        out = rows.new_empty((sum(got), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), got, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        back = grad.new_empty((sum(ctx.sent), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.sent, ctx.got, group=ctx.group)
        return back, None, None, None


def expert_parallel(model: nn.Module, ep_group) -> nn.Module:
    """Every ``MoE`` of ``model`` expert-parallel over the process group ``ep_group``: rank
    ``r`` of ``size`` keeps experts ``[r * n / size, (r + 1) * n / size)`` (``n`` must divide
    by ``size``; every rank must have built the model from the same seed) and exchanges
    tokens with the others. Each rank's tokens must be its own (sequence parallelism gives
    tp ranks theirs). Once ``model`` is sharded, its first forward checks that flatshard was
    told (``Experts(edp, is_expert, ep=ep_group)``): otherwise it would reduce different
    experts together as one dense param. Returns ``model``."""
    size, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    if size > 1 and any(isinstance(m, MoE) for m in model.modules()):
        ranks = dist.get_process_group_ranks(ep_group)
        check_when_sharded(model, lambda state: _check_told(model, state, ranks))
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            if module.n_experts % size:
                raise ValueError(f"{name}: {module.n_experts} experts do not split over {size} ranks")
            local = module.n_experts // size
            experts = module.experts
            for key, param in list(experts.named_parameters(recurse=False)):
                share = param.detach()[rank * local : (rank + 1) * local].clone()
                setattr(experts, key, nn.Parameter(share, requires_grad=param.requires_grad))
            module.ep_group = ep_group
    return model


def check_when_sharded(model: nn.Module, check) -> None:
    """Call ``check(flatshard_state)`` before ``model``'s first forward after flatshard
    sharded it (then never again); before that, every forward looks."""

    @torch._dynamo.disable
    def hook(module: nn.Module, args) -> None:
        state = getattr(module, "flatshard_state", None)
        if state is not None:  # (sharded by flatshard now)
            check(state)
            handle.remove()

    handle = model.register_forward_pre_hook(hook)


def _check_told(model: nn.Module, state, ranks: list[int]) -> None:
    """Raise unless flatshard holds every expert param of ``model`` in its expert buffers,
    with ``ranks`` as the expert-parallel group where one is named."""
    held = {id(p) for p in state.sets["expert"].params} if "expert" in state.sets else set()
    for name, param in model.named_parameters():
        if is_expert(name, param) and param.requires_grad and id(param) not in held:
            raise ValueError(
                f"{name!r} holds this rank's share of experts spread over the expert-parallel ranks "
                f"{ranks}, but flatshard holds it as a dense param reduced over its group, which would "
                "average different experts: shard(model, expert=flatshard.Experts(edp_group, is_expert, "
                "ep=ep_group))"
            )
    spread = state.grad_sync.experts
    if spread is not None and not spread.in_main and spread.over.group is not None:
        named = dist.get_process_group_ranks(spread.over.group)
        if sorted(named) != sorted(ranks):
            raise ValueError(
                f"Experts(ep=...) names the ranks {sorted(named)}, but the experts are spread over {ranks}"
            )
