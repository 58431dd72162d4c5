"""Precision rules the DeepSpeed engine applies before any process starts (one process, no DeepSpeed import)."""

from __future__ import annotations

import pytest
import torch

from lightning_shard import ShardPrecision
from lightning_shard.engines.deepspeed import DeepSpeedEngine


def _config(stage: int, precision: ShardPrecision) -> dict:
    return DeepSpeedEngine(stage, precision).config(1, None, None, torch.device("cpu"))


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
        DeepSpeedEngine(0, ShardPrecision("16-mixed"))


def test_deepspeed_reduce_dtype_it_cannot_communicate_is_refused():
    with pytest.raises(
        ValueError,
        match=r"ShardPrecision\(reduce_dtype=torch.float64\) is not available with engine='deepspeed'",
    ):
        DeepSpeedEngine(2, ShardPrecision("bf16-mixed", reduce_dtype=torch.float64))
