"""The whole Trainer lifecycle on one Trainer and from checkpoints: fit, validate, test, predict, fit again.

Each sequence runs on 2 ranks at every stage and both engines, and its numbers are compared with the
same sequence in one process: Lightning's own ``BoringModel`` and the demo GPT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, loader, trainer_kwargs
from tests.test_manual_and_eval_multirank import eval_gpt

pytestmark = pytest.mark.multirank

STAGES = (0, 1, 2, 3)
KEYS = ("validate", "test", "test_after_second_fit", "test_from_last", "validate_step3", "test_after_resume")


class Boring(BoringModel):
    """BoringModel with data split across ranks in order, so 2 ranks x 2 samples = one process x 4."""

    def __init__(self) -> None:
        torch.manual_seed(7)  # the same weights and samples on every rank and in the reference
        super().__init__()
        self.data = RandomDataset(32, 32)

    def _loader(self) -> DataLoader:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if world == 1:
            return DataLoader(self.data, batch_size=4)
        sampler = DistributedSampler(self.data, world, torch.distributed.get_rank(), shuffle=False)
        return DataLoader(self.data, batch_size=4 // world, sampler=sampler)

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.step(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self.step(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _model(kind: str) -> L.LightningModule:
    return Boring() if kind == "boring" else eval_gpt()


def _data(kind: str, devices: int) -> dict[str, Any]:
    if kind == "boring":
        return {}
    return {"dataloaders": loader(8 // devices, n=32)}


def _sequence(kind: str, devices: int, strategy: Any, ckpt_dir: str) -> dict[str, Any]:
    """fit -> validate -> test -> predict -> fit again (continuing), then a fresh model tested from checkpoints."""
    out: dict[str, Any] = {}
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=3, save_top_k=-1)
    kwargs = trainer_kwargs(max_steps=3, enable_checkpointing=True, callbacks=[checkpoint])
    if kind == "boring":
        kwargs["use_distributed_sampler"] = False
    trainer = L.Trainer(devices=devices, strategy=strategy, **kwargs)
    model = _model(kind)
    train = {} if kind == "boring" else {"train_dataloaders": loader(8 // devices, n=32)}
    trainer.fit(model, **train)
    data = _data(kind, devices)
    out["validate"] = trainer.validate(model, verbose=False, **data)[0]
    out["test"] = trainer.test(model, verbose=False, **data)[0]
    predictions = trainer.predict(model, **data)
    out["predict"] = torch.cat([p if p.dim() > 1 else p[None] for p in predictions])  # type: ignore[union-attr]
    trainer.fit_loop.epoch_loop.max_steps = 6
    trainer.fit(model, **train)
    out["test_after_second_fit"] = trainer.test(model, verbose=False, **data)[0]
    fresh = L.Trainer(devices=devices, strategy=_same(strategy), **trainer_kwargs() | _sampler(kind))
    out["test_from_last"] = fresh.test(
        _model(kind), ckpt_path=str(Path(ckpt_dir) / "last.ckpt"), verbose=False, **data
    )[0]
    # An explicit path on a fresh model, then a fresh fit resumed from step 3 (continuing to step 6).
    step3 = str(Path(ckpt_dir) / "epoch=0-step=3.ckpt")
    out["validate_step3"] = fresh.validate(_model(kind), ckpt_path=step3, verbose=False, **data)[0]
    resumed = L.Trainer(
        devices=devices, strategy=_same(strategy), **trainer_kwargs(max_steps=6) | _sampler(kind)
    )
    model = _model(kind)
    resumed.fit(model, ckpt_path=step3, **train)
    out["test_after_resume"] = resumed.test(model, verbose=False, **data)[0]
    return out


def _same(strategy: Any) -> Any:
    return (
        strategy
        if isinstance(strategy, str)
        else ShardStrategy(stage=strategy.stage, engine=strategy.engine_name)
    )


def _sampler(kind: str) -> dict[str, Any]:
    return {"use_distributed_sampler": False} if kind == "boring" else {}


def _matrix(kind: str, engine: str, root: str) -> dict[int, dict[str, Any]]:
    # The GPT also runs with activation checkpointing: applied once, on the first call only.
    checkpointing = None if kind != "gpt" else ("selective" if engine == "fsdp" else "full")
    return {
        stage: _sequence(
            kind,
            2,
            ShardStrategy(stage=stage, engine=engine, activation_checkpointing=checkpointing),
            str(Path(root) / f"s{stage}"),
        )
        for stage in STAGES
    }


@pytest.mark.parametrize("kind", ["boring", "gpt"])
@pytest.mark.parametrize("engine", ENGINES)
def test_fit_validate_test_predict_fit_again_and_test_from_checkpoint(tmp_path, engine, kind):
    ranks = run_ranks(_matrix, kind, engine, str(tmp_path / "ranks"))
    reference = _sequence(kind, 1, "auto", str(tmp_path / "reference"))
    for stage in STAGES:
        for key in KEYS:
            for rank_result in ranks:
                got = rank_result[stage][key]
                assert set(got) == set(reference[key]), (stage, key)
                for name, value in reference[key].items():
                    torch.testing.assert_close(
                        got[name], value, rtol=1e-5, atol=0, msg=f"{engine} stage {stage} {key}"
                    )
        predictions = torch.stack([r[stage]["predict"] for r in ranks], dim=1).flatten(0, 1)
        torch.testing.assert_close(predictions, reference["predict"], rtol=1e-5, atol=1e-6)


def _checkpoint_modes(root: str) -> dict[str, dict[str, Any]]:
    modes = {"full": {"checkpoint": "full"}, "async": {"async_checkpoint": True}}
    return {
        f"{name} stage {stage}": _sequence(
            "boring", 2, ShardStrategy(stage=stage, **flags), str(Path(root) / f"{name}{stage}")
        )
        for name, flags in modes.items()
        for stage in (1, 3)
    }


def test_lifecycle_with_one_file_and_async_checkpoints(tmp_path):
    ranks = run_ranks(_checkpoint_modes, str(tmp_path / "ranks"))
    reference = _sequence("boring", 1, "auto", str(tmp_path / "reference"))
    for case in ranks[0]:
        for key in KEYS:
            for rank_result in ranks:
                for name, value in reference[key].items():
                    torch.testing.assert_close(
                        rank_result[case][key][name], value, rtol=1e-5, atol=0, msg=f"{case} {key}"
                    )
    assert (tmp_path / "ranks" / "full3" / "last.ckpt").is_file()
    assert not list((tmp_path / "ranks").rglob("*.tmp"))
