"""``core.transform.prepare`` is the only place of the transform order: a step patched there is reached from both
doors (the Trainer's ``ShardStrategy`` and ``ShardFabricStrategy``) and both engines (FSDP2 and DeepSpeed), and
runs before the engine's data-parallel wrap. The steps after it are the session's: backward, the optimizer step,
save and load, patched on ``core.Session``, are reached from both doors and both engines too."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_shard import ShardFabricStrategy, ShardStrategy
from lightning_shard.core import Session, transform
from lightning_shard.demos.ranks import run_ranks
from tests.helpers import loader, tiny_gpt, trainer_kwargs

pytestmark = pytest.mark.multirank

CASES = [
    ("trainer", "fsdp", 3),
    ("fabric", "fsdp", 2),
    ("trainer", "deepspeed", 2),
    ("fabric", "deepspeed", 1),
]


#: The session's steps each door must reach (the engine's own step under DeepSpeed, Lightning's otherwise).
SESSION_STEPS = ("backward", "engine_step", "save", "load", "model_state")


def _recording_session(calls: list[str]) -> dict[str, Any]:
    originals = {name: getattr(Session, name) for name in SESSION_STEPS}
    for name, original in originals.items():

        def recorded(
            self: Session, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any
        ) -> Any:
            calls.append(_name)
            return _original(self, *args, **kwargs)

        setattr(Session, name, recorded)
    return originals


def _run_case(door: str, engine: str, stage: int, root: str) -> None:
    path = f"{root}/{door}-{engine}.ckpt"
    if door == "trainer":
        strategy = ShardStrategy(stage=stage, engine=engine)
        trainer = L.Trainer(devices=1, strategy=strategy, **trainer_kwargs(max_steps=1))
        trainer.fit(tiny_gpt(), loader(4))
        trainer.save_checkpoint(path)
        trainer.strategy.load_checkpoint(path)
        return
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ShardFabricStrategy(stage=stage, engine=engine))
    fabric.launch()
    model = tiny_gpt()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ids = torch.randint(0, 64, (2, 16))
    fabric.backward(torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()))
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer})
    fabric.load(path, {"model": model, "optimizer": optimizer})


def _through_prepare(root: str) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    calls: list[str] = []
    original = transform.apply_compile

    def recording(module: nn.Module, config: Any, engine: Any) -> None:
        # What the step sees: the module before the engine's data-parallel wrap, and the engine's class.
        wrapped = any(type(m).__name__.startswith("FSDP") for m in module.modules())
        seen.append({"engine": type(engine).__name__, "wrapped": wrapped, "compile": config.compile})
        original(module, config, engine)

    transform.apply_compile = recording  # type: ignore[assignment]
    originals = _recording_session(calls)
    results = []
    try:
        for door, engine, stage in CASES:
            seen.clear()
            calls.clear()
            _run_case(door, engine, stage, root)
            results.append({"case": (door, engine, stage), "seen": list(seen), "calls": sorted(set(calls))})
    finally:
        transform.apply_compile = original  # type: ignore[assignment]
        for name, method in originals.items():
            setattr(Session, name, method)
    return results


def test_both_doors_and_both_engines_reach_the_transforms_through_prepare(tmp_path):
    (results,) = run_ranks(_through_prepare, str(tmp_path), world_size=1)
    engines = {"fsdp": "FSDPEngine", "deepspeed": "DeepSpeedEngine"}
    for result, (door, engine, stage) in zip(results, CASES, strict=True):
        assert result["case"] == (door, engine, stage)
        assert [s["engine"] for s in result["seen"]] == [engines[engine]], result
        assert not result["seen"][0]["wrapped"], result  # before FSDP2 / DeepSpeed wrap the module
        # Every step after set-up goes through the session: the engine's own optimizer step under DeepSpeed only.
        expected = set(SESSION_STEPS) - ({"engine_step"} if engine == "fsdp" else set())
        assert set(result["calls"]) == expected, result
