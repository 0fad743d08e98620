"""flatshard under a real ``lightning.Trainer`` (``strategy="flatshard"``, [Note: Lightning's
strategy] in ``hosts/lightning.py``), against Lightning's own DDP strategy on the plain
LightningModule doing the same job: accumulation of 2 micro-batches, clipping (every step
clips: the norm is well above 0.5), a per-step schedule, weight-decay groups, then
``validate``, at stages 0-3 on 2 ranks and on 3 (padding).

Tolerances: as in ``test_hosts_hf.py`` (the same model, data and optimizer): each
micro-batch's loss and each step's grad norm within 1e-5 relative of DDP's. A resumed run
logs what the uninterrupted one logged, to the bit. Under fp16 autocast, ``FP16_REL``.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from functools import partial

import pytest
import torch

import flatshard
from _hosted import Tokens, float8_linears, on_eager_dynamo, tiny_llama
from flatshard.toolkit.testing import run_distributed

pl = pytest.importorskip("lightning.pytorch")
transformers = pytest.importorskip("transformers")

FP16_REL = 4 * math.sqrt(4 * 2e-7 * 2**-11)
"""About 8e-5. In fp32 the losses match DDP's to the bit and the norms to their summation
order (a relative drift delta <= 2e-7 a step; 9e-8 seen). Under fp16 autocast every use of a
param rounds it to fp16 (unit u = 2**-11): a param whose fp32 value differs by a relative delta
rounds to the other fp16 neighbour with probability delta / u and then moves by u, a change of
mean delta but deviation sqrt(delta * u) an element. Over the many independent elements of a
loss or a norm the relative difference is about sqrt(steps * delta * u) after 4 steps (2e-5;
2.2e-5 seen on an AVX2 CPU), and the bound is 4 of those deviations. A wrong loss scale or a
lost micro-batch moves them by percents."""


class _Module(pl.LightningModule):
    """A Hugging Face causal LM trained as Lightning's docs teach; it records each
    micro-batch's loss and each step's grad norm (before clipping, as the HF Trainer logs it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.reductions: list[int] = []  # (flatshard's side: reductions so far, at each micro-batch)
        self.fused = False  # torch's fused AdamW (the kernel an offloaded step takes)
        self.low_bit: str | None = None  # a torchao low-bit AdamW's name ([Note: blockwise state])

    def training_step(self, batch, index):
        self._note_reductions()
        loss = self.model(**batch).loss
        self._note_loss(loss)
        return loss

    # (outside torch.compile's graphs: traced, each append to a list is a new guard, and the
    # compiled test recompiled its step at every micro-batch, 7 times)
    @torch.compiler.disable
    def _note_reductions(self) -> None:
        if hasattr(self, "comm_stats"):
            self.reductions.append(sum(n for op, n in self.comm_stats.calls.items() if "reduce" in op))

    @torch.compiler.disable
    def _note_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach()))

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def validation_step(self, batch, index):
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self):
        named = list(self.named_parameters())
        groups = [
            {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
        ]
        if self.low_bit is not None:
            import torchao.optim

            optimizer = getattr(torchao.optim, self.low_bit)(groups, lr=1e-3)
        else:
            optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=self.fused or None)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.25, total_iters=4)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _trainer(strategy, out: str, world_size: int, **more) -> pl.Trainer:
    settings = dict(
        accelerator="cpu",
        devices=world_size,  # (the ranks torchrun started, as Lightning counts them)
        max_steps=4,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    return pl.Trainer(strategy=strategy, **{**settings, **more})


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Tokens(), batch_size=2, shuffle=False)


