"""The ``flatshard`` command line."""

from __future__ import annotations

import argparse
import os
import sys

from flatshard.app import launcher
from flatshard.app.cli_args import (
    MODEL_HELP,
    add_layout_options,
    bucket_size,
    fraction,
    model_specs_of,
    positive_float,
    positive_int,
)
from flatshard.app.plan_command import add_plan, run_plan
from flatshard.planner.stage import DEFAULT_BUCKET_SIZE, STAGES, StagePolicy


def build_parser() -> argparse.ArgumentParser:
    from flatshard.toolkit.models import PRESETS

    parser = argparse.ArgumentParser(prog="flatshard", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train the built-in GPT on the built-in corpus",
        description="Train a built-in GPT on a learnable synthetic corpus with flatshard data "
        "parallelism. Starts --world-size local ranks itself, or runs as one rank under torchrun.",
    )
    train.add_argument(
        "--world-size", "-n", type=positive_int, default=2, help="local ranks to start (default 2)"
    )
    train.add_argument(
        "--stage",
        type=int,
        choices=STAGES,
        default=0,
        help="ZeRO stage: 0 (DDP) to 3 (params sharded too) (default 0)",
    )
    train.add_argument(
        "--model",
        default="small",
        help=f"a GPT preset ({', '.join(PRESETS)}; default small), hf:<model_type> (a tiny "
        "transformers causal LM of that type, random init), a local config.json or save_pretrained "
        "directory (its causal LM, random init), or module:factory, a function returning an "
        "nn.Module whose forward(tokens, targets) returns the loss",
    )
    train.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (default 300)")
    train.add_argument(
        "--batch-size", type=positive_int, default=16, help="sequences per rank per micro-batch (default 16)"
    )
    train.add_argument(
        "--micro-batches",
        type=positive_int,
        default=1,
        help="micro-batches per step, grads accumulated (default 1)",
    )
    train.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: bf16 params and compute, fp32 main params (default fp32)",
    )
    train.add_argument(
        "--data",
        help="a text file to train on, as byte-level tokens (default: the built-in synthetic corpus)",
    )
    train.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the model's)")
    train.add_argument("--lr", type=positive_float, default=3e-3, help="peak learning rate (default 3e-3)")
    train.add_argument(
        "--bucket-size",
        type=bucket_size,
        default=DEFAULT_BUCKET_SIZE,
        help="elements per bucket, or 'none' for one bucket per buffer (default %(default)s)",
    )
    train.add_argument(
        "--offload-fraction",
        type=fraction,
        default=0.0,
        help="share of each rank's optimizer state and updates kept on the host: "
        "shard(offload=flatshard.Offload(optimizer=F)); 1 puts the whole optimizer there, and at "
        "stage 3 the param shards (default 0)",
    )
    train.add_argument(
        "--offload-step",
        choices=("host", "device"),
        default="host",
        help="where the offloaded optimizer steps, with --offload-fraction 1: on the host, or "
        "streamed to the device a chunk at a time (Offload(step='device')) (default host)",
    )
    train.add_argument(
        "--fp8-gathers",
        action="store_true",
        help="the model's linears (but the output head) in torchao's float8 training, emulated on a "
        "CPU, their weights gathered in fp8: MixedPrecision(fp8_gathers=True); at stages 1-2 with "
        "--dtype bf16",
    )
    train.add_argument("--seed", type=int, default=0, help="model init seed (default 0)")
    train.add_argument(
        "--checkpoint-dir",
        help="save checkpoints DIR/step-N (the newest 2 kept) at the end and every --checkpoint-every steps",
    )
    train.add_argument(
        "--checkpoint-every",
        type=positive_int,
        default=0,
        help="steps between checkpoints (default: at the end only)",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir, if there is one",
    )
    train.add_argument("--init-from", help="start from plain weights (.safetensors or .pt state dict)")
    train.add_argument(
        "--metrics", help="write per-step loss, lr, grad norm, tokens/s, memory, comm bytes (JSONL)"
    )
    train.add_argument("--plot", help="draw the loss curve to this PNG at the end (needs matplotlib)")
    train.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="where each rank trains; auto: its GPU if there is one, else the CPU (default auto)",
    )
    train.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="seconds a collective may take before every rank stops with a DesyncError naming "
        "where each rank is (default 600)",
    )
    add_plan(sub)
    _add_layout(sub)
    _add_export(sub)
    _add_verify(sub)
    _add_bench(sub)
    return parser


