"""Random layouts for property-based tests of the planner (``planning/test_layout.py``,
``planning/test_shard_map.py``): specs of every kind, at any world size and bucket size."""

import torch
from hypothesis import strategies as st

from flatshard import ParamSpec, plan_layout

DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]


@st.composite
def layouts(draw, aligned: bool = False):
    """Random specs and their layout; ``aligned``: with ``align`` drawn too ([Note: aligned
    shards]), and returned third."""
    n = draw(st.integers(1, 24))
    specs = []
    for i in range(n):
        dtype, grad_dtype = draw(st.sampled_from(DTYPES))
        specs.append(
            ParamSpec(
                f"p{i}",
                draw(st.integers(1, 3000)),
                dtype,
                grad_dtype,
                own_bucket=draw(st.booleans()) and draw(st.booleans()),
                unit=draw(st.sampled_from([None, None, "u0", "u1"])),
                whole=draw(st.booleans()) and draw(st.booleans()),
            )
        )
    world = draw(st.integers(1, 8))
    bucket_size = draw(st.sampled_from([None, 1, 100, 1000, 5000]))
    shard = draw(st.booleans())
    high = draw(st.booleans()) and draw(st.booleans())
    align = draw(st.sampled_from([64, 128, 192, 256])) if aligned else None
    layout = plan_layout(
        specs, world_size=world, bucket_size=bucket_size, shard=shard, pad_for_high_busbw=high, align=align
    )
    return (specs, layout, align) if aligned else (specs, layout)
