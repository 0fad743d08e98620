"""``--model hf:TYPE`` for the causal LMs users fine-tune: each type's tiny config
(``models.hf.tiny_config``: the type's own defaults shrunk to fit, key-value heads, head
size, rotary size, experts and windows included) builds, shards at stage 3 on 2 ranks,
computes the plain model's loss before training, and trains (AdamW, lr 2e-3, on a fixed
batch: the loss falls on every rank). The list is the families a fine-tune starts from; the
sweep below tries every type ``transformers`` offers, on one rank."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import flatshard
from _early import Early, lower_priority
from flatshard.toolkit.models import lm_loss, model_factory, tiny_model
from flatshard.toolkit.testing import run_distributed

transformers = pytest.importorskip("transformers")

TYPES = [
    *("llama", "gpt2", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"),
    *("qwen2_moe", "qwen3_moe", "phi", "gpt_neox", "olmo", "olmo2", "starcoder2", "stablelm"),
    *("cohere", "granite", "gemma3_text", "smollm3", "glm", "gpt_bigcode", "bloom", "mpt", "opt"),
]


def _train_each(types: list[str]) -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    for kind in types:
        torch.manual_seed(0)
        plain = tiny_model(kind, seq_len=32).eval()
        torch.manual_seed(0)
        model = flatshard.shard(
            tiny_model(kind, seq_len=32), stage=3, buckets=flatshard.Buckets(size=4000)
        ).eval()
        x = torch.randint(1, 256, (2, 17), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            before, expected = lm_loss(model, x[:, :-1], x[:, 1:]), lm_loss(plain, x[:, :-1], x[:, 1:])
        opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=2e-3)
        model.train()
        for _ in range(3):
            lm_loss(model, x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            after = lm_loss(model, x[:, :-1], x[:, 1:])
        out[kind] = (before.item(), expected.item(), after.item())
    return out


def test_every_listed_type_builds_shards_and_trains_at_stage_3():
    for rank, result in enumerate(run_distributed(_train_each, 2, TYPES, timeout=600)):
        for kind, (before, expected, after) in result.items():
            # the same weights compute the same loss: each unit's params are exact copies
            assert abs(before - expected) <= 1e-6 * abs(expected), (kind, rank, before, expected)
            assert after < before, (kind, rank, before, after)


def test_model_path_builds_the_causal_lm_a_directory_configures(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    model = model_factory(str(tmp_path))()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    model = model_factory(str(tmp_path / "config.json"))()
    assert type(model).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="not a transformers config"):
        model_factory(str(tmp_path / "nothing.json"))()


# -- every causal LM type the installed transformers offers ---------------------------------------
MAX_TINY_PARAMS = 3_000_000  # a tiny config still larger keeps full-size fields tiny_config does not know


def _every_type() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _too_large(kind: str) -> str | None:
    """Why the tiny config of ``kind`` is no tiny model (counted on the meta device), or None."""
    from transformers import AutoModelForCausalLM

    from flatshard.toolkit.models.hf import tiny_config

    with torch.device("meta"):
        count = sum(
            p.numel() for p in AutoModelForCausalLM.from_config(tiny_config(kind, seq_len=32)).parameters()
        )
    if count > MAX_TINY_PARAMS:
        return f"its tiny config still has {count:,} params (fields tiny_config does not shrink)"
    return None


def _plain_fails(kind: str) -> str | None:
    """Why the tiny model of ``kind`` cannot train even without flatshard, or None."""
    try:
        torch.manual_seed(0)
        plain = tiny_model(kind, seq_len=32)
        x = torch.randint(1, 256, (2, 17))
        lm_loss(plain, x[:, :-1], x[:, 1:]).backward()
    except Exception as e:  # (any error of transformers' own, unwrapped)
        return _cannot(e)
    return None


def _cannot(e: Exception) -> str:
    return f"does not build or run from a tiny config on CPU: {type(e).__name__}: {str(e)[:160]}"


def _sweep(kinds: list[str]) -> dict:
    """Each type trained at stage 3; where that fails, the same model without flatshard is
    tried: if it fails too, the type is skipped with its reason (the plain model is built
    only then, so a type that trains is built twice, not three times)."""
    import warnings

    lower_priority()  # (an early job's ranks, as the job: new processes, dropped after)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    out = {}
    for kind in kinds:
        try:
            reason = _too_large(kind)
        except Exception as e:
            reason = _cannot(e)
        if reason is not None:
            out[kind] = ("skip", reason)
            continue
        try:
            out[kind] = ("ran", *_train_each([kind])[kind])
        except Exception as e:
            reason = _plain_fails(kind)
            out[kind] = ("skip", reason) if reason is not None else ("failed", f"{type(e).__name__}: {e}")
    return out


def _both_halves() -> dict:
    """Two one-rank runs side by side (two cores), each taking every other type."""
    kinds = _every_type()
    with ThreadPoolExecutor(2) as pool:
        halves = pool.map(
            lambda part: run_distributed(_sweep, 1, part, timeout=900, reuse=False)[0],
            (kinds[::2], kinds[1::2]),
        )
        return {k: v for half in halves for k, v in half.items()}


SWEEP = Early(__file__, _both_halves)  # ([Note: early starts] in _early.py)


@pytest.fixture(scope="module")
def sweep() -> dict:
    return SWEEP.result()


@pytest.mark.parametrize("kind", _every_type())
def test_every_causal_lm_type_that_builds_on_cpu_trains_at_stage_3(kind, sweep):
    """One rank (the ranks' side is the 26 types above): each type whose tiny config builds
    and runs on CPU without flatshard shards at stage 3, computes the same loss and trains;
    the others are skipped with the reason."""
    outcome, *detail = sweep[kind]
    if outcome == "skip":
        pytest.skip(detail[0])
    assert outcome == "ran", detail
    before, expected, after = detail
    assert abs(before - expected) <= 1e-6 * abs(expected), (before, expected)
    assert after < before, (before, after)
