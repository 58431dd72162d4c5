"""Precision rules the DeepSpeed engine applies before any process starts (one process, no DeepSpeed import)."""

from __future__ import annotations

import pytest
import torch

from lightning_shard import ShardPrecision
from lightning_shard.engines import TrainSettings
from tests.helpers import make_engine


def _config(stage: int, precision: ShardPrecision) -> dict:
    return make_engine("deepspeed", stage, precision).ds_config(TrainSettings())


@pytest.mark.parametrize(
    "precision, reduce_dtype, expected",
    [
        ("bf16-mixed", None, "fp32"),
        ("16-mixed", None, "fp32"),
        ("bf16-mixed", torch.bfloat16, "bf16"),
        ("16-mixed", torch.float16, "fp16"),
        ("32-true", None, None),
    ],
)
def test_deepspeed_reduces_gradients_in_reduce_dtype(precision, reduce_dtype, expected):
    config = _config(2, ShardPrecision(precision, reduce_dtype=reduce_dtype))
    assert config.get("communication_data_type") == expected


def test_deepspeed_fp16_keeps_a_dynamic_loss_scale():
    config = _config(2, ShardPrecision("16-mixed"))
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    assert "bf16" not in config


def test_deepspeed_fp16_without_zero_is_refused():
    with pytest.raises(
        ValueError,
        match=r"ShardStrategy\(stage=0, engine='deepspeed'\) cannot run precision='16-mixed'.*Use stage=1 or higher",
    ):
        make_engine("deepspeed", 0, ShardPrecision("16-mixed"))


def test_deepspeed_reduce_dtype_it_cannot_communicate_is_refused():
    with pytest.raises(
        ValueError,
        match=r"ShardPrecision\(reduce_dtype=torch.float64\) is not available with engine='deepspeed'",
    ):
        make_engine("deepspeed", 2, ShardPrecision("bf16-mixed", reduce_dtype=torch.float64))


@pytest.mark.deepspeed
def test_deepspeed_precision_refusals_fail_when_the_trainer_is_built():
    import lightning as L

    from lightning_shard import ShardStrategy

    with pytest.raises(ValueError, match=r"cannot run precision='bf16-true'"):
        L.Trainer(
            accelerator="cpu", strategy=ShardStrategy(stage=2, engine="deepspeed"), precision="bf16-true"
        )
    with pytest.raises(
        ValueError, match=r"ShardStrategy\(stage=0, engine='deepspeed'\) cannot run precision='16-mixed'"
    ):
        L.Trainer(
            accelerator="cpu",
            strategy=ShardStrategy(stage=0, engine="deepspeed"),
            plugins=[ShardPrecision("16-mixed")],
        )
