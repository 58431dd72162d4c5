"""Patterns real projects use, each run under Lightning's DDPStrategy and under ShardStrategy on the same
2 ranks and data, with the same answer: two optimizers stepping inside one training_step (GANs, RL,
meta-learning), a model built in configure_model, and DDPStrategy's own keyword arguments."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_shard import ShardStrategy
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import ENGINES, CausalLM, LossRecorder, loader, tiny_llama_config, trainer_kwargs

pytestmark = pytest.mark.multirank


class GAN(L.LightningModule):
    """Two optimizers stepped in one training_step: the generator's loss goes through the discriminator
    right after the discriminator's step, and must see the stepped weights."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.record: list[list[float]] = []

    def _d_loss(self, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
        return F.softplus(-self.discriminator(real)).mean() + F.softplus(self.discriminator(fake)).mean()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        fake = self.generator(z).detach()
        d_loss = self._d_loss(real, fake)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        with torch.no_grad():
            d_after = self._d_loss(real, fake)  # the same batch through the stepped discriminator
        g_loss = F.softplus(-self.discriminator(self.generator(z))).mean()
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        with torch.no_grad():
            g_after = F.softplus(-self.discriminator(self.generator(z))).mean()
        losses = torch.stack([d_loss.detach(), d_after, g_loss.detach(), g_after])
        self.record.append(self.trainer.strategy.reduce(losses, reduce_op="mean").tolist())

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.generator.parameters(), lr=0.5),
            torch.optim.SGD(self.discriminator.parameters(), lr=0.5),
        )


