"""Lightning's own callbacks and tuner under ShardStrategy give what they give under Lightning's DDPStrategy, on
the same 2 ranks, data and SGD project, or are refused at set-up with the fix (docs/callbacks.md).

One job per engine runs every feature under DDPStrategy and under ShardStrategy at stages 1 and 3; the tests
below read its results. The adaptations live in :mod:`lightning_shard.trainer._callbacks`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BasePredictionWriter

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.trainer import _callbacks as compat
from tests.helpers import ENGINES, SEQ, VOCAB, LossRecorder, MemoryLogger, loader, trainer_kwargs

FAIL_AT = 3  # the training step that raises in the OnExceptionCheckpoint run
TIMER_S = 1.0


class Project(GPTModule):
    """The tiny GPT with plain SGD (gradient-scale sensitive), a step LR schedule, validation / test / predict
    steps, and ``example_input_array`` (ModelSummary's FLOPs and sizes)."""

    def __init__(self, fail_at: int | None = None, lr: float = 0.5) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, seq_len=SEQ, d_model=32, n_layers=2, n_heads=2, lr=lr)
        self.example_input_array = torch.zeros(2, SEQ, dtype=torch.long)
        self.fail_at = fail_at

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at:
            raise RuntimeError(f"failed at step {self.global_step}")
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])[:, -1]

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SummaryTables(logging.Handler):
    """The tables ModelSummary logs (rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.tables.append(record.getMessage())


class Writer(BasePredictionWriter):
    def __init__(self, root: Path, interval: str) -> None:
        super().__init__(interval)  # type: ignore[arg-type]
        self.root = root

    def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, *args: Any) -> None:
        batch_idx = args[-2]
        torch.save(prediction, self.root / f"rank{trainer.global_rank}-batch{batch_idx}.pt")

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        torch.save((predictions, batch_indices), self.root / f"rank{trainer.global_rank}-epoch.pt")


def _monitored(make: Any, root: Path) -> dict[str, Any]:
    """EarlyStopping, LearningRateMonitor, ModelSummary, ModelCheckpoint on val_loss; then test(ckpt_path="best")."""
    from lightning.pytorch.callbacks import (
        EarlyStopping,
        LearningRateMonitor,
        ModelCheckpoint,
        ModelSummary,
        ThroughputMonitor,
    )

    tables, memory = SummaryTables(), MemoryLogger()
    summary_log = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    summary_log.addHandler(tables)
    best = ModelCheckpoint(dirpath=root / "best", monitor="val_loss")
    throughput = ThroughputMonitor(batch_size_fn=lambda batch: batch[0].size(0), window_size=2)
    callbacks = [
        EarlyStopping(monitor="val_loss", patience=2),
        LearningRateMonitor(),
        ModelSummary(),
        best,
        throughput,
    ]
    kwargs = trainer_kwargs(
        max_steps=30,
        val_check_interval=2,
        limit_val_batches=2,
        log_every_n_steps=1,
        enable_checkpointing=True,
    )
    trainer = L.Trainer(devices=2, strategy=make(), callbacks=callbacks, **{**kwargs, "logger": memory})
    model = Project()
    try:
        trainer.fit(model, loader(4), loader(4))
    finally:
        summary_log.removeHandler(tables)
    tested = trainer.test(model, loader(4), ckpt_path="best", verbose=False)
    return {
        "stop": trainer.global_step,
        "val": [(step, row["val_loss"]) for step, row in memory.rows if "val_loss" in row],
        "lr": [(step, row) for step, row in memory.rows if any(key.startswith("lr-") for key in row)],
        "summary": tables.tables,
        "best": (Path(best.best_model_path).name, float(best.best_model_score)),
        "test": tested[0]["test_loss"],
        "throughput": sorted({key for _, row in memory.rows for key in row if key.startswith("train/")}),
        "mfu": [row["train/device/mfu"] for _, row in memory.rows if "train/device/mfu" in row],
    }


def _predicted(make: Any, root: Path) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelSummary

    root.mkdir(parents=True, exist_ok=True)
    writers = [Writer(root, "batch"), Writer(root, "epoch")]
    summary = ModelSummary()
    trainer = L.Trainer(
        devices=2, strategy=make(), callbacks=[*writers, summary], **trainer_kwargs(max_steps=3)
    )
    model = Project()
    trainer.fit(model, loader(4))
    trainer.predict(model, loader(4, n=16), return_predictions=False)
    trainer.strategy.barrier()
    written = {path.name: torch.load(path) for path in sorted(root.glob("*.pt"))}
    return {"written": written, "summary_adapted": "_summary" in vars(summary)}


def _lr_found(make: Any, root: Path) -> dict[str, Any]:
    from lightning.pytorch.tuner import Tuner

    trainer = L.Trainer(devices=2, strategy=make(), **trainer_kwargs(default_root_dir=str(root)))
    model = Project()
    finder = Tuner(trainer).lr_find(
        model, train_dataloaders=loader(4), min_lr=1e-3, max_lr=5.0, num_training=20, update_attr=True
    )
    assert finder is not None
    return {"suggestion": finder.suggestion(), "results": finder.results, "lr": model.hparams.lr}


def _accumulated(make: Any) -> dict[str, Any]:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    recorder = LossRecorder()
    callbacks = [recorder, GradientAccumulationScheduler({0: 1, 2: 2})]
    trainer = L.Trainer(
        devices=2, strategy=make(), callbacks=callbacks, **trainer_kwargs(max_steps=-1, max_epochs=4)
    )
    try:
        trainer.fit(Project(), loader(4, n=16))  # 2 batches per rank and epoch
    except ValueError as error:
        return {"refused": str(error)}
    return {"losses": recorder.losses, "steps": trainer.global_step}


class _StartStep(L.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.global_step)


def _resumed(make: Any, root: Path) -> dict[str, Any]:
    """OnExceptionCheckpoint after an exception at step FAIL_AT; the resumed run stopped by a Timer."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint, Timer

    kwargs = trainer_kwargs(max_steps=200, enable_checkpointing=True, default_root_dir=str(root))
    failed, resumed = LossRecorder(), LossRecorder()
    trainer = L.Trainer(devices=2, strategy=make(), callbacks=[failed, OnExceptionCheckpoint(root)], **kwargs)
    try:
        trainer.fit(Project(fail_at=FAIL_AT), loader(4))
        error = None
    except RuntimeError as raised:
        error = str(raised)
    start, timer = _StartStep(), Timer(duration={"seconds": TIMER_S}, interval="step")
    trainer = L.Trainer(devices=2, strategy=make(), callbacks=[resumed, start, timer], **kwargs)
    trainer.fit(Project(), loader(4), ckpt_path=root / "on_exception.ckpt")
    return {
        "error": error,
        "before": failed.losses,
        "start": start.steps,
        "after": resumed.losses,
        "stop": trainer.global_step,
        "elapsed": timer.time_elapsed("train"),
    }


