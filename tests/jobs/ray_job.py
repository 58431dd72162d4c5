"""Ray Train jobs on a local Ray cluster, written as Ray's Lightning guide writes them: ``TorchTrainer`` workers,
``RayLightningEnvironment``, ``RayTrainReportCallback``, ``prepare_trainer``, resume from ``ray.train.get_checkpoint()``.

One Ray session runs every part given to ``--parts`` in turn. Starting a run (its controller and each worker
group: new processes that import torch and Lightning) is the slow step, so the parts are as few runs as what they
show allows:

    two_workers  one run of 2 workers, its storage ``s3://`` on the local S3 server (moto): the same small GPT
                 (plain SGD) under RayDDPStrategy, then RayShardStrategy at FSDP stages 1 and 3, DeepSpeed stage 3
                 and stage 3 with tensor parallelism over both workers (one data-parallel rank), 2 epochs each, one
                 Trainer after another; then a last FSDP stage 3 Trainer whose rank 1 exits (os._exit) inside epoch
                 2: Ray restarts the run on 2 new workers (FailureConfig(max_failures=1)), which resume that Trainer
                 from the checkpoint it reported at epoch 1, read back from the S3 server (the Trainers before it
                 finished in the first attempt and are not run again)
    reshard      1 worker resumes the FSDP stage 3 and the DeepSpeed stage 3 checkpoints that 2 workers reported at
                 the end of epoch 2 in ``two_workers`` (read from the S3 server) and trains a third epoch; this run's
                 storage is a local directory

Writes ``<root>/<part>/<name>/rank<r>.json`` (the step training started at and each step's mean loss) and
``<root>/<part>.json`` (Ray's result: error, checkpoint directories).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import pyarrow.fs
import ray
import ray.train
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard.demos import GPTModule
from lightning_shard.demos.s3 import local_s3_server
from lightning_shard.ray import RayShardStrategy

VOCAB, SEQ = 64, 16
HEALTH_CHECK_S = 0.5  # Ray's default is 2 s: shorter, so the failure is seen and the run ends sooner
STRATEGIES = {
    "ddp": lambda: RayDDPStrategy(),
    "fsdp1": lambda: RayShardStrategy(stage=1),
    "fsdp3": lambda: RayShardStrategy(stage=3),
    "deepspeed3": lambda: RayShardStrategy(stage=3, engine="deepspeed"),
    "tp2": lambda: RayShardStrategy(stage=3, tensor_parallel_size=2),
    "fsdp3_lost_worker": lambda: RayShardStrategy(stage=3),
}
# FSDP stages 0 and 2 are not run here: nothing RayShardStrategy does depends on the stage (device, ranks, mesh,
# Ray's process group, each worker's own checkpoint copy), stage 0 is stage 1's DDP wrapper without the optimizer
# partition and stage 2 is stage 3's FSDP2 wrapping without resharding after forward; their losses and checkpoints
# are tested under ShardStrategy (tests/test_parity_multirank.py, test_strategy_multirank.py, test_checkpoint_*).
#: The Trainers of ``two_workers`` in order (a Trainer's index is its ``run_id``); the last one loses a worker.
TWO_WORKERS = list(STRATEGIES)
LOST = TWO_WORKERS[-1]
EXIT_AT = (1, 1)  # (epoch, batch) where rank 1 of the first attempt exits


class JobModule(GPTModule):
    """The demo GPT with plain SGD (a wrong gradient scale shows in the loss); records each step's mean loss
    and, where asked, exits one rank inside a step, as a lost worker does."""

    def __init__(self, run_id: int, exit_at: tuple[int, int] | None = None) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, seq_len=SEQ)
        self.run_id, self.exit_at = run_id, exit_at
        self.losses: list[float] = []
        self.start_step = -1

    def on_train_start(self) -> None:
        self.start_step = self.global_step  # > 0 when resumed from a checkpoint

    def training_step(self, batch, batch_idx):  # type: ignore[override]
        if self.exit_at == (self.current_epoch, batch_idx) and self.global_rank == 1:
            # Ray's controller takes a report from the workers at its next health check: a worker lost
            # before then takes its last report with it, and the run restarts from the one before.
            time.sleep(4 * HEALTH_CHECK_S)
            os._exit(1)
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(self.trainer.strategy.reduce(loss.detach(), reduce_op="mean").item())
        self.log("run_id", float(self.run_id))  # reported with each checkpoint: which Trainer wrote it
        return loss

    def configure_optimizers(self):  # type: ignore[override]
        return torch.optim.SGD(self.parameters(), lr=0.5)


class RecordingReport(RayTrainReportCallback):
    """Ray's callback as it is; also records the files this worker's own directory held when it reported it
    (on several hosts, a worker's directory is all Ray can upload from it)."""

    def __init__(self) -> None:
        super().__init__()
        self.reported: list[list[str]] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        save = trainer.save_checkpoint

        def save_and_record(path: str, *args: Any, **kwargs: Any) -> None:
            save(path, *args, **kwargs)
            root = Path(path).parent
            self.reported.append(sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file()))

        trainer.save_checkpoint = save_and_record  # type: ignore[method-assign]
        try:
            super().on_train_epoch_end(trainer, pl_module)
        finally:
            del trainer.save_checkpoint


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (32, SEQ + 1), generator=g)
    # In order: Lightning puts a DistributedSampler (shuffle=False) under it on several workers.
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4, shuffle=False)


