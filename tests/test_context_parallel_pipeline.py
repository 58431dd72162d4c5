"""Context parallelism with pipeline stages, and ``predict`` under context parallelism, against one process.

One 4-rank job: the demo GPT (its head tied to the embedding: a copy on each stage) in 2 stages x 2
context-parallel ranks, plain SGD (gradient-scale sensitive) and AdamW, 3 steps of accumulation 2, clipping
on. The last 3 targets of every row are -100 (padding), so the two ranks of a group hold 5 and 8 targets
per row: unweighted, the mean of their means is not the sequences' mean. Then ``validate`` and ``predict``
through the stages, and ``predict`` under 2 context-parallel x 2 data-parallel ranks without stages: each
rank's logits for the whole sequences.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.context_parallel import chunk_positions
from lightning_shard.context_parallel.batch import target_weight
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import SEQ, LossRecorder, full_weights, tiny_gpt, token_dataset, trainer_kwargs
from tests.test_parity_multirank import CLIP, SGD_LR

pytestmark = pytest.mark.multirank

PADDED = 3  # targets at the end of every row left out of the loss
PREDICTED = 2  # batches of 8 rows validated and predicted


class Gpt(GPTModule):
    """The tests' tiny GPT with SGD or AdamW, its loss the pipeline's, evaluation and predict steps."""

    def __init__(self, optimizer: str) -> None:
        hparams = dict(tiny_gpt().hparams)  # the helpers' sizes
        torch.manual_seed(0)
        super().__init__(**hparams)
        self.optimizer_name = optimizer

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=SGD_LR)
        return super().configure_optimizers()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def _data(replicas: int = 1, rank: int = 0) -> DataLoader:
    """8 rows a batch for each of ``replicas`` data-parallel ranks, in order; targets padded at the end."""
    x, y = token_dataset(64).tensors
    y = y.clone()
    y[:, -PADDED:] = -100
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=False)
    return DataLoader(dataset, batch_size=8 // replicas, sampler=sampler)


class Seen(L.Callback):
    """What reached this rank's modules: the tokens and positions of the token embedding (first stage) and
    the sequence length of the hidden states entering this stage's blocks."""

    def __init__(self) -> None:
        self.tokens: set[int] = set()
        self.positions: set[tuple[int, ...]] = set()
        self.hidden: set[int] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        gpt = pl_module.model  # type: ignore[attr-defined]
        if gpt.tok_emb is not None:
            gpt.tok_emb.register_forward_pre_hook(lambda _, args: self.tokens.add(args[0].size(1)))
            gpt.pos_emb.register_forward_pre_hook(
                lambda _, args: self.positions.add(tuple(args[0].flatten().tolist()))
            )
        for block in gpt.blocks:
            block.register_forward_pre_hook(lambda _, args: self.hidden.add(args[0].size(1)))


def _fit(optimizer: str, world: int, evaluate: bool = False, **flags: Any) -> dict[str, Any]:
    recorder, seen = LossRecorder(), Seen()
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(**flags) if world > 1 else "auto",
        callbacks=[recorder, seen],
        **trainer_kwargs(
            max_steps=3,
            accumulate_grad_batches=2,
            gradient_clip_val=CLIP,
            gradient_clip_algorithm="norm",
            limit_val_batches=PREDICTED,
            limit_predict_batches=PREDICTED,
        ),
    )
    model = Gpt(optimizer)
    trainer.fit(model, _data())
    out: dict[str, Any] = {
        "losses": recorder.losses,
        "logged": float(trainer.callback_metrics["train_loss"]),
        "seen": (seen.tokens, seen.positions, seen.hidden),
    }
    if evaluate:
        out["weights"] = full_weights(trainer)
        out["val_loss"] = trainer.validate(model, _data(), verbose=False)[0]["val_loss"]
        out["logits"] = torch.cat(trainer.predict(model, _data()))  # type: ignore[arg-type]
    return out