def _job(engine: str, root: str) -> dict[str, dict[str, Any]]:
    from lightning.pytorch.strategies import DDPStrategy

    strategies: dict[str, Any] = {"ddp": DDPStrategy}
    for stage in (1, 3):
        strategies[f"stage{stage}"] = lambda stage=stage: ShardStrategy(stage=stage, engine=engine)
    out: dict[str, dict[str, Any]] = {}
    for name, make in strategies.items():
        where = Path(root) / name
        plain = (lambda: ShardStrategy(stage=3, engine=engine)) if name == "stage3" else make
        out[name] = {
            "monitored": _monitored(make, where / "monitored"),
            "predicted": _predicted(plain, where / "predicted"),
            "lr_find": _lr_found(make, where / "lr_find"),
            "accumulated": _accumulated(make),
            "resumed": _resumed(make, where / "resumed"),
        }
    return out


@pytest.fixture(scope="module", params=ENGINES)
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Any]]:
    engine = request.param
    return engine, run_ranks(_job, engine, str(tmp_path_factory.mktemp(f"callbacks-{engine}")))


def _shard(out: dict[str, Any]) -> dict[str, Any]:
    return {name: result for name, result in out.items() if name != "ddp"}


@pytest.mark.multirank
def test_early_stopping_stops_at_the_ddp_step(job):
    engine, (out, _) = job
    ddp = out["ddp"]["monitored"]
    assert ddp["stop"] < 30  # stopped by the callback, not by max_steps
    for name, result in _shard(out).items():
        got = result["monitored"]
        assert got["stop"] == ddp["stop"], f"{engine} {name}"
        torch.testing.assert_close(got["val"], ddp["val"], rtol=1e-5, atol=0)


