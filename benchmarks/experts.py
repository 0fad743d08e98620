"""Issue 48, item 4, on the CPU: a mixture-of-experts Llama under expert parallelism as
EP2 x EDP2 on 4 gloo ranks (dense params over all 4), with flatshard's stages 0-3 and
FSDP2 as the data-parallel dimension, side by side in one run.

    PYTHONPATH=src python benchmarks/experts.py [--steps N] [--rounds R] [--out PATH]

The job: ``flatshard.toolkit.models.llama.Llama`` (4 layers, width 256, 8 heads, 512 tokens,
sequences of 64) whose feed-forwards are ``MoE`` of 8 experts, top 2, spread over the
mesh's ``ep`` dimension by ``expert_parallel`` (4 experts a rank, tokens sent by
all-to-all), 8 sequences per rank a step, AdamW, clipping at 1.0. The peers, all in the same
ranks:

- ``fsdp2``: torchtitan's recipe: ``fully_shard`` on each block's experts over
  ``mesh["edp"]``, on each block and the root over every rank; torch's AdamW; the experts'
  averaged grads times edp / dp (torchtitan sets FSDP2's gradient divide factor to dp, a
  ``PREMUL_SUM`` gloo lacks); the norm of the dense grads and of the experts' (summed over
  ep) taken apart and joined, as torchtitan's ``_clip_grad_norm_with_ep`` does (the
  reference of every ratio);
- ``flatshard-0/1/2/3``: ``flatshard.shard(model, stage=N, expert=Experts(mesh["edp"],
  is_expert, ep=mesh["ep"]))`` with ``DistributedOptimizer(model, torch.optim.AdamW)`` and
  its ``clip_grad_norm_``.

Peers are timed in rotating rounds (``side_by_side.py``); model state is rank 0's
``flatshard.memory_report`` (unique storages: params, grads, main params, optimizer state).
Prints a table; writes JSON to ``--out``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from side_by_side import arguments, llama_config, report, time_rounds, train_step

WORLD, EP = 4, 2
PEERS = ["fsdp2", "flatshard-0", "flatshard-1", "flatshard-2", "flatshard-3"]
BATCH = 8


def _build(peer: str, mesh):
    import flatshard
    from flatshard.toolkit.models.llama import Llama
    from flatshard.toolkit.models.moe import expert_parallel, is_expert

    torch.manual_seed(0)
    cfg = llama_config(hidden_mult=2, n_experts=8)
    model = expert_parallel(Llama(cfg), mesh["ep"].get_group())
    if peer == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer.feed_forward.experts, mesh=mesh["edp"])
            fully_shard(layer, mesh=mesh["world"])
        fully_shard(model, mesh=mesh["world"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        params = [(n, p) for n, p in model.named_parameters()]
        return model, opt, lambda: _clip_with_ep(params, mesh["ep"].get_group(), 1.0), cfg
    stage = int(peer.split("-")[1])
    experts = flatshard.Experts(mesh["edp"], is_expert, ep=mesh["ep"])
    model = flatshard.shard(model, stage=stage, expert=experts)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    return model, opt, lambda: opt.clip_grad_norm_(1.0), cfg


def _clip_with_ep(params, ep_group, max_norm: float) -> torch.Tensor:
    """The experts' grads scaled to the mean over dp, then torchtitan's clip with expert
    parallelism: the dense grads' norm (DTensors over every rank) and the experts'
    (DTensors over edp, then summed over ep) joined, both clipped."""
    from flatshard.toolkit.models.moe import is_expert

    dense = [p.grad for n, p in params if not is_expert(n, p) and p.grad is not None]
    experts = [p.grad for n, p in params if is_expert(n, p) and p.grad is not None]
    torch._foreach_mul_(experts, (WORLD // EP) / WORLD)  # (FSDP2 averaged over edp; the mean is over dp)
    dense_sq = torch.nn.utils.get_total_norm(dense).full_tensor() ** 2
    expert_sq = torch.nn.utils.get_total_norm(experts).full_tensor() ** 2
    dist.all_reduce(expert_sq, group=ep_group)
    norm = (dense_sq + expert_sq).sqrt()
    for expert in (False, True):  # (one mesh a call: torch's foreach clip cannot mix them)
        chosen = [p for n, p in params if is_expert(n, p) == expert]
        torch.nn.utils.clip_grads_with_norm_(chosen, max_norm, norm)
    return norm


def _rank(steps: int, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from flatshard import memory_report

    mesh = init_device_mesh("cpu", (WORLD // EP, EP), mesh_dim_names=("edp", "ep"))
    mesh["edp", "ep"]._flatten("world")
    built = {peer: _build(peer, mesh) for peer in PEERS}
    cfg = built[PEERS[0]][3]
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # (each rank its own data)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    times, losses = time_rounds(PEERS, lambda peer: train_step(*built[peer][:3], batch), steps, rounds)
    memory = {peer: memory_report(m, o).as_dict() for peer, (m, o, _, _) in built.items()}
    return {"times": times, "memory": memory, "losses": losses}


def main() -> None:
    from flatshard.toolkit import testing

    args = arguments(__doc__, "experts")
    result = testing.run_distributed(_rank, WORLD, args.steps, args.rounds, timeout=3000, reuse=False)[0]
    title = f"EP{EP} x EDP{WORLD // EP} (dense over {WORLD}), gloo, {args.rounds} rounds x {args.steps} steps"
    meta = {"world": WORLD, "ep": EP, "steps": args.steps, "rounds": args.rounds}
    report(title, result["times"], result["memory"], result["losses"], meta, args.out)


if __name__ == "__main__":
    main()