def _against_ddp(stages: list[int], out: str, **more) -> dict:
    """Lightning's DDP on the plain module, then flatshard's strategy at each stage."""
    import flatshard.hosts.lightning  # (registers "flatshard_stage_N")

    model, world_size = tiny_llama(), int(os.environ["WORLD_SIZE"])  # (Lightning's teardown unsets it)
    model = more.pop("prepare", lambda m: m)(model)
    logged = {}
    unused = more.pop("find_unused_parameters", False)
    options = more.pop("options", None)  # more of flatshard.shard's keywords
    for stage in ["ddp", *stages]:
        module = _Module(copy.deepcopy(model))
        module.fused = more.get("fused", False)
        module.low_bit = more.get("low_bit")
        if stage == "ddp":
            name = "ddp_find_unused_parameters_true" if unused else "ddp"
        elif unused or options:
            name = flatshard.hosts.lightning.Strategy(stage, find_unused_parameters=unused, **(options or {}))
        else:
            name = f"flatshard_stage_{stage}"
        plugins = {"plugins": more["plugins_each"]()} if "plugins_each" in more else {}
        settings = {k: v for k, v in more.items() if k not in ("plugins_each", "fused", "low_bit")}
        trainer = _trainer(name, f"{out}/{stage}", world_size, **settings, **plugins)
        trainer.fit(module, _loader())
        (validated,) = trainer.validate(module, _loader(), verbose=False)
        logged[stage] = {"losses": module.losses, "norms": module.norms, "val": validated["val_loss"]}
        logged[stage]["reductions"] = [b - a for a, b in itertools.pairwise(module.reductions)]
        buffers = [b for layout in getattr(module, "layouts", {}).values() for b in layout.buffers]
        logged[stage]["fp8"] = any(b.gather_dtype is not None for b in buffers)
    return logged


def _check_follows(logged: dict, rel: float = 1e-5) -> None:
    want = logged.pop("ddp")
    assert len(want["losses"]) == 8 and len(want["norms"]) == 4, want
    assert all(norm > 0.5 for norm in want["norms"]), want  # (every step clips)
    for stage, got in logged.items():
        for key in ("losses", "norms"):
            assert len(got[key]) == len(want[key]), (stage, key, got, want)
            assert got[key] == pytest.approx(want[key], rel=rel), (stage, key, got, want)
        assert got["val"] == pytest.approx(want["val"], rel=rel), (stage, got, want)
        # the backward of each step's first micro-batch reduces nothing (no_sync); the last's does
        assert all(n == 0 for n in got["reductions"][0::2]), (stage, got["reductions"])
        assert all(n > 0 for n in got["reductions"][1::2]), (stage, got["reductions"])


@pytest.mark.parametrize(("world_size", "stages"), [(2, [0, 1, 2, 3]), (3, [2, 3])])
def test_the_lightning_trainer_follows_its_ddp(tmp_path, world_size, stages):
    for logged in run_distributed(_against_ddp, world_size, stages, str(tmp_path), init=False):
        _check_follows(logged)


@pytest.mark.parametrize("step", ["host", "device"])
def test_the_lightning_trainer_follows_its_ddp_with_the_optimizer_offloaded(tmp_path, step):
    """``Strategy(stage, offload=flatshard.Offload())``: the host step takes torch's fused
    AdamW, so both sides' modules ask for it (the same kernel); stages 2 and 3. ``step="device"``:
    the state streamed to the device for the step ([Note: streamed step]), the same kernel."""
    options = {"offload": flatshard.Offload(step=step)}
    for logged in run_distributed(
        _against_ddp, 2, [2, 3], str(tmp_path), options=options, fused=True, init=False
    ):
        _check_follows(logged)


_eager_against_ddp = partial(on_eager_dynamo, _against_ddp)  # (torchao compiles its step)


