"""A LoRA fine-tune of a Hugging Face causal LM at stage 3, end to end: load pretrained
weights into a model built on the meta device, train with checkpoints, generate, export the
adapter and the merged model, and reload both with plain ``transformers``/``peft``.
``docs/finetune.md`` walks through it; ``tests/app/test_examples.py`` runs it.

    python examples/finetune_lora.py --make-tiny pretrained      # a tiny Llama (no download here)
    torchrun --nproc-per-node 2 examples/finetune_lora.py --pretrained pretrained --out run
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import flatshard
from flatshard.toolkit.data import SyntheticCorpus


# -- 1. load: build on the meta device, add LoRA, shard, fill from the pretrained directory -------
def load(pretrained: str, bf16: bool) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(pretrained)
    with torch.device("meta"):  # no memory: each unit is materialized on its own when sharded
        base = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, lora)
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    model = flatshard.shard(model, stage=3, mixed_precision=mp)
    flatshard.load_pretrained(model, pretrained)  # each rank reads only its shards
    return model


# -- 2. train: AdamW over the adapters, cosine LR, clipping, checkpoints that resume anywhere -----
def train(model: torch.nn.Module, out: str, steps: int, every: int) -> None:
    optimizer = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=2e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    start = 0
    if os.path.isdir(f"{out}/checkpoint"):  # saved at any world size and stage
        extra = flatshard.load_checkpoint(f"{out}/checkpoint", model, optimizer, extra={"lr": schedule})
        start = extra["step"]
    corpus = SyntheticCorpus(16, 32)  # a chain over the first 16 token ids: the new domain
    model.train()
    losses = []
    for step in range(start, steps):
        x, _ = corpus.batch(step, dist.get_rank(), 4)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"step {step + 1}: loss {loss.item():.4f}")
        if (step + 1) % every == 0 or step + 1 == steps:
            extra = {"step": step + 1, "lr": schedule}
            flatshard.save_checkpoint(f"{out}/checkpoint", model, optimizer, extra=extra)
    if len(losses) >= 4:  # (the adapters learn the new domain)
        assert sum(losses[-2:]) / 2 < losses[0] - 0.1, losses


# -- 3. generate: every rank its own prompt; ranks that finish early keep the others company ----
def generate(model: torch.nn.Module, prompt: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)


# -- 4. export: the adapter alone, and the base model with the adapter merged in -----------------
def export(model: torch.nn.Module, out: str) -> None:
    flatshard.save_pretrained(model, f"{out}/adapter")  # for PeftModel.from_pretrained
    flatshard.save_pretrained(model, f"{out}/merged", merged=True)  # for AutoModelForCausalLM


# -- 5. reload with plain transformers and peft (one process, no flatshard) ----------------------
def reload(pretrained: str, out: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    base = AutoModelForCausalLM.from_pretrained(pretrained, dtype=dtype)
    # (autocast_adapter_dtype=False: the adapter computes in the base's dtype, as it trained)
    adapter = PeftModel.from_pretrained(base, f"{out}/adapter", autocast_adapter_dtype=False).eval()
    merged = AutoModelForCausalLM.from_pretrained(f"{out}/merged", dtype=dtype).eval()
    return adapter, merged


def prompt_of(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(1, vocab, (1, 4 + rank), generator=torch.Generator().manual_seed(rank))


def main() -> None:
    args = parse_args()
    if args.make_tiny:
        return make_tiny(args.make_tiny)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = load(args.pretrained, args.bf16)
    train(model, args.out, args.steps, args.every)
    rank, vocab = dist.get_rank(), model.config.vocab_size
    tokens = generate(model, prompt_of(rank, vocab))
    export(model, args.out)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tokens)
    if rank == 0:  # the same weights, unsharded, give the same tokens
        adapter, merged = reload(args.pretrained, args.out, torch.bfloat16 if args.bf16 else torch.float32)
        for r, got in enumerate(everyone):
            expected = generate(adapter, prompt_of(r, vocab))
            print(f"rank {r} generated {got.tolist()[0]}; the reloaded adapter: {expected.tolist()[0]}")
            assert torch.equal(got, expected), f"rank {r}: {got.tolist()} != {expected.tolist()}"
        ids = prompt_of(0, vocab)
        with torch.no_grad():
            gap = (adapter(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item()
        print(f"merged against adapter: largest logit difference {gap:.2e}")
    dist.destroy_process_group()


def make_tiny(directory: str) -> None:
    """A 4-layer Llama with random weights, saved as a pretrained model would be."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)


def parse_args() -> argparse.Namespace:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--pretrained", help="a save_pretrained directory (config.json + weights)")
    parser.add_argument("--out", default="finetune-out", help="checkpoint, adapter and merged model go here")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in all (default 20)")
    parser.add_argument("--every", type=int, default=10, help="save a checkpoint every N steps (default 10)")
    parser.add_argument("--bf16", action="store_true", help="compute in bf16 (fp32 main params)")
    parser.add_argument("--make-tiny", metavar="DIR", help="write a tiny random Llama to DIR and exit")
    return parser.parse_args()


if __name__ == "__main__":
    main()
