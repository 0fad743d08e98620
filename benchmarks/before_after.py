"""Step time of two revisions of flatshard, measured by alternating runs of ``flatshard bench``
on the same machine (before, after, before, ...), so that the machine's drift hits both.

    python benchmarks/before_after.py --before 0d896b9 --after HEAD --runs 3 \\
        --out benchmarks/results/DATE-NAME.json -- --peers ddp flatshard-0 flatshard-3 --rounds 4

Each revision is checked out in a temporary git worktree and run with its ``src`` first on
``PYTHONPATH``. Every bench run reports each peer's step time over DDP's in the same round;
the summary gives, per peer, the median of those ratios before and after, and after/before.
Bytes sent and model state must be equal (printed when they differ).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worktree(rev: str, where: str) -> str:
    path = os.path.join(where, rev.replace("/", "_"))
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", "-f", path, rev], check=True, capture_output=True
    )
    return path


def _bench(tree: str, bench_args: list[str], out: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.join(tree, "src")}
    subprocess.run(
        [sys.executable, "-m", "flatshard", "bench", *bench_args, "--out", out], check=True, env=env
    )
    with open(out) as f:
        return json.load(f)


def _summary(runs: dict[str, dict]) -> dict:
    """Per peer: the median ratio to DDP before and after, their quotient, and whether bytes
    sent, model state and final loss are the same in every run. ``runs``: name -> the
    ``peers`` table of one bench run."""
    peers = next(iter(runs.values()))
    out = {}
    for peer in peers:
        ratios = {
            side: [
                r
                for name, run in runs.items()
                if name.startswith(side)
                for r in run[peer]["ratio_to_ddp_by_round"]
            ]
            for side in ("before", "after")
        }
        medians = {side: statistics.median(v) for side, v in ratios.items()}
        same = {
            key: len({run[peer][key] for run in runs.values()}) == 1
            for key in ("sent_bytes_per_step", "model_state_bytes", "final_loss")
        }
        out[peer] = {
            "before_median_ratio_to_ddp": round(medians["before"], 3),
            "after_median_ratio_to_ddp": round(medians["after"], 3),
            "after_over_before": round(medians["after"] / medians["before"], 3),
            "spread_after": [round(min(ratios["after"]), 3), round(max(ratios["after"]), 3)],
            **{f"{k}_equal": v for k, v in same.items()},
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision")
    parser.add_argument("--after", default="HEAD", help="git revision (default HEAD)")
    parser.add_argument("--runs", type=int, default=3, help="bench runs of each revision (default 3)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("bench_args", nargs="*", help="arguments of flatshard bench (after --)")
    args = parser.parse_args()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": _worktree(args.before, tmp), "after": _worktree(args.after, tmp)}
        try:
            for i in range(1, args.runs + 1):
                for side in ("before", "after"):
                    runs[f"{side}-{i}"] = _bench(trees[side], args.bench_args, f"{args.out}.{side}-{i}.json")[
                        "peers"
                    ]
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
    with open(f"{args.out}.after-1.json") as f:
        machine = json.load(f)["machine"]
    summary = _summary(runs)
    result = {
        "what": f"flatshard bench {' '.join(args.bench_args)}, alternating {args.before} (before) and "
        f"{args.after} (after) {args.runs} times each; ratios are each round's step time over DDP's",
        "machine": machine,
        "summary": summary,
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name in runs:
        os.remove(f"{args.out}.{name}.json")
    for peer, s in summary.items():
        print(
            f"{peer:16s} before {s['before_median_ratio_to_ddp']:.3f}  after "
            f"{s['after_median_ratio_to_ddp']:.3f}  after/before {s['after_over_before']:.3f}  "
            f"after spread {s['spread_after']}"
        )


if __name__ == "__main__":
    main()
