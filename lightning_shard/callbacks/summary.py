"""RunSummary: what a training run did, in a few lines on rank 0 when it ends.

Steps, the final loss, throughput and MFU (from an :class:`~lightning_shard.MFUMonitor` in the same Trainer),
peak memory per rank, and where the last checkpoint is with the commands that load or export it. Works with
any strategy.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_shard.callbacks.mfu import MFUMonitor, peak_memory_bytes


class RunSummary(Callback):
    """Print a summary of the run on rank 0 at the end of ``fit``.

    Args:
        loss_key: the logged metric that is the training loss.
    """

    def __init__(self, loss_key: str = "train_loss") -> None:
        self.loss_key = loss_key
        self.lines: list[str] = []  # the last summary, on rank 0 (tests and scripts read it)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank's peak, gathered (a collective: every rank runs this hook).
        peak = torch.tensor([float(peak_memory_bytes(trainer.strategy.root_device))])
        peaks = trainer.strategy.all_gather(peak.to(trainer.strategy.root_device)).flatten().tolist()
        if trainer.is_global_zero:
            self.lines = summary_lines(trainer, pl_module, self.loss_key, peaks)
            print("\n".join(self.lines), flush=True)


def summary_lines(
    trainer: L.Trainer, pl_module: L.LightningModule, loss_key: str, peaks: list[float]
) -> list[str]:
    loss = trainer.callback_metrics.get(loss_key)
    lines = [f"Run summary: {trainer.global_step} steps on {trainer.world_size} rank(s)"]
    lines.append(
        f"  final {loss_key}: {float(loss):.4f}" if loss is not None else f"  {loss_key}: not logged"
    )
    monitor = next((c for c in trainer.callbacks if isinstance(c, MFUMonitor)), None)  # type: ignore[attr-defined]
    metrics: dict[str, Any] = monitor.metrics if monitor is not None else {}
    if "perf/tokens_per_sec" in metrics:
        lines.append(f"  throughput: {metrics['perf/tokens_per_sec']:,.0f} tokens/s over the last window")
    if "perf/mfu" in metrics:
        lines.append(f"  MFU: {100 * metrics['perf/mfu']:.2f}% (peak: {monitor.peak_source})")  # type: ignore[union-attr]
    lines.append("  peak memory per rank: " + ", ".join(f"{p / 2**30:.2f} GiB" for p in peaks))
    checkpoint = trainer.checkpoint_callback
    path = ""
    if isinstance(checkpoint, ModelCheckpoint):
        path = checkpoint.last_model_path or checkpoint.best_model_path
    if path:
        # FSDP2 swaps in FSDP<Class>: the user's class is the first one it did not make.
        name = next(c for c in type(pl_module).__mro__ if not issubclass(c, FSDPModule)).__name__
        lines.append(f"  checkpoint: {path}")
        lines.append(f"    load:   {name}.load_from_checkpoint({path!r})")
        lines.append(f"    export: lightning-shard consolidate {path} model.pt --weights-only")
    return lines
