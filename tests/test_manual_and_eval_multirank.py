"""Manual optimization and validate / test / predict at every stage, both engines, against one process."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, LossRecorder, loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

STAGES = (0, 1, 2, 3)


# --- manual optimization --------------------------------------------------------------------------


def manual_gpt(accumulate: int, clip: float | None) -> L.LightningModule:
    """The tiny GPT with ``automatic_optimization=False``: SGD, ``manual_backward``, ``clip_gradients``."""
    model = tiny_gpt()
    model.automatic_optimization = False

    def configure_optimizers() -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.5)

    def training_step(batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = model.optimizers()
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        model.manual_backward(loss / accumulate)
        if (batch_idx + 1) % accumulate == 0:
            if clip is not None:
                model.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
        return loss

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    model.training_step = training_step  # type: ignore[method-assign]
    return model


def _fit_manual(devices: int, strategy: Any, accumulate: int, clip: float | None) -> list[float] | str:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=devices, strategy=strategy, callbacks=[recorder], **trainer_kwargs(max_steps=3)
    )
    try:
        trainer.fit(manual_gpt(accumulate, clip), loader(8 // devices))
    except ValueError as err:
        return str(err)
    return recorder.losses


MANUAL_CASES = [(1, None), (2, None), (1, 0.6), (2, 0.6)]


def _manual_matrix(engine: str) -> dict:
    return {
        (stage, accumulate, clip): _fit_manual(2, ShardStrategy(stage=stage, engine=engine), accumulate, clip)
        for stage in STAGES
        for accumulate, clip in MANUAL_CASES
    }


@pytest.mark.parametrize("engine", ENGINES)
def test_manual_optimization_every_stage(engine):
    results = run_ranks(_manual_matrix, engine)[0]
    references = {case: _fit_manual(1, "auto", *case) for case in MANUAL_CASES}
    for (stage, accumulate, clip), got in results.items():
        where = f"{engine} stage {stage}, accumulate {accumulate}, clip {clip}"
        if engine == "deepspeed" and accumulate > 1 and stage in (1, 2):
            assert isinstance(got, str), where
            assert f"ShardStrategy(stage={stage}, engine='deepspeed') cannot accumulate" in got, got
            assert (
                "self.manual_backward() in manual optimization" in got
                and "Call step() after every backward" in got
            ), got
            continue
        if engine == "deepspeed" and clip is not None:
            assert isinstance(got, str), where
            assert "self.clip_gradients(gradient_clip_val=0.6) is not available" in got, got
            assert "engine='fsdp'" in got, got
            continue
        assert not isinstance(got, str), f"{where}: {got}"
        expected = references[accumulate, clip]
        assert len(got) == len(expected) == 3 * accumulate, where
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0, msg=lambda m, w=where: f"{w}: {m}")


# --- validate / test / predict --------------------------------------------------------------------


def eval_gpt() -> L.LightningModule:
    """The tiny GPT with validation, test and predict steps; metrics reduced across ranks."""
    model = tiny_gpt()

    def _losses(batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        per_token = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none")
        return per_token.view(x.shape).mean(1)  # (batch,)

    def validation_step(batch: Any, batch_idx: int) -> None:
        model.log("val_loss", _losses(batch).mean(), sync_dist=True)

    def test_step(batch: Any, batch_idx: int) -> None:
        losses = _losses(batch)
        model.log("test_loss", losses.mean(), sync_dist=True)
        # A per-sample maximum, reduced by max across ranks: the same whatever the batch split.
        model.log("test_loss_max", losses.max(), sync_dist=True, reduce_fx="max")

    def predict_step(batch: Any, batch_idx: int) -> torch.Tensor:
        return model(batch[0]).argmax(-1)

    model.validation_step = validation_step  # type: ignore[method-assign]
    model.test_step = test_step  # type: ignore[method-assign]
    model.predict_step = predict_step  # type: ignore[method-assign]
    return model


def _evaluate(devices: int, strategy: Any) -> dict[str, Any]:
    trainer = L.Trainer(devices=devices, strategy=strategy, **trainer_kwargs())
    model, data = eval_gpt(), loader(8 // devices, n=48)
    # The sampler keeps rank r on samples r, r + world, ...: predictions stay in that order.
    return {
        "validate": trainer.validate(model, data, verbose=False)[0],
        "test": trainer.test(model, data, verbose=False)[0],
        "predict": torch.cat(trainer.predict(model, data)),  # type: ignore[arg-type]
    }


def _eval_matrix(engine: str) -> dict[int, dict[str, Any]]:
    return {stage: _evaluate(2, ShardStrategy(stage=stage, engine=engine)) for stage in STAGES}


@pytest.mark.parametrize("engine", ENGINES)
def test_validate_test_predict_every_stage(engine):
    ranks = run_ranks(_eval_matrix, engine)
    reference = _evaluate(1, "auto")
    assert set(reference["test"]) == {"test_loss", "test_loss_max"}
    for stage in STAGES:
        where = f"{engine} stage {stage}"
        for fn in ("validate", "test"):
            for rank_result in ranks:
                got = rank_result[stage][fn]
                assert set(got) == set(reference[fn]), where
                for key, value in reference[fn].items():
                    torch.testing.assert_close(got[key], value, rtol=1e-5, atol=0, msg=f"{where} {key}")
        # Rank r predicted samples r, r + 2, ...: interleave back into the single process's order.
        predictions = torch.stack([r[stage]["predict"] for r in ranks], dim=1).flatten(0, 1)
        assert torch.equal(predictions, reference["predict"]), where
