"""Gradient-scale-sensitive parity: every stage, both engines, against one process.

AdamW is invariant to a constant gradient scale (a gradient 2x too big moves its losses by ~1e-6),
so it cannot see a wrong loss normalisation or a clip at the wrong norm. Plain SGD without
momentum at a large learning rate can: on the tiny GPT a 2x gradient moves six steps of loss by
about 1%, far outside rtol 1e-5. Every configuration here runs with SGD; AdamW stays for the
optimizer-state paths (ZeRO-1 partitions, sharded moments).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, LossRecorder, loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

STAGES = (0, 1, 2, 3)
# The reference's gradient norms are 1.06, 0.53 (accumulation 1) and 0.75, 0.33 (accumulation 2) on the
# steps the losses see: a clip at 0.6 cuts some steps and not others, so a 2x gradient (which a clip
# below every norm would hide) and a clip at the wrong value both move the losses.
CLIP = 0.6
SGD_LR = 0.5
# (accumulate_grad_batches, gradient_clip_val): optimizer steps are fixed at 3, so accumulation 2 runs 6 batches.
SCHEDULES = [(1, None), (1, CLIP), (2, None), (2, CLIP)]


def sgd_gpt(**overrides: Any) -> L.LightningModule:
    """The tiny GPT trained with plain SGD (no momentum, no schedule): every update is lr x gradient."""
    model = tiny_gpt(**overrides)

    def configure_optimizers() -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=SGD_LR)

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return model


def _model(optimizer: str) -> L.LightningModule:
    return sgd_gpt() if optimizer == "sgd" else tiny_gpt()


def _run(devices: int, strategy: Any, optimizer: str, accumulate: int, clip: float | None) -> list[float]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=devices,
        strategy=strategy,
        callbacks=[recorder],
        **trainer_kwargs(
            max_steps=3,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=clip,
            gradient_clip_algorithm="norm",
        ),
    )
    trainer.fit(_model(optimizer), loader(8 // devices))
    return recorder.losses


def reference(optimizer: str, accumulate: int, clip: float | None) -> list[float]:
    return _run(1, "auto", optimizer, accumulate, clip)


def _fit_matrix(engine: str, optimizer: str, schedules: list[tuple[int, float | None]]) -> dict:
    return {
        (stage, accumulate, clip): _run(
            2, ShardStrategy(stage=stage, engine=engine), optimizer, accumulate, clip
        )
        for stage in STAGES
        for accumulate, clip in schedules
    }


def _check(results: dict, optimizer: str, engine: str) -> None:
    refs = {}
    for (stage, accumulate, clip), losses in results.items():
        if (accumulate, clip) not in refs:
            refs[accumulate, clip] = reference(optimizer, accumulate, clip)
        expected = refs[accumulate, clip]
        assert len(expected) == 3 * accumulate
        torch.testing.assert_close(
            losses,
            expected,
            rtol=1e-5,
            atol=0,
            msg=lambda m, s=stage, a=accumulate, c=clip: (
                f"{engine} stage {s}, {optimizer}, accumulate {a}, clip {c}: {m}"
            ),
        )


@pytest.mark.parametrize("engine", ENGINES)
def test_sgd_parity_every_stage_accumulation_and_clipping(engine):
    results = run_ranks(_fit_matrix, engine, "sgd", SCHEDULES)[0]
    _check(results, "sgd", engine)


@pytest.mark.parametrize("engine", ENGINES)
def test_adamw_parity_every_stage_with_accumulation_and_clipping(engine):
    results = run_ranks(_fit_matrix, engine, "adamw", [(2, CLIP)])[0]
    _check(results, "adamw", engine)


def _fit_cpu_offload() -> dict:
    strategy = {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}
    return {
        (optimizer, accumulate, clip): _run(2, ShardStrategy(**strategy), optimizer, accumulate, clip)
        for optimizer in ("sgd", "adamw")
        for accumulate, clip in [(1, None), (2, CLIP)]
    }


def test_fsdp_cpu_offload_parity():
    for (optimizer, accumulate, clip), losses in run_ranks(_fit_cpu_offload)[0].items():
        expected = reference(optimizer, accumulate, clip)
        assert len(losses) == len(expected) == 3 * accumulate
        torch.testing.assert_close(
            losses, expected, rtol=1e-5, atol=0, msg=lambda m, o=optimizer: f"cpu offload {o}: {m}"
        )
