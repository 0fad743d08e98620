"""Checkpoints: saved at world size N and stage s, loaded at M and t, training continues on
the uninterrupted trajectory; exact resume at the same layout (RNG and schedule included);
other optimizers; visible only when complete; clear errors for bad checkpoints."""

import itertools
import os
import shutil

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _checkpoints import ADAMW, SGD, build, load_step_case, params_of, save_case, train
from _parity import NormalizedSGD, TiedGPT, decay_groups
from flatshard import load_checkpoint, save_checkpoint
from flatshard.toolkit.testing import RankError, run_distributed


def _load_case(path: str, stage: int, optimizer=SGD, bucket_size=3000, dtype=None, **whole):
    model, opt, sched = build(stage, optimizer, seed=1, bucket_size=bucket_size, dtype=dtype, **whole)
    extra = load_checkpoint(path, model, opt, extra={"sched": sched})
    rng = torch.rand(3)
    losses = train(model, opt, sched, range(extra["step"], extra["step"] + 3))
    return {"params": params_of(model), "losses": losses, "rng": rng}


def _max_diff(a, b) -> float:
    return max(float((p - q).abs().max() / q.abs().max().clamp_min(1e-12)) for p, q in zip(a, b, strict=True))


CROSS = [((2, 2), (3, 3)), ((1, 0), (4, 1)), ((4, 3), (2, 0)), ((3, 1), (1, 3)), ((2, 3), (2, 1))]


@pytest.mark.parametrize(("saved", "loaded"), CROSS, ids=[f"{a}to{b}" for a, b in CROSS])
def test_any_world_size_and_stage_continues_the_trajectory(tmp_path, saved, loaded):
    """SGD + momentum, two param groups and a StepLR schedule: saved at (N, s) after 3
    steps, loaded at (M, t) and trained 3 more, the params equal the uninterrupted run's."""
    path = str(tmp_path / "ckpt")
    reference = run_distributed(save_case, saved[0], path, saved[1])[0]
    resumed = run_distributed(_load_case, loaded[0], path, loaded[1], bucket_size=None)[0]
    assert _max_diff(resumed["params"], reference["params"]) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(resumed["losses"], reference["losses"], strict=True)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(a, b) for a, b in itertools.product(itertools.product([1, 2, 3, 4], [0, 1, 2, 3]), repeat=2) if a != b],
)
def test_every_pair_of_layouts(tmp_path, saved, loaded):
    test_any_world_size_and_stage_continues_the_trajectory(tmp_path, saved, loaded)


# (world size, stage, whole), saved -> loaded: whole-param layouts at other world sizes
# (other owners) and stages, and into flat layouts and back
WHOLE_CROSS = [((2, 3, True), (3, 1, True)), ((3, 2, True), (4, 3, True)), ((4, 1, True), (1, 2, True))]
SWAP_CROSS = [((3, 2, True), (2, 2, False)), ((2, 3, False), (4, 3, True))]
MOMENTUM_NORMALIZED = (NormalizedSGD, {"lr": 0.02, "momentum": 0.9})


@pytest.mark.parametrize(("saved", "loaded"), WHOLE_CROSS, ids=[f"{a}to{b}" for a, b in WHOLE_CROSS])
def test_whole_param_runs_continue_the_trajectory_at_any_layout(tmp_path, saved, loaded):
    """A whole-tensor rule with per-param state (normalised SGD with momentum, in fp32) on
    the matrices, SGD on the rest: its state moves to the params' new owners."""
    path = str(tmp_path / "ckpt")
    kw = {"matrices": MOMENTUM_NORMALIZED}
    reference = run_distributed(save_case, saved[0], path, saved[1], whole=saved[2], **kw)[0]
    resumed = run_distributed(
        _load_case, loaded[0], path, loaded[1], bucket_size=None, whole=loaded[2], **kw
    )[0]
    assert _max_diff(resumed["params"], reference["params"]) < 1e-5
    assert max(abs(a - b) / b for a, b in zip(resumed["losses"], reference["losses"], strict=True)) < 1e-5


