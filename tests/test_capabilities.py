"""Each engine's declaration (``Capabilities``) and the one refusal function that reads it, on one process."""

from __future__ import annotations

import importlib.util

import pytest

from lightning_shard.config import ShardConfig
from lightning_shard.engines import (
    NAMES,
    check,
    choose,
    configure,
    declared,
    engine_class,
    refusals,
)
from lightning_shard.flags import ShardFlags

FSDP, DEEPSPEED = declared("fsdp"), declared("deepspeed")


def test_every_registered_engine_declares_itself_under_its_own_name():
    assert NAMES == ("fsdp", "deepspeed")
    for name in NAMES:
        assert engine_class(name).capabilities.name == name
        assert engine_class(name).owns_step == declared(name).owns_step


def test_fsdp_serves_the_plain_flags_and_refuses_by_stage():
    assert refusals(ShardConfig.from_flags(engine="fsdp", stage=3), FSDP) == []
    config = ShardConfig.from_flags(engine="fsdp", stage=1, replicate_size=2, tensor_parallel_size=2)
    assert [m.split(":")[0] for m in refusals(config, FSDP)] == [
        "ShardStrategy(stage=1, replicate_size=2)",
        "ShardStrategy(stage=1, tensor_parallel_size=2) cannot run",
    ]
    ddp = ShardConfig.from_flags({"find_unused_parameters": True}, engine="fsdp", stage=2)
    assert refusals(ddp, FSDP) == [
        "ShardStrategy(find_unused_parameters=True) are DistributedDataParallel options, used at stages 0-1 only"
        " (got stage=2, where FSDP2 shards the model and no DDP wrapper exists). Use stage=0 or 1, or drop them"
        " (FSDP2 needs no find_unused_parameters: unused parameters get no gradient)."
    ]
    offloaded = ShardConfig.from_flags(engine="fsdp", stage=3, offload_optimizer="cpu")
    with pytest.raises(ValueError, match=r"engine='fsdp'.*cannot be served by FSDP2.*Use engine='deepspeed'"):
        check(offloaded, FSDP)


def test_fsdp_leaves_stage_auto_to_the_resolved_stage():
    config = ShardConfig.from_flags(engine="fsdp", stage="auto", replicate_size=2, expert_parallel_size=2)
    assert refusals(config, FSDP) == []
    assert refusals(config.replace(stage=2), FSDP) == []
    assert refusals(config.replace(stage=0), FSDP)[0].startswith("ShardStrategy(stage=0, replicate_size=2)")


def test_deepspeed_refuses_what_it_does_not_declare_and_quotes_the_flags_as_given():
    flags = ShardFlags(stage=3, skip_nonfinite=True, pipeline_parallel_size=2)
    config = ShardConfig.from_flags(**{**vars(flags), "engine": "deepspeed"})
    found = refusals(config, DEEPSPEED, flags)
    assert [m.split(")")[0] for m in found] == [
        "ShardStrategy(skip_nonfinite=True",
        "ShardStrategy(pipeline_parallel_size=2",
    ]
    assert "(chosen for engine='auto', offload_optimizer=None, offload_params=None)" in found[0]
    full = ShardConfig.from_flags(engine="deepspeed", stage=2, checkpoint="full")
    assert refusals(full, DEEPSPEED)[0].startswith(
        "ShardStrategy(checkpoint='full') is not available with the DeepSpeed engine, which writes its own"
    )


@pytest.mark.parametrize(("stage", "refused"), [(0, True), (1, False), (2, False), (3, True), ("auto", True)])
def test_deepspeed_experts_are_zero_1_2_parameters(stage, refused):
    config = ShardConfig.from_flags(engine="deepspeed", stage=stage, expert_parallel_size=2)
    assert bool(refusals(config, DEEPSPEED)) == refused
    if refused:
        with pytest.raises(
            ValueError, match=rf"expert_parallel_size=2, engine='deepspeed', stage={stage!r}\)"
        ):
            check(config, DEEPSPEED)


def test_deepspeed_selective_checkpointing_below_stage_3_only():
    for stage, refused in ((2, False), (3, True)):
        config = ShardConfig.from_flags(engine="deepspeed", stage=stage, activation_checkpointing="selective")
        assert bool(refusals(config, DEEPSPEED)) == refused


def test_deepspeed_missing_is_refused(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    with pytest.raises(ValueError, match=r"needs DeepSpeed .* pip install --no-build-isolation"):
        check(ShardConfig.from_flags(engine="deepspeed", stage=2), DEEPSPEED)


def test_auto_takes_the_first_engine_that_serves_the_offload_flags():
    assert choose(ShardFlags()) is FSDP
    assert choose(ShardFlags(offload_optimizer="cpu", offload_params="cpu")) is FSDP
    assert choose(ShardFlags(offload_optimizer="cpu")) is DEEPSPEED
    assert choose(ShardFlags(engine="deepspeed")) is DEEPSPEED
    assert configure(stage=3, offload_optimizer="cpu").engine == "deepspeed"
    with pytest.raises(
        ValueError, match=r"^ShardStrategy\(engine='ddp'\) is unknown\. Use 'auto', 'fsdp' or"
    ):
        choose(ShardFlags(engine="ddp"))  # type: ignore[arg-type]


def test_from_flags_needs_the_engine_chosen():
    with pytest.raises(ValueError, match=r"from_flags\(engine='auto'\) needs the engine chosen first"):
        ShardConfig.from_flags(stage=3)
