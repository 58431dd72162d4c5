"""Async sharded saves to an S3 API (moto's server on localhost) vs the local disk, 2 CPU ranks.

The model of bench_async_checkpoint.py (~100M parameters + AdamW state, stage 3). Per save: the time the loop is
blocked (``trainer.save_checkpoint`` returning: state staged in host memory) and the time until the checkpoint
is committed (the background write plus the commit: a rename on disk, the marker object on S3). Rounds alternate
the two stores; medians over every save.

    python benchmarks/bench_remote_checkpoint.py --rounds 3 --saves 3 --out benchmarks/results/remote_checkpoint.json
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
from bench_async_checkpoint import DEPTH, WIDTH, Wide
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.demos.s3 import local_s3_server


class TimedSaves(L.Callback):
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.blocked: list[float] = []
        self.committed: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        path = f"{self.directory}/step{trainer.global_step}.ckpt"
        t0 = time.perf_counter()
        trainer.save_checkpoint(path)
        self.blocked.append(time.perf_counter() - t0)
        trainer.strategy.engine.wait_for_checkpoints()
        self.committed.append(time.perf_counter() - t0)
        # moto keeps every object in memory: one checkpoint (1.2 GB) at a time.
        trainer.strategy.remove_checkpoint(path)


def _run(store: str, saves: int) -> dict[str, list[float]]:
    port = os.environ["MASTER_PORT"]
    directory = f"s3://ckpt/bench{port}" if store == "s3" else f"{tempfile.gettempdir()}/bench_remote_{port}"
    timer = TimedSaves(directory)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ShardStrategy(stage=3, async_checkpoint=True),
        max_steps=saves,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Wide(), DataLoader(TensorDataset(torch.randn(4 * saves, WIDTH)), batch_size=2))
    if trainer.is_global_zero and store == "local":
        shutil.rmtree(directory, ignore_errors=True)
    return {"blocked_s": timer.blocked, "committed_s": timer.committed}


def _bench(rounds: int, saves: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {"local": [], "s3": []}
    for r in range(rounds):
        for store in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
            results[store].append(_run(store, saves))
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/remote_checkpoint.json")
    args = parser.parse_args()
    with local_s3_server(bucket="ckpt"):
        raw = run_ranks(_bench, args.rounds, args.saves)[0]
    median = {
        store: {
            key: statistics.median(t for run in raw[store] for t in run[key])
            for key in ("blocked_s", "committed_s")
        }
        for store in raw
    }
    report = {
        "benchmark": f"{DEPTH}x{WIDTH}^2 = {DEPTH * WIDTH * WIDTH / 1e6:.1f}M params + AdamW, stage 3, 2 CPU ranks,"
        " async saves; S3 = moto's server on localhost",
        "median_per_save": median,
        "s3_committed_over_local": median["s3"]["committed_s"] / median["local"]["committed_s"],
        "raw": raw,
    }
    write_report(report, args.out, printed={k: v for k, v in report.items() if k != "raw"})


if __name__ == "__main__":
    main()