@pytest.mark.multirank
def test_learning_rate_monitor_logs_the_ddp_keys_and_rates(job):
    engine, (out, _) = job
    ddp = out["ddp"]["monitored"]["lr"]
    assert len({row["lr-SGD"] for _, row in ddp}) > 1  # the schedule moved the rate
    for name, result in _shard(out).items():
        assert result["monitored"]["lr"] == ddp, f"{engine} {name}"


@pytest.mark.multirank
def test_model_summary_counts_the_whole_model_and_its_flops(job):
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

    engine, (out, _) = job
    ddp = out["ddp"]["monitored"]["summary"]
    total = sum(p.numel() for p in Project().parameters())
    assert len(ddp) == 1 and re.search(
        rf"{re.escape(get_human_readable_count(total))}\s+Total params", ddp[0]
    )
    assert "FLOPs" in ddp[0] and "0         Total Flops" not in ddp[0]
    for name, result in _shard(out).items():
        assert result["monitored"]["summary"] == ddp, f"{engine} {name}"


@pytest.mark.multirank
def test_best_checkpoint_tests_like_ddp(job):
    engine, (out, _) = job
    ddp = out["ddp"]["monitored"]
    for name, result in _shard(out).items():
        got = result["monitored"]
        assert got["best"][0] == ddp["best"][0], f"{engine} {name}"
        torch.testing.assert_close(got["best"][1], ddp["best"][1], rtol=1e-5, atol=0)
        torch.testing.assert_close(got["test"], ddp["test"], rtol=1e-5, atol=0)


@pytest.mark.multirank
def test_prediction_writer_writes_the_ddp_predictions(job):
    engine, (out, _) = job
    ddp = out["ddp"]["predicted"]["written"]
    assert sorted(ddp) == [f"rank{r}-{what}.pt" for r in (0, 1) for what in ("batch0", "batch1", "epoch")]
    for name, result in _shard(out).items():
        written = result["predicted"]["written"]
        assert sorted(written) == sorted(ddp), f"{engine} {name}"
        torch.testing.assert_close(written, ddp, rtol=1e-5, atol=1e-6)


@pytest.mark.multirank
def test_lr_find_suggests_the_ddp_rate(job):
    engine, (out, _) = job
    ddp = out["ddp"]["lr_find"]
    assert ddp["lr"] == ddp["suggestion"]  # update_attr=True
    for name, result in _shard(out).items():
        got = result["lr_find"]
        assert got["suggestion"] == ddp["suggestion"] == got["lr"], f"{engine} {name}"
        assert got["results"]["lr"] == ddp["results"]["lr"]
        torch.testing.assert_close(got["results"]["loss"], ddp["results"]["loss"], rtol=1e-5, atol=0)


@pytest.mark.multirank
def test_gradient_accumulation_scheduler_trains_like_ddp_or_is_refused(job):
    engine, (out, _) = job
    ddp = out["ddp"]["accumulated"]
    assert ddp["steps"] == 2 + 2 + 1 + 1  # epochs 2-3 accumulate 2 batches
    for name, result in _shard(out).items():
        got = result["accumulated"]
        if engine == "deepspeed":
            assert re.search(
                rf"ShardStrategy\(stage={name[-1]}, engine='deepspeed'\) cannot follow Lightning's"
                r" GradientAccumulationScheduler.*Use engine='fsdp'",
                got["refused"],
            )
            continue
        assert got["steps"] == ddp["steps"], f"{engine} {name}"
        torch.testing.assert_close(got["losses"], ddp["losses"], rtol=1e-5, atol=0)


@pytest.mark.multirank
def test_exception_checkpoint_resumes_at_the_failing_step_and_the_timer_stops_the_run(job):
    engine, results = job
    for out in results:
        ddp = out["ddp"]["resumed"]
        for name, result in out.items():
            got = result["resumed"]
            where = f"{engine} {name}"
            assert got["error"] == f"failed at step {FAIL_AT}", where
            assert got["start"] == [FAIL_AT], where
            assert FAIL_AT < got["stop"] < 200 and got["elapsed"] >= TIMER_S, where  # the Timer stopped it
            torch.testing.assert_close(got["before"], ddp["before"], rtol=1e-5, atol=0)
            steps = min(len(got["after"]), len(ddp["after"]))
            torch.testing.assert_close(got["after"][:steps], ddp["after"][:steps], rtol=1e-5, atol=0)
    assert results[0]["stage3"]["resumed"]["stop"] == results[1]["stage3"]["resumed"]["stop"]


