"""What the ``flatshard`` commands share: argument types, the model option's help, the
layout options of ``plan`` and ``layout``, and a model's specs built on the meta device."""

from __future__ import annotations

import argparse
import math

from flatshard.planner.stage import DEFAULT_BUCKET_SIZE, DEFAULT_UNIT_BYTES

MODEL_HELP = (
    "a GPT preset, hf:<model_type> (a tiny transformers model), a directory or config.json (the "
    "transformers model it configures) or module:factory (an nn.Module)"
)


def positive_int(text: str) -> int:
    try:
        value = int(float(text)) if "e" in text.lower() else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def bucket_size(text: str) -> int | None:
    return None if text.lower() in ("none", "one") else positive_int(text)


def unit_bytes(text: str) -> int | None:
    return None if text.lower() == "none" else positive_int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def add_layout_options(parser, *, world_size: int, bucket_help: str) -> None:
    """The options ``plan`` and ``layout`` share: ranks, param dtype, bucket size, units, fp8."""
    from flatshard.planner.plan import DTYPE_BYTES

    parser.add_argument(
        "--world-size",
        "--world",
        "-n",
        type=positive_int,
        default=world_size,
        help=f"ranks (default {world_size})",
    )
    parser.add_argument("--param-dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="default bf16")
    parser.add_argument(
        "--bucket-size",
        type=bucket_size,
        default=DEFAULT_BUCKET_SIZE,
        help=f"{bucket_help}(default %(default)s)",
    )
    parser.add_argument(
        "--whole-params",
        metavar="REGEX",
        help="keep the 2-D params whose names match REGEX whole in one rank's shard, as "
        "shard(whole_params=...) does for Muon (e.g. 'blocks\\.'; default: none)",
    )
    parser.add_argument(
        "--unit-bytes",
        type=unit_bytes,
        default=DEFAULT_UNIT_BYTES,
        help="stage 3: adjacent small units merge while their params fit in this many bytes, as "
        "Stage3(unit_bytes=...) does; 'none': one unit per module (default %(default)s)",
    )
    parser.add_argument(
        "--fp8-gathers",
        action="store_true",
        help="with --model: its linears converted to torchao's float8 training with fp8 all-gathers "
        "(but the output head), with MixedPrecision(fp8_gathers=True): stages 1-3 gather their weights in "
        "one byte an element",
    )


def model_specs_of(model: str, dtype, args: argparse.Namespace):
    """Build ``model`` (a GPT preset or module:factory) on the meta device (no memory used);
    its specs as stages 0-2 and stage 3 lay them out (``--whole-params``: a regex of the
    names of 2-D params kept whole), a table of its stage-3 units (``--unit-bytes``), the
    specs of its frozen params at stages 0-2 and 3 (no grads, no optimizer state), and the
    units' names by index."""
    import re

    import torch

    from flatshard.app.draw import format_units
    from flatshard.toolkit.models import model_factory
    from flatshard.wrap.specs import model_specs, stage3_units, unit_nbytes

    build = model_factory(model)
    with torch.device("meta"):
        module = build().to(dtype)
    if getattr(args, "fp8_gathers", False):
        from flatshard.toolkit.models.float8 import float8_linears

        float8_linears(module)
    whole = args.whole_params
    try:
        pattern = re.compile(whole) if whole else None
    except re.error as e:
        raise ValueError(f"--whole-params {whole!r} is not a regular expression: {e}") from None
    kept = None if pattern is None else (lambda name, p: p.ndim == 2 and pattern.search(name) is not None)
    units, unit_of = stage3_units(module, [], None, args.unit_bytes)
    table = format_units(
        [u.name for u in units],
        [len(u.modules) for u in units],
        unit_nbytes(module, unit_of, len(units)),
        args.unit_bytes,
    )
    stage3 = model_specs(module, stage=3, whole_params=kept, unit_bytes=args.unit_bytes)
    frozen = (
        model_specs(module, frozen=True),
        model_specs(module, stage=3, frozen=True, unit_bytes=args.unit_bytes),
    )
    fp8 = True if getattr(args, "fp8_gathers", False) else None  # (as MixedPrecision(fp8_gathers=True))
    specs = model_specs(module, whole_params=kept, fp8_gathers=fp8)
    return specs, stage3, table, frozen, [u.name for u in units]
