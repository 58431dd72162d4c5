"""Flag validation, registry names, precision mapping: one process, no process group."""

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_shard import ShardPrecision, ShardStrategy
from lightning_shard._modules import detect_block_classes, find_blocks, resolve_module_classes
from lightning_shard.demos import Block
from tests.helpers import make_engine, tiny_gpt


@pytest.mark.parametrize("stage", [-1, 4, "3", True, 2.5])
def test_stage_out_of_range(stage):
    with pytest.raises(ValueError, match=r"ShardStrategy\(stage=.*\) is not a ZeRO stage"):
        ShardStrategy(stage=stage)


def test_unknown_engine():
    with pytest.raises(
        ValueError, match=r"engine='megatron'\) is unknown. Use 'auto', 'fsdp' or 'deepspeed'"
    ):
        ShardStrategy(engine="megatron")


def test_unknown_checkpoint_mode():
    with pytest.raises(ValueError, match=r"checkpoint='zip'\) is unknown"):
        ShardStrategy(checkpoint="zip")


@pytest.mark.parametrize("name, stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_registered_names_equal_constructor(name, stage):
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    strategy = trainer.strategy
    reference = ShardStrategy(stage=stage)
    assert isinstance(strategy, ShardStrategy)
    assert (strategy.stage, strategy.engine_name, strategy.checkpoint_mode) == (
        reference.stage,
        reference.engine_name,
        reference.checkpoint_mode,
    )
    assert StrategyRegistry[name]["init_params"] == {"stage": stage}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_precision_maps_to_shard_precision(precision):
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ShardStrategy(), precision=precision, logger=False
    )
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ShardPrecision) and plugin.precision == precision


@pytest.mark.parametrize("precision", ["64-true", "16-true"])
def test_unsupported_precision_fails_at_construction(precision):
    with pytest.raises(
        ValueError, match=rf"precision='{precision}', which sharded training does not support"
    ):
        L.Trainer(accelerator="cpu", devices=2, strategy=ShardStrategy(), precision=precision, logger=False)


def test_explicit_shard_precision_is_kept():
    plugin = ShardPrecision("bf16-mixed", reduce_dtype=torch.float32)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ShardStrategy(), plugins=[plugin], logger=False
    )
    assert trainer.strategy.precision_plugin is plugin
    policy = plugin.policy.fsdp_mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_shard_precision_bad_values():
    with pytest.raises(ValueError, match=r"ShardPrecision got precision='fp8'"):
        ShardPrecision("fp8")
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.int32\) must be a floating torch.dtype"):
        ShardPrecision("bf16-mixed", reduce_dtype=torch.int32)


def test_shard_modules_accepts_import_paths_and_classes():
    assert ShardStrategy(shard_modules=["lightning_shard.demos.Block"]).config.shard_modules == (Block,)
    assert ShardStrategy(shard_modules={Block}).config.shard_modules == (Block,)
    assert resolve_module_classes("lightning_shard.demos.Block", "flag") == (Block,)


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            ["lightning_shard.demos.NoSuchBlock"],
            r"shard_modules=...\) entry 'lightning_shard.demos.NoSuchBlock' could not be imported",
        ),
        (["Block"], r"entry 'Block' is not an import path"),
        (["lightning_shard.demos.gpt.generate_text"], r"is .* not an nn.Module subclass"),
        ([3], r"entry 3 is neither an nn.Module subclass nor an import-path string"),
        ([], r"shard_modules=...\) is empty"),
    ],
)
def test_shard_modules_bad_entries(spec, match):
    with pytest.raises(ValueError, match=match):
        ShardStrategy(shard_modules=spec)


def test_block_detection_finds_the_repeated_layer():
    model = tiny_gpt()
    assert detect_block_classes(model) == (Block,)
    assert len(find_blocks(model, (Block,))) == 2
    assert detect_block_classes(nn.Linear(2, 2)) == ()


def test_shard_modules_matching_nothing_fails():
    engine = make_engine("fsdp", 3, shard_modules=(nn.GRU,))
    with pytest.raises(ValueError, match=r"shard_modules=\{GRU\}\) matches no submodule of GPTModule"):
        engine.setup_module(tiny_gpt())


def test_nothing_to_shard_fails():
    model = tiny_gpt().requires_grad_(False)
    with pytest.raises(ValueError, match=r"stage=3\) found no trainable parameters in GPTModule"):
        make_engine("fsdp", 3).check_module(model)


@pytest.mark.deepspeed
def test_a_meta_model_is_refused_by_deepspeed_stage_3_only():
    with torch.device("meta"):
        model = tiny_gpt()
    with pytest.raises(
        ValueError, match=r"built on the meta device, which ShardStrategy\(engine='deepspeed'"
    ):
        make_engine("deepspeed", 3).check_module(model)
    make_engine("deepspeed", 2).check_module(model)  # stages 0-2 allocate the whole model on each rank


