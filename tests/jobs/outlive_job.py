"""A job launched as users launch one (``python outlive_job.py``; Lightning starts rank 1) whose rank 1
outlives rank 0, as a rank with a slower shard or a slower disk does: both ranks train, rank 0 writes its
file and exits, rank 1 waits for that file, then ``--outlive`` seconds more, then writes its own.

    --door trainer    a Trainer (2 steps) per stage of --stages, one after the other on the same ranks
    --door fabric     ShardFabricStrategy(stage=3), one step
    --exit-code N     rank 1 exits with code N once its file is written
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardFabricStrategy, ShardStrategy
from lightning_shard.demos import GPT, GPTModule

VOCAB, SEQ = 64, 8


def train_trainer(stages: list[int]) -> int:
    """Fit 2 steps at each stage in turn; the first Trainer's launcher starts rank 1. Returns this rank."""
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    rank = 0
    for stage in stages:
        trainer = L.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=ShardStrategy(stage=stage),
            max_steps=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
        )
        model = GPTModule(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, lr=1e-2)
        trainer.fit(model, data)
        rank = trainer.global_rank
        print(f"rank {rank} finished stage {stage} at step {trainer.global_step}", flush=True)
    return rank


def train_fabric() -> int:
    """One step under ShardFabricStrategy(stage=3); ``fabric.launch()`` starts rank 1. Returns this rank."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardFabricStrategy(stage=3))
    fabric.launch()
    fabric.seed_everything(0)
    model = GPT(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, seq_len=SEQ)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randint(0, VOCAB, (2, SEQ))).float().mean())
    optimizer.step()
    print(f"rank {fabric.global_rank} stepped", flush=True)
    return fabric.global_rank


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)  # where the ranks' files go; names the job's processes
    parser.add_argument("--door", choices=("trainer", "fabric"), default="trainer")
    parser.add_argument("--stages", type=int, nargs="+", default=[3])
    parser.add_argument("--outlive", type=float, default=12.0)
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank = train_trainer(args.stages) if args.door == "trainer" else train_fabric()
    root = Path(args.root)
    if rank == 0:
        (root / "rank0.done").write_text(f"{time.time():.3f}")
        return
    while not (root / "rank0.done").exists():
        time.sleep(0.1)
    time.sleep(args.outlive)
    (root / "rank1.done").write_text(f"{time.time():.3f}")
    print(f"rank 1 wrote its file {args.outlive:.0f} s after rank 0 finished", flush=True)
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
