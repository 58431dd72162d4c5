"""One training job launched the way users launch one: ``python exit_job.py ...`` with devices=2.

Lightning's own launcher starts rank 1; the process exits through normal interpreter shutdown, so
its exit code is what a scheduler would see. Used by the exit tests and benchmarks/stress_exit.py.

    --hang-rank R     rank R sleeps inside training_step at step --hang-step (a hung rank)
    --step-sleep S    seconds each training step sleeps (time to send a signal mid-training); with
                      --sleep-first-attempt, only in torchrun's first attempt (a restarted one trains at full speed)
    --die-rank R      rank R exits at once (os._exit) at step --die-step, in torchrun's first attempt only
    --epoch-steps N   N steps per epoch (Lightning's limit_train_batches): checkpoints at epoch ends resume exactly
    --digest          each rank prints a SHA-256 of the full weights after fit
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule, TextDataModule


class JobModule(GPTModule):
    def __init__(
        self,
        hang_rank: int,
        hang_step: int,
        step_sleep: float,
        die_rank: int = -1,
        die_step: int = 3,
        sleep_first_attempt: bool = False,
    ) -> None:
        super().__init__(vocab_size=256, d_model=32, n_layers=2, n_heads=2, seq_len=32, lr=1e-3)
        self.hang_rank, self.hang_step, self.step_sleep = hang_rank, hang_step, step_sleep
        self.die_rank, self.die_step = die_rank, die_step
        self.sleep_first_attempt = sleep_first_attempt
        self.checkpoint_every, self.checkpoint_dir = 0, None  # set by main() where it checkpoints

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.global_rank == self.die_rank and self.global_step == self.die_step and first_attempt:
            self._wait_for_committed_checkpoint()
            print(f"rank {self.global_rank} dies at step {self.global_step}", flush=True)
            os._exit(1)
        if self.global_rank == self.hang_rank and self.global_step == self.hang_step:
            print(
                f"rank {self.global_rank} hangs at step {self.global_step} at {time.time():.3f}", flush=True
            )
            time.sleep(3600)
        if self.step_sleep and (first_attempt or not self.sleep_first_attempt):
            time.sleep(self.step_sleep)
        return super().training_step(batch, batch_idx)

    def _wait_for_committed_checkpoint(self, limit: float = 120.0) -> None:
        """Die only once the last checkpoint due is committed: a background write still running when a rank
        dies fails (its collectives lose a peer) and leaves nothing to resume from, as it should; the restart
        under test needs one. On a loaded machine the write of step 4 can outlast step 7."""
        every, folder = self.checkpoint_every, self.checkpoint_dir
        if not every or folder is None or self.die_step < every:
            return
        due = f"*-step={self.die_step // every * every}.ckpt"  # renamed into place when committed
        deadline = time.monotonic() + limit
        while not list(Path(folder).glob(due)) and time.monotonic() < deadline:
            time.sleep(0.1)

    def on_train_start(self) -> None:
        print(
            f"rank {self.global_rank} of {self.trainer.world_size} starts training at step {self.global_step}",
            flush=True,
        )
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT")  # set by torchrun's agent
        if restarts is not None:
            print(f"rank {self.global_rank} torchrun restart {restarts}", flush=True)

    def on_exception(self, exception: BaseException) -> None:
        print(
            f"rank {self.global_rank} stopped by {type(exception).__name__} at step {self.global_step}",
            flush=True,
        )

    def test_step(self, batch, batch_idx):  # type: ignore[override]
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x).float().flatten(0, 1), y.flatten())
        self.log("test_loss", loss, sync_dist=True)


class ReportException(L.Callback):
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        name = type(exception).__name__
        print(f"rank {trainer.global_rank} stopped by {name} at step {trainer.global_step}", flush=True)


def report_collectives(trainer: L.Trainer, after: str) -> None:
    """What a script does with the strategy after a Trainer call; every rank must print rank 0's / all ranks' values."""
    strategy, rank = trainer.strategy, trainer.global_rank
    strategy.barrier()
    best = strategy.broadcast(f"path-from-rank-{rank}")
    total = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item()
    gathered = strategy.all_gather(torch.tensor([float(rank)])).flatten().tolist()
    print(f"rank {rank} after {after}: broadcast={best} sum={total} gather={gathered}", flush=True)


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of every parameter's full value, in order (a sharded one gathered: every rank calls this)."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param
        digest.update(name.encode() + full.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="fsdp")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--async-checkpoint", action="store_true")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--every", type=int, default=2, help="checkpoint every N steps (0: none)")
    parser.add_argument("--timeout", type=float, default=None, help="ShardStrategy(timeout=...) in seconds")
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-step", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument(
        "--sleep-first-attempt", action="store_true", help="--step-sleep in torchrun's first attempt only"
    )
    parser.add_argument("--die-rank", type=int, default=-1)
    parser.add_argument("--die-step", type=int, default=3)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--epoch-steps", type=int, default=None)
    parser.add_argument("--digest", action="store_true")
    parser.add_argument(
        "--then-test", action="store_true", help="fit again (2 more steps), then test: same Trainer"
    )
    parser.add_argument(
        "--collectives",
        action="store_true",
        help="after each Trainer call: barrier, broadcast, reduce, all_gather",
    )
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="devices and nodes from torchrun's LOCAL_WORLD_SIZE / WORLD_SIZE (a restart may change them)",
    )
    parser.add_argument("--root", required=True)
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    L.seed_everything(0)
    timeout = timedelta(seconds=args.timeout) if args.timeout else None
    strategy_kwargs = {"timeout": timeout} if timeout else {}
    strategy = ShardStrategy(
        stage=args.stage, engine=args.engine, async_checkpoint=args.async_checkpoint, **strategy_kwargs
    )
    callbacks: list = [ReportException()]
    if args.every:
        ckpt_dir = os.path.join(args.root, "checkpoints")
        callbacks += [
            ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=args.every, save_top_k=-1, save_last=True),
            OnExceptionCheckpoint(dirpath=ckpt_dir, filename="on_exception"),
        ]
    devices, nodes = 2, 1
    if args.elastic:
        devices = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // devices
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=callbacks,
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=args.epoch_steps,
    )
    model = JobModule(
        args.hang_rank,
        args.hang_step,
        args.step_sleep,
        args.die_rank,
        args.die_step,
        args.sleep_first_attempt,
    )
    if args.every:
        model.checkpoint_every, model.checkpoint_dir = args.every, ckpt_dir
    data = TextDataModule(seq_len=32, batch_size=4, n_sentences=400)
    trainer.fit(model, data, ckpt_path=args.resume)
    import torch.distributed as dist

    print(f"rank {trainer.global_rank} finished fit at step {trainer.global_step}", flush=True)
    print(f"rank {trainer.global_rank} process group alive after fit: {dist.is_initialized()}", flush=True)
    if args.digest:
        print(f"rank {trainer.global_rank} weights {weights_digest(model)}", flush=True)
    if args.collectives:
        report_collectives(trainer, "fit")
    if args.then_test:
        trainer.fit_loop.epoch_loop.max_steps = args.max_steps + 2
        trainer.fit(model, data)
        print(f"rank {trainer.global_rank} finished second fit at step {trainer.global_step}", flush=True)
        subset = torch.utils.data.Subset(data.dataset, range(16))
        trainer.test(model, dataloaders=torch.utils.data.DataLoader(subset, batch_size=4), verbose=False)
        print(f"rank {trainer.global_rank} finished test", flush=True)
        if args.collectives:
            report_collectives(trainer, "test")


if __name__ == "__main__":
    main(sys.argv[1:])
