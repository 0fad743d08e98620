"""flatshard under a real ``transformers.Trainer`` ([Note: hosted training] in
``hosts/hf.py``), against the Trainer's own DDP on the plain model doing the same job:
accumulation of 2 micro-batches, clipping (every step clips: the norm is well above 0.5),
a linear schedule, weight-decay groups, then ``evaluate``, at stages 0-3 on 2 ranks and on
3 (padding).

Tolerances ([Note: parity tolerances] in _parity.py): the logged loss and grad norm follow
DDP's within 1e-5 relative: fp32 sums of the same terms in another order differ by a few
ulps (~1e-7), which AdamW's first steps (each element moves by about lr whatever its grad's
size) spread to the params at most as lr / |param| ~ 1e-3 relative for the smallest ones,
and the loss, a mean over the params' effect, moves far less (measured below 1e-6).
A resumed run logs what the uninterrupted one logged, to the bit.
"""

from __future__ import annotations

import copy
import os
from functools import partial

import pytest
import torch

import flatshard
from _hosted import SETTINGS, Tokens, float8_linears, logged_steps, on_eager_dynamo, tiny_llama
from flatshard.toolkit.testing import run_distributed

transformers = pytest.importorskip("transformers")


def _args(out: str, **overrides) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(**{**SETTINGS, "output_dir": out, **overrides})


_logged = logged_steps


def _against_ddp(
    stages: list[int], out: str, optim: str, prepare=None, callback=None, shard=None, **more
) -> dict:
    """The Trainer's DDP on the plain model, then flatshard's Trainer at each stage; each
    side's copy of the model through ``prepare`` first, if given; ``callback()``: a fresh
    ``TrainerCallback`` for each trainer; ``shard``: more of ``flatshard.shard``'s keywords (or
    a function of the stage that gives them)."""
    from flatshard.hosts import hf

    model, data = tiny_llama(), Tokens()
    fresh = (lambda: prepare(copy.deepcopy(model))) if prepare else (lambda: copy.deepcopy(model))
    callbacks = lambda: [callback()] if callback else None  # noqa: E731
    logged = {}
    reference = transformers.Trainer(
        model=fresh(),
        args=_args(f"{out}/ddp", optim=optim, **more),
        train_dataset=data,
        callbacks=callbacks(),
    )
    reference.train()
    logged["ddp"] = [*_logged(reference), (reference.evaluate(data)["eval_loss"], 1.0)]
    for stage in stages:
        args = _args(f"{out}/{stage}", optim=optim, **more)
        how = stage if shard is None else {"stage": stage, **(shard(stage) if callable(shard) else shard)}
        trainer = hf.Trainer(model=fresh(), args=args, train_dataset=data, shard=how, callbacks=callbacks())
        trainer.train()
        logged[stage] = [*_logged(trainer), (trainer.evaluate(data)["eval_loss"], 1.0)]
    return logged


def _check_follows(logged: dict, rel: float, clip: float = 0.5) -> None:
    """Each step's (loss, grad norm), then (where logged) (eval loss, 1.0), against DDP's."""
    want = logged.pop("ddp")
    assert len(want) >= 4 and all(norm > clip for _, norm in want[:4]), want  # (every step clips)
    for stage, got in logged.items():
        assert len(got) == len(want), (stage, got)
        for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
            assert loss == pytest.approx(loss_ref, rel=rel), (stage, got, want)
            assert norm == pytest.approx(norm_ref, rel=rel), (stage, got, want)


def test_the_trainer_follows_its_ddp_at_every_stage(tmp_path):
    for logged in run_distributed(_against_ddp, 2, [0, 1, 2, 3], str(tmp_path), "adamw_torch", init=False):
        _check_follows(logged, rel=1e-5)


