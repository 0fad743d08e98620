"""fp8 gathers of torchao float8 weights, beside bf16 gathers and FSDP2's, on 2 gloo ranks.

    PYTHONPATH=src python benchmarks/fp8_gathers.py OUT.json [--preset small] [--steps 50] [--pow2]
        [--stage 3]

The bench GPT (its blocks' linears converted to torchao's float8 training, emulated on the
CPU) trains with bf16 params and fp32 main params, AdamW, the same batches on every run:

* flatshard at ``--stage`` (3: the unit gathers; 1 or 2: the gathers after each step, with
  ``MixedPrecision(fp8_gathers=True)``), ``enable_fsdp_float8_all_gather=True`` (fp8
  gathers) and ``False`` (bf16);
* FSDP2 (``fully_shard`` on every block, then the root; bf16 params, fp32 reduce) with
  torchao's fp8 all-gather and ``precompute_float8_dynamic_scale_for_fsdp`` after each step,
  and without it.

For each: the all-gather bytes of a step (flatshard's ``CommStats`` payload; FSDP2's counted
by wrapping torch's all-gather calls: the gathered tensor's bytes, the same measure), the
fp8 weights' share of them, the loss at the first and last step and its gap to FSDP2 + fp8,
and the step time (median, and the 10th-90th percentiles of the steps after the first;
emulated fp8 on a CPU: not a GPU's). Prints a table, writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

import flatshard
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, PRESETS
from flatshard.toolkit.testing import run_distributed

LR = 1e-3


def _model(preset: str, fp8_gather: bool, pow2: bool) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    config = Float8LinearConfig(
        emulate=True, enable_fsdp_float8_all_gather=fp8_gather, round_scales_to_power_of_2=pow2
    )
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, n: "blocks." in n)


class _GatherBytes:
    """Bytes of every tensor torch's all-gathers fill while installed (FSDP2's gathers)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._saved = {}

    def __enter__(self):
        for name in ("all_gather_into_tensor", "all_gather_single"):
            if hasattr(dist, name):
                self._saved[name] = original = getattr(dist, name)
                setattr(dist, name, self._counted(original))
        return self

    def _counted(self, original):
        def call(output, *args, **kwargs):
            self.bytes += output.numel() * output.element_size()
            return original(output, *args, **kwargs)

        return call

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def _fsdp2(model: torch.nn.Module, fp8_gather: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    after = (lambda: precompute_float8_dynamic_scale_for_fsdp(model)) if fp8_gather else (lambda: None)
    return model, torch.optim.AdamW(model.parameters(), lr=LR), after


def _flatshard(model: torch.nn.Module, stage: int, fp8_gather: bool):
    asked = True if fp8_gather and stage < 3 else None  # ([Note: fp8 gathers after the step])
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16, fp8_gathers=asked)
    model = flatshard.shard(model, stage=stage, mixed_precision=mp)
    return model, flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=LR), lambda: None


def _run(system: str, fp8_gather: bool, preset: str, steps: int, pow2: bool, stage: int) -> dict:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    raw = _model(preset, fp8_gather, pow2)
    fp8_numel = sum(m.weight.numel() for n, m in raw.named_modules() if type(m).__name__ == "Float8Linear")
    model, opt, after = _fsdp2(raw, fp8_gather) if system == "fsdp2" else _flatshard(raw, stage, fp8_gather)
    corpus = SyntheticCorpus(PRESETS[preset].vocab_size, PRESETS[preset].seq_len)
    losses, times = [], []
    with _GatherBytes() as counted:
        for step in range(steps):
            x, y = corpus.batch(step, rank, 4)
            if system == "flatshard":
                model.comm_stats.reset()
            counted.bytes = 0
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            after()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
    gathered = (
        model.comm_stats.as_dict()["all_gather"]["payload_bytes"] if system == "flatshard" else counted.bytes
    )
    mean = torch.tensor(losses)
    dist.all_reduce(mean)
    steady = sorted(times[1:])  # (the first step builds what the others reuse)
    return {
        "losses": (mean / dist.get_world_size()).tolist(),
        "gather_bytes_last_step": int(gathered),
        "fp8_weight_elements": fp8_numel,
        "ms_per_step": steady[len(steady) // 2] * 1e3,
        "ms_per_step_p10_p90": [steady[int(q * (len(steady) - 1))] * 1e3 for q in (0.1, 0.9)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--pow2", action="store_true", help="scales rounded down to powers of 2")
    parser.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="flatshard's stage")
    args = parser.parse_args()
    runs = {}
    for system in ("flatshard", "fsdp2"):
        for fp8_gather in (True, False):
            at = f"-{args.stage}" if system == "flatshard" else ""
            name = f"{system}{at}, {'fp8' if fp8_gather else 'bf16'} gathers"
            run = (system, fp8_gather, args.preset, args.steps, args.pow2, args.stage)
            runs[name] = run_distributed(_run, 2, *run, timeout=3600)[0]
    reference = runs["fsdp2, fp8 gathers"]["losses"]
    header = ("run", "gather MB/step", "first loss", "last loss", "vs FSDP2+fp8", "ms/step", "p10-p90")
    print("{:<26} {:>15} {:>11} {:>10} {:>13} {:>8} {:>13}".format(*header))
    for name, r in runs.items():
        gap = max(abs(a - b) / b for a, b in zip(r["losses"], reference, strict=True))
        r["max_rel_loss_gap_to_fsdp2_fp8"] = gap
        print(
            f"{name:<26} {r['gather_bytes_last_step'] / 1e6:>15.3f} {r['losses'][0]:>11.4f} "
            f"{r['losses'][-1]:>10.4f} {gap:>12.2%} {r['ms_per_step']:>8.1f} "
            f"{r['ms_per_step_p10_p90'][0]:>6.1f}-{r['ms_per_step_p10_p90'][1]:<6.1f}"
        )
    ours, plain = runs[f"flatshard-{args.stage}, fp8 gathers"], runs[f"flatshard-{args.stage}, bf16 gathers"]
    saved = plain["gather_bytes_last_step"] - ours["gather_bytes_last_step"]
    fp8 = ours["fp8_weight_elements"]
    print(
        f"fp8 gathers send {saved / 1e6:.3f} MB a step less than bf16 gathers ({fp8:,} fp8 weight elements)"
    )
    with open(args.out, "w") as f:
        what = {"preset": args.preset, "steps": args.steps, "pow2": args.pow2, "world_size": 2}
        what["stage"] = args.stage
        json.dump({**what, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
