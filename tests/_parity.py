"""Shared pieces of the parity tests: a small transformer with every awkward feature, and
a loop that trains it side by side with a torch DDP reference.

[Note: parity tolerances]

Losses match torch DDP to 1e-5 relative at every micro-batch. Params match to 1e-5 with SGD
+ momentum at every world size; with AdamW at world sizes 1-2. At 3-4 ranks the bucket
boundaries change gloo's summation order and Adam turns last-ulp differences in near-
cancelling grads into updates of order lr (its step is ~sign(grad)); grads themselves agree
to ~1e-7 there, so those params are held to 1e-2.

The same holds for ``DistributedOptimizer``: with SGD + momentum, params match DDP to 1e-5
at every stage and world size, with param groups, an LR schedule, clipping and accumulation.
With AdamW they match to 1e-5 at world sizes 1-2 without clipping; clipping multiplies grads
by a coefficient computed from a norm summed in a different order (it agrees to ~1e-7), and
Adam again turns that into differences of order lr for near-cancelling grads; so clipping is
tested with SGD, and AdamW (param groups, LR schedule, accumulation) is held to 1e-5 at 1-2
ranks and 1e-2 at 3-4. bf16 params with fp32 main params are held to an fp32 DDP run within
bf16 rounding (losses 2e-3, all params together 1.5e-2), and closer to it than AdamW on bf16
params.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import flatshard
from flatshard.toolkit.data import SyntheticCorpus
from flatshard.toolkit.models import GPT, GPTConfig

SGD = {"optimizer_class": torch.optim.SGD, "opt_kwargs": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}}


def check_parity(result: dict, *, params: float, loss: float = 1e-5, norm: float = 1e-5) -> None:
    """Losses, grad norms and params of a side-by-side run within the given tolerances.

    Where the run recorded ``loss_bounds`` (see ``first_order_loss_bounds``), each loss is
    held to ``loss`` plus the first-order effect of the params' drift before its step."""
    bounds = [loss + extra for extra in result.get("loss_bounds", [0.0] * len(result["loss_diffs"]))]
    assert all(d < b for d, b in zip(result["loss_diffs"], bounds, strict=True)), (
        result["loss_diffs"],
        bounds,
    )
    assert max(result["param_diffs"]) < params, result["param_diffs"]
    assert max(result["norm_diffs"], default=0.0) < norm, result["norm_diffs"]


CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2, tie_embeddings=True)