def test_auto_stage_flags():
    assert ShardStrategy(stage="auto", device_memory="16GB").stage == "auto"
    assert ShardStrategy(stage="auto", offload_params="cpu", offload_optimizer="cpu").stage == 3
    with pytest.raises(
        ValueError, match=r"device_memory='16GB'\) is only used with stage='auto' \(got stage=2\)"
    ):
        ShardStrategy(stage=2, device_memory="16GB")
    with pytest.raises(ValueError, match=r"device_memory.*unknown unit"):
        ShardStrategy(stage="auto", device_memory="16XB")


@pytest.mark.deepspeed
def test_selective_checkpointing_with_deepspeed_zero3_is_refused():
    with pytest.raises(
        ValueError, match=r"engine='deepspeed', activation_checkpointing='selective'\) cannot run"
    ):
        ShardStrategy(stage=3, engine="deepspeed", activation_checkpointing="selective")
    ShardStrategy(stage=3, engine="deepspeed", activation_checkpointing="full")
    ShardStrategy(stage=2, engine="deepspeed", activation_checkpointing="selective")


def test_collective_failures_are_recognised_and_reported_with_the_timeout_flag(monkeypatch):
    from datetime import timedelta

    from lightning_shard import CollectiveTimeoutError
    from lightning_shard.core import processes
    from lightning_shard.core.processes import is_collective_failure

    # The error marks this process's collectives as failed: put the mark back after the test, or every
    # later Trainer call of this process on the default group still alive would refuse to run.
    monkeypatch.setattr(processes, "_collective_failed", False)

    gloo = RuntimeError(
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation"
    )
    peer = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:12198")
    assert is_collective_failure(gloo) and is_collective_failure(peer)
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(ValueError("timeout"))

    strategy = ShardStrategy(stage=3, timeout=timedelta(seconds=20))
    error = strategy._timeout_error("training_step", peer)
    assert isinstance(error, CollectiveTimeoutError)
    assert "ShardStrategy(timeout=0:00:20)" in str(error) and "training_step" in str(error)
    assert "peer [127.0.0.1]:12198" in str(error)
    assert strategy._timed_out


def test_ddp_strategy_options_are_accepted_at_stages_0_and_1_and_refused_elsewhere():
    import torch

    from lightning_shard import _ddp

    for stage in (0, 1):
        strategy = ShardStrategy(stage=stage, find_unused_parameters=True, static_graph=False)
        assert strategy.config.ddp_kwargs == {"find_unused_parameters": True, "static_graph": False}
    assert ShardStrategy(stage=1).config.ddp_kwargs == {}
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) find_unused_params\. Besides"):
        ShardStrategy(stage=1, find_unused_params=True)
    with pytest.raises(
        ValueError, match=r"find_unused_parameters=True\) are DistributedDataParallel options, used"
    ):
        ShardStrategy(stage=3, find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"engine='deepspeed' has no DDP wrapper"):
        ShardStrategy(stage=1, engine="deepspeed", gradient_as_bucket_view=True)
    with pytest.raises(
        ValueError, match=r"ddp_comm_hook=...\) and ShardPrecision\(reduce_dtype=torch.bfloat16\)"
    ):
        _ddp.check_comm_hook({"ddp_comm_hook": print}, torch.bfloat16)


@pytest.mark.deepspeed
def test_one_file_checkpoints_are_refused_with_the_deepspeed_engine_instead_of_ignored():
    with pytest.raises(ValueError, match=r"checkpoint='full'\) is not available with the DeepSpeed engine"):
        ShardStrategy(stage=3, engine="deepspeed", checkpoint="full")
    with pytest.raises(ValueError, match=r"checkpoint='full'\) is not available with the DeepSpeed engine"):
        ShardStrategy(stage=2, offload_optimizer="cpu", checkpoint="full")  # engine="auto" picks DeepSpeed


def test_a_checkpoint_url_is_resolved_or_refused_never_turned_into_a_local_path():
    from pathlib import Path

    from lightning_shard.checkpoint import local_path
    from lightning_shard.checkpoint.storage import Remote, resolve

    assert resolve("ckpt/last.ckpt", "ckpt_path") == Path("ckpt/last.ckpt")
    assert resolve("file:///tmp/run/last.ckpt", "ckpt_path") == Path("/tmp/run/last.ckpt")
    remote = resolve("s3://bucket/run/last.ckpt", "ckpt_path")
    assert isinstance(remote, Remote) and remote.key == "bucket/run/last.ckpt"
    assert remote.with_name("epoch=0-step=2.ckpt").url == "s3://bucket/run/epoch=0-step=2.ckpt"
    with pytest.raises(
        ValueError, match=r"ckpt_path='ftp://host/run/last.ckpt': ShardStrategy cannot write .* ftp://"
    ):
        resolve("ftp://host/run/last.ckpt", "ckpt_path")
    with pytest.raises(
        ValueError,
        match=r"dirpath='s3://bucket/run': this writer needs a local .*bucket mounted as a directory",
    ):
        local_path("s3://bucket/run", "dirpath")
