"""One SLURM task of a job, started as ``srun`` starts it (``SLURM_*`` variables, no launcher): trains the same
small GPT under Lightning's ``DDPStrategy`` and under ShardStrategy's engines, one Trainer each, each in its own
``default_root_dir``.

    --signal-step K   every task sends itself SIGUSR1 inside training step K (SLURM signals every task before
                      the time limit): Lightning saves ``hpc_ckpt_1.ckpt`` and asks ``scontrol`` to requeue
    (no flag)         the next ``srun`` of the job: Lightning finds the HPC checkpoint and resumes from it

The DDP reference reads its rows through a sampler written here on torch's ``DistributedSampler`` (the one
Lightning injects, same seed and split) that starts a resumed epoch at the batch the restored loop is at, so the
resumed runs are held to the rows the uninterrupted run reads there, not to DDP's replay of the epoch's start.

Writes ``<root>/<name>/rank<r>.json``: the step training started at, and the mean loss of each step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule, TextDataModule

STRATEGIES = {
    "ddp": lambda: "ddp",
    "fsdp1": lambda: ShardStrategy(stage=1),
    "fsdp3": lambda: ShardStrategy(stage=3),
    "deepspeed1": lambda: ShardStrategy(stage=1, engine="deepspeed"),
    "deepspeed3": lambda: ShardStrategy(stage=3, engine="deepspeed"),
}


class JobModule(GPTModule):
    """The demo GPT with plain SGD (a wrong gradient scale shows in the loss) and a SIGUSR1 at one step."""

    def __init__(self, signal_step: int) -> None:
        super().__init__(vocab_size=256, d_model=32, n_layers=2, n_heads=2, seq_len=32)
        self.signal_step = signal_step
        self.losses: list[float] = []
        self.start_step = -1

    def on_train_start(self) -> None:
        self.start_step = self.global_step  # > 0 when Lightning resumed from the HPC checkpoint

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        if self.global_step == self.signal_step:
            os.kill(os.getpid(), signal.SIGUSR1)  # handled here, inside this step, on every task
        loss = super().training_step(batch, batch_idx)
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        return loss

    def configure_optimizers(self):  # type: ignore[override]
        return torch.optim.SGD(self.parameters(), lr=0.3)


class SkipTaken(DistributedSampler):
    """torch's ``DistributedSampler`` whose first pass leaves out the batches the restored loop already took."""

    def __init__(self, dataset, batch_size: int, trainer: L.Trainer, **kwargs) -> None:
        super().__init__(dataset, **kwargs)
        self.batch_size, self.trainer, self.first = batch_size, trainer, True

    def __iter__(self):
        indices = list(super().__iter__())
        taken = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed if self.first else 0
        self.first = False
        return iter(indices[taken * self.batch_size :])


class ReferenceData(TextDataModule):
    """The demo's data for the DDP reference, its sampler given (``use_distributed_sampler=False``)."""

    def train_dataloader(self) -> DataLoader:
        trainer = self.trainer
        assert trainer is not None
        sampler = SkipTaken(
            self.dataset,
            self.batch_size,
            trainer,
            num_replicas=trainer.world_size,
            rank=trainer.global_rank,
            shuffle=True,
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
        )
        return DataLoader(self.dataset, batch_size=self.batch_size, sampler=sampler, drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--signal-step", type=int, default=-1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    nodes = int(os.environ["SLURM_NNODES"])
    per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
    for name in args.strategies:
        L.seed_everything(0)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=per_node,
            num_nodes=nodes,
            strategy=STRATEGIES[name](),
            max_steps=args.max_steps,
            default_root_dir=os.path.join(args.root, name),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=name != "ddp",
        )
        assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment), (
            trainer.strategy.cluster_environment
        )
        model = JobModule(args.signal_step)
        data = (ReferenceData if name == "ddp" else TextDataModule)(seq_len=32, batch_size=4, n_sentences=300)
        trainer.fit(model, data)
        result = {"start": model.start_step, "losses": model.losses}
        Path(args.root, name, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