class AwkwardGPT(GPT):
    """GPT with tied embeddings, a frozen param and a param that forward never uses."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.unused = nn.Parameter(torch.randn(7, 3))
        self.blocks[0].ln1.weight.requires_grad_(False)


@torch.no_grad()
def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest elementwise difference, relative to the reference tensor's largest value."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def step_both(opt: torch.optim.Optimizer, opt_ref: torch.optim.Optimizer) -> None:
    """Step the sharded side's optimizer and the reference's, then zero both grads to None."""
    opt.step()
    opt_ref.step()
    opt.zero_grad()
    opt_ref.zero_grad(set_to_none=True)


def drift_from(ours: nn.Module, reference: nn.Module) -> float:
    """``max_rel_diff`` of the sharded model's full params (every rank calls it: a summon at
    stage 3) against ``reference``'s (a DDP module's own module), the largest over params."""
    with ours.summon_full_params(writeback=False):
        pairs = zip(ours.parameters(), reference.parameters(), strict=True)
        return max(max_rel_diff(p, q) for p, q in pairs)


@torch.no_grad()
def max_abs_diff(ours: nn.Module, reference: nn.Module) -> float:
    """Largest elementwise difference of any param (absolute): the drift ``δ`` of a trajectory."""
    pairs = zip(full_params(ours), reference.parameters(), strict=True)
    return max(float((p.float() - q.float()).abs().max()) for p, q in pairs if p.numel())


def first_order_loss_bounds(module: nn.Module, corpus, step: int, accum: int, batch: int, drift: float):
    """How far each micro-batch loss of ``step`` may move, relative, when every param is
    off by at most ``drift`` from ``module``'s (absolute): by Taylor, |L(p + δ) - L(p)| <=
    ||∇L||₁ ||δ||∞ + O(δ²); the factor 2 leaves room for the second-order term as large as
    the first. This is what a param tolerance above 1e-5 (Adam or Muon at 3-4 ranks) means
    for the next losses: they are held to it, not to a number tuned on one CPU model."""
    if drift == 0.0:
        return [0.0] * accum
    probe = copy.deepcopy(module)  # (DDP's hooks stay on the reference)
    params = [p for p in probe.parameters() if p.requires_grad]
    bounds = []
    for micro in range(accum):
        x, y = corpus.batch(step * accum + micro, dist.get_rank(), batch)
        loss = probe(x, y) / accum
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        l1 = sum(float(g.abs().sum()) for g in grads if g is not None)
        bounds.append(2.0 * l1 * drift / abs(float(loss)))
    return bounds


def accumulate(reference, ours, corpus, step: int, accum: int, batch: int, ours_sync_all: bool = False):
    """One step's micro-batches through both models (DDP accumulates under no_sync; ours
    too unless ``ours_sync_all``); yields (loss, reference loss) per micro-batch."""
    rank = dist.get_rank()
    for micro in range(accum):
        x, y = corpus.batch(step * accum + micro, rank, batch)
        last = micro == accum - 1
        with nullcontext() if last else reference.no_sync():
            loss_ref = reference(x, y) / accum
            loss_ref.backward()
        with nullcontext() if last or ours_sync_all else ours.no_sync():
            loss = ours(x, y) / accum
            loss.backward()
        yield loss.item(), loss_ref.item()


def train_side_by_side(
    shard_kwargs: dict,
    *,
    steps: int = 5,
    accum: int = 2,
    batch: int = 4,
    make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    model_cls=AwkwardGPT,
) -> dict:
    """Train flatshard and torch DDP copies of one model on the same data; report diffs."""
    torch.manual_seed(0)
    model = model_cls()
    reference = DDP(copy.deepcopy(model), find_unused_parameters=True)
    ours = flatshard.shard(model, find_unused_parameters=True, **shard_kwargs)
    opt_ref = make_optimizer(reference.parameters())
    opt = make_optimizer(ours.parameters())
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    losses, loss_diffs, param_diffs, loss_bounds = [], [], [], []
    for step in range(steps):
        drift = max_abs_diff(ours, reference.module)
        loss_bounds += first_order_loss_bounds(reference.module, corpus, step, accum, batch, drift)
        for loss, loss_ref in accumulate(reference, ours, corpus, step, accum, batch):
            loss_diffs.append(abs(loss - loss_ref) / abs(loss_ref))
            losses.append(loss)
        for (name, p), p_ref in zip(ours.named_parameters(), reference.module.parameters(), strict=True):
            if (p.grad is None) != (p_ref.grad is None):
                raise AssertionError(f"step {step}: {name}.grad is None for only one of them")
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        param_diffs.append(
            max(
                max_rel_diff(p, q)
                for p, q in zip(ours.parameters(), reference.module.parameters(), strict=True)
            )
        )
    return {
        "losses": losses,
        "loss_diffs": loss_diffs,
        "param_diffs": param_diffs,
        "loss_bounds": loss_bounds,
    }


class TiedGPT(GPT):
    """GPT with tied embeddings and a frozen param; every trainable param gets a grad."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.blocks[0].ln1.weight.requires_grad_(False)


class SharedBlockGPT(TiedGPT):
    """Runs its first block again after the others (a unit called twice per forward)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in [*self.blocks, self.blocks[0]]:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class SkippingGPT(TiedGPT):
    """Skips its last block on every second forward (the same on every rank)."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.calls = 0

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        blocks = self.blocks if self.calls % 2 else self.blocks[:-1]
        for block in blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class RankSkippingGPT(SkippingGPT):
    """Ranks take different control flow: with four blocks, on every 4k+2-th forward rank r
    runs only the first 4 - r (an early exit), on every 4k-th it skips block r."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        rank, blocks = dist.get_rank(), list(self.blocks)
        if self.calls % 4 == 2:
            blocks = blocks[: len(blocks) - rank]
        elif self.calls % 4 == 0:
            blocks = [b for i, b in enumerate(blocks) if i != rank]
        for block in blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class RankUnusedGPT(TiedGPT):
    """Every rank runs every block, but on every second forward rank r's block r skips its
    MLP: params of a unit that ran get no grad on one rank (as experts a rank's tokens do
    not reach), which stage 3 handles with ``find_unused_parameters=True``."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=4, n_heads=2))
        self.calls = 0
        for i, block in enumerate(self.blocks):
            block.forward = partial(_block_maybe_without_mlp, block, self, i)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        return super().forward(idx, targets)


