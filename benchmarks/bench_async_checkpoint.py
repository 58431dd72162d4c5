"""Async vs sync sharded checkpoints: time the training loop is blocked per save, and run throughput.

Model + AdamW state of ~100M parameters (24 bias-free 2048x2048 layers) at stage 3 on 2 CPU ranks.
Per round, interleaved: a run that never saves, a run saving synchronously every N steps, and a
run saving asynchronously every N steps. Also measured: the CPU time the thread writing a checkpoint
spends in DCP's ``write_data`` (serialising and writing the shards). On a machine whose cores the
ranks already keep busy, an async save cannot cost less than that CPU time: see docs/checkpoints.md. Blocked time is the wall time of ``trainer.save_checkpoint``
as the loop sees it; throughput is the run's total wall time over its steps. Medians over rounds.

    python benchmarks/bench_async_checkpoint.py --rounds 5 --steps 20 --every 10 --out benchmarks/results/async_checkpoint.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import lightning as L
import torch
from _common import SaveEvery, cpu_trainer, interleaved, write_report
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks

WIDTH, DEPTH = 2048, 24  # 24 x 2048^2 = 100.7M parameters
MODES = ("none", "sync", "async")


class Wide(L.LightningModule):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(depth))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def _run(mode: str, steps: int, every: int, depth: int) -> dict[str, float | list[float]]:
    # The same directory on both ranks (the port is unique to this run); the first save creates it.
    directory = f"{tempfile.gettempdir()}/bench_ckpt_{os.environ['MASTER_PORT']}_{mode}"
    saver = SaveEvery(every if mode != "none" else 0, directory)
    trainer = cpu_trainer(ShardStrategy(stage=3, async_checkpoint=mode.startswith("async")), steps, [saver])
    data = DataLoader(TensorDataset(torch.randn(4 * steps, WIDTH)), batch_size=2)
    t0 = time.perf_counter()
    trainer.fit(Wide(depth), data)  # teardown waits for the last async save
    total = time.perf_counter() - t0
    if trainer.is_global_zero:
        shutil.rmtree(directory, ignore_errors=True)
    write_cpu, WRITE_CPU_S[:] = list(WRITE_CPU_S), []
    return {"total_s": total, "blocked_s": saver.blocked, "write_cpu_s": write_cpu}


WRITE_CPU_S: list[float] = []


def _timed_write_data(original):  # type: ignore[no-untyped-def]
    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        start = time.thread_time()
        try:
            return original(self, plan, planner)
        finally:
            WRITE_CPU_S.append(time.thread_time() - start)

    return write_data


def _bench(rounds: int, steps: int, every: int, depth: int) -> dict[str, list[dict]]:
    FileSystemWriter.write_data = _timed_write_data(FileSystemWriter.write_data)  # type: ignore[method-assign]
    return interleaved({m: m for m in MODES}, rounds, lambda mode: _run(mode, steps, every, depth))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--depth", type=int, default=DEPTH, help=f"layers of {WIDTH}x{WIDTH}")
    parser.add_argument("--out", default="benchmarks/results/async_checkpoint.json")
    args = parser.parse_args()
    raw = run_ranks(_bench, args.rounds, args.steps, args.every, args.depth)[0]
    blocked = {m: statistics.median(t for run in raw[m] for t in run["blocked_s"]) for m in MODES[1:]}
    total = {m: statistics.median(run["total_s"] for run in raw[m]) for m in raw}
    params = args.depth * WIDTH * WIDTH
    report = {
        "benchmark": f"{args.depth}x{WIDTH}^2 = {params / 1e6:.1f}M params + AdamW, stage 3, 2 CPU ranks,"
        f" {args.steps} steps, a save every {args.every}, {args.rounds} rounds",
        "median_blocked_s_per_save": blocked,
        "async_blocked_over_sync": blocked["async"] / blocked["sync"],
        "median_run_s": total,
        "async_saving_run_over_no_save_run": total["async"] / total["none"],
        "median_write_cpu_s_per_save": {
            m: statistics.median(t for run in raw[m] for t in run["write_cpu_s"]) for m in MODES[1:]
        },
        "sync_saving_run_over_no_save_run": total["sync"] / total["none"],
        "targets": {"async_blocked_over_sync": "<= 0.10", "async_saving_run_over_no_save_run": "<= 1.05"},
        "raw": raw,
    }
    write_report(report, args.out, {k: v for k, v in report.items() if k != "raw"})


if __name__ == "__main__":
    main()