def train_func(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    # Read once: Ray's answer changes with each checkpoint this run reports (one Trainer after another).
    reported = ray.train.get_checkpoint()
    for run_id, name in enumerate(config["names"]):
        out = Path(config["out"], name)
        if config.get("resume"):
            resume = config["resume"][name]
        elif reported is not None:
            # Ray restarted the run after the lost worker: resume the Trainer that lost it from the checkpoint
            # it reported. The Trainers before it finished in the first attempt; one that did not would have
            # caused the restart, and is reported here rather than resumed from another Trainer's checkpoint.
            if name != config.get("lost"):
                if not (out / f"rank{ray.train.get_context().get_world_rank()}.json").exists():
                    raise RuntimeError(
                        f"Ray restarted the run before {name} finished (only {config.get('lost')} loses a worker):"
                        " the first attempt's error is in Ray's worker logs, /tmp/ray/session_latest/logs"
                    )
                continue
            resume = reported
        else:
            resume = None
        L.seed_everything(0)
        report = RecordingReport()
        trainer = L.Trainer(
            devices="auto",
            accelerator="auto",
            strategy=STRATEGIES[name](),
            plugins=[RayLightningEnvironment()],
            callbacks=[report],
            max_epochs=config["max_epochs"],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer = prepare_trainer(trainer)
        exit_at = EXIT_AT if name == config.get("lost") and resume is None else None
        model = JobModule(run_id, exit_at)
        if resume is not None:
            with resume.as_directory() as directory:
                trainer.fit(
                    model, _data(), ckpt_path=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME)
                )
        else:
            trainer.fit(model, _data())
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "start": model.start_step,
            "losses": model.losses,
            "world": trainer.world_size,
            "reported": report.reported,
        }
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def _files(checkpoint: Checkpoint) -> list[str]:
    """The files of a checkpoint in Ray's storage (local or an object store), relative to it."""
    found = checkpoint.filesystem.get_file_info(pyarrow.fs.FileSelector(checkpoint.path, recursive=True))
    root = checkpoint.path.rstrip("/") + "/"
    return sorted(f.path[len(root) :] for f in found if f.type == pyarrow.fs.FileType.File)


def _run(
    root: Path, part: str, workers: int, max_failures: int = 0, storage: str | None = None, **config: Any
) -> Any:
    started = time.perf_counter()
    print(f"{part}: {workers} workers, {config['names']}", flush=True)
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"out": str(root / part), **config},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(
            name=part,
            storage_path=storage or str(root / "storage"),
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    try:
        result = trainer.fit()
        error = None if result.error is None else repr(result.error)
    except Exception as err:  # noqa: BLE001  (reported to the test, which shows it)
        result, error = None, repr(err)
    checkpoints = []
    if result is not None and result.best_checkpoints:
        checkpoints = [
            {"path": c.path, "epoch": m.get("epoch"), "run_id": m.get("run_id"), "files": _files(c)}
            for c, m in result.best_checkpoints
        ]
    summary = {"error": error, "checkpoints": checkpoints, "seconds": time.perf_counter() - started}
    (root / f"{part}.json").write_text(json.dumps(summary))
    print(f"{part}: {summary['seconds']:.0f} s", flush=True)  # what a job that times out reached
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--parts", nargs="+", default=["two_workers", "reshard"])
    args = parser.parse_args()
    root = Path(args.root)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(HEALTH_CHECK_S)  # read by Ray's controller
    # Ray Train's preemption watcher (an actor per worker group) polls for nodes being drained; one local node
    # is never drained, and the lost worker is seen by the controller's health check, not by the watcher.
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"
    # Ray starts its workers (the controllers, each Trainer's workers) at nice 15 by default (worker_niceness, read
    # by the raylet): beside other CPU-bound processes at nice 0 (the rest of a test suite) each then gets a few per
    # cent of a core, and starting a worker group (importing torch and Lightning) took minutes. At this job's own
    # priority its run takes what the load beside it leaves to any process.
    os.environ["RAY_worker_niceness"] = "0"
    with contextlib.ExitStack() as stack:
        # Started before Ray, whose workers inherit its endpoint and credentials (AWS_* variables).
        stack.enter_context(local_s3_server(bucket="ray", log=root / "moto.log"))
        endpoint = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://")
        s3 = f"s3://ray/storage?endpoint_override={endpoint}&scheme=http"
        context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        stack.callback(ray.shutdown)
        # Where Ray Train's controller logs each worker group's start-up (read by the test if the job times out).
        (root / "ray_session").write_text(context.address_info["session_dir"])
        _parts(root, args.parts, s3)


def _parts(root: Path, parts: list[str], s3: str) -> None:
    for part in parts:
        if part == "two_workers":
            _run(root, part, 2, max_failures=1, storage=s3, names=TWO_WORKERS, max_epochs=2, lost=LOST)
        elif part == "reshard":
            saved = json.loads((root / "two_workers.json").read_text())["checkpoints"]
            s3_files, _ = pyarrow.fs.FileSystem.from_uri(s3)
            resume = {}
            for name in ("fsdp3", "deepspeed3"):
                paths = [
                    c["path"] for c in saved if c["run_id"] == TWO_WORKERS.index(name) and c["epoch"] == 1
                ]
                if not paths:
                    raise SystemExit(f"no {name} checkpoint of epoch 2 among {saved}")
                resume[name] = Checkpoint(paths[0], filesystem=s3_files)
            _run(root, part, 1, names=list(resume), max_epochs=3, resume=resume)


if __name__ == "__main__":
    main()