def test_torchaos_8bit_adamw_under_lightning_follows_its_ddp(tmp_path):
    """``configure_optimizers`` returns torchao's ``AdamW8bit`` with two weight-decay groups;
    flatshard steps it over shards cut at its blocks' bounds (``Buckets(align=256)``, [Note:
    blockwise state]) at stage 3 (stage 1 under the HF Trainer: ``test_hosts_hf.py``), so the
    quantized moments are one process's and the run follows Lightning's DDP with the same
    optimizer as an fp32-state run does."""
    options = {"buckets": flatshard.Buckets(align=256)}
    for logged in run_distributed(
        _eager_against_ddp, 2, [3], str(tmp_path), options=options, low_bit="AdamW8bit", init=False
    ):
        _check_follows(logged)


class _FreezeLayer0(pl.Callback):
    """Freezes the first decoder layer after step 2 (a progressive schedule's second phase)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 2:
            for name, p in pl_module.named_parameters():
                if ".layers.0." in name:
                    p.requires_grad_(False)


def test_a_layer_frozen_mid_run_by_a_callback_follows_lightnings_ddp(tmp_path):
    """Lightning's DDP, told to find unused params (as DDP needs once a param gets no grad),
    skips the frozen layer from step 3 on; so does flatshard (before, it kept moving under
    AdamW's momentum and decay). Freezing on one side only moves steps 3-4's norms by 11-12%."""
    for logged in run_distributed(
        _against_ddp,
        2,
        [1, 3],
        str(tmp_path),
        callbacks=[_FreezeLayer0()],
        find_unused_parameters=True,
        init=False,
    ):
        _check_follows(logged)


class _OffloadBetweenSteps(pl.Callback):
    """Gives the device away after each optimizer step (the second micro-batch of two), as an
    RL loop does for its rollouts: every training byte of the sharded module and its optimizer
    to the host, back before the next batch and before validation. Lightning's DDP keeps its
    own."""

    def on_train_start(self, trainer, pl_module):
        self.cycles, self.parked = 0, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if isinstance(pl_module, flatshard.ShardedModule) and batch_idx % 2 == 1:
            flatshard.offload_states(pl_module)
            self.cycles, self.parked = self.cycles + 1, True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.parked:
            flatshard.reload_states(pl_module)
            self.parked = False

    def on_train_end(self, trainer, pl_module):
        self.on_train_batch_start(trainer, pl_module, None, 0)
        sharded = isinstance(pl_module, flatshard.ShardedModule)
        assert self.cycles == (trainer.global_step if sharded else 0), (self.cycles, trainer.global_step)
        assert not sharded or trainer.global_step == 4


def test_states_offloaded_between_lightnings_steps_follow_its_ddp(tmp_path):
    """``flatshard.offload_states`` / ``reload_states`` from a callback after every optimizer
    step of Lightning's loop: the run follows Lightning's DDP as a run without them does
    ([Note: states between phases] in phases.py)."""
    for logged in run_distributed(
        _against_ddp, 2, [1, 3], str(tmp_path), callbacks=[_OffloadBetweenSteps()], init=False
    ):
        _check_follows(logged)


def _fp16(stages: list[int], out: str) -> dict:
    """``16-mixed`` on the CPU (Lightning turns the flag into bf16 there, so the plugin is
    given): each side its own ``GradScaler`` (flatshard's strategy makes its own a
    ``ShardedGradScaler``)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return _against_ddp(
        stages, out, plugins_each=lambda: [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]
    )


def test_the_lightning_trainer_follows_its_ddp_under_fp16_with_a_loss_scale(tmp_path):
    """fp16 autocast with a dynamic loss scale: the same fp16 products on both sides and
    no inf at this scale; the fp16 roundings amplify the norms' summation-order drift
    (``FP16_REL``); the scale is unscaled once, before the clip."""
    for one in run_distributed(_fp16, 2, [2, 3], str(tmp_path), init=False):
        _check_follows(one, rel=FP16_REL)


def test_the_lightning_trainer_follows_its_ddp_under_bf16_mixed(tmp_path):
    """``precision="bf16-mixed"``: Lightning's autocast on both sides, fp32 params and grads:
    the same bf16 products from the same fp32 params, so the same tolerance as in fp32."""
    logged = run_distributed(_against_ddp, 2, [1, 3], str(tmp_path), precision="bf16-mixed", init=False)
    for one in logged:
        _check_follows(one)


class _Params(pl.Callback):
    """The full params (rank 0's, CPU) where the first epoch ends and where training starts."""

    def on_train_start(self, trainer, module):
        self.start = module.full_state_dict()

    def on_train_epoch_end(self, trainer, module):
        if trainer.current_epoch == 0:
            self.after_first_epoch = module.full_state_dict()


def _two_epochs(out: str, stage: int, ckpt_path=None, epochs: int = 2, last: bool = False) -> dict:
    """Two epochs (4 steps each on 2 ranks), a checkpoint at the end of each (and ``last``:
    ``last.ckpt``); or, from ``ckpt_path``, the rest of the two; or the first ``epochs``."""
    import flatshard
    import flatshard.hosts.lightning as fl

    world_size = int(os.environ["WORLD_SIZE"])
    module, params = _Module(tiny_llama()), _Params()
    saves = pl.callbacks.ModelCheckpoint(f"{out}/ckpt", save_top_k=-1, every_n_epochs=1, save_last=last)
    trainer = _trainer(
        fl.Strategy(stage=stage),
        out,
        world_size,
        max_steps=-1,
        max_epochs=epochs,
        callbacks=[saves, params],
        enable_checkpointing=True,
    )
    trainer.fit(module, _loader(), ckpt_path=ckpt_path)
    first = getattr(params, "after_first_epoch", None)
    # (the transformers model the module holds)
    flatshard.save_pretrained(module.model, f"{out}/hf-{trainer.current_epoch}")
    return {
        "end": {k.removeprefix("model."): v for k, v in module.full_state_dict().items()},
        "losses": module.losses,
        "steps": trainer.global_step,
        "start": params.start,
        "after_first_epoch": first,
        "saved": sorted(os.listdir(f"{out}/ckpt")),
    }


def test_a_checkpoint_resumes_exactly(tmp_path):
    """A job stopped after its first epoch, whose next saves were cut off, restarted with
    ``ckpt_path="last"``: a flatshard save appears only whole, so Lightning finds the complete
    ``last.ckpt`` beside the unfinished ones; the run logs what the uninterrupted run logged in
    the second epoch, to the bit, and starts from the params it saved."""
    from flatshard.checkpoint.destination import PARTIAL_MARK

    whole = run_distributed(_two_epochs, 2, str(tmp_path / "a"), 2, init=False)
    assert whole[0]["saved"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"], whole[0]["saved"]
    run_distributed(_two_epochs, 2, str(tmp_path / "b"), 2, None, 1, True, init=False)
    ckpt = tmp_path / "b" / "ckpt"
    assert os.path.isfile(ckpt / "last.ckpt" / "flatshard.json"), sorted(os.listdir(ckpt))  # (flatshard's)
    for cut_off in ("epoch=1-step=8.ckpt.partial", "last.ckpt.partial"):  # (as a killed save leaves them)
        os.makedirs(ckpt / cut_off)
        (ckpt / cut_off / PARTIAL_MARK).touch()
    resumed = run_distributed(_two_epochs, 2, str(tmp_path / "b"), 2, "last", 2, True, init=False)
    for rank, (a, b) in enumerate(zip(whole, resumed, strict=True)):
        assert b["steps"] == a["steps"] == 8, (a["steps"], b["steps"])
        assert b["losses"] == a["losses"][8:], (rank, a["losses"], b["losses"])
        if rank == 0:
            assert all(torch.equal(b["start"][k], v) for k, v in a["after_first_epoch"].items())
    # flatshard.save_pretrained(module.model, ...) of a sharded LightningModule: from_pretrained loads it
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b" / "hf-2").state_dict()
    assert loaded.keys() <= resumed[0]["end"].keys() and len(loaded) > 10, sorted(loaded)[:5]
    assert all(torch.equal(v, resumed[0]["end"][k]) for k, v in loaded.items())


def test_a_checkpoint_of_2_ranks_resumes_on_3_at_another_stage(tmp_path):
    (saved, _) = run_distributed(_two_epochs, 2, str(tmp_path / "a"), 2, init=False)
    ckpt = str(tmp_path / "a" / "ckpt" / "epoch=0-step=4.ckpt")
    results = run_distributed(_two_epochs, 3, str(tmp_path / "b"), 3, ckpt, init=False)
    assert all(torch.equal(results[0]["start"][k], v) for k, v in saved["after_first_epoch"].items())
    for result in results:  # (epoch 2 on 3 ranks: 11 sequences each, 6 micro-batches, 3 steps)
        assert result["steps"] == 4 + 3, result["steps"]
        assert len(result["losses"]) == 6 and all(4.0 < loss < 6.0 for loss in result["losses"]), result


def test_registered_names_choose_the_stage():
    import flatshard.hosts.lightning as fl

    for name, stage in [("flatshard", 2), *((f"flatshard_stage_{s}", s) for s in range(4))]:
        strategy = pl.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False).strategy
        assert isinstance(strategy, fl.Strategy) and strategy.options["stage"] == stage, (name, strategy)
    with pytest.raises(ValueError, match=r"stage must be one of .* got 4"):
        fl.Strategy(stage=4)


class _TwoOptimizers(_Module):
    """A GAN's shape: two optimizers, stepped by hand."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.automatic_optimization = False

    def configure_optimizers(self):
        half = len(list(self.parameters())) // 2
        params = list(self.parameters())
        return [torch.optim.SGD(params[:half], lr=0.1), torch.optim.SGD(params[half:], lr=0.1)]


def _refusals(out: str) -> list[str]:
    import flatshard.hosts.lightning as fl

    said = []
    for module, ckpt in [(_TwoOptimizers(tiny_llama()), None), (_Module(tiny_llama()), f"{out}/plain.ckpt")]:
        torch.save({}, f"{out}/plain.ckpt")
        trainer = _trainer(fl.Strategy(stage=1), out, 1, gradient_clip_val=None, accumulate_grad_batches=1)
        try:
            trainer.fit(module, _loader(), ckpt_path=ckpt)
        except ValueError as e:
            said.append(str(e))
    return said


def test_what_cannot_train_right_is_refused_with_the_reason(tmp_path):
    """Two optimizers (one DistributedOptimizer per model), and a checkpoint file that is not
    a flatshard directory (a plain Lightning .ckpt): each a ValueError saying what to do."""
    (said,) = run_distributed(_refusals, 1, str(tmp_path), init=False)
    assert len(said) == 2, said
    assert "returned 2 optimizers" in said[0] and "optimizer_class" in said[0], said[0]
    assert "plain.ckpt is a file" in said[1] and "load its state_dict" in said[1], said[1]


# -- Fabric ---------------------------------------------------------------------------------------
def _fabric_run(
    strategy, model, out: str, steps: int = 4, save_at: int = 0, load: str | None = None, fp16: bool = False
) -> dict:
    """The loop Fabric's docs teach: accumulation of 2 micro-batches under
    ``no_backward_sync``, ``clip_gradients`` (its norm recorded), AdamW over weight-decay
    groups and a schedule built before ``setup`` (and not handed to it); a checkpoint saved
    after step ``save_at``, or one loaded before the first step."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))] if fp16 else None
    fabric = Fabric(
        accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, plugins=plugins
    )
    fabric.launch()
    optimizer = _Module(model).configure_optimizers()["optimizer"]  # (the groups and settings above)
    schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.25, total_iters=4)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 0}
    if load is not None:
        fabric.load(load, state)
    start = model.module.full_state_dict() if hasattr(model.module, "full_state_dict") else None
    losses, norms, saved = [], [], None
    loader = fabric.setup_dataloaders(_loader())
    steps, batches = min(steps, len(loader) // 2), iter(loader)  # (on 3 ranks: 6 micro-batches)
    for _ in range(state["step"] * 2):
        next(batches)  # (the micro-batches of the steps the checkpoint holds)
    while state["step"] < steps:
        for micro in range(2):
            with fabric.no_backward_sync(model, enabled=micro == 0):
                loss = model(**next(batches)).loss
                fabric.backward(loss)
            losses.append(float(loss.detach()))
        norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=0.5)))
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        state["step"] += 1
        if state["step"] == save_at:
            fabric.save(f"{out}/ckpt", state)
            saved = model.module.full_state_dict()
    return {"losses": losses, "norms": norms, "start": start, "saved": saved, "step": state["step"]}


