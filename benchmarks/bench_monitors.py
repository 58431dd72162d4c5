"""Overhead of MFUMonitor + StragglerDetector on training step time, measured side by side.

One process trains the example GPT on CPU with and without the two monitors, alternating the order
of the two configurations each repetition (interleaved, so drifting machine load hits both), and
reports medians. The monitors log and gather every ``--log-every`` batches (default 10, five times
more often than their defaults) so the logging cost is inside the measurement. Three measures:

- wall: median wall time per step with the monitors over without. On a shared machine this moves
  by tens of percent between repetitions; read it with the per-repetition spread.
- cpu: the same with this process's CPU time (``time.process_time``) per step, which other
  processes' load hardly moves; with one torch thread it is the step's own work.
- hooks: the mean time spent inside the monitors' own hooks per step (logging steps included)
  over the median baseline step: the cost the monitors add, without the machine's noise.

The first step (where "auto" counts FLOPs) and the start-up CPU peak probe are one-time costs,
reported separately and excluded from the medians.

    python benchmarks/bench_monitors.py --steps 40 --reps 8 --out bench_monitors.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_shard import MFUMonitor, StragglerDetector
from lightning_shard.demos import GPTModule, TextDataModule

_HOOKS = ("on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end")
_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class StepTimer(Callback):
    """Wall and CPU time from one batch end to the next, and the monitors' hook time in each step."""

    def __init__(self) -> None:
        self.step_s: dict[str, list[float]] = {name: [] for name in _CLOCKS}
        self.hook_s: list[float] = []
        self.first_step_s = 0.0
        self._hook_acc = 0.0
        self._last: dict[str, float] | None = None
        self._first_start: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self._first_start is None:
            self._first_start = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = {name: clock() for name, clock in _CLOCKS.items()}
        if self._last is None:
            self.first_step_s = now["wall"] - (self._first_start or now["wall"])
        else:
            for name in _CLOCKS:
                self.step_s[name].append(now[name] - self._last[name])
            self.hook_s.append(self._hook_acc)
        self._hook_acc = 0.0
        self._last = {name: clock() for name, clock in _CLOCKS.items()}


def time_hooks(callback: Callback, timer: StepTimer) -> Callback:
    """Make ``callback``'s per-step hooks add their own wall time to ``timer``."""
    for name in _HOOKS:
        hook = getattr(callback, name)

        def timed(*args: Any, _hook: Any = hook, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                timer._hook_acc += time.perf_counter() - start

        setattr(callback, name, timed)
    return callback


def run(with_monitors: bool, args: argparse.Namespace) -> StepTimer:
    L.seed_everything(0, verbose=False)
    timer = StepTimer()
    callbacks: list[Callback] = []
    if with_monitors:
        monitor = MFUMonitor(log_every_n_steps=args.log_every, window=args.log_every)
        detector = StragglerDetector(every_n_steps=args.log_every)
        callbacks = [time_hooks(monitor, timer), time_hooks(detector, timer)]
    module = GPTModule(seq_len=args.seq_len, d_model=args.d_model, n_layers=args.n_layers, n_heads=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        callbacks=[timer, *callbacks],  # the timer first: step 1 is timed from before the FLOP count
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, TextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, n_sentences=8000))
    return timer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="training steps per fit")
    parser.add_argument("--reps", type=int, default=8, help="fits per configuration, interleaved")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of each fit")
    parser.add_argument("--log-every", type=int, default=10, help="monitors log / gather every N batches")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1 keeps a shared machine quieter)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    return parser.parse_args()


def pct(new: float, old: float) -> float:
    return 100 * (new / old - 1)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    configs = ("baseline", "monitors")
    steps = {c: {name: [] for name in _CLOCKS} for c in configs}
    first: dict[str, list[float]] = {c: [] for c in configs}
    hooks: list[float] = []
    per_rep = []
    for rep in range(args.reps):
        medians: dict[str, dict[str, float]] = {}
        for config in configs if rep % 2 == 0 else configs[::-1]:
            timer = run(config == "monitors", args)
            first[config].append(timer.first_step_s)
            medians[config] = {}
            for name in _CLOCKS:
                kept = timer.step_s[name][args.warmup :]
                steps[config][name] += kept
                medians[config][name] = statistics.median(kept)
            if config == "monitors":
                hooks += timer.hook_s[args.warmup :]
        per_rep.append(
            {
                f"{name}_overhead_pct": pct(medians["monitors"][name], medians["baseline"][name])
                for name in _CLOCKS
            }
        )

    median_ms = {c: {name: 1e3 * statistics.median(steps[c][name]) for name in _CLOCKS} for c in configs}
    hook_mean = statistics.fmean(hooks)
    result = {
        "benchmark": "bench_monitors",
        "device": "cpu",
        "torch": torch.__version__,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "median_step_ms": median_ms,
        "overhead_pct": {
            f"{name}_{how}": value
            for name in _CLOCKS
            for how, value in (
                ("pooled_medians", pct(median_ms["monitors"][name], median_ms["baseline"][name])),
                ("median_of_reps", statistics.median(r[f"{name}_overhead_pct"] for r in per_rep)),
            )
        },
        "hook_us_per_step": {"mean": 1e6 * hook_mean, "median": 1e6 * statistics.median(hooks)},
        "hook_overhead_pct": 100 * hook_mean / (median_ms["baseline"]["wall"] / 1e3),
        "per_rep": per_rep,
        "one_time": {
            "first_step_ms_median": {c: 1e3 * statistics.median(v) for c, v in first.items()},
            "note": "'auto' counts FLOPs inside step 1; the CPU peak probe runs once at fit start (~0.25 s)",
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
