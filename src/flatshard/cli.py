"""The ``flatshard`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from flatshard import _launch
from flatshard.api import DEFAULT_BUCKET_SIZE, IMPLEMENTED_STAGES


def _positive_int(text: str) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _bucket_size(text: str) -> int | None:
    return None if text.lower() in ("none", "one") else _positive_int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from flatshard.models import PRESETS

    parser = argparse.ArgumentParser(prog="flatshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train the built-in GPT on the built-in corpus",
        description="Train a built-in GPT on a learnable synthetic corpus with flatshard data "
        "parallelism. Starts --world-size local ranks itself, or runs as one rank under torchrun.",
    )
    train.add_argument(
        "--world-size", "-n", type=_positive_int, default=2, help="local ranks to start (default 2)"
    )
    train.add_argument(
        "--stage",
        type=int,
        choices=IMPLEMENTED_STAGES,
        default=0,
        help="ZeRO stage (implemented: %(choices)s)",
    )
    train.add_argument("--model", choices=sorted(PRESETS), default="small", help="GPT preset (default small)")
    train.add_argument("--steps", type=_positive_int, default=300, help="optimizer steps (default 300)")
    train.add_argument("--batch-size", type=_positive_int, default=16, help="sequences per rank per step")
    train.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    train.add_argument(
        "--bucket-size",
        type=_bucket_size,
        default=DEFAULT_BUCKET_SIZE,
        help="elements per bucket, or 'none' for one bucket per buffer (default %(default)s)",
    )
    train.add_argument("--seed", type=int, default=0, help="model init seed")
    train.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args, argv)
    raise AssertionError(args.command)  # pragma: no cover - argparse rejects unknown commands


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from flatshard._train import TrainConfig, run

    if _launch.launched():
        world = int(os.environ["WORLD_SIZE"])
        explicit = any(a in ("--world-size", "-n") or a.startswith("--world-size=") for a in argv)
        if explicit and args.world_size != world:
            print(
                f"flatshard train: --world-size {args.world_size} but the launcher started {world} ranks",
                file=sys.stderr,
            )
            return 2
    elif args.world_size > 1:
        return _launch.launch_local(argv, args.world_size)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("flatshard train: --device cuda but no CUDA device is available", file=sys.stderr)
            return 2
    cfg = TrainConfig(
        model=args.model,
        stage=args.stage,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        bucket_size=args.bucket_size,
        seed=args.seed,
        device=args.device,
    )
    run(cfg)
    return 0
