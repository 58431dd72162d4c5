"""16-mixed loss scaling with sharded gradients: an overflow on one rank skips the step on all."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_shard import ShardPrecision, ShardStrategy
from tests._dist import run_ranks
from tests.helpers import full_weights, loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank


class _OverflowOnRank1(L.Callback):
    """Makes rank 1's loss infinite at step 1, and snapshots the full weights around it."""

    def __init__(self) -> None:
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.scales: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.snapshots[batch_idx] = full_weights(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales.append(trainer.strategy.precision_plugin.scaler.get_scale())


def _fit_fp16(stage: int):
    callback = _OverflowOnRank1()
    module = tiny_gpt()
    original = module.training_step

    def training_step(batch, batch_idx):
        loss = original(batch, batch_idx)
        if batch_idx == 1 and dist.get_rank() == 1:
            loss = loss * float("inf")
        return loss

    module.training_step = training_step
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=stage),
        plugins=[ShardPrecision("16-mixed")],
        callbacks=[callback],
        **trainer_kwargs(max_steps=4),
    )
    trainer.fit(module, loader(4))
    return callback.snapshots, callback.scales


@pytest.mark.parametrize("stage", [1, 3])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(stage):
    results = run_ranks(_fit_fp16, stage)
    for snapshots, scales in results:
        for name, before in snapshots[1].items():
            torch.testing.assert_close(
                snapshots[2][name], before, rtol=0, atol=0, msg=f"{name} changed in the skipped step"
            )
        assert any((snapshots[3][n] != snapshots[2][n]).any() for n in snapshots[2]), "training did not go on"
        assert scales[1] == scales[0] / 2  # the scaler backed off once, on every rank
    assert results[0][1] == results[1][1]