@pytest.mark.parametrize(("saved", "loaded"), SWAP_CROSS, ids=[f"{a}to{b}" for a, b in SWAP_CROSS])
def test_whole_param_layouts_and_flat_layouts_load_each_other(tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    reference = run_distributed(save_case, saved[0], path, saved[1], whole=saved[2])[0]
    resumed = run_distributed(_load_case, loaded[0], path, loaded[1], bucket_size=None, whole=loaded[2])[0]
    assert _max_diff(resumed["params"], reference["params"]) < 1e-5


@pytest.mark.parametrize(
    ("world_size", "stage", "dtype"), [(2, 2, None), (3, 3, torch.bfloat16), (1, 1, None)]
)
def test_same_layout_resumes_bit_for_bit(tmp_path, world_size, stage, dtype):
    """AdamW (bf16 params with fp32 main params at stage 3): the same params, losses and
    RNG draws as the run that was never interrupted, on every rank."""
    path = str(tmp_path / "ckpt")
    reference = run_distributed(save_case, world_size, path, stage, ADAMW, dtype=dtype)
    resumed = run_distributed(_load_case, world_size, path, stage, ADAMW, dtype=dtype)
    for ref, res in zip(reference, resumed, strict=True):
        assert res["losses"] == ref["losses"]
        assert torch.equal(res["rng"], ref["rng"])
        assert all(torch.equal(a, b) for a, b in zip(res["params"], ref["params"], strict=True))


def test_muon_resumes_bit_for_bit_at_the_same_layout(tmp_path):
    path = str(tmp_path / "ckpt")
    muon = {"whole": True, "matrices": (torch.optim.Muon, {"lr": 0.02, "momentum": 0.95})}
    reference = run_distributed(save_case, 3, path, 3, ADAMW, **muon)
    resumed = run_distributed(_load_case, 3, path, 3, ADAMW, **muon)
    for ref, res in zip(reference, resumed, strict=True):
        assert res["losses"] == ref["losses"]
        assert all(torch.equal(a, b) for a, b in zip(res["params"], ref["params"], strict=True))


def test_bf16_with_main_params_loads_at_another_layout(tmp_path):
    path = str(tmp_path / "ckpt")
    reference = run_distributed(save_case, 2, path, 3, ADAMW, dtype=torch.bfloat16)[0]
    resumed = run_distributed(_load_case, 3, path, 1, ADAMW, dtype=torch.bfloat16)[0]
    assert max(abs(a - b) / b for a, b in zip(resumed["losses"], reference["losses"], strict=True)) < 2e-3


# -- other optimizers ---------------------------------------------------------------------------------
def _ddp_case(path: str, kind: str, mode: str, steps: int = 3):
    """DDP + a param-keyed optimizer (``plain``, ``owner``, ``hybrid``): save after 3 steps
    (``mode="save"``, then train on) or load and train 3 more (``mode="load"``)."""
    torch.manual_seed(0 if mode == "save" else 1)
    model = DDP(TiedGPT())
    groups = decay_groups(model.module)
    cls, hyper = ADAMW
    if kind == "owner":
        opt = flatshard.OwnerShardedOptimizer(groups, cls, **hyper)
    elif kind == "hybrid":
        opt = flatshard.HybridDeviceOptimizer(groups, offload_fraction=0.5, cpu_optimizer_class=cls, **hyper)
    else:
        opt = cls(groups, **hyper)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if mode == "save":
        train(model, opt, sched, range(steps))
        save_checkpoint(path, model, opt, extra={"step": steps, "sched": sched})
    else:
        steps = load_checkpoint(path, model, opt, extra={"sched": sched})["step"]
    losses = train(model, opt, sched, range(steps, steps + 3))
    return {"params": [p.detach().clone() for p in model.module.parameters()], "losses": losses}


@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        (("owner", 2), ("owner", 3)),
        (("owner", 3), ("plain", 1)),
        (("hybrid", 2), ("hybrid", 1)),
        (("plain", 2), ("distributed", 3)),
        (("distributed", 2), ("owner", 2)),
    ],
    ids=lambda case: f"{case[0]}{case[1]}",
)
def test_optimizers_load_each_others_checkpoints(tmp_path, saver, loader):
    """State is keyed by param name, not by optimizer: a DistributedOptimizer, torch AdamW,
    OwnerShardedOptimizer and HybridDeviceOptimizer load each other's checkpoints at other
    world sizes and continue the same trajectory (AdamW; grads differ in the last bits
    between world sizes, hence 1e-4)."""
    path = str(tmp_path / "ckpt")
    if saver[0] == "distributed":
        reference = run_distributed(save_case, saver[1], path, 2, ADAMW)[0]
    else:
        reference = run_distributed(_ddp_case, saver[1], path, saver[0], "save")[0]
    if loader[0] == "distributed":
        resumed = run_distributed(_load_case, loader[1], path, 1, ADAMW)[0]
    else:
        resumed = run_distributed(_ddp_case, loader[1], path, loader[0], "load")[0]
    assert max(abs(a - b) / b for a, b in zip(resumed["losses"], reference["losses"], strict=True)) < 1e-4


