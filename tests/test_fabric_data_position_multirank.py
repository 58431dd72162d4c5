"""A Fabric loop resumed mid-epoch reads the rows the uninterrupted loop reads: 2 CPU ranks, a plain
``DataLoader(shuffle=True)`` through ``fabric.setup_dataloaders`` (Fabric injects its ``DistributedSampler``).

Per stage, three Fabrics on the same ranks: one runs two epochs uninterrupted; one stops after 5 batches of
epoch 0 and ``fabric.save``s model, optimizer, epoch and batch; a fresh one ``fabric.load``s that, calls
``fabric.strategy.resume_dataloader(loader, epoch, batch)`` and runs the usual loop to the end. From batch 5
on it reads exactly the uninterrupted rows (epoch 0's rest, then epoch 1 with its own shuffle) and ends with
its weights (plain SGD: a step on other rows shows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_shard import ShardFabricStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import full_model_weights, tiny_gpt, token_dataset

pytestmark = pytest.mark.multirank

BATCHES = 16  # per rank and epoch: 64 rows, 2 ranks, batch 2
EPOCHS = 2
STOP = 5  # batches of epoch 0 the interrupted run takes before it saves
STAGES = (0, 3)


def _setup(stage: int) -> tuple[L.Fabric, Any, Any, Any]:
    """A fresh Fabric (one model per Fabric; the ranks' process group is shared), the tiny GPT, SGD, loader."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardFabricStrategy(stage=stage))
    fabric.launch()
    model = tiny_gpt(dropout=0.0)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    loader = fabric.setup_dataloaders(DataLoader(token_dataset(64), batch_size=2, shuffle=True))
    return fabric, model, optimizer, loader


def _step(fabric: L.Fabric, model: Any, optimizer: Any, batch: Any, rows: list[list[str]]) -> None:
    x, y = batch
    rows.append([str(row[:8].tolist()) for row in x])  # each row's first 8 tokens: the rows differ there
    logits = model(x)
    fabric.backward(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)))
    optimizer.step()
    optimizer.zero_grad()


def _run(stage: int, path: Path, resume: bool = False, stop: int | None = None) -> dict[str, Any]:
    """Two epochs from the start (``stop``: save after that many batches of epoch 0 and leave), or from the
    state saved at ``path`` (``resume``)."""
    fabric, model, optimizer, loader = _setup(stage)
    state = {"model": model, "optimizer": optimizer, "epoch": 0, "batch": 0}
    if resume:
        fabric.load(path, state)
        fabric.strategy.resume_dataloader(loader, epoch=state["epoch"], batch=state["batch"])
    rows: list[list[str]] = []
    for epoch in range(state["epoch"], EPOCHS):
        for batch in loader:
            _step(fabric, model, optimizer, batch, rows)
            if stop is not None and len(rows) == stop:
                fabric.save(path, {**state, "epoch": epoch, "batch": len(rows)})
                return {"rows": rows}
    sampler = loader._dataloader.sampler
    return {
        "rows": rows,
        "weights": full_model_weights(fabric.strategy._model),
        "resumed": list(sampler.resumed),
        "sampler": type(sampler).__name__,
    }


def _job(root: str) -> dict[int, dict[str, Any]]:
    out = {}
    for stage in STAGES:
        path = Path(root) / f"stage{stage}.ckpt"
        out[stage] = {
            "whole": _run(stage, path),
            "stopped": _run(stage, path, stop=STOP),
            "resumed": _run(stage, path, resume=True),
        }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    return run_ranks(_job, str(tmp_path_factory.mktemp("fabric_data_position")))


@pytest.mark.parametrize("stage", STAGES)
def test_a_fabric_loop_resumed_mid_epoch_reads_the_rows_of_the_uninterrupted_loop(runs, stage):
    for rank, result in enumerate(runs):
        whole, stopped, resumed = (result[stage][run] for run in ("whole", "stopped", "resumed"))
        assert whole["sampler"] == "ResumableDistributedSampler"
        assert len(whole["rows"]) == EPOCHS * BATCHES and whole["resumed"] == []
        assert stopped["rows"] == whole["rows"][:STOP]
        assert resumed["rows"] == whole["rows"][STOP:], f"rank {rank}: the resumed loop read other rows"
        assert resumed["resumed"] == [(0, STOP)]  # the sampler skipped the batches taken, once
        assert resumed["weights"].keys() == whole["weights"].keys()
        for key, value in whole["weights"].items():
            torch.testing.assert_close(resumed["weights"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    # in each epoch the ranks read disjoint halves of the 64 rows, and epoch 1 is another shuffle than epoch 0
    first, second = runs[0][stage]["whole"]["rows"], runs[1][stage]["whole"]["rows"]
    for epoch in (slice(0, BATCHES), slice(BATCHES, None)):
        mine, theirs = {r for b in first[epoch] for r in b}, {r for b in second[epoch] for r in b}
        assert len(mine) == len(theirs) == 32 and not mine & theirs
    assert first[:BATCHES] != first[BATCHES:]
