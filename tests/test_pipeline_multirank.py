"""Pipeline stages on 2 and 4 CPU ranks: losses and final weights equal to one process.

Plain SGD (every update is lr x gradient, so a wrong gradient scale shows) and AdamW, 3 optimizer steps of
accumulation 2 with clipping on: the clip sees the global norm over both stages' parameters, and the
schedule's microbatch losses carry the 1 / (microbatches x accumulation) scale. The ZeRO-1 runs also step a
cosine learning-rate schedule over exactly those 3 steps (lr x 1, 0.75, 0.25), so a run whose scheduler does
not reach the optimizer that steps ends far from one process's weights.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_shard import ShardStrategy
from lightning_shard.demos import GPTModule
from lightning_shard.demos.ranks import run_ranks
from lightning_shard.parallel import MeshLayout
from tests.helpers import LossRecorder, full_weights, tiny_gpt, token_dataset, trainer_kwargs
from tests.test_parity_multirank import CLIP, SGD_LR

pytestmark = pytest.mark.multirank

BATCH = 8  # per optimizer step and accumulation step, over all data-parallel ranks
STEPS = 3  # optimizer steps per fit; a scheduled fit's cosine reaches 0 after the last
# AdamW divides each update by the gradient's running RMS, which turns float rounding in near-zero
# gradients into differences of up to ~1e-5 in the weights after 3 steps; SGD's are ~1e-8.
WEIGHT_ATOL = {"sgd": 1e-6, "adamw": 1e-4}


class PipeGPT(GPTModule):
    """The tiny GPT (untied unless ``tie_embeddings=True`` is passed) with SGD or AdamW and evaluation losses.

    AdamW is the demo's (two param groups, a cosine schedule of ``T_max=max_steps``); SGD takes the same
    schedule when ``schedule`` is set."""

    def __init__(self, optimizer: str = "adamw", schedule: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.optimizer_name = optimizer
        self.schedule = schedule

    def configure_optimizers(self) -> Any:
        if self.optimizer_name != "sgd":
            return super().configure_optimizers()
        optimizer = torch.optim.SGD(self.parameters(), lr=SGD_LR)
        if not self.schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.pipeline_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", self.pipeline_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])


def _model(optimizer: str, n_layers: int, tied: bool = False, schedule: bool = False) -> PipeGPT:
    """``schedule``: the cosine's ``T_max`` is the steps the fit runs (the helpers' 50 moves the rate 0.35%)."""
    reference = tiny_gpt(tie_embeddings=tied, n_layers=n_layers)  # the helpers' sizes and seed
    hparams = dict(reference.hparams) | ({"max_steps": STEPS} if schedule else {})
    torch.manual_seed(0)
    return PipeGPT(optimizer, schedule, **hparams)


def _loader(world: int, pp: int, batch: int, tp: int = 1) -> DataLoader:
    """In order; the stages of one pipeline, and the ranks of a tensor-parallel group, read the same
    batches (the strategy's sampler rule)."""
    layout = MeshLayout.for_world(world, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    rank = int(os.environ.get("RANK", 0)) if world > 1 else 0
    dataset = token_dataset(64)
    sampler = DistributedSampler(
        dataset, num_replicas=layout.data_parallel_size, rank=layout.data_parallel_rank(rank), shuffle=False
    )
    return DataLoader(dataset, batch_size=batch, sampler=sampler)


def _fit(
    optimizer: str,
    world: int = 1,
    validate: bool = False,
    n_layers: int = 2,
    tied: bool = False,
    accumulate: int = 2,
    schedule: bool = False,
    **flags: Any,
) -> dict[str, Any]:
    recorder = LossRecorder()
    pp = flags.get("pipeline_parallel_size", 1)
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(**flags) if world > 1 else "auto",
        callbacks=[recorder],
        **trainer_kwargs(
            max_steps=STEPS,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=CLIP,
            gradient_clip_algorithm="norm",
        ),
    )
    model = _model(optimizer, n_layers, tied, schedule)
    tp = flags.get("tensor_parallel_size", 1)
    dp = world // (pp * tp)
    trainer.fit(model, _loader(world, pp, BATCH // dp, tp))
    out: dict[str, Any] = {"losses": recorder.losses, "weights": full_weights(trainer)}
    out["stage"] = trainer.strategy.config.stage if world > 1 else None  # as planned for stage="auto"
    optimizer_ = trainer.strategy.optimizers[0]
    # the parameters this rank keeps optimizer state for (ZeRO-1: its partition's only), of its stage's
    out["state_of"] = (len(getattr(optimizer_, "optim", optimizer_).state), len(list(model.parameters())))
    if validate:
        loader = _loader(world, pp, BATCH // dp, tp)
        out["val_loss"] = trainer.validate(model, loader, verbose=False)[0]["val_loss"]
        predictions = trainer.predict(model, loader)
        out["logits"] = torch.cat([p.float() for p in predictions])  # type: ignore[union-attr]
    return out


@functools.cache
def _reference(optimizer: str, n_layers: int, tied: bool, accumulate: int, schedule: bool) -> dict[str, Any]:
    """One process's fit, once per configuration: every rank of every case compares with the same run."""
    return _fit(
        optimizer, validate=True, n_layers=n_layers, tied=tied, accumulate=accumulate, schedule=schedule
    )


def _check(
    result: dict[str, Any],
    optimizer: str,
    name: str,
    n_layers: int = 2,
    tied: bool = False,
    accumulate: int = 2,
    schedule: bool = False,
) -> None:
    expected = _reference(optimizer, n_layers, tied, accumulate, schedule)
    assert len(result["losses"]) == STEPS * accumulate
    torch.testing.assert_close(
        result["losses"], expected["losses"], rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}"
    )
    assert sorted(result["weights"]) == sorted(expected["weights"])
    for key, value in expected["weights"].items():
        torch.testing.assert_close(
            result["weights"][key],
            value,
            rtol=1e-5,
            atol=WEIGHT_ATOL[optimizer],
            msg=lambda m, key=key: f"{name} {key}: {m}",
        )
    if "val_loss" in result:
        torch.testing.assert_close(result["val_loss"], expected["val_loss"], rtol=1e-5, atol=0)
        # predict: the last stage's output on every rank of the pipeline
        torch.testing.assert_close(result["logits"], expected["logits"], rtol=1e-5, atol=1e-5)


# name -> (optimizer, flags): both schedules, stage 0 (replicate()) and FSDP2 stages 2 and 3 in each stage.
PP2 = {
    "pp2 gpipe, stage 0, sgd": ("sgd", dict(stage=0, pipeline_schedule="gpipe")),
    "pp2 1f1b, stage 3, sgd": ("sgd", dict(stage=3, pipeline_schedule="1f1b")),
    "pp2 1f1b, stage 2, adamw": ("adamw", dict(stage=2, pipeline_schedule="1f1b")),
    "pp2 gpipe, stage 3, adamw": ("adamw", dict(stage=3, pipeline_schedule="gpipe")),
}


def _pp2_matrix() -> dict[str, dict[str, Any]]:
    results = {}
    for name, (optimizer, flags) in PP2.items():
        # validate and predict after fit through forward-only schedules, once per schedule
        validate = name.startswith("pp2 gpipe, stage 3") or name.startswith("pp2 1f1b, stage 3")
        results[name] = _fit(optimizer, 2, validate, pipeline_parallel_size=2, microbatches=2, **flags)
    return results


def test_two_stages_follow_one_process():
    ranks = run_ranks(_pp2_matrix, world_size=2)
    for name, (optimizer, _) in PP2.items():
        # each rank holds its own stage's weights: together, the whole model
        merged = {**ranks[0][name]["weights"], **ranks[1][name]["weights"]}
        assert not set(ranks[0][name]["weights"]) & set(ranks[1][name]["weights"])
        for rank in ranks:
            _check({**rank[name], "weights": merged}, optimizer, name)


# Two stages on each rank (4 stages of one block: rank 0 runs 0 and 2, rank 1 runs 1 and 3), 4 microbatches.
INTERLEAVED = {
    "pp2 x 2 interleaved_1f1b, stage 3, sgd": ("sgd", dict(stage=3, pipeline_schedule="interleaved_1f1b")),
    "pp2 x 2 zero_bubble, stage 3, sgd": ("sgd", dict(stage=3, pipeline_schedule="zero_bubble")),
    "pp2 x 2 zero_bubble, stage 0, adamw": ("adamw", dict(stage=0, pipeline_schedule="zero_bubble")),
}


def _interleaved_matrix() -> dict[str, dict[str, Any]]:
    results = {}
    for name, (optimizer, flags) in INTERLEAVED.items():
        validate = "interleaved_1f1b" in name
        results[name] = _fit(
            optimizer, 2, validate, n_layers=4, pipeline_parallel_size=2, microbatches=4, **flags
        )
    return results


def test_two_stages_on_each_rank_follow_one_process():
    ranks = run_ranks(_interleaved_matrix, world_size=2)
    for name, (optimizer, _) in INTERLEAVED.items():
        merged = {**ranks[0][name]["weights"], **ranks[1][name]["weights"]}
        assert any(".blocks.2." in key for key in ranks[0][name]["weights"])  # rank 0 holds stages 0 and 2
        assert any(".blocks.3." in key for key in ranks[1][name]["weights"])
        for rank in ranks:
            _check({**rank[name], "weights": merged}, optimizer, name, n_layers=4)


def _pp2_dp2(flags: dict[str, Any]) -> dict[str, Any]:
    return _fit("sgd", 4, False, pipeline_parallel_size=2, microbatches=2, **flags)  # n_layers in flags


@pytest.mark.parametrize(
    "flags",
    [
        dict(stage=3),
        dict(stage=3, replicate_size=2),
        dict(stage=3, pipeline_schedule="zero_bubble", n_layers=4),  # 2 stages per rank
    ],
    ids=["zero3", "hsdp", "zero3 zero_bubble"],
)
def test_two_stages_by_two_data_parallel_ranks_follow_one_process(flags):
    ranks = run_ranks(_pp2_dp2, flags, world_size=4)
    # ranks 0-1 hold stage 0 (sharded over both, or replicated: HSDP), ranks 2-3 stage 1
    merged = {**ranks[0]["weights"], **ranks[2]["weights"]}
    assert ranks[0]["weights"].keys() == ranks[1]["weights"].keys()
    for rank in ranks:
        _check({**rank, "weights": merged}, "sgd", f"pp2 x dp2, {flags}", n_layers=flags.get("n_layers", 2))


# ZeRO-1 and, beside it, stage 0 in the same job: the demo GPT as users run it (its head tied to the embedding,
# its own AdamW of two param groups) and plain SGD, each under a cosine schedule over the run's steps; clipping
# on. The stand-ins ZeRO-1 steps for the stages' DTensor parameters once kept the gradient of an earlier batch
# (or none) whenever a backward replaced the parameters' gradients, so without accumulation stage 1 trained
# differently. Each rank's stage-1 run is held to its stage-0 run (the same rows of data through the same
# parameters) first, tighter than to one process: ZeRO-1 partitions only the optimizer's state, and each
# parameter's update is the same arithmetic on the same reduced gradient (the numbers come out equal bit for bit
# on this machine; the tolerance leaves room for another order of reduction, not for another scale).
ZERO1 = {
    f"{optimizer}, stage {stage}": dict(optimizer=optimizer, stage=stage)
    for optimizer in ("sgd", "adamw")
    for stage in (1, 0)
}


def _zero1_stages(world: int, accumulate: int, tied: bool) -> dict[str, dict[str, Any]]:
    return {
        name: _fit(
            case["optimizer"],
            world,
            tied=tied,
            accumulate=accumulate,
            schedule=True,
            stage=case["stage"],
            pipeline_parallel_size=2,
            microbatches=2,
        )
        for name, case in ZERO1.items()
    }


def _check_zero1(ranks: list[dict[str, Any]], accumulate: int, tied: bool, what: str) -> None:
    last = len(ranks) // 2  # the first rank of the second stage
    for name, case in ZERO1.items():
        if case["stage"] == 1:
            stage0 = name.replace("stage 1", "stage 0")
            for i, rank in enumerate(ranks):
                _check_against_stage_0(rank[name], rank[stage0], f"{what}, rank {i}, {name} against {stage0}")
        merged = {**ranks[0][name]["weights"], **ranks[last][name]["weights"]}
        for rank in ranks:
            _check(
                {**rank[name], "weights": merged},
                case["optimizer"],
                f"{what}, {name}",
                tied=tied,
                accumulate=accumulate,
                schedule=True,
            )


def _check_against_stage_0(result: dict[str, Any], stage0: dict[str, Any], label: str) -> None:
    """One rank's ZeRO-1 run against its stage-0 run: its losses and its own stage's weights."""
    torch.testing.assert_close(
        result["losses"], stage0["losses"], rtol=1e-6, atol=0, msg=lambda m: f"{label}: {m}"
    )
    assert sorted(result["weights"]) == sorted(stage0["weights"]), label
    for key, value in stage0["weights"].items():
        torch.testing.assert_close(
            result["weights"][key],
            value,
            rtol=1e-6,
            atol=1e-7,
            msg=lambda m, key=key: f"{label} {key}: {m}",
        )


def _zero1_no_accumulation() -> dict[str, dict[str, Any]]:
    return _zero1_stages(int(os.environ["WORLD_SIZE"]), accumulate=1, tied=True)


@pytest.mark.parametrize("world", [2, 4], ids=["one data-parallel rank per stage", "pp2 x dp2"])
def test_zero1_without_accumulation_follows_stage_0_and_one_process(world):
    ranks = run_ranks(_zero1_no_accumulation, world_size=world)
    _check_zero1(ranks, accumulate=1, tied=True, what=f"pp2 x dp{world // 2}, no accumulation")


def _pp2_dp2_zero1() -> dict[str, Any]:
    return _zero1_stages(4, accumulate=2, tied=False)


def test_zero1_in_two_stages_by_two_data_parallel_ranks_follows_one_process():
    ranks = run_ranks(_pp2_dp2_zero1, world_size=4)
    _check_zero1(ranks, accumulate=2, tied=False, what="pp2 x dp2, accumulation 2")
    # ZeRO-1 acted: each data-parallel rank of a stage keeps AdamW's state for its own part of the stage
    for first, second in ((0, 1), (2, 3)):
        held_a, total = ranks[first]["adamw, stage 1"]["state_of"]
        held_b, _ = ranks[second]["adamw, stage 1"]["state_of"]
        assert 0 < held_a < total and 0 < held_b < total and held_a + held_b == total


def _pp2_tp2() -> dict[str, Any]:
    # 4 blocks: 2 per stage, so each stage's sequence-parallel region has an entry and an exit block
    flags = dict(stage=3, pipeline_parallel_size=2, tensor_parallel_size=2, microbatches=2)
    return _fit("sgd", 4, False, n_layers=4, **flags)


def test_two_stages_by_tensor_parallel_pairs_follow_one_process():
    ranks = run_ranks(_pp2_tp2, world_size=4)
    merged = {**ranks[0]["weights"], **ranks[2]["weights"]}
    for rank in ranks:
        _check({**rank, "weights": merged}, "sgd", "pp2 x tp2, stage 3", n_layers=4)


def _save_then_resume(path: str, one_file: str) -> dict[str, Any]:
    """Fit 2 steps with 2 stages and save; resume it with and without pipeline stages; then try a
    one-file checkpoint with stages."""
    pp = dict(stage=3, pipeline_parallel_size=2, microbatches=2)
    out: dict[str, Any] = {"errors": []}
    for i, flags in enumerate([pp, pp, dict(stage=3), pp]):
        stages = flags.get("pipeline_parallel_size", 1)
        trainer = L.Trainer(devices=2, strategy=ShardStrategy(**flags), **trainer_kwargs(max_steps=2 + i))
        loader = _loader(2, stages, BATCH * stages // 2)
        resume = None if i == 0 else path if i < 3 else one_file
        try:
            trainer.fit(_model("adamw", 2), loader, ckpt_path=resume)
        except Exception as error:  # noqa: BLE001  (the message is the result)
            out["errors"].append(str(error))
        if i == 0:
            trainer.save_checkpoint(path)
            out["weights"] = full_weights(trainer)
    return out


def test_checkpoint_holds_every_stage_and_resumes_with_and_without_stages(tmp_path):
    from lightning_shard.checkpoint import consolidate

    path = str(tmp_path / "pp2.ckpt")
    one_file = tmp_path / "one.ckpt"
    torch.save({}, one_file)
    ranks = run_ranks(_save_then_resume, path, str(one_file), world_size=2)
    consolidate(path, tmp_path / "full.pt")
    saved = torch.load(tmp_path / "full.pt", weights_only=True)["state_dict"]
    merged = {**ranks[0]["weights"], **ranks[1]["weights"]}
    assert sorted(saved) == sorted(merged)
    for key, value in merged.items():
        torch.testing.assert_close(saved[key].float(), value, rtol=0, atol=0)
    for rank in ranks:
        # resumed with and without stages (losses: tests/test_pipeline_checkpoint_multirank.py); a one-file
        # checkpoint is refused with stages
        assert len(rank["errors"]) == 1, rank["errors"]
        assert re.search(r"resumes sharded\s+checkpoints only.*one-file checkpoint", rank["errors"][0])
        assert "load_model_weights" in rank["errors"][0]