def _add_verify(sub) -> None:
    verify = sub.add_parser(
        "verify",
        help="check a checkpoint or weights file against its checksums, without loading it",
        description="Read every piece of a flatshard checkpoint directory (or a .safetensors/.pt "
        "weights file) and check it against the size and checksum written with it. Exits 1 "
        "naming the first file and tensor that differ.",
    )
    verify.add_argument("path", help="checkpoint directory, or a .safetensors/.pt file")


def _add_bench(sub) -> None:
    from flatshard.app import bench

    parser = sub.add_parser(
        "bench",
        help="flatshard against torch DDP, FSDP2, ZeRO-1 and DeepSpeed: time, memory, bytes sent",
        description=bench.__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(parser, default_out="bench-results/bench.json")


def _add_export(sub) -> None:
    export = sub.add_parser(
        "export",
        help="a checkpoint as one plain state dict (.safetensors or .pt)",
        description="Write the model of a flatshard checkpoint, saved at any world size and stage, "
        "as one state dict file that the plain nn.Module loads with load_state_dict. Streams: "
        "at most --chunk-mib of tensor data is read at a time.",
    )
    export.add_argument("checkpoint", help="checkpoint directory (as written by save_checkpoint)")
    export.add_argument("out", help="file to write: its suffix, .safetensors or .pt, picks the format")
    export.add_argument(
        "--weights",
        choices=["main", "model"],
        default="main",
        help="main: the fp32 main params where the checkpoint has them (default); model: the "
        "params as the model held them",
    )
    export.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="cast floating-point tensors")
    export.add_argument(
        "--chunk-mib", type=positive_int, default=256, help="MiB of data read at a time (default 256)"
    )


def _add_layout(sub) -> None:
    layout = sub.add_parser(
        "layout",
        help="a model's buffers, buckets, padding and rank shards: table and PNG",
        description="Print a model's flat layout (buffers, buckets, params, alignment gaps and "
        "end padding) and every rank's shard of each bucket, as flatshard.shard would build it; "
        "with --out, also draw it as a PNG (needs matplotlib).",
    )
    layout.add_argument(
        "--model",
        required=True,
        help=MODEL_HELP,
    )
    layout.add_argument("--stage", type=int, choices=STAGES, default=2, help="default 2")
    add_layout_options(layout, world_size=2, bucket_help="")
    layout.add_argument("--out", help="also write the drawing to this PNG file")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "train":
        return _train(args, argv)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "layout":
        return _layout(args)
    if args.command == "export":
        return _export(args)
    if args.command == "verify":
        return _verify(args)
    if args.command == "bench":
        from flatshard.app.bench import bench_main

        bench_main(args)
        return 0
    raise AssertionError(args.command)  # pragma: no cover - argparse rejects unknown commands


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from flatshard.app.train import TrainConfig, resolve_device, run

    if launcher.launched():
        world = int(os.environ["WORLD_SIZE"])
        explicit = any(a in ("--world-size", "-n") or a.startswith("--world-size=") for a in argv)
        if explicit and args.world_size != world:
            print(
                f"flatshard train: --world-size {args.world_size} but the launcher started {world} ranks",
                file=sys.stderr,
            )
            return 2
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launcher.launched() else args.world_size
    try:
        device = resolve_device(args.device, local_ranks)
    except ValueError as e:
        print(f"flatshard train: {e}", file=sys.stderr)
        return 2
    reason = _check_train_args(args)  # once, before any rank starts
    if reason is not None:
        print(f"flatshard train: {reason}", file=sys.stderr)
        return 2
    if not launcher.launched() and args.world_size > 1:
        return launcher.launch_local(argv, args.world_size, cpu=device == "cpu")
    cfg = TrainConfig(
        model=args.model,
        stage=args.stage,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        bucket_size=args.bucket_size,
        seed=args.seed,
        device=device,
        offload_fraction=args.offload_fraction,
        offload_step=args.offload_step,
        fp8_gathers=args.fp8_gathers,
        micro_batches=args.micro_batches,
        timeout=args.timeout,
        dtype=args.dtype,
        data=args.data,
        seq_len=args.seq_len,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        init_from=args.init_from,
        metrics=args.metrics,
        plot=args.plot,
    )
    run(cfg)
    return 0


