"""One replica group of a fault-tolerant run: the demo GPT trained with ``ShardStrategy(fault_tolerance={})``.

Launch one per group, each its own job (``torchrun`` here; one ``srun`` step per group on SLURM), with
``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and ``TORCHFT_LIGHTHOUSE`` set (``launch.py`` does it all on one
machine). ``--plain`` trains the same model as one job of ``NUM_REPLICA_GROUPS`` x ranks with HSDP instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from lightning_shard import ShardStrategy
from lightning_shard.demos.gpt import GPTModule, TextDataModule


class Record(L.Callback):
    """Each step's loss; the group's processes exit at ``die_at`` (a failure), once (a marker file says so).
    Every group waits for the others' first step (``ready`` files) so that they start together, and
    ``step_time`` slows each step (a demo on one machine: a restarted group needs seconds to start)."""

    def __init__(
        self, die_at: int | None, fail_at: int | None, out: Path, name: str, groups: int, step_time: float
    ) -> None:
        self.losses: list[float] = []
        self.rows: list[list[list[int]]] = []  # each step's rows of this rank (their first 8 tokens)
        self.changed: list[bool] = []  # whether each step changed this rank's weights
        self.times: list[float] = []  # when each step ended
        self.die_at, self.marker, self.step_time = die_at, out / f"{name}.died", step_time
        self.name, self.batch_idx = name, 0
        self.fail_at = fail_at
        self.term_at: int | None = None  # set by main(): SIGTERM to this group's launcher at that step
        self.out, self.rejoin_at = (
            out,
            None,
        )  # set by main(): the step at which live groups wait for a restart
        self.ready, self.all_ready = out / f"{name}.ready", [out / f"group{g}.ready" for g in range(groups)]

    def on_fit_start(self, trainer: L.Trainer, module: Any) -> None:
        if self.marker.exists():  # restarted after a failure
            self.marker.with_suffix(".restarted").touch()
        self.ready.touch()
        deadline = time.monotonic() + 120
        while not all(path.exists() for path in self.all_ready) and time.monotonic() < deadline:
            time.sleep(0.1)

    @staticmethod
    def _checksum(module: Any) -> float:
        with torch.no_grad():
            return sum(float(getattr(p, "_local_tensor", p).double().sum()) for p in module.parameters())

    def on_before_backward(self, trainer: L.Trainer, module: Any, loss: Any) -> None:
        if self.fail_at is not None and trainer.global_step == self.fail_at:
            # The cross-group collective breaks: this group's end of it is aborted before the backward's
            # all-reduce, so that all-reduce fails here and on every other group taking part.
            trainer.strategy.replica_group.pg.abort()

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.rows.append(batch[0][:, :8].tolist())
        self.before = self._checksum(module)
        if trainer.global_step == self.term_at and trainer.global_rank == 0:
            # Preempted: the group's torchrun is told to stop (as SLURM or Kubernetes tell it), and it passes
            # SIGTERM on to each rank of the group; the other groups are not told anything.
            os.kill(os.getppid(), signal.SIGTERM)
        self.batch_idx = batch_idx

    def on_after_backward(self, trainer: L.Trainer, module: Any) -> None:
        # A lost host: every rank of this group dies after its step's backward (the cross-group average done, the
        # step not committed; on a window's last micro-batch), so the step is the live groups' last with it.
        last = (self.batch_idx + 1) % trainer.accumulate_grad_batches == 0
        if self.rejoin_at is not None and trainer.global_step + 1 == self.rejoin_at and last:
            # A demo on one busy machine: wait until a lost group is back, before the next step's quorum is asked.
            deadline = time.monotonic() + 120
            died = list(self.out.glob("*.died"))
            while died and not all(d.with_suffix(".restarted").exists() for d in died):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        if self.die_at == trainer.global_step and last and not self.marker.exists():
            trainer.strategy.barrier()
            if trainer.global_rank == 0:
                self.marker.touch()
            os._exit(1)  # every rank of this group dies here, mid-run

    def on_exception(self, trainer: L.Trainer, module: Any, exception: BaseException) -> None:
        record = {
            "exception": type(exception).__name__,
            "global_step": trainer.global_step,
            "losses": self.losses,
        }
        (self.out / f"{self.name}.rank{trainer.global_rank}.stopped.json").write_text(json.dumps(record))

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))
        self.changed.append(self._checksum(module) != self.before)
        self.times.append(time.time())
        time.sleep(self.step_time)


def fit(args: argparse.Namespace, stage: int, out: Path, resume: Path | None = None) -> None:
    """One fit at ``stage`` (from ``resume``, a checkpoint, if given); this rank's record in ``out``."""
    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "2"))
    name = "resumed" if resume else "plain" if args.plain else f"group{os.environ['REPLICA_GROUP_ID']}"
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(0)
    width = args.d_model
    model = GPTModule(
        vocab_size=256, seq_len=32, d_model=width, n_layers=2, n_heads=2, max_steps=args.max_steps
    )
    data = TextDataModule(seq_len=32, batch_size=4, n_sentences=400)
    # The plain job: HSDP at stages 2-3 (its replicate dimension is the groups), DDP over every rank at 0-1.
    plain = {"replicate_size": groups} if stage >= 2 else {}
    flags: dict[str, Any] = plain if args.plain else {"fault_tolerance": {"timeout": args.ft_timeout}}
    groups_waited = 0 if args.plain else groups
    record = Record(args.die_at_step, args.fail_at_step, out, name, groups_waited, args.step_time)
    record.rejoin_at, record.term_at = args.rejoin_by_step, args.term_at_step
    callbacks: list[L.Callback] = [record, OnExceptionCheckpoint(out / "exception", f"{name}_on_exception")]
    if args.ckpt_every:  # with fault tolerance, written by the lowest live group only
        every = args.ckpt_every
        callbacks.append(ModelCheckpoint(out / "ckpt", "{step}", every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=ShardStrategy(stage=stage, **flags),
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=True,  # (OnExceptionCheckpoint: a preempted group writes its own)
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=args.epoch_steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
    )
    try:
        trainer.fit(model, datamodule=data, ckpt_path=resume)
    except SystemExit as stop:  # a preempted group: Lightning ends the fit with SystemExit once its hooks ran
        (out / f"{name}.rank{trainer.global_rank}.exit").write_text(str(stop.code or 0))
        raise

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(trainer.strategy.model, options=full)
    if stage == 1:  # ZeRO-1: each rank's partition of the state, gathered on rank 0
        trainer.optimizers[0].consolidate_state_dict(to=0)
        optimizer = trainer.optimizers[0].state_dict() if trainer.global_rank == 0 else {"state": {}}
    else:
        optimizer = get_optimizer_state_dict(trainer.strategy.model, trainer.optimizers[0], options=full)
    replicas = trainer.strategy.replica_group  # what the replica group did (None: no fault tolerance)
    rank = trainer.global_rank
    result = {
        "losses": record.losses,
        "rows": record.rows,
        "global_step": trainer.global_step,
        "changed": record.changed,
        "times": record.times,
        "participants": replicas.participants if replicas else None,
        "discarded": replicas.discarded if replicas else None,
        "heals": replicas.heals if replicas else None,
        "asked_ahead": replicas.asked_ahead if replicas else None,
        "waits": replicas.waits if replicas else None,
        "writes_checkpoints": replicas.writes_checkpoints() if replicas else True,
    }
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save({"weights": weights, "optimizer": optimizer["state"]}, out / f"{name}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--stage", default="3", help="the ZeRO stage, or several to fit one after the other (2,3)"
    )
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True, help="a directory for each stage's results")
    parser.add_argument("--die-at-step", type=int, default=None, help="this group's ranks exit at that step")
    parser.add_argument("--fail-at-step", type=int, default=None, help="a failed collective at that step")
    parser.add_argument("--term-at-step", type=int, default=None, help="SIGTERM to this group at that step")
    parser.add_argument(
        "--rejoin-by-step", type=int, default=None, help="wait there for a lost group's restart"
    )
    parser.add_argument("--step-time", type=float, default=0.0, help="seconds each step sleeps")
    parser.add_argument("--plain", action="store_true", help="one HSDP job instead of replica groups")
    parser.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    parser.add_argument(
        "--ft-timeout",
        type=float,
        default=20.0,
        help="seconds for a quorum, a heal, a cross-group collective",
    )
    parser.add_argument("--d-model", type=int, default=32, help="the demo GPT's width")
    parser.add_argument("--epoch-steps", type=int, default=None, help="steps per epoch (limit_train_batches)")
    parser.add_argument("--ckpt-every", type=int, default=0, help="a ModelCheckpoint every N steps")
    parser.add_argument("--resume", type=Path, help="also fit from OUT's stageS/ckpt/step=N.ckpt of that run")
    parser.add_argument("--resume-step", type=int, default=2)
    args = parser.parse_args()
    for stage in map(int, args.stage.split(",")):
        name = "plain" if args.plain else f"group{os.environ.get('REPLICA_GROUP_ID')}"
        if (args.out / f"stage{stage}" / f"{name}.rank{os.environ.get('RANK', '0')}.json").exists():
            continue  # a group restarted after a failure: the stages it finished before it stay done
        fit(args, stage, args.out / f"stage{stage}")
        if args.resume:
            checkpoint = args.resume / f"stage{stage}" / "ckpt" / f"step={args.resume_step}.ckpt"
            fit(args, stage, args.out / f"stage{stage}", resume=checkpoint)


if __name__ == "__main__":
    main()
