"""A mid-epoch resume reads the rows the uninterrupted run reads: 2 CPU ranks, the training loader a plain
``DataLoader(shuffle=True)`` into which the strategy has Lightning inject its ``DistributedSampler``.

Each fit records the rows every rank reads at each step. A run stopped by a checkpoint written mid-epoch and
resumed with ``fit(ckpt_path=...)`` reads, from the checkpoint's step on, exactly the rows of one uninterrupted
run (epoch 0's rest, then epoch 1 with its own shuffle), and ends with its weights (plain SGD, so a step on
other rows shows). Stages 0 and 2 without accumulation (checkpoint after step 5), stages 1 and 3 with
``accumulate_grad_batches=2`` (checkpoint after step 3: batch 6 of 16). Under Lightning's ``DDPStrategy`` the
same resume starts the epoch again (Lightning's documented behaviour for a loader without state): the rows
differ, side by side, which is what the sampler fixes. A ``StatefulDataLoader`` (torchdata) is left as Lightning
made it and restored by Lightning from its own state: its resume reads what it reads under ``DDPStrategy``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_shard.core.sampler import ResumableDistributedSampler
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import full_weights, tiny_gpt, token_dataset, trainer_kwargs

pytestmark = pytest.mark.multirank

BATCHES = 16  # per rank and epoch: 64 rows, 2 ranks, batch 2
CASES = {  # name: (strategy, accumulate_grad_batches, the step of the mid-epoch checkpoint)
    "stage0": ("stage0", 1, 5),
    "stage1_accumulate": ("stage1", 2, 3),
    "stage2": ("stage2", 1, 5),
    "stage3_accumulate": ("stage3", 2, 3),
    "ddp": ("ddp", 1, 5),
    # torchdata's StatefulDataLoader: left to Lightning, which restores it from its own state, as under DDPStrategy
    "stateful": ("stage3", 1, 5),
    "stateful_ddp": ("ddp", 1, 5),
}


class Rows(L.Callback):
    """The rows this rank reads at each batch (each row's first 8 tokens: the data set's rows differ there)."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: Any, batch: Any, batch_idx: int) -> None:
        self.rows.append([str(row[:8].tolist()) for row in batch[0]])


def _strategy(name: str) -> Any:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_shard import ShardStrategy

    return DDPStrategy() if name == "ddp" else ShardStrategy(stage=int(name[-1]))


def _module() -> Any:
    module = tiny_gpt(lr=0.5, dropout=0.0)
    module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.5)  # type: ignore[method-assign]
    return module


def _fit(name: str, root: Path, steps: int, resume: Path | None = None) -> tuple[list[list[str]], Any]:
    strategy, accumulate, every = CASES[name]
    rows = Rows()
    callbacks: list[L.Callback] = [rows]
    if resume is None:
        callbacks.append(ModelCheckpoint(root / name, "{step}", every_n_train_steps=every, save_top_k=-1))
    trainer = L.Trainer(
        devices=2,
        strategy=_strategy(strategy),
        callbacks=callbacks,
        **trainer_kwargs(
            max_steps=steps,
            accumulate_grad_batches=accumulate,
            use_distributed_sampler=True,
            enable_checkpointing=resume is None,
        ),
    )
    loader_class = DataLoader
    if name.startswith("stateful"):
        from torchdata.stateful_dataloader import StatefulDataLoader as loader_class
    data = loader_class(token_dataset(64), batch_size=2, shuffle=True)
    trainer.fit(_module(), data, ckpt_path=resume)
    sampler = trainer.train_dataloader.sampler
    # ours where Lightning injected a plain DistributedSampler; the stateful loader's left as Lightning made it
    assert isinstance(sampler, ResumableDistributedSampler) == (
        strategy != "ddp" and loader_class is DataLoader
    )
    return rows.rows, full_weights(trainer)


def _runs(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (_, accumulate, every) in CASES.items():
        steps = (2 * BATCHES) // accumulate  # two epochs
        out[name] = {"whole": _fit(name, Path(root) / "whole", steps)}
        # The same run stopped at the checkpoint's step (the files of the whole run are the ones resumed).
        checkpoint = Path(root) / "whole" / name / f"step={every}.ckpt"
        out[name]["resumed"] = _fit(name, Path(root) / "resumed", steps, resume=checkpoint)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_runs, str(tmp_path_factory.mktemp("data_position")))


@pytest.mark.parametrize("name", ["stage0", "stage1_accumulate", "stage2", "stage3_accumulate"])
def test_a_mid_epoch_resume_reads_the_rows_of_the_uninterrupted_run(runs, name):
    _, accumulate, every = CASES[name]
    taken = every * accumulate  # batches of epoch 0 read before the checkpoint
    for rank, result in enumerate(runs):
        whole_rows, whole_weights = result[name]["whole"]
        rows, weights = result[name]["resumed"]
        assert len(whole_rows) == 2 * BATCHES
        assert rows == whole_rows[taken:], f"rank {rank}: the resumed run read other rows"
        for key, value in whole_weights.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-7, msg=key)
    # in each epoch the ranks read disjoint halves of the 64 rows, and epoch 1 is another shuffle than epoch 0
    first, second = runs[0][name]["whole"][0], runs[1][name]["whole"][0]
    for epoch in (slice(0, BATCHES), slice(BATCHES, None)):
        mine, theirs = {r for b in first[epoch] for r in b}, {r for b in second[epoch] for r in b}
        assert len(mine) == len(theirs) == 32 and not mine & theirs
    assert first[:BATCHES] != first[BATCHES:]


def test_lightnings_ddp_strategy_starts_the_epoch_again_on_the_same_resume(runs):
    """The contrast, side by side: the rows (and so the weights) of DDPStrategy's resume are not the whole
    run's (Lightning warns of it)."""
    for result in runs:
        whole_rows, _ = result["ddp"]["whole"]
        rows, _ = result["ddp"]["resumed"]
        assert rows[: BATCHES - 5] == whole_rows[: BATCHES - 5]  # epoch 0 read again from its first batch
        assert rows != whole_rows[5:]


def test_a_stateful_loader_is_left_to_lightning_and_resumes_as_under_ddp_strategy(runs):
    """No second skip on top of the loader's own: the resumed rows and weights are DDPStrategy's."""
    for result in runs:
        rows, weights = result["stateful"]["resumed"]
        ddp_rows, ddp_weights = result["stateful_ddp"]["resumed"]
        assert rows == ddp_rows
        for key, value in ddp_weights.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)
