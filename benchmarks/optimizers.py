"""The optimizers of issue 5 side by side, same ranks, same run: OwnerShardedOptimizer
(bucketed broadcasts, and one broadcast per param) against torch's ZeroRedundancyOptimizer,
and HybridDeviceOptimizer (half or all of the params on the host, with and without overlap)
against the plain optimizer. Every peer is torch DDP + AdamW underneath.

python benchmarks/optimizers.py --world-size 2 --model small --out bench-results/optimizers.json

Without an accelerator "host" and "device" are the same CPU: the hybrid rows then measure
the cost of the extra copies and per-param sub-optimizers, not the benefit of offloading.
"""

from flatshard.app.bench import script_main
from flatshard.app.peers import OPTIMIZER_PEERS

if __name__ == "__main__":
    script_main(__doc__, OPTIMIZER_PEERS, "bench-results/optimizers.json")
