"""Fine-tuning end to end at stage 3, as an accelerate + peft user does it
([Note: pretrained directories] in checkpoint/pretrained.py): a Llama saved with
``save_pretrained`` is built on the meta device, wrapped in LoRA, sharded, filled by
``load_pretrained`` (each rank reading its shards), trained, asked to generate, and written
back as an adapter and as a merged model, which plain ``transformers``/``peft`` reload.

Equalities are exact where the arithmetic is the same (an unsharded model with the same
weights computes bitwise the same logits); the merged model computes ``(W + s·BA)x`` where
the adapter computed ``Wx + s·B(Ax)``: in fp32 each of the 3 layers' 7 matmuls (inner
dimension ≤ 64) may differ by about 64 · 2⁻²⁴ relative to the magnitudes summed, and the
error passes through the residual stream of 3 layers, each amplifying by at most ~5 (their
Lipschitz bound at these weights): ≲ 21 · 64 · 6e-8 · 5³ ≈ 1e-2 relative in the worst case,
1e-3 of the logits' scale as the bound used (errors of independent roundings add as a
square root, not linearly)."""

import pytest
import torch

import flatshard
from _finetune import LORA_TARGETS, prompt, tiny_llama
from flatshard.toolkit.models import lm_loss
from flatshard.toolkit.testing import run_distributed

peft = pytest.importorskip("peft")  # (in the dev extras: CI has it)
transformers = pytest.importorskip("transformers")

BATCH = torch.arange(1, 33).reshape(2, 16) % 90 + 1


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS)


def _lora_from_config(directory: str, device: str):
    """The model of ``directory``'s config with a LoRA adapter, built on ``device`` (at stage
    3 the meta device: nothing is allocated until each unit is materialized)."""
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device(device):
        base = transformers.AutoModelForCausalLM.from_config(config)
    return peft.get_peft_model(base, _lora_config())


def _job(base_dir: str, out: str, stage: int, offload: bool = False) -> dict:
    """``offload``: QLoRA-FSDP's use, the frozen base's shards and the adapters' optimizer on
    the host ([Note: memory tiers] in planner/offload.py), the same run to the bit."""
    rank = torch.distributed.get_rank()
    device = "meta" if stage == 3 else "cpu"  # (below stage 3 every rank holds the whole model)
    more = {"offload": flatshard.Offload()} if offload else {}
    model = flatshard.shard(
        _lora_from_config(base_dir, device), stage=stage, buckets=flatshard.Buckets(size=2000), **more
    )
    missing, unexpected = flatshard.load_pretrained(model, base_dir)
    with torch.no_grad():
        start = model(input_ids=BATCH).logits
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=3e-2)
    for step in range(3):
        x = (BATCH + 7 * (step + rank)) % 90 + 1
        lm_loss(model, x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=BATCH).logits
    tokens = model.generate(input_ids=prompt(rank), max_new_tokens=6, do_sample=False)
    flatshard.save_pretrained(model, f"{out}/adapter")
    flatshard.save_pretrained(model, f"{out}/merged", merged=True)
    full = model.full_state_dict()
    return {
        "missing": missing,
        "unexpected": unexpected,
        "start": start,
        "trained": trained,
        "tokens": tokens.tolist(),
        "full": full,
    }


@pytest.mark.parametrize(
    ("stage", "world_size", "offload"),
    [(3, 1, False), (3, 2, False), (3, 3, False), (2, 2, False), (3, 2, True)],
)
def test_load_train_generate_export_and_reload_with_plain_transformers(stage, world_size, offload, tmp_path):
    base_dir, out = str(tmp_path / "base"), str(tmp_path / "out")
    pretrained = tiny_llama(seed=0).eval()
    pretrained.save_pretrained(base_dir)
    results = run_distributed(_job, world_size, base_dir, out, stage, offload, timeout=300)
    r = results[0]
    assert r["missing"] == [] and r["unexpected"] == []
    with torch.no_grad():
        expected_start = pretrained(input_ids=BATCH).logits
    assert torch.equal(r["start"], expected_start)  # LoRA B starts at zero: the pretrained model
    # the same weights unsharded: a peft model with the gathered state dict
    reference = peft.get_peft_model(tiny_llama(seed=5), _lora_config()).eval()
    reference.load_state_dict(r["full"])
    with torch.no_grad():
        logits = reference(input_ids=BATCH).logits
    assert torch.equal(r["trained"], logits)
    scale = logits.abs().max().item()
    assert (logits - expected_start).abs().max().item() > 0.1 * scale  # (training moved it)
    for rank, got in enumerate(results):
        expected = reference.generate(input_ids=prompt(rank), max_new_tokens=6, do_sample=False)
        assert got["tokens"] == expected.tolist(), rank
    # the adapter, loaded by peft onto the pretrained base: the trained model, exactly
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    adapter = peft.PeftModel.from_pretrained(base, f"{out}/adapter").eval()
    with torch.no_grad():
        assert torch.equal(adapter(input_ids=BATCH).logits, logits)
    # the merged model, loaded by transformers alone: the trained model, up to rounding
    merged = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/merged").eval()
    with torch.no_grad():
        diff = (merged(input_ids=BATCH).logits - logits).abs().max().item()
    assert diff <= 1e-3 * scale, (diff, scale)


