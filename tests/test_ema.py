"""EMA in one process: the averaging math, its schedule, the swaps, checkpoints, optimizer hooks, refusals."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
    WeightAveraging,
)
from torch.optim.swa_utils import get_ema_multi_avg_fn

from lightning_shard import EMA
from lightning_shard.averaging._hooks import AverageHooks
from lightning_shard.averaging._layouts import KEY, layout_of
from lightning_shard.trainer._refused_callbacks import check_callbacks
from tests.helpers import loader, tiny_gpt, trainer_kwargs

DECAY = 0.7


def sgd_gpt() -> L.LightningModule:
    """The tiny GPT with plain SGD (no optimizer state of its own) and a validation loss."""
    model = tiny_gpt()

    def configure_optimizers() -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.5)

    def validation_step(batch: Any, batch_idx: int) -> None:
        x, y = batch
        model.log("val_loss", F.cross_entropy(model(x).flatten(0, 1), y.flatten()))

    model.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    model.validation_step = validation_step  # type: ignore[method-assign]
    return model


class WeightRecorder(L.Callback):
    """The weights after every optimizer step (recorded before any averaging callback sees them)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.val_weights: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.val_weights.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})


def hand_ema(
    steps: list[dict[str, torch.Tensor]], decay: float, chosen: list[int]
) -> dict[str, torch.Tensor]:
    ema: dict[str, torch.Tensor] = {}
    for i in chosen:
        ema = (
            {k: v.clone() for k, v in steps[i].items()}
            if not ema
            else {k: decay * ema[k] + (1 - decay) * steps[i][k] for k in ema}
        )
    return ema


def _fit(callbacks: list[L.Callback], n: int = 64, **kwargs: Any) -> tuple[L.Trainer, L.LightningModule]:
    model, val = sgd_gpt(), kwargs.pop("val", None)
    trainer = L.Trainer(callbacks=callbacks, **trainer_kwargs(**kwargs))
    trainer.fit(model, loader(8, n=n), val)
    return trainer, model


def test_final_weights_are_the_hand_computed_average_and_lightnings():
    recorder = WeightRecorder()
    _, model = _fit([recorder, EMA(decay=DECAY)], max_steps=6)
    expected = hand_ema(recorder.steps, DECAY, list(range(6)))
    _, lightning = _fit([EMAWeightAveraging(decay=DECAY)], max_steps=6)
    lightning_weights = dict(lightning.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p.detach(), lightning_weights[name].detach(), rtol=1e-5, atol=1e-7)
    assert not torch.equal(expected["model.tok_emb.weight"], recorder.steps[-1]["model.tok_emb.weight"])


def test_update_is_torchs_multi_average_in_fp32():
    recorder = WeightRecorder()
    ema = EMA(decay=DECAY)
    trainer, model = _fit([recorder, ema], max_steps=3)
    # torch's own EMA over the same three weights, in fp32.
    averages = [t.clone() for t in recorder.steps[0].values()]
    for step in recorder.steps[1:]:
        get_ema_multi_avg_fn(DECAY)(averages, list(step.values()), None)
    for got, want in zip(model.parameters(), averages, strict=True):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    assert ema.n_averaged == 3


def test_schedule_matches_ema_weight_averaging():
    ours = EMA(update_every_n_steps=3, update_starting_at_step=4, update_starting_at_epoch=2)
    lightning = EMAWeightAveraging(
        update_every_n_steps=3, update_starting_at_step=4, update_starting_at_epoch=2
    )
    for step in range(20):
        assert ours.should_update(step_idx=step) == lightning.should_update(step_idx=step), step
    for epoch in range(5):
        assert ours.should_update(epoch_idx=epoch) == lightning.should_update(epoch_idx=epoch), epoch
    assert not EMA(update_every_n_steps=0).should_update(step_idx=0)


def test_schedule_chooses_the_steps_averaged():
    recorder = WeightRecorder()
    _, model = _fit(
        [recorder, EMA(decay=DECAY, update_every_n_steps=2, update_starting_at_step=1)], max_steps=8
    )
    expected = hand_ema(recorder.steps, DECAY, [2, 4, 6])  # zero-based steps >= 1 divisible by 2
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-7)


