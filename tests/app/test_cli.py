"""The flatshard command line, end to end (real processes)."""

import os
import subprocess
import sys

import pytest

from _cli import cli, missing_from_help
from flatshard.toolkit.testing import run_distributed


def _flatshard(*args, timeout=240):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "flatshard", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _ranks(world_size: int, *args, timeout: float = 240) -> subprocess.CompletedProcess:
    """``flatshard ARGS`` (``_main``) as it runs as each of ``world_size`` ranks under torchrun,
    the ranks forked from the suite's forkserver (torch already imported) rather than started
    as new interpreters: ~1-2 s a command instead of ~11 s, nearly all of it imports. Rank 0's
    result, once every rank has returned the same status. The launcher that starts ranks
    itself (``-n N`` outside torchrun) is tested through real processes by the tests that
    call ``_flatshard``."""
    outs = run_distributed(cli, world_size, *args, init=False, timeout=timeout)
    assert len({out.returncode for out in outs}) == 1, outs
    return outs[0]


def _check_the_loss_fell(out: subprocess.CompletedProcess, stage: str) -> None:
    assert out.returncode == 0, out.stderr
    assert "tiny GPT" in out.stdout and f"stage {stage}, 2 rank(s)" in out.stdout
    line = next(x for x in out.stdout.splitlines() if x.strip().startswith("loss"))
    first, final = (float(v) for v in line.split()[1:4:2])
    uniform = float(line.split("uniform guess ")[1].split(",")[0])
    assert final < first - 0.5 and final < uniform - 0.5, line


