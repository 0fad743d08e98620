"""A checkpoint of a model whose ranks hold different params (each rank a chunk of a
pipeline-parallel model): its manifest and param groups describe the whole model, and a load
reads every saved param on some rank.

The reasoning is [Note: checkpoints of pipeline chunks] below."""

# [Note: checkpoints of pipeline chunks]
#
# Under pipeline parallelism each rank's model is a chunk ([Note: pipeline chunks] in
# ``wrap/pipeline.py``) and names only its own params. A checkpoint is still one model's:
#
# * **The manifest lists the whole model.** Every rank's params (name, shape, dtype), tied
#   names and param-group members are gathered and united before rank 0 writes the manifest
#   and the param groups; a group's hyperparameters are rank 0's (the optimizers' settings
#   check made them the same on every rank). When every rank holds the same params (data
#   parallelism alone), one all-gather of a digest finds that and nothing more is sent.
# * **A load reads each saved param somewhere.** A rank's model may lack params of the
#   checkpoint (another chunk holds them) but not have params it lacks; the ranks then check
#   together that the params they hold cover every saved one, so a model smaller than its
#   checkpoint is an error naming a param no rank loads, not a silent partial load. A param
#   group's saved members may include other chunks' params; each of the rank's own must be in
#   the group it was saved in.
# * **Every chunk of a rank.** A rank running several chunks (an interleaved schedule) passes
#   them as a list, with their optimizers; their pieces go into one save, their param groups
#   united. A chunk given without the rank's others is refused by name before anything is
#   written or read.
#
# So a checkpoint moves between pipeline layouts and one process: it is the file the whole
# model would write.

from __future__ import annotations

import hashlib
import pickle
from typing import Any

from torch import nn

from flatshard.comm.world import World, all_gather_bytes
from flatshard.engine.dynamo import uncompiled

Part = tuple[nn.Module, Any]  # a model this rank saves or loads, and its optimizer (or None)


def chunk_parts(model: Any, optimizer: Any, what: str) -> list[Part]:
    """``model`` and ``optimizer`` as (model, optimizer) pairs: one, or a list of each (the
    pipeline chunks this rank runs, in the same order). A rank's pipeline chunk given without
    the others it runs is refused, naming their stages (one would be left out of the
    checkpoint)."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if isinstance(optimizer, (list, tuple)):
        optimizers = list(optimizer)
    else:
        optimizers = [None] * len(models) if optimizer is None else [optimizer]
    if not models or len(optimizers) != len(models):
        raise ValueError(f"{what} takes a model and its optimizer, or a list of each of the same length")
    models = [uncompiled(m) for m in models]
    given = {id(getattr(m, "flatshard_state", None)) for m in models}
    for m in models:
        pipeline = getattr(getattr(m, "flatshard_state", None), "pipeline", None)
        if pipeline is None:
            continue
        left = sorted(i for i, s in pipeline.chunks.items() if id(s) not in given)
        if left:
            raise ValueError(
                f"{what} was given {len(models)} of this rank's {len(pipeline.chunks)} pipeline chunks: "
                f"stages {left} are missing. Pass every chunk the rank runs as a list (and their "
                "optimizers in the same order)"
            )
    return list(zip(models, optimizers, strict=True))


def _distinct(world: World, blob: bytes) -> list[bytes]:
    """Each distinct ``blob`` of the ranks, in rank order of first appearance: one all-gather
    of digests when they are all alike, then the blobs of the first rank of each kind."""
    digest = hashlib.sha256(blob).digest()[:16]
    if world.group is None:
        return [blob]
    digests = all_gather_bytes(digest, world)
    if all(d == digests[0] for d in digests):
        return [blob]
    first = digests.index(digest) == world.rank
    blobs = all_gather_bytes(blob if first else b"", world)
    return [b for rank, b in enumerate(blobs) if digests.index(digests[rank]) == rank]


def whole_model(
    world: World, params: dict[str, Any], aliases: dict[str, str], groups: list[dict] | None
) -> tuple[dict[str, Any], dict[str, str], list[dict] | None]:
    """The params (name -> shape, dtype), tied names and param groups of the whole model:
    this rank's united with every other rank's (collective)."""
    kinds = [pickle.loads(b) for b in _distinct(world, pickle.dumps((params, aliases, groups)))]
    all_params: dict[str, Any] = {}
    all_aliases: dict[str, str] = {}
    for p, a, _ in kinds:
        all_params.update(p)
        all_aliases.update(a)
    return all_params, all_aliases, united_groups([g for _, _, g in kinds])


def united_groups(kinds: list[list[dict] | None]) -> list[dict] | None:
    """Each param group with the members of every one of ``kinds`` (the first's
    hyperparameters): ranks', or one rank's chunks' optimizers'."""
    first = kinds[0]
    if first is None:
        return None
    united = [{"hyper": g["hyper"], "params": list(g["params"])} for g in first]
    for other in kinds[1:]:
        if other is None or len(other) != len(united):
            raise ValueError(
                f"ranks' optimizers have {len(united)} and {None if other is None else len(other)} "
                "param groups: every rank's optimizer needs the same groups"
            )
        for group, theirs in zip(united, other, strict=True):
            known = set(group["params"])
            group["params"] += [n for n in theirs["params"] if n not in known]
    return united


def check_covered(world: World, saved: dict[str, Any], mine: set[str], where: str) -> None:
    """Every saved param is held by some rank's model (collective); else a ``KeyError``
    naming one that none holds."""
    held: set[str] = set()
    for blob in _distinct(world, pickle.dumps(sorted(mine))):
        held.update(pickle.loads(blob))
    lost = [name for name in saved if name not in held]
    if lost:
        raise KeyError(
            f"{where} has {lost[0]!r}, which the model does not, on any rank ({len(lost)} such): "
            "it would not be loaded"
        )