def _fabric_against_ddp(stages: list[int], out: str, fp16: bool) -> dict:
    import flatshard.hosts.lightning  # noqa: F401  (registers "flatshard_stage_N" for Fabric)

    model = tiny_llama()
    runs = {"ddp": _fabric_run("ddp", copy.deepcopy(model), out, fp16=fp16)}
    for stage in stages:
        runs[stage] = _fabric_run(f"flatshard_stage_{stage}", copy.deepcopy(model), out, fp16=fp16)
    return runs


@pytest.mark.parametrize(
    ("world_size", "stages", "fp16"), [(2, [0, 1, 2, 3], False), (3, [2, 3], False), (2, [2, 3], True)]
)
def test_fabric_follows_its_ddp(tmp_path, world_size, stages, fp16):
    """fp16: autocast and a dynamic loss scale on both sides (as under the Trainer above)."""
    for runs in run_distributed(_fabric_against_ddp, world_size, stages, str(tmp_path), fp16, init=False):
        want = runs.pop("ddp")
        assert len(want["norms"]) >= 3 and all(norm > 0.5 for norm in want["norms"]), want
        for stage, got in runs.items():
            for key in ("losses", "norms"):
                rel = FP16_REL if fp16 else 1e-5
                assert got[key] == pytest.approx(want[key], rel=rel), (stage, key, got[key], want[key])


