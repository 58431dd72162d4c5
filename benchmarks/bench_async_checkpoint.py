"""Async vs sync sharded checkpoints: time the training loop is blocked per save, and run throughput.

Model + AdamW state of ~100M parameters (24 bias-free 2048x2048 layers) at stage 3 on 2 CPU ranks.
Per round, interleaved: a run that never saves, a run saving synchronously every 20 steps, and a
run saving asynchronously every 20 steps. Blocked time is the wall time of ``trainer.save_checkpoint``
as the loop sees it; throughput is the run's total wall time over its steps. Medians over rounds.

    python benchmarks/bench_async_checkpoint.py --rounds 3 --steps 60 --out benchmarks/results/async_checkpoint.json
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
from _common import write_report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks

WIDTH, DEPTH = 2048, 24  # 24 x 2048^2 = 100.7M parameters


class Wide(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH))

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class SaveEvery(L.Callback):
    def __init__(self, every: int, directory: str) -> None:
        self.every, self.directory = every, directory
        self.blocked: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.every and trainer.global_step % self.every == 0:
            t0 = time.perf_counter()
            trainer.save_checkpoint(f"{self.directory}/step{trainer.global_step}.ckpt")
            self.blocked.append(time.perf_counter() - t0)


def _run(mode: str, steps: int, every: int) -> dict[str, float | list[float]]:
    # The same directory on both ranks (the port is unique to this run); the first save creates it.
    directory = f"{tempfile.gettempdir()}/bench_ckpt_{os.environ['MASTER_PORT']}_{mode}"
    saver = SaveEvery(every if mode != "none" else 0, directory)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardStrategy(stage=3, async_checkpoint=mode == "async"),
        max_steps=steps,
        callbacks=[saver],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = DataLoader(TensorDataset(torch.randn(4 * steps, WIDTH)), batch_size=2)
    t0 = time.perf_counter()
    trainer.fit(Wide(), data)  # teardown waits for the last async save
    total = time.perf_counter() - t0
    if trainer.is_global_zero:
        shutil.rmtree(directory, ignore_errors=True)
    return {"total_s": total, "blocked_s": saver.blocked}


def _bench(rounds: int, steps: int, every: int) -> dict[str, list[dict]]:
    modes = ["none", "sync", "async"]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % 3 :] + modes[: r % 3]:
            results[mode].append(_run(mode, steps, every))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/async_checkpoint.json")
    args = parser.parse_args()
    raw = run_ranks(_bench, args.rounds, args.steps, args.every)[0]
    blocked = {m: statistics.median(t for run in raw[m] for t in run["blocked_s"]) for m in ("sync", "async")}
    total = {m: statistics.median(run["total_s"] for run in raw[m]) for m in raw}
    report = {
        "benchmark": f"{DEPTH}x{WIDTH}^2 = {DEPTH * WIDTH * WIDTH / 1e6:.1f}M params + AdamW, stage 3, 2 CPU ranks",
        "median_blocked_s_per_save": blocked,
        "async_blocked_over_sync": blocked["async"] / blocked["sync"],
        "median_run_s": total,
        "async_saving_run_over_no_save_run": total["async"] / total["none"],
        "sync_saving_run_over_no_save_run": total["sync"] / total["none"],
        "targets": {"async_blocked_over_sync": "<= 0.10", "async_saving_run_over_no_save_run": "<= 1.05"},
        "raw": raw,
    }
    write_report(report, args.out, {k: v for k, v in report.items() if k != "raw"})


if __name__ == "__main__":
    main()