def _gan_data(rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    real, z = torch.randn(32, 8, generator=g) + 2.0, torch.randn(32, 8, generator=g)
    return DataLoader(TensorDataset(real[rank::2], z[rank::2]), batch_size=4)


def _gan(strategy: Any) -> list[list[float]]:
    trainer = L.Trainer(devices=2, strategy=strategy, **trainer_kwargs(max_steps=6))
    model = GAN()
    trainer.fit(model, _gan_data(trainer.global_rank))
    return model.record


def _gan_job() -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    out = {"ddp": _gan(DDPStrategy(find_unused_parameters=True))}
    for stage in (0, 1):
        out[f"stage{stage}"] = _gan(ShardStrategy(stage=stage, find_unused_parameters=True))
    for stage in (2, 3):
        out[f"stage{stage}"] = _gan(ShardStrategy(stage=stage))
    return out


def test_two_optimizers_the_second_forward_sees_the_first_step_at_every_stage():
    out = run_ranks(_gan_job)[0]
    ddp = torch.tensor(out.pop("ddp"))
    # Under DDP the step moves the loss of the same batch (else this test could not see stale weights).
    assert (ddp[:, 0] - ddp[:, 1]).abs().min() > 1e-3
    for name, record in out.items():
        torch.testing.assert_close(
            torch.tensor(record), ddp, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def _configure_model(engine: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    def fit(strategy: Any) -> list[float]:
        L.seed_everything(3)
        recorder = LossRecorder()
        trainer = L.Trainer(devices=2, strategy=strategy, callbacks=[recorder], **trainer_kwargs(max_steps=3))
        # A Hugging Face model with its default config, built in configure_model (Lightning's recipe).
        trainer.fit(CausalLM(tiny_llama_config(), "sgd", build_in_configure_model=True), loader(4))
        return recorder.losses

    out = {"ddp": fit(DDPStrategy())}
    for stage in (0, 1, 2, 3) if engine == "fsdp" else (1, 2, 3):
        out[f"stage{stage}"] = fit(ShardStrategy(stage=stage, engine=engine))
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_a_model_built_in_configure_model_trains_as_under_ddp(engine):
    out = run_ranks(_configure_model, engine)[0]
    ddp = out.pop("ddp")
    for name, losses in out.items():
        torch.testing.assert_close(losses, ddp, rtol=1e-5, atol=0, msg=lambda m, n=name: f"{engine} {n}: {m}")


def _averaging_refused() -> str:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    trainer = L.Trainer(
        devices=2,
        strategy=ShardStrategy(stage=3),
        callbacks=[EMAWeightAveraging()],
        **trainer_kwargs(max_steps=1),
    )
    try:
        trainer.fit(CausalLM(tiny_llama_config(), "sgd"), loader(4))
    except ValueError as error:
        return str(error)
    return "trained"


def test_lightnings_weight_averaging_is_refused_at_setup_naming_lightning_shard_ema():
    message = run_ranks(_averaging_refused)[0]
    assert "ShardStrategy(stage=3, engine='fsdp') cannot run Lightning's EMAWeightAveraging" in message
    assert "lightning_shard.EMA" in message


class LoRALM(CausalLM):
    """A Hugging Face Llama under peft LoRA adapters: only the adapters train, the base stays frozen."""

    def __init__(self) -> None:
        import peft

        torch.manual_seed(0)
        super().__init__(tiny_llama_config(), "sgd")
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        self.model = peft.get_peft_model(self.model, config)
        with torch.no_grad():  # non-zero adapters, so the base's gradients would be non-zero too
            for name, param in self.model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


def _already_right(engine: str) -> dict[str, Any]:
    """peft LoRA, Hugging Face's own gradient checkpointing, and a second Trainer on a model already
    sharded by a first one, each under DDP and ShardStrategy."""
    from lightning.pytorch.strategies import DDPStrategy

    from tests.helpers import full_weights

    def fit(trainer_strategy: Any, model: L.LightningModule, steps: int = 3) -> list[float]:
        recorder = LossRecorder()
        trainer = L.Trainer(
            devices=2, strategy=trainer_strategy, callbacks=[recorder], **trainer_kwargs(max_steps=steps)
        )
        trainer.fit(model, loader(4))
        model._last_trainer = trainer  # type: ignore[attr-defined]
        return recorder.losses

    makers: dict[str, Any] = {"ddp": DDPStrategy}
    for stage in (1, 3):
        makers[f"stage{stage}"] = lambda stage=stage: ShardStrategy(stage=stage, engine=engine)
    out: dict[str, Any] = {}
    for name, make in makers.items():
        lora = LoRALM()
        frozen = {k: v.detach().clone() for k, v in lora.model.named_parameters() if not v.requires_grad}
        out[name, "lora"] = fit(make(), lora)
        # By the LightningModule's names (DeepSpeed's engine module adds "module.").
        after = {k.removeprefix("module."): v for k, v in full_weights(lora._last_trainer).items()}
        compared = [torch.equal(after[f"model.{k}"], v) for k, v in frozen.items() if f"model.{k}" in after]
        # Every frozen base weight found among the trained ones (not a vacuous all([])), and none moved.
        out[name, "lora_base_unchanged"] = len(compared) == len(frozen) > 0 and all(compared)
        torch.manual_seed(0)
        checkpointed = CausalLM(tiny_llama_config(), "sgd")
        checkpointed.model.gradient_checkpointing_enable()
        out[name, "hf_checkpointing"] = fit(make(), checkpointed)
        torch.manual_seed(0)
        twice = CausalLM(tiny_llama_config(), "sgd")
        out[name, "first_trainer"] = fit(make(), twice, steps=2)
        out[name, "second_trainer"] = fit(make(), twice, steps=2)  # a new Trainer and strategy, same model
    return out


@pytest.mark.parametrize("engine", ENGINES)
def test_lora_hf_checkpointing_and_a_second_trainer_train_as_under_ddp(engine):
    pytest.importorskip("peft")
    out = run_ranks(_already_right, engine)[0]
    for (name, case), got in out.items():
        if case == "lora_base_unchanged":
            assert got is True, name
            continue
        torch.testing.assert_close(
            got, out["ddp", case], rtol=1e-5, atol=0, msg=lambda m, w=(name, case): f"{w}: {m}"
        )
