"""``core.transform.prepare`` is the only place of the transform order: a step patched there is reached from both
doors (the Trainer's ``ShardStrategy`` and ``ShardFabricStrategy``) and both engines (FSDP2 and DeepSpeed), and
runs before the engine's data-parallel wrap."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard import ShardFabricStrategy, ShardStrategy
from lightning_shard.core import transform
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

CASES = [
    ("trainer", "fsdp", 3),
    ("fabric", "fsdp", 2),
    ("trainer", "deepspeed", 2),
    ("fabric", "deepspeed", 1),
]


def _through_prepare() -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    original = transform.apply_compile

    def recording(module: nn.Module, config: Any, engine: Any) -> None:
        # What the step sees: the module before the engine's data-parallel wrap, and the engine's class.
        wrapped = any(type(m).__name__.startswith("FSDP") for m in module.modules())
        seen.append({"engine": type(engine).__name__, "wrapped": wrapped, "compile": config.compile})
        original(module, config, engine)

    transform.apply_compile = recording  # type: ignore[assignment]
    results = []
    try:
        for door, engine, stage in CASES:
            seen.clear()
            if door == "trainer":
                trainer = L.Trainer(
                    devices=1,
                    strategy=ShardStrategy(stage=stage, engine=engine),
                    **trainer_kwargs(max_steps=1),
                )
                trainer.fit(tiny_gpt(), loader(4))
            else:
                fabric = L.Fabric(
                    accelerator="cpu", devices=1, strategy=ShardFabricStrategy(stage=stage, engine=engine)
                )
                fabric.launch()
                model = tiny_gpt()
                fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            results.append({"case": (door, engine, stage), "seen": list(seen)})
    finally:
        transform.apply_compile = original  # type: ignore[assignment]
    return results


def test_both_doors_and_both_engines_reach_the_transforms_through_prepare():
    (results,) = run_ranks(_through_prepare, world_size=1)
    engines = {"fsdp": "FSDPEngine", "deepspeed": "DeepSpeedEngine"}
    for result, (door, engine, stage) in zip(results, CASES, strict=True):
        assert result["case"] == (door, engine, stage)
        assert [s["engine"] for s in result["seen"]] == [engines[engine]], result
        assert not result["seen"][0]["wrapped"], result  # before FSDP2 / DeepSpeed wrap the module
