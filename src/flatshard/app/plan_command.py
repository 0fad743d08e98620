"""``flatshard plan``: per-rank model-state memory and bytes per step at stages 0-3, from a
parameter count or a model's real layout, and with ``--device-budget`` the least offload
that fits ([Note: device budget] in ``planner/budget.py``)."""

from __future__ import annotations

import argparse
import sys

from flatshard.app.cli_args import MODEL_HELP, add_layout_options, model_specs_of, positive_int


def add_plan(sub) -> None:
    from flatshard.planner.plan import DTYPE_BYTES, OPTIMIZERS
    from flatshard.planner.state_blocks import FORMATS

    plan = sub.add_parser(
        "plan",
        help="per-rank model-state memory and bytes sent per step, stages 0-3",
        description="Per-rank model-state memory (params, grads, fp32 main params, optimizer "
        "state) and wire bytes sent per optimizer step at stages 0-3: from a parameter count "
        "(the ZeRO formulas) or from a model's real flat layout, padding included.",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=positive_int, help="number of parameters, e.g. 7.5e9")
    source.add_argument(
        "--model",
        help=MODEL_HELP,
    )
    add_layout_options(plan, world_size=8, bucket_help="with --model ")
    plan.add_argument(
        "--grad-dtype",
        choices=sorted(DTYPE_BYTES),
        help="with --params (default fp32); a model's grads follow flatshard's policy",
    )
    plan.add_argument(
        "--optimizer",
        choices=sorted([*OPTIMIZERS, *FORMATS]),
        default="adam",
        help="default adam; adamw8bit, adamw4bit and adamwfp8 are torchao's low-bit Adams, on a "
        "layout aligned to their blocks",
    )
    for what in ("main", "state"):
        plan.add_argument(
            f"--{what}-dtype",
            choices=("fp32", "bf16"),
            default="fp32",
            help=f"the optimizer's {what} {'params' if what == 'main' else 'tensors'} "
            "(flatshard.OptimizerPrecision; default fp32)",
        )
    plan.add_argument(
        "--tp",
        type=positive_int,
        default=1,
        help="with --params: tensor-parallel ranks every param is split over (each holds 1/TP "
        "of it); --world-size is then the data-parallel ranks (default 1)",
    )
    plan.add_argument(
        "--pp",
        type=positive_int,
        default=1,
        help="with --params: pipeline stages the params are cut into evenly (each rank holds one "
        "stage's, after the --tp split; default 1)",
    )
    plan.add_argument("--rank", type=int, default=0, help="with --model: whose shard to count (default 0)")
    plan.add_argument(
        "--offload",
        nargs="?",
        const="host",
        choices=("host", "device"),
        help="with --model: as shard(..., offload=flatshard.Offload()): the bytes on the host and "
        "on the device apart, and the bytes over the host link per step; --offload device: as "
        "Offload(step='device'), the optimizer streamed to the device for its step",
    )
    plan.add_argument(
        "--stream-chunk",
        type=positive_int,
        metavar="ELEMENTS",
        help="with --offload device: the elements a streamed chunk holds at most, as "
        "Offload(stream_chunk=...) (default 2**25); the device holds two during the step",
    )
    plan.add_argument(
        "--device-budget",
        type=positive_int,
        metavar="BYTES",
        help="with --model: the bytes of model state each rank's device may hold (e.g. 24e9); for "
        "each stage, the least offload that fits (nothing, a share of the optimizer, or all of it; "
        "with --offload device, the step streamed to the device, its chunks counted), "
        "its bytes on the device at the peak (stage 3: with the units in full) and on the host, or "
        "why nothing fits",
    )
    plan.add_argument("--json", action="store_true", help='print {"stages": {"0": {...}, ...}} instead')