# -- safety ------------------------------------------------------------------------------------------
def _save_twice_case(path: str) -> None:
    model, opt, sched = build(2)
    train(model, opt, sched, range(1))
    save_checkpoint(path, model, opt, extra={"step": 1})
    train(model, opt, sched, range(1, 2))
    save_checkpoint(path, model, opt, extra={"step": 2})


def test_a_checkpoint_is_replaced_only_when_the_new_one_is_complete(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_twice_case, 2, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no partial or old copy left behind
    assert run_distributed(load_step_case, 2, path) == [2, 2]
    # a save cut off between its two renames leaves only PATH.old: it is what loads
    os.rename(path, path + ".old")
    with pytest.warns(UserWarning, match="left complete by a save that was cut off"):
        assert load_step_case(path) == 2


def test_bad_checkpoints_are_refused_with_the_reason(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(save_case, 2, path, 2)
    with pytest.raises(
        RankError, match=r"'wte\.weight' has shape \(64, 32\) in checkpoint .*, \(64, 16\) in the model"
    ):
        run_distributed(load_step_case, 1, path, True)
    bigger = TiedGPT()
    bigger.add_module("head2", torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match=r"has no 'head2\.weight' \(2 of the model's tensors missing\)"):
        load_checkpoint(path, bigger)
    broken = str(tmp_path / "broken")
    shutil.copytree(path, broken)
    data = next(n for n in os.listdir(broken) if n.endswith(".distcp"))
    with open(os.path.join(broken, data), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=f"checkpoint {broken} is corrupted: {data} has 100 bytes"):
        load_step_case(broken)
    os.remove(os.path.join(broken, "flatshard.json"))
    with pytest.raises(ValueError, match=r"is incomplete: it has no flatshard\.json"):
        load_step_case(broken)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_step_case(str(tmp_path / "nothing"))


def _save_into(path: str) -> str:
    model, opt, _ = build(1)
    try:
        save_checkpoint(path, model, opt, extra={"step": 7})
    except FileExistsError as e:
        return str(e)
    return "saved"


@pytest.mark.parametrize("where", ["", ".old", ".partial"])
@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_save_never_touches_what_it_did_not_write(tmp_path, where, kind):
    """A user's directory or file at PATH, PATH.old or PATH.partial refuses the save on every
    rank, naming it, and stays exactly as it was (it used to be renamed and deleted)."""
    path = str(tmp_path / "ckpt")
    mine = path + where
    if kind == "dir":
        os.makedirs(os.path.join(mine, "notes"))
        with open(os.path.join(mine, "notes", "a.txt"), "w") as f:
            f.write("keep me")
    else:
        with open(mine, "w") as f:
            f.write("keep me")
    before = sorted(os.listdir(tmp_path))
    errors = run_distributed(_save_into, 2, path)
    assert all(f"{mine} exists and is a {'directory' if kind == 'dir' else 'file'}" in e for e in errors)
    assert sorted(os.listdir(tmp_path)) == before
    kept = os.path.join(mine, "notes", "a.txt") if kind == "dir" else mine
    with open(kept) as f:
        assert f.read() == "keep me"


def test_a_save_replaces_its_own_checkpoint_and_an_unfinished_save(tmp_path):
    path = str(tmp_path / "ckpt")
    assert _save_into(path) == "saved"
    os.makedirs(path + ".partial")  # a save cut off before it wrote anything
    with open(os.path.join(path + ".partial", "__0_0.distcp"), "wb") as f:
        f.write(b"x")
    assert _save_into(path) == "saved"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    os.makedirs(path + ".partial")  # a save cut off while DCP wrote its index
    for name in (".flatshard-partial", ".metadata.tmp"):
        open(os.path.join(path + ".partial", name), "w").close()
    assert _save_into(path) == "saved"
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert load_step_case(path) == 7
