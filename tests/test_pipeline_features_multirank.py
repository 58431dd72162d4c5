"""Pipeline stages (2 CPU ranks, stage 3) composed with the strategy's other features.

A GPT whose head is tied to its input embedding (the demo's default) follows one process, ``trainer.test``
included: both stages keep a copy and sum its gradient each step. 16-mixed's loss scaler follows one
process's, and an inf in one stage's gradients skips the step on both. Activation checkpointing and
bf16-mixed follow one process; a non-finite loss in the last stage skips the
same optimizer step on both stages; MFUMonitor counts each stage's FLOPs and each batch's tokens once; a
model built on the meta device is initialised stage by stage with its ``init_weights``; ``stage="auto"``
plans for the stages and runs.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_shard import ShardPrecision, ShardStrategy
from lightning_shard.callbacks import MFUMonitor
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import LossRecorder, full_weights, tiny_gpt, trainer_kwargs
from tests.test_parity_multirank import CLIP
from tests.test_pipeline_multirank import BATCH, WEIGHT_ATOL, PipeGPT, _check, _fit, _loader, _model

pytestmark = pytest.mark.multirank

PP2 = dict(stage=3, pipeline_parallel_size=2, microbatches=2)
# Microbatches round differently from the whole batch in half precision. Measured (2 stages against one
# process, 2 CPU ranks): 16-mixed's losses 3.2e-6 relative, its weights 3.7e-5 absolute; bf16-mixed's losses
# 2.0e-5, weights 4.3e-4. The tolerances are ~3x those. A 2x gradient in the stages moves 16-mixed's weights
# by 9.5e-3 (its clipped losses hardly move) and bf16-mixed's losses by 7.5e-3, weights by 7.1e-2.
FP16_TOL = {"losses": dict(rtol=1e-5, atol=0.0), "weights": dict(rtol=0.0, atol=1e-4)}
BF16_TOL = {"losses": dict(rtol=1e-4, atol=0.0), "weights": dict(rtol=0.0, atol=1.5e-3)}
POISONED_STEP = 1


class PoisonedGPT(PipeGPT):
    """Its loss at one optimizer step is multiplied by ``factor``: NaN (skipped) or 0 (a step that changes
    nothing under plain SGD: the reference for a skipped step)."""

    def __init__(self, factor: float, **kwargs: Any) -> None:
        super().__init__("sgd", **kwargs)
        self.factor = factor

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = super().pipeline_loss(logits, targets)
        return loss * self.factor if self.trainer.global_step == POISONED_STEP else loss


def _trainer(world: int, flags: dict[str, Any], callbacks: list[Any], **kwargs: Any) -> L.Trainer:
    """3 optimizer steps of accumulation 2 with clipping: under ShardStrategy(**flags), or in one process."""
    return L.Trainer(
        devices=world,
        strategy=ShardStrategy(**flags) if world > 1 else "auto",
        callbacks=callbacks,
        **kwargs,
        **trainer_kwargs(
            max_steps=3, accumulate_grad_batches=2, gradient_clip_val=CLIP, gradient_clip_algorithm="norm"
        ),
    )


def _poisoned_fit(factor: float, world: int, **flags: Any) -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = _trainer(world, flags, [recorder])
    torch.manual_seed(0)
    model = PoisonedGPT(factor, **_hparams())
    model.load_state_dict(_model("sgd", 2).state_dict())
    trainer.fit(model, _loader(world, flags.get("pipeline_parallel_size", 1), BATCH))
    skipped = getattr(trainer.strategy, "skipped_steps", 0)
    return {"losses": recorder.losses, "weights": full_weights(trainer), "skipped": skipped}


def _tied_fit(optimizer: str, world: int, **flags: Any) -> dict[str, Any]:
    """The GPT with its head tied to the token embedding: fit (accumulation 2, clipping), then test."""
    recorder = LossRecorder()
    trainer = _trainer(world, flags, [recorder])
    hparams = dict(tiny_gpt(n_layers=2).hparams)
    assert hparams["tie_embeddings"]
    torch.manual_seed(0)
    model = PipeGPT(optimizer, **hparams)
    pp = flags.get("pipeline_parallel_size", 1)
    trainer.fit(model, _loader(world, pp, BATCH))
    out = {"losses": recorder.losses, "weights": full_weights(trainer)}
    out["test_loss"] = trainer.test(model, _loader(world, pp, BATCH), verbose=False)[0]["test_loss"]
    return out


INF_STEP = 1
INF_PARAM = "model.tok_emb.weight"  # on the first stage only


class Fp16Probe(L.Callback):
    """Puts an inf into one first-stage gradient at one step; records each step's loss scale, and whether
    this rank's parameters changed in each optimizer step."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self.changed: list[bool] = []

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = dict(pl_module.named_parameters())
        if trainer.global_step == INF_STEP and INF_PARAM in params:
            _local(params[INF_PARAM].grad).fill_(math.inf)

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any
    ) -> None:
        self._before = [_local(p).clone() for p in pl_module.parameters()]

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        before, self._before = getattr(self, "_before", None), None
        if before is not None:  # this batch ended an accumulation window: an optimizer step (or its skip)
            self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))
            after = [_local(p) for p in pl_module.parameters()]  # this rank's shards: no collective
            self.changed.append(any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)))


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _fp16_fit(world: int, **flags: Any) -> dict[str, Any]:
    recorder, probe = LossRecorder(), Fp16Probe()
    if world > 1:
        plugin = ShardPrecision("16-mixed")
    else:  # one process: Lightning's own 16-mixed with torch's scaler (on CPU Lightning would pick bf16)
        plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = _trainer(world, flags, [recorder, probe], plugins=[plugin])
    trainer.fit(_model("sgd", 2), _loader(world, flags.get("pipeline_parallel_size", 1), BATCH))
    return {
        "losses": recorder.losses,
        "weights": full_weights(trainer),
        "scales": probe.scales,
        "changed": probe.changed,
    }


