"""Plain weights in and out: a checkpoint saved at any layout exports to one .safetensors or
.pt state dict that the unwrapped model loads and that gives the same outputs; a plain
state dict seeds a sharded run at full precision; both stream with bounded memory."""

import os
import zipfile

import pytest
import torch
from safetensors.torch import load_file, save_file

import flatshard
from _checkpoints import ADAMW, SGD, build, train
from _parity import CFG, TiedGPT, full_params
from flatshard import export_checkpoint, load_weights, save_checkpoint
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

X, Y = SyntheticCorpus(CFG.vocab_size, CFG.seq_len).batch(99, 0, 4)


def _trained_case(path: str, stage: int, optimizer=SGD, dtype=None):
    """Train 3 steps, save, and return the full params and the model's output on X."""
    model, opt, sched = build(stage, optimizer, dtype=dtype)
    train(model, opt, sched, range(3))
    save_checkpoint(path, model, opt)
    with torch.no_grad():
        logits = model(X)
    return {"params": [p.float() for p in full_params(model)], "logits": logits.float()}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_loads_into_the_plain_model_and_gives_the_same_outputs(tmp_path, suffix):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / f"model{suffix}")
    result = run_distributed(_trained_case, 3, path, 3)[0]
    entries = export_checkpoint(path, out, chunk_bytes=1000)  # many chunks per tensor
    plain = TiedGPT()
    state = load_file(out) if suffix == ".safetensors" else torch.load(out, weights_only=True)
    assert {e.name for e in entries} == set(state) == set(plain.state_dict())  # tied names too
    plain.load_state_dict(state, strict=True)
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), result["params"], strict=True))
    with torch.no_grad():
        assert torch.equal(plain(X), result["logits"])
    if suffix == ".pt":
        assert zipfile.ZipFile(out).testzip() is None  # every record's CRC-32 is right
        assert state["wte.weight"].data_ptr() == state["lm_head.weight"].data_ptr()  # still tied


def test_export_is_the_same_file_whatever_the_chunk_size_and_layout(tmp_path):
    files = []
    for world_size, stage, chunk in [(2, 1, 64), (4, 3, 1 << 20)]:
        path, out = str(tmp_path / f"ckpt{world_size}"), str(tmp_path / f"m{world_size}.safetensors")
        run_distributed(_trained_case, world_size, path, stage)
        export_checkpoint(path, out, chunk_bytes=chunk)
        with open(out, "rb") as f:
            files.append(f.read())
    first = load_file(str(tmp_path / "m2.safetensors"))
    second = load_file(str(tmp_path / "m4.safetensors"))
    assert max((first[k] - second[k]).abs().max().item() for k in first) < 1e-5
    assert len(files[0]) == len(files[1])


def test_export_of_mixed_precision_takes_the_fp32_main_params_unless_told(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_trained_case, 2, path, 2, ADAMW, dtype=torch.bfloat16)
    export_checkpoint(path, str(tmp_path / "main.pt"))
    export_checkpoint(path, str(tmp_path / "model.pt"), weights="model")
    export_checkpoint(path, str(tmp_path / "half.pt"), dtype=torch.float16)
    main, model, half = (
        torch.load(str(tmp_path / f"{n}.pt"), weights_only=True) for n in ("main", "model", "half")
    )
    frozen = "blocks.0.ln1.weight"  # no main param: exported as the model holds it
    assert main[frozen].dtype == torch.bfloat16
    trained = [k for k in main if k != frozen]
    assert all(main[k].dtype == torch.float32 and model[k].dtype == torch.bfloat16 for k in trained)
    assert all(torch.equal(main[k].bfloat16(), model[k]) for k in trained)  # params = main rounded
    assert any(not torch.equal(main[k], model[k].float()) for k in trained)  # main holds more bits
    assert all(half[k].dtype == torch.float16 and torch.equal(half[k], main[k].half()) for k in main)
    with pytest.raises(ValueError, match="weights must be one of"):
        export_checkpoint(path, str(tmp_path / "x.pt"), weights="master")
    with pytest.raises(ValueError, match=r"expected a \.safetensors or \.pt file"):
        export_checkpoint(path, str(tmp_path / "x.npz"))
    assert not os.path.exists(str(tmp_path / "x.npz.partial"))


# -- seeding a sharded run ---------------------------------------------------------------------------
def _reference_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return {k: v.clone() for k, v in TiedGPT().state_dict().items() if k != "lm_head.weight"}


def _seeded_case(source: str, stage: int, dtype=None, path: str | None = None):
    model, opt, sched = build(stage, ADAMW, seed=7, dtype=dtype)  # other initial values
    missing, unexpected = load_weights(model, source)
    if path is not None:
        save_checkpoint(path, model, opt)
    return {"losses": train(model, opt, sched, range(3)), "loaded": (missing, unexpected)}