def _fabric_saves_and_resumes(out: str, stage: int, load: str | None) -> dict:
    import flatshard.hosts.lightning as fl

    return _fabric_run(fl.FabricStrategy(stage=stage), tiny_llama(), out, save_at=0 if load else 2, load=load)


def test_fabric_checkpoints_resume_exactly_and_at_another_world_size_and_stage(tmp_path):
    """Saved after step 2 of 4 on 2 ranks at stage 2: resumed there, steps 3-4 log what the
    uninterrupted run logged, to the bit; on 3 ranks at stage 3 the run starts from the
    saved params, to the bit, and trains on (its data has 3 steps: one more)."""
    whole = run_distributed(_fabric_saves_and_resumes, 2, str(tmp_path), 2, None, init=False)
    ckpt = str(tmp_path / "ckpt")
    assert os.path.isfile(os.path.join(ckpt, "flatshard.json")), ckpt
    resumed = run_distributed(_fabric_saves_and_resumes, 2, str(tmp_path / "b"), 2, ckpt, init=False)
    for a, b in zip(whole, resumed, strict=True):
        assert b["step"] == 4 and b["losses"] == a["losses"][4:] and b["norms"] == a["norms"][2:], (a, b)
    elsewhere = run_distributed(_fabric_saves_and_resumes, 3, str(tmp_path / "c"), 3, ckpt, init=False)
    assert all(torch.equal(elsewhere[0]["start"][k], v) for k, v in whole[0]["saved"].items())
    assert all(r["step"] == 3 and len(r["losses"]) == 2 for r in elsewhere), elsewhere


