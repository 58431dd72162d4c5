"""What Ray Train adds to a ShardStrategy run: per run, and per checkpoint, against Lightning's own launcher.

The same job both ways: the demo GPT at stage 3 on 2 CPU ranks, ``--epochs`` epochs of ``--steps`` steps, a
sharded checkpoint at each epoch end.

* ray: ``TorchTrainer`` with 2 workers (Ray already started: ``ray.init`` is timed once, apart),
  ``RayShardStrategy`` + ``RayLightningEnvironment`` + ``RayTrainReportCallback`` (each worker saves into its
  own directory, then Ray copies both into one checkpoint in storage);
* lightning: ``python bench_ray.py --child ...`` with ``Trainer(devices=2)``, ``ShardStrategy`` and a callback
  that saves ``trainer.save_checkpoint(...)`` at each epoch end (Lightning's launcher starts rank 1).

Per run: the wall time of ``TorchTrainer.fit()`` against that of the whole ``python`` process (start-up,
imports, process group, training, exit). Per checkpoint: the time the training loop spends at an epoch end
(Ray: ``RayTrainReportCallback`` saving, reporting and copying to storage; Lightning: the save alone), and
the save alone inside it. Medians over ``--rounds`` interleaved rounds.

    python benchmarks/bench_ray.py --rounds 3 --out benchmarks/results/ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from _common import token_loader, write_report

from lightning_shard.demos import GPTModule

MODEL = dict(vocab_size=256, seq_len=64, d_model=128, n_layers=4, n_heads=4)


class Module(GPTModule):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(**MODEL)

    def configure_optimizers(self):  # type: ignore[override]
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class EpochEnd(L.Callback):
    """Saves at each epoch end (the Lightning run); with ``report``, wraps Ray's callback instead. Records the
    wall time of each epoch end, and of the ``save_checkpoint`` inside it."""

    def __init__(self, directory: str, report: Any = None) -> None:
        self.directory, self.report = directory, report
        self.epoch_end: list[float] = []
        self.save: list[float] = []

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        save = trainer.save_checkpoint

        def timed_save(path: Any, *args: Any, **kwargs: Any) -> None:
            t0 = time.perf_counter()
            save(path, *args, **kwargs)
            self.save.append(time.perf_counter() - t0)

        trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
        t0 = time.perf_counter()
        try:
            if self.report is not None:
                self.report.on_train_epoch_end(trainer, pl_module)
            else:
                trainer.save_checkpoint(
                    os.path.join(self.directory, str(trainer.current_epoch), "checkpoint.ckpt")
                )
        finally:
            del trainer.save_checkpoint
        self.epoch_end.append(time.perf_counter() - t0)


def _fit(strategy: Any, callback: EpochEnd, config: dict[str, Any], **trainer_kwargs: Any) -> L.Trainer:
    torch.set_num_threads(1)
    trainer = L.Trainer(
        strategy=strategy,
        callbacks=[callback],
        max_epochs=config["epochs"],
        limit_train_batches=config["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    return trainer


def _result(trainer: L.Trainer, callback: EpochEnd, fit_s: float, out: str) -> None:
    if trainer.global_rank == 0:
        result = {"fit_s": fit_s, "epoch_end_s": callback.epoch_end, "save_s": callback.save}
        Path(out).write_text(json.dumps(result))


def ray_train_func(config: dict[str, Any]) -> None:
    from ray.train.lightning import RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    from lightning_shard.ray import RayShardStrategy

    callback = EpochEnd("", report=RayTrainReportCallback())
    trainer = _fit(
        RayShardStrategy(stage=3),
        callback,
        config,
        devices="auto",
        accelerator="auto",
        plugins=[RayLightningEnvironment()],
    )
    trainer = prepare_trainer(trainer)
    t0 = time.perf_counter()
    trainer.fit(Module(), token_loader(config["steps"], model=MODEL))
    _result(trainer, callback, time.perf_counter() - t0, config["out"])


def child(config: dict[str, Any]) -> None:
    from lightning_shard import ShardStrategy

    with tempfile.TemporaryDirectory() as directory:
        callback = EpochEnd(directory)
        trainer = _fit(ShardStrategy(stage=3), callback, config, devices=2, accelerator="cpu")
        t0 = time.perf_counter()
        trainer.fit(Module(), token_loader(config["steps"], model=MODEL))
        _result(trainer, callback, time.perf_counter() - t0, config["out"])


def run_ray(config: dict[str, Any], storage: str) -> dict[str, Any]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        ray_train_func,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=storage, name=f"bench-{time.time_ns()}"),
    )
    t0 = time.perf_counter()
    result = trainer.fit()
    wall = time.perf_counter() - t0
    if result.error is not None:
        raise result.error
    return {"run_s": wall, **json.loads(Path(config["out"]).read_text())}


def run_lightning(config: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(config)], check=True, env=env, capture_output=True
    )
    wall = time.perf_counter() - t0
    return {"run_s": wall, **json.loads(Path(config["out"]).read_text())}


def _median(runs: list[dict[str, Any]], key: str) -> float:
    values = [v for run in runs for v in (run[key] if isinstance(run[key], list) else [run[key]])]
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/ray.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    import ray

    os.environ["OMP_NUM_THREADS"] = "1"
    # Ray's workers unpickle the training function, which names this directory's _common module.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        ray_init_s = time.perf_counter() - t0
        config = {"epochs": args.epochs, "steps": args.steps}
        runs: dict[str, list[dict[str, Any]]] = {"ray": [], "lightning": []}
        for r in range(args.rounds):
            order = ["ray", "lightning"] if r % 2 == 0 else ["lightning", "ray"]
            for name in order:
                cfg = {**config, "out": os.path.join(work, f"{name}-{r}.json")}
                runs[name].append(
                    run_ray(cfg, os.path.join(work, "storage")) if name == "ray" else run_lightning(cfg)
                )
        ray.shutdown()
    medians = {
        name: {key: _median(rs, key) for key in ("run_s", "fit_s", "epoch_end_s", "save_s")}
        for name, rs in runs.items()
    }
    report = {
        "job": {"model": MODEL, "stage": 3, "ranks": 2, **config, "rounds": args.rounds},
        "ray_init_s": ray_init_s,
        "medians": medians,
        "ray_adds": {
            "per_run_s": medians["ray"]["run_s"] - medians["lightning"]["run_s"],
            "per_checkpoint_s": medians["ray"]["epoch_end_s"] - medians["lightning"]["epoch_end_s"],
            "per_checkpoint_save_alone_s": medians["ray"]["save_s"] - medians["lightning"]["save_s"],
            # Inside the same Ray runs: reporting, copying into storage and removing the local copy.
            "report_over_save_s": statistics.median(
                end - save
                for run in runs["ray"]
                for end, save in zip(run["epoch_end_s"], run["save_s"], strict=True)
            ),
        },
        "runs": runs,
    }
    write_report(report, args.out, printed={k: v for k, v in report.items() if k != "runs"})


if __name__ == "__main__":
    main()
