"""Ray Train jobs on a local Ray cluster, written as Ray's Lightning guide writes them: ``TorchTrainer`` workers,
``RayLightningEnvironment``, ``RayTrainReportCallback``, ``prepare_trainer``, resume from ``ray.train.get_checkpoint()``.

One Ray session runs every part given to ``--parts`` in turn (starting Ray and its workers is the slow step):

    parity    2 workers fit the same small GPT (plain SGD) under RayDDPStrategy, then RayShardStrategy at FSDP
              stages 1 and 3, DeepSpeed stage 3, FSDP stages 0 and 2, and stage 3 with tensor parallelism over
              both workers (one data-parallel rank), 2 epochs each, one Trainer after another
    failure   2 workers, FSDP stage 3; rank 1 exits (os._exit) inside epoch 2 of the first attempt; Ray restarts
              the run (FailureConfig(max_failures=1)), which resumes from the checkpoint reported at epoch 1;
              Ray's storage is ``s3://`` on the local S3 server (moto): the workers' shards are uploaded there
              and the restarted run reads them back
    reshard   1 worker resumes the FSDP stage 3 and the DeepSpeed stage 3 checkpoints that 2 workers reported at
              the end of ``parity``, and trains a third epoch

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
    "fsdp0": lambda: RayShardStrategy(stage=0),
    "fsdp2": lambda: RayShardStrategy(stage=2),
    "tp2": lambda: RayShardStrategy(stage=3, tensor_parallel_size=2),
}


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
        resume = config["resume"][name] if config.get("resume") else reported
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
        exit_at = tuple(config["exit_at"]) if config.get("exit_at") and resume is None else None
        model = JobModule(run_id, exit_at)  # type: ignore[arg-type]
        if resume is not None:
            with resume.as_directory() as directory:
                trainer.fit(
                    model, _data(), ckpt_path=os.path.join(directory, RayTrainReportCallback.CHECKPOINT_NAME)
                )
        else:
            trainer.fit(model, _data())
        out = Path(config["out"], name)
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
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--parts", nargs="+", default=["parity", "failure", "reshard"])
    args = parser.parse_args()
    root = Path(args.root)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(HEALTH_CHECK_S)  # read by Ray's controller
    with contextlib.ExitStack() as stack:
        # Started before Ray, whose workers inherit its endpoint and credentials (AWS_* variables).
        stack.enter_context(local_s3_server(bucket="ray", log=root / "moto.log"))
        endpoint = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://")
        s3 = f"s3://ray/storage?endpoint_override={endpoint}&scheme=http"
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        stack.callback(ray.shutdown)
        _parts(root, args.parts, s3)


def _parts(root: Path, parts: list[str], s3: str) -> None:
    names = list(STRATEGIES)
    for part in parts:
        if part == "parity":
            _run(root, part, 2, names=names, max_epochs=2)
        elif part == "failure":
            _run(root, part, 2, max_failures=1, storage=s3, names=["fsdp3"], max_epochs=2, exit_at=[1, 1])
        elif part == "reshard":
            saved = json.loads((root / "parity.json").read_text())["checkpoints"]
            resume = {}
            for name in ("fsdp3", "deepspeed3"):
                paths = [c["path"] for c in saved if c["run_id"] == names.index(name) and c["epoch"] == 1]
                if not paths:
                    raise SystemExit(f"no {name} checkpoint of epoch 2 among {saved}")
                resume[name] = Checkpoint(paths[0])
            _run(root, part, 1, names=list(resume), max_epochs=3, resume=resume)


if __name__ == "__main__":
    main()