def test_a_float8_model_under_lightning_gathers_fp8_and_follows_its_ddp(tmp_path):
    """The decoder's linears in torchao's float8 (the same conversion on both sides): at
    stage 3 their weights are gathered as fp8 bytes ([Note: fp8 gathers]), which each
    ``Float8Linear`` casts to the fp8 operands DDP's casts from the full weights (the scale
    to 2 fp32 ulps), so the run follows Lightning's DDP as an fp32 one does."""
    for logged in run_distributed(_against_ddp, 2, [3], str(tmp_path), prepare=float8_linears, init=False):
        assert logged[3]["fp8"] and not logged["ddp"]["fp8"]
        _check_follows(logged)


def _compiled_against_ddp(stages: list[int], out: str) -> dict:
    """Lightning's own compile path, ``trainer.fit(torch.compile(module))`` (its steps compiled;
    ``aot_eager``: dynamo's and AOT autograd's graphs without inductor's C++ build), under
    flatshard's strategy, against Lightning's DDP on the module uncompiled (the same ops)."""
    import flatshard.hosts.lightning  # noqa: F401

    model, world_size = tiny_llama(), int(os.environ["WORLD_SIZE"])
    logged = {}
    for stage in ["ddp", *stages]:
        module = _Module(copy.deepcopy(model))
        name = "ddp" if stage == "ddp" else f"flatshard_stage_{stage}"
        trainer = _trainer(name, f"{out}/{stage}", world_size)
        compiled = module if stage == "ddp" else torch.compile(module, backend="aot_eager")
        trainer.fit(compiled, _loader())
        logged[stage] = {"losses": module.losses, "norms": module.norms}
    return logged


