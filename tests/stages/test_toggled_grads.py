"""Trainable params frozen for a while after ``shard()`` ([Note: never silent]; the rule in
wrap/changes.py): peft's ``disable_adapter()`` (how TRL computes LoRA DPO's reference) and
DeepSpeed-style steps that train a different part of the model each time, and params frozen
for good mid-run. A param frozen through a backward gets no grad there and the step skips it
(its values and state kept), as torch's optimizers skip a param whose ``.grad`` is None: the
reference is DDP(find_unused_parameters=True), whose frozen params keep ``.grad`` None
([Note: params without a grad] in optim/held.py).

Tolerances ([Note: parity tolerances] in _parity.py): SGD + momentum params follow DDP to
1e-5 relative; logits of the same weights through the same kernels are equal to fp32
rounding of a different reduction order inside no kernel at all: exactly equal.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from _finetune import prompt, tiny_llama, tiny_lora
from _parity import CFG, TiedGPT, drift_from, step_both
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.testing import run_distributed

peft = pytest.importorskip("peft")  # (in the dev extras: CI has it)

CORPUS = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}


def _disable_adapter(stage: int) -> dict:
    """Logits of a sharded LoRA model inside ``disable_adapter()`` (under no_grad, as TRL's
    reference pass) against the plain base model's, then a training step after it."""
    torch.manual_seed(0)
    base = tiny_llama(seed=3).eval()
    model = flatshard.shard(tiny_lora(seed=3), stage=stage)
    opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    x = prompt(dist.get_rank())
    with torch.no_grad():
        want = base(input_ids=x).logits
        with_adapter = model(input_ids=x).logits
        with model.disable_adapter():
            got = model(input_ids=x).logits
    logits = model(input_ids=x).logits
    torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:]).backward()
    opt.step()
    trained = [p.requires_grad for n, p in model.named_parameters() if "lora_" in n]
    return {
        "equal": torch.equal(got, want),
        "adapter_differs": not torch.equal(with_adapter, want),
        "adapters_trainable_again": all(trained) and bool(trained),
    }


@pytest.mark.parametrize("stage", range(4))
def test_peft_disable_adapter_gives_the_base_models_logits(stage):
    """It raised ("requires_grad=False ... after shard()") at the first forward inside it."""
    for result in run_distributed(_disable_adapter, 2, stage, timeout=120):
        assert result == {"equal": True, "adapter_differs": True, "adapters_trainable_again": True}, result


def _halves(stage: int, steps: int = 4) -> dict:
    """Each step trains one half of the blocks (the other half frozen for the step); the
    reference is DDP, whose frozen half has no grad and is skipped by its optimizer."""
    torch.manual_seed(0)
    model = TiedGPT()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(
        model, stage=stage, buckets=flatshard.Buckets(size=3000), find_unused_parameters=True
    )
    opt = flatshard.DistributedOptimizer(ours, torch.optim.SGD, **SGD)
    opt_ref = torch.optim.SGD(reference.parameters(), **SGD)
    drift = []
    for step in range(steps):
        frozen = step % 2
        for side in (ours, reference.module):
            for p in side.blocks[frozen].parameters():
                if p is not side.blocks[0].ln1.weight:  # (frozen from the start: stays so)
                    p.requires_grad_(False)
        x, y = CORPUS.batch(step, dist.get_rank(), 4)
        ours(x, y).backward()
        reference(x, y).backward()
        step_both(opt, opt_ref)
        for side in (ours, reference.module):
            for p in side.blocks[frozen].parameters():
                if p is not side.blocks[0].ln1.weight:
                    p.requires_grad_(True)
        drift.append(drift_from(ours, reference.module))
    return {"drift": drift}


@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, 3), (2, 2), (3, 3)])
def test_params_frozen_for_a_step_are_skipped_by_it(stage, world_size):
    """DeepSpeed's unbalanced-gradients case: the frozen half moved under momentum and weight
    decay before (its grad counted as zero)."""
    for result in run_distributed(_halves, world_size, stage, timeout=120):
        assert max(result["drift"]) < 1e-5, result["drift"]
