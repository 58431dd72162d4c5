"""StragglerDetector: find the rank that holds the others back, by rank and host name.

In synchronous data-parallel training every rank finishes a step when the slowest one does, so
step times cannot tell ranks apart. What differs is the work a rank does *before* it blocks on a
collective. Each rank times, per training batch:

- data: from the end of its previous batch to the start of this one (fetching the batch);
- compute: from the start of the batch to the first ``on_before_backward``: the forward pass and
  loss, measured with CUDA events on GPU (device time, not launch time) and the host clock on CPU.
  A batch that never calls backward is timed to its end.

Under DDP, ZeRO-1/2 and DeepSpeed ZeRO-1/2 neither span contains a collective (gradients are
reduced during backward and the optimizer step), so a slow GPU, a contended host or a slow
dataloader shows up on the rank that has it. Under FSDP / ZeRO-3 the forward all-gathers make
fast ranks wait for the slow one inside their forward, so a rank slow in *compute* is spread
over all ranks and under-reported; a slow dataloader is still attributed correctly.

Every ``every_n_steps`` batches one small all_gather brings each rank's mean (data + compute)
time per batch together; ``straggler/rank{r}_ms`` is logged for every rank, and a rank slower
than ``threshold`` x the median is warned about with its host name. For an even number of ranks
the median is the lower middle value, so with 2 ranks the slower is compared with the faster.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_shard.callbacks._common import Runner, check_count, gather_rows, logged_step

_HOST_BYTES = 64


class StragglerDetector(Callback):
    """Log each rank's own time per batch every ``every_n_steps`` batches and warn about slow ranks.

    Args:
        threshold: a rank whose (data + compute) time per batch exceeds ``threshold`` x the median
            over ranks is flagged; must be > 1.
        every_n_steps: compare ranks every this many training batches (one all_gather each time).

    Flagged ranks are also appended to ``self.stragglers`` (dicts with step, rank, host, ms, ratio)
    on every rank, and the last per-rank times are in ``self.rank_ms``.

    In a Lightning Fabric loop, pass it to ``L.Fabric(callbacks=[...])`` and call, with keyword arguments,
    ``fabric.call("on_train_batch_start", trainer=fabric, pl_module=model, batch=batch, batch_idx=i)``
    before each batch's forward, ``fabric.call("on_before_backward", trainer=fabric, pl_module=model,
    loss=loss)`` before ``fabric.backward`` (without it the compute span runs to the batch's end,
    collectives included) and ``fabric.call("on_train_batch_end", trainer=fabric, pl_module=model,
    outputs=loss, batch=batch, batch_idx=i)`` at the batch's end.
    """

    def __init__(self, threshold: float = 1.2, every_n_steps: int = 50) -> None:
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, (int, float))
            or not threshold > 1
            or not math.isfinite(threshold)
        ):
            raise ValueError(
                f"StragglerDetector(threshold={threshold!r}) must be a finite number > 1: it is how many times"
                " the median time a rank may take before it is flagged. Use e.g. threshold=1.2."
            )
        check_count("StragglerDetector", "every_n_steps", every_n_steps, example=50)
        self.threshold = float(threshold)
        self.every_n_steps = every_n_steps
        self._clock: Callable[[], float] = time.perf_counter  # tests inject a fake clock
        self.stragglers: list[dict[str, Any]] = []
        self.rank_ms: list[float] = []
        self.metrics: dict[str, float] = {}
        self._hosts: list[str] = []
        self._reset_window()
        self._last_end: float | None = None
        self._batches = 0
        self._start = 0.0
        self._data: float | None = None
        self._compute: float | None = None
        self._events: Any = None
        self._cuda = False
        self._started = False

    def _reset_window(self) -> None:
        self._sum_data = 0.0
        self._sum_compute = 0.0
        self._n = 0
        self._n_data = 0  # the first batch of an epoch has no measured fetch
        self._cuda_spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @override
    def on_fit_start(self, trainer: Runner, pl_module: torch.nn.Module) -> None:
        self._started = True
        self._cuda = trainer.strategy.root_device.type == "cuda"
        name = socket.gethostname().encode("utf-8")[:_HOST_BYTES]
        rows = gather_rows(trainer, list(name.ljust(_HOST_BYTES, b"\0")))
        self._hosts = [bytes(int(b) for b in row).rstrip(b"\0").decode("utf-8", "replace") for row in rows]
        self._reset_window()
        self._last_end, self._batches = None, 0

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_end = None  # the epoch boundary is not a batch fetch

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_end = None

    @override
    def on_train_batch_start(
        self, trainer: Runner, pl_module: torch.nn.Module, batch: Any, batch_idx: int
    ) -> None:
        if not self._started:  # a Fabric loop has no fit start: its first batch is one
            self.on_fit_start(trainer, pl_module)
        self._start = self._clock()
        self._data = None if self._last_end is None else self._start - self._last_end
        self._compute = None
        if self._cuda:
            self._events = torch.cuda.Event(enable_timing=True)
            self._events.record()

    @override
    def on_before_backward(self, trainer: Runner, pl_module: torch.nn.Module, loss: torch.Tensor) -> None:
        if self._compute is None:  # only the first backward: later ones follow a collective
            self._stop_compute()

    def _stop_compute(self) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._cuda_spans.append((self._events, end))
            self._compute = 0.0  # device time is read when the window is gathered
        else:
            self._compute = self._clock() - self._start

    @override
    def on_train_batch_end(
        self, trainer: Runner, pl_module: torch.nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._compute is None:
            self._stop_compute()
        if self._data is not None:
            self._sum_data += self._data
            self._n_data += 1
        self._sum_compute += self._compute or 0.0
        self._n += 1
        self._batches += 1
        self._last_end = self._clock()
        if self._batches % self.every_n_steps == 0:
            self._compare(trainer)

    def _compare(self, trainer: Runner) -> None:
        compute_s = self._sum_compute
        if self._cuda_spans:
            self._cuda_spans[-1][1].synchronize()
            compute_s += sum(start.elapsed_time(end) for start, end in self._cuda_spans) / 1e3
        data_ms = 1e3 * self._sum_data / max(self._n_data, 1)
        compute_ms = 1e3 * compute_s / self._n
        self._reset_window()
        rows = gather_rows(trainer, [data_ms + compute_ms, data_ms, compute_ms])
        self.rank_ms = rows[:, 0].tolist()
        median = float(rows[:, 0].median())  # the lower middle value for an even world size
        self.metrics = {f"straggler/rank{r}_ms": ms for r, ms in enumerate(self.rank_ms)}
        self.metrics["straggler/median_ms"] = median
        self.metrics["straggler/max_ratio"] = max(self.rank_ms) / median if median > 0 else 1.0
        for logger in trainer.loggers:
            logger.log_metrics(self.metrics, step=logged_step(trainer, self._batches))
        if median <= 0:
            return
        for rank, (total, data, compute) in enumerate(rows.tolist()):
            if total > self.threshold * median:
                self._flag(trainer, rank, total, data, compute, median)

    def _flag(
        self, trainer: Runner, rank: int, total: float, data: float, compute: float, median: float
    ) -> None:
        host = self._hosts[rank] if rank < len(self._hosts) else "?"
        ratio = total / median
        step = logged_step(trainer, self._batches)
        self.stragglers.append({"step": step, "rank": rank, "host": host, "ms": total, "ratio": ratio})
        rank_zero_warn(
            f"StragglerDetector: rank {rank} on host {host!r} took {total:.1f} ms per batch before its first"
            f" collective (data {data:.1f} ms + compute {compute:.1f} ms), {ratio:.2f}x the median {median:.1f} ms"
            f" (threshold {self.threshold}) over the last {self.every_n_steps} batches up to step {step}."
        )
