"""Showing a layout: each rank's shard boundaries as a table, and the whole layout as a PNG.

The PNG has one bar per buffer. Buckets are the light segments; params are the darker
boxes inside them (two alternating shades); what a bucket holds beyond its params (the
64-element alignment gaps and the end padding) is hatched; dashed lines mark where each
rank's shard starts. matplotlib is imported only to draw.
"""

from __future__ import annotations

from flatshard.planner.layout import Layout, format_layout


def format_shards(layout: Layout) -> str:
    """``format_layout`` plus, per bucket, the range each rank holds (in buffer offsets)."""
    lines = [format_layout(layout), "", "shards (buffer offsets):"]
    for buffer in layout.buffers:
        for bucket in buffer.buckets:
            ranges = [bucket.shard_range(r) for r in range(layout.world_size if layout.sharded else 1)]
            cells = "  ".join(
                f"rank {r}: {lo:,}-{hi:,}" if layout.sharded else f"every rank: {lo:,}-{hi:,}"
                for r, (lo, hi) in enumerate(ranges)
            )
            lines.append(f"  buffer {buffer.index} bucket {bucket.index:>3}  {cells}")
    return "\n".join(lines)


def format_units(names: list[str], counts: list[int], nbytes: list[int], unit_bytes: int | None) -> str:
    """Stage 3's units: each one's modules (``names``: the first and last of merged ones,
    ``counts``: how many) and the bytes of its params ([Note: merged units])."""
    merged = "one per module" if unit_bytes is None else f"adjacent ones merged up to {unit_bytes:,} bytes"
    lines = [f"stage-3 units ({merged}): {len(names)} units of {sum(counts)} modules"]
    lines.append(f"  {'unit':>4}  {'bytes':>13}  modules")
    for i, (name, count, size) in enumerate(zip(names, counts, nbytes, strict=True)):
        label = "(root)" if name == "" else name + (f" ({count})" if count > 1 else "")
        lines.append(f"  {i:>4}  {size:>13,}  {label}")
    return "\n".join(lines)


def draw_layout(layout: Layout, path: str, title: str) -> None:
    """Write ``layout`` as a PNG to ``path`` (see the module docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Rectangle

    height = 1.2 + 0.9 * len(layout.buffers)
    fig, ax = plt.subplots(figsize=(12, height))
    for row, buffer in enumerate(layout.buffers):
        y = len(layout.buffers) - 1 - row
        for bucket in buffer.buckets:
            ax.add_patch(
                Rectangle(
                    (bucket.start, y),
                    bucket.numel,
                    0.8,
                    facecolor="#eeeeee",
                    hatch="///",
                    edgecolor="#999999",
                    linewidth=0.5,
                )
            )
            for i, slot in enumerate(bucket.params):
                color = "#4c72b0" if i % 2 == 0 else "#7fa3d6"
                ax.add_patch(Rectangle((slot.start, y + 0.1), slot.numel, 0.6, facecolor=color, linewidth=0))
            if layout.sharded:
                for r in range(1, layout.world_size):
                    x = bucket.shard_range(r).start
                    ax.plot([x, x], [y - 0.05, y + 0.85], color="#c44e52", linestyle="--", linewidth=0.8)
        ax.text(
            0,
            y + 0.9,
            f"buffer {buffer.index}: {buffer.dtype} params, {buffer.grad_dtype} grads",
            fontsize=8,
            va="bottom",
        )
    ax.set_xlim(0, max(b.numel for b in layout.buffers))
    ax.set_ylim(-0.2, len(layout.buffers) + 0.2)
    ax.set_yticks([])
    ax.set_xlabel("elements")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
