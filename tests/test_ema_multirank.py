"""EMA on 2 ranks: at every stage of both engines the average, the validation loss with it swapped in and a
resumed run's average equal those under Lightning's DDPStrategy on the same data (SGD, fp32)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, loader, shard_stages_then_ddp, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

DECAY = 0.7
STAGES = {"fsdp": (0, 1, 2, 3), "deepspeed": (1, 2, 3)}
N = 24  # 3 global batches of 8: the checkpoint at step 3 sits at an epoch boundary


def sgd_gpt() -> L.LightningModule:
    model = tiny_gpt()

    def configure_optimizers() -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.5)

    def validation_step(batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        model.log("val_loss", loss, sync_dist=True)

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    model.validation_step = validation_step  # type: ignore[method-assign]
    return model


def gathered(pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
    """The whole weights on every rank: FSDP2 shards and DeepSpeed ZeRO-3 partitions gathered."""
    params = dict(pl_module.named_parameters())
    partitioned = [p for p in params.values() if hasattr(p, "ds_tensor")]
    if partitioned:
        import deepspeed

        context: Any = deepspeed.zero.GatheredParameters(partitioned)
    else:
        context = nullcontext()
    with context:
        return {
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for name, p in params.items()
        }


class Observer(L.Callback):
    """Validation losses, and the weights once training ended (after EMA copied the average in)."""

    def __init__(self) -> None:
        self.val_losses: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = gathered(pl_module)


def _fit(
    strategy: Any, ckpt_dir: str | None = None, resume: str | None = None, averaging: Any = None
) -> Observer:
    from lightning_shard import EMA

    observer = Observer()
    callbacks: list[L.Callback] = [averaging or EMA(decay=DECAY), observer]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1))
    trainer = L.Trainer(
        devices=2,
        strategy=strategy,
        callbacks=callbacks,
        **trainer_kwargs(
            max_steps=6, max_epochs=2, limit_val_batches=2, enable_checkpointing=ckpt_dir is not None
        ),
    )
    trainer.fit(sgd_gpt(), loader(4, n=N), loader(4, n=16), ckpt_path=resume)
    return observer


def _job(engine: str, root: str) -> dict[str, Any]:

    strategies = shard_stages_then_ddp(engine, STAGES[engine])
    out: dict[str, Any] = {}
    for name, make in strategies.items():
        ckpt_dir = Path(root) / name
        run = _fit(make(), ckpt_dir=str(ckpt_dir))
        resumed = _fit(make(), resume=str(ckpt_dir / "epoch=0-step=3.ckpt"))
        out[name] = {"val": run.val_losses, "weights": run.weights, "resumed": resumed.weights}
    return out


def _lightning_job(engine: str, root: str) -> dict[str, Any]:
    """Lightning's EMAWeightAveraging under DDP (the reference the DDP run of EMA is held to); its
    StochasticWeightAveraging and EMAWeightAveraging at the stages where ShardStrategy allows them (EMA's run
    checkpointed, sharded at stage 0 and in one file at stage 1, and resumed), and under DDP."""
    from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_shard import ShardStrategy

    out: dict[str, Any] = {}
    if engine == "fsdp":
        for stage, checkpoint in ((0, "sharded"), (1, "full")):
            name = f"stage{stage}"
            out["swa", name] = _fit(
                ShardStrategy(stage=stage), averaging=StochasticWeightAveraging(0.1, swa_epoch_start=1)
            ).weights
            ckpt_dir = Path(root) / f"lightning_ema_{name}"
            run = _fit(
                ShardStrategy(stage=stage, checkpoint=checkpoint),
                ckpt_dir=str(ckpt_dir),
                averaging=EMAWeightAveraging(decay=DECAY),
            )
            resumed = _fit(
                ShardStrategy(stage=stage, checkpoint=checkpoint),
                resume=str(ckpt_dir / "epoch=0-step=3.ckpt"),
                averaging=EMAWeightAveraging(decay=DECAY),
            )
            out["ema", name] = {"val": run.val_losses, "weights": run.weights, "resumed": resumed.weights}
        out["swa", "ddp"] = _fit(
            DDPStrategy(), averaging=StochasticWeightAveraging(0.1, swa_epoch_start=1)
        ).weights
    lightning = _fit(DDPStrategy(), averaging=EMAWeightAveraging(decay=DECAY))
    out["ema", "ddp"] = {"val": lightning.val_losses, "weights": lightning.weights}
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_ema_equals_ddps_at_every_stage_and_after_resume(engine, tmp_path):
    results = run_ranks(_job, engine, str(tmp_path))
    ddp = results[0]["ddp"]
    lightning = run_ranks(_lightning_job, engine, str(tmp_path))[0]
    # Under DDP, EMA is Lightning's EMAWeightAveraging (which averages by decay * ema + (1 - decay) * w)...
    torch.testing.assert_close(ddp["val"], lightning["ema", "ddp"]["val"], rtol=1e-5, atol=0)
    for key, value in lightning["ema", "ddp"]["weights"].items():
        torch.testing.assert_close(ddp["weights"][key], value, rtol=1e-5, atol=1e-6, msg=key)
    # ...and Lightning's SWA and EMA give DDP's weights at the stages check_callbacks allows them (FSDP engine
    # 0-1), EMA's resumed from its checkpoint too.
    for stage in ("stage0", "stage1") if engine == "fsdp" else ():
        for key, value in lightning["swa", "ddp"].items():
            torch.testing.assert_close(lightning["swa", stage][key], value, rtol=1e-5, atol=1e-6, msg=key)
        ema = lightning["ema", stage]
        torch.testing.assert_close(ema["val"], lightning["ema", "ddp"]["val"], rtol=1e-5, atol=0)
        for key, value in lightning["ema", "ddp"]["weights"].items():
            for what in ("weights", "resumed"):
                torch.testing.assert_close(
                    ema[what][key], value, rtol=1e-5, atol=1e-6, msg=f"{stage} {what} {key}"
                )
    assert len(ddp["val"]) == 2  # validation after steps 3 and 6, each with the average swapped in
    final = tiny_gpt()  # the average differs from the last step's weights: the test can tell them apart
    assert not torch.allclose(ddp["weights"]["model.tok_emb.weight"], final.model.tok_emb.weight.detach())
    for rank, out in enumerate(results):
        for name, got in out.items():
            where = f"{engine} {name}, rank {rank}"
            torch.testing.assert_close(
                got["val"], ddp["val"], rtol=1e-5, atol=0, msg=lambda m, w=where: f"{w}: {m}"
            )
            assert got["weights"].keys() == ddp["weights"].keys(), where
            for key, value in ddp["weights"].items():
                for what in ("weights", "resumed"):
                    torch.testing.assert_close(
                        got[what][key],
                        value,
                        rtol=1e-5,
                        atol=1e-6,
                        msg=lambda m, w=f"{where} {what} {key}": f"{w}: {m}",
                    )


#: Low-precision layouts: DeepSpeed's BF16 optimizer (ZeRO-1 + bf16) and ZeRO-3 fp32 masters; FSDP2 and
#: ZeroRedundancyOptimizer with bf16 parameters (the average is fp32 and set aside while swapped in).
MIXED = {"fsdp": ((1, "bf16-true"), (3, "bf16-true")), "deepspeed": ((1, "bf16-mixed"), (3, "bf16-mixed"))}


class AverageDtypes(L.Callback):
    """The dtypes of the averages EMA holds when training ends."""

    def __init__(self, ema: Any) -> None:
        self.ema = ema
        self.seen: set[torch.dtype] = set()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for layout in self.ema._layouts:
            self.seen.update(
                s["ema_weight"].dtype for s in layout.stateful.state.values() if "ema_weight" in s
            )


def _mixed_job(engine: str, root: str) -> dict[str, Any]:
    import lightning as L

    from lightning_shard import EMA, ShardStrategy

    out: dict[str, Any] = {}
    for stage, precision in MIXED[engine]:
        ckpt_dir = Path(root) / f"stage{stage}"
        for resume in (None, str(ckpt_dir / "epoch=0-step=3.ckpt")):
            ema, observer = EMA(decay=DECAY), Observer()
            dtypes = AverageDtypes(ema)
            callbacks: list[L.Callback] = [ema, observer, dtypes]
            if resume is None:
                callbacks.append(ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=3, save_top_k=-1))
            trainer = L.Trainer(
                devices=2,
                strategy=ShardStrategy(stage=stage, engine=engine),
                precision=precision,
                callbacks=callbacks,
                **trainer_kwargs(
                    max_steps=6, max_epochs=2, limit_val_batches=2, enable_checkpointing=resume is None
                ),
            )
            trainer.fit(sgd_gpt(), loader(4, n=N), loader(4, n=16), ckpt_path=resume)
            out[stage, resume is not None] = {
                "val": observer.val_losses,
                "weights": observer.weights,
                "dtypes": dtypes.seen,
            }
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_low_precision_keeps_fp32_averages_and_resumes_exactly(engine, tmp_path):
    results = run_ranks(_mixed_job, engine, str(tmp_path))[0]
    for stage, precision in MIXED[engine]:
        where = f"{engine} stage {stage} {precision}"
        run, resumed = results[stage, False], results[stage, True]
        assert run["dtypes"] == resumed["dtypes"] == {torch.float32}, where
        assert len(run["val"]) == 2, where
        for key, value in run["weights"].items():
            torch.testing.assert_close(resumed["weights"][key], value, rtol=0, atol=0, msg=f"{where} {key}")