def _state_dict_in_summon() -> dict:
    model = flatshard.shard(tiny_llama(seed=0), stage=3, buckets=flatshard.Buckets(size=2000))
    try:
        model.state_dict()
        outside = None
    except RuntimeError as e:
        outside = str(e)
    with model.summon_full_params(writeback=False):
        inside = {k: v.clone() for k, v in model.state_dict().items()}
    return {"outside": outside, "inside": inside}


def test_state_dict_inside_summon_full_params_gives_full_tensors():
    for r in run_distributed(_state_dict_in_summon, 2):
        assert "summon_full_params" in r["outside"]
        expected = tiny_llama(seed=0).state_dict()
        assert set(r["inside"]) == set(expected)
        for k, v in expected.items():
            assert torch.equal(r["inside"][k], v), k


def test_save_pretrained_refuses_a_directory_that_holds_files(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    model = tiny_llama(seed=0)
    with pytest.raises(FileExistsError, match="not empty"):
        flatshard.save_pretrained(model, tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def _plain_job(out: str) -> dict:
    model = flatshard.shard(tiny_llama(seed=0), stage=3, buckets=flatshard.Buckets(size=2000))
    flatshard.save_pretrained(model, out, dtype=torch.bfloat16)
    return {"full": model.full_state_dict()}


def test_a_sharded_transformers_model_saves_a_directory_from_pretrained_loads(tmp_path):
    """Without peft: the model's own ``save_pretrained`` with the gathered state dict, cast on
    request; ``from_pretrained`` gives the same weights (rounded to bf16)."""
    (r, _) = run_distributed(_plain_job, 2, str(tmp_path / "out"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.bfloat16, name
        assert torch.equal(value, r["full"][name].to(torch.bfloat16)), name


def _split_job(out: str) -> dict:
    model = flatshard.shard(tiny_llama(seed=0), stage=3, buckets=flatshard.Buckets(size=2000))
    refused = []
    for bad in (0, "lots", True):  # (refused on every rank, before any gather)
        try:
            flatshard.save_pretrained(model, out, max_shard_size=bad)
        except ValueError as e:
            refused.append(str(e))
    flatshard.save_pretrained(model, out, max_shard_size="100KB")
    return {"full": model.full_state_dict(), "refused": refused}


def test_save_pretrained_splits_the_weights_at_max_shard_size(tmp_path):
    """As ``transformers``' own: files of at most 100 KB and an index; ``from_pretrained``
    gives the sharded model's weights, to the bit."""
    (r, other) = run_distributed(_split_job, 2, str(tmp_path / "out"))
    assert len(r["refused"]) == len(other["refused"]) == 3, r["refused"]
    assert all("max_shard_size must be" in message for message in r["refused"]), r["refused"]
    files = sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    assert len(files) >= 2 and (tmp_path / "out" / "model.safetensors.index.json").exists(), files
    assert all((tmp_path / "out" / f).stat().st_size <= 100_000 * 1.05 for f in files), files  # (+ header)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    for name, value in loaded.items():
        assert torch.equal(value, r["full"][name]), name


def test_an_adapter_is_one_file_and_max_shard_size_says_so(tmp_path):
    model = peft.get_peft_model(tiny_llama(seed=0), _lora_config())
    with pytest.raises(ValueError, match="adapter is written as one file"):
        flatshard.save_pretrained(model, tmp_path / "adapter", max_shard_size="1MB")
    assert not (tmp_path / "adapter").exists()
