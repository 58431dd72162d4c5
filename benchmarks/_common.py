"""Pieces the benchmarks share: the GPT they time, its data, a step timer, the JSON report.

Benchmarks run as scripts (``python benchmarks/bench_x.py``): Python then imports first from the
script's own directory, so ``from _common import ...`` works, and the demo GPT comes from the
installed ``lightning_shard.demos``.
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# DESIGN.md's reference shape: GPT-2 style, 6 x 256, seq 128, batch 4 per rank.
MODEL = dict(vocab_size=256, seq_len=128, d_model=256, n_layers=6, n_heads=4)


def token_loader(
    steps: int, batch_size: int = 4, world_size: int = 2, model: dict[str, Any] = MODEL
) -> DataLoader:
    """Random tokens of ``model``'s vocabulary and sequence length, enough for ``steps`` steps on each of
    ``world_size`` ranks (pinned where there is a GPU to copy them to)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, model["vocab_size"], (batch_size * world_size * steps, model["seq_len"] + 1), generator=g
    )
    return DataLoader(
        TensorDataset(tokens[:, :-1], tokens[:, 1:]),
        batch_size=batch_size,
        pin_memory=torch.cuda.is_available(),
    )


class StepTimer(L.Callback):
    """Wall time of each training batch, from batch start to batch end; on CUDA each batch ends with a
    device sync, so a step's time is the device's, not the launch queue's."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        trainer = args[0] if args else None  # a Fabric loop calls it with no arguments
        if trainer is not None and trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)


class SaveEvery(L.Callback):
    """``trainer.save_checkpoint`` every ``every`` steps (0: never) into ``directory``; the wall time each
    call blocked the loop."""

    def __init__(self, every: int, directory: str) -> None:
        self.every, self.directory = every, directory
        self.blocked: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.every and trainer.global_step % self.every == 0:
            t0 = time.perf_counter()
            trainer.save_checkpoint(f"{self.directory}/step{trainer.global_step}.ckpt")
            self.blocked.append(time.perf_counter() - t0)


class Profile(L.Callback):
    """torch.profiler over training batches ``start`` .. ``start + steps - 1`` (CPU, and CUDA on a GPU): a
    chrome trace (rank 0; gzipped where the name ends in ``.gz``), the ops with the most self CPU time, and
    the events and wall time of the window, for finding where a step goes instead of guessing."""

    def __init__(self, trace: str | None, start: int = 3, steps: int = 3, top: int = 15) -> None:
        self.trace, self.start, self.steps, self.top = trace, start, steps, top
        self.table: list[dict[str, Any]] = []
        self.events: Any = None
        self.wall_us = 0.0
        self._profiler: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx != self.start:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._profiler is None or args[-1] != self.start + self.steps - 1:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.wall_us = (time.perf_counter() - self._t0) * 1e6
        self._profiler.__exit__(None, None, None)
        self.events = self._profiler.events()
        ops = sorted(self._profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        self.table = [
            {
                "op": e.key,
                "calls_per_step": e.count / self.steps,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1000 / self.steps,
                "cpu_ms_per_step": e.cpu_time_total / 1000 / self.steps,
            }
            for e in ops[: self.top]
        ]
        if self.trace is not None and trainer.is_global_zero:
            _export_trace(self._profiler, Path(self.trace))
        self._profiler = None


def _export_trace(profiler: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix != ".gz":
        profiler.export_chrome_trace(str(path))
        return
    raw = path.with_suffix("")  # trace.json.gz -> trace.json
    profiler.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


class SavedBytes:
    """Bytes of activations autograd holds for backward, now and at the peak: each storage counted once while
    any saved tensor refers to it; parameters (saved by every matmul) are not activations."""

    def __init__(self, module: nn.Module) -> None:
        self.now = self.peak = 0
        self._params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._refs: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> Any:
        key = tensor.untyped_storage().data_ptr()
        if key not in self._params:
            if key not in self._refs:
                self.now += tensor.untyped_storage().nbytes()
                self.peak = max(self.peak, self.now)
            self._refs[key] = self._refs.get(key, 0) + 1
        return tensor, key

    def unpack(self, packed: Any) -> torch.Tensor:
        tensor, key = packed
        if key in self._refs:  # each saved tensor is unpacked once, in backward
            self._refs[key] -= 1
            if not self._refs[key]:
                del self._refs[key]
                self.now -= tensor.untyped_storage().nbytes()
        return tensor


def cpu_trainer(
    strategy: Any, steps: int, callbacks: list[L.Callback], devices: int = 2, **kwargs: Any
) -> L.Trainer:
    """A quiet CPU Trainer on ``devices`` ranks for ``steps`` steps: no logger, checkpoints, progress bar or
    summary (``kwargs``: other Trainer arguments, e.g. ``precision``, or ``accelerator="cuda"``)."""
    return L.Trainer(
        **{"accelerator": "cpu"} | kwargs,
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def interleaved(configs: dict[str, Any], rounds: int, run: Any) -> dict[str, list[Any]]:
    """``run(config)`` for every configuration, ``rounds`` times, in a rotated order each round, so machine
    noise hits them alike."""
    names = list(configs)
    results: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(run(configs[name]))
    return results


def write_report(report: dict[str, Any], out: str, printed: dict[str, Any] | None = None) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps(printed if printed is not None else report, indent=2))
