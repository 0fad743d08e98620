"""Train a Hugging Face causal LM with transformers' Trainer, sharded by flatshard.

    torchrun --nproc-per-node 2 examples/hf_trainer.py --out run --stage 3
    torchrun --nproc-per-node 3 examples/hf_trainer.py --out run --stage 2 --steps 36 \
        --resume run/checkpoint-24

The one line that differs from a plain Trainer script is the Trainer's: flatshard's, with
``shard=``. The model is built from a config (no download); the data is a synthetic corpus a
small model learns (flatshard.toolkit.data). Checkpoints resume at any world size and
stage; the final model is saved for ``from_pretrained``. The script checks by itself that
the evaluation loss falls and that ``from_pretrained`` loads the trained weights.
"""

import argparse

import torch
import torch.distributed as dist
import transformers

from flatshard.hosts import hf
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import tiny_model


class Corpus(torch.utils.data.Dataset):
    """``size`` sequences of a synthetic Markov chain: inputs and labels (the model shifts)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.tokens = SyntheticCorpus(256, 32).batch(seed, 0, size)[0]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="run")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()

    training = transformers.TrainingArguments(
        output_dir=args.out,
        use_cpu=not torch.cuda.is_available(),  # (on CPU the ranks join over gloo)
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        learning_rate=3e-3,
        warmup_steps=4,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=12,
        logging_steps=6,
        report_to="none",
        disable_tqdm=True,
    )
    torch.manual_seed(0)  # (every rank builds the same model; flatshard checks it)
    model = tiny_model("llama", seq_len=32)
    train, held_out = Corpus(512), Corpus(64, seed=1)
    trainer = hf.Trainer(
        model=model, args=training, train_dataset=train, eval_dataset=held_out, shard=args.stage
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=args.resume)
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model(f"{args.out}/final")  # every rank gathers; rank 0 writes
    trained = model.full_state_dict()  # (every rank gathers; rank 0 gets the weights)
    if dist.get_rank() == 0:
        print(f"eval loss {before:.3f} -> {after:.3f} after {trainer.state.global_step} steps")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{args.out}/final").state_dict()
        assert all(torch.equal(v, trained[k]) for k, v in loaded.items()), "from_pretrained: other weights"
    assert after < before - 0.5, (before, after)  # (the loss falls)


if __name__ == "__main__":
    main()