def run_plan(args: argparse.Namespace) -> int:
    import json

    from flatshard.planner import plan
    from flatshard.planner.mixed_precision import OptimizerPrecision

    precision = OptimizerPrecision(plan.DTYPES[args.main_dtype], plan.DTYPES[args.state_dtype])
    if args.params is not None:
        only_model = (
            ("--offload", args.offload),
            ("--device-budget", args.device_budget),
            ("--stream-chunk", args.stream_chunk),
        )
        for option, given in (*only_model, ("--fp8-gathers", args.fp8_gathers)):
            if given:
                print(f"flatshard plan: {option} applies to --model only", file=sys.stderr)
                return 2
        per_tp_rank = (args.params + args.tp - 1) // args.tp  # (the larger part of an uneven split)
        plans = plan.plan_from_count(
            (per_tp_rank + args.pp - 1) // args.pp,  # (one pipeline stage's part of it)
            world_size=args.world_size,
            param_dtype=args.param_dtype,
            grad_dtype=args.grad_dtype or "fp32",
            optimizer=args.optimizer,
            precision=precision,
        )
        title = f"{args.params:,} params" + (
            f" split over {args.tp} tensor-parallel ranks" if args.tp > 1 else ""
        )
        title += f" in {args.pp} pipeline stages" if args.pp > 1 else ""
    else:
        if args.stream_chunk is not None and args.offload != "device":
            print("flatshard plan: --stream-chunk applies to --offload device only", file=sys.stderr)
            return 2
        for option, given in (
            ("--grad-dtype", args.grad_dtype is not None),
            ("--offload (the budget decides)", args.offload == "host" and args.device_budget is not None),
            ("--tp", args.tp > 1),
            ("--pp", args.pp > 1),
        ):
            if given:
                print(f"flatshard plan: {option} applies to --params only", file=sys.stderr)
                return 2
        try:
            specs, stage3_specs, units, frozen, names = model_specs_of(
                args.model, plan.DTYPES[args.param_dtype], args
            )
            planning = {
                "world_size": args.world_size,
                "bucket_size": args.bucket_size,
                "optimizer": args.optimizer,
                "rank": args.rank,
                "stage3_specs": stage3_specs,
                "frozen_specs": frozen[0],
                "stage3_frozen_specs": frozen[1],
                "precision": precision,
            }
            plans = plan.plan_from_specs(
                specs, offload=args.offload is not None, **_streamed(args), **planning
            )
        except (ValueError, ImportError, AttributeError) as e:
            print(f"flatshard plan: {e}", file=sys.stderr)
            return 2
        counts = f"{sum(s.numel for s in specs):,} params"
        counts += f" trained, {sum(s.numel for s in frozen[0]):,} frozen" if frozen[0] else ""
        title = f"{args.model} ({counts}), rank {args.rank}"
        if args.device_budget is not None:
            print(_budget(args, specs, planning, names))
            return 0
    if args.json:
        print(json.dumps({"stages": {str(s): p.as_dict() for s, p in plans.items()}}))
    else:
        title += f", {args.world_size} ranks, {args.param_dtype} params, {args.optimizer}"
        title += f" ({args.main_dtype} main params, {args.state_dtype} state)" if precision.lowered else ""
        title += ", the optimizer offloaded" if args.offload else ""
        title += ", stepped on the device" if args.offload == "device" else ""
        fp8 = ", float8 linears gathered in fp8 (MixedPrecision(fp8_gathers=True))"
        title += fp8 if args.fp8_gathers else ""
        print(plan.format_plan(plans, title))
        if args.model is not None:
            print(units)
    return 0


def _streamed(args: argparse.Namespace) -> dict:
    """The plan's keywords for ``--offload device`` ([Note: streamed step]): the budget and the
    plan count the step's chunks."""
    from flatshard.planner.offload import STREAM_CHUNK

    return {"streamed": args.offload == "device", "stream_chunk": args.stream_chunk or STREAM_CHUNK}


def _budget(args: argparse.Namespace, specs, planning: dict, names: list[str]) -> str:
    """Each stage's decision for ``--device-budget`` ([Note: device budget]), as lines or JSON."""
    import json

    from flatshard.planner.budget import fit_budget
    from flatshard.planner.stage import STAGES

    out: dict[str, dict] = {}
    lines = [
        f"{args.model}: rank {args.rank} of {args.world_size}, device budget {args.device_budget:,} bytes"
    ]
    for stage in STAGES:
        try:
            fit = fit_budget(
                args.device_budget, specs, stage=stage, unit_names=names, **_streamed(args), **planning
            )
        except ValueError as e:
            out[str(stage)] = {"fits": False, "why": str(e)}
            lines.append(f"  stage {stage}: does not fit: {e}")
            continue
        p = fit.plan
        out[str(stage)] = {"fits": True, "share": fit.share, "in_flight": fit.in_flight, **p.as_dict()}
        if fit.units is not None:  # (stage 3: the units on the host, [Note: unit homes])
            out[str(stage)]["units"] = [names[int(u)] for u in sorted(fit.units, key=int)]
        out[str(stage)]["device_peak"] = fit.device_peak
        lines.append(
            f"  stage {stage}: {fit.describe(names)}; on the device {fit.device_peak:,} bytes at the peak "
            f"({fit.in_flight:,} of units in full), on the host {p.host:,}, "
            f"{p.link_bytes_per_step:,} bytes over the host link a step"
        )
    return json.dumps({"stages": out}) if args.json else "\n".join(lines)