def _block_maybe_without_mlp(block: nn.Module, model: RankUnusedGPT, i: int, x: torch.Tensor) -> torch.Tensor:
    x = x + block.attn(block.ln1(x))
    if model.calls % 2 == 0 and i == dist.get_rank():
        return x
    return x + block.out(torch.nn.functional.gelu(block.fc(block.ln2(x))))


class CheckpointedGPT(TiedGPT):
    """Recomputes each block's activations in backward (non-reentrant checkpointing)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def is_matrix(name: str, param: nn.Parameter) -> bool:
    """Muon's params in the usual recipe: the blocks' 2-D weights (not embeddings, head)."""
    return param.ndim == 2 and name.startswith("blocks.")


class NormalizedSGD(torch.optim.Optimizer):
    """Steps each param along its (momentum-averaged) grad over that grad's norm: a
    whole-tensor rule in fp32, with per-param state when ``momentum`` is set."""

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = p.grad
                if group["momentum"]:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    direction = buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(direction / direction.norm().clamp_min(1e-12), alpha=-group["lr"])


def decay_groups(model: nn.Module, lr_no_decay: float = 3e-3) -> list[dict]:
    """Two param groups as users write them: no weight decay (and another lr) for 1-D params."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": lr_no_decay}]


def train_optimizer_side_by_side(
    shard_kwargs: dict,
    *,
    optimizer_class=torch.optim.AdamW,
    opt_kwargs: dict | None = None,
    ours_opt_kwargs: dict | None = None,
    ours_optimizer_class=None,
    groups=None,
    steps: int = 4,
    accum: int = 2,
    batch: int = 4,
    clip: float | None = None,
    schedule: bool = False,
    sync_every_micro_batch: bool = False,
    overlap_param_gather: bool = True,
    model_cls=TiedGPT,
    mesh_shape: tuple[int, int] | None = None,
    reference_kwargs: dict | None = None,
    compiled: str | None = None,
    backend: str = "inductor",
) -> dict:
    """Train a flatshard DistributedOptimizer and torch DDP + the same torch optimizer on
    the same data; report loss, grad-norm and param differences at every step. ``compiled``
    runs ours under ``torch.compile`` with ``backend`` (and the reference, the same way):
    "block" compiles each block before wrapping, "model" the wrapped model."""
    opt_kwargs = {"lr": 1e-2, "weight_decay": 0.1} if opt_kwargs is None else opt_kwargs
    torch.manual_seed(0)
    model = model_cls()
    reference = DDP(copy.deepcopy(model), **(reference_kwargs or {}))
    if compiled == "block":  # (the reference too: inductor's kernels round differently from eager's)
        for block in [*model.blocks, *reference.module.blocks]:
            block.compile(backend=backend)
    if mesh_shape is not None:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
        shard_kwargs = {**shard_kwargs, "group": mesh}
    ours = flatshard.shard(model, **shard_kwargs)
    run = torch.compile(ours, backend=backend) if compiled == "model" else ours
    if compiled == "model":
        reference = torch.compile(reference, backend=backend)
    ref_params = reference.module.parameters() if groups is None else groups(reference.module)
    opt_ref = optimizer_class(ref_params, **opt_kwargs)
    opt = flatshard.DistributedOptimizer(
        ours,
        ours_optimizer_class or optimizer_class,
        params=None if groups is None else groups(ours),
        overlap_param_gather=overlap_param_gather,
        **(opt_kwargs if ours_opt_kwargs is None else ours_opt_kwargs),
    )
    scheds = []
    if schedule:
        scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.3) for o in (opt_ref, opt)]
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    out = {"loss_diffs": [], "param_diffs": [], "norm_diffs": [], "losses": []}
    for step in range(steps):
        for loss, loss_ref in accumulate(reference, run, corpus, step, accum, batch, sync_every_micro_batch):
            out["loss_diffs"].append(abs(loss - loss_ref) / abs(loss_ref))
            out["losses"].append(loss)
        if clip is not None:
            norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            norm = opt.clip_grad_norm_(clip)
            out["norm_diffs"].append(abs(norm.item() - norm_ref.item()) / norm_ref.item())
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        for sched in scheds:
            sched.step()
        out["param_diffs"].append(
            max(
                max_rel_diff(p, q)
                for p, q in zip(full_params(ours), reference.module.parameters(), strict=True)
            )
        )
    return out


