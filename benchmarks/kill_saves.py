"""Background saves killed at random moments (issue 62's kill test), on 2 gloo ranks.

    PYTHONPATH=src python benchmarks/kill_saves.py OUT.json [--trials 50] [--seed 0]

Each trial starts two ranks that train-and-save in a loop: the params (stage 2, SGD with
momentum) are all set to the step, then saved with ``blocking=False`` to ``ROOT/step-N``;
the next step's values are written as soon as the call returns, while the save is still in
flight. Once the first save is complete, after a random delay, SIGKILL rank 0, rank 1 or
both (chosen at random). Then ``flatshard.latest_checkpoint(ROOT)`` must name the newest
save that finished, and loading it must give params that all equal its step (no tearing,
no mix of two saves) and finite momentum; an unfinished newer save must be skipped, never
loaded. Prints a table of the outcomes and writes every trial to OUT.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time
import warnings

import torch
from torch import nn

import flatshard
from flatshard.checkpoint.destination import MANIFEST
from flatshard.toolkit.testing import run_distributed


def _build():
    torch.manual_seed(0)
    model = flatshard.shard(nn.Sequential(*[nn.Linear(600, 600) for _ in range(6)]), stage=2)
    opt = flatshard.DistributedOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9)
    model(torch.ones(2, 600)).sum().backward()
    opt.step()
    return model, opt


def _save_forever(root: str) -> None:
    rank = torch.distributed.get_rank()
    with open(os.path.join(root, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    model, opt = _build()
    for step in range(1, 10**6):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        path = os.path.join(root, f"step-{step}")
        flatshard.save_checkpoint(path, model, opt, extra={"step": step}, blocking=False)
        if step == 1:
            flatshard.wait_for_checkpoint()
            if rank == 0:
                open(os.path.join(root, "first"), "w").close()


def _step(name: str) -> int:
    return int(name.removeprefix("step-").split(".")[0])


def _trial(root: str, delay: float, victims: tuple[int, ...]) -> dict:
    outcome: list[BaseException] = []

    def ranks() -> None:
        try:
            run_distributed(_save_forever, 2, root, timeout=300)
        except BaseException as e:  # (a killed rank: RankError is the expected end)
            outcome.append(e)

    thread = threading.Thread(target=ranks)
    thread.start()
    began = time.monotonic()
    while not os.path.exists(os.path.join(root, "first")):
        if not thread.is_alive() or time.monotonic() - began > 120:
            raise RuntimeError(f"the first save did not finish: {outcome}")
        time.sleep(0.001)
    time.sleep(delay)
    for rank in victims:
        with open(os.path.join(root, f"pid{rank}")) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    thread.join()
    saves = [n for n in os.listdir(root) if n.startswith("step-")]
    # (a save killed between its manifest and its rename is whole as step-N.partial)
    complete = [_step(n) for n in saves if os.path.isfile(os.path.join(root, n, MANIFEST))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = flatshard.latest_checkpoint(root)
    model, opt = _build()
    step = flatshard.load_checkpoint(path, model, opt)["step"]
    whole = all(bool(torch.all(p == step)) for p in model.parameters())
    finite = all(bool(torch.isfinite(s["momentum_buffer"]).all()) for s in opt.inner.state.values())
    return {
        "delay_s": round(delay, 3),
        "killed": list(victims),
        "saves_on_disk": len(saves),
        "newest_complete": max(complete),
        "loaded_from": os.path.basename(path),
        "loaded": step,
        "skipped_unfinished": sum("did not finish" in str(w.message) for w in caught),
        "ok": step == max(complete) and whole and finite,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    trials = []
    for i in range(args.trials):
        root = tempfile.mkdtemp(prefix="kill_saves.")
        try:
            victims = rng.choice([(0,), (1,), (0, 1)])
            trials.append(_trial(root, rng.uniform(0.0, 0.6), victims))
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print(i, trials[-1], flush=True)
    by_victims = collections.Counter(tuple(t["killed"]) for t in trials)
    print(f"\n{len(trials)} trials, killed {dict(by_victims)}")
    print("| trials | newest complete loaded | torn or mixed | unfinished newer saves skipped |")
    print("| --- | --- | --- | --- |")
    ok = sum(t["ok"] for t in trials)
    skipped = sum(t["skipped_unfinished"] > 0 for t in trials)
    print(f"| {len(trials)} | {ok} | {len(trials) - ok} | in {skipped} trials |")
    with open(args.out, "w") as f:
        json.dump({"trials": trials, "ok": ok, "seed": args.seed}, f, indent=1)


if __name__ == "__main__":
    main()
