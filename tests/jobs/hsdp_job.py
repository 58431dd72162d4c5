"""HSDP on 2 nodes x 2 processes, launched by torchrun once per node (here both on one host):

    PYTHONPATH=. torchrun --nnodes 2 --nproc-per-node 2 --node-rank N --master-addr 127.0.0.1 \\
        --master-port P tests/jobs/hsdp_job.py --out result.json

The tiny GPT trains with ``ShardStrategy(stage=3, replicate_size=2)``: each node's 2 ranks shard the
model, the 2 nodes hold replicas. Plain SGD, accumulation 2, clipping, 3 optimizer steps. Rank 0
writes the per-micro-batch losses (averaged over ranks), every rank's mesh facts and the sampler
arguments the strategy gives, as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from tests.helpers import LossRecorder, token_dataset, trainer_kwargs
from tests.test_parity_multirank import CLIP, sgd_gpt

GLOBAL_BATCH = 8


class MeshFacts(L.Callback):
    """Every rank's view of the device mesh, gathered on all ranks while the groups exist."""

    def __init__(self) -> None:
        self.ranks: list[dict[str, Any]] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        strategy: Any = trainer.strategy
        mesh = strategy.device_mesh
        names = list(mesh.mesh_dim_names or ())
        param: Any = next(pl_module.parameters())
        is_dtensor = isinstance(param, DTensor)
        mine = {
            "rank": dist.get_rank(),
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "dim_names": names,
            "shape": list(mesh.mesh.shape),
            "groups": {name: mesh[name].mesh.tolist() for name in names},
            "sampler": strategy.distributed_sampler_kwargs,
            "param_mesh": list(param.device_mesh.mesh_dim_names or ()) if is_dtensor else [],
            "param_placements": [str(p) for p in param.placements] if is_dtensor else [],
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        self.ranks = gathered


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-steps", type=int, default=3)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    # torchrun's environment; Lightning removes WORLD_SIZE at teardown, so read it first.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dataset = token_dataset()
    # R=2 x S=2 x T=1: every rank is its own data-parallel rank.
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=False
    )
    data = DataLoader(dataset, batch_size=GLOBAL_BATCH // world, sampler=sampler)

    recorder, facts = LossRecorder(), MeshFacts()
    trainer = L.Trainer(
        devices=2,
        num_nodes=2,
        strategy=ShardStrategy(stage=3, replicate_size=2),
        callbacks=[recorder, facts],
        **trainer_kwargs(
            max_steps=args.max_steps,
            accumulate_grad_batches=2,
            gradient_clip_val=CLIP,
            gradient_clip_algorithm="norm",
        ),
    )
    trainer.fit(sgd_gpt(), data)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world": world, "losses": recorder.losses, "ranks": facts.ranks}, f, indent=1)
    print(f"rank {rank} finished fit at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
