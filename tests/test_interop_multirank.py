"""Checkpoints written by Lightning's own strategies resume under ShardStrategy exactly as those strategies
resume them, and load with ``load_from_checkpoint``: ``DDPStrategy``'s one file and ``ModelParallelStrategy``'s
FSDP2 DCP directory, at stages 1 and 3 (SGD, the same data order)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import VOCAB, LossRecorder, loader, trainer_kwargs

pytestmark = pytest.mark.multirank


class SGDGPT(GPTModule):
    """The tiny GPT with plain SGD; FSDP2 applied by hand in ``configure_model`` under ModelParallelStrategy,
    as Lightning asks of that strategy's users."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(
            vocab_size=VOCAB, seq_len=16, d_model=32, n_layers=2, n_heads=2, lr=0.5, max_steps=50
        )

    def configure_model(self) -> None:
        from lightning.pytorch.strategies import ModelParallelStrategy

        trainer = self._trainer  # none in load_from_checkpoint, which calls this hook too
        if trainer is None or not isinstance(trainer.strategy, ModelParallelStrategy):
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(strategy: Any, steps: int, save: Path | None = None, resume: str | None = None) -> list[float]:
    recorder = LossRecorder()
    callbacks: list[Any] = [recorder]
    if save is not None:
        callbacks.append(ModelCheckpoint(dirpath=save, save_last=True))
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        callbacks=callbacks,
        **trainer_kwargs(max_steps=steps, enable_checkpointing=save is not None),
    )
    trainer.fit(SGDGPT(), loader(4), ckpt_path=resume)
    return recorder.losses


def _job(root: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    anchors = {
        "ddp": lambda: DDPStrategy(),
        "model_parallel": lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    }
    out: dict[str, Any] = {}
    for name, make in anchors.items():
        path = Path(root) / name
        _fit(make(), steps=2, save=path)
        last = str(path / "last.ckpt")
        out[name, "own"] = _fit(make(), steps=4, resume=last)  # the anchor resuming its own checkpoint
        for stage in (1, 3):
            out[name, f"stage{stage}"] = _fit(ShardStrategy(stage=stage), steps=4, resume=last)
    return out


def test_lightning_strategies_checkpoints_resume_and_load_as_their_own(tmp_path):
    out = run_ranks(_job, str(tmp_path))[0]
    for anchor in ("ddp", "model_parallel"):
        own = out[anchor, "own"]
        assert len(own) == 2  # steps 3 and 4, after the checkpoint at step 2
        for stage in (1, 3):
            torch.testing.assert_close(out[anchor, f"stage{stage}"], own, rtol=1e-5, atol=0)
    # One process, no process group: the file and the directory load with Lightning's own classmethod.
    from_file = SGDGPT.load_from_checkpoint(tmp_path / "ddp" / "last.ckpt")
    saved = torch.load(tmp_path / "ddp" / "last.ckpt", weights_only=True)["state_dict"]
    from_directory = SGDGPT.load_from_checkpoint(tmp_path / "model_parallel" / "last.ckpt")
    assert from_directory.hparams == from_file.hparams
    for name, value in from_file.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)
        # Both anchors trained the same 2 steps from the same seed: the same weights, up to reduction order.
        torch.testing.assert_close(from_directory.state_dict()[name], value, rtol=1e-5, atol=1e-6)
