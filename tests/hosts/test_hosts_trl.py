"""flatshard under TRL's trainers, which build on ``transformers.Trainer``
(``flatshard.hosts.hf.sharded(trl.SFTTrainer)``, [Note: hosted training] in ``hosts/hf.py``),
against TRL's own trainer on the plain model (its DDP) doing the same job, with a tokenizer
built here (no download): SFT on pre-tokenized sequences, LoRA SFT, DPO with a reference
model and LoRA DPO, on 2 ranks.

Tolerance: 1e-5 relative on the logged loss and grad norm, as ``test_hosts_hf.py`` derives
for the Trainer (fp32, AdamW's first steps, the same terms summed in another order).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _hosted import SETTINGS, logged_steps
from flatshard.toolkit.models import tiny_model
from flatshard.toolkit.testing import run_distributed

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
SEQ = 16
VOCAB = 256


def _tokenizer():
    """A word-level tokenizer over the tiny model's vocabulary: token ``i`` is the word ``str(i)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {str(i): i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    core = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")


def _data():
    ids = torch.randint(1, VOCAB - 2, (32, SEQ), generator=torch.Generator().manual_seed(0))
    return datasets.Dataset.from_dict({"input_ids": ids.tolist()})


def _config(out: str, config=None, **overrides):
    """``config`` (TRL's ``SFTConfig`` by default) with the settings every hosted run shares."""
    own = {"bf16": False, "gradient_checkpointing": False, "max_length": SEQ}  # (TRL's defaults differ)
    return (config or trl.SFTConfig)(**{**SETTINGS, **own, "output_dir": out, **overrides})


_logged = logged_steps


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", seq_len=SEQ)


def _sft_against_ddp(stages: list[int], out: str) -> dict:
    from flatshard.hosts import hf

    model, data, tokenizer = _model(), _data(), _tokenizer()
    reference = trl.SFTTrainer(
        model=copy.deepcopy(model), args=_config(f"{out}/ddp"), train_dataset=data, processing_class=tokenizer
    )
    reference.train()
    logged = {"ddp": _logged(reference)}
    sft = hf.sharded(trl.SFTTrainer)
    for stage in stages:
        trainer = sft(
            model=copy.deepcopy(model),
            args=_config(f"{out}/{stage}"),
            train_dataset=data,
            processing_class=tokenizer,
            shard=stage,
        )
        trainer.train()
        logged[stage] = _logged(trainer)
    return logged


def test_sft_follows_trls_ddp_at_every_stage(tmp_path):
    for logged in run_distributed(_sft_against_ddp, 2, [0, 1, 2, 3], str(tmp_path), init=False):
        want = logged.pop("ddp")
        assert len(want) == 4 and all(norm > 0.5 for _, norm in want), want  # (every step clips)
        for stage, got in logged.items():
            assert len(got) == len(want), (stage, got)
            for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
                assert loss == pytest.approx(loss_ref, rel=1e-5), (stage, got, want)
                assert norm == pytest.approx(norm_ref, rel=1e-5), (stage, got, want)


def _lora_sft_against_ddp(stages: list[int], out: str) -> dict:
    """``peft_config=`` on both sides: TRL adds the adapters to the plain model under its DDP;
    flatshard's host adds them before sharding."""
    from peft import LoraConfig

    from flatshard.hosts import hf

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    data, tokenizer = _data(), _tokenizer()
    more = {"learning_rate": 1e-2, "max_grad_norm": 0.1}  # (LoRA B starts at zero: small grads)
    common = {"train_dataset": data, "processing_class": tokenizer, "peft_config": config}
    reference = trl.SFTTrainer(model=_model(), args=_config(f"{out}/ddp", **more), **common)
    reference.train()
    logged = {"ddp": _logged(reference)}
    for stage in stages:
        trainer = hf.sharded(trl.SFTTrainer)(
            model=_model(), args=_config(f"{out}/{stage}", **more), shard=stage, **common
        )
        trainer.train()
        logged[stage] = _logged(trainer)
        logged[f"trainable {stage}"] = _trainable(trainer.model)
    logged["trainable ddp"] = _trainable(reference.model)
    return logged


def _trainable(model) -> list[str]:
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


def test_lora_sft_with_peft_config_follows_trls_ddp(tmp_path):
    for logged in run_distributed(_lora_sft_against_ddp, 2, [2, 3], str(tmp_path), init=False):
        want = logged.pop("ddp")
        names = logged.pop("trainable ddp")
        assert names and all("lora_" in n for n in names), names
        for stage in (2, 3):
            assert logged.pop(f"trainable {stage}") == names, stage
        assert len(want) == 4 and all(norm > 0.1 for _, norm in want), want  # (every step clips)
        for stage, got in logged.items():
            for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
                assert loss == pytest.approx(loss_ref, rel=1e-5), (stage, got, want)
                assert norm == pytest.approx(norm_ref, rel=1e-5), (stage, got, want)


def _preferences():
    """16 (prompt, chosen, rejected) triples of the tokenizer's words."""
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(str(int(t)) for t in torch.randint(1, VOCAB - 2, (n,), generator=g))

    return datasets.Dataset.from_list(
        [{"prompt": words(6), "chosen": words(6), "rejected": words(6)} for _ in range(16)]
    )


def _dpo_against_ddp(runs: list[tuple[int, bool]], out: str) -> dict:
    """DPO with a plain reference model passed in (TRL rebuilds one from the model's hub path
    otherwise, which a model built from a config has not), or with LoRA through
    ``peft_config=`` and no reference model: the reference is the model with its adapters
    disabled (``disable_adapter()``: params frozen for a while, ``wrap/changes.py``)."""
    from peft import LoraConfig

    from flatshard.hosts import hf

    data, tokenizer = _preferences(), _tokenizer()
    logged: dict = {}
    for stage, lora in [(None, False), (None, True), *runs]:
        key = ("ddp" if stage is None else stage, lora)
        if key in logged:
            continue
        args = _config(f"{out}/{key}", trl.DPOConfig, max_steps=3)
        more = (
            {"peft_config": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])}
            if lora
            else {}
        )
        if not lora:
            more["ref_model"] = _model()
        host = trl.DPOTrainer if stage is None else hf.sharded(trl.DPOTrainer)
        sharding = {} if stage is None else {"shard": stage}
        trainer = host(
            model=_model(), args=args, train_dataset=data, processing_class=tokenizer, **more, **sharding
        )
        trainer.train()
        logged[key] = _logged(trainer)
        if not lora and stage is not None:  # (at stage 3 the reference is sharded too)
            logged[("reference sharded", stage)] = hasattr(trainer.ref_model, "flatshard_state")
    return logged


def test_dpo_follows_trls_ddp_with_a_reference_model_and_with_lora(tmp_path):
    runs = [(2, False), (3, False), (3, True)]
    for logged in run_distributed(_dpo_against_ddp, 2, runs, str(tmp_path), init=False):
        assert logged[("reference sharded", 3)] and not logged[("reference sharded", 2)], logged
        for stage, lora in runs:
            want, got = logged[("ddp", lora)], logged[(stage, lora)]
            assert len(want) == 3 and want[-1][0] < want[0][0], want  # (the preference loss falls)
            for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
                assert loss == pytest.approx(loss_ref, rel=1e-5), (stage, lora, got, want)
                assert norm == pytest.approx(norm_ref, rel=1e-5), (stage, lora, got, want)
