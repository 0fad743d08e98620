"""What the checkpoint tests share: the model and optimizer they save, the steps they train,
and the rank functions that save a run and load its step."""

import torch
import torch.distributed as dist

import flatshard
from _parity import CFG, TiedGPT, decay_groups, full_params, is_matrix
from flatshard import DistributedOptimizer, load_checkpoint, save_checkpoint
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPTConfig

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
GLOBAL_BATCH = 12  # split evenly at world sizes 1-4, so every world size takes the same steps
SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01})
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1})


def batch(step: int):
    rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    x, y = CORPUS.batch(step, 0, GLOBAL_BATCH)
    k = GLOBAL_BATCH // size
    return x[rank * k : (rank + 1) * k], y[rank * k : (rank + 1) * k]


def build(stage: int, optimizer=SGD, seed: int = 0, bucket_size=3000, dtype=None, whole=False, matrices=None):
    """``whole``: the blocks' matrices kept whole ([Note: whole-param buckets]); ``matrices``:
    (class, hyperparameters) of a param group of those matrices, e.g. Muon."""
    torch.manual_seed(seed)
    kwargs = {} if dtype is None else {"mixed_precision": flatshard.MixedPrecision(param_dtype=dtype)}
    if whole:
        kwargs["whole_params"] = is_matrix
    model = flatshard.shard(TiedGPT(), stage=stage, **kwargs, buckets=flatshard.Buckets(size=bucket_size))
    cls, hyper = optimizer
    groups = decay_groups(model)
    if matrices is not None:
        mats = [p for n, p in model.named_parameters() if is_matrix(n, p)]
        rest = [p for n, p in model.named_parameters() if p.requires_grad and not is_matrix(n, p)]
        groups = [{"params": mats, "optimizer_class": matrices[0], **matrices[1]}, {"params": rest}]
    opt = DistributedOptimizer(model, cls, params=groups, **hyper)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(model, opt, sched, steps) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        mean = loss.detach().clone()  # over the global batch: comparable across world sizes
        if dist.is_initialized():
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses


def params_of(model):
    return [p.float().clone() for p in full_params(model)]


def save_case(path: str, stage: int, optimizer=SGD, bucket_size=3000, dtype=None, steps: int = 3, **whole):
    model, opt, sched = build(stage, optimizer, bucket_size=bucket_size, dtype=dtype, **whole)
    train(model, opt, sched, range(steps))
    save_checkpoint(path, model, opt, extra={"step": steps, "sched": sched})
    after_save = torch.rand(3)  # what the next draw would be
    losses = train(model, opt, sched, range(steps, steps + 3))
    return {"params": params_of(model), "losses": losses, "rng": after_save}


def load_step_case(path: str, tiny: bool = False):
    if tiny:
        torch.manual_seed(0)
        model = flatshard.shard(
            TiedGPT(GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_layers=2, n_heads=2))
        )
        return load_checkpoint(path, model)["step"]
    model, opt, _ = build(1)
    return load_checkpoint(path, model, opt)["step"]


def saved_entries(path: str, kinds: tuple[str, ...] = ("model", "main", "state")) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` whose key starts with one of ``kinds``
    (``model/``, ``main/``, ``state/``), whole, read in this process."""
    import torch.distributed.checkpoint as dcp

    from flatshard.checkpoint.directory import read_manifest
    from flatshard.checkpoint.pieces import reader

    found = reader(path).read_metadata().state_dict_metadata
    wanted = {k: md for k, md in found.items() if k.split("/")[0] in kinds}
    out = {k: torch.empty(md.size, dtype=md.properties.dtype) for k, md in wanted.items()}
    dcp.load(out, storage_reader=reader(path, read_manifest(path)["save_id"]), no_dist=True)
    return out