@pytest.mark.parametrize(
    ("stage", "extra", "started"),
    [
        ("0", [], "by its launcher"),
        ("1", ["--offload-fraction", "0.5", "--fp8-gathers", "--dtype", "bf16"], "as under torchrun"),
        ("3", ["--offload-fraction", "1", "--offload-step", "device"], "as under torchrun"),
    ],
)
def test_train_starts_its_ranks_and_the_loss_falls(stage, extra, started):
    """Its own launcher starting real processes once; the other case as ranks under torchrun
    (``_ranks``), which trains the same without two new interpreters. (Stage 3's run is the
    first of test_train_starts_from_plain_weights.)"""
    args = ["train", "--world-size", "2", "--model", "tiny", "--steps", "60", "--lr", "1e-2"]
    args += ["--stage", stage]
    out = _flatshard(*args, *extra) if started == "by its launcher" else _ranks(2, *args, *extra)
    _check_the_loss_fell(out, stage)
    # (float8 linears in bf16, gathered in fp8 after each step at stage 1)
    assert ("float8 linears gathered in fp8" in out.stdout) == ("--fp8-gathers" in extra), out.stdout
    if extra:  # (1: flatshard.Offload, the whole optimizer, streamed; 0.5: a HybridDeviceOptimizer)
        assert f"{float(extra[1]):.0%} of the optimizer on the host" in out.stdout
        assert ("stepped on the device" in out.stdout) == ("device" in extra), out.stdout
        assert "on the host" in out.stdout.splitlines()[-1], out.stdout  # (memory_report's homes)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["train", "--stage", "7"], "argument --stage: invalid choice: 7"),
        (["train", "--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
        (["train", "--model", "huge"], "--model 'huge' is neither a GPT preset"),
        (["train", "--model", "nosuchmodule:build"], "cannot import 'nosuchmodule'"),
        (["train", "--data", "/nonexistent.txt"], "--data /nonexistent.txt: no such file"),
        (["train", "--resume"], "--resume needs --checkpoint-dir"),
        (
            ["train", "--device", "cuda", "--world-size", "64"],
            "--device cuda needs a CUDA device per local rank: 64 rank(s)",
        ),
        (["train", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["train", "--micro-batches", "0"], "argument --micro-batches: expected a positive integer, got '0'"),
        (["train", "--lr", "-1"], "argument --lr: expected a positive number, got '-1'"),
        (
            ["train", "--offload-fraction", "2"],
            "argument --offload-fraction: expected a number in [0, 1], got '2'",
        ),
        (["train", "--offload-step", "device"], "it needs --offload-fraction 1, got 0"),
        (["train", "--stage", "1", "--fp8-gathers"], "--fp8-gathers at stage 1 needs --dtype bf16"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["plan"], "one of the arguments --params --model is required"),
        (["plan", "--model", "nosuch"], "neither a GPT preset"),
        (["plan", "--model", "tiny", "--grad-dtype", "fp16"], "--grad-dtype applies to --params only"),
        (["plan", "--params", "10", "--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb'"),
        (["plan", "--model", "tiny", "--rank", "5", "-n", "2"], "rank 5 is outside a world of size 2"),
        (["layout"], "the following arguments are required: --model"),
        (["layout", "--model", "nosuch"], "neither a GPT preset"),
        (["layout", "--model", "tiny", "--stage", "4"], "argument --stage: invalid choice: 4"),
        (["train", "--checkpoint-dir", __file__], f"--checkpoint-dir {__file__} is a file, not a directory"),
        (["export", "/nonexistent/ckpt", "out.pt"], "no checkpoint at /nonexistent/ckpt"),
        (["export", "ckpt"], "the following arguments are required: out"),
        (["export", "a", "b.pt", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3'"),
        (["bench", "--peers", "megatron"], "argument --peers: invalid choice: 'megatron'"),
        (["bench", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    ],
)
def test_bad_arguments_exit_nonzero_with_a_reason(args, reason, capsys, monkeypatch):
    """In this process (``main`` as ``python -m flatshard`` calls it; each case used to cost a
    new interpreter and torch import, ~3 s): exit status 2 and the reason on stderr's last line."""
    from flatshard.app.cli import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        code = main(list(args))  # (a check after parsing returns the status)
    except SystemExit as e:  # (argparse's own errors exit)
        code = e.code
    assert code == 2
    assert reason in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_command_exits_2_with_the_reason():
    """The same through a real ``python -m flatshard`` process, for a check after parsing (the
    status ``main`` returns; argparse's own errors exit 2 by themselves, as above)."""
    out = _flatshard("export", "/nonexistent/ckpt", "out.pt", timeout=60)
    assert out.returncode == 2
    assert "no checkpoint at /nonexistent/ckpt" in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("device", "ranks", "gpus", "chosen"),
    [
        ("auto", 2, 0, "cpu"),
        ("auto", 2, 1, "cpu"),
        ("auto", 2, 2, "cuda"),
        ("auto", 1, 1, "cuda"),
        ("cpu", 1, 8, "cpu"),
    ],
)
def test_device_auto_is_cuda_only_with_a_gpu_per_local_rank(monkeypatch, device, ranks, gpus, chosen):
    """With 2 ranks on a one-GPU machine, ``auto`` used to pick CUDA for both, and rank 1 then
    asked for ``set_device(1)``, which does not exist; now it trains on CPU there, and
    ``cuda`` says why it cannot."""
    import torch

    from flatshard.app.train import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_device(device, ranks) == chosen
    if gpus < ranks:
        with pytest.raises(ValueError, match=f"{ranks} rank\\(s\\), {gpus} device"):
            resolve_device("cuda", ranks)


def test_help_lists_every_train_option():
    assert not missing_from_help(
        "train",
        (
            "--world-size",
            "--stage",
            "--model",
            "--steps",
            "--batch-size",
            "--lr",
            "--bucket-size",
            "--offload-fraction",
            "--micro-batches",
            "--dtype",
            "--data",
            "--seq-len",
            "--checkpoint-dir",
            "--checkpoint-every",
            "--resume",
            "--init-from",
            "--metrics",
            "--plot",
        ),
    )


def test_layout_prints_every_ranks_shards_and_draws_a_png(tmp_path):
    png = tmp_path / "layout.png"
    out = cli("layout", "--model", "tiny", "-n", "3", "--stage", "3", "--out", str(png))
    assert out.returncode == 0, out.stderr
    assert "sharded over 3 ranks" in out.stdout and "wte.weight" in out.stdout
    shard_lines = [line for line in out.stdout.splitlines() if line.strip().startswith("buffer 0 bucket")]
    assert shard_lines and all("rank 2:" in line for line in shard_lines)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    help_text = cli("layout", "--help").stdout
    for option in ("--model", "--world-size", "--stage", "--param-dtype", "--bucket-size", "--out"):
        assert option in help_text


def test_layout_shows_whole_param_buckets():
    out = cli("layout", "--model", "tiny", "-n", "2", "--whole-params", r"blocks\.")
    assert out.returncode == 0, out.stderr
    owned = [line for line in out.stdout.splitlines() if "attn.qkv.weight" in line]
    assert owned and all("(rank " in line for line in owned)
    assert "(whole params)" in out.stdout
    bad = cli("layout", "--model", "tiny", "--whole-params", "(")
    assert bad.returncode == 2 and "--whole-params '(' is not a regular expression" in bad.stderr


def test_export_writes_a_state_dict_the_plain_model_loads(tmp_path):
    import torch

    import flatshard
    from _parity import TiedGPT

    torch.manual_seed(3)
    model = flatshard.shard(TiedGPT(), stage=0)
    flatshard.save_checkpoint(str(tmp_path / "ckpt"), model)
    out = cli("export", str(tmp_path / "ckpt"), str(tmp_path / "m.pt"), "--dtype", "bf16")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"wrote {tmp_path / 'm.pt'}: ")
    plain = TiedGPT()
    plain.load_state_dict(torch.load(str(tmp_path / "m.pt"), weights_only=True))
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q.bfloat16().float())
    help_text = cli("export", "--help").stdout
    for option in ("checkpoint", "out", "--weights", "--dtype", "--chunk-mib"):
        assert option in help_text


def test_bench_compares_ddp_and_flatshard_and_counts_the_bytes_sent(tmp_path):
    import json

    out_json = tmp_path / "bench.json"
    out = cli(  # (in this process: its ranks fork from the suite's forkserver)
        "bench",
        "-n",
        "2",
        "--model",
        "tiny",
        "--peers",
        "ddp",
        "flatshard-2",
        "--steps",
        "2",
        "--rounds",
        "2",
        "--out",
        str(out_json),
    )
    assert out.returncode == 0, out.stderr
    assert "ddp" in out.stdout and "flatshard-2" in out.stdout and f"wrote {out_json}" in out.stdout
    result = json.loads(out_json.read_text())
    ddp, ours = result["peers"]["ddp"], result["peers"]["flatshard-2"]
    assert ddp["ratio_to_ddp"] == 1.0 and ours["ratio_to_ddp"] > 0
    # each round paired with DDP's in the same round
    assert ddp["ratio_to_ddp_by_round"] == [1.0, 1.0]
    assert len(ours["ratio_to_ddp_by_round"]) == 2 and min(ours["ratio_to_ddp_by_round"]) > 0
    assert abs(ours["final_loss"] - ddp["final_loss"]) < 1e-4  # the same training
    assert ddp["final_losses_agree_across_rounds"] and ours["final_losses_agree_across_rounds"]
    grad_bytes = 4 * result["params"]
    # a ring all-reduce sends 2 (N-1)/N of the grads per rank: the tiny GPT's at N = 2
    assert grad_bytes <= ddp["sent_bytes_per_step"] < 1.1 * grad_bytes
    # stage 2: half of that in the grads' reduce-scatter, half in the params' all-gather,
    # which a step leaves in flight: the count must not lose it at either end of the window
    assert grad_bytes <= ours["sent_bytes_per_step"] < 1.1 * grad_bytes
    assert ours["model_state_bytes"] < ddp["model_state_bytes"]
    assert ours["rss_bytes"] > ours["rss_growth_bytes"] > 0


def _text_file(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    return text


def test_train_on_a_text_file_with_metrics_plot_checkpoints_and_exact_resume(tmp_path):
    """Byte-level text, two micro-batches, bf16, stage 2 at 2 ranks: a run of 12 steps
    writes its metrics, plot and checkpoints; resumed from its step-8 checkpoint, the
    run's last 4 steps are the same as the uninterrupted run's, bit for bit."""
    import json

    text, ckpt = _text_file(tmp_path), tmp_path / "ckpt"
    common = ["train", "-n", "2", "--model", "small", "--stage", "2", "--steps", "12", "--data", str(text)]
    common += ["--seq-len", "32", "--batch-size", "4", "--micro-batches", "2", "--dtype", "bf16"]
    out = _ranks(
        2,
        *common,
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        "4",
        "--metrics",
        str(tmp_path / "a.jsonl"),
        "--plot",
        str(tmp_path / "loss.png"),
    )
    assert out.returncode == 0, out.stderr
    assert "small GPT" in out.stdout and "bf16" in out.stdout and "uniform guess 5.545" in out.stdout
    records = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "model_state_bytes", "comm_wire_bytes"):
        assert all(r[key] > 0 for r in records), key
    assert records[-1]["loss"] < records[0]["loss"]
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(ckpt)) == ["step-12", "step-8"]  # the newest two
    import shutil

    shutil.rmtree(ckpt / "step-12")  # as if the run had stopped after step 8's save
    out = _ranks(
        2, *common, "--checkpoint-dir", str(ckpt), "--resume", "--metrics", str(tmp_path / "b.jsonl")
    )
    assert out.returncode == 0, out.stderr
    assert "steps            8 -> 12" in out.stdout
    resumed = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [9, 10, 11, 12]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [
        (r["loss"], r["grad_norm"]) for r in records[8:]
    ]
    # resuming with no step left to train is refused (it used to print negative tokens/s); a
    # real process, started by the launcher, whose exit status is the ranks'
    out = _flatshard(*common, "--checkpoint-dir", str(ckpt), "--resume")
    assert out.returncode == 2
    assert "--steps 12, but the newest checkpoint" in out.stderr and "is at step 12" in out.stderr


def test_train_starts_from_plain_weights(tmp_path):
    """A stage-3 run whose loss falls; then --init-from: its exported weights start the next
    run (whose first loss is the trained model's, far below an untrained one's)."""
    import json

    ckpt = tmp_path / "ckpt"
    base = ["train", "-n", "2", "--model", "tiny", "--lr", "1e-2", "--checkpoint-dir", str(ckpt)]
    out = _ranks(2, *base, "--steps", "60", "--stage", "3", "--metrics", str(tmp_path / "a.jsonl"))
    _check_the_loss_fell(out, "3")
    weights = tmp_path / "w.safetensors"
    out = cli("export", str(ckpt / "step-60"), str(weights))
    assert out.returncode == 0, out.stderr
    out = _ranks(
        2,
        "train",
        "-n",
        "2",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--stage",
        "1",
        "--init-from",
        str(weights),
        "--metrics",
        str(tmp_path / "b.jsonl"),
    )
    assert out.returncode == 0, out.stderr
    trained = [json.loads(line)["loss"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    started = json.loads((tmp_path / "b.jsonl").read_text().splitlines()[0])["loss"]
    assert started < trained[0] - 0.5 and abs(started - trained[-1]) < 0.3


def test_bench_runs_a_hugging_face_model_with_every_torch_peer_and_shows_progress(tmp_path):
    """``bench --model hf:llama``: the peers that wrap blocks (FSDP2) find the decoder layers,
    every peer trains the same model to the same loss, and each round says so on stderr."""
    import json

    out_json = tmp_path / "bench.json"
    args = ["bench", "-n", "2", "--model", "hf:llama", "--peers", "ddp", "fsdp2-zero3", "flatshard-3"]
    out = cli(*args, "--steps", "2", "--rounds", "1", "--batch", "2", "--out", str(out_json))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("hf:llama ("), out.stdout
    rounds = [line for line in out.stderr.splitlines() if line.startswith("round ")]
    assert len(rounds) == 3 and all("ms/step, loss" in line for line in rounds), out.stderr
    result = json.loads(out_json.read_text())
    peers = result["peers"]
    losses = [peers[name]["final_loss"] for name in ("ddp", "fsdp2-zero3", "flatshard-3")]
    assert max(losses) - min(losses) < 1e-4, losses
    # theory on 2 ranks, fp32: DDP all-reduces the grads (2 units of half the bytes), stage 3
    # reduce-scatters them and gathers the params twice (3 units)
    fp32 = 4 * result["params"]
    assert peers["ddp"]["theory_bytes_per_step"] == fp32
    assert peers["flatshard-3"]["theory_bytes_per_step"] == 3 * fp32 // 2
