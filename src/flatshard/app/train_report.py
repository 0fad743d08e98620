"""What ``flatshard train`` shows and writes: the progress bar on rank 0, per-step metrics
as JSON lines, the summary, the loss-curve PNG."""

from __future__ import annotations

import json
import sys
import time
from typing import IO

from flatshard.memory import mib


def format_summary(s: dict) -> str:
    mem = s["memory"]
    offload = s.get("offload_fraction", 0.0)
    floor = s.get("entropy_floor")
    floor = "" if floor is None else f", corpus entropy floor {floor:.3f}"
    return "\n".join(
        [
            f"flatshard train: {s['model']} ({s['params']:,} params), stage {s['stage']}, "
            f"{s['world_size']} rank(s), {s['dtype']}"
            + (f", {offload:.0%} of the optimizer on the host" if offload else "")
            + (", stepped on the device" if offload and s.get("offload_step") == "device" else "")
            + (", float8 linears gathered in fp8" if s.get("fp8_gathers") else ""),
            f"  steps            {s['first_step']} -> {s['steps']}",
            f"  tokens/s         {s['tokens_per_s']:,.0f}",
            f"  loss             {s['first_loss']:.3f} -> {s['final_loss']:.3f}  "
            f"(uniform guess {s['uniform_loss']:.3f}{floor})",
            f"  model state/rank {mib(mem['total'])}  (params {mib(mem['params'])}, grads "
            f"{mib(mem['grads'])}, main params {mib(mem['main_params'])}, optimizer "
            f"{mib(mem['optimizer_state'])})"
            + (
                f"; on the host {mib(mem['host'])}, on the device {mib(mem['device'])}"
                if mem.get("host")
                else ""
            ),
        ]
    )


class Metrics:
    """Per-step records, appended as JSON lines to ``path`` (rank 0; None: kept in memory only)."""

    def __init__(self, path: str | None, *, resume: bool) -> None:
        self.records: list[dict] = []
        self._file: IO[str] | None = None
        if path is not None:
            self._file = open(path, "a" if resume else "w")  # noqa: SIM115 - closed in close()

    def add(self, record: dict) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def plot_losses(path: str, records: list[dict], title: str, reference: dict[str, float | None]) -> None:
    """The loss curve (every record's ``loss`` by ``step``), with horizontal reference lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(
        [r["step"] for r in records], [r["loss"] for r in records], lw=1.2, label="loss (mean over ranks)"
    )
    for (label, value), style in zip(reference.items(), ("--", ":"), strict=False):
        if value is not None:
            ax.axhline(value, ls=style, color="gray", lw=1, label=f"{label} {value:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


class Progress:
    """A progress bar on rank 0: rich when installed, a plain line otherwise."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total = total
        self.enabled = enabled
        self._rich = None
        self._last = 0.0
        if not enabled:
            return
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )
        except ImportError:
            return
        self._rich = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._task = self._rich.add_task("train", total=total, loss="-")
        self._rich.start()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, completed=step, loss=f"{loss:.3f}")
            return
        now = time.monotonic()
        if now - self._last > 0.5 or step == self.total:
            self._last = now
            filled = int(30 * step / self.total)
            sys.stderr.write(
                f"\rtrain [{'#' * filled}{'.' * (30 - filled)}] {step}/{self.total} loss {loss:.3f}"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.enabled:
            sys.stderr.write("\n")
