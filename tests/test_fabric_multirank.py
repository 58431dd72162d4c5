"""ShardFabricStrategy on 2 ranks: a plain Fabric loop matches the Trainer strategy, and checkpoints cross.

Each job runs the Fabric loop and the Trainer on the same ranks, data and initial weights, with plain SGD
(lr 0.5: a gradient 2x off, a clip at the wrong norm or a lost accumulation step all move the losses far
beyond rtol 1e-5). Fabric makes the process group; the Trainer joins it, as in one script using both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_shard import ShardFabricStrategy, ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import LossRecorder, full_model_weights, full_weights, loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

SGD_LR = 0.5
CLIP = 0.6
STEPS = 3
#: (accumulate, clip) schedules each parity job runs, Fabric and Trainer side by side.
SCHEDULES = [(1, CLIP), (2, None)]
#: Multiplies the loss the Fabric loop back-propagates, not the one it reports (1.0: parity). Set to 2.0,
#: every parity test fails from its second step on (checked when the tests were written).
GRADIENT_SCALE = 1.0


def _sgd_gpt() -> L.LightningModule:
    model = tiny_gpt()

    def configure_optimizers() -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=SGD_LR)

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return model


def _fabric(stage: int, engine: str = "fsdp", precision: str = "32-true", **flags: Any) -> L.Fabric:
    strategy = ShardFabricStrategy(stage=stage, engine=engine, **flags)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)  # type: ignore[arg-type]
    fabric.launch()
    return fabric


def _fabric_losses(fabric: L.Fabric, accumulate: int, clip: float | None) -> list[float]:
    return _fabric_run(fabric, accumulate, clip)[0]


def _fabric_run(
    fabric: L.Fabric, accumulate: int, clip: float | None, steps: int = STEPS
) -> tuple[list[float], Any, Any]:
    """The plain Fabric loop: micro-batches without gradient sync, clip, step; the loss averaged over ranks."""
    model = _sgd_gpt()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=SGD_LR))
    data = fabric.setup_dataloaders(loader(4), use_distributed_sampler=False)
    losses = []
    for i, (x, y) in enumerate(data):
        if i == steps * accumulate:
            break
        boundary = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not boundary):
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)) / accumulate
            fabric.backward(loss * GRADIENT_SCALE)
        # As the Trainer reports it under accumulation: the micro-batch's share of the step's loss.
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        if boundary:
            if clip is not None:
                fabric.clip_gradients(model, optimizer, max_norm=clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses, model, optimizer


def _trainer_losses(
    stage: int, engine: str, accumulate: int, clip: float | None, precision: str, flags: dict
) -> list[float]:
    recorder = LossRecorder()
    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=stage, engine=engine, **flags),
        callbacks=[recorder],
        precision=precision,  # type: ignore[arg-type]
        **trainer_kwargs(
            max_steps=STEPS,
            accumulate_grad_batches=accumulate,
            gradient_clip_val=clip,
            gradient_clip_algorithm="norm",
        ),
    )
    trainer.fit(_sgd_gpt(), loader(4))
    return recorder.losses


def _parity_job(
    stage: int,
    engine: str,
    schedules: list[tuple[int, float | None]],
    precision: str = "32-true",
    flags: dict | None = None,
) -> dict:
    """Per schedule, a Fabric of its own (one model per Fabric; the same process group) and a Trainer."""
    flags = flags or {}
    return {
        (accumulate, clip): (
            _fabric_losses(_fabric(stage, engine, precision, **flags), accumulate, clip),
            _trainer_losses(stage, engine, accumulate, clip, precision, flags),
        )
        for accumulate, clip in schedules
    }


def _check(results: dict) -> None:
    for (accumulate, clip), (fabric_losses, trainer_losses) in results.items():
        assert len(fabric_losses) == STEPS * accumulate
        torch.testing.assert_close(
            fabric_losses,
            trainer_losses,
            rtol=1e-5,
            atol=0,
            msg=lambda m, a=accumulate, c=clip: f"accumulate {a}, clip {c}: {m}",
        )


@pytest.mark.parametrize("stage", [1, 3])
def test_fabric_loop_matches_the_trainer_strategy_with_sgd(stage):
    _check(run_ranks(_parity_job, stage, "fsdp", SCHEDULES)[0])


def test_fabric_loop_matches_the_trainer_at_stage_2_with_bf16_mixed_and_activation_checkpointing():
    flags = {"activation_checkpointing": "full"}
    _check(run_ranks(_parity_job, 2, "fsdp", [(1, CLIP)], "bf16-mixed", flags)[0])


@pytest.mark.deepspeed
def test_fabric_loop_matches_the_trainer_strategy_on_the_deepspeed_engine():
    _check(run_ranks(_parity_job, 3, "deepspeed", [(1, None), (2, None)])[0])


def _collectives(fabric: L.Fabric) -> tuple[Any, ...]:
    rank = fabric.global_rank
    fabric.barrier()
    return (
        fabric.broadcast(f"from rank {rank}"),
        fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
        fabric.all_gather(torch.tensor(float(rank))).tolist(),
    )


def _features_job() -> dict:
    """strategy="zero3" by name, bf16-mixed, empty init, separate module / optimizer set-up, clipping and
    collectives before and after the loop."""
    fabric = L.Fabric(strategy="zero3", accelerator="cpu", devices=2, precision="bf16-mixed")
    fabric.launch()
    out: dict[str, Any] = {"before": _collectives(fabric), "strategy": type(fabric.strategy).__name__}
    with fabric.init_module(empty_init=True):
        model = tiny_gpt()
    out["built_on_meta"] = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["sharded"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
    losses, norms = [], []
    x, y = next(iter(fabric.setup_dataloaders(loader(4), use_distributed_sampler=False)))
    for _ in range(4):  # one batch, again and again: its loss must fall
        with fabric.autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.5).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach()).item())
    fabric.backward(F.cross_entropy(model(x).view(-1, logits.size(-1)), y.reshape(-1)) * float("nan"))
    try:
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        out["nonfinite"] = "no error"
    except RuntimeError as error:
        out["nonfinite"] = str(error)
    optimizer.zero_grad()
    out.update(losses=losses, norms=norms, logits_dtype=str(logits.dtype), after=_collectives(fabric))
    return out


def test_zero3_by_name_bf16_empty_init_separate_setup_and_collectives_around_the_loop():
    out = run_ranks(_features_job)
    for rank, result in enumerate(out):
        assert result["strategy"] == "ShardFabricStrategy"
        assert result["built_on_meta"] and result["sharded"]
        for when in ("before", "after"):
            assert result[when] == ("from rank 0", 3.0, [0.0, 1.0]), (rank, when)
        assert result["logits_dtype"] == "torch.float32"  # Fabric's mixed plugin returns float32 outputs
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert result["losses"][-1] < result["losses"][0]
        assert (
            "total norm of the gradients is nan" in result["nonfinite"]
        )  # on every rank, groups still usable
    # The clipping norm is the whole model's: the same on both ranks, each holding half of every gradient.
    assert out[0]["norms"] == out[1]["norms"] and out[0]["losses"] == out[1]["losses"]


def _validating_gpt() -> L.LightningModule:
    model = _sgd_gpt()
    model.validation_step = lambda batch, batch_idx: None  # type: ignore[method-assign]
    return model


def _trainer_to_fabric_job(root: str) -> dict:
    """The Trainer (stage 3) trains and saves; Fabric (stage 1, another layout) resumes its weights and step."""
    trainer = L.Trainer(devices=2, strategy=ShardStrategy(stage=3), **trainer_kwargs(max_steps=2))
    trainer.fit(_sgd_gpt(), loader(4))
    path = Path(root) / "trainer.ckpt"
    trainer.save_checkpoint(path)
    saved = full_weights(trainer)
    fabric = _fabric(1)
    model = _sgd_gpt()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=SGD_LR))
    state = {"model": model, "optimizer": optimizer, "global_step": None}
    remainder = fabric.load(path, state)
    loaded = full_model_weights(fabric.strategy._model)
    return {
        "saved": saved,
        "loaded": loaded,
        "global_step": state["global_step"],
        "remainder": sorted(remainder),
    }


def _fabric_to_trainer_job(root: str) -> dict:
    """Fabric (stage 3, async save) trains and saves; the Trainer (stage 2) and a fresh Fabric (stage 0) read it."""
    fabric = _fabric(3, async_checkpoint=True)
    _, model, optimizer = _fabric_run(fabric, 1, None, steps=2)
    path = Path(root) / "fabric.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2})
    fabric.strategy.wait_for_checkpoints()  # written in the background; another reader comes next
    saved = full_model_weights(fabric.strategy._model)
    trainer = L.Trainer(devices=2, strategy=ShardStrategy(stage=2), **trainer_kwargs(limit_val_batches=1))
    module = _validating_gpt()
    trainer.validate(module, loader(4), ckpt_path=path)
    by_trainer = full_weights(trainer)
    again = _fabric(0)
    fresh = _sgd_gpt()
    fresh, fresh_optimizer = again.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=SGD_LR))
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    again.load(path, state)
    return {
        "saved": saved,
        "trainer": by_trainer,
        "fabric": full_model_weights(again.strategy._model),
        "step": state["step"],
    }


def test_a_trainer_checkpoint_resumes_under_fabric(tmp_path):
    out = run_ranks(_trainer_to_fabric_job, str(tmp_path))
    for rank in out:
        assert rank["saved"].keys() == rank["loaded"].keys()
        for key, value in rank["saved"].items():
            torch.testing.assert_close(rank["loaded"][key], value, rtol=0, atol=0, msg=key)
        assert rank["global_step"] == 2
        assert "loops" in rank["remainder"] and "state_dict" not in rank["remainder"]
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_fabric_checkpoint_loads_under_the_trainer_and_fabric(tmp_path):
    out = run_ranks(_fabric_to_trainer_job, str(tmp_path))
    for rank in out:
        assert rank["step"] == 2
        initial = full_model_weights(_sgd_gpt())
        assert any(not torch.equal(initial[k], v) for k, v in rank["saved"].items())  # training moved them
        for key, value in rank["saved"].items():
            torch.testing.assert_close(rank["trainer"][key], value, rtol=0, atol=0, msg=key)
            torch.testing.assert_close(rank["fabric"][key], value, rtol=0, atol=0, msg=key)


def test_the_fabric_example_runs_on_two_ranks_and_exits_zero(tmp_path):
    """examples/fabric_gpt.py as docs/fabric.md and the README show it (fewer steps): Fabric starts rank 1."""
    import subprocess
    import sys

    from tests.helpers import job_env

    script = Path(__file__).resolve().parents[1] / "examples" / "fabric_gpt.py"
    run = subprocess.run(
        [sys.executable, str(script), "--steps", "3", "--checkpoint", "ckpt/fabric.ckpt"],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    losses = [float(line.split()[3]) for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert (tmp_path / "ckpt" / "fabric.ckpt" / "meta.pt").is_file()
    assert not list(tmp_path.rglob("*.tmp"))
