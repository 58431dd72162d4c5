"""MFUMonitor: throughput, model and hardware FLOPs utilisation, dataloader wait and peak memory.

The formula. A training step of B samples of T tokens does F model FLOPs; it takes ``dt``
seconds on each of D devices, each able to do P FLOP/s at the run's compute dtype::

    MFU = achieved model FLOP/s / available FLOP/s
        = (F / dt) / (D x P)
        = (B x T / dt) x (F / (B x T)) / (D x P)
        = tokens/s x FLOPs/token / (devices x peak)

For a dense decoder with N matmul parameters, L layers of width d and context T, the forward
pass does 2N FLOPs per token (one multiply-add per weight) plus 4·L·T·d for attention
(QK^T and AV, each 2·T·d per token and layer); the backward pass does twice the forward (the
gradient with respect to the input and to the weight), so FLOPs/token = 6N + 12·L·T·d (the PaLM
appendix B formula). This module does not assume that formula: it *counts* the FLOPs of a real
batch with ``torch.utils.flop_counter``, so grouped-query attention, sliding windows implemented
as smaller matmuls, MoE routing, tied heads and odd shapes come out as executed.

MFU uses model FLOPs (forward + backward); HFU (hardware FLOPs utilisation) also counts the
forward FLOPs that activation checkpointing recomputes during backward, so HFU >= MFU and the
gap is the recompute.

How "auto" counts, and why during the real first step. A monitor must be a pure observer: a run
with it trains bit for bit like one without. Counting on a separate forward+backward would have to
undo everything that pass changes: the random stream it draws from (dropout, on the CPU and on the
accelerator), buffers a training-mode forward updates (BatchNorm running statistics and
``num_batches_tracked``), gradients, module hooks, values the model logs from inside its forward,
and under FSDP2/DeepSpeed it would issue collectives every rank must join. Restoring all of that is
fragile and the pass costs a step. Instead the counter (a dispatch mode, which changes no value) is
entered in ``on_train_batch_start`` of the first batch and left in ``on_before_optimizer_step`` (or
``on_train_batch_end`` when that batch does not step), so it sees exactly the first step's own
forward and backward and nothing runs twice: there is nothing to restore, and it is the cheapest
way. The CPU peak probe (``_peaks.probe_cpu_peak``) draws its matrices from a generator of its own
for the same reason: drawing from the default one shifted every later dropout mask. Each counted
op is tagged by autograd phase: outside the autograd engine it is forward; inside the engine
with grad mode off it is backward; inside the engine with grad mode on it is forward work being
recomputed for a checkpointed region (``torch.utils.checkpoint`` re-enables grad for exactly
that). Model FLOPs = forward + backward; hardware FLOPs = all three. Later batches are scaled
by their token count (samples x sequence length of the first tensor) against the counted one,
which is exact for the matmuls and ignores the attention term's quadratic change with length.
(Double backward, ``create_graph=True``, would be tagged as recompute.)

Per-rank work. Every rank counts its own batch on its own device. Ops on tensor subclasses
(DTensor under tensor parallelism) are counted after the subclass turns them into local ops,
so a rank counts the shard it computes, not the global matmul. Every ``log_every_n_steps``
batches one small all_gather brings each rank's window (time, samples, tokens, FLOPs, peak)
together; rates are summed over ranks and MFU divides by the sum of the ranks' peaks.

Timing. A batch's time runs from the end of the previous batch to the end of this one, so it
includes fetching the batch; the fetch share (previous end to this start) is reported as the
dataloader wait. The chain restarts at each epoch and after validation, so neither is counted.
On CUDA the device is synchronised only at the first and last batch of each logged window.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_shard._batch import batch_shape
from lightning_shard.callbacks._common import (
    Runner,
    check_count,
    gather_rows,
    logged_step,
    precision_name,
    ranks_per_batch,
)
from lightning_shard.callbacks._flops import FirstStepFlops
from lightning_shard.callbacks._peaks import ComputeDtype, compute_dtype, probe_cpu_peak, table_peak


class _Record(NamedTuple):
    seconds: float
    wait: float
    samples: int
    tokens: Any  # int, tensor (from tokens_fn) or None
    model_flops: float
    hardware_flops: float


FlopsPerBatch = Literal["auto"] | int | Callable[[Any], int]


class MFUMonitor(Callback):
    """Log throughput, MFU, HFU, dataloader wait and peak memory every ``log_every_n_steps`` batches.

    Args:
        flops_per_batch: ``"auto"`` counts the first batch's forward+backward FLOPs (see the module
            docstring); an int is the model FLOPs of every batch on one rank; a callable maps a batch
            to its model FLOPs. HFU is only known with ``"auto"``.
        peak_flops: dense peak FLOP/s of one device, overriding the table and the CPU probe.
        tokens_fn: maps a batch to its token count (e.g. non-padding tokens); by default samples x
            sequence length of the batch's first integer tensor.
        window: number of recent batches the rates are averaged over.
        log_every_n_steps: log every this many training batches; None follows the Trainer's (50 when
            that is 0).
        prog_bar: under the Trainer, also show the latest ``mfu`` and ``tok/s`` in the progress bar.

    Keys (all under ``perf/``) are listed in docs/monitoring.md. The last logged values are also kept
    in ``self.metrics`` on every rank.

    In a Lightning Fabric loop, pass it to ``L.Fabric(callbacks=[...])`` and call
    ``fabric.call("on_train_batch_start", trainer=fabric, pl_module=model, batch=batch, batch_idx=i)``
    before each (micro-)batch's forward and ``fabric.call("on_train_batch_end", trainer=fabric,
    pl_module=model, outputs=loss, batch=batch, batch_idx=i)`` after its backward (and the optimizer step,
    when it steps); metrics go to ``fabric.loggers`` at the number of batches seen. Keyword arguments:
    Fabric passes each hook only those its signature names, so a LightningModule's own hooks of the same
    name run too.
    """

    def __init__(
        self,
        flops_per_batch: FlopsPerBatch = "auto",
        peak_flops: float | None = None,
        tokens_fn: Callable[[Any], int] | None = None,
        window: int = 20,
        log_every_n_steps: int | None = None,
        prog_bar: bool = True,
    ) -> None:
        _check_flops_per_batch(flops_per_batch)
        _check_positive(
            "peak_flops",
            peak_flops,
            "the device's dense peak in FLOP/s, e.g. peak_flops=989e12 for an H100 SXM in bf16, or None to look it up",
        )
        if tokens_fn is not None and not callable(tokens_fn):
            raise ValueError(f"MFUMonitor(tokens_fn={tokens_fn!r}) must be a callable(batch) -> int or None.")
        check_count("MFUMonitor", "window", window, example=20)
        if log_every_n_steps is not None:
            check_count("MFUMonitor", "log_every_n_steps", log_every_n_steps, example=50)
        self.flops_per_batch = flops_per_batch
        self.peak_flops = peak_flops
        self.tokens_fn = tokens_fn
        self.window = window
        self.log_every_n_steps = log_every_n_steps
        self.prog_bar = prog_bar
        self._clock: Callable[[], float] = time.perf_counter  # tests inject a fake clock
        self.metrics: dict[str, float] = {}
        self.device_peak: float | None = None  # this rank's peak FLOP/s
        self.peak_source: str | None = None
        self._first = FirstStepFlops()
        self._records: deque[_Record] = deque(maxlen=window)
        self._batches = 0
        self._last_end: float | None = None
        self._start = 0.0
        self._every = 1
        self._device = torch.device("cpu")
        self._started = False

    @property
    def counted(self) -> dict[str, float] | None:
        """What ``"auto"`` counted on the first batch (model, hardware and forward FLOPs, token units)."""
        return self._first.counted

    @override
    def on_fit_start(self, trainer: Runner, pl_module: torch.nn.Module) -> None:
        self._started = True
        device = trainer.strategy.root_device
        dtype = compute_dtype(precision_name(trainer), pl_module, device)
        if self.peak_flops is not None:
            self.device_peak, self.peak_source = self.peak_flops, "peak_flops"
        else:
            self.device_peak, self.peak_source = _device_peak(device, dtype)
        if self.device_peak is None:
            rank_zero_warn(
                f"MFUMonitor: no peak FLOP/s known for {self.peak_source}, so perf/mfu and perf/hfu are not"
                " logged (throughput and TFLOP/s still are). Pass MFUMonitor(peak_flops=...) with the"
                " device's dense peak in FLOP/s."
            )
        # Trainer(log_every_n_steps=0) turns Lightning's own logging off; the monitor then uses its default.
        self._every = self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 0) or 50
        self._device = device
        # A reused monitor starts over: the model or its batches may have changed since the last fit.
        self._first.reset()
        self._batches, self._last_end = 0, None
        self._records.clear()

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_end = None  # the epoch boundary (checkpointing, loader restart) is not a step

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
        if self.flops_per_batch == "auto":
            self._first.start(batch)  # only the first batch of the fit is counted

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self._stop_counting()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._first.abort()

    @override
    def on_train_batch_end(
        self, trainer: Runner, pl_module: torch.nn.Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._stop_counting()
        self._batches += 1
        n = self._batches
        if self._device.type == "cuda" and (n % self._every == 0 or (n + self.window) % self._every == 0):
            torch.cuda.synchronize(self._device)  # the window's edges must be device time, not queue time
        now = self._clock()
        if self._last_end is not None:
            self._records.append(self._record(now, batch))
        self._last_end = now
        if n % self._every == 0 and self._records:
            self._log(trainer)
        if self.prog_bar and self.metrics and isinstance(pl_module, L.LightningModule):
            # The window's latest figures beside the loss in the progress bar (not logged again: the
            # loggers got them from _log).
            shown = {"mfu": self.metrics.get("perf/mfu"), "tok/s": self.metrics.get("perf/tokens_per_sec")}
            for name, value in shown.items():
                if value is not None and math.isfinite(value):
                    pl_module.log(
                        name, float(value), prog_bar=True, logger=False, on_step=True, on_epoch=False
                    )

    def _stop_counting(self) -> None:
        if self._first.stop() and not self._first.counted["model_flops"]:  # type: ignore[index]
            rank_zero_warn(
                "MFUMonitor(flops_per_batch='auto') counted 0 FLOPs in the first step (no op it knows ran, e.g."
                " custom kernels), so FLOP rates are not logged. Pass flops_per_batch=<int or callable>."
            )

    def _batch_flops(self, batch: Any) -> tuple[float, float]:
        if isinstance(self.flops_per_batch, int):
            return float(self.flops_per_batch), math.nan
        if callable(self.flops_per_batch):
            return float(self.flops_per_batch(batch)), math.nan
        model, hardware = self._first.scaled(batch), self._first.scaled(batch, "hardware_flops")
        return (math.nan, math.nan) if model is None or hardware is None else (model, hardware)

    def _record(self, now: float, batch: Any) -> _Record:
        samples, shape_tokens = batch_shape(batch)
        tokens = self.tokens_fn(batch) if self.tokens_fn is not None else shape_tokens
        model, hardware = self._batch_flops(batch)
        return _Record(now - self._last_end, self._start - self._last_end, samples, tokens, model, hardware)  # type: ignore[operator]

    def _log(self, trainer: Runner) -> None:
        recs = list(self._records)
        tokens = [r.tokens for r in recs]
        local = [
            sum(r.seconds for r in recs),
            sum(r.wait for r in recs),
            float(sum(r.samples for r in recs)),
            math.nan if any(t is None for t in tokens) else float(sum(tokens)),
            sum(r.model_flops for r in recs),
            sum(r.hardware_flops for r in recs),
            self.device_peak or 0.0,
            peak_memory_bytes(self._device),
        ]
        # Ranks that share a batch (tensor-parallel groups, pipeline stages) each count a part of its FLOPs
        # but the whole of its samples and tokens: those are counted once per batch.
        share = ranks_per_batch(trainer)
        local[2] /= share
        local[3] /= share
        rows = gather_rows(trainer, local)
        self.metrics = _window_metrics(rows, len(recs))
        for logger in trainer.loggers:
            logger.log_metrics(self.metrics, step=logged_step(trainer, self._batches))


def _window_metrics(rows: torch.Tensor, n_batches: int) -> dict[str, float]:
    """Per-rank windows (one row each: seconds, wait, samples, tokens, model FLOPs, hw FLOPs, peak, memory) -> metrics."""
    seconds, wait, samples, tokens, model, hardware, peak, memory = rows.double().unbind(dim=1)
    devices = rows.shape[0]
    metrics = {
        "perf/step_time_s": (seconds / n_batches).mean(),
        "perf/samples_per_sec": (samples / seconds).sum(),
        "perf/tokens_per_sec": (tokens / seconds).sum(),
        "perf/tokens_per_sec_per_device": (tokens / seconds).sum() / devices,
        "perf/tflops_per_device": (model / seconds).sum() / devices / 1e12,
        "perf/dataloader_wait_frac": (wait / seconds).mean(),
        "perf/peak_memory_gb": memory.max() / 1e9,
    }
    if bool((peak > 0).all()):
        metrics["perf/mfu"] = (model / seconds).sum() / peak.sum()
        metrics["perf/hfu"] = (hardware / seconds).sum() / peak.sum()
        metrics["perf/peak_tflops_per_device"] = peak.mean() / 1e12
    # An unknown quantity (no tokens, no HFU without "auto", no FLOPs counted) is left out, never logged as NaN.
    return {k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}


def _device_peak(
    device: torch.device, dtype: ComputeDtype, metrics: str = "perf/mfu and perf/hfu are"
) -> tuple[float | None, str]:
    """(peak FLOP/s of one device or None, where it came from) for the run's compute dtype."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return table_peak(name, dtype), f"device {name!r} in {dtype} (peak table)"
    if device.type == "cpu":
        peak = probe_cpu_peak(dtype)
        rank_zero_info(
            f"A CPU has no datasheet peak; a {dtype} matmul probe measured an achievable"
            f" {peak / 1e12:.3f} TFLOP/s per process. {metrics} relative to it."
        )
        return peak, f"cpu in {dtype} (matmul probe)"
    return None, f"device type {device.type!r} in {dtype}"


def peak_memory_bytes(device: torch.device) -> float:
    """This process's peak memory on ``device``: allocated CUDA bytes, or the resident set on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    try:
        import resource  # optional: resource (absent on Windows)
    except ImportError:  # pragma: no cover - Windows
        return math.nan
    # ru_maxrss is the process's peak resident set: KiB on Linux, bytes on macOS.
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * (
        1 if sys.platform == "darwin" else 1024
    )


def _check_flops_per_batch(value: Any) -> None:
    if (
        value == "auto"
        or callable(value)
        or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    ):
        return
    raise ValueError(
        f"MFUMonitor(flops_per_batch={value!r}) must be 'auto', a positive int of model FLOPs per batch on one"
        " rank, or a callable(batch) -> int. Use 'auto' to count them from the first batch."
    )


def _check_positive(flag: str, value: Any, fix: str) -> None:
    ok = value is None or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )
    if not ok:
        raise ValueError(f"MFUMonitor({flag}={value!r}) must be a positive finite number. Pass {fix}.")
