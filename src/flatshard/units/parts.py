"""One bucket of a stage-3 unit, and its gather: every rank's shard into the full bucket, in
the param dtype or as fp8 bytes ([Note: fp8 gathers] in ``engine/fp8_gathers.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from flatshard.comm.collectives import DONE, HOST_TO_DEVICE, CommStats, Handle, all_gather
from flatshard.comm.world import World
from flatshard.engine.buffer import FlatBuffer
from flatshard.engine.fp8_gathers import Fp8Scales
from flatshard.planner.layout import BucketLayout
from flatshard.units.full_buckets import FullBuckets


@dataclass(frozen=True)
class Part:
    """One bucket of a unit, with what gathering it needs."""

    buffer: FlatBuffer
    bucket: BucketLayout
    world: World
    params: Sequence[nn.Parameter]  # indexed by slot.index
    full_buckets: FullBuckets | None = None  # the buffer's (None: only grads are gathered)
    scales: Fp8Scales | None = None  # its buffer's weights are gathered in fp8 ([Note: fp8 gathers])

    def full_tensor(self) -> torch.Tensor:
        """The bucket's full tensor ([Note: full buckets])."""
        return self._buckets().tensor(self.bucket)

    def allocate(self) -> torch.Tensor:
        return self._buckets().allocate(self.bucket)

    def free(self) -> None:
        self._buckets().free(self.bucket)

    def point(self, *, full: bool) -> None:
        """The bucket's params at their views of the full bucket, or at their placeholders."""
        self._buckets().point(self.bucket, full=full)

    def _buckets(self) -> FullBuckets:
        if self.full_buckets is None:
            raise RuntimeError(f"bucket {self.bucket.index} is not sharded at stage 3: it has no full bucket")
        return self.full_buckets


def start_gather(
    part: Part, full: torch.Tensor, stats: CommStats, *, fp8: bool
) -> tuple[Handle, torch.Tensor | None]:
    """Start filling ``full`` (the part's allocated full bucket) from every rank's shard: in the
    param dtype, or (``fp8``) as fp8 bytes in the returned ``packed`` tensor (uint8), which
    ``part.scales.decode`` turns into ``full`` once the handle is waited for."""
    source = part.buffer.gather_source(part.bucket)
    packed = torch.empty(part.bucket.numel, dtype=torch.uint8, device=full.device) if fp8 else None
    mine = part.buffer.own_part(full if packed is None else packed, part.bucket)
    if packed is None:  # (from page-locked memory, queued: [Note: memory tiers] in planner/offload.py)
        mine.copy_(source, non_blocking=source.is_pinned())
    else:  # (cast where the shard lives: an offloaded one sends its bytes over the host link)
        assert part.scales is not None
        encoded = mine if source.device == mine.device else torch.empty_like(mine, device=source.device)
        part.scales.encode(part.buffer, part.bucket, source, encoded)
        if encoded is not mine:
            mine.copy_(encoded)
    if part.buffer.shard_on_host:  # (an offloaded shard: what crossed the link, [Note: memory tiers])
        stats.record(HOST_TO_DEVICE, mine.numel() * mine.element_size(), 0)
    if part.world.size == 1:
        return DONE, packed
    sent = full if packed is None else packed
    return all_gather(sent, mine, part.world, stats=stats, splits=part.bucket.splits), packed
