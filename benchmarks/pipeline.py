"""Issue 48, item 7, on the CPU: a Llama cut into 2 pipeline stages as PP2 x DP2 on 4 gloo
ranks under torch's 1F1B schedule, with flatshard's stages 0-2 and FSDP2 as the
data-parallel dimension of each stage, side by side in one run.

    PYTHONPATH=src python benchmarks/pipeline.py [--steps N] [--rounds R] [--out PATH]

The job: ``flatshard.toolkit.models.llama.Llama`` (4 layers, width 256, 8 heads, 512 tokens,
sequences of 64), each rank holding the ``pipeline_chunk`` of its pipeline stage, 16
sequences per dp rank a step in 4 micro-batches, AdamW, clipping at 1.0. The peers, all in
the same ranks:

- ``fsdp2+pp``: ``fully_shard`` on each block and the chunk over ``mesh["dp"]``, torch's
  ``PipelineStage`` (which runs FSDP2 without a reduction per micro-batch), torch's AdamW,
  torchtitan's clip (torch's ``get_total_norm`` summed over pp): the reference of every ratio;
- ``flatshard-0/1/2+pp``: ``flatshard.shard(chunk, stage=N, group=mesh["dp"])`` in
  ``flatshard.hosts.pipelining.PipelineStage`` (one reduction a step), ``DistributedOptimizer``
  and its ``clip_grad_norm_`` (the whole model's norm);
- ``flatshard-2+torch-stage``: the stage-2 chunk in torch's own ``PipelineStage``, which
  reduces after every micro-batch, with the same optimizer and clip (its norm the chunk's).

Peers are timed in rotating rounds (``side_by_side.py``); model state is rank 0's
``flatshard.memory_report``. Prints a table; writes JSON to ``--out``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from side_by_side import arguments, llama_config, report, time_rounds

WORLD, PP, MICRO, BATCH = 4, 2, 4, 16
PEERS = ["fsdp2+pp", "flatshard-0+pp", "flatshard-1+pp", "flatshard-2+pp", "flatshard-2+torch-stage"]


def _build(peer: str, mesh):
    from torch.distributed.pipelining import PipelineStage as TorchStage
    from torch.distributed.pipelining import Schedule1F1B

    import flatshard
    from flatshard.hosts.pipelining import PipelineStage
    from flatshard.toolkit.models.llama import Llama, lm_loss, pipeline_chunk

    torch.manual_seed(0)
    cfg = llama_config()
    pp = mesh["pp"].get_local_rank()
    chunk = pipeline_chunk(Llama(cfg), pp, PP)
    if peer.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for layer in chunk.layers.values():
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(chunk, mesh=mesh["dp"])
        opt = torch.optim.AdamW(chunk.parameters(), lr=1e-3)
        clip = lambda: _torchtitan_clip(chunk, mesh)  # noqa: E731
        stage_class = TorchStage
    else:
        chunk = flatshard.shard(chunk, stage=int(peer.split("-")[1].split("+")[0]), group=mesh["dp"])
        opt = flatshard.DistributedOptimizer(chunk, torch.optim.AdamW, lr=1e-3)
        clip = lambda: opt.clip_grad_norm_(1.0)  # noqa: E731
        stage_class = TorchStage if peer.endswith("torch-stage") else PipelineStage
    stage = stage_class(chunk, pp, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    return chunk, opt, clip, Schedule1F1B(stage, MICRO, loss_fn=lm_loss), cfg


def _torchtitan_clip(model, mesh) -> None:
    params = list(model.parameters())
    total = torch.nn.utils.get_total_norm([p.grad for p in params]).full_tensor() ** 2
    dist.all_reduce(total, group=mesh["pp"].get_group())
    torch.nn.utils.clip_grads_with_norm_(params, 1.0, total.sqrt())


def _step(opt, clip, schedule, batch, last: bool) -> float:
    losses: list[torch.Tensor] = []
    schedule.step(batch[0], target=batch[1], losses=losses)
    clip()
    opt.step()
    opt.zero_grad()
    return torch.stack(losses).mean().item() if last else float("nan")


def _rank(steps: int, rounds: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from flatshard import memory_report

    mesh = init_device_mesh("cpu", (PP, WORLD // PP), mesh_dim_names=("pp", "dp"))
    last = mesh["pp"].get_local_rank() == PP - 1
    built = {peer: _build(peer, mesh) for peer in PEERS}
    cfg = built[PEERS[0]][4]
    g = torch.Generator().manual_seed(100 + mesh["dp"].get_local_rank())  # (each dp rank its own data)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len + 1), generator=g)
    batch = (tokens[:, :-1], tokens[:, 1:])
    times, losses = time_rounds(PEERS, lambda peer: _step(*built[peer][1:4], batch, last), steps, rounds)
    memory = {peer: memory_report(m, o).as_dict() for peer, (m, o, _, _, _) in built.items()}
    return {"times": times, "memory": memory, "losses": losses}


def main() -> None:
    from flatshard.toolkit import testing

    args = arguments(__doc__, "pipeline", steps=4)
    results = testing.run_distributed(_rank, WORLD, args.steps, args.rounds, timeout=3000, reuse=False)
    result, last = results[0], results[-1]  # (the last pipeline stage's ranks have the losses)
    title = f"PP{PP} x DP{WORLD // PP}, 1F1B, {MICRO} micro-batches, gloo, {args.rounds} x {args.steps} steps"
    meta = {"world": WORLD, "pp": PP, "micro_batches": MICRO, "steps": args.steps, "rounds": args.rounds}
    report(title, result["times"], result["memory"], last["losses"], meta, args.out)


if __name__ == "__main__":
    main()
