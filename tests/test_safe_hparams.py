"""Our checkpoints load under ``weights_only=True`` (Lightning's default) with the hyper-parameters users give:
a dataclass config, an enum, an ``AttributeDict``, a ``Namespace``, a path; resuming from them is exact, and
``load_from_checkpoint`` rebuilds the module with them. A class that could run code when rebuilt stays refused."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import CheckpointLoadError, ShardStrategy
from lightning_shard.checkpoint import _torch_files
from lightning_shard.demos import GPTModule
from tests.helpers import SEQ, VOCAB, loader, trainer_kwargs


@dataclasses.dataclass
class TrainConfig:
    d_model: int = 32
    lr: float = 0.5
    schedule: AttributeDict = dataclasses.field(default_factory=lambda: AttributeDict(warmup=0))


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


@dataclasses.dataclass
class Rebuilds:
    """Rebuilt through a method of its own, which could do anything: never allowed by default."""

    name: str = ""
    rebuilt: ClassVar[list[str]] = []

    def __setstate__(self, state: dict[str, Any]) -> None:
        Rebuilds.rebuilt.append(state["name"])  # copy.deepcopy comes here too: tests clear it first
        self.__dict__.update(state)


class ConfiguredGPT(GPTModule):
    def __init__(
        self,
        cfg: TrainConfig,
        mode: Mode = Mode.FAST,
        extra: AttributeDict | None = None,
        args: argparse.Namespace | None = None,
        out: Path = Path("runs"),
        other: Any = None,
    ) -> None:
        torch.manual_seed(0)
        super().__init__(vocab_size=VOCAB, seq_len=SEQ, d_model=cfg.d_model, n_layers=2, n_heads=2)
        self.save_hyperparameters()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.cfg.lr)


def _module(other: Any = None) -> ConfiguredGPT:
    return ConfiguredGPT(
        TrainConfig(),
        Mode.SLOW,
        AttributeDict(tags=AttributeDict(team="x")),
        argparse.Namespace(seed=3),
        Path("/tmp/out"),
        other,
    )


def _fit(steps: int, checkpoint: str, dirpath: Path | None = None, **fit: Any) -> ConfiguredGPT:
    module = _module()
    callbacks = [ModelCheckpoint(dirpath=dirpath, save_last=True)] if dirpath else []
    trainer = L.Trainer(
        devices=1,
        strategy=ShardStrategy(stage=3, checkpoint=checkpoint),
        callbacks=callbacks,
        **trainer_kwargs(max_steps=steps, enable_checkpointing=dirpath is not None),
    )
    trainer.fit(module, loader(4, n=8), **fit)  # an epoch of 2 steps: a resume at its end is exact
    return module


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _weights(module: L.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


@pytest.mark.parametrize("checkpoint", ["sharded", "full"])
def test_resume_and_load_from_checkpoint_with_weights_only_true(tmp_path: Path, checkpoint: str) -> None:
    reference = _weights(_fit(3, checkpoint))
    _fit(2, checkpoint, dirpath=tmp_path)
    last = tmp_path / "last.ckpt"
    # One step past the resume: as under DDPStrategy, a resume from an epoch-end checkpoint is exact there.
    resumed = _fit(3, checkpoint, ckpt_path=str(last), weights_only=True)
    for key, value in reference.items():
        assert torch.equal(_full(_weights(resumed)[key]), _full(value)), key

    loaded = ConfiguredGPT.load_from_checkpoint(last, weights_only=True)
    assert loaded.hparams.cfg == TrainConfig()
    assert loaded.hparams.mode is Mode.SLOW
    assert type(loaded.hparams.extra) is AttributeDict and loaded.hparams.extra.tags.team == "x"
    assert loaded.hparams.args.seed == 3 and loaded.hparams.out == Path("/tmp/out")
    two = _weights(_fit(2, checkpoint))
    assert all(torch.equal(_full(value), _full(two[key])) for key, value in _weights(loaded).items())


def test_a_class_with_its_own_setstate_stays_refused() -> None:
    module = _module(other=Rebuilds("planted"))
    buffer = io.BytesIO()
    _torch_files.save({"hyper_parameters": dict(module.hparams)}, buffer)
    buffer.seek(0)
    Rebuilds.rebuilt.clear()
    with pytest.raises(pickle.UnpicklingError, match="Rebuilds"):
        _torch_files.load(buffer, weights_only=None)
    assert Rebuilds.rebuilt == []
    buffer.seek(0)
    assert _torch_files.load(buffer, weights_only=False)["hyper_parameters"]["other"].name == "planted"
    assert Rebuilds.rebuilt == ["planted"]  # the opt-in runs it, as torch.load(weights_only=False) would


def test_resume_refuses_a_hyper_parameter_class_that_is_not_plain(tmp_path: Path) -> None:
    """Through the strategy: the refusal names the class and the opt-in; nothing ran."""
    module = _module(other=Rebuilds("planted"))
    trainer = L.Trainer(
        devices=1,
        strategy=ShardStrategy(stage=3),
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)],
        **trainer_kwargs(max_steps=1, enable_checkpointing=True),
    )
    trainer.fit(module, loader(4))
    trainer = L.Trainer(devices=1, strategy=ShardStrategy(stage=3), **trainer_kwargs(max_steps=2))
    with pytest.raises(CheckpointLoadError, match=r"Rebuilds.*weights_only=False"):
        Rebuilds.rebuilt.clear()
        trainer.fit(_module(), loader(4), ckpt_path=str(tmp_path / "last.ckpt"))
    assert Rebuilds.rebuilt == []


def _deepspeed_round_trip(root: str) -> tuple[bool, Any]:
    directory = Path(root)
    module = _module()
    L.Trainer(
        devices=1,
        strategy=ShardStrategy(stage=2, engine="deepspeed"),
        callbacks=[ModelCheckpoint(dirpath=directory, save_last=True)],
        **trainer_kwargs(max_steps=1, enable_checkpointing=True),
    ).fit(module, loader(4, n=8))
    trainer = L.Trainer(
        devices=1, strategy=ShardStrategy(stage=2, engine="deepspeed"), **trainer_kwargs(max_steps=2)
    )
    trainer.fit(_module(), loader(4, n=8), ckpt_path=str(directory / "last.ckpt"))  # weights_only=None
    loaded = ConfiguredGPT.load_from_checkpoint(directory / "last.ckpt")
    return trainer.global_step == 2, loaded.hparams.cfg


@pytest.mark.deepspeed
@pytest.mark.multirank
def test_deepspeed_checkpoints_with_dataclass_hyper_parameters_resume_safely(tmp_path: Path) -> None:
    """DeepSpeed unpickles its files itself: the scan before it allows the same harmless classes."""
    from lightning_shard.demos.ranks import run_ranks

    resumed, cfg = run_ranks(_deepspeed_round_trip, str(tmp_path), world_size=1)[0]
    assert resumed and cfg == TrainConfig()
