"""Sharded checkpoints written with pipeline stages resume on another layout, and the other way round.

A run of 8 steps saves at step 4 (an epoch boundary: 32 samples in global batches of 8); resuming that
checkpoint on another layout must give the uninterrupted run's last 4 losses. SGD shows that every
group's hyperparameters reach every stage's parameters; AdamW (decay and no-decay groups, a cosine
schedule) that each parameter gets its own moments back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.parallel import MeshLayout
from tests.helpers import LossRecorder, token_dataset, trainer_kwargs
from tests.test_pipeline_multirank import _model

pytestmark = pytest.mark.multirank

N = 32  # 4 global batches of 8: the checkpoint at step 4 sits at an epoch boundary
BATCH = 8
STEPS = 8
# 4 blocks: each stage of PP2 x TP2 needs two for the sequence-parallel plan
LAYERS = 4

PP2_DP2 = dict(stage=3, pipeline_parallel_size=2, microbatches=2)
DP4 = dict(stage=3)
PP2_TP2 = dict(stage=3, pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2)


def _loader(flags: dict[str, Any]) -> DataLoader:
    """In order; the ranks of one pipeline and of one tensor-parallel group read the same batches."""
    layout = MeshLayout.for_world(
        4,
        tensor_parallel_size=flags.get("tensor_parallel_size", 1),
        pipeline_parallel_size=flags.get("pipeline_parallel_size", 1),
    )
    dataset = token_dataset(N)
    dp = layout.data_parallel_size
    rank = layout.data_parallel_rank(int(os.environ["RANK"]))
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=BATCH // dp, sampler=sampler)


def _fit(optimizer: str, flags: dict[str, Any], ckpt_dir: str | None = None, resume: str | None = None):
    recorder = LossRecorder()
    callbacks: list[L.Callback] = [recorder]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1))
    trainer = L.Trainer(
        devices=4,
        strategy=ShardStrategy(**flags),
        callbacks=callbacks,
        **trainer_kwargs(max_steps=STEPS, enable_checkpointing=ckpt_dir is not None),
    )
    trainer.fit(_model(optimizer, LAYERS), _loader(flags), ckpt_path=resume)
    return recorder.losses


def _across_layouts(optimizer: str, root: str) -> dict[str, tuple[list[float], list[float]]]:
    """(uninterrupted, resumed) losses: a PP2 x DP2 checkpoint resumed at DP4 and PP2 x TP2, and a DP4
    checkpoint resumed at PP2 x DP2."""
    pp_dir, dp_dir = str(Path(root) / "pp2_dp2"), str(Path(root) / "dp4")
    step4 = "epoch=0-step=4.ckpt"
    pp_losses = _fit(optimizer, PP2_DP2, ckpt_dir=pp_dir)
    dp_losses = _fit(optimizer, DP4, ckpt_dir=dp_dir)
    return {
        "pp2 x dp2 -> dp4": (pp_losses, _fit(optimizer, DP4, resume=str(Path(pp_dir) / step4))),
        "pp2 x dp2 -> pp2 x tp2": (pp_losses, _fit(optimizer, PP2_TP2, resume=str(Path(pp_dir) / step4))),
        "dp4 -> pp2 x dp2": (dp_losses, _fit(optimizer, PP2_DP2, resume=str(Path(dp_dir) / step4))),
    }


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_pipeline_checkpoint_resumes_on_another_layout(tmp_path, optimizer):
    results = run_ranks(_across_layouts, optimizer, str(tmp_path), world_size=4)
    for rank in results:
        for name, (uninterrupted, resumed) in rank.items():
            assert len(uninterrupted) == STEPS and len(resumed) == STEPS - 4, name
            torch.testing.assert_close(
                resumed,
                uninterrupted[4:],
                rtol=1e-5,
                atol=0,
                msg=lambda m, name=name: f"{optimizer} {name}: {m}",
            )
