"""Issue 48, item 7, on the CPU: a tensor-parallel Llama as TP2 x DP2 on 4 gloo ranks, with
flatshard's stages 0-2 and FSDP2 as the data-parallel dimension, side by side in one run.

    PYTHONPATH=src python benchmarks/tensor_parallel.py [--steps N] [--rounds R] [--out PATH]

The job: ``flatshard.toolkit.models.llama.Llama`` (4 layers, width 256, 8 heads, 512
tokens, sequences of 64), made tensor-parallel over the mesh's ``tp`` dimension by
torchtitan's plan (``parallelize``), 8 sequences per dp rank a step, AdamW, clipping at 1.0.
The peers, all in the same ranks:

- ``fsdp2+tp``: ``fully_shard`` on each block and the root over ``mesh["dp"]``, torch's
  AdamW over the DTensors, torch's ``clip_grad_norm_`` (the reference of every ratio);
- ``fsdp2-keep+tp``: the same with ``reshard_after_forward=False`` (ZeRO-2-like);
- ``flatshard-0/1/2+tp``: ``flatshard.shard(model, stage=N, group=mesh["dp"])`` with
  ``DistributedOptimizer(model, torch.optim.AdamW)`` and its ``clip_grad_norm_``.

Peers are timed in rotating rounds (``side_by_side.py``); model state is rank 0's
``flatshard.memory_report`` (unique storages: params, grads, main params, optimizer state).
Prints a table; writes JSON to ``--out``.
"""

from __future__ import annotations

import torch

from side_by_side import arguments, llama_config, report, time_rounds, train_step

WORLD, TP = 4, 2
PEERS = ["fsdp2+tp", "fsdp2-keep+tp", "flatshard-0+tp", "flatshard-1+tp", "flatshard-2+tp"]
BATCH = 8


def _build(peer: str, mesh):
    import flatshard
    from flatshard.toolkit.models.llama import Llama, parallelize

    torch.manual_seed(0)
    cfg = llama_config()
    model = parallelize(Llama(cfg), mesh["tp"])
    if peer.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        keep = peer.startswith("fsdp2-keep")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=not keep)
        fully_shard(model, mesh=mesh["dp"], reshard_after_forward=not keep)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # noqa: E731
    else:
        stage = int(peer.split("-")[1].split("+")[0])
        model = flatshard.shard(model, stage=stage, group=mesh["dp"])
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
        clip = lambda: opt.clip_grad_norm_(1.0)  # noqa: E731
    return model, opt, clip, cfg


def _rank(steps: int, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from flatshard import memory_report

    mesh = init_device_mesh("cpu", (WORLD // TP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    built = {peer: _build(peer, mesh) for peer in PEERS}
    cfg = built[PEERS[0]][3]
    g = torch.Generator().manual_seed(100 + dp_rank)  # (each dp rank its own data, tp ranks alike)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    times, losses = time_rounds(PEERS, lambda peer: train_step(*built[peer][:3], batch), steps, rounds)
    memory = {peer: memory_report(m, o).as_dict() for peer, (m, o, _, _) in built.items()}
    return {"times": times, "memory": memory, "losses": losses}


def main() -> None:
    from flatshard.toolkit import testing

    args = arguments(__doc__, "tensor-parallel")
    result = testing.run_distributed(_rank, WORLD, args.steps, args.rounds, timeout=3000, reuse=False)[0]
    title = f"TP{TP} x DP{WORLD // TP}, gloo, {args.rounds} rounds x {args.steps} steps"
    meta = {"world": WORLD, "tp": TP, "steps": args.steps, "rounds": args.rounds}
    report(title, result["times"], result["memory"], result["losses"], meta, args.out)


if __name__ == "__main__":
    main()