def test_validation_sees_the_average_and_training_continues_from_the_weights():
    recorder = WeightRecorder()
    val = loader(8, n=16)
    trainer, _ = _fit([recorder, EMA(decay=DECAY)], max_steps=6, val_check_interval=3, val=val)
    plain = WeightRecorder()
    _fit([plain], max_steps=6, val_check_interval=3, val=val)
    # Validation after steps 3 and 6 (two batches each) saw the average of the steps so far...
    assert len(recorder.val_weights) == 4
    for seen, upto in zip(recorder.val_weights[::2], (3, 6), strict=True):
        expected = hand_ema(recorder.steps, DECAY, list(range(upto)))
        for name, value in expected.items():
            torch.testing.assert_close(seen[name], value, rtol=1e-5, atol=1e-7)
    # ...and training went on from the trained weights, as without EMA.
    for got, want in zip(recorder.steps, plain.steps, strict=True):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_resume_gives_the_uninterrupted_average(tmp_path):
    recorder = WeightRecorder()
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    # Three steps an epoch: the checkpoint at step 3 sits at an epoch boundary.
    _, uninterrupted = _fit(
        [recorder, EMA(decay=DECAY), checkpoint], n=24, max_steps=6, enable_checkpointing=True
    )
    model = sgd_gpt()
    resumed = EMA(decay=DECAY)
    trainer = L.Trainer(callbacks=[resumed], **trainer_kwargs(max_steps=6))
    trainer.fit(model, loader(8, n=24), ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    assert resumed.n_averaged == 6
    for got, want in zip(model.parameters(), uninterrupted.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    saved = torch.load(tmp_path / "epoch=0-step=3.ckpt", weights_only=False)
    averages = [entry[KEY] for entry in saved["optimizer_states"][0]["state"].values()]
    assert len(averages) == len(list(model.parameters())) and all(a.dtype == torch.float32 for a in averages)


def test_resume_without_averages_starts_again_with_a_warning(tmp_path):
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _fit([checkpoint], n=24, max_steps=3, enable_checkpointing=True)
    path = tmp_path / "epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=False)
    saved["callbacks"] = {EMA(decay=DECAY).state_key: EMA(decay=DECAY).state_dict() | {"n_averaged": 3}}
    torch.save(saved, path)
    recorder, ema = WeightRecorder(), EMA(decay=DECAY)
    trainer = L.Trainer(callbacks=[recorder, ema], **trainer_kwargs(max_steps=5))
    with pytest.warns(UserWarning, match="holds no averages of the weights although 3 updates"):
        trainer.fit(sgd_gpt(), loader(8, n=24), ckpt_path=str(path))
    assert ema.n_averaged == 2
    expected = hand_ema(recorder.steps, DECAY, [0, 1])
    for name, p in trainer.lightning_module.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=1e-5, atol=1e-7)


class Normed(L.LightningModule):
    """A BatchNorm model: floating-point running statistics and an integer counter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_normed(callback: L.Callback) -> Normed:
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(40, 4, generator=g)), batch_size=8
    )
    model = Normed()
    L.Trainer(callbacks=[callback], **trainer_kwargs(max_steps=5)).fit(model, data)
    return model


@pytest.mark.parametrize("use_buffers", [True, False])
def test_buffers_are_averaged_like_lightnings(use_buffers):
    ours = _fit_normed(EMA(decay=DECAY, use_buffers=use_buffers)).state_dict()
    lightning = _fit_normed(EMAWeightAveraging(decay=DECAY, use_buffers=use_buffers)).state_dict()
    for name, value in ours.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, lightning[name], rtol=1e-5, atol=1e-7, msg=name)
    plain = _fit_normed(L.Callback()).state_dict()
    changed = not torch.equal(ours["net.1.running_mean"], plain["net.1.running_mean"])
    assert changed == use_buffers


# --- optimizer hooks ------------------------------------------------------------------------------


def _adam() -> tuple[torch.nn.Parameter, torch.optim.Adam]:
    p = torch.nn.Parameter(torch.ones(3))
    return p, torch.optim.Adam([p], lr=0.1)


def test_the_average_is_hidden_from_the_step():
    p, adam = _adam()
    hooks = AverageHooks(adam, lambda: False)
    adam.state[p][KEY] = torch.full((3,), 7.0)  # an average before Adam's first step (a skipped step)
    p.grad = torch.ones(3)
    adam.step()
    assert set(adam.state[p]) == {"step", "exp_avg", "exp_avg_sq", KEY}
    assert torch.equal(adam.state[p][KEY], torch.full((3,), 7.0))
    hooks.remove()
    _, bare = _adam()
    bare.state[bare.param_groups[0]["params"][0]][KEY] = torch.zeros(3)
    bare.param_groups[0]["params"][0].grad = torch.ones(3)
    with pytest.raises(KeyError, match="exp_avg"):
        bare.step()  # what the hook prevents


def test_loading_keeps_the_average_in_fp32():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    sgd = torch.optim.SGD([p], lr=0.1)
    AverageHooks(sgd, lambda: False)
    average = torch.tensor([1.0, 1.0 + 2**-12, 3.0])  # not a bfloat16 value
    sgd.load_state_dict({"state": {0: {KEY: average}}, "param_groups": sgd.state_dict()["param_groups"]})
    assert sgd.state[p][KEY].dtype == torch.float32
    assert torch.equal(sgd.state[p][KEY], average)


def test_placeholders_only_when_asked_and_missing():
    p, adam = _adam()
    wanted = {"yes": False}
    AverageHooks(adam, lambda: wanted["yes"])
    assert adam.state_dict()["state"] == {}
    wanted["yes"] = True
    state = adam.state_dict()["state"]
    assert torch.equal(state[0][KEY], torch.zeros(3)) and state[0][KEY].dtype == torch.float32
    assert KEY not in adam.state[p]  # the live state is untouched
    adam.state[p][KEY] = torch.ones(3)
    assert torch.equal(adam.state_dict()["state"][0][KEY], torch.ones(3))


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"decay": 1.5}, r"EMA\(decay=1.5\) must be between 0 and 1"),
        ({"decay": -0.1}, r"EMA\(decay=-0.1\) must be between 0 and 1"),
        ({"update_every_n_steps": -1}, r"EMA\(update_every_n_steps=-1\) must be 0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EMA(**kwargs)


def test_layouts_refuse_what_they_cannot_average():
    with pytest.raises(ValueError, match="cannot average weights DeepSpeed swaps to NVMe"):
        layout_of(SimpleNamespace(swap_optimizer=True))
    with pytest.raises(ValueError, match="cannot find the weights SimpleNamespace steps"):
        layout_of(SimpleNamespace())


def _trainer_with(callback: L.Callback) -> L.Trainer:
    return L.Trainer(callbacks=[callback], **trainer_kwargs())


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(
    "callback",
    [EMAWeightAveraging(), WeightAveraging(), StochasticWeightAveraging(swa_lrs=0.1)],
    ids=["EMAWeightAveraging", "WeightAveraging", "StochasticWeightAveraging"],
)
def test_lightning_averaging_is_refused_on_sharded_parameters(stage, callback):
    name = type(callback).__name__
    with pytest.raises(
        ValueError,
        match=rf"ShardStrategy\(stage={stage}\) cannot run Lightning's {name} callback: it copies whole tensors"
        rf" into parameters that are FSDP2 shards \(DTensor\) at stage {stage}\. Use lightning_shard.EMA",
    ):
        check_callbacks(_trainer_with(callback), f"ShardStrategy(stage={stage})", stage, "fsdp")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lightning_averaging_is_refused_under_deepspeed(stage):
    where = f"ShardStrategy(stage={stage}, engine='deepspeed')"
    with pytest.raises(
        ValueError,
        match=r"cannot run Lightning's StochasticWeightAveraging callback: .*DeepSpeed's ZeRO optimizer is not a"
        r" torch Optimizer\. Use lightning_shard.EMA",
    ):
        check_callbacks(_trainer_with(StochasticWeightAveraging(swa_lrs=0.1)), where, stage, "deepspeed")
    with pytest.raises(
        ValueError,
        match=r"cannot run Lightning's EMAWeightAveraging callback: it copies the model's parameters, which"
        r" DeepSpeed partitions .*Use lightning_shard.EMA\(decay=...\) instead",
    ):
        check_callbacks(_trainer_with(EMAWeightAveraging()), where, stage, "deepspeed")


@pytest.mark.parametrize("stage", [0, 1])
def test_lightning_averaging_is_allowed_at_stages_0_and_1(stage):
    # Their results and resumes equal DDPStrategy's: tests/test_ema_multirank.py.
    for callback in (EMAWeightAveraging(), WeightAveraging()):
        check_callbacks(_trainer_with(callback), f"ShardStrategy(stage={stage})", stage, "fsdp")
    check_callbacks(_trainer_with(StochasticWeightAveraging(swa_lrs=0.1)), "ShardStrategy()", stage, "fsdp")
    check_callbacks(_trainer_with(EMA()), "ShardStrategy()", 3, "deepspeed")
