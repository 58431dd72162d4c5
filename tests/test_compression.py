"""``gradient_compression=`` flag rules: refused with the fix wherever DDP's all-reduce does not run."""

from __future__ import annotations

import pytest
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_shard import ShardStrategy


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(gradient_compression="int4"), r"must be 'bf16', 'fp16', 'powersgd', 'onebit_adam' or a dict"),
        (dict(stage=1, gradient_compression="onebit_adam"), r"needs stage=0, got stage=1.*ZeRO-1 partitions"),
        (
            dict(stage=0, gradient_compression={"method": "onebit_adam", "freeze_step": 0}),
            r"freeze_step=0 must be an int >= 1",
        ),
        (
            dict(stage=0, gradient_compression={"method": "onebit_adam", "chunks": 4}),
            r"has \['chunks'\]; 1-bit Adam takes 'freeze_step'",
        ),
        (
            dict(stage=0, checkpoint="full", gradient_compression="onebit_adam"),
            r"checkpoint='full'.*'sharded'",
        ),
        (dict(gradient_compression={"method": "fp16", "rank": 2}), r"fp16 takes no options"),
        (
            dict(gradient_compression={"method": "powersgd", "ranks": 2}),
            r"has \['ranks'\], which PowerSGDState",
        ),
        (
            dict(stage=2, gradient_compression="powersgd"),
            r"applies at stages 0-1.*ShardPrecision\(reduce_dtype=torch.bfloat16\)",
        ),
        (dict(stage=1, checkpoint="full", gradient_compression="powersgd"), r"checkpoint='full'.*'sharded'"),
        (
            dict(stage=0, tensor_parallel_size=2, gradient_compression="fp16"),
            r"tensor_parallel_size=2.*replicate\(\), which has no communication hook",
        ),
        (
            dict(stage=1, gradient_compression="fp16", ddp_comm_hook=default_hooks.fp16_compress_hook),
            r"gradient_compression='fp16'\) and ddp_comm_hook=\.\.\. both set",
        ),
    ],
)
def test_bad_compression_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        ShardStrategy(**flags)


def test_compression_on_the_deepspeed_engine_is_refused():
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match=r"engine='deepspeed' does not run.*1-bit Adam"):
        ShardStrategy(stage=1, engine="deepspeed", gradient_compression="powersgd")


def test_powersgd_options_take_torch_names_and_short_ones():
    config = ShardStrategy(
        stage=1, gradient_compression={"method": "powersgd", "rank": 4, "warm_start": False}
    ).config
    assert config.gradient_compression == {
        "method": "powersgd",
        "matrix_approximation_rank": 4,
        "warm_start": False,
    }