@pytest.mark.parametrize(("world_size", "stage"), [(3, 3), (2, 1), (1, 0)])
def test_a_plain_state_dict_seeds_a_sharded_run(tmp_path, world_size, stage):
    """A safetensors file written by the safetensors library (tied name left out, as HF
    does) seeds the run: it trains exactly like a plain model that loaded it."""
    source = str(tmp_path / "pretrained.safetensors")
    save_file(_reference_weights(), source)
    seeded = run_distributed(_seeded_case, world_size, source, stage)[0]
    reference = run_distributed(_plain_case, 1, _reference_weights())[0]
    assert seeded["loaded"] == ([], [])
    assert max(abs(a - b) / b for a, b in zip(seeded["losses"], reference, strict=True)) < 1e-5


def _plain_case(weights):
    model, opt, sched = build(0, ADAMW, seed=7)
    model.load_state_dict({**weights, "lm_head.weight": weights["wte.weight"]})
    return train(model, opt, sched, range(3))


def test_seeding_16_bit_params_keeps_the_source_precision_in_the_main_params(tmp_path):
    """fp32 weights into bf16 params: the main params take the fp32 values exactly (the
    checkpoint exports them bit for bit), the params their rounding."""
    source, path = str(tmp_path / "pretrained.pt"), str(tmp_path / "ckpt")
    torch.save(_reference_weights(), source)
    run_distributed(_seeded_case, 2, source, 3, torch.bfloat16, path)
    export_checkpoint(path, str(tmp_path / "main.pt"))
    export_checkpoint(path, str(tmp_path / "model.pt"), weights="model")
    main = torch.load(str(tmp_path / "main.pt"), weights_only=True)
    model = torch.load(str(tmp_path / "model.pt"), weights_only=True)
    for name, value in _reference_weights().items():
        if name != "blocks.0.ln1.weight":  # frozen: no main param
            assert torch.equal(main[name], value), name
        assert torch.equal(model[name], value.bfloat16()), name


def test_hybrid_optimizer_masters_take_the_source_precision():
    torch.manual_seed(0)
    model = TiedGPT().bfloat16()
    opt = flatshard.HybridDeviceOptimizer(
        model.parameters(), offload_fraction=0.5, cpu_optimizer_class=torch.optim.AdamW
    )
    weights = _reference_weights()
    load_weights(model, weights, opt)
    names = {id(p): n for n, p in model.named_parameters()}
    masters = opt.masters()
    assert len(masters) == len(list(model.parameters()))
    for param, master in masters.items():
        assert torch.equal(master, weights[names[id(param)]])
        assert torch.equal(param, weights[names[id(param)]].bfloat16())


def test_bad_weights_are_refused_with_the_name():
    model = flatshard.shard(TiedGPT(), stage=0)
    weights = _reference_weights()
    with pytest.raises(KeyError, match=r"the state dict has no 'wte\.weight' \(1 of the model's"):
        load_weights(model, {k: v for k, v in weights.items() if k != "wte.weight"})
    with pytest.raises(KeyError, match=r"has 'extra\.bias', which the model does not"):
        load_weights(model, {**weights, "extra.bias": torch.zeros(2)})
    loose = load_weights(model, {**weights, "extra.bias": torch.zeros(2)}, strict=False)
    assert loose == ([], ["extra.bias"])
    with pytest.raises(ValueError, match=r"'wpe\.weight' has shape \(3, 32\) in the state dict, \(16, 32\)"):
        load_weights(model, {**weights, "wpe.weight": torch.zeros(3, 32)})
    with pytest.raises(FileNotFoundError, match="no weights file at"):
        load_weights(model, "/nonexistent/model.safetensors")


# -- bounded memory ----------------------------------------------------------------------------------
def _save_big(path: str) -> None:
    model = flatshard.shard(torch.nn.Sequential(*[torch.nn.Linear(2000, 2000) for _ in range(12)]), stage=0)
    flatshard.save_checkpoint(path, model)  # 12 x 16 MB


def _export_growth(path: str, out: str) -> int:
    """How far an export grows this process's peak RSS (a rank of its own: its peak is its
    own, from what it held when it started)."""
    import resource

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    before = peak()
    flatshard.export_checkpoint(path, out, chunk_bytes=4 << 20)
    return peak() - before


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("big") / "ckpt")
    run_distributed(_save_big, 1, path, timeout=240)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_export_streams_with_bounded_memory(tmp_path, suffix, big_checkpoint):
    """Exporting 192 MB of params grows the process's peak RSS by far less than that."""
    out = str(tmp_path / f"big{suffix}")
    (grown,) = run_distributed(_export_growth, 1, big_checkpoint, out, timeout=240)
    assert os.path.getsize(out) > 190e6
    assert grown < 80e6, f"peak RSS grew by {grown / 1e6:.0f} MB while exporting 192 MB"