def _predict(world: int, **flags: Any) -> torch.Tensor:
    """A fresh model's logits for this rank's rows (``world / 2`` context-parallel pairs read their own)."""
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(**flags) if world > 1 else "auto",
        **trainer_kwargs(limit_predict_batches=PREDICTED),
    )
    replicas = max(world // 2, 1)
    rank = int(os.environ.get("RANK", 0)) // 2 if world > 1 else 0
    return torch.cat(trainer.predict(Gpt("sgd"), _data(replicas, rank)))  # type: ignore[arg-type]


def _four_ranks() -> dict[str, Any]:
    stages = dict(pipeline_parallel_size=2, context_parallel_size=2, microbatches=2)
    return {
        "sgd": _fit("sgd", 4, evaluate=True, stage=3, **stages),
        "adamw": _fit("adamw", 4, stage=0, context_parallel_method="ulysses", **stages),
        "predict cp2 x dp2": _predict(4, stage=3, context_parallel_size=2),
    }


def _close(actual: Any, expected: Any, name: str, atol: float = 0.0) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def test_pipeline_stages_with_context_parallelism_and_predict_follow_one_process():
    results = run_ranks(_four_ranks, world_size=4)
    first, second = results[0], results[2]  # rank 0: stage 0, cp rank 0; rank 2: stage 1, cp rank 0
    expected = {"sgd": _fit("sgd", 1, evaluate=True), "adamw": _fit("adamw", 1)}
    for optimizer, reference in expected.items():
        name = f"pp2 x cp2 {optimizer}"
        assert len(reference["losses"]) == 6
        _close(first[optimizer]["losses"], reference["losses"], name)
        # every rank logs the loss of the whole sequences, as one process does
        _close(first[optimizer]["logged"], reference["logged"], f"{name} train_loss")
        # the cut acted on both stages: half the tokens, the first rank's head and tail chunks' positions
        tokens, positions, hidden = first[optimizer]["seen"]
        assert tokens == {SEQ // 2} and hidden == {SEQ // 2}, first[optimizer]["seen"]
        assert positions == {tuple(chunk_positions(SEQ, 2, 0).tolist())}, positions
        assert second[optimizer]["seen"] == (set(), set(), {SEQ // 2}), second[optimizer]["seen"]
    sgd, reference = first["sgd"], expected["sgd"]
    weights = {**sgd["weights"], **second["sgd"]["weights"]}  # each stage's own: together, the whole model
    assert sorted(weights) == sorted(reference["weights"])
    for key, value in reference["weights"].items():
        _close(weights[key], value, f"pp2 x cp2 sgd weight {key}", atol=1e-6)
    _close(sgd["val_loss"], reference["val_loss"], "pp2 x cp2 val_loss")
    # logits near 0: float rounding of a few 1e-8 (a permuted chunk would differ by ~0.1)
    _close(sgd["logits"], reference["logits"][: 8 * PREDICTED], "pp2 x cp2 predict", atol=1e-6)
    # without stages: each data-parallel pair's rows (rank 2 reads the odd ones), whole sequences
    fresh = _predict(1)
    for rank in (0, 2):
        actual = results[rank]["predict cp2 x dp2"]
        _close(actual, fresh[rank // 2 :: 2], f"cp2 x dp2 predict, rank {rank}", atol=1e-6)


def test_the_target_weight_is_the_ranks_share_of_the_targets():
    target = torch.arange(16)[None].repeat(2, 1)
    target[:, -PADDED:] = -100
    cut = target.index_select(1, chunk_positions(SEQ, 2, 0))  # 5 targets a row of the group's 13
    assert target_weight(target, cut, 2) == pytest.approx(2 * 5 / 13)
    assert target_weight(target.float(), cut.float(), 2) == 1.0  # a regression target: every entry counts
    assert target_weight(target[:, 0], target[:, 0], 2) == 1.0  # no sequence dimension: not cut
    assert target_weight(None, None, 2) == 1.0
