"""A Fabric job launched as users launch one (``python fabric_exit_job.py``; Fabric starts rank 1) whose
rank 1 outlives rank 0: after one training step, rank 1 sleeps while rank 0 returns and exits."""

from __future__ import annotations

import argparse
import time

import lightning as L
import torch

from lightning_shard import ShardFabricStrategy
from lightning_shard.core import processes
from lightning_shard.demos import GPT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)  # names the job's processes for the test's pgrep
    parser.add_argument("--grace", type=float, default=2.0)
    args = parser.parse_args()
    processes.CHILD_EXIT_GRACE_S = args.grace  # how long rank 0 waits for rank 1 before stopping it
    torch.set_num_threads(1)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardFabricStrategy(stage=3))
    fabric.launch()
    fabric.seed_everything(0)
    model = GPT(vocab_size=64, d_model=16, n_layers=2, n_heads=2, seq_len=8)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, 64, (2, 8))
    fabric.backward(model(x).float().mean())
    optimizer.step()
    print(f"rank {fabric.global_rank} stepped", flush=True)
    if fabric.global_rank == 1:
        print(f"rank 1 outlives rank 0 from {time.time():.3f}", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
