"""The bad-input catalog's cases and the helpers that build them (``test_bad_inputs.py``
runs them): a small sharded model, a saved checkpoint, damage done to one, and changes made
to a wrapped model."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import flatshard
from flatshard.app.cli import main as cli_main
from flatshard.checkpoint.directory import MANIFEST


@dataclass
class Case:
    name: str
    run: Callable[[Path], object]  # given a fresh directory
    error: type[Exception]
    names: str  # a regex the message must match: the value, option, file or param


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _sharded(stage: int = 1) -> flatshard.ShardedModule:
    return flatshard.shard(_model(), stage=stage)


def _opt(model=None, cls=torch.optim.AdamW, **kw):
    return flatshard.DistributedOptimizer(model if model is not None else _sharded(), cls, **kw)


def _saved(tmp: Path) -> Path:
    """A checkpoint of a stage-1 model with AdamW state, at ``tmp/ckpt``."""
    model = _sharded()
    opt = _opt(model, lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    flatshard.save_checkpoint(tmp / "ckpt", model, opt)
    return tmp / "ckpt"


def _peft_exported_for_from_pretrained(tmp: Path) -> object:
    """A LoRA model's checkpoint exported as ``model.safetensors``, the file from_pretrained
    reads (it would find none of peft's names there and load a random-init model)."""
    from peft import LoraConfig, get_peft_model

    from flatshard.toolkit.models import tiny_model

    torch.manual_seed(0)
    lora = get_peft_model(tiny_model("llama", seq_len=8), LoraConfig(r=2, target_modules=["q_proj"]))
    model = flatshard.shard(lora, stage=1)
    flatshard.save_checkpoint(tmp / "ckpt", model, _opt(model))
    return flatshard.export_checkpoint(tmp / "ckpt", tmp / "model.safetensors")


def _load(path: Path, model=None) -> None:
    model = model if model is not None else _sharded()
    flatshard.load_checkpoint(path, model, _opt(model))


def _with_manifest(tmp: Path, text: str) -> Path:
    path = _saved(tmp)
    (path / MANIFEST).write_text(text)
    return path


def _flip_a_data_byte(tmp: Path) -> Path:
    """One bit flipped in the middle of the exp_avg of ``0.weight``, a piece every load reads
    (a flip in a piece no load reads, such as the step counters of a run's later params,
    is found by ``flatshard verify``)."""
    path = _saved(tmp)
    stored = dcp.FileSystemReader(str(path)).read_metadata().storage_data
    where = next(v for k, v in stored.items() if k.fqn == "state/exp_avg/0.weight")
    data = path / where.relative_path
    raw = bytearray(data.read_bytes())
    raw[where.offset + where.length // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    return path


def _user_dir(tmp: Path) -> Path:
    (tmp / "mine").mkdir()
    (tmp / "mine" / "notes.txt").write_text("precious")
    return tmp / "mine"


def _snapshot(tmp: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(tmp)): p.read_bytes() if p.is_file() else None for p in tmp.rglob("*")}


def _save_over(make: Callable[[Path], Path]) -> Callable[[Path], None]:
    """Save onto what ``make`` puts there; nothing in the directory may change."""

    def run(tmp: Path) -> None:
        target, model = make(tmp), _sharded()
        before = _snapshot(tmp)
        try:
            flatshard.save_checkpoint(target, model)
        finally:
            assert _snapshot(tmp) == before, "save_checkpoint changed files it did not write"

    return run


def _garbage(tmp: Path, name: str) -> Path:
    (tmp / name).write_bytes(random.Random(name).randbytes(4096))
    return tmp / name


def _step_without_optimizer(tmp: Path) -> None:
    model = _sharded(stage=2)
    model(torch.randn(3, 4)).sum().backward()


def _clip(max_norm: object, **kw) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        model = _sharded()
        opt = _opt(model, lr=1e-2)
        model(torch.randn(3, 4)).sum().backward()
        return opt.clip_grad_norm_(max_norm, **kw)

    return run


def _nan_grads_clipped(tmp: Path) -> object:
    model = _sharded()
    opt = _opt(model, lr=1e-2)
    (model(torch.randn(3, 4)).sum() * float("nan")).backward()
    return opt.clip_grad_norm_(1.0, error_if_nonfinite=True)


def _save_while_locked(tmp: Path) -> None:
    from flatshard.checkpoint.destination import save_lock

    with save_lock(str(tmp / "ckpt"), True):
        flatshard.save_checkpoint(tmp / "ckpt", _sharded())


def _user_lock_file(tmp: Path) -> None:
    (tmp / "ckpt.lock").write_text("mine")
    _save_over(lambda t: t / "ckpt")(tmp)


def _piece_of_another_save(tmp: Path) -> Path:
    """The same model saved twice, one piece file copied over (sizes made to fit)."""
    first, second = tmp / "a", tmp / "b"
    model = _sharded()
    opt = _opt(model, lr=1e-2)
    flatshard.save_checkpoint(first, model, opt)
    flatshard.save_checkpoint(second, model, opt)
    (first / "__0_0.distcp").write_bytes((second / "__0_0.distcp").read_bytes())
    manifest = json.loads((first / MANIFEST).read_text())
    manifest["files"]["__0_0.distcp"] = (first / "__0_0.distcp").stat().st_size
    (first / MANIFEST).write_text(json.dumps(manifest))
    return first


def _another_save_id(tmp: Path) -> Path:
    path = _saved(tmp)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["save_id"] = "0" * 32
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def _changed_after_wrapping(change: Callable[[nn.Module], None]) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        model = _sharded()
        change(model)
        return model(torch.randn(3, 4))

    return run


def _unfreeze_frozen(tmp: Path) -> object:
    """A model wrapped with ``1.bias`` frozen, which is then made trainable."""
    module = _model()
    module[1].bias.requires_grad_(False)
    model = flatshard.shard(module, stage=1)
    model[1].bias.requires_grad_(True)
    return model(torch.randn(3, 4))


class _ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.real = nn.Linear(4, 4)
        self.rotation = nn.Parameter(torch.ones(4, dtype=torch.complex64))


def _deepcopy(which: str) -> Callable[[Path], object]:
    def run(tmp: Path) -> object:
        import copy

        model = _sharded(stage=3)
        return copy.deepcopy(model if which == "model" else _opt(model))

    return run


def _pickled(tmp: Path) -> object:
    return torch.save(_sharded(stage=1), tmp / "model.pt")


def _nested(tmp: Path) -> object:
    return flatshard.shard(nn.Sequential(flatshard.shard(nn.Linear(4, 4)), nn.Linear(4, 2)), stage=2)


def _second_derivative(tmp: Path) -> object:
    """A gradient penalty's backward (create_graph=True) at stage 3."""
    model = _sharded(stage=3)
    _opt(model)
    return model(torch.randn(3, 4)).square().sum().backward(create_graph=True)


def _rebound_while_sharded(tmp: Path) -> object:
    """``.data`` of a stage-3 param rebound outside ``summon_full_params`` (an EMA swap):
    the next gather would overwrite it."""
    model = _sharded(stage=3)
    model[0].weight.data = torch.zeros(4, 4)
    return model(torch.randn(3, 4))


def _replace_param(model: nn.Module) -> None:
    model[0].weight = nn.Parameter(torch.zeros(4, 4))


def _add_module(model: nn.Module) -> None:
    model.append(nn.Linear(2, 2))


def _truncated_piece(tmp: Path) -> Path:
    path = _saved(tmp)
    piece = path / "__0_0.distcp"
    piece.write_bytes(piece.read_bytes()[:-100])
    return path


def _missing_piece(tmp: Path) -> Path:
    path = _saved(tmp)
    (path / "__0_0.distcp").unlink()
    return path


def _wider() -> nn.Module:
    torch.manual_seed(0)
    return flatshard.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2)), stage=1)


def _cli(*argv: str) -> Callable[[Path], object]:
    """``flatshard ARGV`` in this process; a refusal is exit status 2 (argparse's too)."""

    def run(tmp: Path) -> object:
        args = [a.replace("TMP", str(tmp)) for a in argv]
        code = cli_main(args)
        raise SystemExit(code)

    return run


def _file(tmp: Path) -> Path:
    (tmp / "a-file").write_text("x")
    return tmp / "a-file"


def _into_torch_optimizer(tmp: Path) -> object:
    """A DistributedOptimizer's state dict loaded into a torch optimizer (it was
    ``KeyError: 'param_groups'``)."""
    model = _sharded()
    opt = _opt(model, lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return torch.optim.AdamW(nn.Linear(4, 4).parameters()).load_state_dict(opt.state_dict())