def full_params(model: nn.Module) -> list[torch.Tensor]:
    """Copies of every param's full value, at any stage (stage 3 gathers them)."""
    with model.summon_full_params(writeback=False):
        return [p.detach().clone() for p in model.parameters()]


def train_against_fsdp2(
    shard_kwargs: dict,
    *,
    fsdp_kwargs: dict | None = None,
    steps: int = 4,
    batch: int = 4,
    clip: float | None = 1.0,
    model_cls=TiedGPT,
    after_step=None,
    optimizer_class=torch.optim.AdamW,
    hyper: dict | None = None,
) -> dict:
    """Train flatshard (with DistributedOptimizer + ``optimizer_class``, AdamW by default)
    and torch FSDP2 (``fully_shard`` on every block, then the root) side by side; report
    loss and param diffs. ``after_step(reference)`` runs after each of FSDP2's steps."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = model_cls()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in reference.blocks:
        fully_shard(block, mesh=mesh, **(fsdp_kwargs or {}))
    fully_shard(reference, mesh=mesh, **(fsdp_kwargs or {}))
    ours = flatshard.shard(model, **shard_kwargs)
    hyper = {"lr": 1e-2, "weight_decay": 0.1} if hyper is None else hyper
    opt_ref = optimizer_class(reference.parameters(), **hyper)
    opt = flatshard.DistributedOptimizer(ours, optimizer_class, **hyper)
    corpus = SyntheticCorpus(CFG.vocab_size, CFG.seq_len)
    out = {"loss_diffs": [], "param_diffs": [], "norm_diffs": [], "losses": []}
    for step in range(steps):
        x, y = corpus.batch(step, dist.get_rank(), batch)
        loss_ref = reference(x, y)
        loss_ref.backward()
        loss = ours(x, y)
        loss.backward()
        out["loss_diffs"].append(abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()))
        out["losses"].append(loss.item())
        if clip is not None:
            norm_ref = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).full_tensor()
            norm = opt.clip_grad_norm_(clip)
            out["norm_diffs"].append(abs(norm.item() - norm_ref.item()) / norm_ref.item())
        for o in (opt_ref, opt):
            o.step()
            o.zero_grad()
        if after_step is not None:
            after_step(reference)
        ref_full = [p.full_tensor() for p in reference.parameters()]
        out["param_diffs"].append(
            max(max_rel_diff(p, q) for p, q in zip(full_params(ours), ref_full, strict=True))
        )
    return out


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``B @ A`` (LoRA)."""

    def __init__(self, base: nn.Linear, rank: int = 4, scale: float = 2.0) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.01)  # (not zero: A gets grads)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class LoRAGPT(TiedGPT):
    """A LoRA fine-tune: every param of the GPT frozen (embeddings, norms, every linear), a
    trainable low-rank adapter on each linear of each block."""

    def __init__(self, cfg: GPTConfig = CFG) -> None:
        super().__init__(cfg)
        self.requires_grad_(False)
        for block in self.blocks:
            for owner in (block.attn, block):
                for name in ("qkv", "proj", "fc", "out"):
                    if isinstance(getattr(owner, name, None), nn.Linear):
                        setattr(owner, name, LoRALinear(getattr(owner, name)))


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(6, 6)
        self.expert = nn.Linear(6, 6)

    def forward(self, x):
        return (self.expert(torch.relu(self.router(x))) ** 2).mean()
