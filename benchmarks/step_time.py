"""Step time of flatshard vs torch DDP on the built-in GPT, same ranks, same run.

python benchmarks/step_time.py --world-size 2 --model small --out bench-results/step_time.json
"""

from flatshard.app.bench import script_main
from flatshard.app.peers import STAGE_PEERS

if __name__ == "__main__":
    script_main(__doc__, STAGE_PEERS, "bench-results/step_time.json")
