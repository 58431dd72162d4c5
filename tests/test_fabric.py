"""ShardFabricStrategy in one process: flags, names, precision, refusals and their messages."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch import nn

from lightning_shard import ShardFabricStrategy, ShardStrategy
from lightning_shard.core.registry import NAMES
from lightning_shard.fabric import _checkpoint
from lightning_shard.fabric._precision import FabricShardPrecision
from lightning_shard.fabric._setup import parameter_names, rebind

_NAMES = [
    pytest.param(name, marks=pytest.mark.deepspeed) if name == "zero2_offload" else name
    for name in NAMES
    if name != "zero3_offload_nvme"
]


@pytest.mark.parametrize("name", _NAMES)
def test_each_name_is_the_equivalent_constructor_call(name):
    strategy = STRATEGY_REGISTRY.get(name)
    assert isinstance(strategy, ShardFabricStrategy)
    assert strategy.config == ShardFabricStrategy(**NAMES[name][1]).config
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, ShardFabricStrategy)
    assert fabric.strategy.config == ShardStrategy(**NAMES[name][1]).config  # the Trainer's flags, too


def test_nvme_name_needs_the_swap_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("LIGHTNING_SHARD_NVME_PATH", raising=False)
    with pytest.raises(ValueError, match="LIGHTNING_SHARD_NVME_PATH.*ShardFabricStrategy"):
        STRATEGY_REGISTRY.get("zero3_offload_nvme")


def test_a_trainer_strategy_given_to_fabric_names_the_fabric_twin():
    with pytest.raises(ValueError, match=r"ShardStrategy\(stage=3.*ShardFabricStrategy.*\.fabric\(\)"):
        L.Fabric(strategy=ShardStrategy(stage=3), accelerator="cpu", devices=2)


def test_fabric_twin_of_a_trainer_strategy_has_its_validated_flags():
    trainer_side = ShardStrategy(stage=1, find_unused_parameters=True, checkpoint="full")
    fabric_side = trainer_side.fabric()
    assert isinstance(fabric_side, ShardFabricStrategy)
    assert fabric_side.config == trainer_side.config
    assert (
        fabric_side.config
        == ShardFabricStrategy(stage=1, find_unused_parameters=True, checkpoint="full").config
    )


def test_flags_are_validated_as_for_the_trainer():
    with pytest.raises(ValueError, match="offload_params"):
        ShardFabricStrategy(stage=2, offload_params="cpu")
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        ShardFabricStrategy(stage=3, no_such_flag=1)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"stage": "auto"}, r"stage='auto'.*lightning-shard plan"),
        ({"stage": 3, "skip_nonfinite": True}, r"skip_nonfinite=True.*isfinite"),
    ],
)
def test_trainer_only_flags_are_refused_with_the_fix(flags, match):
    with pytest.raises(ValueError, match=match):
        ShardFabricStrategy(**flags)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_fabric_precision_becomes_the_engines_shard_precision(precision):
    fabric = L.Fabric(
        strategy=ShardFabricStrategy(stage=3), accelerator="cpu", devices=2, precision=precision
    )
    plugin = fabric.strategy.precision
    assert isinstance(plugin, FabricShardPrecision) and plugin.policy.precision == precision


def test_a_shard_precision_plugin_sets_the_reduction_dtype():
    from lightning_shard import ShardPrecision

    plugin = ShardPrecision("bf16-mixed", reduce_dtype=torch.bfloat16)
    fabric = L.Fabric(strategy=ShardFabricStrategy(stage=3), accelerator="cpu", devices=2, plugins=[plugin])
    # the Trainer's plugin holds a torch-level policy: Fabric's adapter takes that very policy
    assert fabric.strategy.precision.policy is plugin.policy
    assert fabric.strategy.precision.policy.reduce_dtype == torch.bfloat16


def test_an_unsupported_precision_fails_when_fabric_is_built():
    with pytest.raises(ValueError, match="precision='16-true'.*bf16-mixed"):
        L.Fabric(strategy=ShardFabricStrategy(stage=3), accelerator="cpu", devices=2, precision="16-true")


def test_set_up_order_and_engine_refusals_name_the_fix():
    strategy = ShardFabricStrategy(stage=3)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="setup_module.*setup_optimizers"):
        strategy.setup_optimizer(optimizer)
    with pytest.raises(RuntimeError, match="fabric.launch"):
        strategy.engine  # noqa: B018
    with pytest.raises(RuntimeError, match="fabric.launch"):
        strategy.device_mesh  # noqa: B018
    with pytest.raises(RuntimeError, match="no model is set up"):
        strategy.save_checkpoint("x", {"optimizer": optimizer})
    with pytest.raises(ValueError, match="norm_type=2.0"):
        strategy.clip_gradients_norm(nn.Linear(2, 2), optimizer, max_norm=1.0, norm_type=1.0)
    with pytest.raises(TypeError, match="filter"):
        strategy.save_checkpoint("x", {}, filter={"model": lambda k, v: True})
    with pytest.raises(ValueError, match="state=None"):
        strategy.load_checkpoint("x", None)
    strategy._module = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="one model per Fabric"):
        strategy.setup_module(nn.Linear(2, 2))
    # the model is set up (fabric.setup_module keeps it)
    with pytest.raises(ValueError, match="not the set-up model's"):
        strategy.setup_optimizer(optimizer)


@pytest.mark.deepspeed
def test_deepspeed_engine_needs_joint_setup_and_clips_inside_its_step():
    strategy = ShardFabricStrategy(stage=2, engine="deepspeed")
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    strategy._module = module
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model, optimizer\)"):
        strategy.setup_optimizer(optimizer)
    with pytest.raises(ValueError, match="clip_val=.*engine='fsdp'"):
        strategy.clip_gradients_value(module, optimizer, clip_val=1.0)
    with pytest.raises(ValueError, match="max_norm=.*engine='fsdp'"):
        strategy.clip_gradients_norm(module, optimizer, max_norm=1.0)


def test_an_optimizer_built_before_setup_is_pointed_at_the_new_parameters_by_name():
    before, after = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD(before.parameters(), lr=0.1)
    names = parameter_names(before)
    rebind(optimizer, names, dict(after.named_parameters()))
    assert optimizer.param_groups[0]["params"] == list(after.parameters())
    with pytest.raises(ValueError, match="not the model's"):
        rebind(optimizer, {}, dict(after.named_parameters()))
    stepped = torch.optim.Adam(before.parameters())
    before(torch.ones(1, 2)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="already stepped"):
        rebind(stepped, names, dict(after.named_parameters()))
    # Pipeline stages cut the other stages' parameters away: they leave the optimizer too; without a cut, a
    # parameter gone from the model is an error.
    partial = torch.optim.SGD(before.parameters(), lr=0.1)
    kept = {"weight": after.weight}
    with pytest.raises(ValueError, match="'bias' the optimizer holds is gone from the model"):
        rebind(partial, names, kept)
    rebind(partial, names, kept, cut=True)
    assert partial.param_groups[0]["params"] == [after.weight]
    # A tied parameter is found under whichever of its names the stage kept (the head's, on the last stage).
    tied = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
    tied[1].weight = tied[0].weight
    last = nn.Sequential(nn.Identity(), nn.Linear(2, 4, bias=False))
    shared = torch.optim.SGD(tied.parameters(), lr=0.1)
    rebind(shared, parameter_names(tied), dict(last.named_parameters()), cut=True)
    assert shared.param_groups[0]["params"] == [last[1].weight]


def test_a_fabric_state_maps_onto_the_trainer_checkpoint_layout():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    key, optimizers, others = _checkpoint.split_state({"model": model, "opt": optimizer, "step": 3}, model)
    assert (key, optimizers, others) == ("model", [("opt", optimizer)], {"step": 3})
    checkpoint = _checkpoint.to_checkpoint({"w": 1}, [{"s": 2}], others)
    assert checkpoint["state_dict"] == {"w": 1} and checkpoint["optimizer_states"] == [{"s": 2}]
    assert checkpoint["step"] == 3 and "pytorch-lightning_version" in checkpoint
    with pytest.raises(ValueError, match="exactly one model"):
        _checkpoint.split_state({"model": model, "other": other}, model)
    with pytest.raises(ValueError, match="'state_dict'.*Rename"):
        _checkpoint.split_state({"model": model, "state_dict": 1}, model)
    state = {"model": model, "step": 0, "epoch": 0}
    with pytest.raises(KeyError, match="'epoch'.*strict=False"):
        _checkpoint.restore_entries(state, {"step": 0, "epoch": 0}, {"step": 5}, strict=True)
    remaining = _checkpoint.restore_entries(
        state, {"step": 0, "epoch": 0}, {"step": 5, "extra": 1}, strict=False
    )
    assert state["step"] == 5 and remaining == {"extra": 1}
