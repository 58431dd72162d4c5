"""Precision rules the DeepSpeed engine applies before any process starts (one process, no DeepSpeed import)."""

from __future__ import annotations

import pytest
import torch

from lightning_shard import ShardPrecision
from lightning_shard.engines import TrainSettings
from tests.helpers import make_engine


def _config(stage: int, precision: ShardPrecision) -> dict:
    return make_engine("deepspeed", stage, precision).ds_config(TrainSettings())


@pytest.fixture
def cpu_fp16(monkeypatch):
    """DeepSpeed's config for 16-mixed is checked on any CPU: pretend this one serves fp16."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: True)


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
def test_deepspeed_reduces_gradients_in_reduce_dtype(cpu_fp16, precision, reduce_dtype, expected):
    config = _config(2, ShardPrecision(precision, reduce_dtype=reduce_dtype))
    assert config.get("communication_data_type") == expected


def test_deepspeed_fp16_keeps_a_dynamic_loss_scale(cpu_fp16):
    config = _config(2, ShardPrecision("16-mixed"))
    assert config["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    assert "bf16" not in config


def test_deepspeed_fp16_without_zero_is_refused():
    with pytest.raises(
        ValueError,
        match=r"ShardStrategy\(stage=0, engine='deepspeed'\) cannot run precision='16-mixed'.*Use stage=1 or higher",
    ):
        make_engine("deepspeed", 0, ShardPrecision("16-mixed"))


def test_deepspeed_fp16_on_a_cpu_without_fp16_is_refused_at_setup(monkeypatch):
    from lightning_shard.engines import engine_class
    from lightning_shard.engines.deepspeed.precision import check_device_precision, cpu_supports_fp16

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)  # e.g. AMD EPYC
    assert not cpu_supports_fp16()
    # Trainer construction cannot know the device: the flags pass there, and fail once set-up knows it.
    engine_class("deepspeed").check_precision(2, ShardPrecision("16-mixed"))
    with pytest.raises(
        ValueError,
        match=r"ShardStrategy\(engine='deepspeed'\) cannot run precision='16-mixed' on this CPU: DeepSpeed's CPU"
        r" accelerator has no fp16 support here \(torch.ops.mkldnn._is_mkldnn_fp16_supported\(\) is False.*"
        r" Use precision='bf16-mixed', or engine='fsdp' .*, or a GPU\.",
    ):
        make_engine("deepspeed", 2, ShardPrecision("16-mixed"))
    make_engine("deepspeed", 2, ShardPrecision("bf16-mixed"))  # DeepSpeed's CPU bf16 needs no probe
    check_device_precision(torch.device("cuda"), ShardPrecision("16-mixed"))  # only the CPU is probed


def test_a_torch_without_the_fp16_probe_counts_as_no_fp16(monkeypatch):
    from lightning_shard.engines.deepspeed.precision import cpu_supports_fp16

    def missing() -> bool:
        raise RuntimeError("No such operator mkldnn::_is_mkldnn_fp16_supported")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", missing)
    assert not cpu_supports_fp16()


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