@pytest.mark.parametrize("step", ["host", "device"])
def test_the_trainer_follows_its_ddp_with_the_optimizer_offloaded(tmp_path, step):
    """``shard={"stage": ..., "offload": flatshard.Offload()}``: the host step takes torch's
    fused AdamW, so the reference trains with ``optim="adamw_torch_fused"`` (the same kernel);
    at stage 3 the param shards live on the host too. ``step="device"``: the same state
    streamed to the device for its step ([Note: streamed step]), the same kernel here."""
    import flatshard

    offload = {"offload": flatshard.Offload(step=step)}
    for logged in run_distributed(
        _against_ddp, 2, [1, 3], str(tmp_path), "adamw_torch_fused", shard=offload, init=False
    ):
        _check_follows(logged, rel=1e-5)


def test_the_trainer_follows_its_ddp_on_3_ranks(tmp_path):
    """3 ranks (buckets padded to a multiple of 3); SGD, which does not amplify a grad's last
    ulps as AdamW's first steps do."""
    for logged in run_distributed(_against_ddp, 3, [1, 3], str(tmp_path), "sgd", init=False):
        _check_follows(logged, rel=1e-5)


def test_the_trainer_follows_its_ddp_under_bf16_autocast(tmp_path):
    """bf16=True: the Trainer's autocast on both sides, fp32 params and grads: the same bf16
    products from the same fp32 params, so the same tolerance as in fp32."""
    for logged in run_distributed(
        _against_ddp, 2, [1, 3], str(tmp_path), "adamw_torch", bf16=True, init=False
    ):
        _check_follows(logged, rel=1e-5)


