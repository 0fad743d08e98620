"""Train a Hugging Face causal LM under Lightning's Trainer (or Fabric), sharded by flatshard.

    torchrun --nproc-per-node 2 examples/lightning_trainer.py --out run --stage 3
    torchrun --nproc-per-node 3 examples/lightning_trainer.py --out run --epochs 3 \
        --resume run/checkpoints/last.ckpt
    torchrun --nproc-per-node 2 examples/lightning_trainer.py --fabric --out run  (Fabric's loop)

The model is built from a config (no download); the data is a synthetic corpus a small
model learns (flatshard.toolkit.data). Each epoch ends with a checkpoint, which resumes at
any world size and stage. The script checks by itself that the loss falls.
"""

import argparse
import os

import lightning as L
import torch

import flatshard.hosts.lightning  # noqa: F401  (registers strategy="flatshard" and "flatshard_stage_N")
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import tiny_model


class Corpus(torch.utils.data.Dataset):
    """``size`` sequences of a synthetic Markov chain: inputs and labels (the model shifts)."""

    def __init__(self, size: int, seq_len: int = 32) -> None:
        self.tokens = SyntheticCorpus(256, seq_len).batch(0, 0, size)[0]

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


class CausalLM(L.LightningModule):
    def __init__(self, model: torch.nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch, index):
        loss = self.model(**batch).loss
        self.log("loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, index):
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=10)  # warm-up
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="run")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--fabric", action="store_true", help="Fabric's loop instead of the Trainer")
    args = parser.parse_args()
    (with_fabric if args.fabric else with_trainer)(args)


def with_trainer(args: argparse.Namespace) -> None:
    torch.manual_seed(0)  # (every rank builds the same model; flatshard checks it)
    module = CausalLM(tiny_model("llama", seq_len=32))
    trainer = L.Trainer(
        strategy=f"flatshard_stage_{args.stage}",
        accelerator="auto",
        devices=int(os.environ.get("WORLD_SIZE", 1)),  # (the ranks torchrun started)
        max_epochs=args.epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        default_root_dir=args.out,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{args.out}/checkpoints", save_last=True)],
        logger=False,
        enable_progress_bar=False,
    )
    train = torch.utils.data.DataLoader(Corpus(192), batch_size=4, shuffle=True)
    val = torch.utils.data.DataLoader(Corpus(32), batch_size=8)
    (before,) = trainer.validate(module, val, verbose=False)
    trainer.fit(module, train, val, ckpt_path=args.resume)
    after = trainer.callback_metrics["val_loss"].item()
    if trainer.is_global_zero:
        print(f"val loss {before['val_loss']:.3f} -> {after:.3f} after {trainer.global_step} steps")
    assert after < before["val_loss"] - 0.5, (before, after)  # (the loss falls)


def with_fabric(args: argparse.Namespace) -> None:
    fabric = L.Fabric(strategy=f"flatshard_stage_{args.stage}", devices=int(os.environ.get("WORLD_SIZE", 1)))
    fabric.launch()
    torch.manual_seed(0)
    model = tiny_model("llama", seq_len=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)  # sharded in place; the optimizer rebuilt
    train = fabric.setup_dataloaders(torch.utils.data.DataLoader(Corpus(192), batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "epoch": 0}
    if args.resume:
        fabric.load(args.resume, state)
    before = validate(fabric, model)
    while state["epoch"] < args.epochs:
        train.sampler.set_epoch(state["epoch"])
        for index, batch in enumerate(train):
            accumulating = index % 2 == 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(model(**batch).loss)
            if not accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)  # the global norm
                optimizer.step()
                optimizer.zero_grad()
        state["epoch"] += 1
        fabric.save(f"{args.out}/fabric-ckpt", state)  # each rank writes its pieces
    after = validate(fabric, model)
    fabric.print(f"val loss {before:.3f} -> {after:.3f} after {state['epoch']} epochs")
    assert after < before - 0.2, (before, after)  # (the loss falls)


@torch.no_grad()
def validate(fabric: L.Fabric, model: torch.nn.Module) -> float:
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(Corpus(32), batch_size=8))
    losses = [model(**batch).loss for batch in loader]
    return fabric.all_reduce(torch.stack(losses).mean(), reduce_op="mean").item()


if __name__ == "__main__":
    main()
