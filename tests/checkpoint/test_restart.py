"""A job that torchrun starts again after a rank is killed resumes by itself from the newest
complete checkpoint ([Note: latest checkpoint] in checkpoint/latest.py) and ends where an
uninterrupted job ends, bit for bit."""

import os
import subprocess
import sys

import torch

from flatshard.toolkit.testing import run_script

_JOB = """
import os, signal, sys, time
import torch, torch.distributed as dist
import flatshard
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, PRESETS

root, out, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = flatshard.shard(GPT(PRESETS["tiny"]), stage=3)
opt = flatshard.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-2)
corpus = SyntheticCorpus(vocab_size=64, seq_len=16)
start = 0
if (path := flatshard.latest_checkpoint(root)) is not None:
    start = flatshard.load_checkpoint(path, model, opt)["step"] + 1
    with open(os.path.join(root, f"resumed-{dist.get_rank()}"), "w") as f:  # (ranks' prints interleave)
        f.write(os.path.basename(path))
for step in range(start, 8):
    model(*corpus.batch(step, dist.get_rank(), batch_size=2)).backward()
    opt.step()
    opt.zero_grad()
    if step % 2 == 1:
        name = os.path.join(root, f"step-{step}")
        flatshard.save_checkpoint(name, model, opt, extra={"step": step}, blocking=False)
    first_try = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if step == kill_at and first_try and dist.get_rank() == 1:  # (its save is in flight)
        # (as soon as rank 0 has marked the save unfinished, long before it can finish: killed
        # earlier, the save would leave no trace and a restart nothing to skip by name)
        mark, waited = os.path.join(root, f"step-{step}.partial", ".flatshard-partial"), time.monotonic()
        while not os.path.exists(mark) and time.monotonic() - waited < 60:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
flatshard.wait_for_checkpoint()
full = model.full_state_dict()
if dist.get_rank() == 0:
    torch.save(full, out)
dist.destroy_process_group()
"""


def _torchrun(job, root, out, kill_at: int, restarts: int) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", str(restarts), "--monitor-interval", "0.1", str(job)]
    # torch 2.13's workers share the agent's store, where a restarted gloo group can read the
    # dead attempt's addresses (pytorch/pytorch#135712); docs/checkpoints.md says to set this
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*command, root, out, str(kill_at)], env=env, capture_output=True, text=True, timeout=240
    )


def test_a_job_restarted_after_a_rank_is_killed_resumes_and_ends_as_an_uninterrupted_one(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(_JOB)
    run_script(job, 2, str(tmp_path / "plain"), str(tmp_path / "plain.pt"), "-1", timeout=120)
    assert not any(n.startswith("resumed") for n in os.listdir(tmp_path / "plain"))
    # rank 1 dies right after its save of step 5 began; torchrun starts both ranks again
    killed = _torchrun(job, tmp_path / "killed", tmp_path / "killed.pt", kill_at=5, restarts=2)
    assert killed.returncode == 0, killed.stderr[-4000:]
    for rank in (0, 1):
        with open(tmp_path / "killed" / f"resumed-{rank}") as f:
            assert f.read() == "step-3", killed.stderr[-4000:]
    assert "skipping" in killed.stderr and "step-5" in killed.stderr  # (the unfinished save, by name)
    expected, got = (torch.load(tmp_path / f"{k}.pt") for k in ("plain", "killed"))
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(value, got[name]), name  # (the same steps from the same state: exact)