def _hparams() -> dict[str, Any]:
    return dict(tiny_gpt(tie_embeddings=False, n_layers=2).hparams)


class InitRecorder(L.Callback):
    """Each parameter's mean and std as the first step starts (gathered whole, on the rank's stage)."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stats = {
            name: (float(w.mean()), float(w.std()) if w.numel() > 1 else 0.0)
            for name, w in full_weights(trainer).items()
        }


def _meta_fit() -> dict[str, Any]:
    recorder, init = LossRecorder(), InitRecorder()
    trainer = L.Trainer(
        devices=2, strategy=ShardStrategy(**PP2), callbacks=[recorder, init], **trainer_kwargs(max_steps=2)
    )
    hparams = _hparams()
    with trainer.init_module(empty_init=True):
        model = PipeGPT("sgd", **hparams)
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model, _loader(2, 2, BATCH))
    return {"losses": recorder.losses, "init": init.stats, "hparams": hparams}


def _mfu_fit(world: int, **flags: Any) -> dict[str, Any]:
    monitor = MFUMonitor(log_every_n_steps=4, window=3)
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(**flags) if world > 1 else "auto",
        callbacks=[monitor],
        **trainer_kwargs(max_steps=4),
    )
    pp = flags.get("pipeline_parallel_size", 1)
    batch = next(iter(_loader(world, pp, BATCH)))[0]
    trainer.fit(_model("sgd", 2), _loader(world, pp, BATCH))
    return {"counted": monitor.counted, "metrics": monitor.metrics, "tokens": batch.numel()}


def _features() -> dict[str, Any]:
    return {
        "tied sgd": _tied_fit("sgd", 2, **PP2),
        "tied adamw": _tied_fit("adamw", 2, **PP2),
        "16-mixed": _fp16_fit(2, **PP2),
        "selective checkpointing": _fit("sgd", 2, activation_checkpointing="selective", **PP2),
        "full checkpointing": _fit("adamw", 2, activation_checkpointing="full", **PP2),
        "bf16-mixed": _bf16_fit(2, **PP2),
        "skipped": _poisoned_fit(math.nan, 2, skip_nonfinite=True, **PP2),
        "meta": _meta_fit(),
        "mfu": _mfu_fit(2, **PP2),
        # the planner picks the stage for this mesh (each rank planned with half the model)
        "auto": _fit("sgd", 2, stage="auto", device_memory="1TB", pipeline_parallel_size=2, microbatches=2),
    }


def _bf16_fit(world: int, **flags: Any) -> dict[str, Any]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=world,
        strategy=ShardStrategy(**flags) if world > 1 else "auto",
        precision="bf16-mixed",
        callbacks=[recorder],
        **trainer_kwargs(max_steps=3),
    )
    trainer.fit(_model("sgd", 2), _loader(world, flags.get("pipeline_parallel_size", 1), BATCH))
    return {"losses": recorder.losses, "weights": full_weights(trainer)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_features, world_size=2)


def _merged(ranks: list[dict[str, Any]], name: str) -> dict[str, torch.Tensor]:
    assert not set(ranks[0][name]["weights"]) & set(ranks[1][name]["weights"])
    return {**ranks[0][name]["weights"], **ranks[1][name]["weights"]}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_head_tied_to_the_embedding_follows_one_process_and_tests(ranks, optimizer):
    name = f"tied {optimizer}"
    expected = _tied_fit(optimizer, 1)
    first, last = (rank[name]["weights"] for rank in ranks)
    # each stage keeps its copy under the name its module gives it; the checkpoint's keys are one process's
    assert "model.tok_emb.weight" in first and "model.head.weight" in last
    merged = _merged(ranks, name)
    assert sorted(merged) == sorted(expected["weights"])
    torch.testing.assert_close(first["model.tok_emb.weight"], last["model.head.weight"], rtol=0, atol=0)
    for rank in ranks:
        torch.testing.assert_close(rank[name]["losses"], expected["losses"], rtol=1e-5, atol=0)
        torch.testing.assert_close(rank[name]["test_loss"], expected["test_loss"], rtol=1e-5, atol=0)
    for key, value in expected["weights"].items():
        torch.testing.assert_close(
            merged[key], value, rtol=1e-5, atol=WEIGHT_ATOL[optimizer], msg=lambda m, key=key: f"{key}: {m}"
        )


def test_16_mixed_scales_as_one_process_and_an_inf_in_one_stage_skips_the_step_on_both(ranks):
    expected = _fp16_fit(1)
    assert expected["scales"] == [65536.0, 32768.0, 32768.0]  # the inf at step 1 halved the scale
    assert expected["changed"] == [True, False, True]
    merged = _merged(ranks, "16-mixed")
    for rank in ranks:  # the inf was on the first stage's gradient only: the last stage skipped too
        assert rank["16-mixed"]["scales"] == expected["scales"]
        assert rank["16-mixed"]["changed"] == expected["changed"]
        torch.testing.assert_close(rank["16-mixed"]["losses"], expected["losses"], **FP16_TOL["losses"])
    assert sorted(merged) == sorted(expected["weights"])
    for key, value in expected["weights"].items():
        torch.testing.assert_close(
            merged[key], value, **FP16_TOL["weights"], msg=lambda m, key=key: f"{key}: {m}"
        )


@pytest.mark.parametrize(
    ("name", "optimizer"), [("selective checkpointing", "sgd"), ("full checkpointing", "adamw")]
)
def test_activation_checkpointing_in_stages_follows_one_process(ranks, name, optimizer):
    for rank in ranks:
        _check({**rank[name], "weights": _merged(ranks, name)}, optimizer, f"pp2, {name}")


def test_bf16_mixed_stages_follow_one_process(ranks):
    expected = _bf16_fit(1)
    merged = _merged(ranks, "bf16-mixed")
    for rank in ranks:
        torch.testing.assert_close(rank["bf16-mixed"]["losses"], expected["losses"], **BF16_TOL["losses"])
    assert sorted(merged) == sorted(expected["weights"])
    for key, value in expected["weights"].items():
        torch.testing.assert_close(
            merged[key], value, **BF16_TOL["weights"], msg=lambda m, key=key: f"{key}: {m}"
        )


def test_a_nonfinite_loss_in_the_last_stage_skips_the_step_on_every_stage(ranks):
    # A skipped SGD step changes nothing, as a step with a zero loss does in one process.
    expected = _poisoned_fit(0.0, 1)
    merged = _merged(ranks, "skipped")
    for rank in ranks:
        assert rank["skipped"]["skipped"] == 1
        losses = rank["skipped"]["losses"]
        assert all(math.isnan(v) for v in losses[2:4]), losses  # the two batches of step 1
        kept = losses[:2] + losses[4:]
        torch.testing.assert_close(kept, expected["losses"][:2] + expected["losses"][4:], rtol=1e-5, atol=0)
    for key, value in expected["weights"].items():
        torch.testing.assert_close(
            merged[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
        )


def test_a_meta_model_is_initialised_stage_by_stage(ranks):
    first, second = ranks[0]["meta"], ranks[1]["meta"]
    assert any(k.startswith("model.tok_emb") for k in first["init"])
    assert any(k.startswith("model.head") for k in second["init"])
    depth, vocab = first["hparams"]["n_layers"], first["hparams"]["vocab_size"]
    for rank in (first, second):
        for name, (mean, std) in rank["init"].items():
            if ".ln" in name or "ln_f" in name:  # LayerNorm: ones and zeros
                assert std == 0.0 and mean in (0.0, 1.0), (name, mean)
            elif name.endswith("bias"):
                assert mean == 0.0 and std == 0.0, name
            else:  # GPT-2's normal init, residual projections scaled by depth
                scaled = name.endswith("proj.weight") or name.endswith("mlp.2.weight")
                target = 0.02 / math.sqrt(2 * depth) if scaled else 0.02
                assert abs(std - target) < 0.1 * target, (name, std, target)
        assert all(math.isfinite(v) for v in rank["losses"])
        assert abs(rank["losses"][0] - math.log(vocab)) < 0.05  # near-uniform logits from a fresh init


def test_stage_auto_plans_and_runs_with_pipeline_stages(ranks):
    for rank in ranks:
        assert rank["auto"]["stage"] == 0  # a tiny model fits replicated
        _check({**rank["auto"], "weights": _merged(ranks, "auto")}, "sgd", "pp2, stage='auto'")


def test_mfu_counts_each_stage_flops_and_each_batch_tokens_once(ranks):
    expected = _mfu_fit(1)
    stages = [rank["mfu"] for rank in ranks]
    # Each stage counts its own part of the model's FLOPs; together, the whole model's.
    total = sum(stage["counted"]["model_flops"] for stage in stages)
    assert 0 < stages[0]["counted"]["model_flops"] < total
    assert total == pytest.approx(expected["counted"]["model_flops"], rel=1e-6)
    for stage in stages:
        metrics = stage["metrics"]
        # both stages read the same batch: its tokens count once per step
        per_step = metrics["perf/tokens_per_sec"] * metrics["perf/step_time_s"]
        assert per_step == pytest.approx(stage["tokens"], rel=0.1)
        assert 0 < metrics["perf/mfu"] < 1