def _cut_off(checkpoint: str, how: str) -> None:
    """Leave ``checkpoint`` as a save cut off by a failure would: before the host's last
    write (``trainer_state.json``), or with a flatshard file torn."""
    if how == "before its last write":
        os.remove(os.path.join(checkpoint, "trainer_state.json"))
        return
    saved = os.path.join(checkpoint, "flatshard")
    files = [os.path.join(saved, n) for n in os.listdir(saved)]
    largest = max(files, key=os.path.getsize)
    os.truncate(largest, os.path.getsize(largest) // 2)


def _save_resume_export(out: str, stage: int) -> dict:
    """4 steps saving a Trainer checkpoint every 2, the last one then cut off; a new Trainer
    resumed with ``resume_from_checkpoint=True`` (so from step 2's); then save_model of the
    resumed run, loaded by from_pretrained on rank 0."""
    import warnings

    from flatshard.hosts import hf

    data = Tokens()
    first = hf.Trainer(
        model=tiny_llama(),
        args=_args(f"{out}/a", save_strategy="steps", save_steps=2),
        train_dataset=data,
        shard=stage,
    )
    first.train()
    if torch.distributed.get_rank() == 0:
        _cut_off(f"{out}/a/checkpoint-4", "before its last write" if stage == 2 else "torn")
    torch.distributed.barrier()
    again = hf.Trainer(model=tiny_llama(), args=_args(f"{out}/a"), train_dataset=data, shard=stage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again.train(resume_from_checkpoint=True)  # (the host's own pick would be checkpoint-4)
    again.save_model(f"{out}/saved")
    state = again.model.full_state_dict()
    same = None
    if torch.distributed.get_rank() == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/saved").state_dict()
        same = all(torch.equal(loaded[k], v) for k, v in state.items() if k in loaded)
        same = same and set(loaded) <= set(state)
    return {
        "first": _logged(first),
        "resumed": _logged(again),
        "same": same,
        "files": sorted(os.listdir(f"{out}/a/checkpoint-2")),
        "skipped": [str(w.message) for w in caught if "skipping" in str(w.message)],
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_resumes_exactly_and_save_model_loads_with_from_pretrained(tmp_path, stage):
    for rank, result in enumerate(run_distributed(_save_resume_export, 2, str(tmp_path), stage, init=False)):
        # the history of steps 1-2 comes back from the checkpoint; steps 3-4 are trained again
        assert result["resumed"] == result["first"], result  # to the bit
        assert len(result["skipped"]) == 1 and "checkpoint-4" in result["skipped"][0], result["skipped"]
        assert "flatshard" in result["files"] and "optimizer.pt" not in result["files"], result["files"]
        if rank == 0:
            assert result["same"], "from_pretrained loads other values than the sharded model holds"


class _AtTrainBegin(transformers.TrainerCallback):
    """The full params a run starts from (after any resume), on rank 0."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = model.full_state_dict()


def _resume_elsewhere(out: str, stage: int) -> dict:
    """Resume a checkpoint written by 2 ranks at another world size and stage: the params
    it starts from are the checkpoint's (its model.safetensors, which save_model wrote, to
    the bit), and it trains on to step 4."""
    from flatshard.hosts import hf

    start = _AtTrainBegin()
    args = _args(f"{out}/c")
    trainer = hf.Trainer(
        model=tiny_llama(), args=args, train_dataset=Tokens(), shard=stage, callbacks=[start]
    )
    trainer.train(resume_from_checkpoint=f"{out}/a/checkpoint-2")
    same = True
    if torch.distributed.get_rank() == 0:
        saved = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/a/checkpoint-2").state_dict()
        same = all(torch.equal(saved[k], v) for k, v in start.params.items() if k in saved)
    losses = [loss for loss, _ in _logged(trainer)]
    return {"steps": trainer.state.global_step, "losses": losses, "same": same}


def test_a_checkpoint_of_2_ranks_resumes_on_3_at_another_stage(tmp_path):
    run_distributed(_save_resume_export, 2, str(tmp_path), 2, init=False)
    for result in run_distributed(_resume_elsewhere, 3, str(tmp_path), 3, init=False):
        assert result["same"], "the resumed run does not start from the checkpoint's params"
        assert result["steps"] == 4 and len(result["losses"]) == 4, result
        assert all(5.0 < loss < 6.0 for loss in result["losses"]), result


def _lora() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _peft_against_ddp(stages: list[int], out: str) -> dict:
    """LoRA: the Trainer's DDP on the peft model, then flatshard's at each stage; then
    save_model of the last writes the adapter, with the values the sharded model holds."""
    from safetensors.torch import load_file

    from flatshard.hosts import hf

    model, data = _lora(), Tokens()
    args = {"learning_rate": 1e-2, "max_grad_norm": 0.1}  # (LoRA B starts at zero; its grads are small)
    reference = transformers.Trainer(
        model=copy.deepcopy(model), args=_args(f"{out}/ddp", **args), train_dataset=data
    )
    reference.train()
    logged = {"ddp": _logged(reference)}
    for stage in stages:
        trainer = hf.Trainer(
            model=copy.deepcopy(model), args=_args(f"{out}/{stage}", **args), train_dataset=data, shard=stage
        )
        trainer.train()
        logged[stage] = _logged(trainer)
    trainer.save_model(f"{out}/adapter")
    state = trainer.model.full_state_dict()
    if torch.distributed.get_rank() == 0:
        saved = load_file(f"{out}/adapter/adapter_model.safetensors")
        mine = {k: v for k, v in state.items() if "lora_" in k}
        logged["adapter"] = len(saved) == len(mine) > 0 and all(
            torch.equal(saved[k.replace(".default", "")], v) for k, v in mine.items()
        )
    return logged


def test_a_peft_model_follows_ddp_and_saves_its_adapter(tmp_path):
    for rank, logged in enumerate(run_distributed(_peft_against_ddp, 2, [2, 3], str(tmp_path), init=False)):
        if rank == 0:
            assert logged.pop("adapter"), "the adapter written is not the trained one"
        _check_follows(logged, rel=1e-5, clip=0.1)


def _refusals(out: str) -> dict:
    """What would train wrong under the Trainer, refused before training, naming the cause."""
    from flatshard.hosts import hf

    attempts = {
        "no use_cpu": lambda: hf.Trainer(model=tiny_llama(), args=_args(out, use_cpu=False), shard=2),
        "a torch optimizer": lambda: hf.Trainer(
            model=tiny_llama(),
            args=_args(out),
            shard=2,
            optimizers=(torch.optim.SGD(tiny_llama().parameters()), None),
        ),
        "best model": lambda: hf.Trainer(
            model=tiny_llama(),
            args=_args(out, load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"),
            shard=2,
        ),
        "not sharded": lambda: hf.Trainer(model=tiny_llama(), args=_args(out)),
    }
    refused = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except (ValueError, TypeError) as e:
            refused[name] = str(e)
    return refused


def test_what_would_train_wrong_is_refused_before_training(tmp_path):
    for refused in run_distributed(_refusals, 2, str(tmp_path), init=False):
        assert "use_cpu=True" in refused["no use_cpu"] and "2 ranks" in refused["no use_cpu"], refused
        assert "flatshard.DistributedOptimizer" in refused["a torch optimizer"], refused
        assert "load_best_model_at_end" in refused["best model"], refused
        assert "shard=STAGE" in refused["not sharded"], refused


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    """Each decoder layer compiled, as flatshard's compile page teaches (``aot_eager``: dynamo's
    graphs and AOT autograd's, as inductor receives them, without its C++ build)."""
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    return model


def test_the_trainer_follows_its_ddp_with_compiled_layers(tmp_path):
    """The same compiled layers on both sides: the same tolerance as uncompiled."""
    for logged in run_distributed(
        _against_ddp, 2, [2, 3], str(tmp_path), "adamw_torch", _compiled, init=False
    ):
        _check_follows(logged, rel=1e-5)


def test_the_trainer_follows_its_ddp_with_torch_compile_true(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the Trainer compiles the whole model and
    clears grads through the compiled wrapper's ``zero_grad()``, which never reached
    flatshard's (grad norm 1.84 against DDP's 1.42 at step 2, losses drifting from step 3).
    The same compiled model on both sides: the same tolerance. Dynamo's ``eager`` backend: the
    subject is the wrapper, which any backend has (AOTAutograd under the Trainer: compiled
    layers, above). Stage 2, the issue's case (the same path clears every stage:
    test_params_without_grads)."""
    compiled = {"torch_compile": True, "torch_compile_backend": "eager"}
    for logged in run_distributed(_against_ddp, 2, [2], str(tmp_path), "adamw_torch", init=False, **compiled):
        _check_follows(logged, rel=1e-5)


class _FreezeLayer0(transformers.TrainerCallback):
    """Freezes the first decoder layer after step 2 (a progressive schedule's second phase)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            for name, p in model.named_parameters():
                if ".layers.0." in name:
                    p.requires_grad_(False)


def test_a_layer_frozen_mid_run_by_a_callback_follows_the_trainers_ddp(tmp_path):
    """The Trainer's DDP finds unused params (its default for a PreTrainedModel), so it skips
    the frozen layer from step 3 on; so does flatshard (before, the layer kept moving under
    AdamW's momentum and decay, and the losses left DDP's)."""
    for logged in run_distributed(
        _against_ddp, 2, [1, 3], str(tmp_path), "adamw_torch", callback=_FreezeLayer0, init=False
    ):
        _check_follows(logged, rel=1e-5)


class _OffloadBetweenSteps(transformers.TrainerCallback):
    """Gives the device away between steps, as an RL loop does for its rollouts: every
    training byte of a sharded model and its optimizer to the host after each step, back
    before the next and before the run's evaluation (the DDP reference keeps its own)."""

    def __init__(self) -> None:
        self.cycles, self.parked = 0, False

    def on_step_end(self, args, state, control, model=None, **kwargs):
        import flatshard

        if isinstance(model, flatshard.ShardedModule):
            flatshard.offload_states(model)
            self.cycles, self.parked = self.cycles + 1, True

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        import flatshard

        if self.parked:
            flatshard.reload_states(model)
            self.parked = False

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.on_step_begin(args, state, control, model=model)
        reference = args.output_dir.endswith("/ddp")  # (_against_ddp's folder for the Trainer's DDP)
        assert self.cycles == (0 if reference else state.global_step), (args.output_dir, self.cycles)


def test_states_offloaded_between_the_trainers_steps_follow_its_ddp(tmp_path):
    """``flatshard.offload_states`` / ``reload_states`` from a callback, around every step of
    the Trainer's loop (its optimizer and scheduler hold the same objects throughout): the
    run follows the Trainer's DDP as a run without them does ([Note: states between
    phases] in phases.py)."""
    for logged in run_distributed(
        _against_ddp, 2, [1, 3], str(tmp_path), "adamw_torch", callback=_OffloadBetweenSteps, init=False
    ):
        _check_follows(logged, rel=1e-5)


class _ShareDecided(transformers.TrainerCallback):
    """Checks, at the end, what a device budget put on the host: a share of the optimizer
    strictly between none and all, at stage 3 some units and not all (the DDP reference has
    no such optimizer)."""

    def on_train_end(self, args, state, control, optimizer=None, **kwargs):
        if args.output_dir.endswith("/ddp"):
            return
        decided = getattr(optimizer, "optimizer", optimizer).offload  # (accelerate wraps it)
        if args.output_dir.endswith("/3"):  # ([Note: unit homes])
            assert decided is not None and decided.units, decided
        else:
            assert decided is not None and 0 < decided.fraction < 1, decided


def _budget(stage: int) -> dict:
    """``shard``'s keywords at ``stage`` with ``Offload(device_budget=B)``, B 60% of the way
    from what all of the optimizer on the host needs on the most loaded rank to what none
    does (stage 3: a unit a decoder layer, so that the budget chooses among them)."""
    import flatshard
    from flatshard.planner.budget import in_flight_bytes
    from flatshard.planner.plan import plan_from_specs
    from flatshard.wrap.specs import model_specs

    with torch.device("meta"):
        specs = model_specs(tiny_llama(), stage=stage, unit_bytes=None)
    kwargs = {"world_size": 2, "bucket_size": 3000, "stage3_specs": specs}
    none = max(plan_from_specs(specs, rank=r, **kwargs)[stage].device for r in range(2))
    full = max(plan_from_specs(specs, rank=r, offload=True, **kwargs)[stage].device for r in range(2))
    in_flight = in_flight_bytes(specs)[0] if stage == 3 else 0
    budget = full + int(0.6 * (none - 1 - full)) + in_flight
    more = {"stage3": flatshard.Stage3(unit_bytes=None)} if stage == 3 else {}
    more["buckets"] = flatshard.Buckets(size=3000)
    return {"offload": flatshard.Offload(device_budget=budget), **more}


def _budgeted_against_ddp(out: str) -> dict:
    return _against_ddp([1, 3], out, "adamw_torch_fused", shard=_budget, callback=_ShareDecided)


def test_a_device_budget_under_the_trainer_follows_its_ddp(tmp_path):
    """``shard={"offload": flatshard.Offload(device_budget=B)}``: the optimizer built by the
    Trainer takes the least offload that fits B (a share of its state at stage 1, some
    decoder layers at stage 3), and the run follows the Trainer's DDP with the same fused
    AdamW on both sides."""
    for logged in run_distributed(_budgeted_against_ddp, 2, str(tmp_path), init=False):
        _check_follows(logged, rel=1e-5)


_eager_against_ddp = partial(on_eager_dynamo, _against_ddp)  # (torchao compiles its step)


def test_the_trainers_torchao_8bit_adamw_over_aligned_shards_follows_its_ddp(tmp_path):
    """``optim="adamw_torch_8bit"``: the Trainer's own torchao AdamW8bit, its weight-decay
    groups and schedule, stepped over shards cut at block bounds ([Note: blockwise state]):
    the quantized moments are one process's, so the run follows the Trainer's DDP as an
    fp32-state run does (the embedding, the head, the MLP and the q and o projections, of 4096
    elements and more, have quantized moments; k, v and the norms plain ones)."""
    aligned = {"buckets": flatshard.Buckets(align=256)}
    for logged in run_distributed(
        _eager_against_ddp, 2, [1, 3], str(tmp_path), "adamw_torch_8bit", shard=aligned, init=False
    ):
        _check_follows(logged, rel=1e-5)


def test_a_float8_model_under_the_trainer_follows_its_ddp(tmp_path):
    """A transformers Llama converted to float8 training, the same conversion on both sides:
    flatshard makes torchao's wrapped weights plain params ([Note: tensor-subclass params]),
    and at 2 ranks the grads are the same sums as DDP's, so the fp8 casts of the same weights
    are the same and the run follows DDP as an fp32 one does. At stage 3 the weights are
    gathered as fp8 bytes ([Note: fp8 gathers]), which ``Float8Linear`` casts to the same fp8
    operands (the scale to 2 fp32 ulps)."""
    for logged in run_distributed(
        _against_ddp, 2, [1, 3], str(tmp_path), "adamw_torch", prepare=float8_linears, init=False
    ):
        _check_follows(logged, rel=1e-5)


def _fp8_after_the_step(out: str) -> dict:
    """A float8 Llama at stage 1 in bf16 under the Trainer, its weights gathered after each
    step in bf16 and in fp8 (``MixedPrecision(fp8_gathers=True)``); each run's logs, and
    the fp8 run's saved weights beside its fp32 values of record."""
    from safetensors.torch import load_file

    from flatshard.hosts import hf

    model, data, logged = float8_linears(tiny_llama()), Tokens(), {}
    for fp8 in (None, True):
        mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16, fp8_gathers=fp8)
        args = _args(f"{out}/{fp8}")
        how = {"stage": 1, "mixed_precision": mp}
        trainer = hf.Trainer(model=copy.deepcopy(model), args=args, train_dataset=data, shard=how)
        trainer.train()
        logged[fp8] = _logged(trainer)
        trainer.save_model(f"{out}/{fp8}/final")
        exact = trainer.model.full_state_dict()
    saved = load_file(f"{out}/True/final/model.safetensors") if torch.distributed.get_rank() == 0 else {}
    same = all(torch.equal(v, exact[k]) for k, v in saved.items())
    return {"logged": logged, "saved": len(saved), "same": same}


def test_fp8_gathers_after_the_step_under_the_trainer(tmp_path):
    """The Trainer's loop (accumulation, clipping, a schedule) with the float8 weights gathered
    in fp8 after each step logs the bf16-gathering run's losses and norms within 1e-5 (the
    fp8 weights' own buffers sum the clipping norm in another order; the matmul operands are
    the same: ``tests/stages/test_fp8_gathers_after_step.py``), and ``save_model`` writes the
    fp32 values of record, not the fp8 values the params hold between steps."""
    results = run_distributed(_fp8_after_the_step, 2, str(tmp_path), init=False)
    for r in results:
        _check_follows({"ddp": r["logged"][None], "fp8": r["logged"][True]}, rel=1e-5)
    assert results[0]["saved"] > 0 and results[0]["same"]  # (rank 0 writes)


class _BatchNormOverHidden(torch.nn.Module):
    """BatchNorm1d over the hidden features, in place of the final norm: buffers training
    changes (its running statistics), which ``evaluate`` reads."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


def _with_batchnorm(model: torch.nn.Module) -> torch.nn.Module:
    model.model.norm = _BatchNormOverHidden(model.config.hidden_size)
    return model


def test_batchnorm_statistics_in_the_trainers_evaluate_follow_its_ddp(tmp_path):
    """Each rank's running statistics move with its own batches. The Trainer's DDP sends rank
    0's before the first micro-batch of each step (the forward before it, the last of the
    step before, synced), and its evaluation runs on the plain model, without DDP: each rank
    with its own. flatshard sent them before the synced micro-batch instead, and (after the
    rule was made DDP's) before the evaluation too: the mean eval loss over ranks moved by a
    few 1e-6, inside the tolerance, so it is compared to the bit here (the training losses
    are bit-equal in this run too)."""
    for logged in run_distributed(
        _against_ddp, 2, [1, 3], str(tmp_path), "adamw_torch", prepare=_with_batchnorm, init=False
    ):
        evals = {stage: got[-1] for stage, got in logged.items()}
        _check_follows(logged, rel=1e-5)
        assert all(e == evals["ddp"] for e in evals.values()), evals
