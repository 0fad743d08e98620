"""TP2 x PP2 x DP2 on 8 gloo ranks against the whole model in one process: more ranks than
the suite runs (its tests keep to 4), so a script to run by hand, not a test.

    python tests/three_d.py   (about a minute on 2 cores)

Each pipeline chunk of the toolkit's Llama is made tensor-parallel by torchtitan's plan and
sharded over dp at stages 0-3, under 1F1B with 2 micro-batches a dp rank; each step's loss
and clipped norm, and every param after 3 steps, must be within the suite's bound
(tests/mesh/test_pipeline.py: 1e-5 relative, derived there). Prints the worst of each and
exits non-zero past the bound."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from _pipeline import reference, train_tp_pp
from flatshard.toolkit.testing import run_distributed

RELATIVE = 1e-5
STEPS, BATCH = 3, 8  # (4 sequences a dp rank a step: 2 micro-batches of 2)


def main() -> int:
    expected = reference(STEPS, BATCH)
    results = run_distributed(train_tp_pp, 8, [0, 1, 2, 3], STEPS, BATCH, 2, timeout=900)
    worst = {"loss": 0.0, "norm": 0.0, "params": 0.0}
    for by_stage in results:
        for r in by_stage.values():
            for key in ("loss", "norm"):
                for ours, want in zip(r[key], expected[key], strict=True):
                    if ours is not None:  # (the loss: on the last pipeline stage only)
                        worst[key] = max(worst[key], abs(ours - want) / want)
            for name, value in r["params"].items():
                want = expected["params"][name]
                worst["params"] = max(worst["params"], ((value - want).abs().max() / want.abs().max()).item())
    print(f"TP2 x PP2 x DP2, stages 0-3, {STEPS} steps: worst relative difference {worst}")
    return 0 if max(worst.values()) < RELATIVE else 1


if __name__ == "__main__":
    sys.exit(main())