@pytest.mark.multirank
def test_shard_strategy_adapts_lightning_callbacks_at_setup(job):
    engine, (out, _) = job
    assert out["stage3"]["predicted"]["summary_adapted"]


# --- one process: the adaptations themselves ------------------------------------------------------------------


def _fakes(engine: str, callbacks: list[Any], optimizers: list[Any] | None = None) -> tuple[Any, Any]:
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    strategy = SimpleNamespace(engine_name=engine, stage=3, optimizers=optimizers or [])
    state = SimpleNamespace(fn=TrainerFn.VALIDATING)  # the fit-only checks have tests of their own
    return SimpleNamespace(
        callbacks=callbacks, accumulate_grad_batches=1, strategy=strategy, state=state
    ), strategy


def test_a_changing_accumulation_schedule_is_refused_under_deepspeed():
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    trainer, strategy = _fakes("deepspeed", [GradientAccumulationScheduler({0: 1, 2: 2})])
    with pytest.raises(ValueError, match=r"engine='deepspeed'\) cannot follow .*Use engine='fsdp'"):
        compat.adapt(trainer, strategy)
    compat.adapt(*_fakes("fsdp", trainer.callbacks))  # the FSDP engine follows the schedule
    compat.adapt(*_fakes("deepspeed", [GradientAccumulationScheduler({0: 1})]))  # nothing changes


def test_shard_summary_counts_deepspeed_partitioned_parameters():
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.utilities.model_summary import summarize

    model = Project()
    model.example_input_array = None
    total = sum(p.numel() for p in model.parameters())
    for p in model.parameters():  # what ZeRO-3 leaves on every rank: size-0 data, the size in ds_numel
        p.ds_numel = p.numel()  # type: ignore[attr-defined]
        p.data = torch.empty(0)
    assert summarize(model).total_parameters == 0  # Lightning's own count
    callback = ModelSummary()
    compat.adapt(*_fakes("deepspeed", [callback]))
    summary = callback._summary(None, model)  # type: ignore[arg-type]
    assert summary.total_parameters == summary.trainable_parameters == total
    assert summary.param_nums == [total]


def test_a_model_summary_subclass_with_its_own_count_keeps_it():
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    class Own(ModelSummary):
        def _summary(self, trainer: Any, pl_module: Any) -> Any:
            return "own"

    own, rich = Own(), RichModelSummary()
    compat.adapt(*_fakes("fsdp", [own, rich]))
    assert own._summary(None, None) == "own"  # type: ignore[arg-type]
    assert "_summary" in vars(rich)


def test_lr_search_sees_the_torch_optimizer_and_the_strategy_gets_its_own_back():
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import LearningRateFinder

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    zero = SimpleNamespace(optimizer=sgd)  # DeepSpeed's ZeRO optimizer wraps the torch one
    callback, seen = LearningRateFinder(), []

    def search(trainer: Any, pl_module: Any) -> None:
        seen.append(list(trainer.strategy.optimizers))
        raise RuntimeError("search failed")

    callback.lr_find = search  # type: ignore[method-assign]
    trainer, strategy = _fakes("deepspeed", [callback], [zero])
    compat.adapt(trainer, strategy)
    compat.adapt(trainer, strategy)  # a later Trainer call: wrapped once
    with pytest.raises(RuntimeError, match="search failed"):
        callback.lr_find(trainer, None)
    assert seen == [[sgd]] and strategy.optimizers == [zero]


def test_a_sharded_optimizer_class_is_named_after_the_optimizer_it_shards():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_shard.engines.fsdp.zero import named_zero_class

    named = named_zero_class(torch.optim.SGD)
    assert named.__name__ == "SGD" and issubclass(named, ZeroRedundancyOptimizer)
    assert named_zero_class(torch.optim.SGD) is named


@pytest.mark.multirank
def test_throughput_monitor_logs_mfu_under_every_shard_configuration(job):
    engine, (out, _) = job
    ddp = out["ddp"]["monitored"]
    assert "train/device/batches_per_sec" in ddp["throughput"]  # Lightning's own numbers, under DDP too
    for name, result in _shard(out).items():
        got = result["monitored"]
        assert set(ddp["throughput"]) <= set(got["throughput"]), f"{engine} {name}"
        # ShardStrategy feeds the monitor its FLOPs and the CPU's peak: MFU with no user code.
        assert got["mfu"] and all(0 < value < 1 for value in got["mfu"]), f"{engine} {name}: {got['mfu']}"
