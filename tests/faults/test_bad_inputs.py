"""The bad-input catalog: each case is refused with a documented ``Exception`` type whose
message names the bad value (the option, the file, the param), before anything is written
or stepped. Single-process cases run in a world of one; the ones that need ranks out of step
are in ``test_desync.py``, the ones about ranks that disagree at wrap time in
``stages/test_wrap_behavior.py``."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import flatshard
from _catalog import (
    Case,
    _add_module,
    _another_save_id,
    _changed_after_wrapping,
    _cli,
    _clip,
    _ComplexNet,
    _deepcopy,
    _file,
    _flip_a_data_byte,
    _garbage,
    _into_torch_optimizer,
    _load,
    _missing_piece,
    _model,
    _nan_grads_clipped,
    _nested,
    _opt,
    _peft_exported_for_from_pretrained,
    _pickled,
    _piece_of_another_save,
    _rebound_while_sharded,
    _replace_param,
    _save_over,
    _save_while_locked,
    _saved,
    _second_derivative,
    _sharded,
    _step_without_optimizer,
    _truncated_piece,
    _unfreeze_frozen,
    _user_dir,
    _user_lock_file,
    _wider,
    _with_manifest,
)
from _parity import NormalizedSGD

BF16 = torch.bfloat16
BF16_STATE = flatshard.OptimizerPrecision(state_dtype=BF16)

CASES = [
    # -- shard() ------------------------------------------------------------------------------
    Case("shard a str", lambda t: flatshard.shard("model"), TypeError, "got str"),
    Case("shard twice", lambda t: flatshard.shard(_sharded()), ValueError, "already sharded"),
    Case("stage 5", lambda t: flatshard.shard(_model(), stage=5), ValueError, "5"),
    Case("stage '1'", lambda t: flatshard.shard(_model(), stage="1"), (TypeError, ValueError), "'1'"),
    Case(
        "Buckets.size 0",
        lambda t: flatshard.shard(_model(), buckets=flatshard.Buckets(size=0)),
        ValueError,
        "Buckets.size.*0",
    ),
    Case(
        "Buckets.size 1.5",
        lambda t: flatshard.shard(_model(), buckets=flatshard.Buckets(size=1.5)),
        ValueError,
        "1.5",
    ),
    Case(
        "Buckets.per_launch 0",
        lambda t: flatshard.shard(_model(), buckets=flatshard.Buckets(per_launch=0)),
        ValueError,
        "0",
    ),
    Case("grad_scale inf", lambda t: flatshard.shard(_model(), grad_scale=float("inf")), ValueError, "inf"),
    Case("grad_scale nan", lambda t: flatshard.shard(_model(), grad_scale=float("nan")), ValueError, "nan"),
    Case("grad_scale 0", lambda t: flatshard.shard(_model(), grad_scale=0), ValueError, "grad_scale.* 0"),
    Case("timeout -5", lambda t: flatshard.shard(_model(), timeout=-5), ValueError, "timeout.*-5"),
    Case("group 'abc'", lambda t: flatshard.shard(_model(), group="abc"), TypeError, "group.*str"),
    Case(
        "stage-3 option at stage 2",
        lambda t: flatshard.shard(_model(), stage=2, stage3=flatshard.Stage3(backward_prefetch="post")),
        ValueError,
        "backward_prefetch.*stage 2",
    ),
    Case(
        "units at stage 1",
        lambda t: flatshard.shard(_model(), stage=1, stage3=flatshard.Stage3(units=[nn.Linear])),
        ValueError,
        "units.*stage 1",
    ),
    Case(
        "backward_prefetch 'later'",
        lambda t: flatshard.shard(_model(), stage=3, stage3=flatshard.Stage3(backward_prefetch="later")),
        ValueError,
        "'later'",
    ),
    Case(
        "ignored_modules at stage 2",
        lambda t: flatshard.shard(
            _model(), stage=2, stage3=flatshard.Stage3(ignored_modules=[nn.Linear(2, 2)])
        ),
        ValueError,
        "ignored_modules.*stage 2",
    ),
    Case(
        "a DataParallel module",
        lambda t: flatshard.shard(nn.DataParallel(_model())),
        (TypeError, ValueError),
        "DataParallel",
    ),
    Case(
        "param_dtype int8",
        lambda t: flatshard.shard(_model(), mixed_precision=flatshard.MixedPrecision(param_dtype=torch.int8)),
        (TypeError, ValueError),
        "int8",
    ),
    # -- DistributedOptimizer -------------------------------------------------------------------
    Case("optimizer over a plain module", lambda t: _opt(_model()), (TypeError, ValueError), "Sequential"),
    Case("optimizer_class a str", lambda t: _opt(cls="AdamW"), TypeError, "'AdamW'"),
    Case("LBFGS (not elementwise)", lambda t: _opt(cls=torch.optim.LBFGS), ValueError, "LBFGS"),
    Case("lr 'abc'", lambda t: _opt(lr="abc"), TypeError, "'abc'"),
    Case("lr -1", lambda t: _opt(lr=-1), ValueError, "-1"),
    Case("betas of one", lambda t: _opt(betas=(0.9,)), ValueError, r"\(0\.9,\)"),
    Case("unknown hyperparameter", lambda t: _opt(lrr=1e-3), TypeError, "lrr"),
    Case(
        "a group's lr 'x'",
        lambda t: (m := _sharded()) and _opt(m, params=[{"params": [m[0].weight], "lr": "x"}]),
        TypeError,
        "param group 0: lr='x'",
    ),
    Case("params []", lambda t: _opt(params=[]), ValueError, "empty"),
    Case("precision 'bf16'", lambda t: _opt(precision="bf16"), TypeError, "precision.*'bf16'"),
    Case(
        "state_dtype float16",
        lambda t: flatshard.OptimizerPrecision(state_dtype=torch.float16),
        ValueError,
        "state_dtype.*float16",
    ),
    Case(
        "bf16 main params of fp32 params",
        lambda t: _opt(precision=flatshard.OptimizerPrecision(main_dtype=torch.bfloat16)),
        ValueError,
        "main_dtype=torch.bfloat16.*float32.*MixedPrecision",
    ),
    Case(
        "bf16 state with a class stepped whole",
        lambda t: _opt(cls=NormalizedSGD, precision=BF16_STATE, lr=0.1),
        ValueError,
        "NormalizedSGD.*stepped per param",
    ),
    Case(
        "grad_dtype float16",
        lambda t: flatshard.MixedPrecision(torch.bfloat16, grad_dtype=torch.float16),
        ValueError,
        "grad_dtype.*float16",
    ),
    Case(
        "bf16 grads with a class stepped whole",
        lambda t: _opt(
            flatshard.shard(_model(), mixed_precision=flatshard.MixedPrecision(BF16, grad_dtype=BF16)),
            cls=NormalizedSGD,
            lr=0.1,
        ),
        ValueError,
        "grad_dtype=torch.bfloat16.*NormalizedSGD",
    ),
    Case(
        "bf16 state inside the hybrid optimizer",
        lambda t: _opt(cls=flatshard.HybridDeviceOptimizer, precision=BF16_STATE, lr=0.1),
        ValueError,
        "HybridDeviceOptimizer.*own copies",
    ),
    Case(
        "a foreign tensor in params",
        lambda t: _opt(params=[nn.Parameter(torch.zeros(3, 5))]),
        ValueError,
        r"\(3, 5\)",
    ),
    Case(
        "a param in two groups",
        lambda t: (
            (m := _sharded()) and _opt(m, params=[{"params": [m[0].weight]}, {"params": [m[0].weight]}])
        ),
        ValueError,
        "0.weight",
    ),
    Case("two optimizers", lambda t: (m := _sharded()) and (_opt(m), _opt(m)), ValueError, "already has"),
    Case("loss_scale 'huge'", lambda t: _opt(loss_scale="huge"), ValueError, "'huge'"),
    Case(
        "a stage-2 backward with no optimizer", _step_without_optimizer, RuntimeError, "DistributedOptimizer"
    ),
    Case(
        "owner assignment 'x'",
        lambda t: flatshard.OwnerShardedOptimizer(
            _model().parameters(), torch.optim.SGD, assignment="x", lr=1
        ),
        ValueError,
        "'x'",
    ),
    Case(
        "owner bucket_cap_bytes -1",
        lambda t: flatshard.OwnerShardedOptimizer(
            _model().parameters(), torch.optim.SGD, bucket_cap_bytes=-1, lr=1
        ),
        ValueError,
        "-1",
    ),
    # -- checkpoints and weights ----------------------------------------------------------------
    Case("save over a user's directory", _save_over(_user_dir), FileExistsError, "mine"),
    Case("save over a user's file", _save_over(_file), FileExistsError, "a-file"),
    Case(
        "save where PATH.old is a user's",
        _save_over(lambda t: _user_dir(t).rename(t / "x.old") and t / "x"),
        FileExistsError,
        r"x\.old",
    ),
    Case(
        "an unpicklable extra",
        lambda t: flatshard.save_checkpoint(t / "c", _sharded(), extra={"fn": lambda: 0}),
        flatshard.CheckpointError,
        "lambda",
    ),
    Case("load from nowhere", lambda t: _load(t / "nowhere"), FileNotFoundError, "nowhere"),
    Case(
        "load a directory without a manifest",
        lambda t: _load(_user_dir(t)),
        flatshard.CheckpointError,
        "mine.*flatshard.json",
    ),
    Case(
        "a manifest that is not JSON",
        lambda t: _load(_with_manifest(t, "{not json")),
        flatshard.CheckpointError,
        "flatshard.json is not JSON",
    ),
    Case(
        "a manifest of another format",
        lambda t: _load(_with_manifest(t, json.dumps({"format": "other/9"}))),
        flatshard.CheckpointError,
        "other/9",
    ),
    Case("a flipped byte", lambda t: _load(_flip_a_data_byte(t)), flatshard.ChecksumError, r"\.distcp"),
    Case(
        "a model of other shapes",
        lambda t: _load(_saved(t), flatshard.shard(nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2)), stage=1)),
        ValueError,
        r"0\.weight",
    ),
    Case(
        "an extra key the checkpoint lacks",
        lambda t: flatshard.load_checkpoint(_saved(t), _sharded(), extra={"sched": object()}),
        KeyError,
        "sched",
    ),
    Case(
        "random bytes as .safetensors",
        lambda t: flatshard.load_weights(_sharded(), _garbage(t, "w.safetensors")),
        flatshard.CheckpointError,
        r"w\.safetensors",
    ),
    Case(
        "random bytes as .pt",
        lambda t: flatshard.load_weights(_sharded(), _garbage(t, "w.pt")),
        flatshard.CheckpointError,
        r"w\.pt",
    ),
    Case(
        "weights from nowhere",
        lambda t: flatshard.load_weights(_sharded(), t / "none.safetensors"),
        FileNotFoundError,
        "none.safetensors",
    ),
    Case(
        "export to an unknown suffix",
        lambda t: flatshard.export_checkpoint(_saved(t), t / "out.txt"),
        ValueError,
        r"out\.txt",
    ),
    Case(
        "verify a user's directory",
        lambda t: flatshard.verify_checkpoint(_user_dir(t)),
        flatshard.CheckpointError,
        "mine",
    ),
    # -- the CLI (exit status 2, the reason on stderr) -----------------------------------------
    Case("train --stage 7", _cli("train", "-n", "1", "--stage", "7"), SystemExit, "--stage.*7"),
    Case("train --lr abc", _cli("train", "-n", "1", "--lr", "abc"), SystemExit, "--lr.*abc"),
    Case("train --steps 0", _cli("train", "-n", "1", "--steps", "0"), SystemExit, "--steps.*0"),
    Case("train --timeout -1", _cli("train", "-n", "1", "--timeout", "-1"), SystemExit, "--timeout.*-1"),
    Case("train --model nosuch", _cli("train", "-n", "1", "--model", "nosuch"), SystemExit, "nosuch"),
    Case(
        "train --checkpoint-dir a file",
        lambda t: _file(t) and _cli("train", "-n", "1", "--checkpoint-dir", "TMP/a-file")(t),
        SystemExit,
        "a-file is a file",
    ),
    Case(
        "train --resume alone",
        _cli("train", "-n", "1", "--resume"),
        SystemExit,
        "--resume needs --checkpoint-dir",
    ),
    Case(
        "train --data nowhere",
        _cli("train", "-n", "1", "--data", "TMP/nowhere.txt"),
        SystemExit,
        "nowhere.txt",
    ),
    Case("plan --params -5", _cli("plan", "--params", "-5"), SystemExit, "--params.*-5"),
    Case("layout --stage 9", _cli("layout", "--stage", "9"), SystemExit, "--stage.*9"),
    Case("verify nowhere", _cli("verify", "TMP/nowhere"), SystemExit, "nowhere"),
    # each of these trained wrong or lost a checkpoint without a word ([Note: never silent] in errors.py)
    Case(
        "shard sync_module_states='no'",
        lambda t: flatshard.shard(_model(), sync_module_states="no"),
        TypeError,
        "sync_module_states.*'no'",
    ),
    Case(
        "shard broadcast_buffers=1",
        lambda t: flatshard.shard(_model(), broadcast_buffers=1),
        TypeError,
        "broadcast_buffers.*1",
    ),
    Case(
        "shard find_unused_parameters=None",
        lambda t: flatshard.shard(_model(), find_unused_parameters=None),
        TypeError,
        "find_unused_parameters.*None",
    ),
    Case(
        "optimizer nonfinite='no'",
        lambda t: _opt(nonfinite="no"),
        ValueError,
        "nonfinite.*'no'",
    ),
    Case("clip_grad_norm_(nan)", _clip(float("nan")), ValueError, "max_norm.*nan"),
    Case("clip_grad_norm_(-1)", _clip(-1.0), ValueError, "max_norm.*-1"),
    Case("clip_grad_norm_('1')", _clip("1"), ValueError, "max_norm.*'1'"),
    Case(
        "clip_grad_norm_ of NaN grads, error_if_nonfinite",
        _nan_grads_clipped,
        RuntimeError,
        "non-finite.*'0.weight'",
    ),
    Case(
        "save while another save holds the path",
        _save_while_locked,
        FileExistsError,
        r"another save to .*ckpt is in progress",
    ),
    Case(
        "save beside a user's PATH.lock",
        _user_lock_file,
        FileExistsError,
        r"ckpt\.lock exists and is not a flatshard save lock",
    ),
    Case(
        "load a piece file of another save",
        lambda t: _load(_piece_of_another_save(t)),
        flatshard.ChecksumError,
        r"a/__0_0\.distcp.*another save",
    ),
    Case(
        "verify a piece file of another save",
        lambda t: flatshard.verify_checkpoint(_piece_of_another_save(t)),
        flatshard.ChecksumError,
        r"a/__0_0\.distcp.*another save",
    ),
    Case(
        "load under another save id",
        lambda t: _load(_another_save_id(t)),
        flatshard.ChecksumError,
        r"ckpt/__0_0\.distcp.*another save",
    ),
    Case(
        "a param replaced after shard()",
        _changed_after_wrapping(_replace_param),
        RuntimeError,
        r"param '0\.weight' was replaced",
    ),
    Case(
        "a frozen param made trainable after shard()",
        _unfreeze_frozen,
        RuntimeError,
        r"param '1\.bias' has requires_grad=True, False when wrapped",
    ),
    Case("a complex param", lambda t: flatshard.shard(_ComplexNet()), ValueError, r"'rotation' is complex"),
    Case(
        "nn.Embedding(sparse=True)",
        lambda t: flatshard.shard(nn.Sequential(nn.Embedding(8, 4, sparse=True), nn.Linear(4, 2))),
        ValueError,
        r"submodule '0' \(Embedding\(sparse=True\)\) gives sparse grads",
    ),
    Case(
        "backward(create_graph=True) at stage 3",
        _second_derivative,
        flatshard.ShardedParamError,
        r"create_graph=True reached unit '.*' at stage 3.*Use stage 2",
    ),
    Case(
        "export_checkpoint of a peft model as model.safetensors",
        _peft_exported_for_from_pretrained,
        ValueError,
        r"holds a peft model .*'model\.safetensors' is a file from_pretrained reads.*save_pretrained",
    ),
    Case(
        ".data rebound at stage 3 outside summon_full_params",
        _rebound_while_sharded,
        flatshard.ShardedParamError,
        r"param '0\.weight'.*rebound while sharded.*summon_full_params",
    ),
    Case("shard() inside shard()", _nested, ValueError, r"submodule '0' is already sharded.*Stage3\(units="),
    Case(
        "copy.deepcopy(model)", _deepcopy("model"), TypeError, r"deepcopy of a Sequential.*before shard\(\)"
    ),
    Case(
        "copy.deepcopy(optimizer)", _deepcopy("optimizer"), TypeError, r"deepcopy of a DistributedOptimizer"
    ),
    Case(
        "a DistributedOptimizer's state_dict into a torch optimizer",
        _into_torch_optimizer,
        KeyError,
        r"'param_groups': this is a flatshard DistributedOptimizer's state dict",
    ),
    Case(  # (it was "Can't pickle <class ...>: it's not the same object as ...")
        "torch.save(model)", _pickled, TypeError, r"torch.save or pickle of a Sequential.*full_state_dict"
    ),
    Case(
        "a module added after shard()",
        _changed_after_wrapping(_add_module),
        RuntimeError,
        r"module '\(root\)' has child modules \['0', '1', '2'\]",
    ),
    Case(
        "mixed_precision 'bf16'",
        lambda t: flatshard.shard(_model(), mixed_precision="bf16"),
        TypeError,
        "mixed_precision.*'bf16'",
    ),
    Case(
        "Experts match a str",
        lambda t: flatshard.Experts(None, "experts"),
        TypeError,
        "match.*'experts'",
    ),
    Case(
        "extra a list",
        lambda t: flatshard.save_checkpoint(t / "ckpt", _sharded(), extra=[1, 2]),
        TypeError,
        r"extra.*\[1, 2\]",
    ),
    Case(
        "restore_rng 'yes'",
        lambda t: flatshard.load_checkpoint(_saved(t), _sharded(), restore_rng="yes"),
        TypeError,
        "restore_rng.*'yes'",
    ),
    Case(
        "a truncated piece file",
        lambda t: _load(_truncated_piece(t)),
        flatshard.CheckpointError,
        r"__0_0\.distcp has \d+ bytes, \d+ when it was written",
    ),
    Case(
        "a missing piece file",
        lambda t: _load(_missing_piece(t)),
        flatshard.CheckpointError,
        r"file __0_0\.distcp is missing",
    ),
    Case(
        "a model with one more layer", lambda t: _load(_saved(t), _wider()), KeyError, r"has no '2\.weight'"
    ),
    Case(
        "export weights 'both'",
        lambda t: flatshard.export_checkpoint(_saved(t), t / "w.safetensors", weights="both"),
        ValueError,
        "weights.*'both'",
    ),
    Case(
        "export chunk_bytes 0",
        lambda t: flatshard.export_checkpoint(_saved(t), t / "w.safetensors", chunk_bytes=0),
        ValueError,
        "chunk_bytes.*0",
    ),
    Case(
        "load_weights lacking a key",
        lambda t: flatshard.load_weights(_sharded(), {"0.weight": torch.zeros(4, 4)}),
        KeyError,
        r"no '0\.bias'",
    ),
    Case(
        "unit_bytes 0",
        lambda t: flatshard.shard(_model(), stage=3, stage3=flatshard.Stage3(unit_bytes=0)),
        ValueError,
        "unit_bytes.*0",
    ),
    Case(
        "forward_prefetch -1",
        lambda t: flatshard.shard(_model(), stage=3, stage3=flatshard.Stage3(forward_prefetch=-1)),
        ValueError,
        "forward_prefetch.*-1",
    ),
    Case(
        "limit_all_gathers 0",
        lambda t: flatshard.shard(_model(), stage=3, stage3=flatshard.Stage3(limit_all_gathers=0)),
        ValueError,
        "limit_all_gathers.*0",
    ),
    Case(
        "whole_params 'x'",
        lambda t: flatshard.shard(_model(), stage=2, whole_params="x"),
        TypeError,
        "whole_params.*str",
    ),
    Case(
        "reduce_dtype int32",
        lambda t: flatshard.MixedPrecision(reduce_dtype=torch.int32),
        ValueError,
        "reduce_dtype.*int32",
    ),
    Case(
        "hybrid offload_fraction 1.5",
        lambda t: flatshard.HybridDeviceOptimizer(
            _model().parameters(), offload_fraction=1.5, cpu_optimizer_class=torch.optim.AdamW, lr=0.1
        ),
        ValueError,
        "offload_fraction.*1.5",
    ),
    Case("loss_scale -1", lambda t: _opt(loss_scale=-1.0), ValueError, "loss scale.*-1"),
    Case(
        "plan_layout world_size 0",
        lambda t: flatshard.plan_layout(
            [flatshard.ParamSpec("a", 4, torch.float32, torch.float32)], world_size=0, bucket_size=10
        ),
        ValueError,
        "world_size.*0",
    ),
]


def test_the_catalog_is_at_least_forty_cases_and_each_is_named_once():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_with_a_clear_error(case, tmp_path, capsys):
    with pytest.raises(case.error) as caught:
        case.run(tmp_path)
    if isinstance(caught.value, SystemExit):
        assert caught.value.code not in (0, None), "a refusal must exit non-zero"
        message = capsys.readouterr().err
    else:
        message = str(caught.value)
        assert isinstance(caught.value, Exception)  # (not a BaseException: except Exception sees it)
    assert re.search(case.names, message, re.S), (
        f"{case.name}: the message does not name the value:\n{message}"
    )


def test_params_on_another_cuda_device_than_the_current_one_are_refused_under_nccl(monkeypatch):
    """Under NCCL the control collectives run on the current device: params on cuda:3 with
    cuda:0 current (a torchrun script that never called set_device) would put every rank on
    cuda:0, which NCCL refuses or hangs on. Refused before any collective, naming the fix; gloo
    (host control tensors) and a matching current device are left alone. (CUDA is faked: the
    rule reads only the current device's index.)"""
    from flatshard.wrap.arguments import check_current_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ValueError, match=re.escape("cuda:3 but the current CUDA device is cuda:0")) as e:
        check_current_device(torch.device("cuda", 3), "nccl")
    assert "torch.cuda.set_device(3)" in str(e.value)
    check_current_device(torch.device("cuda", 3), "gloo")
    check_current_device(torch.device("cuda", 0), "nccl")
    check_current_device(torch.device("cpu"), "nccl")


def test_shard_under_a_launcher_before_the_process_group_is_refused(monkeypatch):
    """torchrun sets WORLD_SIZE; a script that shards before init_process_group got a world of
    one on every rank, each training alone without a word (DDP raises: no default group)."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 in the environment but no process group"):
        flatshard.shard(nn.Linear(4, 4))
    monkeypatch.setenv("WORLD_SIZE", "1")
    flatshard.shard(nn.Linear(4, 4))  # (a launcher's world of one is one)