def test_a_compiled_lightning_module_follows_its_ddp(tmp_path):
    """At stage 3, whose hooks gather and free params around every unit (one stage: tracing the
    module's steps costs ~15 s here)."""
    for logged in run_distributed(_compiled_against_ddp, 2, [3], str(tmp_path), init=False):
        want = logged.pop("ddp")
        assert len(want["losses"]) == 8 and len(want["norms"]) == 4, want
        for stage, got in logged.items():
            for key in ("losses", "norms"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (stage, key, got, want)


def _fp8_after_the_step(out: str) -> dict:
    """A float8 Llama at stage 2 in bf16 under a real ``lightning.Trainer``, its weights
    gathered after each step in bf16 and in fp8 (``MixedPrecision(fp8_gathers=True)``)."""
    import flatshard.hosts.lightning

    model, world_size, logged = float8_linears(tiny_llama()), int(os.environ["WORLD_SIZE"]), {}
    for fp8 in (None, True):
        mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16, fp8_gathers=fp8)
        module = _Module(copy.deepcopy(model))
        strategy = flatshard.hosts.lightning.Strategy(2, mixed_precision=mp)
        _trainer(strategy, f"{out}/{fp8}", world_size).fit(module, _loader())
        buffers = [b for layout in module.layouts.values() for b in layout.buffers]
        logged[fp8] = {"losses": module.losses, "norms": module.norms}
        logged[fp8]["fp8"] = any(b.gather_dtype is not None for b in buffers)
    return logged


def test_fp8_gathers_after_the_step_under_lightning(tmp_path):
    """Lightning's loop (accumulation, clipping, a schedule) with the float8 weights gathered
    in fp8 after each step follows the bf16-gathering run within 1e-5: the matmul operands are
    the same (``tests/stages/test_fp8_gathers_after_step.py``), the clipping norm summed over
    the fp8 weights' own buffers in another order. (Lightning's DDP has no fp32 main params of
    bf16 params to compare with; the bf16-gathering run follows it in fp32 above.)"""
    for r in run_distributed(_fp8_after_the_step, 2, str(tmp_path), init=False):
        assert r[True]["fp8"] and not r[None]["fp8"]
        for key in ("losses", "norms"):
            assert len(r[True][key]) == len(r[None][key]) > 0, key
            assert r[True][key] == pytest.approx(r[None][key], rel=1e-5), key
