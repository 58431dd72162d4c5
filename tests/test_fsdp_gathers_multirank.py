"""How many all-gathers a training step makes at stages 2 and 3 (2 gloo ranks): the root's parameters
once per step, also when ``training_step`` calls ``self(x)`` inside the root's forward."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import loader, tiny_gpt, trainer_kwargs

N_LAYERS = 3


class GatherCounter(L.Callback):
    """All-gathers between the start and the end of each training batch: gloo's, or through shared memory."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._count = 0
        self._original: Any = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        from lightning_shard.engines._shm import SharedMemoryGroup

        self._original = (dist.all_gather_single, SharedMemoryGroup.all_gather)

        def counting(original: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                self._count += 1
                return original(*args, **kwargs)

            return call

        dist.all_gather_single = counting(self._original[0])
        SharedMemoryGroup.all_gather = counting(self._original[1])  # type: ignore[method-assign]

    def on_train_batch_start(self, *args: Any) -> None:
        self._count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.per_step.append(self._count)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import torch.distributed as dist

        from lightning_shard.engines._shm import SharedMemoryGroup

        dist.all_gather_single, SharedMemoryGroup.all_gather = self._original


class ModelCall(L.LightningModule):
    """The same GPT, its step calling the inner model (no nested root forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_gpt(n_layers=N_LAYERS)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.inner.pipeline_loss(self.inner.model(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _job(stage: int) -> dict[str, Any]:
    out = {}
    for name, make in {"self_call": lambda: tiny_gpt(n_layers=N_LAYERS), "model_call": ModelCall}.items():
        counter = GatherCounter()
        trainer = L.Trainer(
            devices=2, strategy=ShardStrategy(stage=stage), callbacks=[counter], **trainer_kwargs(max_steps=4)
        )
        trainer.fit(make(), loader(4))
        out[name] = counter.per_step
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[int, list[dict[str, Any]]]:
    return {stage: run_ranks(_job, stage) for stage in (2, 3)}


@pytest.mark.parametrize("stage", [2, 3])
def test_the_root_is_gathered_once_per_step(ranks, stage):
    # Stage 2 packs the small blocks into one unit gathered from forward to backward; stage 3 gathers
    # each block in forward and again in backward. Either way the root (embeddings, head) once.
    blocks = 1 if stage == 2 else 2 * N_LAYERS
    for out in ranks[stage]:
        assert out["self_call"] == [blocks + 1] * 4
        assert out["model_call"] == [blocks + 1] * 4
