"""ThroughputMonitorFlops: Lightning's own ``ThroughputMonitor`` gets FLOPs and a peak, so it logs MFU.

Lightning's ``ThroughputMonitor`` logs ``train/device/mfu`` only when two numbers exist:

- ``pl_module.flops_per_batch``: the model FLOPs (forward + backward) of one batch on one device, read
  on every batch end. Lightning leaves computing it to the user (``measure_flops`` on a meta model in
  ``setup``) and, if the attribute is missing at the first batch, warns and never looks again.
- ``available_flops``: the device's peak FLOP/s, looked up in Lightning's CUDA/TPU tables in the
  monitor's ``setup``. A CPU, and any GPU missing from that table, has none.

This callback fills in what is missing and nothing else: a module that defines ``flops_per_batch``
itself keeps it, and a peak Lightning knows is kept. The FLOPs are counted on the first training
step while it runs (the same counter as ``MFUMonitor``: no extra forward, no side effect), then
scaled to each batch by its token count; during validation inside ``fit`` the attribute holds the
forward FLOPs only, since no backward runs. The peak comes from this package's table (``_peaks``),
or on a CPU from a short matmul probe, in the run's compute dtype.

MFU as Lightning computes it: ``flops_per_batch x world_size`` summed over its window, divided by the
window's time and by ``world_size``, over ``available_flops``; i.e. per-device achieved FLOP/s over
one device's peak, the same quantity as ``perf/mfu`` of ``MFUMonitor`` when all ranks are alike.

Two ways to turn it on: ``Trainer(callbacks=[ThroughputMonitor(...), ThroughputMonitorFlops()])`` under
any strategy, or by the strategy itself: :func:`feed_throughput_monitor`, called from a strategy's
``setup(trainer)``, attaches one when a ``ThroughputMonitor`` is present, so users write nothing.
Outside ``fit`` (``validate`` / ``test`` / ``predict`` alone) it does nothing.
"""

from __future__ import annotations

import weakref
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ThroughputMonitor
from typing_extensions import override

from lightning_shard.callbacks._flops import FirstStepFlops
from lightning_shard.callbacks._peaks import compute_dtype
from lightning_shard.callbacks.mfu import MFUMonitor, _device_peak

# Modules whose ``flops_per_batch`` this callback created: it may overwrite those, never a user's own.
_OWNED: weakref.WeakSet[L.LightningModule] = weakref.WeakSet()


class ThroughputMonitorFlops(Callback):
    """Give Lightning's ``ThroughputMonitor`` the model FLOPs per batch and the device peak it lacks.

    Args:
        peak_flops: dense peak FLOP/s of one device, used where Lightning knows none; None looks it up
            (this package's table, or a matmul probe on CPU).

    Does nothing when the Trainer has no ``ThroughputMonitor``.
    """

    def __init__(self, peak_flops: float | None = None) -> None:
        if peak_flops is not None and not (
            isinstance(peak_flops, (int, float)) and not isinstance(peak_flops, bool) and peak_flops > 0
        ):
            raise ValueError(
                f"ThroughputMonitorFlops(peak_flops={peak_flops!r}) must be a positive number of FLOP/s of one"
                " device, e.g. 989e12 for an H100 SXM in bf16, or None to look it up."
            )
        self.peak_flops = peak_flops
        self._first = FirstStepFlops()
        self._active = False

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        monitors = [c for c in _callbacks(trainer) if isinstance(c, ThroughputMonitor)]
        self._active = bool(monitors) and _own_flops_attribute(pl_module)
        self._first.reset()
        if monitors and any(m.available_flops is None for m in monitors):
            self._fill_peak(trainer, pl_module, monitors)

    def _fill_peak(self, trainer: L.Trainer, pl_module: L.LightningModule, monitors: list) -> None:
        peak = self.peak_flops
        if peak is None:
            device = trainer.strategy.root_device
            precision = getattr(trainer.strategy.precision_plugin, "precision", "32-true")
            peak, _ = _device_peak(device, compute_dtype(precision, pl_module, device), "train/device/mfu is")
        if peak is None:
            return
        for monitor in monitors:
            if monitor.available_flops is None:
                monitor.available_flops = int(peak)
                # The monitor built its Throughput trackers in setup, each holding its own copy of the peak.
                for tracker in getattr(monitor, "_throughputs", {}).values():
                    tracker.available_flops = int(peak)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._active:
            return
        shared = _counting_monitor(trainer)
        if shared is None:
            self._first.start(batch)  # only the first batch of the fit is counted
        self._publish(pl_module, batch, shared, "model_flops")

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        if not self._active:
            return
        self._first.stop()
        shared = _counting_monitor(trainer)
        counted = (shared._first if shared is not None else self._first).counted
        # The first step, just counted: published before its batch end, where Lightning reads it.
        if counted is not None and getattr(pl_module, "flops_per_batch", None) is None:
            setattr(pl_module, "flops_per_batch", int(counted["model_flops"]))  # noqa: B010

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._first.stop()  # a first batch that did not step (accumulation): known from the next batch on

    @override
    def on_validation_batch_start(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._active:
            self._publish(pl_module, batch, _counting_monitor(trainer), "forward_flops")

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._first.abort()

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._first.abort()
        if self._active:
            # Lightning's monitor remembers that the attribute exists: it stays, holding no stale number.
            setattr(pl_module, "flops_per_batch", None)  # noqa: B010
        self._active = False

    def _publish(self, pl_module: L.LightningModule, batch: Any, shared: MFUMonitor | None, key: str) -> None:
        first = shared._first if shared is not None else self._first
        flops = first.scaled(batch, key)
        if flops is not None:
            setattr(pl_module, "flops_per_batch", int(flops))  # noqa: B010


def feed_throughput_monitor(trainer: L.Trainer) -> ThroughputMonitorFlops | None:
    """Attach a :class:`ThroughputMonitorFlops` to ``trainer`` when it has a ``ThroughputMonitor``.

    For a strategy to call in its ``setup(trainer)`` (after the callbacks' ``setup``, before
    ``on_fit_start``), so MFU appears with no user code. Returns the callback that feeds the monitor
    (one already there, or the one attached now), or None when there is no ``ThroughputMonitor``.
    Calling it again is harmless.
    """
    if not any(isinstance(c, ThroughputMonitor) for c in _callbacks(trainer)):
        return None
    for callback in _callbacks(trainer):
        if isinstance(callback, ThroughputMonitorFlops):
            return callback
    feed = ThroughputMonitorFlops()
    # It stays for the Trainer's later calls (a second fit finds it here); it has no state to checkpoint.
    _callbacks(trainer).append(feed)
    return feed


def _own_flops_attribute(pl_module: L.LightningModule) -> bool:
    """Claim ``pl_module.flops_per_batch`` unless the user defined it; True when this callback may set it."""
    if pl_module in _OWNED:
        return True
    if hasattr(pl_module, "flops_per_batch"):
        return False
    setattr(pl_module, "flops_per_batch", None)  # noqa: B010  # exists before the first batch end, where Lightning looks once
    _OWNED.add(pl_module)
    return True


def _counting_monitor(trainer: L.Trainer) -> MFUMonitor | None:
    """An ``MFUMonitor`` that counts the same first step already: its count is shared, not repeated."""
    for callback in _callbacks(trainer):
        if isinstance(callback, MFUMonitor) and callback.flops_per_batch == "auto":
            return callback
    return None


def _callbacks(trainer: L.Trainer) -> list[Callback]:
    return trainer.callbacks  # type: ignore[attr-defined]  # set by Lightning's callback connector, not declared