def _check_train_args(args: argparse.Namespace) -> str | None:
    """Why the options cannot work (before any rank starts), or None."""
    from flatshard.app.train import resume_problem
    from flatshard.toolkit.models import model_factory

    try:
        model_factory(args.model)
    except ValueError as e:
        return str(e)
    for option, path in (("--data", args.data), ("--init-from", args.init_from)):
        if path is not None and not os.path.isfile(path):
            return f"{option} {path}: no such file"
    if args.offload_step == "device" and args.offload_fraction != 1.0:
        return (
            f"--offload-step device streams all of the optimizer: it needs --offload-fraction 1, "
            f"got {args.offload_fraction:g}"
        )
    policy = StagePolicy(args.stage)
    if args.fp8_gathers and not policy.gathers_params:
        return "--fp8-gathers: stage 0 gathers no params; use stages 1-3"
    if args.fp8_gathers and not policy.gathers_units and args.dtype != "bf16":
        return (
            f"--fp8-gathers at stage {args.stage} needs --dtype bf16 (fp32 main params keep the exact "
            "values while the params hold their fp8 ones)"
        )
    if args.resume and args.checkpoint_dir is None:
        return "--resume needs --checkpoint-dir"
    if args.checkpoint_dir is not None and os.path.isfile(args.checkpoint_dir):
        return f"--checkpoint-dir {args.checkpoint_dir} is a file, not a directory"
    problem = resume_problem(args.checkpoint_dir, args.steps) if args.resume else None
    if problem is not None:
        return problem
    if args.checkpoint_every and args.checkpoint_dir is None:
        return "--checkpoint-every needs --checkpoint-dir"
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib (pip install 'flatshard[plot]')"
    return None


def _layout(args: argparse.Namespace) -> int:
    from flatshard.app import draw
    from flatshard.planner import plan
    from flatshard.planner.layout import plan_layout

    try:
        specs, stage3_specs, units, frozen, _ = model_specs_of(
            args.model, plan.DTYPES[args.param_dtype], args
        )
    except (ValueError, ImportError, AttributeError) as e:
        print(f"flatshard layout: {e}", file=sys.stderr)
        return 2
    policy = StagePolicy(args.stage)
    layout = plan_layout(
        stage3_specs if policy.gathers_units else specs,
        world_size=args.world_size,
        bucket_size=args.bucket_size,
        shard=policy.pads_for_shards,
    )
    print(draw.format_shards(layout))
    if frozen[0]:  # (sharded with their units at stage 3, replicated on every rank below)
        kept = "sharded with their units" if policy.shards_params else "replicated on every rank"
        print(f"\nfrozen params ({kept}; no grads, no optimizer state):")
        if policy.shards_params:
            frozen_layout = plan_layout(frozen[1], world_size=args.world_size, bucket_size=args.bucket_size)
            print(draw.format_shards(frozen_layout))
        else:
            print(f"{sum(s.numel for s in frozen[0]):,} elements")
    if policy.gathers_units:
        print(f"\n{units}")
    if args.out:
        title = f"{args.model}: stage {args.stage}, {args.world_size} ranks, {args.param_dtype} params"
        try:
            draw.draw_layout(layout, args.out, title)
        except ImportError:
            print("flatshard layout: --out needs matplotlib (pip install 'flatshard[plot]')", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from flatshard.checkpoint.weights import export_checkpoint
    from flatshard.planner import plan

    dtype = None if args.dtype is None else plan.DTYPES[args.dtype]
    try:
        entries = export_checkpoint(
            args.checkpoint, args.out, weights=args.weights, dtype=dtype, chunk_bytes=args.chunk_mib << 20
        )
    except (OSError, ValueError, KeyError) as e:
        print(f"flatshard export: {e}", file=sys.stderr)
        return 2
    tensors = {e.source: e for e in entries}.values()  # a tied param once
    values, mib = sum(e.numel for e in tensors), sum(e.nbytes for e in tensors) / 2**20
    print(f"wrote {args.out}: {len(entries)} tensors, {values:,} values, {mib:.1f} MiB")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from flatshard.checkpoint.directory import verify_checkpoint
    from flatshard.errors import CheckpointError

    try:
        counts = verify_checkpoint(args.path)
    except (OSError, CheckpointError) as e:
        print(f"flatshard verify: {e}", file=sys.stderr)
        return 1
    note = f" ({counts['unchecked']} written without checksums)" if counts["unchecked"] else ""
    print(f"{args.path}: {counts['checked']} pieces in {counts['files']} files match their checksums{note}")
    return 0
